"""Device->host writes in prefix order, and the store backups a landed write starts.
Scheduler thread only.

Backed-up nodes form a prefix from the root: a node is written only once its parent has a
host copy or one is coming (a queued write), and writes apply in queue order, a child's
after its parent's (or it fails with it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvtier.cache.slots import Part, Slots
from kvtier.controller.config import ControllerConfig, WritePolicy
from kvtier.controller.controller import WriteOp
from kvtier.controller.stats import CacheStats
from kvtier.controller import store_pages
from kvtier.cache import page_groups
from kvtier.storeio.ops import BackupOp, PageKeys
from kvtier.tree import Tier, TreeNode

log = logging.getLogger(__name__)


class Writes(Part):
    def __init__(
        self,
        slots: Slots,
        config: ControllerConfig,
        stats: CacheStats,
        key_of: Callable[[bytes], str],
        complain: Callable[[str, str], None],
        events=None,
    ) -> None:
        """`events`: told of pages on their way to and in the store (kvtier/events/cache_events.py)."""
        super().__init__(slots, config, stats)
        self.events = events
        self.key_of = key_of
        self.has_mirror = slots.has_mirror
        self.complain = complain
        self.writing: set[int] = set()  # node ids with a device->host write in flight

    def after_insert(self, added: list[TreeNode]) -> None:
        if self.cfg.write_policy == WritePolicy.WRITE_THROUGH and self.has_mirror:
            for node in added:
                self.write_node(node)

    def write_hot_path(self, node: TreeNode) -> None:
        """write_through_selective: back up nodes on the path hit often enough, root-down."""
        for n in self._path(node):
            if n.hit_count >= self.cfg.write_threshold:
                self.write_node(n)

    def write_paths(self, leaves: list[TreeNode]) -> None:
        """Queue writes of every node not backed up on the paths to `leaves`, root-down."""
        for leaf in leaves:
            path = []
            while leaf is not self.tree.root and not leaf.backed_up:
                path.append(leaf)
                leaf = leaf.parent
            for node in reversed(path):
                self.write_node(node)

    def _path(self, node: TreeNode) -> list[TreeNode]:
        path = []
        while node is not self.tree.root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def write_node(self, node: TreeNode) -> bool:
        """Queue node's device->host copy (locked until its ack). False if not possible now."""
        if (
            node.backed_up
            or node.id in self.writing
            or not node.on_device
            or not self.has_mirror
        ):
            return node.backed_up or node.id in self.writing
        parent = node.parent
        if parent is not self.tree.root and not self._host_copy_coming(parent):
            return False  # backed-up nodes form a prefix from the root
        self.slots.make_host_room(len(node))
        host = self.ctl.write(node.values[Tier.DEVICE], node)
        if host is None:
            self.counters.writes_skipped_no_host_space += 1
            return False
        self.tree.lock(node)
        self.writing.add(node.id)
        return True

    def _host_copy_coming(self, node: TreeNode, budget: int = 64) -> bool:
        """Has `node` a host copy, or will a queued write give it one: its own, or (a half
        split off during a write) the lower half's below it. Past `budget` nodes looked at,
        no (a wide subtree never written stays cheap); docs/design.md §7."""
        if node.backed_up or node.id in self.writing:
            return True
        stack = [node]
        while stack and budget > 0:
            for c in stack.pop().children.values():
                budget -= 1
                if c.id in self.writing:
                    return True
                if not c.backed_up and c.on_device:
                    stack.append(c)
        return False

    # -- completions --------------------------------------------------------------------------

    def apply(self, op: WriteOp[TreeNode]) -> None:
        node = op.tag
        self.writing.discard(node.id)
        self.tree.unlock(node)
        if op.handle.error is not None or op.failed_elsewhere:
            self._failed(
                op, f"device->host write failed: {op.handle.error or 'on another rank'}"
            )
            return
        try:  # validates before it changes anything
            unused = self.tree.mark_backed_up(node, op.host_slots)
        except (
            ValueError
        ) as exc:  # its parent's write failed: a child's copy fails with it
            self._failed(op, f"write of {node} depends on a failed write ({exc})")
            return
        op.applied = True  # from here on the tree owns the host slots
        self.ctl.free_host(
            unused
        )  # a prefetch from the store may have given part of it a host copy
        halves = self._landed(node, op.host_slots.size)
        self._write_waiting_children(halves)
        self.counters.writes += 1
        self.counters.d2h_bytes += op.host_slots.size * self.ctl.pool.bytes_per_token
        self.latency["write"].observe(time.perf_counter() - op.started)
        for half in reversed(
            halves
        ):  # root-down: each half split off during the write is stored too
            self._backup_to_store(half)

    def _failed(self, op: WriteOp, why: str) -> None:
        self.counters.write_failures += 1
        self.complain("write", why)
        self.ctl.free_host(op.host_slots)
        op.applied = True

    def release(self, op: WriteOp[TreeNode]) -> None:
        """Contain a write whose apply raised: unless the tree took its host slots, they go
        back and the node stays device-only."""
        if op.tag.id in self.writing:
            self.writing.discard(op.tag.id)
            self.tree.unlock(op.tag)
        if not op.applied:
            self.ctl.free_host(op.host_slots)

    def _landed(self, node: TreeNode, written: int) -> list[TreeNode]:
        """`node` and the halves split off above it during its write, bottom-up (`written`
        tokens cover them all)."""
        landed, covered, n = [node], len(node), node
        while covered < written and n.parent is not self.tree.root:
            n = n.parent
            covered += len(n)
            landed.append(n)
        return landed

    def _write_waiting_children(self, landed: list[TreeNode]) -> None:
        """Write the children refused while their parent had no host copy coming: those of
        the nodes a write just landed. Each does the same for its own children when it lands."""
        if self.cfg.write_policy != WritePolicy.WRITE_THROUGH:
            return
        for n in landed:
            for child in list(n.children.values()):
                if (
                    child.on_device
                    and not child.backed_up
                    and child.id not in self.writing
                ):
                    self.write_node(child)

    def _backup_to_store(self, node: TreeNode) -> None:
        if self.ctl.storage is None or not self.cfg.storage_backup:
            return
        ps, group = self.page_size, self.ctl.storage.group
        pages = node.values[Tier.HOST][::ps] // ps
        first, lead, deferred = 0, None, 0
        if (
            group > 1
        ):  # store pages of several pages: those whose last page is the node's (store_pages.py)
            first = page_groups.tokens_above(node) // ps
            last = store_pages.ends(first, len(pages), group)
            if not last:
                return  # none: a longer sequence's backup stores its pages
            lead, deferred = (
                page_groups.lead_in(node, first % group, ps, Tier.HOST),
                len(pages) - last[-1] - 1,
            )
        keys = PageKeys(
            self.tree.hashing_of(node), self.key_of, len(pages), first
        )  # hashed by the storage thread
        self.tree.protect_host(
            node
        )  # and so the host copies above it, `lead` among them
        if self.events is not None:
            self.events.backup_started(node, 0 if lead is None else len(lead))
        self.ctl.backup(keys, pages, node, lead, deferred)

    def apply_backup(self, op: BackupOp[TreeNode]) -> None:
        self.tree.release_host(op.tag)
        if op.keys.hashes is not None:
            self.tree.adopt_hashes(op.tag, op.keys.hashes)
        good = sum(op.ok or [])
        self.counters.l3_write_pages += good
        self.counters.l3_write_failures += len(op.keys) - good - op.deferred
        self.counters.l3_write_bytes += (
            op.store_bytes
        )  # whole store pages: lead-in pages too
        self.latency["backup"].observe(time.perf_counter() - op.started)
        if (
            self.events is not None
        ):  # last: a release after a raise above forgets it once
            self.events.backup_done(op.tag, op.ok)

    def release_backup(self, op: BackupOp[TreeNode]) -> None:
        self.tree.release_host(op.tag)
        if self.events is not None:
            self.events.backup_done(
                op.tag, None
            )  # nothing stored: forget what it started
