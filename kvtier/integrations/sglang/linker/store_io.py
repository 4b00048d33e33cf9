"""The linker's store calls: a client of the store runtime (kvtier/storeio/), all on one
store loop of its own, behind its breaker.

- `leading_run(keys)`: the store's leading run (`batch_exists`) for a lookup, which SGLang
  waits for: 0 at once while the breaker has the store down, and never waited on past one
  timeout (the store's own ends the call first; the wait here is the backstop).
- `read(keys, pages)`: store pages into reserved host pages (a `StoreRead`); `landed` is
  the run of pages that verified; its `phase` (storeio/ops.py): FINISHED, no page lands
  past `landed`; SETTLED, the store stopped touching the pages (a read that timed out may
  still write them until then); ABANDONED, given up on stuck while it could write them.
- `write(keys, pages)`: host pages to the store (a `BackupOp`; `finished` once settled).
- `hint(keys, lease_s, priority)`: an agent's lease or priority for the pages (`Store.hint`),
  one guarded call, in the order given, never waited for (linker/hints.py).

Each call takes SGLang's page keys; their store keys are made on the storage thread
(`PageKeys`), never on the scheduler's. With `store.page_tokens` above the engine's page
size, the storage thread also groups them into store pages of several engine pages
(`store_pages.py`): the scheduler still hands over and gets back engine pages.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from kvtier.backends.base import Store
from kvtier.errors import Complaints, KvtierError, StoreDown
from kvtier.storeio.breaker import Breaker
from kvtier.storeio.call import lifetime, send_hint, store_call
from kvtier.storeio.loop import StoreLoop
from kvtier.storeio.ops import BackupOp, PageKeys, StoreOp
from kvtier.storeio.writes import Manifest, backup_calls, payloads, write_pages
from kvtier.hashing import key_maker
from kvtier.integrations.sglang.keys import page_hash_of
from kvtier.integrations.sglang.linker import store_pages
from kvtier.tiers.mirror import HostMirror

log = logging.getLogger(__name__)
MEMO = 1 << 16  # page hashes the storage thread remembers (~200 bytes each)


@dataclass(eq=False)
class StoreRead(StoreOp):
    keys: PageKeys  # store keys (made on the storage thread)
    pages: np.ndarray  # host pages, one per key
    around: PageKeys | None = None  # grouped reads: the lookup's run its pages are in
    at: list[int] | None = None  # ... and where in it each of them is
    landed: int = 0
    answered: bool = (
        False  # the store answered: a page short of `keys` missed or did not verify
    )

    def writes_pages(self) -> bool:
        """Its read goes into its host pages (or buffers copied into them once verified)."""
        return True


class LinkerStore:
    def __init__(
        self,
        store: Store,
        mirror: HostMirror,
        settings,
        counters,
        clock: Callable[[], float],
    ) -> None:
        self.store, self.mirror, self.counters = store, mirror, counters
        self.prefix, self.namespace_id, self.keyed = (
            settings.key_prefix,
            settings.namespace.id,
            settings.keyed_hash,
        )
        self.manifest = Manifest(
            settings.key_prefix,
            self.namespace_id,
            settings.namespace.manifest(mirror.page_bytes),
        )
        self.breaker = Breaker(store.name, settings.breaker, clock)
        self.store_loop = StoreLoop(settings.cpus, name="kvtier-storage")
        self.loop = self.store_loop.loop
        self._complain = Complaints(
            log
        )  # a full disk fails every write: not a line each
        self.progress = threading.Event()  # set whenever a read moves
        self.key_of = key_maker(settings.key_prefix, self.namespace_id)
        self.group = settings.store_group  # engine pages a store page holds, on average
        self._memo: dict[str, bytes] = {}  # SGLang key -> page hash (storage thread)
        # hints reach the store one at a time, in the order the scheduler gave them (a
        # store's hint may read a page's lease, then write it)
        self._hints_in_order = asyncio.Lock()
        self.hinted_pages = 0  # pages the store's `hint` acted on (storage thread)
        self.hints_failed = 0

    @property
    def timeout_s(self) -> float:
        return self.store.timeout_s

    def keys(self, keys: Sequence[str]) -> list[str]:
        """The store keys of SGLang's page keys (through the tenant's keyed hash, with a key)."""
        keyed, key_of = self.keyed, self.key_of
        return [key_of(page_hash_of(k, keyed)) for k in keys]

    def _lazy(self, keys: Sequence[str]) -> PageKeys:
        """`keys(keys)`, made on first use: by the storage thread."""
        engine = list(keys)
        return PageKeys(partial(self._hashes, engine), self.key_of, count=len(engine))

    def _hashes(self, engine: list[str]) -> list[bytes]:
        """The page hashes of SGLang's keys (storage thread): the recent ones remembered,
        since lookups ask about the same prefixes again and again."""
        memo = self._memo
        if len(memo) > MEMO:
            memo.clear()
        out = list(map(memo.get, engine))
        if None in out:
            keyed = self.keyed
            for i, h in enumerate(out):
                if h is None:
                    out[i] = memo[engine[i]] = page_hash_of(engine[i], keyed)
        return out

    # -- lookup --------------------------------------------------------------------------------

    def leading_run(self, keys: Sequence[str], limit: int | None = None) -> int:
        """The store's leading run of `keys`, at most `limit` (a store page of several
        engine pages may end past it)."""
        limit = len(keys) if limit is None else min(limit, len(keys))
        if self.group == 1:
            keys = keys[:limit]
        fut = self.store_loop.submit(self._exists(self._lazy(keys), limit))
        try:
            return fut.result(self.store.timeout_s + 0.5)
        except Exception as exc:
            self.counters.lookup_store_errors += 1
            log.warning(
                "kvtier linker: store lookup of %d pages gave up: %r", len(keys), exc
            )
            return 0

    async def _exists(self, keys: PageKeys, limit: int) -> int:
        try:
            if self.group > 1:
                return await store_pages.leading_run(
                    keys.chain(), self.group, self.key_of, self._exists_call, limit
                )
            return await store_call(
                self.breaker, lambda: self.store.batch_exists(list(keys))
            )
        except StoreDown:
            self.counters.lookup_store_skipped += 1
        except KvtierError:
            self.counters.lookup_store_errors += 1
        return 0

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether the store holds each of `keys` (one `exists_each`, as `leading_run` is
        bounded): a hybrid model's side pools restore a window that need not start at
        the first page. A skipped or failed call: none held."""
        fut = self.store_loop.submit(self._present(self._lazy(keys)))
        try:
            return fut.result(self.store.timeout_s + 0.5)
        except Exception as exc:
            self.counters.lookup_store_errors += 1
            log.warning(
                "kvtier linker: store lookup of %d pages gave up: %r", len(keys), exc
            )
            return [False] * len(keys)

    async def _present(self, keys: PageKeys) -> list[bool]:
        try:
            return await store_call(
                self.breaker, lambda: self.store.exists_each(list(keys))
            )
        except StoreDown:
            self.counters.lookup_store_skipped += 1
        except KvtierError:
            self.counters.lookup_store_errors += 1
        return [False] * len(keys)

    def _exists_call(self, keys: list[str]) -> Awaitable[int]:
        return store_call(self.breaker, lambda: self.store.batch_exists(keys))

    # -- reads and writes ----------------------------------------------------------------------

    def read(
        self,
        keys: Sequence[str],
        pages: np.ndarray,
        around: tuple[Sequence[str], list[int]] | None = None,
    ) -> StoreRead:
        """Read `keys` into host `pages`; `around`: the run of keys they are in, in their
        sequence's order, and where each of them is in it (None: `keys` are that run)."""
        if around is None:
            around = (keys, list(range(len(keys))))
        context = self._lazy(around[0]) if self.group > 1 else None
        read = StoreRead(self._lazy(keys), pages, context, around[1])
        self.store_loop.submit(
            lifetime(
                self.breaker,
                read,
                lambda: self._read_pages(read),
                self.progress.set,
            )
        )
        return read

    async def _read_pages(self, read: StoreRead) -> KvtierError | None:
        """Returns the failure whose settling frees the pages again (a timed-out call), or None."""
        try:
            if self.group > 1:
                ok = await self._read_segments(read)
            else:
                ok = await self._read_own(list(read.keys), read.pages)
        except StoreDown:
            return None
        except KvtierError as exc:
            return exc
        except Exception:  # never leave a read unfinished
            log.exception("kvtier linker: store read failed")
            return None
        read.landed = next((i for i, good in enumerate(ok) if not good), len(ok))
        read.answered = True
        return None

    async def _read_own(self, keys: list[str], pages: np.ndarray) -> list[bool]:
        """Engine pages from their own store pages, straight into host pages (page_first),
        or through buffers copied in once verified; per page, did it verify."""
        mirror = self.mirror
        page_first = mirror.config.layout == "page_first"
        views = (
            mirror.page_views(pages)
            if page_first
            else [bytearray(mirror.page_bytes) for _ in range(len(keys))]
        )
        ok = await store_call(
            self.breaker, lambda: self.store.batch_get_into(keys, views)
        )
        if not page_first:
            for p, v, good in zip(pages.tolist(), views, ok):
                if good:
                    mirror.write_page(p, v)
        return ok

    async def _read_segments(self, read: StoreRead) -> list[bool]:
        """Each segment holding pages of the read from its store page (into a buffer; the
        read's pages copied into host pages once verified), the rest from their own store
        pages; per page, did it verify. The segments are those of `read.around`'s keys, the
        lookup's run the read's pages are in: a segment may end past the last one read."""
        g, pb, key_of = self.group, self.mirror.page_bytes, self.key_of
        hashes = read.around.chain()
        at = read.at
        ok = [False] * len(at)
        wanted = []  # (its end, its page count or None where it starts before, read slots)
        cut, k = store_pages.ends(hashes, g), 0
        for a, b in zip([None, *cut], cut):
            first = k
            while k < len(at) and at[k] <= b:
                k += 1
            if k > first:
                wanted.append((b, None if a is None else b - a, first, k))
            if k == len(at):
                break
        if wanted:
            keys = [key_of(store_pages.segment_hash(hashes[b], g)) for b, *_ in wanted]
            blobs = await store_call(self.breaker, lambda: self.store.batch_get(keys))
            for (b, count, first, last), blob in zip(wanted, blobs):
                have = -1 if blob is None or len(blob) % pb else len(blob) // pb
                if have < b - at[first] + 1 or (count is not None and have != count):
                    continue  # missing, or not the segment this key names: its pages' own
                rows = np.frombuffer(blob, np.uint8).reshape(have, pb)
                pick = [have - 1 - (b - i) for i in at[first:last]]
                self.mirror.write_pages(read.pages[first:last], rows[pick])
                ok[first:last] = [True] * (last - first)
        rest = [i for i, good in enumerate(ok) if not good]
        if rest:
            own = await self._read_own(
                [key_of(hashes[at[i]]) for i in rest], read.pages[rest]
            )
            for i, good in zip(rest, own):
                ok[i] = good
        return ok

    def wait(self, read: StoreRead, seconds: float, settled: bool = False) -> bool:
        """Until `read` finished (or settled); False if it had not within `seconds`."""
        deadline = time.monotonic() + seconds
        while not (read.settled if settled else read.finished):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.progress.wait(min(left, 0.05))
            self.progress.clear()
        return True

    def write(
        self, keys: Sequence[str], pages: np.ndarray, contiguous: bool = False
    ) -> BackupOp:
        """Store host `pages` under `keys`; `contiguous`: the keys are one run of their
        sequence, in order (then segments it holds whole are stored as one store page)."""
        op = BackupOp(self._lazy(keys), pages.copy(), None)
        grouped = contiguous and self.group > 1
        self.store_loop.start(
            lifetime(
                self.breaker,
                op,
                lambda: self._write_calls(op, grouped),
                lambda: None,
                finish_settled=True,
            )
        )
        return op

    def _write_calls(
        self, op: BackupOp, grouped: bool
    ) -> Awaitable[KvtierError | None]:
        write = (
            partial(self._write_segments, op)
            if grouped
            else partial(
                write_pages,
                self.breaker,
                self.store,
                op,
                partial(payloads, self.mirror),
                self.mirror.page_bytes,
            )
        )
        return backup_calls(
            self.breaker, self.store, op, self.manifest, write, self._complain
        )

    async def _write_segments(self, op: BackupOp) -> list[bool]:
        """One `batch_set` of the run's store pages (`store_pages.write_plan`), within an
        admitted backup; per engine page, is it stored."""
        g, key_of = self.group, self.key_of
        hashes = op.keys.chain()
        plan = store_pages.write_plan(hashes, g)
        views = payloads(self.mirror, op.host_pages)
        keys = [
            key_of(
                store_pages.segment_hash(hashes[p.last], g)
                if p.whole
                else hashes[p.first]
            )
            for p in plan
        ]
        blobs = [
            b"".join(views[p.first : p.last + 1]) if p.whole else views[p.first]
            for p in plan
        ]
        ok = await store_call(
            self.breaker, lambda: self.store.batch_set(keys, blobs), admitted=True
        )
        stored = [False] * len(hashes)
        for p, good in zip(plan, ok):
            if good:
                stored[p.first : p.last + 1] = [True] * (p.last - p.first + 1)
        op.store_bytes = sum(stored) * self.mirror.page_bytes
        return stored

    # -- hints -------------------------------------------------------------------------------

    def hint(
        self, keys: Sequence[str], lease_s: float | None, priority: int | None
    ) -> None:
        """Called from the scheduler thread: pass an agent's hint for these pages on to the
        store (`Store.hint`), as one guarded store call. Advice: a store that is down or
        fails is counted (`hints_failed`) and logged, never waited for; `drain` waits for
        the call like any op."""
        self.store_loop.start(self._hint(self._lazy(keys), lease_s, priority))

    async def _hint(
        self, keys: PageKeys, lease_s: float | None, priority: int | None
    ) -> None:
        named = list(keys)
        if self.group > 1:  # and the store pages of the segments ending among them
            chain, g = keys.chain(), self.group
            named += [
                self.key_of(store_pages.segment_hash(chain[e], g))
                for e in store_pages.ends(chain, g)
            ]
        done = await send_hint(
            self.breaker,
            self.store,
            self._hints_in_order,
            named,
            lease_s,
            priority,
            self._complain,
        )
        if done is None:
            self.hints_failed += 1
        else:
            self.hinted_pages += done

    # -- lifecycle -----------------------------------------------------------------------------

    def drain(self) -> None:
        self.store_loop.drain(4 * self.store.timeout_s)

    def close(self) -> None:
        self.store_loop.shutdown(self.store, 4 * self.store.timeout_s)

    def stats(self) -> dict:
        return {**self.store.stats(), **self.breaker.stats()}
