"""The storage thread: one asyncio loop that runs every L3 call (prefetch and backup).

Ops are plain objects shared with the scheduler thread. A prefetch is two-phase:

1. storage thread: `batch_exists` -> `present` (pages the store holds, a leading run);
2. scheduler (in `poll`, agreed across ranks): makes room on host, reserves pages for
   exactly those pages, sets `host_pages` and `granted`;
3. storage thread: reads into those pages; `landed` grows by verified pages.

Every snapshot is safe to read: `host_pages` is set before `granted`, a page below
`landed` is verified and never written again. An op's `phase` (kvtier/storeio/ops.py):
FINISHED is the logical end (no page will land past `landed`); SETTLED comes when the
store has really stopped touching the op's pages: a read that timed out may still be
writing into them from a thread until then, so the scheduler frees an op's unused pages
only once it is settled. A backup is finished only once settled. Host slots are allocated
and freed by the scheduler only.

The worker keeps the cache's policy only (when to grant, back up, skip a slow store); the
loop, the breaker-guarded call and the ops' lifetime are the store runtime's (storeio/).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import TypeVar

import numpy as np

from kvtier.backends.base import Store
from kvtier.controller import store_pages
from kvtier.controller.speed import LoadSpeed
from kvtier.errors import Complaints, KvtierError
from kvtier.storeio.breaker import Breaker, BreakerConfig
from kvtier.storeio.call import lifetime, send_hint, store_call
from kvtier.storeio.loop import StoreLoop
from kvtier.storeio.ops import BackupOp, PageKeys, StoreOp
from kvtier.storeio.writes import Manifest, backup_calls, payloads, write_pages
from kvtier.tiers.mirror import HostMirror

T = TypeVar("T")

log = logging.getLogger(__name__)
CHUNK_BYTES = 8 << 20


class Outcome(Enum):
    """How a prefetch ended (set by the storage thread)."""

    RUNNING = "running"
    DONE = "done"  # every page the store holds landed
    PARTIAL = "partial"  # stopped at a miss, a page that did not verify, or fewer pages granted
    STOPPED = "stopped"  # the scheduler stopped it
    NO_SPACE = "no_space"  # no host page was granted
    ERROR = "error"
    STORE_DOWN = "store_down"  # the breaker kept it from the store
    SLOW_STORE = "slow_store"  # loading was expected slower than recomputing (speed.py)


@dataclass(eq=False)
class PrefetchOp(StoreOp):
    request_id: str
    keys: Sequence[str]  # a list, or PageKeys (made on the storage thread)
    tokens: int  # tokens the keys cover
    started: float = field(default_factory=time.perf_counter)
    # written by the scheduler, then `StorageWorker.wake` (plain flags: nothing blocks on them)
    stop: bool = False
    granted: bool = False
    wake: asyncio.Event | None = None  # the storage loop's view of `granted` / `stop`
    host_pages: np.ndarray | None = (
        None  # page numbers, set by the scheduler before `granted`
    )
    # written by the storage thread
    present: int | None = None  # pages the store holds, once batch_exists answered
    landed: int = 0
    reading: np.ndarray | None = None  # host pages a store read is filling now
    store_bytes: int = 0  # bytes read from the store that verified (whole store pages)
    outcome: Outcome = Outcome.RUNNING
    error: str | None = None
    # the scheduler's side
    inserted: int = 0
    abandoned_anywhere: bool = False  # a read of it was abandoned on some rank (agreed): its unused pages are held back

    def writes_pages(self) -> bool:
        """A read into host pages is under way: given up on stuck, it may still write them."""
        return self.reading is not None


class StorageWorker:
    """The cache's client of the store runtime: its prefetches and backups run on a store
    loop of their own, behind its breaker; never blocks the scheduler."""

    def __init__(
        self,
        store: Store,
        mirror: HostMirror,
        max_inflight_bytes: int,
        breaker: BreakerConfig = BreakerConfig(),  # noqa: B008 (frozen)
        clock=time.monotonic,
        cpus: frozenset[int] | None = None,
        manifest: tuple[str, str, dict] | None = None,
        group: int = 1,
    ) -> None:
        """`cpus`: where the loop thread runs, and so the store I/O threads it starts (cpus.py);
        `manifest`: (key prefix, namespace id, manifest) to write before the first page and
        keep written (storeio/writes.py); `group`: device pages in a store page (store_pages.py;
        the scheduler submits no op in which no store page ends)."""
        self.store = store
        self.breaker = Breaker(store.name, breaker, clock)
        self._complain = Complaints(
            log
        )  # a full disk fails every backup: not a line each
        self.keeps_page_order = (
            type(store).touch is not Store.touch
        )  # else `touch` would do nothing
        self.clock = clock
        self.speed = LoadSpeed(
            clock, probe_s=breaker.backoff_s
        )  # skip loads slower than recomputing
        self.manifest = None if manifest is None else Manifest(*manifest)
        self.mirror = mirror
        self.group = group
        pages_in_flight = max(
            1, max_inflight_bytes // (mirror.page_bytes * group)
        )  # store pages
        # a read batch of ~8 MiB: few round trips for small pages, bounded memory for big ones
        self.chunk = max(
            1, min(CHUNK_BYTES // (mirror.page_bytes * group), pages_in_flight)
        )
        slots_count = max(1, pages_in_flight // self.chunk)
        self.store_loop = StoreLoop(cpus, name="kvtier-storage")
        # hints reach the store one at a time, in the order the scheduler gave them (S3
        # reads a page's tags before it rewrites them: two at once would lose one)
        self._hints_in_order = asyncio.Lock()
        self.loop = self.store_loop.loop

        async def semaphore() -> asyncio.Semaphore:
            return asyncio.Semaphore(slots_count)

        # bounds the reads in flight (max_inflight_prefetch_bytes)
        self.read_slots = self.store_loop.run(semaphore())
        self.progress = (
            threading.Event()
        )  # set whenever a prefetch moves (an idle scheduler waits on it)
        self.moves = (
            0  # bumped after each change to a prefetch the scheduler reads (`moved`)
        )
        self.backups_moved = (
            0  # the same for a backup's end, which no request waits for
        )
        self.hinted_pages = 0  # pages the store's `hint` acted on (storage thread)
        self.hints_failed = 0

    def moved(self, backup: bool = False) -> None:
        """An op changed (its fields are written first): the scheduler's next poll reads
        them (`moves` or `backups_moved` tells it something moved). A prefetch's move also
        wakes an idle scheduler (`progress`); a backup's end does not: no request waits for
        it, and a nap it ended would poll for nothing."""
        if backup:
            self.backups_moved += 1
            return
        self.moves += 1
        self.progress.set()

    def submit_prefetch(self, op: PrefetchOp) -> None:
        self.store_loop.start(self._prefetch(op))

    def submit_backup(
        self,
        op: BackupOp,
        mirror: HostMirror | None = None,
        manifest: Manifest | None = None,
    ) -> None:
        """`mirror`, `manifest`: a side component's (a hybrid model's SWA KV or states,
        one store page a host page), in place of the cache's own."""
        self.store_loop.start(self._backup(op, mirror, manifest))

    def touch(self, keys: PageKeys) -> None:
        """Called from the scheduler thread: these pages just left host, so the store's
        copies are the ones left (`Store.touch`). Rides along with the next wake-up."""
        self.store_loop.post(lambda: self._touch_now(keys))

    def _touch_now(self, keys: PageKeys) -> None:
        if self.breaker.down:  # a hint is not worth a timeout (nor a probe)
            return
        try:
            self.store.touch(keys)
        except Exception:  # an order hint: never worth an op
            log.exception("touching %d pages in the store failed", len(keys))

    def hint(self, keys: PageKeys, lease_s: float | None, priority: int | None) -> None:
        """Called from the scheduler thread: pass an agent's hint for these pages on to the
        store (`Store.hint`), as one guarded store call. Advice: a store that is down or
        fails is counted (`hints_failed`) and logged, never waited for; `drain` waits for
        the call like any op."""
        self.store_loop.start(self._hint(keys, lease_s, priority))

    async def _hint(
        self, keys: PageKeys, lease_s: float | None, priority: int | None
    ) -> None:
        done = await send_hint(
            self.breaker,
            self.store,
            self._hints_in_order,
            list(keys),
            lease_s,
            priority,
            self._complain,
        )
        if done is None:
            self.hints_failed += 1
        else:
            self.hinted_pages += done

    def wake(self, op: PrefetchOp) -> None:
        """Called from the scheduler thread after `granted` or `stop` changed."""
        self.store_loop.post(lambda: op.wake is not None and op.wake.set())

    def call(self, call: Callable[[], Awaitable[T]]) -> Awaitable[T]:
        """One store call of an admitted op (`store_call`): a failure is raised."""
        return store_call(self.breaker, call, admitted=True)

    async def _prefetch(self, op: PrefetchOp) -> None:
        await lifetime(self.breaker, op, lambda: self._prefetch_calls(op), self.moved)

    async def _prefetch_calls(self, op: PrefetchOp) -> KvtierError | None:
        try:
            return await self._prefetch_pages(op)
        finally:
            # ended before the store said what it holds: nothing. Left unknown, the agreed
            # count would stay unknown, and a rank whose store did answer would wait for a
            # grant that never comes (docs/design.md §7)
            if op.present is None:
                op.present = 0

    async def _prefetch_pages(self, op: PrefetchOp) -> KvtierError | None:
        """Read the op's pages; returns the failure whose settling frees its pages (or None)."""
        op.wake = asyncio.Event()
        if op.granted or op.stop:
            op.wake.set()
        try:
            if not self.breaker.admit():
                op.present, op.outcome = 0, Outcome.STORE_DOWN
                return None
            asked = self.clock()
            if self.group == 1:
                present = found = await self.call(
                    lambda: self.store.batch_exists(list(op.keys))
                )
            else:
                present, found = await store_pages.exists(self, op)
            self.speed.observe_call(self.clock() - asked)
            if present and not self.speed.worth_loading(
                found * self.group,
                -(-found // self.chunk),
                present * op.tokens // len(op.keys),
            ):
                op.present, op.outcome = 0, Outcome.SLOW_STORE
                self.moved()
                return None
            op.present = present
            self.moved()
            if op.present == 0:
                op.outcome = Outcome.DONE
                return None
            if not await self._wait_grant(op):
                op.outcome = Outcome.STOPPED
                return None
            pages = op.host_pages
            if pages is None or len(pages) == 0:
                op.outcome = Outcome.NO_SPACE
                return None
            op.outcome = Outcome.DONE if len(pages) == op.present else Outcome.PARTIAL
            if self.group > 1:
                why = await store_pages.read(self, op, pages)
                if why is not None:
                    op.outcome = Outcome(why)
                return None
            for start in range(0, len(pages), self.chunk):
                if op.stop:
                    op.outcome = Outcome.STOPPED
                    return None
                chunk = pages[start : start + self.chunk]
                async with self.read_slots:
                    asked = self.clock()
                    op.reading = chunk
                    ok = await self.call(
                        partial(self._read, op.keys[start : start + len(chunk)], chunk)
                    )
                    op.reading = None
                    self.speed.observe_read(len(chunk), self.clock() - asked)
                run = next((i for i, good in enumerate(ok) if not good), len(ok))
                op.store_bytes += (
                    sum(ok) * self.mirror.page_bytes
                )  # pages past a bad one verified too (unused)
                op.landed += run
                self.moved()
                if run < len(ok):
                    op.outcome = (
                        Outcome.PARTIAL
                    )  # a miss or a page that did not verify: stop at it
                    return None
        except KvtierError as exc:
            op.outcome, op.error = Outcome.ERROR, str(exc)
            self._complain(
                "prefetch", f"prefetch {op.request_id}: {exc} (its pages are misses)"
            )
            return exc
        except Exception as exc:  # never leave an op unfinished
            op.outcome, op.error = Outcome.ERROR, f"{type(exc).__name__}: {exc}"
            log.exception("prefetch %s failed", op.request_id)
        return None

    async def _wait_grant(self, op: PrefetchOp) -> bool:
        """Wait for the scheduler to reserve host pages (it does so in its next poll);
        False if stopped or not granted within the store timeout."""
        try:
            while not (op.granted or op.stop):
                await asyncio.wait_for(op.wake.wait(), self.store.timeout_s)
                op.wake.clear()
        except asyncio.TimeoutError:
            return False
        return op.granted and not op.stop

    async def _read(self, keys: list[str], pages: np.ndarray) -> list[bool]:
        mirror = self.mirror
        if mirror.config.layout == "page_first":
            views = mirror.page_views(pages)
            return await self.store.batch_get_into(keys, views)
        temps = [bytearray(mirror.page_bytes) for _ in keys]
        ok = await self.store.batch_get_into(keys, temps)
        for p, t, good in zip(pages.tolist(), temps, ok):
            if good:
                mirror.write_page(p, t)
        return ok

    async def _backup(
        self,
        op: BackupOp,
        mirror: HostMirror | None = None,
        manifest: Manifest | None = None,
    ) -> None:
        """Finished only once the store stopped reading the host pages (they stay protected)."""
        await lifetime(
            self.breaker,
            op,
            lambda: self._backup_calls(op, mirror, manifest),
            lambda: self.moved(backup=True),
            finish_settled=True,
        )

    async def _backup_calls(
        self,
        op: BackupOp,
        mirror: HostMirror | None = None,
        manifest: Manifest | None = None,
    ) -> KvtierError | None:
        if mirror is not None:  # a side component's pages: one store page each
            write = partial(
                write_pages,
                self.breaker,
                self.store,
                op,
                partial(payloads, mirror),
                mirror.page_bytes,
            )
            return await backup_calls(
                self.breaker, self.store, op, manifest, write, self._complain
            )
        if self.group == 1:
            write = partial(
                write_pages,
                self.breaker,
                self.store,
                op,
                self.payloads,
                self.mirror.page_bytes,
            )
        else:
            write = partial(store_pages.backup, self, op)
        return await backup_calls(
            self.breaker, self.store, op, self.manifest, write, self._complain
        )

    def payloads(self, pages: np.ndarray) -> list:
        """The bytes of host `pages`, as the store takes them (storeio/writes.py)."""
        return payloads(self.mirror, pages)

    def drain(self, timeout: float) -> None:
        """Wait for every submitted op to finish (they all end: each store call has a timeout)."""
        self.store_loop.drain(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.store_loop.shutdown(self.store, timeout)
