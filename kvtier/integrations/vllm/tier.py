"""`KvtierTier`: kvtier's stores as a vLLM 0.33.0 secondary tier (docs/vllm.md).

vLLM's `TieringOffloadingManager` keeps GPU copies and its CPU primary tier; this tier sits
below it. A cascade (`submit_store`) writes primary rows to the store, a promotion
(`submit_load`) reads them back into the primary rows vLLM pinned for the job. Every store
call runs on the tier's own store loop (kvtier/storeio/) behind kvtier's breaker,
with kvtier's frames and checksums; the scheduler thread only queues work and polls what
finished. Rows go to and from the store as views of the shared primary region: no copy
on this side (a store that reads in place verifies in place). With a tenant key
(docs/security.md) the store keys are the tenant's keyed hashes of vLLM's keys and every
row is sealed; the KV events keep vLLM's own keys.

Threads: vLLM calls the tier under its manager lock, from the scheduler thread or its
tier-poll thread. Those calls own the lookup index and the job table; the loop thread owns
the store and hands outcomes back through one queue. The file store's jobs skip the loop
(one hop, backends/file_direct.py): vLLM's thread submits their thread jobs straight to
the store's I/O threads, the last to end queues the call on that same queue, and
`get_finished_jobs` collects it; the caller checks their deadlines itself and gives a
stuck one up (its stop flags: no row written after). The breaker, shared by both threads,
holds a lock; the store's index takes the direct calls' effects on the loop thread
(handed off: FileStore._handoff). Other stores' jobs run on the loop.
"""

from __future__ import annotations

from typing_extensions import override

import asyncio
import dataclasses
import logging
import queue
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.backends.file_direct import DirectCall
from kvtier.errors import StoreError, StoreTimeout
from kvtier.integrations.stack import build_stack
from kvtier.integrations.observe import startup_line
from kvtier.integrations.vllm.index import LookupIndex, Probe
from kvtier.integrations.vllm.keys import StoreKeys, tier_settings, vllm_geometry
from kvtier.integrations.vllm.metrics import TierMetrics
from kvtier.storeio.call import (
    StagingPool,
    direct_admitted,
    direct_ended,
    guarded,
    read_staged,
)
from kvtier.storeio.cpus import check_cpus
from kvtier.validate import usable_cores

log = logging.getLogger(__name__)


# the file store's I/O threads at least: a thread for each of the jobs vLLM keeps in flight
# (4 in benchmarks/vllm_tier.py), as vLLM's own fs tier gives each job one, but no more
# than the cores they may run on (`job_threads`). On a page cache or tmpfs a read is a
# memory copy and a check, each holding the GIL for part of the page, so threads past the
# cores only take turns, and every turn is a wake-up: on two cores, 4 threads loaded
# 64 x 256 KiB rows at 0.83-0.91x vLLM's tier where 2 load them at 0.93-1.10x
# (benchmarks/vllm_tier.py, docs/vllm.md).
JOB_THREADS = 4

# the direct calls' effects (FileStore.handoff_backlog) that may wait for the store loop
# before the tier posts it a settle_direct to apply them
HANDOFF_BOUND = 256


def job_threads(cpus: Collection[int] | None) -> int:
    """`JOB_THREADS`, or fewer on a machine with fewer cores: those of `cpus`
    (`controller.cpus`, where the store's threads are confined), else those this process
    may run on."""
    cores = len(cpus) if cpus else usable_cores()
    return max(1, min(JOB_THREADS, cores))


def with_job_threads(options, threads: int):
    """A store's options with `max_concurrency` (the file store's I/O threads) raised to
    `threads` (`job_threads`): the store's default keeps half the cores for an engine's
    scheduler, which on two cores is one thread for every job vLLM has in flight, where
    vLLM's own fs tier gives each job a thread. A larger setting is kept."""
    current = getattr(options, "max_concurrency", None)
    if not isinstance(current, int) or current >= threads:
        return options
    return dataclasses.replace(options, max_concurrency=threads)


@dataclass(slots=True, frozen=True)
class _Done:
    """A job's outcome, from the loop thread: `ok[i]` for `keys[i]`."""

    job: TransferJob
    ok: list[bool]
    seconds: float
    nbytes: int
    answered: bool = True  # False: the call failed as a whole (breaker, timeout): nothing learnt of its keys
    unknown: frozenset = (
        frozenset()
    )  # keys whose read failed on an error: nothing learnt of them


def _hand_over(task: asyncio.Task, fut: Future) -> None:
    """A job's or probe's task ended (loop thread): its outcome into the caller's future;
    a task cancelled (the loop closing under it) ends it with the CancelledError, so that
    `_ended` fails its keys."""
    if task.cancelled():
        fut.set_exception(asyncio.CancelledError())
    elif task.exception() is not None:
        fut.set_exception(task.exception())
    else:
        fut.set_result(task.result())


class KvtierTier(TierMetrics, SecondaryTierManager):  # TierMetrics: vLLM's stats hooks
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector=None,
        **tier_config: Any,
    ) -> None:
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, backpressure_detector
        )
        s = tier_settings(tier_type, tier_config)
        self.settings = s
        self.locality = Locality(s.locality) if s.locality is not None else None
        self._flat = primary_kv_view.cast(
            "B"
        )  # rows addressed by byte offset (2-D views cannot be indexed)
        self._row_views: dict[int, memoryview] = {}  # chunk id -> its row (`_rows`)
        # on any error nothing is left running: vLLM shuts down only the tiers it got
        stack = build_stack(
            config=s.config,
            geometry=vllm_geometry(offloading_spec, self.block_size_bytes, s),
            who=f"secondary tier {tier_type!r}",
            store_options=with_job_threads(
                s.config.store.options,
                job_threads(check_cpus(s.config.controller.cpus)),
            ),
            thread="kvtier-vllm-store",
        )
        self.stack = stack
        self.tenant = (
            stack.tenant
        )  # docs/security.md: key id, keyed store keys, sealed store
        self.namespace, self.key_prefix = stack.namespace, stack.key_prefix
        self._store_keys = StoreKeys(stack.key, self.tenant.keyed)
        self._loop, self.store, self.breaker = stack.loop, stack.store, stack.breaker
        # the file store: jobs go straight to its I/O threads (file_direct.py)
        self._direct = self.store if getattr(self.store, "direct_io", False) else None
        self._calls: list[DirectCall] = []  # direct calls not collected yet
        self._settling = False  # a settle_direct posted to the loop and not ended
        self._settled: Future | None = None  # the last settle_direct posted: its end
        if self._direct is not None:
            self._loop.run(self._start_threads())  # on the loop: its CPUs
            self._settle_bytes = max(1, self._direct.config.capacity_bytes // 64)
        self.index = LookupIndex(
            s.index_keys, LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
        )
        self._staging = StagingPool()  # the loop thread's, for stores that need it
        self._outcomes: queue.SimpleQueue = queue.SimpleQueue()  # loop thread -> caller
        self._landed = False  # set after each outcome is queued: the caller drains then
        self._futures: dict[
            Future, TransferJob | Probe
        ] = {}  # every job and probe on the loop, until it ended
        self._jobs = 0  # submitted jobs whose result was not handed to vLLM yet
        self._results: list[JobResult] = []
        wants_events = (
            s.enable_kv_events
            and offloading_spec.kv_events_config.enable_kv_cache_events
        )
        self._events: list[OffloadingEvent] | None = [] if wants_events else None
        self._manifest_written = False
        self._closed = False
        self.counters = {
            "store_jobs": 0,
            "store_keys": 0,
            "store_ok": 0,
            "load_jobs": 0,
            "load_keys": 0,
            "load_ok": 0,
            "direct_jobs": 0,  # jobs that went straight to the file store's threads
            "loop_jobs": 0,  # jobs that ran on the store loop
            "thread_jobs": 0,  # the direct jobs' thread jobs: their hops
        }
        log.info(
            startup_line(
                "vLLM secondary tier",
                s.config,
                self.namespace.id,
                self.tenant.key_id,
                f"vLLM GPU -> vLLM CPU primary -> kvtier store {self.store.name} "
                f"({self.namespace.model_id}, {self.block_size_bytes} B/row)",
            )
        )

    def store_keys(self, keys: Iterable[OffloadKey]) -> list[str]:
        """The store keys of vLLM's keys (through the tenant's keyed hash, with a key); the
        KV events keep vLLM's own keys."""
        return self._store_keys(keys)

    # -- lookups: never wait on the network (index.py) -------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """A dict lookup of the index (and, once something landed since, the outcomes)."""
        if self._landed:
            self._take_outcomes()
        return self.index.lookup(key, req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._take_outcomes()
        for probe in self.index.take_probes():
            self._start(self._probe(probe), probe)

    async def _probe(self, probe: Probe) -> None:
        full = self.store_keys(probe.keys)
        run = await guarded(self.breaker, lambda: self.store.batch_exists(full), 0)
        self._post(("probe", probe, run))

    # -- jobs --------------------------------------------------------------------------------

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        """Every row is written, also one this tier once stored: the store may have evicted
        it since (its capacity, a TTL, another writer's purge), which `index.present` never
        hears of, and vLLM cascades a block only when it newly enters its primary tier."""
        job = job_metadata
        self._jobs += 1
        self.counters["store_jobs"] += 1
        self.counters["store_keys"] += len(job.keys)
        if self._direct is not None and self._manifest_written:
            self._begin_direct(job, write=True)
        else:  # the first write goes on the loop: a namespace's manifest first
            self.counters["loop_jobs"] += 1
            self._start(self._store(job), job)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._jobs += 1
        self.counters["load_jobs"] += 1
        self.counters["load_keys"] += len(job_metadata.keys)
        if self._direct is not None:
            self._begin_direct(job_metadata, write=False)
        else:
            self.counters["loop_jobs"] += 1
            self._start(self._load(job_metadata), job_metadata)

    # -- the file store's jobs: one hop from vLLM's thread (file_direct.py) -------------------

    async def _start_threads(self) -> None:
        self._direct.start_threads()

    def _begin_direct(self, job: TransferJob, write: bool) -> None:
        """Submit `job`'s pages to the file store's I/O threads from this thread. A load
        reads straight into the rows (a job given up on writes none: the stop flags) and
        deletes a row that does not verify in the same thread job."""
        if self._closed:
            raise RuntimeError("kvtier vLLM tier: shut down")
        keys = list(job.keys)
        if not direct_admitted(self.breaker):  # skipped: counted by the breaker
            self._finish(_Done(job, [False] * len(keys), 0.0, 0, answered=False))
            return
        start = time.perf_counter()
        full, rows = self.store_keys(keys), self._rows(job.chunk_ids)
        try:
            if write:
                call = self._direct.begin_set(full, rows, self._landed_direct)
            else:
                call = self._direct.begin_get_into(
                    full, rows, self._landed_direct, drop_bad=True
                )
        except (
            Exception
        ) as exc:  # a bug, not a store failure: fail the job, never hang vLLM
            log.error("kvtier vLLM tier: a store job failed to start: %r", exc)
            self._finish(_Done(job, [False] * len(keys), 0.0, 0, answered=False))
            return
        call.tag = (job, start, full)
        self._calls.append(call)
        self.counters["direct_jobs"] += 1
        self.counters["thread_jobs"] += call.thread_jobs

    def _landed_direct(self, call: DirectCall) -> None:
        """A direct call's last thread job ended (on that I/O thread): queued, no wake-up."""
        self._outcomes.put(("direct", call))
        self._landed = True

    def _end_direct(self, call: DirectCall) -> None:
        """Collect a direct call that ended (this thread); a second time does nothing."""
        if call.ended:
            return
        self._calls.remove(call)
        job, start, full = call.tag
        keys = job.keys
        errors: set[str] = set()
        try:
            if call.write:
                ok = self._direct.end_set(call)
            else:
                ok = self._direct.end_get_into(call, errors)
        except StoreError as exc:  # no page could be written
            if not call.timed_out:
                direct_ended(self.breaker, exc)
            ok = None
        except Exception as exc:  # a bug: say it, fail its keys, never hang vLLM
            log.error("kvtier vLLM tier: a store job failed: %r", exc)
            call.ended = True
            ok = None
        if call.timed_out:  # failed as a whole at its deadline (the breaker was told)
            ok = None
        elif ok is not None:
            direct_ended(self.breaker, None)
        answered, ok = ok is not None, ok or [False] * len(keys)
        seconds, bs = time.perf_counter() - start, self.block_size_bytes
        if call.write:
            self._finish(_Done(job, ok, seconds, len(keys) * bs))
        else:
            unknown = (
                frozenset(k for k, f in zip(keys, full) if f in errors)
                if errors
                else frozenset()
            )
            self._finish(_Done(job, ok, seconds, sum(ok) * bs, answered, unknown))
        self._settle_soon()

    def _check_deadlines(self) -> None:
        """Direct calls past their deadline fail as a whole (the breaker told, as for a
        loop call's timeout); past it by the store's `timeout_s` again (a hung mount),
        they are given up on (`FileStore.give_up`: no row written from then on) and
        their jobs reported failed."""
        now = time.monotonic()
        grace = self._direct.timeout_s
        for call in list(self._calls):
            if now < call.deadline or call.ended:
                continue
            if call.done():
                self._end_direct(call)
                continue
            if not call.timed_out:
                direct_ended(self.breaker, StoreTimeout(self._direct.timed_out(call)))
            if now >= call.deadline + grace:
                direct_ended(self.breaker, self._direct.give_up(call))
                self._calls.remove(call)
                job, start, _ = call.tag
                self._finish(
                    _Done(
                        job,
                        [False] * len(job.keys),
                        time.perf_counter() - start,
                        0,
                        answered=False,
                    )
                )

    def _settle_soon(self) -> None:
        """Once the direct writes added a 64th of the capacity since the last time, or
        `HANDOFF_BOUND` effects wait for the loop (reads and touches alone, which post
        nothing to it, would queue them without end), the loop applies them and holds
        the capacity (`FileStore.settle_direct`), in the background: one wake-up of the
        loop for many jobs."""
        if (
            self._settling
            or self._closed
            or (
                self._direct.direct_unsettled < self._settle_bytes
                and self._direct.handoff_backlog < HANDOFF_BOUND
            )
        ):
            return
        self._post_settle()

    def _post_settle(self) -> Future:
        """Post the loop a settle_direct, keeping the GIL (StoreLoop.post), as every
        hand-over; the future ends with it (`_settled`, the last one posted)."""
        self._settling = True
        self._direct.direct_unsettled = 0
        settled: Future = Future()
        self._settled = settled
        self._loop.post(
            lambda: self._loop.loop.create_task(self._settle()).add_done_callback(
                lambda _: settled.set_result(None)
            )
        )
        return settled

    async def _settle(self) -> None:
        try:
            await guarded(self.breaker, self._direct.settle_direct, None)
        finally:
            self._settling = False

    def _rows(self, chunk_ids) -> list[memoryview]:
        """The primary rows of `chunk_ids`: views of the shared region, each made once (the
        region and its rows are fixed for the tier's lifetime)."""
        views = self._row_views
        ids = chunk_ids.tolist() if hasattr(chunk_ids, "tolist") else chunk_ids
        out = []
        for c in ids:
            view = views.get(c)
            if view is None:
                view = self._row(int(c))
            out.append(view)
        return out

    def _row(self, c: int) -> memoryview:
        bs = self.block_size_bytes
        view = self._flat[c * bs : (c + 1) * bs]
        if 0 <= c and len(view) == bs:  # a row of the region: kept
            self._row_views[c] = view
        return view

    async def _store(self, job: TransferJob) -> None:
        start = time.perf_counter()
        keys = list(job.keys)
        full, rows = self.store_keys(keys), self._rows(job.chunk_ids)
        written = await guarded(
            self.breaker, lambda: self._set(full, rows), [False] * len(keys)
        )
        self._post(
            (
                "job",
                _Done(
                    job,
                    [bool(g) for g in written],
                    time.perf_counter() - start,
                    len(keys) * self.block_size_bytes,
                ),
            )
        )

    async def _set(self, full: list[str], rows: list[memoryview]) -> list[bool]:
        if (
            not self._manifest_written
        ):  # docs/formats.md: a namespace's manifest precedes its first page
            manifest = {
                **self.namespace.manifest(self.block_size_bytes),
                "created": time.time(),
            }
            await self.store.put_manifest(self.key_prefix, self.namespace.id, manifest)
            self._manifest_written = True
        return await self.store.batch_set(full, rows)

    async def _load(self, job: TransferJob) -> None:
        """Verified rows into the pinned primary rows (`read_staged`: a read given up on
        stuck writes into no row vLLM frees and reuses).
        A row that misses or fails verification is False; vLLM frees its primary row unread,
        and the row is deleted from the store before the job is reported (a probe after it
        misses it)."""
        start = time.perf_counter()
        keys = list(job.keys)
        full = self.store_keys(keys)
        rows = self._rows(job.chunk_ids)
        errors: set[str] = set()
        ok = await read_staged(
            self.breaker, self.store, full, rows, self._staging, errors
        )
        answered, ok = ok is not None, ok or [False] * len(keys)
        bad = [k for k, good in zip(full, ok) if not good and k not in errors]
        if (
            answered and bad
        ):  # missing or corrupt: no later probe finds it, here or elsewhere
            await guarded(self.breaker, lambda: self.store.delete(bad), 0)
        self._post(
            (
                "job",
                _Done(
                    job,
                    list(ok),
                    time.perf_counter() - start,
                    sum(ok) * self.block_size_bytes,
                    answered,
                    frozenset(k for k, f in zip(keys, full) if f in errors),
                ),
            )
        )

    def _start(self, coro, what: TransferJob | Probe) -> None:
        """Hand `coro` to the store loop through `StoreLoop.post`: the jobs and probes of
        one step wake it once, with a write that keeps the GIL (storeio/waker.py), where
        a `submit` each cost a GIL-releasing wake-up of the caller, vLLM's scheduler."""
        if self._closed:
            coro.close()
            raise RuntimeError("kvtier vLLM tier: shut down")
        fut: Future = Future()
        self._futures[fut] = what
        fut.add_done_callback(lambda f: self._post(("ended", f)))
        self._loop.post(
            lambda: self._loop.loop.create_task(coro).add_done_callback(
                lambda task: _hand_over(task, fut)
            )
        )

    def _post(self, item: tuple) -> None:
        """Hand an outcome to the caller's thread (from the loop thread)."""
        self._outcomes.put(item)
        self._landed = (
            True  # after the put: a drain that cleared it first sees the item
        )

    def _take_outcomes(self) -> None:
        """Apply what the loop thread finished (caller's thread: it owns the index)."""
        if not self._landed:
            return  # nothing was queued since the last drain
        self._landed = False
        while True:
            try:
                item = self._outcomes.get_nowait()
            except queue.Empty:
                break
            self._apply(item)

    def _apply(self, item: tuple) -> None:
        if item[0] == "direct":
            self._end_direct(item[1])
        elif item[0] == "probe":
            self.index.apply(item[1], item[2])
        elif item[0] == "job":
            self._finish(item[1])
        else:
            self._ended(item[1])

    def _ended(self, fut: Future) -> None:
        """A job's or probe's coroutine ended (after it posted its outcome, if it did);
        a second call for it (`drain_jobs`, then its callback) does nothing."""
        what = self._futures.pop(fut, None)
        if what is None:
            return
        if (
            fut.exception() is not None
        ):  # a bug, not a store failure: say it, fail its keys, never hang vLLM
            log.error("kvtier vLLM tier: a store task failed: %r", fut.exception())
            if isinstance(what, Probe):
                self.index.apply(what, 0)
            else:
                self._finish(_Done(what, [False] * len(what.keys), 0.0, 0))

    def _finish(self, done: _Done) -> None:
        job, ok = done.job, done.ok
        keys = list(job.keys)
        every = all(ok)
        good = keys if every else [k for k, g in zip(keys, ok) if g]
        if job.is_promotion:
            self.counters["load_ok"] += len(good)
            self.index.remember_all(good)
            if not every:
                for k, g in zip(keys, ok):
                    if g:
                        continue
                    if done.answered and k not in done.unknown:
                        self._lost(k)
                    else:  # the call failed as a whole, or this row on an error: recomputed, not promoted again, not announced gone
                        self.index.forget(k)
            partial = None if every else good
        else:
            self.counters["store_ok"] += len(good)
            self.index.stored_all(good)
            if good and self._events is not None:
                self._events.append(
                    OffloadingEvent(
                        keys=good,
                        medium=Medium.STORAGE,
                        removed=False,
                        locality=self.locality,
                        ownership=self.tier_type,
                    )
                )
            partial = None
        self._jobs -= 1
        self._results.append(
            JobResult(
                job_id=job.job_id,
                success=all(ok),
                successful_keys=partial,
                transfer_time=done.seconds,
                transfer_bytes=done.nbytes,
            )
        )

    def _lost(self, key: OffloadKey) -> None:
        """A load found `key` missing or bad: announced gone if it was announced stored;
        a MISS from then on (index.py), until this tier stores it again."""
        if key in self.index.present and self._events is not None:
            self._events.append(
                OffloadingEvent(
                    keys=[key],
                    medium=Medium.STORAGE,
                    removed=True,
                    locality=self.locality,
                    ownership=self.tier_type,
                )
            )
        self.index.forget(key, unreadable=True)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._take_outcomes()
        if self._calls:
            self._check_deadlines()
        done, self._results = self._results, []
        return done

    @override
    def drain_jobs(self) -> None:
        """Wait for every job and probe to end (each store call ends within its timeout,
        plus, after a timeout, until the store stopped touching the rows); results stay
        queued for the next `get_finished_jobs`. The file store's direct calls: each
        waited for up to its deadline and the grace after it, then given up on; the wait
        is on the outcome queue, where each call's last thread job queues it."""
        while self._calls:
            call = self._calls[0]
            left = call.deadline + self._direct.timeout_s - time.monotonic()
            try:
                self._apply(self._outcomes.get(timeout=max(0.0, left)))
            except queue.Empty:
                pass
            self._check_deadlines()
        if self._futures:
            wait(list(self._futures))
        self._take_outcomes()
        for fut in list(self._futures):  # ended, and its callback may not have run yet
            self._ended(fut)

    def _settle_now(self) -> None:
        """Apply the direct calls' effects on the store (the shared byte count of the
        pages they wrote or deleted included) and hold its capacity, now (shutdown). One
        still running in the background is waited for first: the files of the pages it
        evicts are unlinked after it chose them, past the end of a settle that finds the
        capacity held already."""
        if self._direct is not None:
            if self._settled is not None:
                self._settled.result()
            self._post_settle().result()

    @override
    def has_pending_work(self) -> bool:
        self._take_outcomes()
        if self._calls:
            self._check_deadlines()
        return bool(self._jobs or self.index.in_flight or self._results)

    # -- requests, events, hints -------------------------------------------------------------

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self.index.release(req_context.req_id)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        self._take_outcomes()
        if not self._events:
            return ()
        out, self._events[:] = list(self._events), []
        return out

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Known-stored rows just used: the store's eviction order hears it (no I/O waits)."""
        full = self.store_keys(k for k in keys if k in self.index.present)
        if full and not self.breaker.down:
            if self._direct is not None:  # applied before the loop's next call
                self._direct.touch_later(full)
                self._settle_soon()
            else:
                self._loop.post(lambda: self._touch_now(full))

    def _touch_now(self, full: list[str]) -> None:
        try:
            self.store.touch(full)
        except Exception:  # an order hint: never worth a failure
            log.exception("kvtier: touching %d rows in the store failed", len(full))

    def kvtier_stats(self) -> dict:
        return {
            "namespace": self.namespace.id,
            **self.counters,
            **self.index.stats(),
            **self.store.stats(),
            **self.breaker.stats(),
        }

    @override
    def shutdown(self) -> None:
        """Drain, close the store, stop the loop; a second call does nothing."""
        if self._closed:
            return
        self.drain_jobs()
        self._settle_now()
        self._closed = True
        try:
            self._loop.run(self.store.close())
        except Exception as exc:
            log.warning("kvtier: closing the %s store: %s", self.store.name, exc)
        self._loop.close()
        self._row_views.clear()  # the region's rows: vLLM unmaps it once none is held
        self._flat.release()
