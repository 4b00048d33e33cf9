"""The scheduler-side half of the cache: starts transfers and applies their results to the
tree. It is the only code that joins the tree and the controller, and it runs on the
scheduler thread only.

Every `poll()` makes exactly one agreement call (one collective under tensor parallelism)
whose vector length depends only on replicated state (the prefetches started so far), so
every rank calls it the same number of times with the same shape.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtier.controller.config import PrefetchPolicy, WritePolicy
from kvtier.controller.storage import PrefetchOp
from kvtier.hashing import make_key, page_hashes
from kvtier.tree import MatchResult, RadixKey, Tier, TreeNode

if TYPE_CHECKING:
    from kvtier.cache import TieredCache

log = logging.getLogger(__name__)
D, H = Tier.DEVICE, Tier.HOST


@dataclass(eq=False)
class _Prefetch:
    """Scheduler-side state of one prefetch: the key it continues and its current anchor."""

    op: PrefetchOp
    key: RadixKey
    anchor: TreeNode
    deadline: float | None
    want_stop: bool = False
    result: int | None = None  # tokens inserted, once finished on every rank
    discard: bool = False


class Applier:
    def __init__(self, cache: "TieredCache") -> None:
        self.cache = cache
        self.tree = cache.tree
        self.ctl = cache.controller
        self.cfg = cache.config.controller
        self.counters = cache.stats_obj.counters
        self.latency = cache.stats_obj.latency
        self.writing: set[int] = set()  # node ids with a device->host write in flight
        self.prefetches: dict[str, _Prefetch] = {}

    # -- writes -------------------------------------------------------------------------------

    def after_insert(self, added: list[TreeNode]) -> None:
        if self.cfg.write_policy == WritePolicy.WRITE_THROUGH and self.cache.mirror is not None:
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
        if node.backed_up or node.id in self.writing or not node.on_device or self.cache.mirror is None:
            return node.backed_up or node.id in self.writing
        parent = node.parent
        if parent is not self.tree.root and not parent.backed_up and parent.id not in self.writing:
            return False  # backed-up nodes form a prefix from the root
        if self.ctl.host_available() < len(node):
            self.evict_host(len(node) - self.ctl.host_available())
        host = self.ctl.write(node.device_value, node)
        if host is None:
            self.counters.writes_skipped_no_host_space += 1
            return False
        self.tree.lock(node)
        self.writing.add(node.id)
        return True

    def evict_host(self, n: int) -> int:
        ev = self.tree.evict_host(n)
        self.ctl.free_host(ev.host_indices)
        self.counters.host_evicted_tokens += ev.evicted_tokens
        return ev.evicted_tokens

    def evict_device(self, n: int) -> int:
        write_back = self.cfg.write_policy == WritePolicy.WRITE_BACK and self.cache.mirror is not None
        ev = self.tree.evict_device(n, backup_first=write_back)
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
            ev = self.tree.evict_device(n - evicted, backup_first=True)
            self._free_evicted(ev)
            evicted += ev.evicted_tokens
        return evicted

    def _free_evicted(self, ev) -> None:
        self.ctl.device_alloc.free(ev.device_indices)
        self.counters.device_evicted_tokens += ev.evicted_tokens

    def drain_writes(self) -> None:
        """Wait for every queued write to land and apply it (write-back eviction)."""
        self.ctl.flush_writes()
        for op in list(self.ctl.writes):
            op.handle.finished.wait(self.cache.config.store.timeout_s + 30.0)
        self.poll()

    # -- loads --------------------------------------------------------------------------------

    def load_back(self, node: TreeNode) -> int:
        chain = self.tree.nodes_to_load(node)
        total = sum(len(n) for n in chain)
        if total == 0 or total < self.cfg.load_back_min_tokens:
            return 0
        anchor = chain[0].parent
        self.cache.lock(anchor)  # allocation may evict: keep the path we load under
        self.tree.protect_host(node)
        try:
            device = self.cache._alloc_device(total)
        finally:
            self.cache.unlock(anchor)
        if device is None:
            self.tree.release_host(node)
            return 0
        host = torch.cat([n.host_value for n in chain])
        offset = 0
        for n in chain:
            self.tree.mark_loaded(n, device[offset:offset + len(n)])
            offset += len(n)
        self.tree.lock(node)  # until the copy has landed
        op = self.ctl.load(host, device, node)
        self.cache._new_loads.append(op.handle)
        self.counters.loads += 1
        return total

    # -- prefetch -----------------------------------------------------------------------------

    def start_prefetch(self, request_id: str, key: RadixKey, match: MatchResult) -> bool:
        if self.ctl.storage is None or request_id in self.prefetches:
            return False
        anchor = match.best_match_node
        if anchor is not self.tree.root and not anchor.backed_up:
            return False  # prefetched pages need a parent on host
        start = match.device_indices.numel() + match.host_hit_length
        ps = self.cache.page_size
        pages = (len(key) - start) // ps
        if pages <= 0 or pages * ps < self.cfg.prefetch_min_tokens:
            return False
        suffix = key[start:start + pages * ps]
        prev = self.tree.page_hashes(anchor)[-1] if anchor is not self.tree.root else None
        hashes = page_hashes(suffix.tokens, ps, self.tree.namespace_id, key.extra_key, prev, self.tree.hash_algo)
        keys = [make_key(self.cache.config.store.key_prefix, self.tree.namespace_id, h) for h in hashes]
        op = PrefetchOp(request_id, keys, tag=None, tokens=pages * ps)
        deadline = None
        if self.cfg.prefetch_policy == PrefetchPolicy.TIMEOUT:
            deadline = time.monotonic() + self.cfg.prefetch_timeout(pages * ps)
        if anchor is not self.tree.root:
            self.tree.protect_host(anchor)
        self.prefetches[request_id] = _Prefetch(op, suffix, anchor, deadline)
        self.ctl.prefetch(op)
        self.counters.prefetches += 1
        return True

    def prefetch_done(self, request_id: str) -> bool:
        p = self.prefetches.get(request_id)
        return p is None or p.result is not None

    def take_prefetch(self, request_id: str) -> int:
        p = self.prefetches.get(request_id)
        if p is None:
            return 0
        policy = self.cfg.prefetch_policy
        if policy == PrefetchPolicy.BEST_EFFORT and p.result is None:
            p.want_stop = True
            self.poll()
        elif policy in (PrefetchPolicy.WAIT_COMPLETE, PrefetchPolicy.TIMEOUT):
            # Each store call has a timeout, so a prefetch always ends; TIMEOUT stops earlier.
            # Every iteration polls (one collective on every rank), then sleeps until this
            # rank's storage thread reports progress (or 5 ms, for the other ranks' news).
            while True:
                p.op.progress.clear()
                self.poll()
                if p.result is not None or (policy == PrefetchPolicy.TIMEOUT and p.op.stop.is_set()):
                    break
                p.op.progress.wait(0.005)
        taken = p.op.inserted * self.cache.page_size
        self.counters.storage_hit_tokens += taken
        if p.result is None:
            p.discard = True  # finishes on a later poll; nobody waits for it
        else:
            del self.prefetches[request_id]
        return taken

    def abort_prefetch(self, request_id: str) -> None:
        p = self.prefetches.get(request_id)
        if p is not None:
            p.want_stop, p.discard = True, True

    # -- poll ---------------------------------------------------------------------------------

    def poll(self) -> None:
        self.ctl.flush_writes()
        live = list(self.prefetches.values())
        now = time.monotonic()
        for p in live:
            if p.deadline is not None and now >= p.deadline and not p.op.finished:
                p.want_stop = True
        mins = self.ctl.ready()
        for p in live:
            mins += [p.op.present, p.op.landed, int(p.op.finished)]
        maxs = [int(p.want_stop) for p in live]
        agreed, stops = self.cache.agreement.agree(mins, maxs)
        self._apply_writes(agreed[0])
        self._apply_loads(agreed[1])
        self._apply_backups(agreed[2])
        for i, p in enumerate(live):
            present, landed, finished = agreed[3 + 3 * i: 6 + 3 * i]
            if present >= 0 and not p.op.granted.is_set():
                self._grant(p, present)
            self._apply_prefetch(p, landed, bool(finished), bool(stops[i]))
        self.cache.agreement.check(agreed + stops)

    def _grant(self, p: _Prefetch, present: int) -> None:
        """Make room on host for the pages the store holds (agreed on every rank), reserve them."""
        need = present * self.cache.page_size
        if present > 0 and self.ctl.host_available() < need:
            self.evict_host(need - self.ctl.host_available())
        self.ctl.grant(p.op, present)

    def _apply_writes(self, n: int) -> None:
        for op in self.ctl.pop(self.ctl.writes, n):
            node = op.tag
            self.writing.discard(node.id)
            self.tree.unlock(node)
            if op.handle.error is not None:
                log.error("device->host write failed: %s; %s stays device-only", op.handle.error, node)
                self.ctl.free_host(op.host_indices)
                continue
            # a prefetch from the store may have given (part of) the path a host copy first
            self.ctl.free_host(self.tree.mark_backed_up(node, op.host_indices))
            self._write_waiting_children(node, op.host_indices.numel())
            self.counters.writes += 1
            self.counters.d2h_bytes += op.host_indices.numel() * self.cache.pool.bytes_per_token
            self.latency["write"].observe(time.perf_counter() - op.started)
            self._backup_to_store(node)

    def _write_waiting_children(self, node: TreeNode, written: int) -> None:
        """Children inserted while this write was in flight under a half split off from
        `node` could not be written then: that half had no host copy and no write of its
        own. `written` tokens cover `node` and any such halves above it."""
        if self.cfg.write_policy != WritePolicy.WRITE_THROUGH:
            return
        covered, n = len(node), node
        while covered < written and n.parent is not self.tree.root:
            n = n.parent
            covered += len(n)
            for child in list(n.children.values()):
                if child.on_device and not child.backed_up and child.id not in self.writing:
                    self.write_node(child)

    def _backup_to_store(self, node: TreeNode) -> None:
        if self.ctl.storage is None or not self.cfg.storage_backup:
            return
        prefix = self.cache.config.store.key_prefix
        keys = [make_key(prefix, self.tree.namespace_id, h) for h in self.tree.page_hashes(node)]
        pages = node.host_value[:: self.cache.page_size] // self.cache.page_size
        self.tree.protect_host(node)
        self.ctl.backup(keys, pages, node)

    def _apply_loads(self, n: int) -> None:
        for op in self.ctl.pop(self.ctl.loads, n):
            node = op.tag
            self.tree.unlock(node)
            self.tree.release_host(node)
            if op.handle.error is not None:
                self._undo_load(node, op)
                continue
            self.counters.h2d_bytes += op.device_indices.numel() * self.cache.pool.bytes_per_token
            self.latency["load"].observe(time.perf_counter() - op.started)

    def _undo_load(self, node: TreeNode, op) -> None:
        """A load that failed leaves no device copy behind: demote the chain bottom-up."""
        log.critical("host->device load failed: %s; demoting the loaded path", op.handle.error)
        loaded = set(op.device_indices.tolist())
        while node is not self.tree.root and node.on_device and set(node.device_value.tolist()) <= loaded:
            self.ctl.device_alloc.free(self.tree.demote(node))
            node = node.parent

    def _apply_backups(self, n: int) -> None:
        for op in self.ctl.pop(self.ctl.backups, n):
            self.tree.release_host(op.tag)
            good = sum(op.ok or [])
            self.counters.l3_write_pages += good
            self.counters.l3_write_failures += len(op.keys) - good
            self.counters.l3_write_bytes += good * self.cache.mirror.page_bytes
            self.latency["backup"].observe(time.perf_counter() - op.started)

    def _apply_prefetch(self, p: _Prefetch, landed: int, finished: bool, stop: bool) -> None:
        op = p.op
        if stop and not op.stop.is_set():
            self.ctl.stop_prefetch(op)
        if landed > op.inserted:
            self._insert_landed(p, landed)
        if not finished:
            return
        if op.host_pages is not None and op.host_pages.numel() > op.inserted:
            self.ctl.free_host(self.ctl.page_slots(op.host_pages[op.inserted:]))  # unused or unagreed
        if p.anchor is not self.tree.root:
            self.tree.release_host(p.anchor)
        del self.ctl.prefetches[op.request_id]
        p.result = landed
        c = self.counters
        c.l3_read_pages += landed
        c.l3_read_bytes += landed * self.cache.mirror.page_bytes
        c.prefetch_stopped_early += op.outcome == "stopped"
        c.prefetch_timed_out += bool(p.deadline is not None and op.stop.is_set())
        c.prefetch_errors += op.outcome == "error"
        self.latency["prefetch"].observe(time.perf_counter() - op.started)
        if p.discard:
            del self.prefetches[op.request_id]

    def _insert_landed(self, p: _Prefetch, landed: int) -> None:
        """Pages [inserted, landed) are verified on host: hang them under the anchor."""
        op, ps = p.op, self.cache.page_size
        pages = op.host_pages[op.inserted:landed]
        slots = self.ctl.page_slots(pages)
        key = p.key[op.inserted * ps:landed * ps]
        r = self.tree.insert_host(p.anchor, key, slots)
        self.ctl.free_host(slots[: r.prefix_len])  # already on host: the tree keeps its own copy
        self.tree.protect_host(r.last_node)
        if p.anchor is not self.tree.root:
            self.tree.release_host(p.anchor)
        p.anchor = r.last_node
        op.inserted = landed

    def drain(self, rounds: int = 100) -> None:
        """Stop prefetches, wait for every transfer and store op, apply all of them (applying
        a write starts its store backup, hence the rounds)."""
        for p in self.prefetches.values():
            p.want_stop, p.discard = True, True
        for _ in range(rounds):
            self.ctl.wait_idle()
            self.poll()
            c = self.ctl
            if not (c.writes or c.loads or c.backups or c.prefetches or c._queued_writes):
                break
        self.prefetches.clear()
