"""The linker's store calls in flight and what each holds on the host tier.

| state | what it holds | until |
|---|---|---|
| a store write (`backups`) | a pin on each of its published pages | it settled (`reap`) |
| an orphaned read (`orphans`) | its reserved host pages | the read settled (`reap`) |
| a quarantined read | its reserved host pages, for good | never: a stuck thread may write them |
| an unreadable key | nothing: a lookup stops before it | a write of it succeeds, or it ages out |

Scheduler thread only; the calls themselves run on the storage thread (`store_io.py`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from itertools import compress

import numpy as np

from kvtier.storeio.ops import BackupOp
from kvtier.integrations.sglang.linker.host_index import HostIndex
from kvtier.integrations.sglang.linker.metrics import LinkerCounters
from kvtier.integrations.sglang.linker.store_io import LinkerStore, StoreRead

log = logging.getLogger(__name__)
UNREADABLE = 4096  # store pages remembered as not verifying (the newest ones)


class StoreOps:
    """The one owner of the linker's store calls: `l3` is None without a store (every
    call is then a no-op or a miss)."""

    def __init__(
        self,
        l3: LinkerStore | None,
        index: HostIndex,
        counters: LinkerCounters,
        page_bytes: int,
        writes_store: bool,
    ) -> None:
        self.l3, self.index, self.counters = l3, index, counters
        self.page_bytes, self.writes_store = page_bytes, writes_store
        self.backups: list[
            tuple[BackupOp, list[str], list[str], np.ndarray]
        ] = []  # (op, pinned keys, its keys, their host pages)
        # store pages that did not verify when read: a lookup stops before them until a
        # write of the page succeeds (else every request on that prefix would fail its load)
        self.unreadable: OrderedDict[str, None] = OrderedDict()
        self.orphans: list[
            tuple[StoreRead, np.ndarray]
        ] = []  # ended reads whose pages wait to settle
        self.quarantined: list[
            np.ndarray
        ] = []  # pages of abandoned store reads: never reused

    # -- writes --------------------------------------------------------------------------------

    def offloaded(
        self,
        copied: list[str],
        keys: list[str],
        pages: np.ndarray,
        contiguous: bool = False,
    ) -> None:
        """An offload that copied `copied` published `keys` (`pages`) on host: a rank that
        does not write the store forgets they were unreadable (the writing rank forgets
        once stored, in `reap`); the writing rank stores them (pinned until settled).
        `contiguous`: `keys` are one run of their sequence, in order."""
        if self.unreadable and not self.writes_store:
            for k in copied:
                self.unreadable.pop(k, None)
        if self.l3 is None or not self.writes_store or not keys:
            return
        pinned = self.index.pin_fresh(keys, pages)
        self.backups.append(
            (self.l3.write(keys, pages, contiguous), pinned, keys, pages)
        )

    def reap(self) -> None:
        """Settle what the storage thread finished: store writes unpin their pages, ended
        reads give theirs back."""
        if self.backups:
            still = []
            for entry in self.backups:
                op, pinned, keys, pages = entry
                if not op.finished:
                    still.append(entry)
                    continue
                self.index.unpin(pinned, pages if pinned == keys else None)
                if self.unreadable:  # a page stored again verifies again
                    for k in compress(keys, op.ok or []):
                        self.unreadable.pop(k, None)
                good = sum(op.ok or [])
                self.counters.l3_write_pages += good
                self.counters.l3_write_bytes += good * self.page_bytes
                self.counters.l3_write_failures += len(op.keys) - good
            self.backups = still
        if self.orphans:
            still = []
            for read, pages in self.orphans:
                if (
                    read.settled and read.abandoned
                ):  # a stuck thread may still write them
                    self.quarantined.append(pages)
                elif read.settled:
                    self.index.release(pages)
                else:
                    still.append((read, pages))
            self.orphans = still

    # -- reads ---------------------------------------------------------------------------------

    def leading_run(self, keys: Sequence[str], limit: int | None = None) -> int:
        """The store's leading run of `keys` (at most `limit`), stopped before a page known
        not to verify."""
        stored = self.l3.leading_run(keys, limit)
        if not self.unreadable:
            return stored
        return next(
            (i for i, k in enumerate(keys[:stored]) if k in self.unreadable), stored
        )

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether the store holds each of `keys`, a page known not to verify as absent."""
        held = self.l3.present(keys)
        unreadable = self.unreadable
        return [h and k not in unreadable for k, h in zip(keys, held)]

    def read(
        self,
        keys: Sequence[str],
        pages: np.ndarray,
        around: tuple[Sequence[str], list[int]] | None = None,
    ) -> StoreRead:
        return self.l3.read(keys, pages, around)

    def wait(self, read: StoreRead, seconds: float) -> bool:
        return self.l3.wait(read, seconds)

    def end_read(self, read: StoreRead, keys: list[str], pages: np.ndarray) -> None:
        """A load stopped with its store read of `keys` into reserved `pages`: verified,
        they become host pages; else they go back once the read has settled."""
        if read.finished and read.landed == len(read.keys):  # verified: host pages now
            self.index.publish(keys, pages)
            return
        if (
            read.finished and read.answered
        ):  # the store answered, and this page was missing or bad
            self._mark_unreadable(keys[read.landed])
        self.orphans.append((read, pages))
        self.reap()

    def _mark_unreadable(self, key: str) -> None:
        self.counters.l3_read_failures += 1
        self.unreadable[key] = None
        self.unreadable.move_to_end(key)
        while len(self.unreadable) > UNREADABLE:
            self.unreadable.popitem(last=False)

    # -- lifecycle and checks ------------------------------------------------------------------

    def quiesce(self) -> None:
        """Every store call has ended (bounded by the store's timeouts) and been reaped."""
        if self.l3 is not None:
            self.l3.drain()
            for read, _ in self.orphans:
                self.l3.wait(read, 4 * self.l3.timeout_s, settled=True)
        self.reap()

    def running(self) -> int:
        """Store calls that still hold host pages."""
        return len(self.backups) + len(self.orphans)

    def close(self) -> None:
        if self.l3 is not None:
            self.l3.close()

    def reserved(self) -> list[int]:
        """The reserved host pages these calls hold (orphaned and quarantined reads)."""
        owned: list[int] = []
        for pages in [p for _, p in self.orphans] + self.quarantined:
            owned += pages.tolist()
        return owned

    def pinned(self) -> list[list[str]]:
        """The keys each store write pinned."""
        return [p for _, p, _, _ in self.backups]

    def quarantined_pages(self) -> int:
        return sum(p.size for p in self.quarantined)

    def stats(self) -> dict:
        return {} if self.l3 is None else self.l3.stats()
