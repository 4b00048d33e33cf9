"""kvtier inside a running SGLang: the storage backend's start-up line, and its counters
on SGLang's own /metrics in the multiprocess mode SGLang runs (--enable-metrics)."""

from __future__ import annotations

import logging

import kvtier
from tests.integrations.prom_multiproc import multiproc, scrape  # noqa: F401
from tests.integrations.test_sglang import (  # noqa: F401  (sg: the fixture)
    attach,
    fill,
    make_pool,
    page_keys,
    sg,
    write_yaml,
)


def test_the_storage_backend_logs_one_start_line_and_reaches_sglangs_metrics(
    sg,  # noqa: F811
    multiproc,  # noqa: F811
    tmp_path,
    caplog,
):
    """Its counters never reached SGLang's metrics endpoint and its start-up line named
    neither kvtier's version, the tenant key id nor the tiers."""
    caplog.set_level(logging.INFO, logger="kvtier.integrations.sglang")
    path = write_yaml(tmp_path, {"backend": "file", "root": str(tmp_path / "l3")})
    pool = make_pool(sg, "mha", "page_first")
    backend = attach(sg, pool, path, tp_rank=0)
    ns = backend.namespace.id
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("kvtier ")
    ]
    assert lines == [
        f"kvtier {kvtier.__version__} SGLang storage backend: store file (kvtier), "
        f"namespace {ns}, tenant key none, tiers SGLang device -> SGLang host "
        f"({backend.namespace.dtype}, {pool.page_size} tokens and {backend.page_bytes} "
        "B/page) -> kvtier store file"
    ]
    keys = page_keys(3)
    assert backend.batch_set_v1(keys, fill(pool, 3, seed=1)) == [True] * 3
    assert backend.batch_exists(keys + page_keys(1)) == 3
    backend.close()  # its last numbers are exported as it closes
    got = scrape(multiproc)
    labels = (("namespace", ns), ("tp_rank", "0"))
    assert got[("kvtier_storage_set_ok_total", labels)] == 3
    assert got[("kvtier_storage_set_pages_total", labels)] == 3
    assert got[("kvtier_storage_sets_total", labels)] == 3
    assert got[("kvtier_storage_store_down", labels)] == 0
    assert got[("kvtier_storage_breaker_trips_total", labels)] == 0
