"""The one agreement per poll: what every rank has finished, agreed in one collective,
then applied to the tree. Scheduler thread only.

Two-phase rule (docs/design.md, "fail closed"): nothing an op writes becomes visible to a
new match before the op completed successfully, and applying one completion either
finishes it or releases what it reserved — `poll()` never stops halfway.

Every `poll()` makes exactly one agreement call (one collective under tensor parallelism)
whose vector length depends only on replicated state (the prefetches started so far, the
ops in flight), so every rank calls it the same number of times with the same shape. The
vector is `PollReport`, encoded and decoded in one place, field by field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvtier.cache.loads import Loads
from kvtier.cache.prefetch import Ended, Prefetcher, PrefetchState
from kvtier.cache.writes import Writes
from kvtier.controller.controller import CacheController, Finished, OpKind
from kvtier.controller.stats import Counters
from kvtier.controller.tp import Agreement
from kvtier.tree import TreeNode

log = logging.getLogger(__name__)
UNKNOWN = -1  # a prefetch's `present` before its store answered (below every real count, for MIN)


@dataclass(slots=True, frozen=True)
class PrefetchReport:
    present: int | None  # pages the store holds (None: not known yet)
    landed: int
    ended: Ended


@dataclass(slots=True, frozen=True)
class PollReport:
    """What one rank has finished, or (after `agree`) what every rank has: counts by MIN,
    stop wishes by MAX. The shape follows replicated state only."""

    finished: Finished
    prefetches: list[PrefetchReport]  # per live prefetch, in start order
    settled: list[int]  # per ended prefetch whose store call had not settled: 1 if it has
    writes_landed: list[int]  # per write in flight (tensor parallel only): 1 if it landed
    stops: list[int]  # per live prefetch: 1 if a rank wishes it stopped

    def mins(self) -> list[int]:
        out = list(self.finished)
        for p in self.prefetches:
            out += [UNKNOWN if p.present is None else p.present, p.landed, int(p.ended)]
        return out + self.settled + self.writes_landed

    def agree(self, agreement: Agreement) -> "PollReport":
        mins, stops = agreement.agree(self.mins(), self.stops)
        k, n = len(Finished._fields), len(self.prefetches)
        prefetches = [PrefetchReport(None if present == UNKNOWN else present, landed, Ended(ended))
                      for present, landed, ended in zip(*[iter(mins[k:k + 3 * n])] * 3)]
        rest = mins[k + 3 * n:]
        return PollReport(Finished(*mins[:k]), prefetches, rest[:len(self.settled)], rest[len(self.settled):], stops)

    def decisions(self) -> list[int]:
        """Everything agreed, for the consensus check."""
        return self.mins() + self.stops


class Completions:
    def __init__(self, controller: CacheController, writes: Writes, loads: Loads, prefetcher: Prefetcher,
                 agreement: Agreement, counters: Counters) -> None:
        self.ctl = controller
        self.writes = writes
        self.loads = loads
        self.prefetcher = prefetcher
        self.agreement = agreement
        self.tp = agreement.world_size > 1
        self.counters = counters

    def report(self, live: list[PrefetchState]) -> PollReport:
        """This rank's numbers (first `Ended`: what is read after it is final once ended)."""
        finished = self.ctl.finished()
        prefetches = []
        for p in live:
            ended = Ended.of(p.op)
            prefetches.append(PrefetchReport(p.op.present, p.op.landed, ended))
        return PollReport(finished, prefetches, self.ctl.unsettled(), self.ctl.writes_landed() if self.tp else [],
                          [int(p.want_stop) for p in live])

    def poll(self) -> None:
        self.ctl.flush_writes()
        pf = self.prefetcher
        live = pf.live()
        pf.wish_stops(live)
        agreed = self.report(live).agree(self.agreement)
        writes = self.ctl.take(OpKind.WRITE, agreed.finished.writes)
        if self.tp:
            for op, ok in zip(writes, agreed.writes_landed):  # landed on every rank?
                op.failed_elsewhere = not ok and op.handle.error is None
        self._each("write", writes, self.writes.apply, self.writes.release)
        self._each("load", self.ctl.take(OpKind.LOAD, agreed.finished.loads), self.loads.apply, self.loads.release)
        self._each("backup", self.ctl.take(OpKind.BACKUP, agreed.finished.backups), self.writes.apply_backup,
                   self.writes.release_backup)
        for p, r, stop in zip(live, agreed.prefetches, agreed.stops):
            if pf.idle(p, r.present, r.landed, r.ended, bool(stop)):
                continue  # most polls, most prefetches
            self._each("prefetch", [p], lambda p: pf.apply(p, r.present, r.landed, r.ended, bool(stop)), pf.release)
        if agreed.settled:
            for op in self.ctl.take_settled(agreed.settled):
                pf.free_unused(op)
        pf.mark_ready()
        self.agreement.check(agreed.decisions())

    def back_up(self, leaves: list[TreeNode]) -> None:
        """Write-back eviction: write the paths to `leaves` to host, wait, apply the writes."""
        self.writes.write_paths(leaves)
        self.ctl.wait_writes()
        self.poll()

    def drain(self, rounds: int = 100) -> None:
        """Stop prefetches, wait for every transfer and store op, apply all of them (applying
        a write starts its store backup, hence the rounds). A waiting request's prefetch ends
        with what it landed and the request is named ready, as at any end."""
        self.prefetcher.stop_all()
        for _ in range(rounds):
            self.poll()  # applies the stops (and grants): no op is left waiting for the scheduler
            if not self.ctl.busy():  # the same on every rank: each op leaves at an agreed poll
                break
            self.ctl.wait_idle()
        self.prefetcher.forget_ended()

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

