"""A hybrid model's store prefetch: the FULL pages past a request's match, the SWA window
that ends where they end and the state taken exactly there, brought to host in one op.

Two phases, as a FULL prefetch (controller/storage.py):

1. storage thread: which lengths could be restored, by existence on the store: FULL
   pages `batch_exists` (a leading run), then per candidate end the state under the
   MAMBA namespace and the window's pages under the SWA namespace (`exists_each`); the
   longest end every component has. It reads those pages (each store page verified by its
   frame) into buffers of its own; a page of any component missing or not verifying
   makes that end not restorable: the next shorter end whose pages all verify is taken
   (its missing pages read then), or none (`length` 0, a miss): never wrong bytes;
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
    got = {
        None: {},
        "swa": {},
        "mamba": {},
    }  # per component: page -> verified bytes or None

    async def have(c, pages) -> bool:
        """Are `pages` of component `c` read and verified? (Reads those not read yet.)"""
        todo = [i for i in pages if i not in got[c]]
        if todo:
            key, buffers = op.keys[c], [bytearray(op.page_bytes[c]) for _ in todo]
            ok = await worker.call(
                lambda: store.batch_get_into([key(chain[i]) for i in todo], buffers)
            )
            for i, b, good_read in zip(todo, buffers, ok):
                got[c][i] = b if good_read else None
        return all(got[c][i] is not None for i in pages)

    for e in sorted((e for e, g in zip(ends, good) if g), reverse=True):
        if op.stop:
            return
        if not await have(None, range(first, e)):
            continue  # a FULL page below e missing or not verifying: a shorter end
        if w and not await have("swa", range(max(0, e - w), e)):
            continue
        if op.state and not await have("mamba", [e - 1]):
            continue
        op.full = [got[None][i] for i in range(first, e)]
        op.swa = [got["swa"][i] for i in range(max(0, e - w), e)] if w else []
        op.state_bytes = got["mamba"][e - 1] if op.state else None
        op.length = e - first  # last: the scheduler reads the buffers only past it
        return
