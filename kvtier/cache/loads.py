"""Host->device loads of a request's host-only prefix, into device slots the request will
own. Scheduler thread only.

A load's slots belong to its op until the worker has returned, then to the request that
asked; the tree does not change, so no other match sees them. A request that lets go of
its load before the copy stopped leaves it *orphaned*: its slots are freed when the op is
applied (`orphaned_pages` counts them meanwhile)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier.cache.slots import Part, Slots
from kvtier.controller.config import ControllerConfig
from kvtier.controller.controller import LoadOp
from kvtier.controller.stats import CacheStats
from kvtier.tiers.indices import concat
from kvtier.tree import Tier, TreeNode


class Loads(Part):
    def __init__(
        self,
        slots: Slots,
        config: ControllerConfig,
        stats: CacheStats,
        complain: Callable[[str, str], None],
        short_of_room: Callable[[], None],
    ) -> None:
        """`short_of_room`: called when a load finds no device room (writes in flight lock
        device pages, and the next poll must apply those that landed: the completions')."""
        super().__init__(slots, config, stats)
        self.complain = complain
        self.short_of_room = short_of_room
        self.orphaned_pages = 0  # device pages of orphaned loads, freed when applied

    def start(self, node: TreeNode) -> LoadOp[TreeNode] | None:
        """Copy the host-only path ending at `node` into fresh device slots, owned by the
        returned op and then by the request that asked. None if the path is too short or
        the device has no room. The caller holds a lock on the path's device end (the
        request's prefix, `acquire`): the allocation may evict, never the path loaded under."""
        chain = self.tree.nodes_to_load(node)
        total = sum(len(n) for n in chain)
        if total == 0 or total < self.cfg.load_back_min_tokens:
            return None
        anchor = chain[0].parent
        assert anchor is self.tree.root or anchor.locks[Tier.DEVICE], (
            f"loading under {anchor}, which nobody locked"
        )
        self.tree.protect_host(node)
        device = self.slots.alloc_device(total)
        if device is None:
            self.tree.release_host(node)
            self.short_of_room()
            return None
        # allocation may have applied completions that split nodes of the path: walk it again
        host = concat([n.values[Tier.HOST] for n in self.tree.nodes_to_load(node)])
        assert host.size == total, (
            f"the host path to {node} changed length while allocating"
        )
        op = self.ctl.load(host, device, node)
        self.counters.loads += 1
        return op

    def orphan(self, op: LoadOp) -> None:
        """The request that started `op` let go of it: its slots are freed once the worker
        has returned (now, if it has)."""
        if op.handle.is_done() and not self.ctl.load_pending(op):
            self.slots.free_device(op.device_slots)
            return
        op.orphaned = True
        self.orphaned_pages += op.device_slots.size // self.page_size

    def apply(self, op: LoadOp[TreeNode]) -> None:
        self.tree.release_host(op.tag)
        if op.handle.error is not None:
            self.counters.load_failures += 1
            self.complain(
                "load",
                f"host->device load failed: {op.handle.error}; the request recomputes",
            )
        else:
            self.counters.h2d_bytes += (
                op.device_slots.size * self.ctl.pool.bytes_per_token
            )
            self.latency["load"].observe(time.perf_counter() - op.started)
        if op.orphaned:
            self._free_orphan(op)

    def release(self, op: LoadOp) -> None:
        if op.orphaned:
            self._free_orphan(op)

    def _free_orphan(self, op: LoadOp) -> None:
        op.orphaned = False
        self.orphaned_pages -= op.device_slots.size // self.page_size
        self.slots.free_device(op.device_slots)
