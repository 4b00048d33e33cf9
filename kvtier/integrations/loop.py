"""The store's own thread for an engine adapter: one asyncio loop where every store call
runs, and the breaker in front of each call (docs/sglang.md, docs/vllm.md).

An adapter builds its store on this loop and calls it only from there: `run` when the
engine's thread may block on the answer (SGLang's prefetch and backup threads), `submit`
when it must not (vLLM's scheduler: the answer is polled).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Awaitable, Callable

from kvtier.controller.breaker import Breaker, BreakerConfig
from kvtier.controller.config import ControllerConfig
from kvtier.controller.cpus import keep_to
from kvtier.errors import StoreError, StoreTimeout


class LoopThread:
    """One asyncio loop on a daemon thread: the only place the store is used. `cpus`
    (`controller.cpus`) keeps it, and the store threads it starts, off the engine's cores."""

    def __init__(self, cpus: frozenset[int] | None = None, name: str = "kvtier-store") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, args=(cpus,), name=name, daemon=True)
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


def breaker_for(store_name: str, c: ControllerConfig) -> Breaker:
    """The breaker of the YAML's `controller:` settings, as the cache's storage thread uses."""
    return Breaker(store_name, BreakerConfig(c.store_down_after_failures, c.store_probe_backoff_s,
                                             c.store_probe_max_backoff_s))


async def guarded(breaker: Breaker, call: Callable[[], Awaitable], fallback: Any) -> Any:
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
