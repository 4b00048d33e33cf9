"""The completion side of the cache: starts transfers and applies their results to the
tree. It is the only code that joins the tree and the controller; it runs on the
scheduler thread only and takes its parts explicitly (tree, controller, config, stats,
agreement, clock), never the facade.

Two-phase rule (docs/design.md, "fail closed"): nothing an op writes becomes visible to a
new match before the op completed successfully, and applying one completion either
finishes it or releases what it reserved — `poll()` never stops halfway.

Every `poll()` makes exactly one agreement call (one collective under tensor parallelism)
whose vector length depends only on replicated state (the prefetches started so far), so
every rank calls it the same number of times with the same shape.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np

from kvtier.cache_prefetch import PrefetchSide, PrefetchState
from kvtier.controller.config import ControllerConfig, WritePolicy
from kvtier.controller.controller import CacheController, LoadOp
from kvtier.controller.stats import CacheStats
from kvtier.controller.storage import PageKeys
from kvtier.controller.tp import Agreement
from kvtier.hashing import key_maker
from kvtier.tiers.indices import concat
from kvtier.tree import RadixTree, Tier, TreeNode

log = logging.getLogger(__name__)
D, H = Tier.DEVICE, Tier.HOST


class Applier(PrefetchSide):
    def __init__(self, tree: RadixTree, controller: CacheController, config: ControllerConfig, key_prefix: str,
                 stats: CacheStats, agreement: Agreement, has_mirror: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tree = tree
        self.ctl = controller
        self.cfg = config
        self.key_of = key_maker(key_prefix, tree.namespace_id)  # page hash -> store key
        self.page_size = tree.page_size
        self.counters = stats.counters
        self.latency = stats.latency
        self.agreement = agreement
        self.tp = agreement.world_size > 1
        self.has_mirror = has_mirror
        self.clock = clock
        self.writing: set[int] = set()  # node ids with a device->host write in flight
        self.prefetches: dict[str, PrefetchState] = {}
        self.newly_ready: list[str] = []  # prefetching requests that became ready
        self.events = None  # told of pages that reached the store (kvtier/events/cache_events.py)
        self.orphaned_pages = 0  # device pages of orphaned loads, freed when applied
        self._complained: set[str] = set()
        # tokens an eviction frees beyond the demand, per tier (whole pages)
        whole_pages = lambda size: int(size * config.evict_headroom) // self.page_size * self.page_size
        self.device_headroom = whole_pages(controller.device_alloc.size)
        self.host_headroom = whole_pages(controller.mirror.size) if has_mirror else 0

    # -- device slots -------------------------------------------------------------------------

    def alloc_device(self, n: int) -> np.ndarray | None:
        """`n` device slots (a multiple of page_size), evicting on demand (and the headroom
        beyond it); None if short."""
        alloc = self.ctl.device_alloc
        if alloc.available_size() < n:
            self.evict_device(n - alloc.available_size(), self.device_headroom)
        return alloc.alloc_slots(n)

    def evict_device(self, n: int, headroom: int = 0) -> int:
        """Evict at least `n` device tokens if possible, and up to `headroom` more where no
        write must land first: under write_back, only a demand not met waits for backups."""
        write_back = self.cfg.write_policy == WritePolicy.WRITE_BACK and self.has_mirror
        ev = self.tree.evict_device(n + headroom, backup_first=write_back)
        self._free_evicted(ev)
        evicted = ev.evicted_tokens
        if evicted < n and ev.needs_backup:
            for leaf in ev.needs_backup:  # back the whole path up, root-down, then evict again
                path = []
                while leaf is not self.tree.root and not leaf.backed_up:
                    path.append(leaf)
                    leaf = leaf.parent
                for node in reversed(path):
                    self.write_node(node)
            self.drain_writes()
            ev = self.tree.evict_device(n + headroom - evicted, backup_first=True)
            self._free_evicted(ev)
            evicted += ev.evicted_tokens
        return evicted

    def _free_evicted(self, ev) -> None:
        self.ctl.device_alloc.free_slots(ev.device_slots)
        self.counters.device_evicted_tokens += ev.evicted_tokens

    def _make_host_room(self, n: int) -> None:
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
        if self.ctl.storage is None or not self.ctl.storage.keeps_page_order:
            return  # no hashes gathered on the scheduler thread for a store that ignores them
        hashes = [h for node in nodes if node.hashes for h in node.hashes]
        if hashes:
            self.ctl.storage.touch(PageKeys(hashes, self.key_of))

    # -- writes -------------------------------------------------------------------------------

    def after_insert(self, added: list[TreeNode]) -> None:
        if self.cfg.write_policy == WritePolicy.WRITE_THROUGH and self.has_mirror:
            for node in added:
                self.write_node(node)

    def write_hot_path(self, node: TreeNode) -> None:
        """write_through_selective: back up nodes on the path hit often enough, root-down."""
        path = []
        while node is not self.tree.root:
            path.append(node)
            node = node.parent
        for n in reversed(path):
            if n.hit_count >= self.cfg.write_threshold:
                self.write_node(n)

    def write_node(self, node: TreeNode) -> bool:
        """Queue node's device->host copy (locked until its ack). False if not possible now."""
        if node.backed_up or node.id in self.writing or not node.on_device or not self.has_mirror:
            return node.backed_up or node.id in self.writing
        parent = node.parent
        if parent is not self.tree.root and not self._host_copy_coming(parent):
            return False  # backed-up nodes form a prefix from the root
        self._make_host_room(len(node))
        host = self.ctl.write(node.values[D], node)
        if host is None:
            self.counters.writes_skipped_no_host_space += 1
            return False
        self.tree.lock(node)
        self.writing.add(node.id)
        return True

    def _host_copy_coming(self, node: TreeNode, budget: int = 64) -> bool:
        """Has `node` a host copy, or will a queued write give it one: its own, or (a half
        split off during a write) the lower half's below it. Writes apply in queue order:
        a child's after its parent's, or it fails with it. Past `budget` nodes looked at,
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

    def drain_writes(self) -> None:
        """Wait for every queued write to land and apply it (write-back eviction)."""
        self.ctl.flush_writes()
        for op in list(self.ctl.writes):
            self.ctl.write_stream.wait(op.handle, 30.0)
        self.poll()

    def _apply_write(self, op) -> None:
        node = op.tag
        self.writing.discard(node.id)
        self.tree.unlock(node)
        if op.handle.error is not None or op.failed_elsewhere:
            self._write_failed(op, f"device->host write failed: {op.handle.error or 'on another rank'}")
            return
        try:  # validates before it changes anything
            unused = self.tree.mark_backed_up(node, op.host_slots)
        except ValueError as exc:  # its parent's write failed: a child's copy fails with it
            self._write_failed(op, f"write of {node} depends on a failed write ({exc})")
            return
        op.applied = True  # from here on the tree owns the host slots
        self.ctl.free_host(unused)  # a prefetch from the store may have given part of it a host copy
        self._write_waiting_children(node, op.host_slots.size)
        self.counters.writes += 1
        self.counters.d2h_bytes += op.host_slots.size * self.ctl.pool.bytes_per_token
        self.latency["write"].observe(time.perf_counter() - op.started)
        self._backup_to_store(node)

    def _write_failed(self, op, why: str) -> None:
        self.counters.write_failures += 1
        self._complain("write", why)
        self.ctl.free_host(op.host_slots)
        op.applied = True

    def _release_write(self, op) -> None:
        """Contain a write whose apply raised: unless the tree took its host slots, they go
        back and the node stays device-only."""
        if op.tag.id in self.writing:
            self.writing.discard(op.tag.id)
            self.tree.unlock(op.tag)
        if not op.applied:
            self.ctl.free_host(op.host_slots)

    def _write_waiting_children(self, node: TreeNode, written: int) -> None:
        """Write the children refused while their parent had no host copy coming: those of
        `node` and of the halves split off it during its write (`written` tokens cover
        them all). Each does the same for its own children when it lands."""
        if self.cfg.write_policy != WritePolicy.WRITE_THROUGH:
            return
        landed, covered, n = [node], len(node), node
        while covered < written and n.parent is not self.tree.root:
            n = n.parent
            covered += len(n)
            landed.append(n)
        for n in landed:
            for child in list(n.children.values()):
                if child.on_device and not child.backed_up and child.id not in self.writing:
                    self.write_node(child)

    def _backup_to_store(self, node: TreeNode) -> None:
        if self.ctl.storage is None or not self.cfg.storage_backup:
            return
        keys = PageKeys(self.tree.page_hashes(node), self.key_of)
        pages = node.values[Tier.HOST][:: self.page_size] // self.page_size
        self.tree.protect_host(node)
        if self.events is not None:
            self.events.backup_started(node)
        self.ctl.backup(keys, pages, node)

    def _apply_backup(self, op) -> None:
        self.tree.release_host(op.tag)
        if self.events is not None:
            self.events.backup_done(op.tag, op.ok)
        good = sum(op.ok or [])
        self.counters.l3_write_pages += good
        self.counters.l3_write_failures += len(op.keys) - good
        self.counters.l3_write_bytes += good * self.ctl.mirror.page_bytes
        self.latency["backup"].observe(time.perf_counter() - op.started)

    # -- loads --------------------------------------------------------------------------------

    def start_load(self, node: TreeNode) -> LoadOp | None:
        """Copy the host-only path ending at `node` into fresh device slots, owned by the
        returned op and then by the request that asked: the tree does not change, so no
        other match sees those slots. The request publishes them when it inserts (after its
        forward read them). None if the path is too short or the device has no room."""
        chain = self.tree.nodes_to_load(node)
        total = sum(len(n) for n in chain)
        if total == 0 or total < self.cfg.load_back_min_tokens:
            return None
        anchor = chain[0].parent
        if anchor is not self.tree.root:
            self.tree.lock(anchor)  # allocation may evict: keep the path we load under
        self.tree.protect_host(node)
        try:
            device = self.alloc_device(total)
        finally:
            if anchor is not self.tree.root:
                self.tree.unlock(anchor)
        if device is None:
            self.tree.release_host(node)
            return None
        # allocation may have applied completions that split nodes of the path: walk it again
        host = concat([n.values[Tier.HOST] for n in self.tree.nodes_to_load(node)])
        assert host.size == total, f"the host path to {node} changed length while allocating"
        op = self.ctl.load(host, device, node)
        self.counters.loads += 1
        return op

    def orphan_load(self, op: LoadOp) -> None:
        """The request that started `op` let go of it: its slots are freed once the worker
        has returned (now, if it has)."""
        if op.handle.is_done() and op not in self.ctl.loads:
            self.ctl.device_alloc.free_slots(op.device_slots)
            return
        op.orphaned = True
        self.orphaned_pages += op.device_slots.size // self.page_size

    def _apply_load(self, op: LoadOp) -> None:
        self.tree.release_host(op.tag)
        if op.handle.error is not None:
            self.counters.load_failures += 1
            self._complain("load", f"host->device load failed: {op.handle.error}; the request recomputes")
        else:
            self.counters.h2d_bytes += op.device_slots.size * self.ctl.pool.bytes_per_token
            self.latency["load"].observe(time.perf_counter() - op.started)
        if op.orphaned:
            self._free_orphan(op)

    def _release_load(self, op: LoadOp) -> None:
        if op.orphaned:
            self._free_orphan(op)

    def _free_orphan(self, op: LoadOp) -> None:
        op.orphaned = False
        self.orphaned_pages -= op.device_slots.size // self.page_size
        self.ctl.device_alloc.free_slots(op.device_slots)

    # -- poll ---------------------------------------------------------------------------------

    def poll(self) -> None:
        self.ctl.flush_writes()
        live = [p for p in self.prefetches.values() if p.result is None]  # replicated: same on every rank
        now = self.clock()
        for p in live:
            if p.deadline is not None and now >= p.deadline and not p.op.finished:
                p.want_stop = True
        mins = self.ctl.ready()
        for p in live:
            op = p.op
            ended = 2 if op.settled else int(op.finished)  # first: what is read after is final once ended
            mins += [op.present, op.landed, ended]
        settled_at = len(mins)
        unsettled = self.ctl.unsettled
        if unsettled:
            mins += [int(op.settled) for op in unsettled]
        writes_at = len(mins)
        if self.tp:
            mins += self.ctl.writes_landed()
        maxs = [int(p.want_stop) for p in live]
        agreed, stops = self.agreement.agree(mins, maxs)
        writes = self.ctl.pop(self.ctl.writes, agreed[0])
        if self.tp:
            for op, ok in zip(writes, agreed[writes_at:]):  # landed on every rank?
                op.failed_elsewhere = not ok and op.handle.error is None
        self._each("write", writes, self._apply_write, self._release_write)
        self._each("load", self.ctl.pop(self.ctl.loads, agreed[1]), self._apply_load, self._release_load)
        self._each("backup", self.ctl.pop(self.ctl.backups, agreed[2]), self._apply_backup,
                   lambda op: self.tree.release_host(op.tag))
        for i, p in enumerate(live):
            present, landed, ended = agreed[3 + 3 * i: 6 + 3 * i]
            p.stopped = p.stopped or bool(stops[i])
            if self._idle(p, present, landed, ended, stops[i]):
                continue  # most polls, most prefetches
            self._each("prefetch", [p], lambda p: self._poll_prefetch(p, present, landed, ended, stops[i]),
                       self._release_prefetch)
        if unsettled:
            self._free_settled(agreed[settled_at:writes_at])
        self._mark_ready()
        self.agreement.check(agreed + stops)

    def _each(self, kind: str, ops: list, apply, release) -> None:
        """Apply each completion; one that raises is released, counted and logged, and the
        rest still apply (poll never stops halfway)."""
        for op in ops:
            try:
                apply(op)
            except Exception as exc:
                self.counters.apply_errors += 1
                log.exception("kvtier: applying a %s completion failed (%s); released it", kind, exc)
                try:
                    release(op)
                except Exception:
                    log.exception("kvtier: releasing a failed %s completion failed", kind)

    def _complain(self, kind: str, message: str) -> None:
        """The first failure of a kind at ERROR, the rest at DEBUG (counters carry them)."""
        if kind in self._complained:
            log.debug("%s", message)
        else:
            self._complained.add(kind)
            log.error("%s (further %s failures are counted in stats, not logged)", message, kind)

    def drain(self, rounds: int = 100) -> None:
        """Stop prefetches, wait for every transfer and store op, apply all of them (applying
        a write starts its store backup, hence the rounds). A waiting request's prefetch ends
        with what it landed and the request is named ready, as at any end: discarded, it
        was forgotten, and the request waited forever."""
        for p in self.prefetches.values():
            p.want_stop = True
        for _ in range(rounds):
            self.poll()  # applies the stops (and grants): no op is left waiting for the scheduler
            if not self.ctl.busy():  # the same on every rank: each op leaves at an agreed poll
                break
            self.ctl.wait_idle()
        self.prefetches = {rid: p for rid, p in self.prefetches.items() if p.result is None}
