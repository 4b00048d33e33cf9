"""A hybrid model's side components in the cache (SWA KV, recurrent states): per component
its pool, its mirror and the owner of its slots. Scheduler thread only.

Who holds a side slot (kvtier/README.md, "Who owns a slot", per component):

| state | device slot | host slot |
|---|---|---|
| free | `SideSlots`' allocator of the component | its mirror's allocator (the controller's lock) |
| a request's (`acquire`, `alloc_swa`, `alloc_state`) | the request, counted in `handed` | — |
| of a load in flight the request let go | the load, counted in `orphaned`, freed when applied | — |
| reserved by a write in flight | — | the write op, until `poll()` applies it |
| in the tree | the tree; the tree hands what it lets go to `free_tree` (its frees sink) | the tree |
| let go by the tree while a copy reads it (`pin`) | `deferred` until the copy is applied (`unpin`) | likewise |

A slot a copy in flight reads is pinned: the tree may let it go meanwhile (evicted,
tombstoned), but it is not reused before the copy stopped, so what the copy read is what
the tree held.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from kvtier.controller.controller import CacheController
from kvtier.tiers.allocator import PagedAllocator
from kvtier.tiers.components import Component, ComponentSpec
from kvtier.tiers.mirror import HostMirror, MirrorConfig
from kvtier.tiers.pool import DeviceKVPool
from kvtier.tree import HybridRadixTree, Tier
from kvtier.tree.results import ComponentFrees

D, H = Tier.DEVICE, Tier.HOST


class Side:
    """One side component: its pool, its mirror (None without a host tier), its device
    allocator, and the counts of where its slots are."""

    def __init__(self, spec: ComponentSpec, mirror: MirrorConfig | None) -> None:
        self.component = spec.component
        self.pool = DeviceKVPool(spec.pool)
        self.mirror = None if mirror is None else HostMirror(self.pool, mirror)
        self.page_size = spec.pool.page_size
        self.allocator = PagedAllocator(spec.pool.size, self.page_size)
        self.handed = 0  # device slots the requests own
        self.orphaned = 0  # device slots of loads their request let go
        self.pins = (
            Counter(),
            Counter(),
        )  # per tier: slot -> copies in flight reading it
        self.deferred: tuple[list[int], list[int]] = ([], [])  # let go while pinned


class SideSlots:
    def __init__(
        self,
        specs: dict[Component, ComponentSpec],
        mirror: MirrorConfig | None,
        tree: HybridRadixTree,
        controller: CacheController,
    ) -> None:
        self.tree, self.ctl = tree, controller
        self.sides = {
            c: Side(spec, mirror) for c, spec in specs.items() if c != Component.FULL
        }
        for c, side in self.sides.items():
            controller.add_component(c, side.pool, side.mirror)
        tree.set_frees_sink(self.free_tree)

    def __contains__(self, component: Component) -> bool:
        return component in self.sides

    def pool(self, component: Component) -> DeviceKVPool:
        return self.sides[component].pool

    # -- device -------------------------------------------------------------------------------

    def alloc_device(self, component: Component, n: int) -> np.ndarray | None:
        """`n` device slots (a multiple of the page size) for a request, evicting the
        component's unlocked values on demand; None if short."""
        side = self.sides[component]
        short = n - side.allocator.available_size()
        if short > 0:
            self.tree.evict_component(component, D, short)
        slots = side.allocator.alloc_slots(n)
        if slots is not None:
            side.handed += slots.size
        return slots

    def take_back(self, component: Component, n: int) -> None:
        """`n` of the requests' device slots left them (the tree took them, or freed)."""
        self.sides[component].handed -= n

    def free_request(self, component: Component, slots: np.ndarray) -> None:
        """Free device slots a request owns."""
        if slots.size:
            self.sides[component].allocator.free_slots(slots)
            self.sides[component].handed -= slots.size

    def orphan(self, component: Component, n: int) -> None:
        """`n` of the requests' device slots belong to a load their request let go."""
        side = self.sides[component]
        side.handed -= n
        side.orphaned += n

    def free_orphaned(self, component: Component, slots: np.ndarray) -> None:
        if slots.size:
            side = self.sides[component]
            side.allocator.free_slots(slots)
            side.orphaned -= slots.size

    # -- host ---------------------------------------------------------------------------------

    def alloc_host(self, component: Component, n: int) -> np.ndarray | None:
        """`n` host slots for a write, evicting the component's host values on demand;
        None if short (the write goes without this component: a miss there later)."""
        side = self.sides[component]
        if side.mirror is None:
            return None
        short = n - self.ctl.component_host_accounting(component).free
        if short > 0:
            self.tree.evict_component(component, H, short)
        return self.ctl.alloc_component_host(component, n)

    def free_host(self, component: Component, slots: np.ndarray) -> None:
        self.ctl.free_component_host(component, slots)

    # -- slots the tree lets go ---------------------------------------------------------------

    def free_tree(self, frees: ComponentFrees) -> None:
        """The tree's frees sink: every slot it let go, freed unless a copy reads it."""
        for component, tier, slots in (
            (Component.SWA, D, frees.swa_device),
            (Component.SWA, H, frees.swa_host),
            (Component.MAMBA, D, frees.mamba_device),
            (Component.MAMBA, H, frees.mamba_host),
        ):
            if slots.size:
                self._free(self.sides[component], tier, slots)

    def _free(self, side: Side, tier: Tier, slots: np.ndarray) -> None:
        pins = side.pins[tier]
        keep = np.array([pins[s] > 0 for s in slots.tolist()], dtype=bool)
        if keep.any():
            side.deferred[tier].extend(slots[keep].tolist())
            slots = slots[~keep]
        if not slots.size:
            return
        if tier == D:
            side.allocator.free_slots(slots)
        else:
            self.ctl.free_component_host(side.component, slots)

    def pin(self, component: Component, tier: Tier, slots: np.ndarray) -> None:
        """A copy in flight reads `slots`: not reused before `unpin`."""
        side = self.sides[component]
        side.pins[tier].update(slots.tolist())

    def unpin(self, component: Component, tier: Tier, slots: np.ndarray) -> None:
        side = self.sides[component]
        pins = side.pins[tier]
        pins.subtract(slots.tolist())
        for s in slots.tolist():
            if pins[s] <= 0:
                del pins[s]
        deferred = side.deferred[tier]
        free = [s for s in deferred if s not in pins]
        if free:
            side.deferred[tier][:] = [s for s in deferred if s in pins]
            self._free(side, tier, np.array(free, dtype=np.int64))

    # -- checks -------------------------------------------------------------------------------

    def accounting_problems(self) -> list[str]:
        """free + tree + requests + orphaned loads + deferred == total, per component and
        tier; every slot the tree holds allocated."""
        self.tree.take_frees()  # nothing left over from a call that returned none
        problems = []
        for c, side in self.sides.items():
            name = c.value
            tree_d = self.tree.component_evictable_size(
                c, D
            ) + self.tree.component_protected_size(c, D)
            free, total = side.allocator.available_size(), side.pool.config.size
            deferred = len(side.deferred[D])
            if free + tree_d + side.handed + side.orphaned + deferred != total:
                problems.append(
                    f"{name} device: free {free} + tree {tree_d} + requests {side.handed} + "
                    f"orphaned loads {side.orphaned} + deferred {deferred} != {total}"
                )
            strays = side.allocator.unallocated(self._tree_slots(c, D))
            if strays.size:
                problems.append(
                    f"{name} device: the tree holds unallocated slots {strays[:8].tolist()}"
                )
            if side.mirror is None:
                continue
            host = self.ctl.component_host_accounting(c)
            tree_h = self.tree.component_evictable_size(
                c, H
            ) + self.tree.component_protected_size(c, H)
            deferred = len(side.deferred[H])
            if host.free + tree_h + host.in_flight + deferred != side.mirror.size:
                problems.append(
                    f"{name} host: free {host.free} + tree {tree_h} + in flight "
                    f"{host.in_flight} + deferred {deferred} != {side.mirror.size}"
                )
        return problems

    def _tree_slots(self, component: Component, tier: Tier) -> np.ndarray:
        out, stack = [], [self.tree.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is self.tree.root:
                continue
            if component == Component.SWA and n.swa[tier] is not None:
                out.append(n.swa[tier])
            elif component == Component.MAMBA and n.mamba[tier] is not None:
                out.append(np.array([n.mamba[tier]], dtype=np.int64))
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)
