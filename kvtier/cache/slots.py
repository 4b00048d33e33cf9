"""Who owns a device slot and a host slot, and on-demand eviction (kvtier/README.md, "Who
owns a slot"). `Slots` owns the device allocator — kvtier's own, or one the engine hands
in (`DeviceAllocator`) — and frees what the tree evicts on either tier. Scheduler thread
only."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol
from collections.abc import Callable

import numpy as np

from kvtier.controller.config import ControllerConfig, WritePolicy
from kvtier.controller.controller import CacheController
from kvtier.controller.stats import CacheStats, Counters
from kvtier.cache import page_groups
from kvtier.storeio.ops import PageKeys
from kvtier.tiers.indices import Repeats
from kvtier.tree import RadixTree, Tier, TreeNode
from kvtier.tree.check import tier_slots
from kvtier.tree.results import DeviceEviction


class DeviceAllocator(Protocol):
    """Page-granular device slots (slot 0 is padding), as `tiers.allocator.PagedAllocator`
    has them. An engine that allocates KV slots itself passes an adapter over its own."""

    size: int
    page_size: int

    def available_size(self) -> int: ...
    def alloc_slots(self, n: int) -> np.ndarray | None: ...
    def free_slots(self, slots: np.ndarray) -> None: ...
    def free_group(self) -> AbstractContextManager: ...
    def unallocated(self, slots: np.ndarray) -> np.ndarray: ...


BackUp = Callable[
    [list[TreeNode]], None
]  # write these leaves' paths to host and apply the writes


class Slots:
    def __init__(
        self,
        tree: RadixTree,
        controller: CacheController,
        device: DeviceAllocator,
        config: ControllerConfig,
        counters: Counters,
        key_of: Callable[[bytes], str],
        has_mirror: bool,
        back_up: BackUp,
    ) -> None:
        self.tree = tree
        self.ctl = controller
        self.device = device
        self.page_size = device.page_size
        self.write_back = config.write_policy == WritePolicy.WRITE_BACK and has_mirror
        self.counters = counters
        self.key_of = key_of
        self.has_mirror = has_mirror
        # tokens an eviction frees beyond the demand, per tier (whole pages)
        whole_pages = lambda size: (
            int(size * config.evict_headroom) // self.page_size * self.page_size
        )
        self.device_headroom = whole_pages(device.size)
        self.host_headroom = whole_pages(controller.mirror.size) if has_mirror else 0
        self.back_up = back_up  # write-back eviction backs paths up first (the cache's completions)
        self._repeats = Repeats(
            device.size + device.page_size
        )  # the pool's slots, padding page included

    # -- device -------------------------------------------------------------------------------

    def device_free(self) -> int:
        return self.device.available_size()

    def alloc_device(self, n: int) -> np.ndarray | None:
        """`n` device slots (a multiple of page_size), evicting on demand (and the headroom
        beyond it); None if short."""
        if self.device.available_size() < n:
            self.evict_device(n - self.device.available_size(), self.device_headroom)
        return self.device.alloc_slots(n)

    def free_device(self, slots: np.ndarray) -> None:
        """Free the pages `slots` touch (a double free raises, changing nothing)."""
        if slots.size:
            self.device.free_slots(slots)

    def free_group(self) -> AbstractContextManager:
        """`with slots.free_group(): ...` batches the device frees inside."""
        return self.device.free_group()

    def unallocated(self, slots: np.ndarray) -> np.ndarray:
        return self.device.unallocated(slots)

    def repeated(self, slots: np.ndarray) -> np.ndarray:
        """The device slots `slots` lists more than once (empty if none): two tokens' KV
        in one slot. A few microseconds for a request's row (`Repeats`)."""
        try:
            if not self._repeats.any(slots):
                return slots[:0]
        except IndexError:  # past the pool (an engine's allocator checks its own range)
            pass
        return Repeats.which(slots)

    def evict_device(self, n: int, headroom: int = 0) -> int:
        """Evict at least `n` device tokens if possible, and up to `headroom` more where no
        write must land first: under write_back, only a demand not met waits for backups."""
        ev = self.tree.evict_device(n + headroom, backup_first=self.write_back)
        self._free_evicted(ev)
        evicted = ev.evicted_tokens
        if evicted < n and ev.needs_backup:
            self.back_up(ev.needs_backup)
            ev = self.tree.evict_device(n + headroom - evicted, backup_first=True)
            self._free_evicted(ev)
            evicted += ev.evicted_tokens
        return evicted

    def evict_all_device(self) -> None:
        """Evict every unlocked device token (flush)."""
        self.device.free_slots(
            self.tree.evict_device(self.tree.total_size(Tier.DEVICE)).device_slots
        )

    def _free_evicted(self, ev: DeviceEviction) -> None:
        # scanned for repeats like any free: an engine that put a slot the tree holds into a
        # finish's own part (nothing knows whose a slot is) made the tree hold it twice, and
        # taken as listed it would be queued twice (one slot, two owners)
        self.free_device(ev.device_slots)
        self.counters.device_evicted_tokens += ev.evicted_tokens

    def accounting_problems(self, request_pages: int, orphaned_pages: int) -> list[str]:
        """free + held by the tree + held by requests/ops == total, for pool and mirror."""
        problems, ps, tree = [], self.page_size, self.tree
        dev_free, dev_tree, dev_req = (
            self.device.available_size(),
            tree.total_size(Tier.DEVICE),
            request_pages * ps,
        )
        if (
            dev_req < 0
        ):  # a negative count would balance pages the tree holds but never allocated
            problems.append(f"device: requests hold {dev_req} slots")
        strays = self.device.unallocated(tier_slots(tree, Tier.DEVICE))
        if strays.size:
            problems.append(
                f"device: the tree holds slots whose pages are not allocated: {strays[:8].tolist()}"
            )
        dev_ops, total = orphaned_pages * ps, self.device.size
        if dev_free + dev_tree + dev_req + dev_ops != total:
            problems.append(
                f"device: free {dev_free} + tree {dev_tree} + requests {dev_req} + orphaned loads "
                f"{dev_ops} != {total}"
            )
        if self.has_mirror:
            host = self.ctl.host_accounting()
            host_tree, total = tree.total_size(Tier.HOST), self.ctl.mirror.size
            if host.free + host_tree + host.in_flight + host.quarantined != total:
                problems.append(
                    f"host: free {host.free} + tree {host_tree} + in flight {host.in_flight} "
                    f"+ quarantined {host.quarantined} != {total}"
                )
        return problems

    # -- host ---------------------------------------------------------------------------------

    def make_host_room(self, n: int) -> None:
        """Evict host tokens until `n` are free, and the headroom beyond, if they are short."""
        free = self.ctl.host_available()
        if free < n:
            self.evict_host(n - free + self.host_headroom)

    def evict_host(self, n: int) -> int:
        ev = self.tree.evict_host(n)
        self.ctl.free_host(ev.host_slots)
        self.counters.host_evicted_tokens += ev.evicted_tokens
        self._touch_in_store(ev.removed)
        return ev.evicted_tokens

    def _touch_in_store(self, nodes: list[TreeNode]) -> None:
        """Pages that left host live on in the store only: make them its newest there. A
        page hit on device or host never reaches the store, so by access order alone the
        store would evict the pages used most first."""
        storage = self.ctl.storage
        if storage is None or not storage.keeps_page_order:
            return  # no hashes gathered on the scheduler thread for a store that ignores them
        nodes = [
            node for node in nodes if node.hashes
        ]  # removed nodes: nobody changes them
        chains = [node.hashes for node in nodes]
        if storage.group > 1:  # a store page is keyed by its last page (store_pages.py)
            g, ps = storage.group, self.page_size
            chains = [
                n.hashes[(g - 1 - page_groups.tokens_above(n) // ps) % g :: g]
                for n in nodes
            ]
        count = sum(map(len, chains))
        if count:  # flattened by the storage thread, with the keys
            storage.touch(
                PageKeys(
                    lambda: [h for chain in chains for h in chain], self.key_of, count
                )
            )


class Part:
    """What writes, loads and the prefetcher are built over: the slots (and through them
    the tree and the controller), the controller config and the stats."""

    def __init__(
        self, slots: Slots, config: ControllerConfig, stats: CacheStats
    ) -> None:
        self.tree, self.ctl, self.slots = slots.tree, slots.ctl, slots
        self.cfg = config
        self.counters, self.latency = stats.counters, stats.latency
        self.page_size = slots.page_size
