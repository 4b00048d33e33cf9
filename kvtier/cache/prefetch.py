"""The prefetcher: starts a request's store prefetch, grants it host pages, hangs the pages
that landed verified under its anchor, and says when the request may go on. Scheduler
thread only; what it applies each poll is agreed across ranks (`completions.py`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum, IntEnum
from collections.abc import Callable

import numpy as np

from kvtier.cache.slots import Part, Slots
from kvtier.controller.config import ControllerConfig, PrefetchPolicy
from kvtier.controller.stats import CacheStats
from kvtier.controller import store_pages
from kvtier.controller.storage import Outcome, PrefetchOp
from kvtier.storeio.ops import PageKeys
from kvtier.tree import KnownHashes, MatchResult, RadixKey, TreeNode
from kvtier.tree.key import same_prefix


class Ended(IntEnum):
    """How far a prefetch has ended; agreed by MIN, so the order matters."""

    RUNNING = 0
    FINISHED = 1  # no page lands past `landed`
    SETTLED = 2  # and the store stopped touching its pages


class Link(Enum):
    """What a prefetch is to the request that started it."""

    WAITING = "waiting"  # the request waits to be named ready
    READY = "ready"  # named ready: the request may acquire it again
    DISCARDED = (
        "discarded"  # nobody takes it (its request was aborted): forget it when it ends
    )
    AWAITED = "awaited"  # discarded, and a new request with its id waits: name that one when it ends


@dataclass(eq=False)
class PrefetchState:
    """Scheduler-side state of one prefetch: the key it continues and its current anchor."""

    op: PrefetchOp
    whole: (
        RadixKey  # the request's key, as acquired: the pages' hashes hold only for it
    )
    key: RadixKey  # the pages asked for: a suffix of `whole`, from its page `first`
    first: int
    anchor: TreeNode
    deadline: float | None
    link: Link = Link.WAITING
    want_stop: bool = False  # this rank's wish (its clock passed the deadline, a drain)
    stopped: bool = False  # some rank wished it (agreed in a poll): under `timeout`, the request goes on
    broken: bool = False  # applying it raised once: it inserts nothing more
    result: int | None = None  # pages inserted, once ended on every rank
    polls: int = 0

    @property
    def discarded(self) -> bool:
        return self.link in (Link.DISCARDED, Link.AWAITED)


class Prefetcher(Part):
    def __init__(
        self,
        slots: Slots,
        config: ControllerConfig,
        stats: CacheStats,
        key_of: Callable[[bytes], str],
        clock: Callable[[], float],
    ) -> None:
        super().__init__(slots, config, stats)
        self.key_of = key_of
        self.clock = clock
        self.prefetches: dict[str, PrefetchState] = {}  # in start order (replicated)
        self._ready: list[str] = []  # requests named ready since `take_ready`
        # the scheduler changed something a poll reads (a stop wish) since the last full poll:
        # the next one reads everything (`quiet`). A new prefetch is not such a change: until
        # its store op moves (which `ctl.moves()` shows) a poll has nothing of it to apply,
        # and `quiet` already reads a new deadline or a new waiting request
        self.changed = False

    # -- the request's side -------------------------------------------------------------------

    def start(self, request_id: str, key: RadixKey, match: MatchResult) -> bool:
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
        group = self.ctl.storage.group
        if group > 1 and not store_pages.ends(start // ps, pages, group):
            return False  # no whole store page among them (store_pages.py)
        suffix = key[start : start + pages * ps]
        hashing = self.tree.hashing_below(
            anchor, suffix
        )  # run by the storage thread (PageKeys)
        op = PrefetchOp(
            request_id,
            PageKeys(hashing, self.key_of, pages, start // ps),
            tokens=pages * ps,
        )
        deadline = None
        if self.cfg.prefetch_policy == PrefetchPolicy.TIMEOUT:
            deadline = self.clock() + self.cfg.prefetch_timeout(pages * ps)
        if anchor is not self.tree.root:
            self.tree.protect_host(anchor)
        self.prefetches[request_id] = PrefetchState(
            op, key, suffix, start // ps, anchor, deadline
        )
        self.ctl.prefetch(op)
        self.counters.prefetches += 1
        return True

    def started(self, request_id: str) -> bool:
        return request_id in self.prefetches

    def is_ready(self, request_id: str) -> bool:
        """May the request be acquired now? Not while the prefetch of an aborted request
        with the same id still runs: the new one is named by the poll that sees it end."""
        p = self.prefetches.get(request_id)
        if p is not None and p.discarded:
            p.link = Link.AWAITED
            return False
        return p is None or p.link == Link.READY

    def take(
        self, request_id: str, key: RadixKey | None = None
    ) -> tuple[int, KnownHashes | None]:
        """(Tokens the request's (ready) prefetch put on host, the page hashes it computed
        for the key's pages past its match: only if `key` starts with the tokens they were
        computed from); an unfinished one is stopped and finishes on a later poll, nobody
        waiting for it. `key` None: the request lets go of it (abort)."""
        p = self.prefetches.get(request_id)
        if p is None:
            return 0, None
        taken = p.op.inserted * self.page_size
        if p.result is None:
            p.want_stop, p.link = True, Link.DISCARDED
            self.changed = True
        else:
            del self.prefetches[request_id]
        chain = (
            p.op.keys.hashes
        )  # None if the storage thread never hashed them (store down)
        if (
            chain is None
            or key is None
            or not same_prefix(key, p.whole, (p.first + len(chain)) * self.page_size)
        ):
            return taken, None
        return taken, KnownHashes(p.first, chain)

    def take_ended(self, request_id: str) -> bool:
        """For a prefetch no request acquires (an agent's hint): forget it once it has
        ended on every rank (what it landed stays on host); True then, or if unknown."""
        p = self.prefetches.get(request_id)
        if p is None:
            return True
        if p.result is None:
            return False
        del self.prefetches[request_id]
        return True

    def same_key(
        self, request_id: str, tokens, extra_key: str | None
    ) -> RadixKey | None:
        """The key the request's prefetch was started with, if `tokens` (a numpy array, as
        kvtier's own callers pass) and `extra_key` are the same again: the second acquire of
        a request does not copy and check its prompt a second time. Else None."""
        p = self.prefetches.get(request_id)
        if (
            p is None
            or not isinstance(tokens, np.ndarray)
            or tokens.dtype != np.int64
            or extra_key != p.whole.extra_key
        ):
            return None
        whole = p.whole.tokens
        return (
            p.whole
            if tokens.shape == whole.shape and tokens.tobytes() == whole.tobytes()
            else None
        )

    def take_ready(self) -> list[str]:
        """The requests named ready since the last call."""
        ready, self._ready = self._ready, []
        return ready

    def waiting_since(self) -> list[float]:
        """perf_counter start of each prefetch whose request waits (any thread: a snapshot)."""
        return [
            p.op.started
            for p in list(self.prefetches.values())
            if p.link == Link.WAITING
        ]

    # -- the poll's side ----------------------------------------------------------------------

    def live(self) -> list[PrefetchState]:
        """Prefetches not ended on every rank (replicated: the same on every rank)."""
        return [p for p in self.prefetches.values() if p.result is None]

    def wish_stops(self, live: list[PrefetchState]) -> None:
        """This rank's clock passed a deadline: it wishes the prefetch stopped."""
        now = self.clock()
        for p in live:
            if p.deadline is not None and now >= p.deadline and not p.op.finished:
                p.want_stop = True

    def stop_all(self) -> None:
        for p in self.prefetches.values():
            p.want_stop = True
        self.changed = True

    def quiet(self) -> bool:
        """Would a poll whose background state did not move since the last full one change
        nothing here? Not after a change of the scheduler's own (`changed`), nor while a
        prefetch's deadline or its poll count (best effort) decides when its request goes on."""
        if self.changed:
            return False
        policy = self.cfg.prefetch_policy
        if policy == PrefetchPolicy.WAIT_COMPLETE or not self.prefetches:
            return True
        if policy == PrefetchPolicy.TIMEOUT:
            return all(
                p.deadline is None or p.result is not None
                for p in self.prefetches.values()
            )
        return all(p.link is not Link.WAITING for p in self.prefetches.values())

    def forget_ended(self) -> None:
        self.prefetches = {
            rid: p for rid, p in self.prefetches.items() if p.result is None
        }

    def idle(
        self, p: PrefetchState, present: int | None, landed: int, ended: int, stop: int
    ) -> bool:
        """Would `apply` do nothing? (No grant due, no stop, no page landed, not ended.)"""
        return not (ended or stop or p.broken or landed > p.op.inserted) and (
            present is None or p.op.granted
        )

    def apply(
        self, p: PrefetchState, present: int | None, landed: int, ended: int, stop: bool
    ) -> None:
        """What every rank agreed on for `p` this poll: pages the store holds (None: some
        rank does not know yet), pages landed, how far it ended, whether to stop it."""
        p.stopped = p.stopped or stop
        if p.broken:
            landed, stop = p.op.inserted, True
        if present is not None and _grants(p, ended, stop):
            self._grant(p, present)
        op = p.op
        if stop and not op.stop:
            self.ctl.stop_prefetch(op)
        if landed > op.inserted:
            self._insert_landed(p, landed)
        if ended:
            self._end(p, landed, settled=ended >= Ended.SETTLED)

    def release(self, p: PrefetchState) -> None:
        """Contain a prefetch whose apply raised: stop it; nothing more of it is inserted,
        and it ends (pages unused) on a later poll as usual."""
        p.broken = True
        self.ctl.stop_prefetch(p.op)

    def mark_ready(self) -> None:
        """Which waiting requests may go on (per the prefetch policy), after this poll: from
        agreed numbers only, so every rank names the same requests in the same poll."""
        policy, waiting = self.cfg.prefetch_policy, Link.WAITING
        for rid, p in self.prefetches.items():
            if p.link is not waiting:
                continue
            p.polls += 1
            if (
                p.result is not None
                or (policy == PrefetchPolicy.BEST_EFFORT and p.polls >= 1)
                or (policy == PrefetchPolicy.TIMEOUT and p.stopped)
            ):
                p.link = Link.READY
                self._ready.append(rid)

    def free_unused(self, op: PrefetchOp) -> None:
        """An ended op's host pages not inserted (unused, or landed on some rank only)."""
        if op.host_pages is not None and op.host_pages.size > op.inserted:
            self.ctl.free_unused_pages(op)

    def make_grant_room(
        self,
        live: list[PrefetchState],
        reports: list[tuple[int | None, int, int]],
        stops: list[int],
    ) -> None:
        """Host room for every grant this poll makes (agreed numbers: the same on every
        rank), in one eviction pass: each `_grant` then finds its pages free. None for a
        prefetch stopped or ended by now: `apply` grants it nothing."""
        pages = sum(
            present
            for p, (present, _, ended), stop in zip(live, reports, stops)
            if present and _grants(p, ended, stop)
        )
        if pages:
            self.slots.make_host_room(pages * self.page_size)

    def _grant(self, p: PrefetchState, present: int) -> None:
        """Make room on host for the pages the store holds (agreed on every rank), reserve them."""
        if present > 0:
            self.slots.make_host_room(present * self.page_size)
        self.ctl.grant(p.op, present)

    def _end(self, p: PrefetchState, landed: int, settled: bool) -> None:
        """The op ended on every rank: release its anchor; its unused pages go back now if
        its store call has settled on every rank, else in the poll where it has (the same
        poll on every rank)."""
        op = p.op
        if p.anchor is not self.tree.root:
            self.tree.release_host(p.anchor)
            p.anchor = self.tree.root
        self.ctl.end_prefetch(op, settled)
        if settled:
            self.free_unused(op)
        p.result = landed
        c = self.counters
        c.l3_read_pages += landed
        c.l3_read_bytes += op.store_bytes  # whole store pages: pages the tree held too
        c.prefetch_stopped_early += op.outcome == Outcome.STOPPED
        c.prefetch_timed_out += bool(p.deadline is not None and op.stop)
        c.prefetch_errors += op.outcome == Outcome.ERROR
        c.prefetch_skipped_store_down += op.outcome == Outcome.STORE_DOWN
        c.prefetch_skipped_slow += op.outcome == Outcome.SLOW_STORE
        self.latency["prefetch"].observe(time.perf_counter() - op.started)
        if p.discarded:
            del self.prefetches[op.request_id]
            if (
                p.link == Link.AWAITED
            ):  # a new request with its id said "not ready" meanwhile
                self._ready.append(op.request_id)

    def _insert_landed(self, p: PrefetchState, landed: int) -> None:
        """Pages [inserted, landed) are verified on host: hang them under the anchor."""
        op, ps = p.op, self.page_size
        pages = op.host_pages[op.inserted : landed]
        slots = self.ctl.page_slots(pages)
        key = p.key[op.inserted * ps : landed * ps]
        r = self.tree.insert_host(
            p.anchor, key, slots, KnownHashes(0, op.keys.hashes[op.inserted : landed])
        )
        self.ctl.free_host(
            slots[: r.prefix_len]
        )  # already on host: the tree keeps its own copy
        self.tree.protect_host(r.last_node)
        if p.anchor is not self.tree.root:
            self.tree.release_host(p.anchor)
        p.anchor = r.last_node
        op.inserted = landed


def _grants(p: PrefetchState, ended: int, stop: int) -> bool:
    """Does this poll grant `p` host pages (its store has answered)? Not twice, nor one
    broken, stopped or ended by now: it reads nothing, and no host KV is evicted for it."""
    return not (p.op.granted or p.broken or p.stopped or stop or ended)
