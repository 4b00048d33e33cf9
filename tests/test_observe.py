"""PrometheusExport: kvtier's numbers copied into prometheus_client metrics of the engine's
process (docs/sglang.md, Metrics); a private registry stands in for SGLang's scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvtier.integrations.observe import PrometheusExport, flat_series


def test_counters_grow_by_what_grew_gauges_are_set_and_ticks_are_spaced():
    numbers = {"sets": 3, "store_down": False, "store": "file"}
    now = [100.0]
    registry = CollectorRegistry()
    export = PrometheusExport(
        lambda: flat_series("kvtier_storage", numbers),
        {"tp_rank": "0"},
        interval_s=5.0,
        registry=registry,
        clock=lambda: now[0],
    )

    def value(name):
        return registry.get_sample_value(name, {"tp_rank": "0"})

    export.tick()  # the first tick exports
    assert value("kvtier_storage_sets_total") == 3
    assert value("kvtier_storage_store_down") == 0
    numbers.update(sets=5, store_down=True)
    now[0] += 4.9
    export.tick()  # within the interval: nothing read
    assert value("kvtier_storage_sets_total") == 3
    now[0] += 0.1
    export.tick()
    assert value("kvtier_storage_sets_total") == 5
    assert value("kvtier_storage_store_down") == 1
    numbers["sets"] = 2  # the source started over (a reset): counted as new
    export.export()
    assert value("kvtier_storage_sets_total") == 7
    assert registry.get_sample_value("kvtier_storage_store") is None  # not a number


def test_a_failing_read_never_fails_the_engines_call(caplog):
    def broken():
        raise RuntimeError("stats went away")

    PrometheusExport(broken, {}, registry=CollectorRegistry()).tick()
    assert "reading stats for the engine's metrics failed" in caplog.text
