"""A circuit breaker for a sick store: fail fast instead of paying a timeout per request.

After `failures` consecutive failed or timed-out store calls the store is *down*: prefetches
and backups skip it at once (counted). One probe is let through after `backoff_s`, doubling
up to `max_backoff_s` while it keeps failing; the first success closes the breaker. A
black-hole endpoint then costs at most one timeout per probe interval, not one per request.

It lives on the storage thread; the scheduler only reads `stats()`. A caller that calls a
store from its own thread too (the vLLM tier's direct file calls) shares it: its methods
hold a lock.
Skipping ends an op as "present: 0 pages", which every rank agrees on through `poll()`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable

from kvtier.errors import StoreAbandoned

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class BreakerConfig:
    failures: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0


class Breaker:
    def __init__(
        self,
        name: str,
        config: BreakerConfig = BreakerConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.config = config
        self.clock = clock
        self.consecutive = 0
        self.down = False
        self.backoff = config.backoff_s
        self.next_probe = 0.0
        self.probing = False
        self.trips = 0
        self.skipped = 0
        self._lock = threading.RLock()

    def admit(self) -> bool:
        """May a call go to the store now? (While down: only one probe per interval.)"""
        with self._lock:
            if not self.down:
                return True
            if not self.probing and self.clock() >= self.next_probe:
                self.probing = True
                return True
            self.skipped += 1
            return False

    def succeeded(self) -> None:
        with self._lock:
            if self.down:
                log.warning(
                    "store %s answers again after %d skipped calls; using it",
                    self.name,
                    self.skipped,
                )
            self.consecutive, self.down, self.probing = 0, False, False
            self.backoff = self.config.backoff_s

    def failed(self, why: str) -> None:
        with self._lock:
            self.consecutive += 1
            if self.down:  # a failed probe: wait longer
                self.probing = False
                self.backoff = min(self.backoff * 2, self.config.max_backoff_s)
                self.next_probe = self.clock() + self.backoff
            elif self.consecutive >= self.config.failures:
                self.down, self.trips = True, self.trips + 1
                self.next_probe = self.clock() + self.backoff
                log.error(
                    "store %s is down after %d failed calls (last: %s); skipping it, probing every %.1fs+",
                    self.name,
                    self.consecutive,
                    why,
                    self.backoff,
                )

    def abandoned(self, outcome) -> bool:
        """Did the call whose `settled` gave `outcome` get abandoned, its threads stuck (a
        hung mount)? Then the store is down now, without waiting for more failures."""
        with self._lock:
            if not isinstance(outcome, StoreAbandoned):
                return False
            while not self.down:
                self.failed(str(outcome))
            return True

    def stats(self) -> dict:
        return {
            "store_down": self.down,
            "breaker_trips": self.trips,
            "calls_skipped_store_down": self.skipped,
        }
