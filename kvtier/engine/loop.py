"""One scheduler thread that owns an Engine and its cache, for a server.

Requests from any thread are queued (`generate` returns a Future); the thread admits
them into the engine's batch between steps, so concurrent clients share forwards. It
polls the cache on every step and, when nothing runs, every `idle_poll_s`: background
writes and backups are applied while the server is idle, not at the next request. Every
other use of the cache (`call`: stats, metrics, flush) runs on the same thread, between
steps: the cache has one owner.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any
from collections.abc import Callable

from kvtier.engine.engine import Engine, Result
from kvtier.engine.workloads import Turn

log = logging.getLogger(__name__)


class Busy(RuntimeError):
    """The queue is full: the server is at its bound (a 503)."""


class EngineLoop:
    def __init__(
        self, engine: Engine, max_queue: int = 1024, idle_poll_s: float = 0.05
    ) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.idle_poll_s = idle_poll_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[
            str, Future
        ] = {}  # ticket -> the caller's future (loop thread only)
        self._queued = (
            0  # generate requests accepted, not answered (any thread: under _lock)
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.served = 0
        self.refused_busy = 0
        self.idle_polls = 0
        self._thread = threading.Thread(
            target=self._run, name="kvtier-engine", daemon=True
        )
        self._thread.start()

    def generate(self, turn: Turn, remember: bool) -> Future:
        """Queue one request; its Future ends with the engine's Result. Busy if full."""
        with self._lock:
            if self._queued >= self.max_queue:
                self.refused_busy += 1
                raise Busy(
                    f"{self._queued} requests queued: at most {self.max_queue} (--max-queue); retry later"
                )
            self._queued += 1
        fut: Future = Future()
        self._inbox.put(("generate", (turn, remember), fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the loop thread between steps; its Future ends with what it returns."""
        fut: Future = Future()
        self._inbox.put(("call", fn, fut))
        return fut

    def stats(self) -> dict:
        """On the loop thread (through `call`): the server's own numbers."""
        return {
            "queued": self._queued,
            "max_queue": self.max_queue,
            "served": self.served,
            "refused_busy": self.refused_busy,
            "idle_polls": self.idle_polls,
            "held_back": self.engine.held_back,
            "preempted": self.engine.preempted,
            "passed_over": self.engine.passed_over,
            "sliced": self.engine.sliced,
        }

    def close(self, timeout: float = 30.0) -> None:
        """Stop after the requests in hand (up to `timeout`), then close the cache."""
        self._stop.set()
        self._inbox.put(("wake", None, None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "engine loop still busy after %.0fs; closing the cache anyway", timeout
            )
        self.engine.cache.close()

    def _run(self) -> None:
        while True:
            idle = not self.engine.pending()
            if idle and self._stop.is_set():
                return
            self._take(block=idle)
            try:
                if self.engine.pending():
                    self._deliver(self.engine.step())
                else:
                    self.idle_polls += 1
                    self.engine.cache.poll()  # nothing runs: still apply what finished
            except (
                Exception
            ) as exc:  # a bug of ours: fail what is in hand, keep serving
                log.exception("engine step failed")
                self._fail_all(exc)

    def _take(self, block: bool) -> None:
        """Move everything queued into the engine; when idle, wait up to `idle_poll_s` first."""
        try:
            item = (
                self._inbox.get(timeout=self.idle_poll_s)
                if block
                else self._inbox.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, arg, fut: Future | None) -> None:
        if kind == "generate":
            turn, remember = arg
            self._futures[self.engine.submit(turn, remember)] = fut
        elif kind == "call":
            try:
                fut.set_result(arg())
            except Exception as exc:
                fut.set_exception(exc)

    def _deliver(self, results: list[Result]) -> None:
        for r in results:
            fut = self._futures.pop(r.ticket, None)
            if fut is None:  # failed already (`_fail_all`)
                continue
            with self._lock:
                self._queued -= 1
            self.served += 1
            if not fut.done():
                fut.set_result(r)

    def _fail_all(self, exc: Exception) -> None:
        futures, self._futures = self._futures, {}
        with self._lock:
            self._queued -= len(futures)
        for fut in futures.values():
            if not fut.done():
                fut.set_exception(exc)
