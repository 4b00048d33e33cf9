"""The linker's loads: host (and store) pages -> device slots, layer by layer.

`load` queues a request's load: its host pages pinned, the rest read from the store into
reserved host pages at once. `start` makes one job of every queued load: wait for its
store reads (all verified, or the job fails before writing a byte to the device), then
copy layer by layer; the counter lets the forward wait for layer i only. `finish` waits
until the job stopped writing device memory and ends each load: unpinned, its store-read
pages published when they verified (`StoreOps.end_read`). Scheduler thread only; the copy
runs on the load stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from kvtier.tiers.streams import Handle, TransferError, TransferStream
from kvtier.integrations.sglang.linker.host_index import HostIndex
from kvtier.integrations.sglang.linker.metrics import LinkerCounters
from kvtier.integrations.sglang.linker.store_io import StoreRead
from kvtier.integrations.sglang.linker.store_ops import StoreOps
from kvtier.tiers.indices import concat, page_slots
from kvtier.tiers.mirror import HostMirror
from kvtier.tiers.pool import DeviceKVPool

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LoadOp:
    rid: str
    keys: list[str]
    device_slots: np.ndarray
    host_pages: np.ndarray  # per page of `keys`
    pinned: list[str]
    read: StoreRead | None = None  # store pages -> reserved host pages
    read_index: np.ndarray | None = None  # which pages of `keys` the read covers
    doomed: str | None = None  # why it cannot succeed (known when queued)
    around: list[str] | None = None  # the lookup's keys, of which `keys` are the first


@dataclass(eq=False)
class LoadBatch:
    index: int
    loads: list[LoadOp]
    handle: Handle


class LayerCounter:
    """SGLang's `LayerWiseLoadCounter` over kvtier's copy handles, with its method set
    (`update_producer`, `set_consumer`, `wait_until`, `finish`): the forward of
    batch `index` waits for layer i of its load only. A failed load does not raise into
    the forward (it runs on whatever the slots hold); `finish` reports it.

    SGLang's own counter resolves a future per layer and blocks the CPU on it; here a
    layer's wait is the copy handle's (`Handle.wait_layer`): on a GPU the forward's
    stream waits on the layer's recorded event, on a CPU an unstarted copy runs on the
    waiter's thread. The load stream signals the handle, so `complete`/`fail` are the
    stream's."""

    def __init__(self) -> None:
        self.handles: dict[int, Handle] = {}
        self.producer_index = -1
        self.consumer_index = -1

    def update_producer(self, handle: Handle) -> int:
        """The next batch's index, its layers signalled through `handle`."""
        self.producer_index += 1
        self.handles[self.producer_index] = handle
        return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, layer: int) -> None:
        handle = self.handles.get(self.consumer_index)
        if handle is None:
            return
        try:
            handle.wait_layer(layer)
        except TransferError:
            pass

    def finish(self, index: int) -> bool:
        """Drop batch `index` (its copy has stopped); True when every layer landed."""
        handle = self.handles.pop(index, None)
        return handle is None or handle.error is None


class Loads:
    """The one owner of loads: queued per request (`queued`), started per batch
    (`started`), and the batch counter SGLang's forward waits on (`counter`)."""

    def __init__(
        self,
        pool: DeviceKVPool,
        mirror: HostMirror,
        index: HostIndex,
        store_ops: StoreOps,
        counters: LinkerCounters,
        load_stream: TransferStream,
        read_wait_s: float,
    ) -> None:
        self.pool, self.mirror, self.index = pool, mirror, index
        self.store_ops, self.counters = store_ops, counters
        self.page_size = pool.config.page_size
        self.load_stream, self.read_wait_s = load_stream, read_wait_s
        self.counter = LayerCounter()
        self.queued: dict[str, LoadOp] = {}
        self.started: dict[int, LoadBatch] = {}

    def load(
        self,
        rid: str,
        keys: list[str],
        slots: np.ndarray,
        around: list[str] | None = None,
    ) -> None:
        """`around`: the keys its lookup was asked about (`keys` their first ones), where
        a store page read may end past `keys`."""
        self.cancel(rid)
        pinned, host = self.index.pin_found(keys)
        op = LoadOp(rid, keys, slots, host, pinned, around=around)
        missing = np.flatnonzero(host == 0)
        if missing.size:
            self._read_missing(op, missing)
        self.queued[rid] = op
        self.counters.loads += 1

    def _read_missing(self, op: LoadOp, missing: np.ndarray) -> None:
        if self.store_ops.l3 is None:
            op.doomed = f"{missing.size} pages left the host tier and there is no store"
            return
        pages = self.index.reserve(int(missing.size))
        if pages is None:
            op.doomed = f"no host room to read {missing.size} pages from the store"
            return
        at = missing.tolist()
        # store pages of several engine pages are those of the lookup's whole run
        around = (op.around or op.keys, at)
        op.read = self.store_ops.read([op.keys[i] for i in at], pages, around)
        op.read_index = missing
        op.host_pages[missing] = pages

    def cancel(self, rid: str) -> bool:
        op = self.queued.pop(rid, None)
        if op is None:
            return False
        self.counters.loads_cancelled += 1
        self._end_load(op, landed=False)
        return True

    def start(self) -> int:
        if not self.queued:
            return -1
        loads, self.queued = list(self.queued.values()), {}
        handle = Handle(self.pool.num_layers)
        index = self.counter.update_producer(handle)
        self.started[index] = LoadBatch(index, loads, handle)
        self.load_stream.submit(lambda h: self._copy_in(loads, h), handle)
        return index

    def _copy_in(self, loads: list[LoadOp], handle) -> None:
        """The load job: every store read verified, or fail before the device is written."""
        for op in loads:
            if op.doomed is not None:
                raise TransferError(f"load {op.rid}: {op.doomed}")
            if op.read is not None:
                self._wait_read(op)
        device = concat([op.device_slots for op in loads])
        host = concat([page_slots(op.host_pages, self.page_size) for op in loads])
        plan = self.mirror.plan(device, host)
        for layer in range(self.pool.num_layers):
            self.mirror.load_layer(self.pool, host, device, layer, plan)
            handle.layer_done(layer)

    def _wait_read(self, op: LoadOp) -> None:
        read = op.read
        if not self.store_ops.wait(read, self.read_wait_s):
            raise TransferError(
                f"load {op.rid}: its store read did not end within {self.read_wait_s}s"
            )
        if read.landed < len(read.keys):
            why = (
                "a page missed or did not verify"
                if read.answered
                else "the store failed or is down"
            )
            raise TransferError(
                f"load {op.rid}: {read.landed} of {len(read.keys)} store pages verified ({why})"
            )

    def finish(self, index: int) -> bool:
        batch = self.started.pop(index, None)
        if batch is None:
            return True
        self.load_stream.wait(batch.handle, None)  # bounded: the job's own waits are
        landed = self.counter.finish(index)
        for op in batch.loads:
            self._end_load(op, landed)
        if not landed:
            self.counters.load_failures += 1
            log.warning(
                "kvtier linker: load batch %d failed: %s", index, batch.handle.error
            )
        return landed

    def _end_load(self, op: LoadOp, landed: bool) -> None:
        """The load stopped touching its pages: unpin; store-read pages become host pages
        when they verified, else go back once the read has settled."""
        self.index.unpin(op.pinned)
        pages = len(op.keys)
        if landed:
            c = self.counters
            c.load_pages += pages
            c.h2d_bytes += pages * self.mirror.page_bytes
            c.l3_read_pages += 0 if op.read is None else len(op.read.keys)
            c.l3_read_bytes += (
                0 if op.read is None else len(op.read.keys) * self.mirror.page_bytes
            )
        if op.read is None:
            return
        keys = [op.keys[i] for i in op.read_index.tolist()]
        self.store_ops.end_read(op.read, keys, op.host_pages[op.read_index])

    def quiesce(self) -> None:
        """Cancel every queued load, and finish every started batch."""
        for rid in list(self.queued):
            self.cancel(rid)
        for index in list(self.started):
            self.finish(index)

    def close(self) -> None:
        self.load_stream.close()

    def _all(self) -> list[LoadOp]:
        return list(self.queued.values()) + [
            o for b in self.started.values() for o in b.loads
        ]

    def reserved(self) -> list[int]:
        """The host pages the loads' store reads reserved."""
        owned: list[int] = []
        for op in self._all():
            if op.read is not None:
                owned += op.host_pages[op.read_index].tolist()
        return owned

    def pinned(self) -> list[list[str]]:
        """The keys each load pinned."""
        return [op.pinned for op in self.queued.values()] + [
            o.pinned for b in self.started.values() for o in b.loads
        ]
