"""Store-call ops: an op's lifetime is one `Phase`, written by the store loop's thread only.

    QUEUED -> RUNNING -> FINISHED -> SETTLED
                                  -> ABANDONED

FINISHED is the logical end (nothing more is learnt: no page lands past what landed);
SETTLED is when the store has really stopped touching the op's buffers (a call that timed
out may still write them from a thread until then); ABANDONED is settled with its call's
threads given up on stuck (a hung mount) while it could still write the op's pages: those
pages stay out of use for good. An op that ends at once (nothing was in flight) goes
straight to SETTLED. Every reader sees one phase at a time: a single attribute store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

import numpy as np


class Phase(Enum):
    QUEUED = 0  # made, not yet picked up by the store loop
    RUNNING = 1
    FINISHED = 2  # the logical end; its buffers may still be written (not settled)
    SETTLED = 3  # the store stopped touching its buffers
    ABANDONED = 4  # settled, but its stuck threads may still write its pages


@dataclass(eq=False)
class StoreOp:
    """What every op on the store loop has: its phase (`StoreLoop.finish` and `settle`
    move it) and what its readers ask of it."""

    phase: Phase = field(default=Phase.QUEUED, kw_only=True)

    @property
    def finished(self) -> bool:
        return self.phase.value >= Phase.FINISHED.value

    @property
    def settled(self) -> bool:
        return self.phase.value >= Phase.SETTLED.value

    @property
    def abandoned(self) -> bool:
        return self.phase is Phase.ABANDONED

    def writes_pages(self) -> bool:
        """Could a call of this op given up on stuck still write pages of its own? (Then it
        ends ABANDONED, not SETTLED.) A write only reads its pages."""
        return False


class PageKeys(Sequence):
    """The store keys of `count` pages, made on first use by the storage thread from their
    hashes — given, or computed then by `hashing()` (a prefetch's chain over the prompt):
    keying and hashing stay off the scheduler thread. `hashes` stays None until computed;
    the scheduler only reads it (one attribute store, under the GIL). `first`: the page's
    index in its sequence of the first key (where store pages of several pages start:
    `controller/store_pages.py`)."""

    __slots__ = ("hashes", "count", "key_of", "first", "_hashing", "_keys")

    def __init__(
        self,
        hashes: list[bytes] | Callable[[], list[bytes]],
        key_of: Callable[[bytes], str],
        count: int | None = None,
        first: int = 0,
    ) -> None:
        lazy = callable(hashes)
        self.hashes = None if lazy else hashes
        self._hashing = hashes if lazy else None
        self.count = len(hashes) if count is None else count
        self.key_of, self.first, self._keys = key_of, first, None

    def chain(self) -> list[bytes]:
        """The pages' hashes (computed now if they were not)."""
        if self.hashes is None:
            self.hashes = self._hashing()
        return self.hashes

    def at(self, indices: Sequence[int]) -> list[str]:
        """The keys of the pages at `indices` only."""
        chain, key_of = self.chain(), self.key_of
        return [key_of(chain[i]) for i in indices]

    def _made(self) -> list[str]:
        if self._keys is None:
            self._keys = [self.key_of(h) for h in self.chain()]
        return self._keys

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        return self._made()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._made())


Tag = TypeVar("Tag")


@dataclass(eq=False)
class BackupOp(StoreOp, Generic[Tag]):
    """Host pages to the store. `finished` only once settled: the host pages stay
    protected until the store stopped reading them."""

    keys: Sequence[str]  # a list, or PageKeys
    host_pages: np.ndarray  # page numbers
    tag: Tag
    started: float = field(default_factory=time.perf_counter)
    lead_in: np.ndarray | None = (
        None  # host pages before its first: they complete its first store page
    )
    ok: list[bool] | None = None  # per page: is it stored
    store_bytes: int = (
        0  # bytes the store took (whole store pages, `lead_in` pages among them)
    )
    deferred: int = 0  # pages past its last whole store page, left to a longer sequence (set by its maker)
    error: str | None = None
