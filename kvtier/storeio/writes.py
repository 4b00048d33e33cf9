"""Writing host pages to a store, for every client of the store loop that backs pages up
(the cache's `StorageWorker`, the SGLang linker): a `BackupOp`'s calls, and the namespace's
manifest, kept written before its pages."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np

from kvtier.backends.base import Store
from kvtier.errors import Complaints, KvtierError
from kvtier.storeio.breaker import Breaker
from kvtier.storeio.call import store_call
from kvtier.storeio.ops import BackupOp

log = logging.getLogger(__name__)
MANIFEST_CHECK_EVERY = (
    64  # backups between two checks that the namespace's manifest is there
)


class Manifest:
    """A namespace's manifest, kept written: before its first page, and every
    `MANIFEST_CHECK_EVERY` backups after, written if the store does not have it (kept if it
    does). A failed write is tried again at the next backup, and a manifest the store
    dropped (Redis eviction, a TTL) comes back: a namespace's pages always have their
    manifest, which `store purge --tenant` finds them by. The store loop alone uses it."""

    def __init__(self, prefix: str, namespace_id: str, manifest: dict) -> None:
        self.prefix, self.namespace_id, self.manifest = prefix, namespace_id, manifest
        self._due = 0  # backups until the manifest is checked again (0: the next one)

    async def keep(self, breaker: Breaker, store: Store) -> None:
        """Within an admitted backup: a failure is raised (the backup fails with it)."""
        if self._due > 0:
            self._due -= 1
            return
        prefix, ns, manifest = self.prefix, self.namespace_id, self.manifest
        got = await store_call(
            breaker, lambda: store.get_manifest(prefix, ns), admitted=True
        )
        if got is None:
            await store_call(
                breaker,
                lambda: store.put_manifest(
                    prefix, ns, {**manifest, "created": time.time()}
                ),
                admitted=True,
            )
        self._due = MANIFEST_CHECK_EVERY


async def backup_calls(
    breaker: Breaker,
    store: Store,
    op: BackupOp,
    manifest: Manifest | None,
    write: Callable[[], Awaitable[list[bool]]],
    complain: Complaints,
) -> KvtierError | None:
    """A backup's calls (for `lifetime`): admitted once, the manifest first, then `write()`
    (which sets `op.ok` call by call where it makes several); the failure they ended with,
    or None. Never raises: `op.ok` and `op.error` say what was stored."""
    try:
        if not breaker.admit():
            op.ok, op.error = [False] * len(op.keys), "store down"
            return None
        if manifest is not None:
            await manifest.keep(breaker, store)
        op.ok = await write()
    except KvtierError as exc:
        op.error = str(exc)
        op.ok = op.ok or [False] * len(
            op.keys
        )  # store pages of several pages: the calls before it stored theirs
        complain("backup", f"backup of {len(op.keys)} pages failed: {exc}")
        return exc  # a stuck write reads no further page (io_threads.py)
    except Exception as exc:
        op.error = f"{type(exc).__name__}: {exc}"
        op.ok = op.ok or [False] * len(op.keys)
        log.exception("backup failed")
    return None


def payloads(mirror, pages: np.ndarray) -> list:
    """The bytes of host `pages` of `mirror` (a HostMirror) as a store takes them: views
    of page_first pages, a copy of each layer_first one."""
    if mirror.config.layout == "page_first":
        return mirror.page_views(pages)
    return [mirror.page_view(int(p)).numpy() for p in pages]


async def write_pages(
    breaker: Breaker,
    store: Store,
    op: BackupOp,
    payloads: Callable[[np.ndarray], list],
    page_bytes: int,
) -> list[bool]:
    """One store page per host page: one `batch_set` of the op's pages (within an admitted
    backup); counts the bytes the store took."""
    ok = await store_call(
        breaker,
        lambda: store.batch_set(list(op.keys), payloads(op.host_pages)),
        admitted=True,
    )
    op.store_bytes = sum(ok) * page_bytes
    return ok
