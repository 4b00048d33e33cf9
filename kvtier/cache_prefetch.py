"""The prefetch side of the completion code (`cache_sync.Applier` inherits it): starts a
request's store prefetch, grants it host pages, hangs the pages that landed verified under
its anchor, and says when the request may go on. Scheduler thread only, like the rest of
the Applier; the state it uses (tree, controller, config, prefetches) is the Applier's."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvtier.controller.config import PrefetchPolicy
from kvtier.controller.storage import PageKeys, PrefetchOp
from kvtier.tree import KnownHashes, MatchResult, RadixKey, TreeNode
from kvtier.tree.key import same_prefix


@dataclass(eq=False)
class PrefetchState:
    """Scheduler-side state of one prefetch: the key it continues and its current anchor."""

    op: PrefetchOp
    whole: RadixKey  # the request's key, as acquired: the pages' hashes hold only for it
    key: RadixKey  # the pages asked for: a suffix of `whole`, from its page `first`
    first: int
    anchor: TreeNode
    deadline: float | None
    want_stop: bool = False  # this rank's wish (its clock passed the deadline, a drain)
    stopped: bool = False  # some rank wished it (agreed in a poll): under `timeout`, the request goes on
    result: int | None = None  # pages inserted, once finished on every rank
    ready: bool = False  # reported to the server: its request may be acquired again
    discard: bool = False  # nobody takes it (its request was aborted): forget it when it finishes
    waiting: bool = False  # discarded, and a new request with its id waits: name that one when it ends
    broken: bool = False  # applying it raised once: it inserts nothing more
    polls: int = 0


class PrefetchSide:
    """Prefetch methods of `cache_sync.Applier` (its attributes, its poll)."""

    def start_prefetch(self, request_id: str, key: RadixKey, match: MatchResult) -> bool:
        if self.ctl.storage is None or request_id in self.prefetches:
            return False
        anchor = match.best_match_node
        if anchor is not self.tree.root and not anchor.backed_up:
            return False  # prefetched pages need a parent on host
        start = match.device_slots.size + match.host_hit_length
        ps = self.page_size
        pages = (len(key) - start) // ps
        if pages <= 0 or pages * ps < self.cfg.prefetch_min_tokens:
            return False
        suffix = key[start:start + pages * ps]
        hashing = self.tree.hashing_below(anchor, suffix)  # run by the storage thread (PageKeys)
        op = PrefetchOp(request_id, PageKeys(hashing, self.key_of, pages), tag=None, tokens=pages * ps)
        deadline = None
        if self.cfg.prefetch_policy == PrefetchPolicy.TIMEOUT:
            deadline = self.clock() + self.cfg.prefetch_timeout(pages * ps)
        if anchor is not self.tree.root:
            self.tree.protect_host(anchor)
        self.prefetches[request_id] = PrefetchState(op, key, suffix, start // ps, anchor, deadline)
        self.ctl.prefetch(op)
        self.counters.prefetches += 1
        return True

    def is_ready(self, request_id: str) -> bool:
        """May the request be acquired now? Not while the prefetch of an aborted request
        with the same id still runs: the new one is named by the poll that sees it end."""
        p = self.prefetches.get(request_id)
        if p is not None and p.discard:
            p.waiting = True
            return False
        return p is None or p.ready

    def take_prefetch(self, request_id: str, key: RadixKey | None = None) -> tuple[int, KnownHashes | None]:
        """(Tokens the request's (ready) prefetch put on host, the page hashes it computed
        for the key's pages past its match: only if `key` starts with the tokens they were
        computed from); an unfinished one is stopped and finishes on a later poll, nobody
        waiting for it. `key` None: the request lets go of it (abort)."""
        p = self.prefetches.get(request_id)
        if p is None:
            return 0, None
        p.waiting = False
        taken = p.op.inserted * self.page_size
        if p.result is None:
            p.want_stop, p.discard = True, True
        else:
            del self.prefetches[request_id]
        chain = p.op.keys.hashes  # None if the storage thread never hashed them (store down)
        if chain is None or key is None or not same_prefix(key, p.whole, (p.first + len(chain)) * self.page_size):
            return taken, None
        return taken, KnownHashes(p.first, chain)

    def _mark_ready(self) -> None:
        """Which waiting requests may go on (per the prefetch policy), after this poll: from
        agreed numbers only. (Under `timeout`, each rank's own clock passing the deadline
        named the request on one rank a poll before the other, and the ranks' schedulers
        then ran different batches.)"""
        policy = self.cfg.prefetch_policy
        for rid, p in self.prefetches.items():
            if p.ready or p.discard:
                continue
            p.polls += 1
            if p.result is not None or (policy == PrefetchPolicy.BEST_EFFORT and p.polls >= 1) or \
                    (policy == PrefetchPolicy.TIMEOUT and p.stopped):
                p.ready = True
                self.newly_ready.append(rid)

    def _grant(self, p: PrefetchState, present: int) -> None:
        """Make room on host for the pages the store holds (agreed on every rank), reserve them."""
        need = present * self.page_size
        if present > 0:
            self._make_host_room(need)
        self.ctl.grant(p.op, present)

    def _apply_prefetch(self, p: PrefetchState, landed: int, ended: int, stop: bool) -> None:
        """`ended` (agreed): 0 running on some rank, 1 finished on every rank, 2 and its store
        call settled on every rank too."""
        op = p.op
        if stop and not op.stop:
            self.ctl.stop_prefetch(op)
        if landed > op.inserted:
            self._insert_landed(p, landed)
        if not ended:
            return
        self._close_prefetch(p, settled=ended >= 2)
        p.result = landed
        c = self.counters
        c.l3_read_pages += landed
        c.l3_read_bytes += landed * self.ctl.mirror.page_bytes
        c.prefetch_stopped_early += op.outcome == "stopped"
        c.prefetch_timed_out += bool(p.deadline is not None and op.stop)
        c.prefetch_errors += op.outcome == "error"
        c.prefetch_skipped_store_down += op.outcome == "store_down"
        c.prefetch_skipped_slow += op.outcome == "slow_store"
        self.latency["prefetch"].observe(time.perf_counter() - op.started)
        if p.discard:
            del self.prefetches[op.request_id]
            if p.waiting:  # a new request with its id said "not ready" meanwhile
                self.newly_ready.append(op.request_id)

    def _close_prefetch(self, p: PrefetchState, settled: bool) -> None:
        """The op ended: release its anchor; its unused pages go back now if its store call
        has settled on every rank, else in the poll where it has (`_free_settled`): the same
        poll on every rank."""
        op = p.op
        if p.anchor is not self.tree.root:
            self.tree.release_host(p.anchor)
            p.anchor = self.tree.root
        self.ctl.prefetches.pop(op.request_id, None)
        if settled:
            self._free_unused(op)
        else:
            self.ctl.unsettled.append(op)

    def _release_prefetch(self, p: PrefetchState) -> None:
        """Contain a prefetch whose apply raised: stop it; nothing more of it is inserted,
        and it ends (pages unused) on a later poll as usual."""
        p.broken = True
        self.ctl.stop_prefetch(p.op)

    def _free_settled(self, settled: list[int]) -> None:
        """Free the unused pages of the first ended ops whose store calls have settled on
        every rank (`settled`, agreed): host room decides what a write or a prefetch gets and
        what is evicted, so every rank frees them in the same poll."""
        unsettled = self.ctl.unsettled
        for op, done in zip(unsettled, settled):
            if done:
                self._free_unused(op)
        self.ctl.unsettled = [op for op, done in zip(unsettled, settled) if not done] + unsettled[len(settled):]

    def _free_unused(self, op) -> None:
        """An ended op's host pages not inserted (unused, or landed on some rank only)."""
        if op.host_pages is not None and op.host_pages.size > op.inserted:
            self.ctl.free_unused_pages(op)

    def _insert_landed(self, p: PrefetchState, landed: int) -> None:
        """Pages [inserted, landed) are verified on host: hang them under the anchor."""
        op, ps = p.op, self.page_size
        pages = op.host_pages[op.inserted:landed]
        slots = self.ctl.page_slots(pages)
        key = p.key[op.inserted * ps:landed * ps]
        r = self.tree.insert_host(p.anchor, key, slots, KnownHashes(0, op.keys.hashes[op.inserted:landed]))
        self.ctl.free_host(slots[: r.prefix_len])  # already on host: the tree keeps its own copy
        self.tree.protect_host(r.last_node)
        if p.anchor is not self.tree.root:
            self.tree.release_host(p.anchor)
        p.anchor = r.last_node
        op.inserted = landed

    @staticmethod
    def _idle(p: PrefetchState, present: int, landed: int, ended: int, stop: int) -> bool:
        """Would `_poll_prefetch` do nothing? (No grant due, no stop, no page landed, not finished.)"""
        return not (ended or stop or p.broken or landed > p.op.inserted) and \
            (present < 0 or p.op.granted)

    def _poll_prefetch(self, p: PrefetchState, present: int, landed: int, ended: int, stop: int) -> None:
        if p.broken:
            landed, stop = p.op.inserted, 1
        if present >= 0 and not p.op.granted and not p.broken:
            self._grant(p, present)
        self._apply_prefetch(p, landed, ended, bool(stop))
