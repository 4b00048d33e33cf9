"""Counters and latency histograms of a cache, as a dict and as Prometheus metrics."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field

BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_S) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def as_dict(self) -> dict:
        return {
            "count": self.count,
            "sum_s": self.sum,
            "buckets": dict(zip([*map(str, BUCKETS_S), "+Inf"], self.cumulative())),
        }

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out


@dataclass(slots=True)
class Counters:
    lookup_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    l3_write_bytes: int = 0
    l3_write_pages: int = 0
    l3_write_failures: int = 0
    l3_read_bytes: int = 0
    l3_read_pages: int = 0
    device_evicted_tokens: int = 0
    host_evicted_tokens: int = 0
    writes: int = 0
    writes_skipped_no_host_space: int = 0
    write_failures: int = 0
    loads: int = 0
    load_failures: int = 0
    aborts: int = 0
    apply_errors: int = 0
    prefetches: int = 0
    prefetch_stopped_early: int = 0
    prefetch_timed_out: int = 0
    prefetch_errors: int = 0
    prefetch_skipped_store_down: int = 0
    prefetch_skipped_slow: int = (
        0  # loads expected slower than recomputing (controller/speed.py)
    )
    polls: int = 0
    polls_idle: int = 0  # of those: nothing had moved since the last one, so none was read (completions.py)
    polls_deferred: int = 0  # of those: only copies or backups had finished; left for a later poll (completions.py)


@dataclass
class CacheStats:
    counters: Counters = field(default_factory=Counters)
    latency: dict[str, Histogram] = field(
        default_factory=lambda: {
            k: Histogram() for k in ("write", "load", "prefetch", "backup")
        }
    )

    def as_dict(self) -> dict:
        c = self.counters
        out = asdict(c)
        out["miss_tokens"] = (
            c.lookup_tokens
            - c.device_hit_tokens
            - c.host_hit_tokens
            - c.storage_hit_tokens
        )
        out["latency"] = {k: h.as_dict() for k, h in self.latency.items()}
        return out


# the KV event publisher's numbers that are levels now; the others only grow
EVENT_GAUGES = frozenset(
    (
        "queued",
        "unsent",
        "buffered",
        "subscriptions_held",
        "replays_open",
        "replays_unread_bytes",
    )
)


class PrometheusCollector:
    """Registered on a cache's own CollectorRegistry; reads `stats()` at scrape time."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        stats = self.cache.stats()
        for name, value in stats["counters"].items():
            if isinstance(value, (int, float)) and name != "latency":
                yield CounterMetricFamily(
                    f"kvtier_{name}", f"kvtier {name.replace('_', ' ')}", value=value
                )
        for tier, sizes in stats["tiers"].items():
            for name, value in sizes.items():
                yield GaugeMetricFamily(
                    f"kvtier_{tier}_{name}",
                    f"kvtier {tier} {name.replace('_', ' ')}",
                    value=value,
                )
        for name, value in stats["queues"].items():
            yield GaugeMetricFamily(
                f"kvtier_queue_{name}",
                f"kvtier queue {name.replace('_', ' ')}",
                value=value,
            )
        for name, value in stats.get("store", {}).items():
            if isinstance(value, (int, float)):  # a bool (store_down) is 0 or 1
                yield GaugeMetricFamily(
                    f"kvtier_store_{name}",
                    f"kvtier store {name.replace('_', ' ')}",
                    value=value,
                )
        for name, value in stats.get("events", {}).items():  # docs/events.md
            family = GaugeMetricFamily if name in EVENT_GAUGES else CounterMetricFamily
            yield family(
                f"kvtier_events_{name}",
                f"kvtier events {name.replace('_', ' ')}",
                value=value,
            )
        for op, h in self.cache.stats_obj.latency.items():
            buckets = [(str(b), c) for b, c in zip(BUCKETS_S, h.cumulative())] + [
                ("+Inf", h.count)
            ]
            yield HistogramMetricFamily(
                f"kvtier_{op}_latency_seconds",
                f"kvtier {op} latency",
                buckets=buckets,
                sum_value=h.sum,
            )
