"""kvtier's side of a store's hints (`Store.hint`): which pages are leased until when, on
kvtier's clock, and their eviction priority. A store carries them by its own means (the
file store's eviction order, Redis TTLs, S3 tags); this table decides, never the store's
trust: a lease past its end on the clock is no lease, whatever a TTL or a tag still says.

Only hinted pages are in it: a page with no lease and priority 0 is a plain page and
leaves the table. A store uses it from its loop thread only.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class Hint:
    until: float | None  # the lease's end on the clock; None: no lease
    priority: int = 0


class Leases:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.hints: dict[str, Hint] = {}
        self._ends: list[
            tuple[float, str]
        ] = []  # (until, key): a lease to look at then

    def __len__(self) -> int:
        return len(self.hints)

    def __contains__(self, key: str) -> bool:
        return key in self.hints

    def get(self, key: str) -> Hint | None:
        return self.hints.get(key)

    def apply(
        self, key: str, lease_s: float | None, priority: int | None
    ) -> Hint | None:
        """Lease `key` for `lease_s` from now (None: release) at `priority` (None: the
        priority it has, 0 where none); its entry, or None where it is a plain page now."""
        until = None if lease_s is None else self.clock() + lease_s
        if priority is None:
            hint = self.hints.get(key)
            priority = 0 if hint is None else hint.priority
        return self.put(key, until, priority)

    def put(self, key: str, until: float | None, priority: int) -> Hint | None:
        if until is None and priority == 0:
            self.hints.pop(key, None)
            return None
        hint = self.hints[key] = Hint(until, priority)
        if until is not None:
            heapq.heappush(self._ends, (until, key))
            if len(self._ends) > 2 * len(self.hints) + 64:  # renewed, released: stale
                self._ends = [
                    (h.until, k) for k, h in self.hints.items() if h.until is not None
                ]
                heapq.heapify(self._ends)
        return hint

    def leased(self, key: str) -> bool:
        hint = self.hints.get(key)
        return hint is not None and hint.until is not None and hint.until > self.clock()

    def remaining(self, key: str) -> float:
        """Seconds left of `key`'s lease (0 where none)."""
        hint = self.hints.get(key)
        if hint is None or hint.until is None:
            return 0.0
        return max(0.0, hint.until - self.clock())

    def expire(self) -> list[str]:
        """Keys whose lease ended by now: their lease is gone from the table (a priority
        stays); each returned once."""
        now, ended = self.clock(), []
        while self._ends and self._ends[0][0] <= now:
            until, key = heapq.heappop(self._ends)
            hint = self.hints.get(key)
            if hint is None or hint.until != until:
                continue  # released or leased anew since
            ended.append(key)
            self.put(key, None, hint.priority)
        return ended

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.hints.pop(key, None)

    def replace_all(self, hints: dict[str, Hint]) -> None:
        """The table as another process wrote it (the file store's shared leases)."""
        self.hints = hints
        self._ends = [(h.until, k) for k, h in hints.items() if h.until is not None]
        heapq.heapify(self._ends)
