"""The linker's offloads: device -> host copies of the pages the host tier lacks, published
in the order SGLang offloaded them.

An offload reserves host pages (evicting cold ones) and copies into them on the write
stream; SGLang keeps the node locked until it consumed the offload, so the device pages
are stable while read. `pop_completed` publishes the oldest finished one and hands its
pages to the store writes (`StoreOps.offloaded`). Scheduler thread only.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, field
from itertools import compress

import numpy as np
import torch

from kvtier.tiers.streams import Handle, TransferStream
from kvtier.integrations.sglang.linker.host_index import HostIndex
from kvtier.integrations.sglang.linker.metrics import LinkerCounters
from kvtier.integrations.sglang.linker.store_ops import StoreOps
from kvtier.tiers.indices import page_slots
from kvtier.tiers.mirror import HostMirror
from kvtier.tiers.pool import DeviceKVPool


NO_PAGES = np.zeros(0, np.int64)


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
    whole: bool = False  # `keys` are every page SGLang offloaded, in order (one run)


class Offloads:
    """The one owner of offloads in flight (`ops`, oldest first) and of which op copies
    each key now (`copying`)."""

    def __init__(
        self,
        pool: DeviceKVPool,
        mirror: HostMirror,
        index: HostIndex,
        store_ops: StoreOps,
        counters: LinkerCounters,
        write_stream: TransferStream,
        forward_stream=None,
    ) -> None:
        self.pool, self.mirror, self.index = pool, mirror, index
        self.store_ops, self.counters = store_ops, counters
        self.page_size = pool.config.page_size
        self.write_stream, self.forward_stream = write_stream, forward_stream
        self.ops: deque[OffloadOp] = deque()
        self.copying: dict[
            str, OffloadOp
        ] = {}  # key -> the op whose copy of it is in flight

    def offload(self, keys: list[str], slots: np.ndarray) -> None:
        """Queue the copy of the pages of `keys` (at device `slots`) neither on host nor in
        flight; an op is queued even when there is nothing to copy or no host room."""
        copying = self.copying
        known = self.index.pages
        self.counters.offloads += 1
        # the usual case, in C loops, a dict op or two per key: keys distinct, none on host
        # or in flight (most offloads are all new); `mine` becomes their `copying` entries
        op = OffloadOp(keys, NO_PAGES, None, whole=True)
        mine = dict.fromkeys(keys, op)
        distinct = len(mine) == len(keys)
        if (
            distinct
            and known.keys().isdisjoint(mine.keys())
            and (not copying or copying.keys().isdisjoint(mine.keys()))
        ):
            new, picked, depends = keys, slots, []
        else:
            mine = None
            held = list(map(known.__contains__, keys))
            inflight = copying.keys() & keys if copying else None
            if inflight:
                held = list(map(operator.or_, held, map(inflight.__contains__, keys)))
                ops = map(copying.__getitem__, inflight)
                depends = list({id(o): o for o in ops}.values())
            else:
                depends = []
            if not distinct:  # a key named twice is copied once, from its first page
                first: dict[str, int] = {}
                for i, k in enumerate(keys):
                    first.setdefault(k, i)
                once = set(first.values())
                held = [h or i not in once for i, h in enumerate(held)]
            index = list(compress(range(len(keys)), map(operator.not_, held)))
            new = [keys[i] for i in index]
            picked = slots.reshape(-1, self.page_size)[index].reshape(-1)
        if not new:
            self.ops.append(OffloadOp([], np.zeros(0, np.int64), None, depends))
            return
        pages = self.index.reserve(len(new))
        if pages is None:
            self.counters.offload_no_host_room_pages += len(new)
            self.ops.append(
                OffloadOp([], np.zeros(0, np.int64), None, depends, refused=True)
            )
            return
        host = page_slots(pages, self.page_size)
        handle = Handle(0)
        ready = self._forward_ready()
        self.write_stream.submit(lambda h: self._copy_out(picked, host, ready), handle)
        if mine is None:
            op = OffloadOp(new, pages, handle, depends)
            mine = dict.fromkeys(new, op)
        else:
            op.host_pages, op.handle = pages, handle
        copying.update(mine)
        self.ops.append(op)

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

    def num_completed(self) -> int:
        """How many ops, from the oldest, have finished their copy."""
        n = 0
        for op in self.ops:
            if op.handle is not None and not op.handle.done:
                break
            n += 1
        return n

    def pop_completed(self) -> bool:
        """Publish the oldest op's pages; False if it (or an op it waited on) failed."""
        op = self.ops.popleft()
        assert op.handle is None or op.handle.done, (
            "pop_completed_offload before its copy finished"
        )
        ok = not op.refused and (op.handle is None or op.handle.error is None)
        op.success = ok and all(d.success for d in op.depends)
        if len(self.copying) == len(op.keys):  # the only op in flight: its keys are all
            self.copying.clear()
        else:
            deque(map(self.copying.__delitem__, op.keys), maxlen=0)
        if not ok:
            self.counters.offload_failures += 1
            self.index.release(op.host_pages)
            return False
        # a key a store read published meanwhile keeps that page; the offload's went back free
        kept = self.index.publish(op.keys, op.host_pages)
        keys, pages = op.keys, op.host_pages
        if not all(kept):
            keys = list(compress(keys, kept))
            pages = pages[np.array(kept, dtype=bool)]
        self.counters.offload_pages += len(op.keys)
        self.counters.d2h_bytes += len(op.keys) * self.mirror.page_bytes
        self.store_ops.offloaded(op.keys, keys, pages, op.whole and keys is op.keys)
        if not op.success:
            self.counters.offload_failures += 1
        return op.success

    def quiesce(self) -> None:
        """Wait for every copy; drop the ops unapplied (SGLang releases them as failed)."""
        for op in self.ops:
            if op.handle is not None:
                self.write_stream.wait(op.handle, None)
        while self.ops:
            op = self.ops.popleft()
            for k in op.keys:
                del self.copying[k]
            self.index.release(op.host_pages)

    def close(self) -> None:
        self.write_stream.close()

    def reserved(self) -> list[int]:
        """The host pages the ops in flight reserved."""
        owned: list[int] = []
        for op in self.ops:
            owned += op.host_pages.tolist()
        return owned
