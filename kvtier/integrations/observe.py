"""What an engine's operator sees of kvtier inside SGLang or vLLM: one start-up line in the
engine's log, and kvtier's counters on the engine's own metrics endpoint.

SGLang (`--enable-metrics`) runs prometheus_client in multiprocess mode: its launcher sets
`PROMETHEUS_MULTIPROC_DIR` before the scheduler processes start, every metric those
processes create writes its value to a file there, and the HTTP server's `/metrics`
serves what `MultiProcessCollector` reads back. A collector registered in a scheduler
process is never read, so `PrometheusExport` copies kvtier's numbers into metrics of the
scheduler process instead (counters by their increase, gauges by value), at most once per
`interval_s`, from a call the engine makes anyway. vLLM takes a tier's numbers through its
own hooks instead (`kvtier/integrations/vllm/metrics.py`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

import kvtier

log = logging.getLogger(__name__)

# Monotonic numbers among the flat stats of the storage backend and the vLLM tier (the
# adapters' own, the store's StoreCounters, the breaker's); any other number is a gauge.
COUNTERS = frozenset(
    {
        "get_pages", "get_ok", "set_pages", "set_ok",
        "store_jobs", "store_keys", "store_ok", "load_jobs", "load_keys", "load_ok",
        "probes", "probe_keys", "lookup_hits", "lookup_misses", "lookup_retries",
        "exists_calls", "sets", "set_failures", "set_bytes", "gets", "hits", "misses",
        "get_bytes", "frame_failures", "errors", "timeouts", "evictions", "deletes",
        "breaker_trips", "calls_skipped_store_down", "disk_full_evictions", "touched",
    }
)  # fmt: skip

Series = dict[str, tuple[str, float]]  # metric name -> ("counter" | "gauge", value)


def startup_line(
    integration: str,
    config,
    namespace_id: str,
    tenant_key_id: str | None,
    tiers: str,
) -> str:
    """The one line an adapter logs when it is ready: kvtier's version, the integration,
    the store (its backend and key prefix: never a URL, which may hold a password), the
    namespace id, the tenant key id and the tiers below the engine's device memory."""
    store = config.store
    where = (
        "none" if store.backend == "none" else f"{store.backend} ({store.key_prefix})"
    )
    return (
        f"kvtier {kvtier.__version__} {integration}: store {where}, namespace "
        f"{namespace_id}, tenant key {tenant_key_id or 'none'}, tiers {tiers}"
    )


def flat_series(prefix: str, stats: Mapping) -> Series:
    """A flat stats dict (the storage backend's `kvtier_stats`, the vLLM tier's) as
    series: numbers only (a bool is 0 or 1), counters by name (COUNTERS)."""
    out: Series = {}
    for name, value in stats.items():
        if isinstance(value, (int, float)):
            kind = "counter" if name in COUNTERS else "gauge"
            out[f"{prefix}_{name}"] = (kind, float(value))
    return out


def linker_series(stats: Mapping) -> Series:
    """The linker's `stats()` under the names docs/sglang.md gives (`kvtier_linker_*`, as
    LinkerCollector serves them): its counters, and its host, queue and store gauges."""
    out: Series = {
        f"kvtier_linker_{name}": ("counter", float(value))
        for name, value in stats["counters"].items()
    }
    for group in ("host", "queues", "store"):
        prefix = "queue" if group == "queues" else group
        for name, value in stats.get(group, {}).items():
            if isinstance(value, (int, float)):
                out[f"kvtier_linker_{prefix}_{name}"] = ("gauge", float(value))
    return out


class PrometheusExport:
    """kvtier's series as prometheus_client metrics of this process, labelled `labels`.

    `tick()` re-reads `read()` when `interval_s` has passed since the last export (the
    caller's thread: the adapter calls it from a call the engine makes every step);
    `export()` re-reads now. A counter grows by what its number grew (by the number itself
    after the number went back, as after a reset). Metrics go to no registry: in
    multiprocess mode their files are what SGLang serves; `registry` is for tests."""

    def __init__(
        self,
        read: Callable[[], Series],
        labels: Mapping[str, str],
        *,
        interval_s: float = 5.0,
        registry=None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read = read
        self.labels = dict(labels)
        self.interval_s = interval_s
        self.registry = registry
        self.clock = clock
        self._metrics: dict[str, object] = {}
        self._last: dict[str, float] = {}
        self._due = clock()
        self._lock = threading.Lock()  # SGLang calls the backend from several threads

    def tick(self) -> None:
        if self.clock() >= self._due:
            self.export(wait=False)

    def export(self, wait: bool = True) -> None:
        """Re-read and update every metric; with `wait=False`, skip if another thread
        is exporting (its numbers are as fresh)."""
        if not self._lock.acquire(blocking=wait):
            return
        try:
            self._export()
        finally:
            self._lock.release()

    def _export(self) -> None:
        self._due = self.clock() + self.interval_s
        try:
            series = self.read()
        except Exception:  # metrics never fail the engine's call
            log.exception("kvtier: reading stats for the engine's metrics failed")
            return
        for name, (kind, value) in series.items():
            metric = self._metric(name, kind)
            if kind == "counter":
                last = self._last.get(name, 0.0)
                grown = value - last if value >= last else value
                if grown:
                    metric.inc(grown)
                self._last[name] = value
            else:
                metric.set(value)

    def _metric(self, name: str, kind: str):
        metric = self._metrics.get(name)
        if metric is None:
            from prometheus_client import Counter, Gauge

            doc = f"kvtier {name.replace('_', ' ')}"
            names = list(self.labels)
            if kind == "counter":
                family = Counter(name, doc, names, registry=self.registry)
            else:
                family = Gauge(
                    name,
                    doc,
                    names,
                    registry=self.registry,
                    multiprocess_mode="mostrecent",  # one writer per label set
                )
            metric = self._metrics[name] = family.labels(**self.labels)
        return metric


def sglang_export(
    read: Callable[[], Series], labels: Mapping[str, str]
) -> PrometheusExport | None:
    """An export into SGLang's metrics where SGLang runs them (`--enable-metrics` sets
    PROMETHEUS_MULTIPROC_DIR for its processes), else None: nothing would read it."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    return PrometheusExport(read, labels)
