"""The cache controller: moves KV between the pool, the mirror and the store.

It owns every asynchronous thing — the write and load streams, the storage thread, the
op queues, the host allocator's lock — and never touches the tree. Ops carry a `tag` of
the caller's type (the cache's node); the scheduler thread asks how many ops of each kind
are finished (`finished()`), agrees on the counts across ranks, and takes exactly that
many (`take`), in submission order. Nobody else touches the queues.

Host slot ownership: free in the mirror's allocator; reserved by a write or a prefetch
until the cache takes the op; then the tree's, or back to the allocator. Device slots are
not the controller's: `cache/slots.py` owns them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Generic, NamedTuple, TypeVar

import numpy as np

from kvtier.backends.base import Store
from kvtier.controller.config import ControllerConfig
from kvtier.storeio.cpus import check_cpus, confine
from kvtier.controller.storage import PrefetchOp, StorageWorker
from kvtier.storeio.ops import BackupOp
from kvtier.tiers.streams import Handle, make_stream
from kvtier.errors import StoreError, StoreUnavailable
from kvtier.tiers.indices import check_slots, concat, page_slots
from kvtier.tiers.mirror import HostMirror
from kvtier.tiers.pool import DeviceKVPool


Tag = TypeVar("Tag")  # what the caller ties an op to (the cache: a tree node)


@dataclass(slots=True, frozen=True)
class ComponentCopy:
    """A side component's part of a write or a load (a hybrid model's SWA KV or state
    slots), copied in the same op as its FULL KV: device slots of the component's pool and
    host slots of its mirror (`CacheController.add_component`)."""

    component: object  # tiers.components.Component
    device_slots: np.ndarray
    host_slots: np.ndarray


class OpKind(IntEnum):
    WRITE = 0
    LOAD = 1
    BACKUP = 2


class HostAccounting(NamedTuple):
    """Host slots outside the tree, in slots."""

    free: int
    in_flight: int  # reserved by ops not applied yet
    quarantined: int  # of abandoned store reads: never reused


class Finished(NamedTuple):
    """Leading finished ops of each kind (snapshots; they only grow)."""

    writes: int
    loads: int
    backups: int


@dataclass(eq=False)
class WriteOp(Generic[Tag]):
    device_slots: np.ndarray
    host_slots: np.ndarray
    tag: Tag
    handle: Handle | None = None
    started: float = field(default_factory=time.perf_counter)
    applied: bool = (
        False  # the scheduler took it (its host slots went to the tree or back)
    )
    failed_elsewhere: bool = (
        False  # landed here, failed on another rank: failed on every rank
    )
    extras: tuple[ComponentCopy, ...] = ()  # side components, reserved like host_slots


@dataclass(eq=False)
class LoadOp(Generic[Tag]):
    """A host->device copy into fresh device slots. The slots belong to the op until its
    worker has returned, then to whoever started it (a request): nothing in the tree
    points at them while the copy is in flight. `orphaned`: the request let go before the
    copy ended, so the scheduler frees the slots when it applies the op."""

    host_slots: np.ndarray
    device_slots: np.ndarray
    tag: Tag
    handle: Handle
    started: float = field(default_factory=time.perf_counter)
    orphaned: bool = False
    extras: tuple[
        ComponentCopy, ...
    ] = ()  # side components: device slots the request's too

    @property
    def ok(self) -> bool:
        """Landed without error (False while in flight)."""
        return self.handle.is_done() and self.handle.error is None


class CacheController:
    def __init__(
        self,
        pool: DeviceKVPool,
        mirror: HostMirror | None,
        store: Store | None,
        config: ControllerConfig,
        stream_factory=make_stream,
        clock=time.monotonic,
        manifest: tuple[str, str, dict] | None = None,
        store_pages: int = 1,
    ) -> None:
        """`stream_factory(name, device)` makes the write and load streams (a test passes
        one whose every copy it schedules itself); `clock` times the store breaker's probes;
        `manifest` (key prefix, namespace id, manifest) is written to the store once;
        `store_pages`: device pages in one store page (store_pages.py)."""
        cpus = check_cpus(
            config.cpus
        )  # before any thread starts: a bad value leaves nothing behind
        self.pool = pool
        self.mirror = mirror
        self.config = config
        self.page_size = pool.config.page_size
        self.host_lock = (
            threading.Lock()
        )  # the mirror's allocator is shared with the storage thread
        self.write_stream = stream_factory("write", pool.device)
        self.load_stream = stream_factory("load", pool.device)
        for t in [*self.write_stream.threads(), *self.load_stream.threads()]:
            confine(t.native_id, cpus)  # they start no threads of their own: no race
        self.storage = None
        if store is not None and mirror is not None:
            breaker = config.breaker_config()
            self.storage = StorageWorker(
                store,
                mirror,
                config.max_inflight_prefetch_bytes,
                breaker,
                clock,
                cpus,
                manifest,
                store_pages,
            )
        self._queued_writes: list[WriteOp] = []
        self._queues: dict[OpKind, deque] = {kind: deque() for kind in OpKind}
        self._prefetches: dict[str, PrefetchOp] = {}  # in submission order
        self._unsettled: list[
            PrefetchOp
        ] = []  # ended, but the store may still write their pages
        self._quarantined: list[
            np.ndarray
        ] = []  # host pages an abandoned store read may still write
        self._copies_done = (
            0  # write and load handles finished (bumped by their runners)
        )
        self.components: dict = {}  # side component -> (pool, mirror): add_component

    def add_component(self, component, pool: DeviceKVPool, mirror: HostMirror | None):
        """A hybrid model's side component (SWA KV, states): its pool and mirror, whose
        slots ride in writes and loads as `ComponentCopy` extras. Its mirror's allocator is
        behind `host_lock` like the FULL one's."""
        self.components[component] = (pool, mirror)

    def alloc_component_host(self, component, n: int) -> np.ndarray | None:
        with self.host_lock:
            return self.components[component][1].allocator.alloc_slots(n)

    def free_component_host(self, component, slots: np.ndarray) -> None:
        if slots.size:
            with self.host_lock:
                self.components[component][1].allocator.free_slots(slots)

    def component_host_accounting(self, component) -> HostAccounting:
        """A side component's host slots outside the tree (as `host_accounting`)."""
        with self.host_lock:
            free = self.components[component][1].allocator.available_size()
            n = sum(
                x.host_slots.size
                for op in (*self._queued_writes, *self._queues[OpKind.WRITE])
                for x in op.extras
                if x.component == component
            )
            return HostAccounting(free, n, 0)

    @property
    def store(self) -> Store | None:
        return self.storage.store if self.storage else None

    def probe_store(self, key_prefix: str, namespace_id: str, timeout_s: float) -> None:
        """Reach the store once (its manifest), or close and raise StoreUnavailable (one line)."""
        storage = self.storage
        probe = storage.store.get_manifest(key_prefix, namespace_id)
        try:
            asyncio.run_coroutine_threadsafe(probe, storage.loop).result(timeout_s)
        except (StoreError, TimeoutError) as exc:
            self.close()
            raise StoreUnavailable(
                f"store.required: the {storage.store.name} store cannot be reached at start: "
                f"{str(exc) or type(exc).__name__}"
            ) from exc

    # -- host slots (the lock makes accounting snapshots consistent) --------------------------

    def alloc_host(self, n: int) -> np.ndarray | None:
        with self.host_lock:
            return self.mirror.allocator.alloc_slots(n)

    def free_host(self, slots: np.ndarray) -> None:
        if slots.size:
            with self.host_lock:
                self.mirror.allocator.free_slots(slots)

    def free_unused_pages(self, op: PrefetchOp) -> None:
        """A settled op's host pages past those inserted go back, unless a read of it was
        abandoned stuck on some rank (agreed in a poll: `abandoned_anywhere`; this rank's
        own, `abandoned`, is always in it): then they are all kept out of use for good,
        counted, on every rank (its allocator stays the others')."""
        pages = op.host_pages[op.inserted :]
        if (
            op.abandoned_anywhere or op.abandoned
        ):  # agreed: the same pages on every rank
            if pages.size:
                with self.host_lock:  # one consistent accounting snapshot
                    self._quarantined.append(pages)
            return
        self.free_host_pages(pages)

    def quarantined_pages(self) -> int:
        """Host pages kept out of use for good: an abandoned store read may still write them."""
        return sum(p.size for p in self._quarantined)

    def free_host_pages(self, pages: np.ndarray) -> None:
        if pages.size:
            with self.host_lock:
                self.mirror.allocator.free_pages(pages)

    def host_available(self) -> int:
        with self.host_lock:
            return self.mirror.allocator.available_size()

    def grant(self, op: PrefetchOp, pages: int) -> int:
        """Reserve up to `pages` free host pages for `op` and let its reads start."""
        if (
            pages == 0 and op.present == 0
        ):  # this rank's store holds none: its op waits for no grant
            op.granted = True
            return 0
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

    def write(
        self, device_slots: np.ndarray, tag: Tag, extras: tuple[ComponentCopy, ...] = ()
    ) -> np.ndarray | None:
        """Reserve host slots and queue a device->host copy; None if the mirror is full.
        `extras`: side components' copies (their host slots reserved by the caller) that
        land, or fail, with it; the op owns their host slots until it is applied."""
        host = self.alloc_host(device_slots.size)
        if host is None:
            return None
        self._queued_writes.append(WriteOp(device_slots, host, tag, extras=extras))
        return host

    def flush_writes(self) -> None:
        """Submit every queued write as one merged transfer."""
        if not self._queued_writes:
            return
        ops, self._queued_writes = self._queued_writes, []
        dev = _joined([op.device_slots for op in ops])
        host = _joined([op.host_slots for op in ops])
        mirror, pool = self.mirror, self.pool
        sides = self._side_copies([x for op in ops for x in op.extras])

        def job(h: Handle) -> None:
            if dev.size:  # none: side components alone (their FULL KV is on host)
                mirror.backup(pool, dev, host)
            for (side_pool, side_mirror), d, hs in sides:
                side_mirror.backup(side_pool, d, hs)

        handle = self.write_stream.submit(job, Handle(on_done=self._copy_done))
        writes = self._queues[OpKind.WRITE]
        for op in ops:
            op.handle = handle
            writes.append(op)

    def wait_writes(self, timeout: float = 30.0) -> None:
        """Submit the queued writes and wait for every write in flight to land (or fail)."""
        self.flush_writes()
        for op in list(self._queues[OpKind.WRITE]):
            self.write_stream.wait(op.handle, timeout)

    # -- host -> device -----------------------------------------------------------------------

    def _side_copies(self, extras) -> list:
        """Per side component in `extras`: ((pool, mirror), device slots, host slots),
        joined."""
        out = []
        for component, (pool, mirror) in self.components.items():
            mine = [x for x in extras if x.component == component and x.host_slots.size]
            if mine:
                out.append(
                    (
                        (pool, mirror),
                        _joined([x.device_slots for x in mine]),
                        _joined([x.host_slots for x in mine]),
                    )
                )
        return out

    def load(
        self,
        host_slots: np.ndarray,
        device_slots: np.ndarray,
        tag: Tag,
        extras: tuple[ComponentCopy, ...] = (),
        layers: list | None = None,
    ) -> LoadOp:
        """Copy host slots into (already allocated) device slots, one layer at a time.
        A hybrid model's load (`layers`: per model layer, its component and its layer in
        that component's pool) copies, per model layer in order, that layer's FULL KV or
        side component (`extras`) and then signals the layer landed."""
        mirror, pool = self.mirror, self.pool
        check_slots("host_slots", host_slots)
        check_slots("device_slots", device_slots, host_slots.size)
        if layers is None:
            layers = [(None, layer) for layer in range(pool.num_layers)]
        by_pool = {id(p): (p, m, d, hs) for (p, m), d, hs in self._side_copies(extras)}

        def job(h: Handle) -> None:
            # plans by whoever runs the job (streams.py)
            plans = {k: m.plan(d, hs) for k, (p, m, d, hs) in by_pool.items()}
            plan = mirror.plan(device_slots, host_slots) if host_slots.size else None
            for i, (component, layer) in enumerate(layers):
                if component is None or component not in self.components:
                    if host_slots.size:
                        mirror.load_layer(pool, host_slots, device_slots, layer, plan)
                else:
                    side_pool = self.components[component][0]
                    got = by_pool.get(id(side_pool))
                    if got is not None:
                        p, m, d, hs = got
                        m.load_layer(p, hs, d, layer, plans[id(side_pool)])
                h.layer_done(i)

        handle = self.load_stream.submit(job, Handle(len(layers), self._copy_done))
        op = LoadOp(host_slots, device_slots, tag, handle, extras=tuple(extras))
        self._queues[OpKind.LOAD].append(op)
        return op

    def load_pending(self, op: LoadOp) -> bool:
        """Is `op` still queued (not taken by the scheduler)?"""
        return op in self._queues[OpKind.LOAD]

    # -- host <-> store -----------------------------------------------------------------------

    def backup(
        self,
        keys: list[str],
        host_pages: np.ndarray,
        tag: Tag,
        lead_in: np.ndarray | None = None,
        deferred: int = 0,
        component=None,
        manifest=None,
    ) -> BackupOp | None:
        """`component`: the pages are host pages of that side component's mirror
        (`add_component`), stored under its own namespace (`manifest`: its Manifest)."""
        if self.storage is None:
            return None
        op = BackupOp(keys, host_pages, tag, lead_in=lead_in, deferred=deferred)
        self._queues[OpKind.BACKUP].append(op)
        mirror = None if component is None else self.components[component][1]
        self.storage.submit_backup(op, mirror, manifest)
        return op

    def prefetch(self, op: PrefetchOp) -> None:
        if op.request_id in self._prefetches:
            raise ValueError(
                f"prefetch: request_id={op.request_id!r} already has a prefetch in flight"
            )
        self._prefetches[op.request_id] = op
        self.storage.submit_prefetch(op)

    def end_prefetch(self, op: PrefetchOp, settled: bool) -> None:
        """The scheduler is done with `op`; unless its store call has `settled`, its pages
        stay reserved until `take_settled` names it."""
        self._prefetches.pop(op.request_id, None)
        if not settled:
            self._unsettled.append(op)

    def prefetch_ops(self) -> list[PrefetchOp]:
        """The prefetches that may hold host pages: in flight, or ended and not settled."""
        return [*self._prefetches.values(), *self._unsettled]

    def unsettled(self) -> list[tuple[int, int]]:
        """Per ended prefetch whose store call had not settled, in order: (1 if it has now,
        1 if a read of it was abandoned stuck here). Read settled first: `abandoned` is
        set before `settled`."""
        return [(int(op.settled), int(op.abandoned)) for op in self._unsettled]

    def take_settled(
        self, settled: list[int], abandoned: list[int]
    ) -> list[PrefetchOp]:
        """The first `len(settled)` unsettled prefetches whose flag is set (agreed): they
        leave the controller; the rest stay, in order. One abandoned on any rank (agreed)
        holds back all its unused host pages on every rank (`free_unused_pages`)."""
        head = self._unsettled[: len(settled)]
        self._unsettled = [
            op for op, done in zip(head, settled) if not done
        ] + self._unsettled[len(settled) :]
        for op, stuck in zip(head, abandoned):
            op.abandoned_anywhere = op.abandoned_anywhere or bool(stuck)
        return [op for op, done in zip(head, settled) if done]

    # -- completion ---------------------------------------------------------------------------

    def _copy_done(self) -> None:
        self._copies_done += 1  # by the stream's runner, after the handle says done

    def moves(self) -> tuple[int, int]:
        """Two counts that grow after every change the background threads make to what
        `finished()`, `unsettled()` and the prefetch ops report (each bumps one after its
        change): (prefetches, which requests wait for; copies and backups, which none does).
        Equal at two reads: nothing of that moved in between."""
        storage = self.storage
        if storage is None:
            return 0, self._copies_done
        return storage.moves, self._copies_done + storage.backups_moved

    def finished(self) -> Finished:
        """Leading finished ops of each kind (snapshots; only grow)."""
        q = self._queues
        return Finished(
            _leading(q[OpKind.WRITE], lambda op: op.handle.is_done()),
            _leading(q[OpKind.LOAD], lambda op: op.handle.is_done()),
            _leading(q[OpKind.BACKUP], lambda op: op.finished),
        )

    def writes_landed(self) -> list[int]:
        """Per write in flight, in order: 1 if it has landed here. A write's outcome changes
        the tree, so under tensor parallelism the ranks agree on these (MIN): a write that
        failed on any rank fails on every rank."""
        return [
            int(op.handle.is_done() and op.handle.error is None)
            for op in self._queues[OpKind.WRITE]
        ]

    def take(self, kind: OpKind, n: int) -> list:
        """The `n` oldest ops of `kind` (finished on every rank), which leave the controller."""
        queue = self._queues[kind]
        return [queue.popleft() for _ in range(n)]

    def queue_sizes(self) -> dict[str, int]:
        q = self._queues
        return {
            "writes": len(q[OpKind.WRITE]),
            "loads": len(q[OpKind.LOAD]),
            "backups": len(q[OpKind.BACKUP]),
            "prefetches": len(self._prefetches),
            "host_pages_quarantined": self.quarantined_pages(),
        }

    def host_accounting(self) -> HostAccounting:
        """Where the host slots not in the tree are, one consistent snapshot."""
        with self.host_lock:
            return HostAccounting(
                self.mirror.allocator.available_size(),
                self._in_flight_host_slots(),
                self.quarantined_pages() * self.page_size,
            )

    def _in_flight_host_slots(self) -> int:
        n = sum(op.host_slots.size for op in self._queued_writes)
        n += sum(op.host_slots.size for op in self._queues[OpKind.WRITE])
        for op in self.prefetch_ops():
            if op.host_pages is not None:
                n += (op.host_pages.size - op.inserted) * self.page_size
        return n

    def busy(self) -> bool:
        """Any op not applied yet (or a prefetch whose store call has not settled)?"""
        return bool(
            any(self._queues.values())
            or self._prefetches
            or self._queued_writes
            or self._unsettled
        )

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until every submitted transfer and store op has finished."""
        self.flush_writes()
        deadline = time.monotonic() + timeout
        for stream, ops in (
            (self.write_stream, list(self._queues[OpKind.WRITE])),
            (self.load_stream, list(self._queues[OpKind.LOAD])),
        ):
            for op in ops:
                stream.wait(op.handle, max(0.0, deadline - time.monotonic()))
        if self.storage is not None:
            self.storage.drain(max(0.0, deadline - time.monotonic()))

    def wait_progress(self, timeout: float) -> None:
        """An idle scheduler's nap: returns when a prefetch moved, or after `timeout`."""
        if self.storage is None:
            return
        self.storage.progress.wait(timeout)
        self.storage.progress.clear()

    def close(self) -> None:
        for op in self._prefetches.values():
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
