"""Writes and loads of a hybrid model's cache: FULL KV as `Writes` and `Loads` move it,
with the side components (SWA KV, states) in the same op (`ComponentCopy` extras), so
they land, fail and roll back together. Scheduler thread only.

- A node's write carries its SWA KV and state that are on device and not on host. When
  it lands, each half the node was split into during the write gets its share on host
  (`set_component`); a failed write frees the side host slots it reserved. The device
  slots it reads are pinned (`SideSlots.pin`) until it is applied.
- A node whose FULL KV is already on host gets side components on device later (a finish
  that ends inside another request's node puts its state and window on the split's upper
  half; a window replaces a tombstone): `write_sides` writes them in an op of their own
  (no FULL slots), landing and failing as above. Write-through does it after a finish and
  after each write lands; write-back when a device eviction would drop them (the tree
  lists such a node as needing a backup).
- When a node's FULL pages (or, later, side components written on their own) are backed up to the store, its SWA KV and state on host are
  too, each under its component's namespace (`tiers/components.py`): SWA page i under the
  hash of the node's page i, the state under the hash of its last page; their host slots
  stay pinned until the backup is applied (one store page a device page only).
- A request's load carries the host parts of its window's SWA KV and of its state into
  slots the request owns; the host slots it reads are pinned until it is applied.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kvtier.cache.components import SideSlots
from kvtier.cache.loads import Loads
from kvtier.cache.writes import Writes
from kvtier.controller.config import WritePolicy
from kvtier.controller.controller import ComponentCopy, LoadOp, WriteOp
from kvtier.storeio.ops import PageKeys
from kvtier.tiers.components import Component
from kvtier.tiers.indices import concat
from kvtier.tree import Tier, TreeNode

D, H = Tier.DEVICE, Tier.HOST
_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(eq=False)
class SideBackup:
    """The tag of a side component's store backup: the host slots it reads (pinned until
    it is applied) and what it stored."""

    component: Component
    slots: np.ndarray


class HybridWrites(Writes):
    def __init__(self, side: SideSlots, side_store: dict, *args, **kwargs) -> None:
        """`side_store`: per side component with a store, (key maker of its namespace,
        its Manifest)."""
        super().__init__(*args, **kwargs)
        self.side = side
        self.side_store = side_store
        self._to_store: list[TreeNode] | None = None  # nodes of the write being applied
        # per side component: pages the store took, and pages it did not
        self.side_stored = {c: [0, 0] for c in side_store}
        # node id -> its length when a side-only write of it was queued (its halves, if
        # it is split meanwhile, share what the write read)
        self.writing_sides: dict[int, int] = {}

    def write_node(self, node: TreeNode) -> bool:
        """`Writes.write_node`, with the node's side components on device and not on host
        (a node already backed up: those alone, `write_sides`)."""
        if node.backed_up and node.id not in self.writing:
            self.write_sides(node)
        if (
            node.backed_up
            or node.id in self.writing
            or not node.on_device
            or not self.has_mirror
        ):
            return node.backed_up or node.id in self.writing
        parent = node.parent
        if parent is not self.tree.root and not self._host_copy_coming(parent):
            return False
        self.slots.make_host_room(len(node))
        extras = self._extras(node)
        host = self.ctl.write(node.values[D], node, extras)
        if host is None:
            self._drop_extras(extras)
            self.counters.writes_skipped_no_host_space += 1
            return False
        self.tree.lock(node)
        self.writing.add(node.id)
        return True

    def write_sides(self, node: TreeNode) -> bool:
        """Queue a write of `node`'s side components that are on device and not on host,
        its FULL KV being on host already: an op with no FULL slots, whose side host
        slots are reserved (and whose device slots pinned) until it is applied. False if
        there is nothing to write, or no host room for any of it."""
        if (
            not self.has_mirror
            or not node.backed_up
            or not node.on_device
            or node.id in self.writing
            or node.id in self.writing_sides
            or not self._sides_missing(node)
        ):
            return False
        extras = self._extras(node)
        if not extras:
            self.counters.writes_skipped_no_host_space += 1
            return False
        if self.ctl.write(_EMPTY, node, extras) is None:  # never: no FULL slots
            self._drop_extras(extras)
            return False
        self.writing_sides[node.id] = len(node)
        return True

    def after_finish(self, last: TreeNode, swa_start: int) -> None:
        """Write-through, after a finish's insert ending at `last`: the nodes it gave a
        state or SWA KV whose FULL KV was already on host (not new: `after_insert` writes
        those) get them written too."""
        if self.cfg.write_policy != WritePolicy.WRITE_THROUGH or not self.has_mirror:
            return
        n = last
        while n is not self.tree.root and (n is last or n.start >= swa_start):
            self.write_sides(n)
            n = n.parent

    def write_paths(self, leaves: list[TreeNode]) -> None:
        """`Writes.write_paths`, and the side components on device only of the nodes on
        those paths already backed up (write-back eviction lists a leaf that has them; its
        ancestors become leaves next)."""
        super().write_paths(leaves)
        for leaf in leaves:
            n = leaf
            while n is not self.tree.root:
                self.write_sides(n)  # not backed up: its write carries them
                n = n.parent

    def _sides_missing(self, node) -> bool:
        return any(
            component in self.side and values[D] is not None and values[H] is None
            for component, values in (
                (Component.SWA, node.swa),
                (Component.MAMBA, node.mamba),
            )
        )

    def _extras(self, node) -> tuple[ComponentCopy, ...]:
        out = []
        for component, values in (
            (Component.SWA, node.swa),
            (Component.MAMBA, node.mamba),
        ):
            if component not in self.side or values[D] is None or values[H] is not None:
                continue
            dev = np.asarray(values[D], dtype=np.int64).reshape(-1)
            host = self.side.alloc_host(component, dev.size)
            if host is None:
                continue  # written without it: a miss on host for this component
            self.side.pin(component, D, dev)
            out.append(ComponentCopy(component, dev, host))
        return tuple(out)

    def _drop_extras(self, extras, free_host: bool = True) -> None:
        for x in extras:
            self.side.unpin(x.component, D, x.device_slots)
            if free_host:
                self.side.free_host(x.component, x.host_slots)

    def apply(self, op: WriteOp[TreeNode]) -> None:
        if op.host_slots.size == 0 and op.tag.id in self.writing_sides:
            for h in self._apply_sides(op):  # the side components it put on host
                self._backup_sides(h)
            return
        self._to_store = []
        try:
            super().apply(op)
            extras, op.extras = op.extras, ()
            if self.cfg.write_policy == WritePolicy.WRITE_THROUGH:
                # sides that reached the node while its FULL KV was being written
                after = self._landed(op.tag, op.host_slots.size)
            else:
                after = []
            self._settle_extras(op, extras)
        finally:
            nodes, self._to_store = self._to_store, None
        for node in nodes:  # once the side components it carried are on host
            self._backup_sides(node)
        for h in after:
            if h.backed_up:
                self.write_sides(h)

    def _backup_to_store(self, node: TreeNode) -> None:
        super()._backup_to_store(node)
        if self._to_store is not None:
            self._to_store.append(node)
        else:
            self._backup_sides(node)

    def _backup_sides(self, node: TreeNode) -> None:
        """Store `node`'s SWA KV and state on host under their namespaces, with its FULL
        pages (docs/design.md, "Hybrid models: components"): the SWA page i under the hash
        of the node's page i, the state under the hash of its last page. The host slots
        are pinned until the backup is applied."""
        storage = self.ctl.storage
        if (
            not self.side_store
            or storage is None
            or not self.cfg.storage_backup
            or storage.group > 1
            or not self.tree._in_tree(node)
        ):
            return
        chain = functools.cache(self.tree.hashing_of(node))
        for component, values in (
            (Component.SWA, node.swa),
            (Component.MAMBA, node.mamba),
        ):
            if component not in self.side_store or values[H] is None:
                continue
            key_of, manifest = self.side_store[component]
            if component == Component.SWA:
                slots = np.asarray(values[H], dtype=np.int64)
                pages = slots[:: self.page_size] // self.page_size
                keys = PageKeys(chain, key_of, len(pages))
            else:
                slots = np.array([values[H]], dtype=np.int64)
                pages = slots
                keys = PageKeys(lambda c=chain: c()[-1:], key_of, 1)
            self.side.pin(component, H, slots)
            self.ctl.backup(
                keys,
                pages,
                SideBackup(component, slots),
                component=component,
                manifest=manifest,
            )

    def apply_backup(self, op) -> None:
        if not isinstance(op.tag, SideBackup):
            super().apply_backup(op)
            return
        tag, op.tag = op.tag, None
        if tag is None:
            return
        self.side.unpin(tag.component, H, tag.slots)
        good = sum(op.ok or [])
        counts = self.side_stored[tag.component]
        counts[0] += good
        counts[1] += len(op.keys) - good

    def release_backup(self, op) -> None:
        if not isinstance(op.tag, SideBackup) and op.tag is not None:
            super().release_backup(op)
            return
        tag, op.tag = op.tag, None
        if tag is not None:
            self.side.unpin(tag.component, H, tag.slots)

    def _apply_sides(self, op: WriteOp[TreeNode]) -> list[TreeNode]:
        """A side-only write: each half of the node (split meanwhile) gets its share on
        host if it still holds its FULL KV there; a failed one frees what it reserved. The
        halves, or none if it failed."""
        length = self.writing_sides.pop(op.tag.id)
        extras, op.extras = op.extras, ()
        op.applied = True
        if op.handle.error is not None or op.failed_elsewhere:
            self.counters.write_failures += 1
            self.complain(
                "write",
                f"device->host write of side components failed: "
                f"{op.handle.error or 'on another rank'}",
            )
            self._drop_extras(extras)
            return []
        halves = self._landed(op.tag, length)[::-1]  # top-down
        self._settle(op.tag, halves, extras)
        return halves

    def _settle_extras(self, op: WriteOp[TreeNode], extras) -> None:
        if not extras:
            return
        landed = (
            op.handle.error is None
            and not op.failed_elsewhere
            and op.tag.values[H] is not None
        )
        if not landed:
            self._drop_extras(extras)
            return
        halves = self._landed(op.tag, op.host_slots.size)[::-1]  # top-down
        self._settle(op.tag, halves, extras)

    def _settle(self, node, halves: list, extras) -> None:
        """Each copy that landed goes to the node (a state: its end) or its halves (SWA
        KV: each its tokens'), its device slots unpinned."""
        for x in extras:
            self.side.unpin(x.component, D, x.device_slots)
            if x.component == Component.MAMBA:
                self._settle_state(node, x)
            else:
                self._settle_swa(halves, x)

    def _settle_state(self, node, x: ComponentCopy) -> None:
        if node.mamba[H] is None and node.values[H] is not None:
            self.tree.set_component(node, Component.MAMBA, H, int(x.host_slots[0]))
        else:
            self.side.free_host(x.component, x.host_slots)

    def _settle_swa(self, halves: list, x: ComponentCopy) -> None:
        """Each half gets the host copy of its tokens' SWA KV (what the write read was the
        tree's SWA KV of those tokens: pinned, so not reused meanwhile)."""
        offset = sum(len(h) for h in halves) - x.host_slots.size
        for h in halves:
            lo, hi = max(offset, 0), offset + len(h)
            offset = hi
            if hi <= 0:
                continue
            part = x.host_slots[lo:hi]
            if h.swa[H] is None and h.values[H] is not None:
                self.tree.set_component(h, Component.SWA, H, part)
            else:
                self.side.free_host(x.component, part)

    def release(self, op: WriteOp[TreeNode]) -> None:
        if op.host_slots.size == 0:
            self.writing_sides.pop(op.tag.id, None)
        super().release(op)
        extras, op.extras = op.extras, ()
        self._drop_extras(extras)


class HybridLoads(Loads):
    """Loads whose ops may carry side components (`acquire` builds them); an orphaned
    op's side device slots are freed with its FULL ones, and every host slot it read is
    unpinned when it is applied."""

    def __init__(self, side: SideSlots, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.side = side
        self._pinned: set[LoadOp] = set()  # ops whose extras' host slots are pinned

    def start_hybrid(
        self, node: TreeNode | None, extras: list[ComponentCopy], layers: list
    ) -> LoadOp | None:
        """One load op for a request: the host-only FULL path ending at `node` (None:
        none) into fresh device slots, and `extras` (side components into slots the
        request allocated), per model layer (`layers`). The host slots of `extras` are
        pinned until the op is applied. None (nothing started) if the device is short."""
        chain = [] if node is None else self.tree.nodes_to_load(node)
        total = sum(len(n) for n in chain)
        if chain:
            self.tree.protect_host(node)
        device = self.slots.alloc_device(total) if total else _EMPTY
        if device is None:
            self.tree.release_host(node)
            self.short_of_room()
            return None
        host = (
            concat([n.values[H] for n in self.tree.nodes_to_load(node)])
            if chain
            else _EMPTY
        )
        assert host.size == total, f"the host path to {node} changed length"
        for x in extras:
            self.side.pin(x.component, H, x.host_slots)
        op = self.ctl.load(host, device, node, tuple(extras), layers)
        self._pinned.add(op)
        self.counters.loads += 1
        return op

    def orphan(self, op: LoadOp) -> None:
        done = op.handle.is_done() and not self.ctl.load_pending(op)
        super().orphan(op)
        for x in op.extras:
            if done:
                self.side.free_request(x.component, x.device_slots)
            else:
                self.side.orphan(x.component, x.device_slots.size)

    def apply(self, op: LoadOp) -> None:
        orphaned = op.orphaned
        if op.tag is not None and op.host_slots.size:
            super().apply(op)
        else:  # side parts alone: no host path was protected
            if op.handle.error is not None:
                self.counters.load_failures += 1
                self.complain("load", f"host->device load failed: {op.handle.error}")
            if orphaned:
                self._free_orphan(op)
        self._settle(op, orphaned)

    def release(self, op: LoadOp) -> None:
        orphaned = op.orphaned
        super().release(op)
        self._settle(op, orphaned)

    def _settle(self, op: LoadOp, orphaned: bool) -> None:
        pinned = op in self._pinned
        self._pinned.discard(op)
        for x in op.extras:
            if pinned:
                self.side.unpin(x.component, H, x.host_slots)
            if orphaned:
                self.side.free_orphaned(x.component, x.device_slots)
