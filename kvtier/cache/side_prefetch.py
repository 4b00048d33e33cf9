"""A hybrid model's store prefetch: the FULL pages past a request's match, the SWA window
that ends where they end and the state taken exactly there, brought to host in one op.

Two phases, as a FULL prefetch (controller/storage.py):

1. storage thread: which lengths could be restored, by existence on the store: FULL
   pages `batch_exists` (a leading run), then per candidate end the state under the
   MAMBA namespace and the window's pages under the SWA namespace (`exists_each`); the
   longest end every component has. It reads those pages (each store page verified by its
   frame) into buffers of its own; any page of any component missing or not verifying
   makes the op a miss (`length` 0): never part of a prefix, never wrong bytes;
2. scheduler (`poll`): takes host slots of each component's mirror, copies the verified
   bytes in, hangs the FULL pages under the anchor (`insert_host`) and gives the nodes
   the window's SWA KV and the state (`set_component`); the request's next `acquire`
   restores from host as from any host hit.

The store part always comes whole: its window is read from the store even where it
reaches below the match (a tree's copy may be a tombstone there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.errors import KvtierError
from kvtier.storeio.call import lifetime
from kvtier.storeio.ops import StoreOp

log = logging.getLogger(__name__)


@dataclass(eq=False)
class HybridPrefetchOp(StoreOp):
    """`first`: the page the store part starts at (the match's end); `pages`: pages asked
    past it; `window`: the SWA window in pages (0 without SWA); `state`: whether a state
    must end the part. `keys` per component (None: FULL): its key maker; `page_bytes` per
    component: bytes of one of its store pages."""

    request_id: str
    hashing: Callable[[], list[bytes]]  # the key's page hashes from the root
    first: int
    pages: int
    window: int
    state: bool
    keys: dict
    page_bytes: dict
    stop: bool = False  # the scheduler's wish (an abort, a drain): no more calls
    # written by the storage thread, read by the scheduler once `finished`
    chain: list[bytes] | None = None
    length: int = 0  # pages past `first` read and verified, every component with them
    full: list = field(default_factory=list)
    swa: list = field(default_factory=list)  # pages [first + length - window, ...)
    state_bytes: bytearray | None = None
    error: str | None = None


def submit(worker, op: HybridPrefetchOp) -> None:
    """Run `op` on the storage worker's loop (`worker`: the cache's StorageWorker)."""
    worker.store_loop.start(
        lifetime(worker.breaker, op, lambda: _calls(worker, op), worker.moved)
    )


async def _calls(worker, op: HybridPrefetchOp) -> KvtierError | None:
    try:
        if not worker.breaker.admit():
            return None
        await _find_and_read(worker, op)
    except KvtierError as exc:
        op.length, op.error = 0, str(exc)
        return exc
    except Exception as exc:  # never leave an op unfinished
        op.length, op.error = 0, f"{type(exc).__name__}: {exc}"
        log.exception("hybrid prefetch %s failed", op.request_id)
    return None


async def _find_and_read(worker, op: HybridPrefetchOp) -> None:
    store, first, w = worker.store, op.first, op.window
    chain = op.chain = op.hashing()
    full_key, swa_key, state_key = (op.keys.get(c) for c in (None, "swa", "mamba"))
    full = await worker.call(
        lambda: store.batch_exists([full_key(h) for h in chain[first:]])
    )
    if not full or op.stop:
        return
    ends = list(range(first + 1, first + full + 1))  # candidate end pages
    good = [True] * len(ends)
    if op.state:
        have = await worker.call(
            lambda: store.exists_each([state_key(chain[e - 1]) for e in ends])
        )
        good = [g and h for g, h in zip(good, have)]
    lo = max(0, first + 1 - w)
    if w and any(good) and not op.stop:
        have = await worker.call(
            lambda: store.exists_each([swa_key(chain[i]) for i in range(lo, ends[-1])])
        )
        for j, e in enumerate(ends):
            good[j] = good[j] and all(have[max(0, e - w) - lo : e - lo])
    best = max((e for e, g in zip(ends, good) if g), default=None)
    if best is None or op.stop:
        return
    reads = [(None, list(range(first, best)))]
    if w:
        reads.append(("swa", list(range(max(0, best - w), best))))
    if op.state:
        reads.append(("mamba", [best - 1]))
    got = {}
    for c, pages in reads:
        if op.stop:
            return
        key = op.keys[c]
        buffers = [bytearray(op.page_bytes[c]) for _ in pages]
        ok = await worker.call(
            lambda k=key, p=pages, b=buffers: store.batch_get_into(
                [k(chain[i]) for i in p], b
            )
        )
        if not all(ok):  # a miss, or a page that did not verify: the op is a miss
            return
        got[c] = buffers
    op.full = got[None]
    op.swa = got.get("swa", [])
    op.state_bytes = got["mamba"][0] if op.state else None
    op.length = best - first  # last: the scheduler reads the buffers only past it
