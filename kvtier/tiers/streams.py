"""Transfer streams: where pool<->mirror copies run, and how their completion is signalled.

`CpuTransferStream` runs jobs in order on one worker thread and signals through the
handle (layers landed, done) under one shared condition (used when there is no GPU, and
in every test); a thread that would block on a job the worker has not started runs it
(and the jobs queued before it) itself.
`CudaTransferStream` has a worker thread enqueue the same jobs on a side CUDA stream
(never the scheduler thread) and signals with CUDA events, made by that worker. A job's
completion is reported only by the copy that finished: an exception is stored on the
handle and re-raised to whoever waits on it.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections import deque
from typing import Any
from collections.abc import Callable

import torch

from kvtier.errors import TransferError


# One condition for every handle: a handle costs no lock or Event of its own (a load over 80
# layers would make 81 Events on the scheduler thread). Waiters are few (the scheduler
# thread, a drain); a notify wakes them all and each checks its own handle again.
_SIGNAL = threading.Condition(threading.Lock())


def _fresh_signal_after_fork() -> None:
    """A child forked while a worker held the condition's lock would inherit it held."""
    global _SIGNAL
    _SIGNAL = threading.Condition(threading.Lock())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_signal_after_fork)


class Handle:
    """Completion of one job: `landed` layers (in order, for loads) and `done` overall.
    The job's runner signals (`layer_done`, `finish`, `fail`); anyone may wait."""

    __slots__ = (
        "num_layers",
        "landed",
        "done",
        "error",
        "cuda_events",
        "run_here",
        "on_done",
        "missed",
    )

    def __init__(
        self, num_layers: int = 0, on_done: Callable[[], None] | None = None
    ) -> None:
        self.num_layers = num_layers
        self.landed = 0  # layers [0, landed) have landed (all of them once done)
        self.done = False
        self.error: BaseException | None = None
        self.cuda_events: list | None = (
            None  # CUDA stream: one per layer, made by its worker
        )
        self.run_here: Callable[[], None] | None = (
            None  # CPU stream: run the job on the waiter's thread if not started
        )
        self.on_done = on_done  # called by the runner once `done` is set (the controller counts moves)
        self.missed = False  # a forward's wait for a layer gave up: that forward read KV not landed (LayerWaiter)

    def layer_done(self, layer: int) -> None:
        if self.cuda_events is not None:
            self.cuda_events[layer].record()  # on the side stream the job runs under
        with _SIGNAL:
            self.landed = max(self.landed, layer + 1)
            _SIGNAL.notify_all()

    def finish(self) -> None:
        with _SIGNAL:
            self.landed, self.done = self.num_layers, True
            if (
                self.on_done is not None
            ):  # before any waiter wakes: one that polls next sees it
                self.on_done()
            _SIGNAL.notify_all()

    def fail(self, exc: BaseException) -> None:
        """Every waiter wakes up (layer waiters too) and sees the error."""
        self.error = exc
        self.finish()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the job has finished (or failed); False on timeout."""
        with _SIGNAL:
            return _SIGNAL.wait_for(lambda: self.done, timeout)

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """CPU: until the layer has landed (running the job here if the worker has not
        started it: `CpuTransferStream`). CUDA: until the worker has *enqueued* the
        layer's copy and recorded its event (microseconds), then the caller's stream waits
        on that event on the device: the host never waits for the copy itself. (Waiting on
        an event not yet recorded would be a no-op: the forward would read unloaded KV.)"""
        run = self.run_here  # read once: the runner clears it when the job ends
        if run is not None and self.landed <= layer:
            run()
        if self.landed <= layer:
            with _SIGNAL:
                if not _SIGNAL.wait_for(lambda: self.landed > layer, timeout):
                    raise TransferError(f"layer {layer} did not land within {timeout}s")
        if self.cuda_events is not None and self.error is None:
            torch.cuda.current_stream().wait_event(self.cuda_events[layer])
        if self.error is not None:
            raise TransferError(f"load failed: {self.error}") from self.error

    def is_done(self) -> bool:
        return self.done


Job = Callable[[Handle], None]


class TransferStream(ABC):
    @abstractmethod
    def submit(self, job: Job, handle: Handle) -> Handle:
        """Run `job(handle)` after every job submitted before it; it signals `handle`."""

    @abstractmethod
    def close(self) -> None: ...

    def threads(self) -> list[threading.Thread]:
        """The threads this stream runs jobs on (to keep them on `controller.cpus`)."""
        return []

    def wait(self, handle: Handle, timeout: float) -> bool:
        """Block until `handle`'s job has finished (or failed); False on timeout. Only
        drains and write-back eviction wait like this, never a forward."""
        return handle.wait(timeout)


class _Finisher:
    """Runs `step(item)` for each queued (item, handle) in order and settles the handle:
    failed with the exception, or finished. Its thread runs them; `run_until(handle)` lets
    a thread that would wait for `handle` run the queue up to it instead. One runner at a
    time (`_busy`), always the oldest job first: the order holds whoever runs a job."""

    def __init__(self, name: str, step: Callable[[Any], None]) -> None:
        self._items: deque = deque()
        self._cv = threading.Condition(threading.Lock())
        self._busy = False  # a job is running (on the thread or a waiter's)
        self._step = step
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, item: Any, handle: Handle) -> None:
        with self._cv:
            self._items.append((item, handle))
            self._cv.notify()

    def _take(self):
        """The oldest job, now ours to run; None if it is someone else's turn or none is queued."""
        if self._busy or not self._items or self._items[0] is None:
            return None
        self._busy = True
        return self._items.popleft()

    def _settle(self, item: Any, handle: Handle) -> None:
        try:
            self._step(item)
        except BaseException as exc:  # the waiter learns of it; the runner keeps going
            handle.fail(exc)
            if (
                not isinstance(exc, Exception)
                and threading.current_thread() is not self.thread
            ):
                raise  # a waiter's KeyboardInterrupt stays its own
        else:
            handle.finish()
        finally:
            handle.run_here = (
                None  # (it refers to the handle: no cycle outlives the job)
            )
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while (entry := self._take()) is None:
                    if self._items and self._items[0] is None and not self._busy:
                        return
                    self._cv.wait()
            self._settle(*entry)

    def run_until(self, handle: Handle) -> None:
        """Run queued jobs, oldest first, on this thread until `handle`'s has run; return
        at once when a job is running elsewhere (the caller then waits as usual)."""
        while not handle.done:
            with self._cv:
                entry = self._take()
            if entry is None:
                return
            self._settle(*entry)

    def close(self) -> None:
        with self._cv:
            self._items.append(None)
            self._cv.notify_all()
        self.thread.join()


class CpuTransferStream(TransferStream):
    """Jobs run in order on a worker thread. A thread about to wait for a job the worker has
    not started runs it itself (with the jobs queued before it): on a CPU pool the copy is
    the wait, and a hand-off to a thread that must first win the GIL costs more than the
    bytes (docs/design.md §2). `help_waiters=False` keeps every job on the worker."""

    def __init__(self, name: str, help_waiters: bool = True) -> None:
        self._worker = _Finisher(f"kvtier-{name}", lambda item: item[0](item[1]))
        self._help = help_waiters

    def submit(self, job: Job, handle: Handle) -> Handle:
        if self._help:
            handle.run_here = lambda: self._worker.run_until(handle)
        self._worker.put((job, handle), handle)
        return handle

    def wait(self, handle: Handle, timeout: float) -> bool:
        if self._help:
            self._worker.run_until(handle)
        return handle.wait(timeout)

    def threads(self) -> list[threading.Thread]:
        return [self._worker.thread]

    def close(self) -> None:
        self._worker.close()


class CudaTransferStream(TransferStream):
    """A worker thread enqueues each job's copies on a side stream (non-blocking, from
    pinned host memory); per-layer CUDA events mark landings.

    `submit` only records an event on the caller's stream (the KV it wrote before
    submitting) and queues the job: the scheduler thread never launches a copy. The worker
    makes the side stream wait for that event, runs the job under the side stream (its
    `layer_done` records each layer's event, then lets waiters through), records the job's
    final event and waits for it, then marks the handle finished for the scheduler's acks.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._worker = _Finisher(f"kvtier-{name}", self._run)

    def submit(self, job: Job, handle: Handle) -> Handle:
        ready = torch.cuda.Event()
        ready.record(
            torch.cuda.current_stream(self.device)
        )  # KV written before we copy it
        self._worker.put((job, handle, ready), handle)
        return handle

    def _run(self, item) -> None:
        job, handle, ready = item
        torch.cuda.set_device(self.device)
        handle.cuda_events = [
            torch.cuda.Event() for _ in range(handle.num_layers)
        ]  # here, not on the scheduler
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            job(handle)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # this worker waits, not the scheduler

    def threads(self) -> list[threading.Thread]:
        return [self._worker.thread]

    def close(self) -> None:
        self._worker.close()
        self.stream.synchronize()


def make_stream(name: str, device: torch.device) -> TransferStream:
    """A cache's streams: on CPU every copy runs on the worker, never on the scheduler
    thread while it waits (docs/design.md §2)."""
    if device.type == "cuda":
        return CudaTransferStream(name, device)
    return CpuTransferStream(name, help_waiters=False)
