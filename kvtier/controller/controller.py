"""The cache controller: moves KV between the pool, the mirror and the store.

It owns every asynchronous thing — the write and load streams, the storage thread, the
op queues — and never touches the tree. Ops carry an opaque `tag` (the cache's node);
the scheduler thread asks how many ops are finished (`ready()`), agrees on the counts
across ranks, and pops exactly that many, in submission order.

Slot ownership (device / host):

| state                               | held by                          |
|-------------------------------------|----------------------------------|
| free                                | the allocator                    |
| reserved for a write / a prefetch   | the op, until the cache pops it  |
| in the tree                         | the tree (the cache frees them)  |
| handed to a request                 | the request, via the cache       |
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.backends.base import Store
from kvtier.controller.breaker import BreakerConfig
from kvtier.controller.config import ControllerConfig
from kvtier.controller.cpus import check_cpus, confine
from kvtier.controller.storage import BackupOp, PrefetchOp, StorageWorker
from kvtier.controller.streams import Handle, make_stream
from kvtier.tiers.allocator import PagedAllocator
from kvtier.tiers.indices import check_slots, concat, page_slots
from kvtier.tiers.mirror import HostMirror
from kvtier.tiers.pool import DeviceKVPool


@dataclass(eq=False)
class WriteOp:
    device_slots: np.ndarray
    host_slots: np.ndarray
    tag: Any
    handle: Handle | None = None
    started: float = field(default_factory=time.perf_counter)
    applied: bool = False  # the scheduler took it (its host slots went to the tree or back)
    failed_elsewhere: bool = False  # landed here, failed on another rank: failed on every rank


@dataclass(eq=False)
class LoadOp:
    """A host->device copy into fresh device slots. The slots belong to the op until its
    worker has returned, then to whoever started it (a request): nothing in the tree
    points at them while the copy is in flight. `orphaned`: the request let go before the
    copy ended, so the scheduler frees the slots when it applies the op."""

    host_slots: np.ndarray
    device_slots: np.ndarray
    tag: Any
    handle: Handle
    started: float = field(default_factory=time.perf_counter)
    orphaned: bool = False

    @property
    def ok(self) -> bool:
        """Landed without error (False while in flight)."""
        return self.handle.is_done() and self.handle.error is None


class CacheController:
    def __init__(self, pool: DeviceKVPool, mirror: HostMirror | None, store: Store | None,
                 config: ControllerConfig, stream_factory=make_stream, clock=time.monotonic) -> None:
        """`stream_factory(name, device)` makes the write and load streams (a test passes
        one whose every copy it schedules itself); `clock` times the store breaker's probes."""
        cpus = check_cpus(config.cpus)  # before any thread starts: a bad value leaves nothing behind
        self.pool = pool
        self.mirror = mirror
        self.config = config
        self.page_size = pool.config.page_size
        self.device_alloc = PagedAllocator(pool.config.size, self.page_size)
        self.host_lock = threading.Lock()  # the mirror's allocator is shared with the storage thread
        self.write_stream = stream_factory("write", pool.device)
        self.load_stream = stream_factory("load", pool.device)
        for t in [*self.write_stream.threads(), *self.load_stream.threads()]:
            confine(t.native_id, cpus)  # they start no threads of their own: no race
        self.storage = None
        if store is not None and mirror is not None:
            breaker = BreakerConfig(config.store_down_after_failures, config.store_probe_backoff_s,
                                    config.store_probe_max_backoff_s)
            self.storage = StorageWorker(store, mirror, config.max_inflight_prefetch_bytes, breaker, clock, cpus)
        self._queued_writes: list[WriteOp] = []
        self.writes: deque[WriteOp] = deque()
        self.loads: deque[LoadOp] = deque()
        self.backups: deque[BackupOp] = deque()
        self.prefetches: dict[str, PrefetchOp] = {}  # in submission order
        self.unsettled: list[PrefetchOp] = []  # finished, but the store may still write their pages
        self.quarantined: list[np.ndarray] = []  # host pages a stuck store read may still write

    @property
    def store(self) -> Store | None:
        return self.storage.store if self.storage else None

    # -- host slots (the lock makes accounting snapshots consistent) --------------------------

    def alloc_host(self, n: int) -> np.ndarray | None:
        with self.host_lock:
            return self.mirror.allocator.alloc_slots(n)

    def free_host(self, slots: np.ndarray) -> None:
        if slots.size:
            with self.host_lock:
                self.mirror.allocator.free_slots(slots)

    def free_unused_pages(self, op: PrefetchOp) -> None:
        """A settled op's host pages past those inserted go back, but those of a read that
        was abandoned stuck (`op.quarantined`): kept out of use for good, counted."""
        pages = op.host_pages[op.inserted:]
        if op.quarantined is not None:
            stuck = np.isin(pages, op.quarantined)
            self.quarantined.append(pages[stuck])
            pages = pages[~stuck]
        self.free_host_pages(pages)

    def free_host_pages(self, pages: np.ndarray) -> None:
        if pages.size:
            with self.host_lock:
                self.mirror.allocator.free_pages(pages)

    def host_available(self) -> int:
        with self.host_lock:
            return self.mirror.allocator.available_size()

    def grant(self, op: PrefetchOp, pages: int) -> int:
        """Reserve up to `pages` free host pages for `op` and let its reads start."""
        ps = self.page_size
        with self.host_lock:
            take = min(pages, self.mirror.allocator.available_size() // ps)
            if take:
                op.host_pages = self.mirror.allocator.alloc_pages(take)
        op.granted = True
        self.storage.wake(op)
        return take

    def stop_prefetch(self, op: PrefetchOp) -> None:
        op.stop = True
        self.storage.wake(op)

    def page_slots(self, pages: np.ndarray) -> np.ndarray:
        """The slots of `pages` (numpy: no GIL hand-off on the scheduler thread; docs/design.md §2)."""
        return page_slots(pages, self.page_size)

    # -- device -> host -----------------------------------------------------------------------

    def write(self, device_slots: np.ndarray, tag: Any) -> np.ndarray | None:
        """Reserve host slots and queue a device->host copy; None if the mirror is full."""
        host = self.alloc_host(device_slots.size)
        if host is None:
            return None
        self._queued_writes.append(WriteOp(device_slots, host, tag))
        return host

    def flush_writes(self) -> None:
        """Submit every queued write as one merged transfer."""
        if not self._queued_writes:
            return
        ops, self._queued_writes = self._queued_writes, []
        dev = _joined([op.device_slots for op in ops])
        host = _joined([op.host_slots for op in ops])
        mirror, pool = self.mirror, self.pool
        handle = self.write_stream.submit(lambda h: mirror.backup(pool, dev, host), Handle())
        for op in ops:
            op.handle = handle
            self.writes.append(op)

    # -- host -> device -----------------------------------------------------------------------

    def load(self, host_slots: np.ndarray, device_slots: np.ndarray, tag: Any) -> LoadOp:
        """Copy host slots into (already allocated) device slots, one layer at a time."""
        mirror, pool = self.mirror, self.pool
        check_slots("host_slots", host_slots)
        check_slots("device_slots", device_slots, host_slots.size)

        def job(h: Handle) -> None:
            plan = mirror.plan(device_slots, host_slots)  # by whoever runs the job (streams.py)
            for layer in range(pool.num_layers):
                mirror.load_layer(pool, host_slots, device_slots, layer, plan)
                h.layer_done(layer)

        handle = self.load_stream.submit(job, Handle(pool.num_layers))
        op = LoadOp(host_slots, device_slots, tag, handle)
        self.loads.append(op)
        return op

    # -- host <-> store -----------------------------------------------------------------------

    def backup(self, keys: list[str], host_pages: np.ndarray, tag: Any) -> BackupOp | None:
        if self.storage is None:
            return None
        op = BackupOp(keys, host_pages, tag)
        self.backups.append(op)
        self.storage.submit_backup(op)
        return op

    def prefetch(self, op: PrefetchOp) -> None:
        if op.request_id in self.prefetches:
            raise ValueError(f"prefetch: request_id={op.request_id!r} already has a prefetch in flight")
        self.prefetches[op.request_id] = op
        self.storage.submit_prefetch(op)

    # -- completion ---------------------------------------------------------------------------

    def ready(self) -> list[int]:
        """Leading finished counts [writes, loads, backups] (snapshots; only grow)."""
        return [_leading(self.writes, lambda op: op.handle.is_done()),
                _leading(self.loads, lambda op: op.handle.is_done()),
                _leading(self.backups, lambda op: op.finished)]

    def writes_landed(self) -> list[int]:
        """Per write in flight, in order: 1 if it has landed here. A write's outcome changes
        the tree, so under tensor parallelism the ranks agree on these (MIN): a write that
        failed on any rank fails on every rank."""
        return [int(op.handle.is_done() and op.handle.error is None) for op in self.writes]

    def pop(self, queue: deque, n: int) -> list:
        return [queue.popleft() for _ in range(n)]

    def host_accounting(self) -> tuple[int, int]:
        """(free host slots, host slots reserved by ops not applied yet), one consistent snapshot."""
        with self.host_lock:
            return self.mirror.allocator.available_size(), self._in_flight_host_slots()

    def _in_flight_host_slots(self) -> int:
        n = sum(op.host_slots.size for op in self._queued_writes)
        n += sum(op.host_slots.size for op in self.writes)
        for op in [*self.prefetches.values(), *self.unsettled]:
            if op.host_pages is not None:
                n += (op.host_pages.size - op.inserted) * self.page_size
        return n + sum(p.size for p in self.quarantined) * self.page_size

    def busy(self) -> bool:
        """Any op not applied yet (or a prefetch whose store call has not settled)?"""
        return bool(self.writes or self.loads or self.backups or self.prefetches or self._queued_writes or self.unsettled)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until every submitted transfer and store op has finished."""
        self.flush_writes()
        deadline = time.monotonic() + timeout
        for stream, ops in ((self.write_stream, list(self.writes)), (self.load_stream, list(self.loads))):
            for op in ops:
                stream.wait(op.handle, max(0.0, deadline - time.monotonic()))
        if self.storage is not None:
            self.storage.drain(max(0.0, deadline - time.monotonic()))

    def wait_progress(self, timeout: float) -> None:
        """An idle scheduler's nap: returns when a store op moved, or after `timeout`."""
        if self.storage is None:
            return
        self.storage.progress.wait(timeout)
        self.storage.progress.clear()

    def close(self) -> None:
        for op in self.prefetches.values():
            self.stop_prefetch(op)
        self.wait_idle()
        self.write_stream.close()
        self.load_stream.close()
        if self.storage is not None:
            self.storage.close()


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """One slot array of `parts` (`concat` keeps the GIL on the scheduler thread)."""
    return parts[0] if len(parts) == 1 else concat(parts)


def _leading(queue: deque, done) -> int:
    n = 0
    for op in queue:
        if not done(op):
            break
        n += 1
    return n
