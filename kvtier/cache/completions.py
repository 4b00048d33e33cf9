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
from kvtier.cache.loads import Loads
from kvtier.cache.prefetch import Ended, Prefetcher, PrefetchState
from kvtier.cache.writes import Writes
from kvtier.controller.controller import CacheController, Finished, OpKind
from kvtier.controller.stats import Counters
from kvtier.controller.tp import Agreement
from kvtier.tree import TreeNode

log = logging.getLogger(__name__)
# On one rank, polls in a row that may leave finished copies and backups for a later poll
# (no request waits for them; a prefetch's move, a drain, an allocation or eviction that
# fell short, or this many polls apply them)
LAZY_POLLS = 4
UNKNOWN = (
    -1
)  # a prefetch's `present` before its store answered (below every real count, for MIN)


class PollReport:
    """What one rank has finished, or (after `agree`) what every rank has: counts by MIN,
    flags by MAX. The shape follows replicated state only. The one place that knows where
    each number sits in the agreed vectors:

        [writes, loads, backups]                       finished ops of each kind (`Finished`)
        [present, landed, ended] per live prefetch     present UNKNOWN until the store answered
        [settled] per ended, unsettled prefetch        1 once its store call settled
        [landed] per write in flight (tensor parallel) 1 if it landed on this rank
    and apart, by MAX: [stop] per live prefetch, then [abandoned] per live prefetch and per
    ended, unsettled one: 1 if a read of it was given up on stuck on this rank (its unused
    host pages are held back on every rank, so the ranks' host allocators stay the same).
    """

    __slots__ = ("mins", "maxs", "prefetches", "unsettled")

    def __init__(
        self, mins: list[int], maxs: list[int], prefetches: int, unsettled: int
    ) -> None:
        self.mins, self.maxs, self.prefetches, self.unsettled = (
            mins,
            maxs,
            prefetches,
            unsettled,
        )

    @classmethod
    def of(
        cls,
        finished: Finished,
        live: list[PrefetchState],
        unsettled: list[tuple[int, int]],
        writes_landed: list[int],
    ) -> PollReport:
        """This rank's numbers. `ended` is read first: what is read after it is final once
        ended (a read's abandonment is set before `settled`). `unsettled`: (settled,
        abandoned) per ended, unsettled prefetch."""
        mins, stuck = list(finished), []
        for p in live:
            op = p.op
            ended = (
                Ended.SETTLED
                if op.settled
                else Ended.FINISHED
                if op.finished
                else Ended.RUNNING
            )
            present = op.present
            mins += (UNKNOWN if present is None else present, op.landed, ended)
            stuck.append(int(op.abandoned))
        maxs = (
            [int(p.want_stop) for p in live]
            + stuck
            + [abandoned for _, abandoned in unsettled]
        )
        return cls(
            mins + [settled for settled, _ in unsettled] + writes_landed,
            maxs,
            len(live),
            len(unsettled),
        )

    def agree(self, agreement: Agreement) -> PollReport:
        mins, maxs = agreement.agree(self.mins, self.maxs)
        return PollReport(mins, maxs, self.prefetches, self.unsettled)

    @property
    def finished(self) -> Finished:
        return Finished(*self.mins[:_K])

    def prefetch_reports(self) -> list[tuple[int | None, int, int]]:
        """(present or None, landed, ended) per live prefetch, in start order."""
        flat = self.mins[_K : _K + 3 * self.prefetches]
        return [
            (None if present == UNKNOWN else present, landed, ended)
            for present, landed, ended in zip(flat[0::3], flat[1::3], flat[2::3])
        ]

    @property
    def settled(self) -> list[int]:
        at = _K + 3 * self.prefetches
        return self.mins[at : at + self.unsettled]

    @property
    def writes_landed(self) -> list[int]:
        return self.mins[_K + 3 * self.prefetches + self.unsettled :]

    @property
    def stops(self) -> list[int]:
        return self.maxs[: self.prefetches]

    @property
    def abandoned_live(self) -> list[int]:
        return self.maxs[self.prefetches : 2 * self.prefetches]

    @property
    def abandoned(self) -> list[int]:
        """Per ended, unsettled prefetch."""
        return self.maxs[2 * self.prefetches :]


_K = len(Finished._fields)


class Completions:
    def __init__(
        self,
        controller: CacheController,
        writes: Writes,
        loads: Loads,
        prefetcher: Prefetcher,
        agreement: Agreement,
        counters: Counters,
    ) -> None:
        self.ctl = controller
        self.writes = writes
        self.loads = loads
        self.prefetcher = prefetcher
        self.agreement = agreement
        self.tp = agreement.world_size > 1
        self.counters = counters
        # `ctl.moves()` read at the start of the last full poll, if it applied everything it
        # read (None: the next poll reads everything). One rank only: ranks poll in lockstep,
        # one collective each, whatever moved where.
        self._quiet_at: tuple[int, int] | None = None
        self._may_skip = not self.tp and not agreement.consensus_check
        self._deferred = (
            0  # polls in a row that left finished copies or backups for later
        )

    def poll(self, force: bool = False) -> None:
        """Apply what every rank has finished. On one rank, a poll after which nothing has
        moved — no copy or store op changed (`ctl.moves()`), the scheduler changed nothing the
        prefetches read (`Prefetcher.quiet`), no write queued — returns at once: the full
        poll would agree on the same numbers and apply nothing. So does one after which only
        copies or backups finished, up to `LAZY_POLLS` in a row: no request waits for them,
        and applied together with the next prefetch's move they cost one full poll, not one
        each. `force` (a drain, a write-back eviction) applies everything."""
        ctl, pf = self.ctl, self.prefetcher
        ctl.flush_writes()
        moves = (
            ctl.moves()
        )  # before anything is read: a change after it shows at the next poll
        self.counters.polls += 1
        quiet = self._quiet_at
        if quiet is not None and not force and moves[0] == quiet[0] and pf.quiet():
            if moves[1] == quiet[1]:
                self.counters.polls_idle += 1
                return
            if self._deferred < LAZY_POLLS:
                self._deferred += 1
                self.counters.polls_deferred += 1
                return
        pf.changed = False
        errors = self.counters.apply_errors
        self._deferred = 0
        self._full_poll()
        self._quiet_at = (
            moves if self._may_skip and self.counters.apply_errors == errors else None
        )

    def short_of_room(self) -> None:
        """An allocation or an engine's eviction fell short: finished writes unlock device
        pages, so the next poll that sees any applies them."""
        self._deferred = LAZY_POLLS

    def _full_poll(self) -> None:
        ctl, pf = self.ctl, self.prefetcher
        live = pf.live()
        pf.wish_stops(live)
        agreed = PollReport.of(
            ctl.finished(),
            live,
            ctl.unsettled(),
            ctl.writes_landed() if self.tp else [],
        ).agree(self.agreement)
        finished = agreed.finished
        writes = ctl.take(OpKind.WRITE, finished.writes)
        if self.tp:
            for op, ok in zip(writes, agreed.writes_landed):  # landed on every rank?
                op.failed_elsewhere = not ok and op.handle.error is None
        self._each("write", writes, self.writes.apply, self.writes.release)
        self._each(
            "load",
            ctl.take(OpKind.LOAD, finished.loads),
            self.loads.apply,
            self.loads.release,
        )
        self._each(
            "backup",
            ctl.take(OpKind.BACKUP, finished.backups),
            self.writes.apply_backup,
            self.writes.release_backup,
        )
        reports = agreed.prefetch_reports()
        self._each(
            "grant room",
            [reports],
            lambda r: pf.make_grant_room(live, r, agreed.stops),
            lambda r: None,
        )
        for p, (present, landed, ended), stop, stuck in zip(
            live, reports, agreed.stops, agreed.abandoned_live
        ):
            p.op.abandoned_anywhere = p.op.abandoned_anywhere or bool(
                stuck
            )  # before its pages are freed
            if pf.idle(p, present, landed, ended, stop):
                continue  # most polls, most prefetches
            self._each(
                "prefetch",
                [p],
                lambda p: pf.apply(p, present, landed, ended, bool(stop)),  # noqa: B023
                pf.release,
            )
        settled = agreed.settled
        if settled:
            for op in ctl.take_settled(settled, agreed.abandoned):
                pf.free_unused(op)
        pf.mark_ready()
        if self.agreement.consensus_check:
            self.agreement.check(agreed.mins + agreed.maxs)

    def back_up(self, leaves: list[TreeNode]) -> None:
        """Write-back eviction: write the paths to `leaves` to host, wait, apply the writes."""
        self.writes.write_paths(leaves)
        self.ctl.wait_writes()
        self.poll(force=True)

    def drain(self, rounds: int = 100) -> None:
        """Stop prefetches, wait for every transfer and store op, apply all of them (applying
        a write starts its store backup, hence the rounds). A waiting request's prefetch ends
        with what it landed and the request is named ready, as at any end."""
        self.prefetcher.stop_all()
        for _ in range(rounds):
            self.poll(
                force=True
            )  # applies the stops (and grants): no op is left waiting for the scheduler
            if (
                not self.ctl.busy()
            ):  # the same on every rank: each op leaves at an agreed poll
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
                log.exception(
                    "kvtier: applying a %s completion failed (%s); released it",
                    kind,
                    exc,
                )
                try:
                    release(op)
                except Exception:
                    log.exception(
                        "kvtier: releasing a failed %s completion failed", kind
                    )
