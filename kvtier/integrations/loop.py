"""The store's own thread for an engine adapter: one asyncio loop where every store call
runs, and the breaker in front of each call (docs/sglang.md, docs/vllm.md).

An adapter builds its store on this loop and calls it only from there: `run` when the
engine's thread may block on the answer (SGLang's prefetch and backup threads), `submit`
when it must not (vLLM's scheduler: the answer is polled). `tenant_of` is what the YAML's
tenant key (docs/security.md) gives every adapter: the key id for its namespace, the keyed
hash its engine's page keys go through before they become store keys, the seal of its store.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any
from collections.abc import Awaitable, Callable

import numpy as np

from kvtier.backends.base import Store
from kvtier.backends.seal import SealedCodec
from kvtier.config import NamespaceConfig
from kvtier.controller.breaker import Breaker, BreakerConfig
from kvtier.controller.config import ControllerConfig
from kvtier.controller.cpus import keep_to
from kvtier.errors import StoreError, StoreTimeout
from kvtier.hashing import KeyedHash


class LoopThread:
    """One asyncio loop on a daemon thread: the only place the store is used. `cpus`
    (`controller.cpus`) keeps it, and the store threads it starts, off the engine's cores."""

    def __init__(
        self, cpus: frozenset[int] | None = None, name: str = "kvtier-store"
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self._run, args=(cpus,), name=name, daemon=True
        )
        self.thread.start()

    def _run(self, cpus: frozenset[int] | None) -> None:
        keep_to(cpus)  # before any store thread is started from here: they inherit it
        self.loop.run_forever()

    def submit(self, coro: Awaitable) -> Future:
        """Start `coro` on the loop; its outcome arrives in the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Awaitable) -> Any:
        return self.submit(coro).result()

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass(slots=True, frozen=True)
class StoreTenant:
    """A tenant key's part in an engine adapter; all None without a key. Its repr names
    only the key's id."""

    key_id: str | None = None  # hex: the adapter's Namespace(tenant_key_id=...)
    keyed: KeyedHash | None = (
        None  # the engine's page keys go through it before they become store keys
    )
    codec: SealedCodec | None = None

    def seal(self, store: Store | None) -> None:
        """The store frames and reads every page sealed with the tenant's key."""
        if self.codec is not None and store is not None:
            store.seal_with(self.codec)


def tenant_of(ns: NamespaceConfig) -> StoreTenant:
    """The tenant key of the YAML's `namespace:` (`tenant_key`, `encrypt`) for an engine
    adapter; its keyed hash gives 32-byte page hashes, as SGLang's sha256 keys are."""
    keys = ns.tenant_keys()
    if keys is None:
        return StoreTenant()
    return StoreTenant(
        keys.current.key_id.hex(),
        keys.current.page_hash("sha256"),
        SealedCodec(keys.current_only(), ns.encrypt),
    )


def breaker_for(store_name: str, c: ControllerConfig) -> Breaker:
    """The breaker of the YAML's `controller:` settings, as the cache's storage thread uses."""
    return Breaker(
        store_name,
        BreakerConfig(
            c.store_down_after_failures,
            c.store_probe_backoff_s,
            c.store_probe_max_backoff_s,
        ),
    )


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


async def guarded(
    breaker: Breaker, call: Callable[[], Awaitable], fallback: Any
) -> Any:
    """One store call behind the breaker, on the loop. A failure is `fallback` (a miss); a
    timed-out call returns only once the store has stopped touching the caller's buffers,
    or has abandoned the call's stuck threads (a hung mount: the store is then down)."""
    if not breaker.admit():  # counted by the breaker
        return fallback
    try:
        result = await call()
    except StoreTimeout as exc:
        breaker.failed(str(exc))
        settled = getattr(exc, "settled", None)
        if settled is not None:
            breaker.abandoned(await settled)
        return fallback
    except StoreError as exc:
        breaker.failed(str(exc))
        return fallback
    breaker.succeeded()
    return result
