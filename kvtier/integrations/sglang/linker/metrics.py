"""The linker's numbers: counters (a dict, and Prometheus metrics read at scrape time).

Names follow kvtier's collector (controller/stats.py): counters `kvtier_linker_<name>`,
gauges `kvtier_linker_host_<name>`, `kvtier_linker_queue_<name>`, `kvtier_linker_store_<name>`.
docs/sglang.md says what each one means.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class LinkerCounters:
    lookups: int = 0
    lookup_pages: int = 0  # pages SGLang asked about (its device-uncached tail)
    host_hit_pages: int = 0  # of those, restorable from the host tier
    store_hit_pages: int = 0  # of those, restorable from the store only
    lookup_store_skipped: int = 0  # lookups that did not ask the store: breaker down
    lookup_store_errors: int = (
        0  # store lookups that failed or timed out (host-only answers)
    )
    offloads: int = 0
    offload_pages: int = 0  # pages copied device -> host
    offload_failures: int = 0
    offload_no_host_room_pages: int = 0
    d2h_bytes: int = 0
    l3_write_pages: int = 0
    l3_write_bytes: int = 0
    l3_write_failures: int = 0  # pages the store did not take (they stay host-only)
    loads: int = 0
    load_pages: int = 0
    load_failures: int = (
        0  # load batches that failed closed (SGLang aborts their requests)
    )
    loads_cancelled: int = 0
    h2d_bytes: int = 0
    l3_read_pages: int = 0
    l3_read_bytes: int = 0
    l3_read_failures: int = (
        0  # store pages that did not verify when read (the load failed closed)
    )

    def as_dict(self) -> dict:
        out = asdict(self)
        out["miss_pages"] = (
            self.lookup_pages - self.host_hit_pages - self.store_hit_pages
        )
        return out


class LinkerCollector:
    """A prometheus_client collector over a linker's `stats()` (register it on a
    CollectorRegistry; SGLang's own metrics are untouched)."""

    def __init__(self, linker) -> None:
        self.linker = linker

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.linker.stats()
        for name, value in stats["counters"].items():
            yield CounterMetricFamily(
                f"kvtier_linker_{name}",
                f"kvtier linker {name.replace('_', ' ')}",
                value=value,
            )
        for group in ("host", "queues", "store"):
            prefix = "queue" if group == "queues" else group
            for name, value in stats.get(group, {}).items():
                if isinstance(value, (int, float)):  # a bool (store_down) is 0 or 1
                    yield GaugeMetricFamily(
                        f"kvtier_linker_{prefix}_{name}",
                        f"kvtier linker {prefix} {name.replace('_', ' ')}",
                        value=value,
                    )
