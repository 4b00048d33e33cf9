"""prometheus_client in multiprocess mode as SGLang's processes run it
(`PROMETHEUS_MULTIPROC_DIR` set before the first metric), and a scrape of that directory
as SGLang's HTTP server does it (`MultiProcessCollector` over a fresh registry)."""

from __future__ import annotations

import pytest


@pytest.fixture
def multiproc(tmp_path, monkeypatch):
    """This process writes its metrics into a fresh multiprocess directory: prometheus_client
    chose its value class at import, so the test sets what the env variable selects."""
    from prometheus_client import values

    folder = tmp_path / "prometheus"
    folder.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    return folder


def scrape(folder) -> dict[tuple[str, tuple], float]:
    """What SGLang's /metrics serves from `folder`: (sample name, sorted labels) -> value."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }
