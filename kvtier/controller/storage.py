"""The storage thread: one asyncio loop that runs every L3 call (prefetch and backup).

Ops are plain objects shared with the scheduler thread. A prefetch is two-phase:

1. storage thread: `batch_exists` -> `present` (pages the store holds, a leading run);
2. scheduler (in `poll`, agreed across ranks): makes room on host, reserves pages for
   exactly those pages, sets `host_pages` and `granted`;
3. storage thread: reads into those pages; `landed` grows by verified pages.

Every snapshot is safe to read: `host_pages` is set before `granted`, a page below
`landed` is verified and never written again. `finished` is the logical end (no page will
land past `landed`); `settled` comes when the store has really stopped touching the op's
pages: a read that timed out may still be writing into them from a thread until then, so
the scheduler frees an op's unused pages only once it is settled. A backup is `finished`
only once settled. Host slots are allocated and freed by the scheduler only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvtier.backends.base import Store
from kvtier.controller import store_pages
from kvtier.controller.breaker import Breaker, BreakerConfig
from kvtier.controller.cpus import keep_to
from kvtier.controller.speed import LoadSpeed
from kvtier.controller.waker import Waker
from kvtier.errors import Complaints, KvtierError
from kvtier.tiers.mirror import HostMirror

log = logging.getLogger(__name__)
CHUNK_BYTES = 8 << 20
MANIFEST_CHECK_EVERY = (
    64  # backups between two checks that the namespace's manifest is there
)


class PageKeys(Sequence):
    """The store keys of `count` pages, made on first use by the storage thread from their
    hashes — given, or computed then by `hashing()` (a prefetch's chain over the prompt):
    keying and hashing stay off the scheduler thread. `hashes` stays None until computed;
    the scheduler only reads it (one attribute store, under the GIL). `first`: the page's
    index in its sequence of the first key (where store pages of several pages start:
    `store_pages.py`)."""

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


Tag = TypeVar("Tag")


@dataclass(eq=False)
class PrefetchOp:
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
    finished: bool = False
    settled: bool = False
    reading: np.ndarray | None = None  # host pages a store read is filling now
    store_bytes: int = 0  # bytes read from the store that verified (whole store pages)
    abandoned: bool = False  # a read of it into host pages was abandoned stuck here (set before `settled`)
    outcome: Outcome = Outcome.RUNNING
    error: str | None = None
    # the scheduler's side
    inserted: int = 0
    abandoned_anywhere: bool = False  # a read of it was abandoned on some rank (agreed): its unused pages are held back


@dataclass(eq=False)
class BackupOp(Generic[Tag]):
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
    finished: bool = False
    error: str | None = None


class StorageWorker:
    """Runs store coroutines on its own event loop thread; never blocks the scheduler."""

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
        keep written (`_write_manifest`); `group`: device pages in a store page (store_pages.py;
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
        self.manifest = manifest  # (key prefix, namespace id, manifest) kept written
        self._manifest_due = (
            0  # backups until the manifest is checked again (0: the next one)
        )
        self.mirror = mirror
        self.group = group
        pages_in_flight = max(
            1, max_inflight_bytes // (mirror.page_bytes * group)
        )  # store pages
        # a read batch of ~8 MiB: few round trips for small pages, bounded memory for big ones
        self.chunk = max(
            1, min(CHUNK_BYTES // (mirror.page_bytes * group), pages_in_flight)
        )
        self._slots_count = max(1, pages_in_flight // self.chunk)
        self.loop = asyncio.new_event_loop()
        # ops submitted since the loop last woke up: one wake-up starts them all
        self._pending: list = []  # callables for the loop
        self._pending_lock = threading.Lock()
        self._wake_scheduled = False
        self._waker = Waker(self.loop, self._run_pending)
        self._thread = threading.Thread(
            target=self._run, args=(cpus,), name="kvtier-storage", daemon=True
        )
        self._thread.start()
        self._slots = self._call_soon(
            lambda: asyncio.Semaphore(self._slots_count)
        ).result()
        self._running = 0  # ops submitted and not ended: `drain` waits until none is
        self._ended = threading.Condition(threading.Lock())
        self.progress = (
            threading.Event()
        )  # set whenever a prefetch moves (an idle scheduler waits on it)
        self.moves = (
            0  # bumped after each change to a prefetch the scheduler reads (`_moved`)
        )
        self.backups_moved = (
            0  # the same for a backup's end, which no request waits for
        )
        self.hinted_pages = 0  # pages the store's `hint` acted on (storage thread)
        self.hints_failed = 0

    def _moved(self, backup: bool = False) -> None:
        """An op changed (its fields are written first): the scheduler's next poll reads
        them (`moves` or `backups_moved` tells it something moved). A prefetch's move also
        wakes an idle scheduler (`progress`); a backup's end does not: no request waits for
        it, and a nap it ended would poll for nothing."""
        if backup:
            self.backups_moved += 1
            return
        self.moves += 1
        self.progress.set()

    def _run(self, cpus: frozenset[int] | None) -> None:
        keep_to(cpus)  # before any store thread is started from here: they inherit it
        self.loop.run_forever()

    def _call_soon(self, fn) -> Future:
        async def wrap():
            return fn()

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop)

    def submit_prefetch(self, op: PrefetchOp) -> None:
        self._submit(self._prefetch, op)

    def submit_backup(self, op: BackupOp) -> None:
        self._submit(self._backup, op)

    def _submit(self, run, op) -> None:
        """Start `run(op)` on the loop; `drain` waits for it. Counted, not given a future:
        a concurrent Future per op (a Condition, two callbacks) cost the scheduler thread
        ~3.5 us an op."""
        with self._ended:
            self._running += 1
        self._post(lambda: self.loop.create_task(self._counted(run(op))))

    async def _counted(self, coro) -> None:
        try:
            await coro
        finally:
            with self._ended:
                self._running -= 1
                if not self._running:
                    self._ended.notify_all()

    def _post(self, fn) -> None:
        """Run `fn` on the loop. The first call since the loop last took the queue wakes it
        (one byte on its pipe, written keeping the GIL: `waker.py`); the others ride along:
        a poll that starts ten ops and grants five prefetches wakes the loop once."""
        with self._pending_lock:
            self._pending.append(fn)
            wake, self._wake_scheduled = not self._wake_scheduled, True
        if wake:
            self._waker.wake()

    def _run_pending(self) -> None:
        with self._pending_lock:
            batch, self._pending, self._wake_scheduled = self._pending, [], False
        for fn in batch:
            fn()

    def touch(self, keys: PageKeys) -> None:
        """Called from the scheduler thread: these pages just left host, so the store's
        copies are the ones left (`Store.touch`). Rides along with the next wake-up."""
        self._post(lambda: self._touch_now(keys))

    def _touch_now(self, keys: PageKeys) -> None:
        if self.breaker.down:  # a hint is not worth a timeout (nor a probe)
            return
        try:
            self.store.touch(keys)
        except Exception:  # an order hint: never worth an op
            log.exception("touching %d pages in the store failed", len(keys))

    def hint(self, keys: PageKeys, lease_s: float | None, priority: int) -> None:
        """Called from the scheduler thread: pass an agent's hint for these pages on to the
        store (`Store.hint`). Advice: a store that is down or fails is logged and counted
        (`hints_failed`), never waited for; `drain` waits for the call like any op."""
        self._submit(self._hint, (keys, lease_s, priority))

    async def _hint(self, args: tuple[PageKeys, float | None, int]) -> None:
        keys, lease_s, priority = args
        if self.breaker.down:  # a hint is not worth a timeout (nor a probe)
            self.hints_failed += 1
            return
        try:
            done = await asyncio.wait_for(
                self.store.hint(list(keys), lease_s=lease_s, priority=priority),
                self.store.timeout_s,
            )
        except Exception as exc:  # advice: never an op's failure
            self.hints_failed += 1
            self._complain("hint", f"hint for {len(keys)} pages failed: {exc}")
            return
        self.hinted_pages += int(done or 0)

    def wake(self, op: PrefetchOp) -> None:
        """Called from the scheduler thread after `granted` or `stop` changed."""
        self._post(lambda: op.wake is not None and op.wake.set())

    async def _prefetch(self, op: PrefetchOp) -> None:
        settled = None
        try:
            settled = await self._prefetch_pages(op)
        finally:
            # ended before the store said what it holds: nothing. Left unknown, the agreed
            # count would stay unknown, and a rank whose store did answer would wait for a
            # grant that never comes (docs/design.md §7)
            if op.present is None:
                op.present = 0
            op.finished = True
            self._moved()
        if settled is not None and self.breaker.abandoned(await settled):
            op.abandoned = (
                op.reading is not None
            )  # a stuck thread may still write those host pages
        op.settled = True
        self._moved()

    async def _prefetch_pages(self, op: PrefetchOp):
        """Read the op's pages; returns what to await before its pages are free (or None)."""
        op.wake = asyncio.Event()
        if op.granted or op.stop:
            op.wake.set()
        try:
            if not self.breaker.admit():
                op.present, op.outcome = 0, Outcome.STORE_DOWN
                return None
            asked = self.clock()
            if self.group == 1:
                present = found = await self._guarded(
                    self.store.batch_exists(list(op.keys))
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
                self._moved()
                return None
            op.present = present
            self._moved()
            if op.present == 0:
                op.outcome = Outcome.DONE
                return
            if not await self._wait_grant(op):
                op.outcome = Outcome.STOPPED
                return
            pages = op.host_pages
            if pages is None or len(pages) == 0:
                op.outcome = Outcome.NO_SPACE
                return
            op.outcome = Outcome.DONE if len(pages) == op.present else Outcome.PARTIAL
            if self.group > 1:
                why = await store_pages.read(self, op, pages)
                if why is not None:
                    op.outcome = Outcome(why)
                return None
            for start in range(0, len(pages), self.chunk):
                if op.stop:
                    op.outcome = Outcome.STOPPED
                    return
                chunk = pages[start : start + self.chunk]
                async with self._slots:
                    asked = self.clock()
                    op.reading = chunk
                    ok = await self._guarded(
                        self._read(op.keys[start : start + len(chunk)], chunk)
                    )
                    op.reading = None
                    self.speed.observe_read(len(chunk), self.clock() - asked)
                run = next((i for i, good in enumerate(ok) if not good), len(ok))
                op.store_bytes += (
                    sum(ok) * self.mirror.page_bytes
                )  # pages past a bad one verified too (unused)
                op.landed += run
                self._moved()
                if run < len(ok):
                    op.outcome = (
                        Outcome.PARTIAL
                    )  # a miss or a page that did not verify: stop at it
                    return
        except KvtierError as exc:
            op.outcome, op.error = Outcome.ERROR, str(exc)
            self._complain(
                "prefetch", f"prefetch {op.request_id}: {exc} (its pages are misses)"
            )
            return getattr(exc, "settled", None)
        except Exception as exc:  # never leave an op unfinished
            op.outcome, op.error = Outcome.ERROR, f"{type(exc).__name__}: {exc}"
            log.exception("prefetch %s failed", op.request_id)
        return None

    async def _write_manifest(self) -> None:
        """Before a namespace's first page, and every `MANIFEST_CHECK_EVERY` backups after:
        describe it in the store if it is not there (kept if it is). A failed write is tried
        again at the next backup, and a manifest the store dropped (Redis eviction, a TTL)
        comes back: a namespace's pages always have their manifest, which `store purge
        --tenant` finds them by."""
        if self._manifest_due > 0:
            self._manifest_due -= 1
            return
        prefix, ns, manifest = self.manifest
        if await self._guarded(self.store.get_manifest(prefix, ns)) is None:
            await self._guarded(
                self.store.put_manifest(
                    prefix, ns, {**manifest, "created": time.time()}
                )
            )
        self._manifest_due = MANIFEST_CHECK_EVERY

    async def _guarded(self, call):
        """A store call whose outcome the breaker learns (a miss or a bad page is no failure)."""
        try:
            result = await call
        except KvtierError as exc:
            self.breaker.failed(str(exc))
            raise
        self.breaker.succeeded()
        return result

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

    async def _backup(self, op: BackupOp) -> None:
        """Finished only once the store stopped reading the host pages (they stay protected)."""
        settled = None
        try:
            if not self.breaker.admit():
                op.ok, op.error = [False] * len(op.keys), "store down"
                return
            if self.manifest is not None:
                await self._write_manifest()
            if self.group == 1:
                op.ok = await self._guarded(
                    self.store.batch_set(list(op.keys), self._payloads(op.host_pages))
                )
                op.store_bytes = sum(op.ok) * self.mirror.page_bytes
            else:
                op.ok = await store_pages.backup(self, op)
        except KvtierError as exc:
            op.error = str(exc)
            op.ok = op.ok or [False] * len(
                op.keys
            )  # store pages of several pages: the calls before it stored theirs
            settled = getattr(exc, "settled", None)
            self._complain("backup", f"backup of {len(op.keys)} pages failed: {exc}")
        except Exception as exc:
            op.error = f"{type(exc).__name__}: {exc}"
            op.ok = op.ok or [False] * len(op.keys)
            log.exception("backup failed")
        finally:
            if settled is None:
                op.finished = True
                self._moved(backup=True)
        if settled is not None:
            self.breaker.abandoned(
                await settled
            )  # a stuck write reads no further page (io_threads.py)
            op.finished = True
            self._moved(backup=True)

    def _payloads(self, pages: np.ndarray) -> list:
        if self.mirror.config.layout == "page_first":
            return self.mirror.page_views(pages)
        return [self.mirror.page_view(int(p)).numpy() for p in pages]

    def drain(self, timeout: float) -> None:
        """Wait for every submitted op to finish (they all end: each store call has a timeout)."""
        with self._ended:
            self._ended.wait_for(lambda: not self._running, timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.drain(timeout)
        try:
            asyncio.run_coroutine_threadsafe(self.store.close(), self.loop).result(
                timeout
            )
        except Exception as exc:
            log.warning("closing store: %s", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        self._waker.close(self.loop)
        self.loop.close()
