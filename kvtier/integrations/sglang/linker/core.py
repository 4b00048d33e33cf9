"""The linker's engine-free core: host tier, store and copies behind SGLang's ten calls.

`KvtierLinker` (shell.py) translates SGLang's `PoolTransfer`s into these calls; the fault
simulator (kvtier/testing/linker_sim.py) makes them directly. Every call comes from
SGLang's scheduler thread; copies run on kvtier's transfer streams, store calls on the
storage thread (`StorageWorker`).

- `offload(keys, device_slots)`: copy the pages the host tier lacks device -> host (the
  write stream; SGLang keeps the node locked until the offload is consumed, so the device
  pages are stable while read). In order, `pop_completed_offload` publishes them on host
  and starts their write to the store (pinned until it settles).
- `lookup(rid, keys)`: pages restorable in chain order, no holes: the host run, then the
  store's leading run (one `batch_exists`, behind the breaker, never waited on past one
  timeout), then the host run again. It promises only what a load queued next can land:
  the store part and the host pages after it are capped at the host room a reservation
  could get then (free, or published and unpinned, less the host pages the load pins).
  A lookup pins nothing (SGLang says nothing when a matched request is aborted, so a pin
  would outlive it); the pages it found become the newest in the LRU.
- `load(rid, keys, device_slots)`: queue; host pages are pinned, the rest are read from
  the store into reserved host pages at once (a storage-thread op). Always True for a
  well-formed call: SGLang needs the same answer on every rank, and a failure is reported
  by `finish_layer_wise_loading`, which SGLang agrees across ranks.
- `start_layer_wise_loading()`: one job for every queued load: wait for its store reads
  (all verified, or the job fails before writing a byte to the device), then copy layer by
  layer; `layer_done_counter.wait_until(i)` waits for layer i only.
- `finish_layer_wise_loading(i)`: until batch i stopped writing device memory; False if
  any page failed (SGLang aborts its requests; the slots are private to them). Pages read
  from the store become host pages when they verified.
"""

from __future__ import annotations

import logging
import operator
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import compress, repeat
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.backends.base import Store
from kvtier.controller.breaker import BreakerConfig
from kvtier.controller.storage import BackupOp
from kvtier.controller.streams import Handle, TransferError, TransferStream, make_stream
from kvtier.hashing import KeyedHash, Namespace
from kvtier.integrations.sglang.linker.hints import LinkerHints
from kvtier.integrations.sglang.linker.host_index import HostIndex
from kvtier.integrations.sglang.linker.metrics import LinkerCounters
from kvtier.integrations.sglang.linker.store_io import LinkerStore, StoreRead
from kvtier.tiers.indices import concat, page_slots, slots_of
from kvtier.tiers.mirror import HostMirror, MirrorConfig
from kvtier.tiers.pool import DeviceKVPool

log = logging.getLogger(__name__)
UNREADABLE = 4096  # store pages remembered as not verifying (the newest ones)
StreamFactory = Callable[[str, torch.device], TransferStream]


@dataclass(slots=True, frozen=True)
class LinkerSettings:
    namespace: Namespace
    key_prefix: str = "kvtier"
    mirror: MirrorConfig = MirrorConfig()
    breaker: BreakerConfig = BreakerConfig()
    writes_store: bool = (
        True  # False on MLA ranks other than 0: rank 0 writes the shared pages
    )
    max_inflight_bytes: int = 256 << 20
    read_wait_s: float | None = (
        None  # a load's wait for its store reads; None: 4 store timeouts
    )
    cpus: frozenset[int] | None = None
    keyed_hash: KeyedHash | None = (
        None  # a tenant key's (docs/security.md): SGLang's page keys go through it
    )


@dataclass(eq=False)
class OffloadOp:
    keys: list[str]  # the pages this op copies (the others were on host or in flight)
    host_pages: np.ndarray
    handle: Handle | None  # None: nothing to copy
    depends: list[OffloadOp] = field(
        default_factory=list
    )  # earlier ops copying some of its pages
    refused: bool = False  # no host room
    success: bool | None = None


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


@dataclass(eq=False)
class LoadBatch:
    index: int
    loads: list[LoadOp]
    handle: Handle


class LayerCounter:
    """SGLang's layer-done counter (`set_consumer`, `wait_until`): the forward of batch
    `index` waits for layer i of its load only. A failed load does not raise into the
    forward (it runs on whatever the slots hold); `finish_layer_wise_loading` reports it."""

    def __init__(self) -> None:
        self.handles: dict[int, Handle] = {}
        self.consumer = -1

    def set_consumer(self, index: int) -> None:
        self.consumer = index

    def wait_until(self, layer: int) -> None:
        handle = self.handles.get(self.consumer)
        if handle is None:
            return
        try:
            handle.wait_layer(layer)
        except TransferError:
            pass


class LinkerCore:
    def __init__(
        self,
        pool: DeviceKVPool,
        settings: LinkerSettings,
        store: Store | None = None,
        *,
        streams: StreamFactory = make_stream,
        clock: Callable[[], float] = time.monotonic,
        forward_stream=None,
    ) -> None:
        self.pool, self.settings, self.store = pool, settings, store
        self.page_size = pool.config.page_size
        self.mirror = HostMirror(pool, settings.mirror)
        self.index = HostIndex(self.mirror.allocator)
        self.hints = LinkerHints(self.index, self.mirror.page_bytes, clock)  # hints.py
        self.counters = LinkerCounters()
        self.counter = LayerCounter()
        self.forward_stream = forward_stream
        self.write_stream = streams("linker-write", pool.device)
        self.load_stream = streams("linker-load", pool.device)
        self.l3 = (
            None
            if store is None
            else LinkerStore(store, self.mirror, settings, self.counters, clock)
        )
        self.read_wait_s = (
            settings.read_wait_s
            if settings.read_wait_s is not None
            else 4 * (store.timeout_s if store is not None else 1.0)
        )
        self.offloads: deque[OffloadOp] = deque()
        self.copying: dict[
            str, OffloadOp
        ] = {}  # key -> the op whose copy of it is in flight
        self.backups: list[
            tuple[BackupOp, list[str], list[str]]
        ] = []  # (op, pinned keys, its keys)
        # store pages that did not verify when read: a lookup stops before them until a
        # write of the page succeeds (else every request on that prefix would fail its load)
        self.unreadable: OrderedDict[str, None] = OrderedDict()
        self.queued: dict[str, LoadOp] = {}
        self.started: dict[int, LoadBatch] = {}
        self.orphans: list[
            tuple[StoreRead, np.ndarray]
        ] = []  # ended reads whose pages wait to settle
        self.quarantined: list[
            np.ndarray
        ] = []  # pages of abandoned store reads: never reused
        self.next_index = 0
        self.closed = False

    # -- keys --------------------------------------------------------------------------------

    def _check(self, keys: Sequence[str], device_slots) -> np.ndarray:
        try:  # one C loop: a key that is not a string raises, an empty one reads 0
            good = not isinstance(keys, str) and all(map(str.__len__, keys))
        except TypeError:
            good = False
        if not good:
            raise ValueError(
                "keys: expected a list of SGLang page keys (non-empty strings)"
            )
        slots = slots_of(device_slots)
        if slots.shape[0] != len(keys) * self.page_size:
            raise ValueError(
                f"device_indices has {slots.shape[0]} slots for {len(keys)} pages; expected "
                f"{len(keys) * self.page_size} ({self.page_size} per page)"
            )
        return slots

    # -- offload -----------------------------------------------------------------------------

    def offload(self, keys: Sequence[str], device_slots) -> bool:
        slots = self._check(keys, device_slots)
        self._reap()
        keys = list(keys)
        copying = self.copying
        known = self.index.pages
        # the pages neither on host nor in flight, found by C loops (most offloads are all new)
        held = list(map(known.__contains__, keys))
        inflight = copying.keys() & keys if copying else None
        if inflight:
            held = list(map(operator.or_, held, map(inflight.__contains__, keys)))
            ops = map(copying.__getitem__, inflight)
            depends = list({id(op): op for op in ops}.values())
        else:
            depends = []
        self.counters.offloads += 1
        first = dict.fromkeys(
            keys
        )  # a key named twice is copied once, from its first page
        if not any(held) and len(first) == len(keys):
            new = keys
            picked = slots
        else:
            if len(first) != len(keys):
                first = {}
                for i, k in enumerate(keys):
                    first.setdefault(k, i)
                once = set(first.values())
                held = [h or i not in once for i, h in enumerate(held)]
            index = list(compress(range(len(keys)), map(operator.not_, held)))
            new = [keys[i] for i in index]
            picked = slots.reshape(-1, self.page_size)[index].reshape(-1)
        if not new:
            self.offloads.append(OffloadOp([], np.zeros(0, np.int64), None, depends))
            return True
        pages = self.index.reserve(len(new))
        if pages is None:
            self.counters.offload_no_host_room_pages += len(new)
            self.offloads.append(
                OffloadOp([], np.zeros(0, np.int64), None, depends, refused=True)
            )
            return True
        host = page_slots(pages, self.page_size)
        handle = Handle(0)
        ready = self._forward_ready()
        self.write_stream.submit(lambda h: self._copy_out(picked, host, ready), handle)
        op = OffloadOp(new, pages, handle, depends)
        copying.update(dict.fromkeys(new, op))
        self.offloads.append(op)
        return True

    def _forward_ready(self):
        """On a GPU: an event after the forward's writes, which the copy waits for."""
        if self.forward_stream is None or self.pool.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(self.forward_stream)
        return event

    def _copy_out(self, device: np.ndarray, host: np.ndarray, ready) -> None:
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        self.mirror.backup(self.pool, device, host)

    def num_completed_offloads(self) -> int:
        self._reap()
        n = 0
        for op in self.offloads:
            if op.handle is not None and not op.handle.done:
                break
            n += 1
        return n

    def pop_completed_offload(self) -> bool:
        op = self.offloads.popleft()
        assert op.handle is None or op.handle.done, (
            "pop_completed_offload before its copy finished"
        )
        ok = not op.refused and (op.handle is None or op.handle.error is None)
        op.success = ok and all(d.success for d in op.depends)
        deque(map(self.copying.__delitem__, op.keys), maxlen=0)
        if not ok:
            self.counters.offload_failures += 1
            self.index.release(op.host_pages)
            return False
        # a key a store read published meanwhile keeps that page; the offload's went back free
        kept = self.index.publish(op.keys, op.host_pages.tolist())
        keys, pages = op.keys, op.host_pages
        if not all(kept):
            keys = list(compress(keys, kept))
            pages = pages[np.array(kept, dtype=bool)]
        self.counters.offload_pages += len(op.keys)
        self.counters.d2h_bytes += len(op.keys) * self.mirror.page_bytes
        if self.unreadable and not self.settings.writes_store:
            for k in op.keys:  # the writing rank forgets once stored (_reap)
                self.unreadable.pop(k, None)
        self._write_store(keys, pages)
        if not op.success:
            self.counters.offload_failures += 1
        return op.success

    def _write_store(self, keys: list[str], pages: np.ndarray) -> None:
        if self.l3 is None or not self.settings.writes_store or not keys:
            return
        pinned = self.index.pin(keys)
        self.backups.append((self.l3.write(keys, pages), pinned, keys))

    def _reap(self) -> None:
        """Settle what the storage thread finished: store writes unpin their pages, ended
        reads give theirs back; hint leases expire or take what arrived."""
        self.hints.poll()
        if self.backups:
            still = []
            for op, pinned, keys in self.backups:
                if not op.finished:
                    still.append((op, pinned, keys))
                    continue
                self.index.unpin(pinned)
                if self.unreadable:  # a page stored again verifies again
                    for k in compress(keys, op.ok or []):
                        self.unreadable.pop(k, None)
                good = sum(op.ok or [])
                self.counters.l3_write_pages += good
                self.counters.l3_write_bytes += good * self.mirror.page_bytes
                self.counters.l3_write_failures += len(op.keys) - good
            self.backups = still
        if self.orphans:
            still = []
            for read, pages in self.orphans:
                if (
                    read.settled and read.abandoned
                ):  # a stuck thread may still write them
                    self.quarantined.append(pages)
                elif read.settled:
                    self.index.release(pages)
                else:
                    still.append((read, pages))
            self.orphans = still

    # -- lookup ------------------------------------------------------------------------------

    def lookup(self, rid: str, keys: Sequence[str]) -> int:
        """Pages of `keys`, from the first, that a load queued next can restore."""
        self._reap()
        n = len(keys)
        index = self.index
        host, unpinned = index.run(keys)
        end, stored = host, 0
        if end < n and self.l3 is not None:
            # the load pins the host run (out of the LRU), then reserves a page per store page
            room = index.room() - unpinned
            if room > 0:
                stored = self.l3.leading_run(keys[end : end + room])
                stored = next(
                    (
                        i
                        for i, k in enumerate(keys[end : end + stored])
                        if k in self.unreadable
                    ),
                    stored,
                )
                end, _ = index.run(keys, end + stored, room - stored)
        c = self.counters
        c.lookups += 1
        c.lookup_pages += n
        c.host_hit_pages += end - stored
        c.store_hit_pages += stored
        return end

    # -- load --------------------------------------------------------------------------------

    def load(self, rid: str, keys: Sequence[str], device_slots) -> bool:
        slots = self._check(keys, device_slots)
        self._reap()
        self.cancel_queued_load(rid)
        keys = list(keys)
        pinned = self.index.pin(keys)
        host = np.fromiter(
            map(self.index.pages.get, keys, repeat(0)), dtype=np.int64, count=len(keys)
        )
        op = LoadOp(rid, keys, slots, host, pinned)
        missing = np.flatnonzero(host == 0)
        if missing.size:
            self._read_missing(op, missing)
        self.queued[rid] = op
        self.counters.loads += 1
        return True

    def _read_missing(self, op: LoadOp, missing: np.ndarray) -> None:
        if self.l3 is None:
            op.doomed = f"{missing.size} pages left the host tier and there is no store"
            return
        pages = self.index.reserve(int(missing.size))
        if pages is None:
            op.doomed = f"no host room to read {missing.size} pages from the store"
            return
        op.read = self.l3.read([op.keys[i] for i in missing.tolist()], pages)
        op.read_index = missing
        op.host_pages[missing] = pages

    def cancel_queued_load(self, rid: str) -> bool:
        op = self.queued.pop(rid, None)
        if op is None:
            return False
        self.counters.loads_cancelled += 1
        self._end_load(op, landed=False)
        return True

    def start_layer_wise_loading(self) -> int:
        if not self.queued:
            return -1
        loads, self.queued = list(self.queued.values()), {}
        index, self.next_index = self.next_index, self.next_index + 1
        handle = Handle(self.pool.num_layers)
        self.counter.handles[index] = handle
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
        if not self.l3.wait(read, self.read_wait_s):
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

    def finish_layer_wise_loading(self, index: int) -> bool:
        batch = self.started.pop(index, None)
        if batch is None:
            return True
        self.load_stream.wait(batch.handle, None)  # bounded: the job's own waits are
        del self.counter.handles[index]
        landed = batch.handle.error is None
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
        read, own = op.read, op.host_pages[op.read_index]
        if read.finished and read.landed == len(read.keys):  # verified: host pages now
            self.index.publish(
                [op.keys[i] for i in op.read_index.tolist()], own.tolist()
            )
            return
        if (
            read.finished and read.answered
        ):  # the store answered, and this page was missing or bad
            self._mark_unreadable(op.keys[int(op.read_index[read.landed])])
        self.orphans.append((read, own))
        self._reap()

    def _mark_unreadable(self, key: str) -> None:
        self.counters.l3_read_failures += 1
        self.unreadable[key] = None
        self.unreadable.move_to_end(key)
        while len(self.unreadable) > UNREADABLE:
            self.unreadable.popitem(last=False)

    # -- lifecycle ---------------------------------------------------------------------------

    def quiesce(self) -> None:
        """Every copy and store call this linker started has ended and been applied."""
        for rid in list(self.queued):
            self.cancel_queued_load(rid)
        for index in list(self.started):
            self.finish_layer_wise_loading(index)
        for op in self.offloads:
            if op.handle is not None:
                self.write_stream.wait(op.handle, None)
        while self.offloads:  # dropped unapplied: SGLang releases them as failed
            op = self.offloads.popleft()
            for k in op.keys:
                del self.copying[k]
            self.index.release(op.host_pages)
        if self.l3 is not None:
            self.l3.drain()
            for read, _ in self.orphans:
                self.l3.wait(read, 4 * self.l3.timeout_s, settled=True)
        self._reap()

    def reset(self) -> None:
        """Quiesce, then drop the host tier (the store keeps its pages). A store call that
        outlived its timeout keeps its pages until it ends (`_reap` then frees them)."""
        self.quiesce()
        if self.backups or self.orphans:
            log.warning(
                "kvtier linker: reset with %d store calls still running; their pages wait for them",
                len(self.backups) + len(self.orphans),
            )
        self.hints.release_all()
        self.index.clear()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.reset()
        self.write_stream.close()
        self.load_stream.close()
        if self.l3 is not None:
            self.l3.close()

    # -- checks and numbers ------------------------------------------------------------------

    def check_accounting(self) -> list[str]:
        """Host pages: free + published + reserved == total, and every reserved page has
        exactly one owner op; pins equal what their owners hold (loads and store writes)."""
        problems = self.index.check()
        owned: list[int] = []
        for op in self.offloads:
            owned += op.host_pages.tolist()
        for op in list(self.queued.values()) + [
            o for b in self.started.values() for o in b.loads
        ]:
            if op.read is not None:
                owned += op.host_pages[op.read_index].tolist()
        for pages in [p for _, p in self.orphans] + self.quarantined:
            owned += pages.tolist()
        if sorted(owned) != sorted(self.index.reserved):
            problems.append(
                f"reserved host pages {sorted(self.index.reserved)[:8]}... are not those ops hold "
                f"{sorted(owned)[:8]}..."
            )
        held: dict[str, int] = {}
        owners = (
            [p for _, p, _ in self.backups]
            + [op.pinned for op in self.queued.values()]
            + [o.pinned for b in self.started.values() for o in b.loads]
            + self.hints.pinned()
        )
        for keys in owners:
            for k in keys:
                held[k] = held.get(k, 0) + 1
        if held != self.index.pins:
            problems.append(
                "host pins differ from what lookups, loads and store writes hold"
            )
        return problems

    def stats(self) -> dict:
        alloc = self.mirror.allocator
        out = {
            "counters": self.counters.as_dict(),
            "host": {
                "pages_total": alloc.num_pages,
                "pages_free": alloc.available_size() // self.page_size,
                "pages_published": len(self.index.pages),
                "pages_pinned": len(self.index.pins),
                "pages_evicted": self.index.evicted_pages,
                "pages_quarantined": sum(p.size for p in self.quarantined),
            },
            "queues": {
                "offloads": len(self.offloads),
                "loads_queued": len(self.queued),
                "loads_started": len(self.started),
                "store_writes": len(self.backups),
            },
            "namespace": self.settings.namespace.id,
            "hints": self.hints.stats(),
        }
        if self.l3 is not None:
            out["store"] = self.l3.stats()
        return out
