"""Threads for blocking store I/O that a stuck call cannot take down with it.

A read on a hung NFS or FUSE mount never returns: the thread that made it is lost. Such a
thread must not hold the process (a `ThreadPoolExecutor`'s threads are joined at exit and
by `shutdown`), nor the pool's capacity, nor the call that waits on it. Here:

- `IoThreads` runs jobs on daemon threads; `abandon(futures)` gives up on the threads
  running those jobs (each is replaced by a fresh one, up to a bound) and `shutdown` waits
  for the others only, up to a timeout.
- `settle_jobs` awaits a call's jobs like `Store._in_threads` (never ending the call while
  a job may still touch the caller's buffers), except that once the call is cancelled it
  waits at most `grace_s` more: jobs still running then are abandoned, their `stop` event
  set (a job checks it between pages: it touches no further buffer), and `StoreAbandoned`
  raised. A job that writes the caller's buffers only through `StopFlag.writing` (the
  file store's reads) writes none of them from then on; other buffers of those jobs may
  still be written by the stuck threads: whoever owns them keeps them out of use for good
  (the storage worker quarantines them).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Executor, Future
from queue import SimpleQueue
from collections.abc import Callable

from kvtier.errors import StoreAbandoned


class StopFlag(threading.Event):
    """A call's `stop` for its thread jobs: set when the call gives up on them. A job
    holds `writing` around every write into the caller's buffers and checks `is_set()`
    inside it; `set()` takes `writing`, so once it returned no job writes those buffers
    (it waits at most for one copy in progress, which never blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = threading.Lock()

    def set(self) -> None:
        with self.writing:
            super().set()


class IoThreads(Executor):
    def __init__(self, size: int, name: str, max_replaced: int | None = None) -> None:
        self.size, self.name = size, name
        self.max_replaced = 4 * size if max_replaced is None else max_replaced
        self._jobs: SimpleQueue = SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[threading.Thread, Future] = {}
        self._threads: list[threading.Thread] = []
        self._given_up: set[threading.Thread] = set()
        self.abandoned = 0  # threads given up on (stuck in a call)
        self._closed = False

    def _spawn(self) -> None:
        """A thread started by the thread that submits (the store's loop thread): it keeps
        to that thread's CPUs (storeio/cpus.py), as a ThreadPoolExecutor's would."""
        t = threading.Thread(
            target=self._work, name=f"{self.name}_{len(self._threads)}", daemon=True
        )
        self._threads.append(t)
        t.start()

    def start_all(self) -> None:
        """Start every thread now, from this thread (their CPUs: `_spawn`), for a pool
        that other threads submit to later (the file store's direct calls)."""
        with self._lock:
            while len(self._threads) - len(self._given_up) < self.size:
                self._spawn()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._closed:
            raise RuntimeError(f"{self.name}: shut down")
        fut: Future = Future()
        with self._lock:
            if (
                len(self._threads) - len(self._given_up) < self.size
                and len(self._threads) < self.size + self.max_replaced
            ):
                self._spawn()
        self._jobs.put((fut, fn, args, kwargs))
        return fut

    def _work(self) -> None:
        me = threading.current_thread()
        while (item := self._jobs.get()) is not None:
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[me] = fut
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                fut.set_exception(exc)
            finally:
                with self._lock:
                    self._running.pop(me, None)
                    late = me in self._given_up
            if late:  # came back after being replaced: the pool is whole without it
                return

    def abandon(self, futures: list) -> int:
        """Give up on the threads running `futures` (concurrent futures); how many."""
        wanted = set(futures)
        with self._lock:
            stuck = [
                t
                for t, f in self._running.items()
                if f in wanted and t not in self._given_up
            ]
            for t in (
                stuck
            ):  # the next submit starts one in its place (up to max_replaced in all)
                self._given_up.add(t)
                self.abandoned += 1
        return len(stuck)

    def shutdown(
        self,
        wait: bool = True,
        *,
        cancel_futures: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Stop the threads; with `wait`, join those not given up on (up to `timeout` in all)."""
        self._closed = True
        if cancel_futures:
            while not self._jobs.empty():
                item = self._jobs.get_nowait()
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if not wait:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            if t in self._given_up:
                continue
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


async def settle_jobs(
    jobs: list[asyncio.Future], grace_s: float, give_up: Callable[[], int]
) -> list:
    """The jobs' results, in order (see the module docstring); `give_up()` abandons the jobs
    still running and returns how many it abandoned."""
    if not jobs:
        return []
    loop = asyncio.get_running_loop()
    cancelled, deadline = None, None
    while True:
        try:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            _, pending = await asyncio.wait(
                jobs, timeout=timeout
            )  # asyncio.wait never cancels them
            if not pending:
                break
            n = give_up()
            for job in (
                jobs
            ):  # retrieve what the others ended with: asyncio logs nothing at exit
                if job.done() and not job.cancelled():
                    job.exception()
            raise StoreAbandoned(
                f"{n} I/O thread(s) stuck for {grace_s:.1f}s after the call's timeout: "
                "abandoned (their buffers stay out of use)"
            )
        except asyncio.CancelledError as exc:
            cancelled = exc
            if all(j.done() for j in jobs):
                break
            deadline = loop.time() + grace_s
    errors = [j.exception() for j in jobs if not j.cancelled()]
    if cancelled is not None:
        raise cancelled
    for error in errors:
        if error is not None:
            raise error
    return [j.result() for j in jobs]
