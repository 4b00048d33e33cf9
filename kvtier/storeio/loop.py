"""The store loop: one asyncio loop on a thread of its own, where every call to one store
runs (the cache's storage thread, the linker's, each engine adapter's).

A caller's thread hands it work three ways: `submit` (a coroutine; its outcome arrives in a
concurrent Future: `run` blocks on it, for an engine thread that may block), `post` (a
callable; the first since the loop last woke wakes it with a write that keeps the GIL,
`waker.py`, and the others ride along: the scheduler's way, which must not wait), and
`start` (an op's coroutine through `post`, counted so that `drain` waits for it).
`cpus` (`controller.cpus`) keeps the thread, and the store threads it starts, off the
engine's cores.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from kvtier.backends.base import Store
from kvtier.storeio.cpus import keep_to
from kvtier.storeio.waker import Waker

log = logging.getLogger(__name__)


class StoreLoop:
    def __init__(
        self, cpus: frozenset[int] | None = None, name: str = "kvtier-store"
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self._pending: list[Callable[[], None]] = []  # posted since the loop last woke
        self._pending_lock = threading.Lock()
        self._wake_scheduled = False
        self._waker = Waker(self.loop, self._run_pending)
        self._running = 0  # ops started and not ended: `drain` waits until none is
        self._ended = threading.Condition(threading.Lock())
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

    def run(self, coro: Awaitable, timeout: float | None = None) -> Any:
        return self.submit(coro).result(timeout)

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def post(self, fn: Callable[[], None]) -> None:
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
            try:
                fn()
            except (
                Exception
            ):  # a bug in one posted call must not drop the rest of its batch
                log.exception(
                    "store loop: a posted call raised; the rest of its batch runs"
                )

    def start(self, coro: Awaitable) -> None:
        """Run an op's `coro` on the loop (through `post`); `drain` waits for it. Counted,
        not given a future: a concurrent Future per op (a Condition, two callbacks) cost
        the scheduler thread ~3.5 us an op."""
        with self._ended:
            self._running += 1
        self.post(lambda: self.loop.create_task(self._counted(coro)))

    async def _counted(self, coro: Awaitable) -> None:
        try:
            await coro
        finally:
            with self._ended:
                self._running -= 1
                if not self._running:
                    self._ended.notify_all()

    def drain(self, timeout: float) -> None:
        """Wait for every started op to end (they all do: each store call has a timeout)."""
        with self._ended:
            self._ended.wait_for(lambda: not self._running, timeout)

    def shutdown(self, store: Store, timeout: float) -> None:
        """Drain, close `store` on the loop, stop the loop."""
        self.drain(timeout)
        try:
            self.run(store.close(), timeout)
        except Exception as exc:
            log.warning("closing store: %s", exc)
        self.close(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop (what runs on it is dropped: `drain` first to let it end)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self._waker.close(self.loop)
            self.loop.close()
