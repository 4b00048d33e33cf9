"""Session histories: a bounded LRU of each session's conversation so far.

A session's next turn is its history (earlier prompts and the outputs generated for them)
followed by the turn's new tokens. At most `cap` sessions are kept, least recently used
dropped first; with `ttl_s`, a session not used for that long is dropped too. Both are
counted (`stats()`). A dropped session's next turn starts an empty history: its prompt is
then only what the client sent (the KV of the old history may still be cached and hit).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class Histories:
    def __init__(
        self,
        cap: int = 4096,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"sessions cap={cap!r}: must be an integer >= 1")
        if ttl_s is not None and not (
            isinstance(ttl_s, (int, float))
            and not isinstance(ttl_s, bool)
            and ttl_s > 0
        ):
            raise ValueError(
                f"session ttl_s={ttl_s!r}: must be a number of seconds > 0 (or none)"
            )
        self.cap, self.ttl_s, self.clock = cap, ttl_s, clock
        self._entries: OrderedDict[str, tuple[float, list[int]]] = (
            OrderedDict()
        )  # LRU first
        self.evicted = 0  # dropped for the cap
        self.expired = 0  # dropped for the TTL

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session: str) -> list[int]:
        """The session's history (empty if unknown, dropped or expired)."""
        self._expire()
        entry = self._entries.get(session)
        return [] if entry is None else entry[1]

    def put(self, session: str, tokens: list[int]) -> None:
        self._entries.pop(session, None)
        self._entries[session] = (self.clock(), tokens)
        while len(self._entries) > self.cap:
            self._entries.popitem(last=False)
            self.evicted += 1
        self._expire()

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        limit = self.clock() - self.ttl_s
        while self._entries:
            session, (used, _) = next(iter(self._entries.items()))
            if used > limit:
                break
            del self._entries[session]
            self.expired += 1

    def stats(self) -> dict:
        self._expire()
        return {
            "sessions": len(self._entries),
            "sessions_cap": self.cap,
            "session_ttl_s": self.ttl_s,
            "sessions_evicted": self.evicted,
            "sessions_expired": self.expired,
            "session_history_tokens": sum(len(t) for _, t in self._entries.values()),
            "session_id_bytes": sum(
                len(s.encode("utf-8", "surrogatepass")) for s in self._entries
            ),
        }
