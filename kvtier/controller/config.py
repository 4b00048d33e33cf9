"""Controller policies and limits."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvtier.storeio.breaker import BreakerConfig
from kvtier.storeio.cpus import parse_cpu_list


class WritePolicy(str, Enum):
    WRITE_THROUGH = "write_through"  # back up on insert
    WRITE_THROUGH_SELECTIVE = (
        "write_through_selective"  # back up once hit_count >= threshold
    )
    WRITE_BACK = "write_back"  # back up when evicted from device


class PrefetchPolicy(str, Enum):
    BEST_EFFORT = "best_effort"  # take what has landed when the request is scheduled
    WAIT_COMPLETE = "wait_complete"  # wait for the whole prefetch
    TIMEOUT = "timeout"  # wait up to base + per-1k-token budget (capped)


@dataclass(slots=True, frozen=True)
class ControllerConfig:
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_threshold: int = 2
    storage_backup: bool = True  # back host pages up to the store
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    prefetch_timeout_base_s: float = 0.2
    prefetch_timeout_per_1k_tokens_s: float = 0.1
    prefetch_timeout_max_s: float = 2.0
    prefetch_min_tokens: int = 1
    max_inflight_prefetch_bytes: int = 256 << 20
    load_back_min_tokens: int = 1
    # an allocation that finds its tier short evicts this fraction of the tier beyond what
    # it needs, so evictions come in batches, not one pass per allocation (docs/design.md §4)
    evict_headroom: float = 0.03
    consensus_check: bool = False
    store_down_after_failures: int = 3  # consecutive failed/timed-out store calls
    store_probe_backoff_s: float = (
        1.0  # first probe of a down store; doubles up to the max
    )
    store_probe_max_backoff_s: float = 30.0
    # CPUs for kvtier's own threads, as `taskset -c` lists them ("1-3"): keep the scheduler's
    # core out (docs/design.md §7). null: they run wherever the process may.
    cpus: str | int | None = None

    def breaker_config(self) -> BreakerConfig:
        """The store breaker's settings (every client of the store runtime uses them)."""
        return BreakerConfig(
            self.store_down_after_failures,
            self.store_probe_backoff_s,
            self.store_probe_max_backoff_s,
        )

    def __post_init__(self) -> None:
        for name in (
            "write_threshold",
            "prefetch_min_tokens",
            "max_inflight_prefetch_bytes",
            "load_back_min_tokens",
            "store_down_after_failures",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 1")
        for name in (
            "prefetch_timeout_base_s",
            "prefetch_timeout_per_1k_tokens_s",
            "prefetch_timeout_max_s",
            "store_probe_backoff_s",
            "store_probe_max_backoff_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 0")
        if not 0 <= self.evict_headroom <= 0.5:
            raise ValueError(
                f"evict_headroom={self.evict_headroom!r}: must be a fraction of the tier in [0, 0.5]"
            )
        if self.cpus is not None:
            if isinstance(self.cpus, bool) or not isinstance(self.cpus, (str, int)):
                raise ValueError(
                    f"cpus={self.cpus!r}: expected a CPU list such as '1-3,6', or null"
                )
            object.__setattr__(self, "cpus", str(self.cpus))
            parse_cpu_list(
                self.cpus
            )  # the syntax now; the CPUs against the machine's when threads start

    def prefetch_timeout(self, tokens: int) -> float:
        return min(
            self.prefetch_timeout_max_s,
            self.prefetch_timeout_base_s
            + self.prefetch_timeout_per_1k_tokens_s * tokens / 1000,
        )
