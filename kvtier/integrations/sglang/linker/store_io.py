"""The linker's store calls: all on one `StorageWorker`'s event loop, behind its breaker.

- `leading_run(keys)`: the store's leading run (`batch_exists`) for a lookup, which SGLang
  waits for: 0 at once while the breaker has the store down, and never waited on past one
  timeout (the store's own ends the call first; the wait here is the backstop).
- `read(keys, pages)`: store pages into reserved host pages (a `StoreRead`); `landed` is
  the run of pages that verified. `finished`: no page lands past `landed`; `settled`: the
  store stopped touching the pages (a read that timed out may still write them until then).
- `write(keys, pages)`: host pages to the store (a `BackupOp`; `finished` once settled).

Each call takes SGLang's page keys; their store keys are made on the storage thread
(`PageKeys`), never on the scheduler's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.backends.base import Store
from kvtier.controller.storage import BackupOp, PageKeys, StorageWorker
from kvtier.errors import KvtierError
from kvtier.hashing import key_maker
from kvtier.integrations.sglang.keys import page_hash_of
from kvtier.tiers.mirror import HostMirror

log = logging.getLogger(__name__)


@dataclass(eq=False)
class StoreRead:
    keys: PageKeys  # store keys (made on the storage thread)
    pages: np.ndarray  # host pages, one per key
    landed: int = 0
    answered: bool = (
        False  # the store answered: a page short of `keys` missed or did not verify
    )
    finished: bool = False
    settled: bool = False
    abandoned: bool = (
        False  # given up on stuck (a hung mount): a thread may still write its pages
    )


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
        manifest = (
            settings.key_prefix,
            self.namespace_id,
            settings.namespace.manifest(mirror.page_bytes),
        )
        self.worker = StorageWorker(
            store,
            mirror,
            settings.max_inflight_bytes,
            settings.breaker,
            clock,
            settings.cpus,
            manifest,
        )
        self.progress = threading.Event()  # set whenever a read moves
        self.key_of = key_maker(settings.key_prefix, self.namespace_id)

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

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.worker.loop)

    # -- lookup --------------------------------------------------------------------------------

    def leading_run(self, keys: Sequence[str]) -> int:
        fut = self._run(self._exists(self._lazy(keys)))
        try:
            return fut.result(self.store.timeout_s + 0.5)
        except Exception as exc:
            self.counters.lookup_store_errors += 1
            log.warning(
                "kvtier linker: store lookup of %d pages gave up: %r", len(keys), exc
            )
            return 0

    async def _exists(self, keys: PageKeys) -> int:
        breaker = (
            self.worker.breaker
        )  # used on the storage thread only, as StorageWorker does
        if not breaker.admit():
            self.counters.lookup_store_skipped += 1
            return 0
        try:
            present = await self.store.batch_exists(list(keys))
        except KvtierError as exc:
            breaker.failed(str(exc))
            self.counters.lookup_store_errors += 1
            return 0
        breaker.succeeded()
        return present

    # -- reads and writes ----------------------------------------------------------------------

    def read(self, keys: Sequence[str], pages: np.ndarray) -> StoreRead:
        read = StoreRead(self._lazy(keys), pages)
        self._run(self._read(read))
        return read

    async def _read(self, read: StoreRead) -> None:
        settled = None
        try:
            settled = await self._read_pages(read)
        finally:
            read.finished = True
            self.progress.set()
        if settled is not None:
            read.abandoned = self.worker.breaker.abandoned(await settled)
        read.settled = True
        self.progress.set()

    async def _read_pages(self, read: StoreRead):
        """Returns what to await before the pages are free again (a timed-out call), or None."""
        breaker, mirror = self.worker.breaker, self.mirror
        if not breaker.admit():
            return None
        page_first = mirror.config.layout == "page_first"
        views = (
            mirror.page_views(read.pages)
            if page_first
            else [bytearray(mirror.page_bytes) for _ in range(len(read.keys))]
        )
        try:
            ok = await self.store.batch_get_into(list(read.keys), views)
        except KvtierError as exc:
            breaker.failed(str(exc))
            return getattr(exc, "settled", None)
        except Exception:  # never leave a read unfinished
            log.exception("kvtier linker: store read failed")
            return None
        breaker.succeeded()
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
        self.worker.submit_backup(op)
        return op

    # -- lifecycle -----------------------------------------------------------------------------

    def drain(self) -> None:
        self.worker.drain(4 * self.store.timeout_s)

    def close(self) -> None:
        self.worker.close(4 * self.store.timeout_s)

    def stats(self) -> dict:
        return {**self.store.stats(), **self.worker.breaker.stats()}
