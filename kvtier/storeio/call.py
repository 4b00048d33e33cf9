"""The breaker-guarded store call, an op's lifetime around its calls, and the staged read:
each written once, for every client of the store loop (the cache's `StorageWorker`, the
SGLang linker, the SGLang storage backend, the vLLM tier). All run on the store loop.

- `store_call`: one call the breaker admits (or skips: `StoreDown`) and learns the outcome
  of; a failure is raised, and the caller awaits its settling (`settle`) when its buffers
  may be touched no more.
- `guarded`: `store_call` whose failure is a fallback value, returned once settled.
- `lifetime`: an op's phases (ops.py) around its calls: FINISHED when they returned,
  SETTLED (or ABANDONED) once the failure they ended with has settled.
- `read_staged`: a read into an engine's memory that never writes it once given up on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from kvtier.backends.base import Store
from kvtier.errors import KvtierError, StoreDown, StoreError, StoreTimeout
from kvtier.storeio.breaker import Breaker
from kvtier.storeio.ops import Phase, StoreOp

T = TypeVar("T")


async def store_call(
    breaker: Breaker, call: Callable[[], Awaitable[T]], *, admitted: bool = False
) -> T:
    """`call()`, one store call whose outcome the breaker learns (a miss or a page that
    does not verify is no failure). `admitted`: the op it belongs to was admitted already
    (one admission per op: a prefetch's calls all go, or none). A `KvtierError` is counted
    and raised; a timed-out call's buffers are the caller's only after `settle`."""
    if not admitted and not breaker.admit():  # counted by the breaker
        raise StoreDown(f"store {breaker.name} is down: call skipped")
    try:
        result = await call()
    except KvtierError as exc:
        breaker.failed(str(exc))
        raise
    breaker.succeeded()
    return result


def direct_admitted(breaker: Breaker) -> bool:
    """`store_call`'s admission for a store call made off the loop, from the caller's own
    thread (the file store's direct calls, backends/file_direct.py: the breaker holds a
    lock for them); a skip is counted by the breaker."""
    return breaker.admit()


def direct_ended(breaker: Breaker, failure: BaseException | None) -> None:
    """What a direct call ended with, for the breaker, as `store_call` and `settle` tell
    it of a loop call's: None (answered), a StoreAbandoned (its threads were given up on
    stuck: the store is down now), or another store failure (a timeout, no page written)."""
    if failure is None:
        breaker.succeeded()
    elif not breaker.abandoned(failure):
        breaker.failed(str(failure))


async def settle(breaker: Breaker, failure: BaseException | None) -> bool:
    """Wait until the call that raised `failure` stopped touching its buffers; True if it
    was abandoned stuck (a hung mount: the breaker puts the store down at once)."""
    if not isinstance(failure, StoreTimeout) or failure.settled is None:
        return False
    return breaker.abandoned(await failure.settled)


async def guarded(
    breaker: Breaker, call: Callable[[], Awaitable], fallback: Any
) -> Any:
    """`store_call` on its own: a skip or a failure is `fallback` (a miss); a timed-out call
    returns only once the store has stopped touching the caller's buffers, or has abandoned
    the call's stuck threads (a hung mount: the store is then down)."""
    try:
        return await store_call(breaker, call)
    except StoreDown:
        return fallback
    except StoreError as exc:
        await settle(breaker, exc)
        return fallback


async def send_hint(
    breaker: Breaker,
    store: Store,
    in_order: asyncio.Lock,
    keys: list[str],
    lease_s: float | None,
    priority: int | None,
    complain: Callable[[str, str], None],
) -> int | None:
    """An agent's hint for `keys` to the store (`Store.hint`), one guarded call at a time
    under `in_order` (a store's hint may read, then write: two at once would lose one).
    Advice: a skip or a failure is None (a failure logged through `complain`), never
    raised; else how many pages the store acted on."""
    try:
        async with in_order:
            done = await store_call(
                breaker, lambda: store.hint(keys, lease_s=lease_s, priority=priority)
            )
    except StoreDown:  # skipped: a hint is not worth waiting for the store
        return None
    except Exception as exc:  # advice: never an op's failure
        complain("hint", f"hint for {len(keys)} pages failed: {exc}")
        return None
    return int(done or 0)


async def lifetime(
    breaker: Breaker,
    op: StoreOp,
    calls: Callable[[], Awaitable[BaseException | None]],
    moved: Callable[[], None],
    *,
    finish_settled: bool = False,
) -> None:
    """Run an op's `calls`, which return the failure it ended with (or None) and never
    raise; `moved()` after each phase its readers wait for. The op is FINISHED once they
    returned, then SETTLED once that failure settled, ABANDONED if its call was abandoned
    stuck while it could write the op's pages (`StoreOp.writes_pages`).
    `finish_settled`: no FINISHED before SETTLED (a write, whose pages stay protected)."""
    op.phase = Phase.RUNNING
    failure = None
    try:
        failure = await calls()
    finally:
        if not finish_settled:
            op.phase = Phase.FINISHED
            moved()
    abandoned = await settle(breaker, failure)
    op.phase = Phase.ABANDONED if abandoned and op.writes_pages() else Phase.SETTLED
    moved()


class StagingPool:
    """Buffers where `read_staged` reads pages of a store that cannot promise
    `reads_end_with_call`, before they are copied into an engine's memory: reused, so a
    call faults in no fresh memory, and at most `limit_bytes` kept. The store's loop
    thread alone uses it. The buffers of a call that failed are dropped, never reused: a
    thread it abandoned may still write them."""

    def __init__(self, limit_bytes: int = 64 << 20) -> None:
        self.limit_bytes, self.kept = limit_bytes, 0
        self._free: dict[int, list[np.ndarray]] = {}

    def take(self, nbytes: int) -> np.ndarray:
        free = self._free.get(nbytes)
        if free:
            self.kept -= nbytes
            return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, bufs: list[np.ndarray]) -> None:
        for buf in bufs:
            if self.kept + buf.size <= self.limit_bytes:
                self._free.setdefault(buf.size, []).append(buf)
                self.kept += buf.size


async def read_staged(
    breaker: Breaker,
    store: Store,
    keys: list[str],
    views: list[memoryview],
    pool: StagingPool | None = None,
    errors: set[str] | None = None,
) -> list[bool] | None:
    """`store.batch_get_into(keys, views)` behind the breaker, never writing an engine's
    `views` once the call was given up on stuck (a hung mount: the engine frees and
    reuses them). A store whose reads end with the call (`reads_end_with_call`: the
    file store copies each checked chunk in under the call's stop flag) reads straight
    into them; any other reads into buffers of kvtier's own (from `pool` where given),
    copied into `views` only for pages that verified, once the call returned. A `views`
    entry whose page failed may hold garbage. None: the call failed as a whole (the
    breaker skipped the store, a timeout, an error), which says nothing of whether the
    store holds the pages; nor does a key put in `errors` (`Store.batch_get_into`)."""
    if store.reads_end_with_call:
        return await guarded(
            breaker, lambda: store.batch_get_into(keys, views, errors), None
        )
    staged = [
        np.empty(len(v), dtype=np.uint8) if pool is None else pool.take(len(v))
        for v in views
    ]
    ok = await guarded(
        breaker,
        lambda: store.batch_get_into(keys, [memoryview(s) for s in staged], errors),
        None,
    )
    for view, page, good in zip(views, staged, ok or []):
        if good:  # numpy's copy lets the GIL go for a big page: the engine's threads run meanwhile
            np.copyto(np.frombuffer(view, dtype=np.uint8), page)
    if ok is not None and pool is not None:
        pool.give(staged)
    return ok
