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
(`PageKeys`), never on the scheduler's.
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
from kvtier.tiers.mirror import HostMirror

log = logging.getLogger(__name__)


@dataclass(eq=False)
class StoreRead(StoreOp):
    keys: PageKeys  # store keys (made on the storage thread)
    pages: np.ndarray  # host pages, one per key
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
        engine, keyed = list(keys), self.keyed
        return PageKeys(
            lambda: [page_hash_of(k, keyed) for k in engine],
            self.key_of,
            count=len(engine),
        )

    # -- lookup --------------------------------------------------------------------------------

    def leading_run(self, keys: Sequence[str]) -> int:
        fut = self.store_loop.submit(self._exists(self._lazy(keys)))
        try:
            return fut.result(self.store.timeout_s + 0.5)
        except Exception as exc:
            self.counters.lookup_store_errors += 1
            log.warning(
                "kvtier linker: store lookup of %d pages gave up: %r", len(keys), exc
            )
            return 0

    async def _exists(self, keys: PageKeys) -> int:
        try:
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

    # -- reads and writes ----------------------------------------------------------------------

    def read(self, keys: Sequence[str], pages: np.ndarray) -> StoreRead:
        read = StoreRead(self._lazy(keys), pages)
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
        mirror = self.mirror
        page_first = mirror.config.layout == "page_first"
        views = (
            mirror.page_views(read.pages)
            if page_first
            else [bytearray(mirror.page_bytes) for _ in range(len(read.keys))]
        )
        try:
            ok = await store_call(
                self.breaker,
                lambda: self.store.batch_get_into(list(read.keys), views),
            )
        except StoreDown:
            return None
        except KvtierError as exc:
            return exc
        except Exception:  # never leave a read unfinished
            log.exception("kvtier linker: store read failed")
            return None
        run = next((i for i, good in enumerate(ok) if not good), len(ok))
        if not page_first:
            for p, v in zip(read.pages[:run].tolist(), views[:run]):
                mirror.write_page(p, v)
        read.landed, read.answered = run, True
        return None

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

    def write(self, keys: Sequence[str], pages: np.ndarray) -> BackupOp:
        op = BackupOp(self._lazy(keys), pages.copy(), None)
        self.store_loop.start(
            lifetime(
                self.breaker,
                op,
                lambda: self._write_calls(op),
                lambda: None,
                finish_settled=True,
            )
        )
        return op

    def _write_calls(self, op: BackupOp) -> Awaitable[KvtierError | None]:
        write = partial(
            write_pages,
            self.breaker,
            self.store,
            op,
            partial(payloads, self.mirror),
            self.mirror.page_bytes,
        )
        return backup_calls(
            self.breaker, self.store, op, self.manifest, write, self._complain
        )

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

    # -- lifecycle -----------------------------------------------------------------------------

    def drain(self) -> None:
        self.store_loop.drain(4 * self.store.timeout_s)

    def close(self) -> None:
        self.store_loop.shutdown(self.store, 4 * self.store.timeout_s)

    def stats(self) -> dict:
        return {**self.store.stats(), **self.breaker.stats()}
