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
the store and the breaker and hands outcomes back through one queue.
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

from kvtier.integrations.stack import build_stack
from kvtier.integrations.observe import startup_line
from kvtier.integrations.vllm.index import LookupIndex, Probe
from kvtier.integrations.vllm.keys import page_hash_of, tier_settings, vllm_geometry
from kvtier.integrations.vllm.metrics import TierMetrics
from kvtier.storeio.call import StagingPool, guarded, read_staged

log = logging.getLogger(__name__)


# the file store's I/O threads at least: a thread for each of the jobs vLLM keeps in flight
# (4 in benchmarks/vllm_tier.py). On a page cache or tmpfs a read is a memory copy under
# the GIL, so threads past the jobs only take turns: 8 on two cores cost a quarter of the
# 256 KiB rows' throughput against 4.
JOB_THREADS = 4


def with_job_threads(options):
    """A store's options with `max_concurrency` (the file store's I/O threads) raised to
    `JOB_THREADS`: the store's default keeps half the cores for an engine's scheduler,
    which on two cores is one thread for every job vLLM has in flight, where vLLM's own
    fs tier gives each job a thread. A larger setting is kept."""
    threads = getattr(options, "max_concurrency", None)
    if not isinstance(threads, int) or threads >= JOB_THREADS:
        return options
    return dataclasses.replace(options, max_concurrency=JOB_THREADS)


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
        # on any error nothing is left running: vLLM shuts down only the tiers it got
        stack = build_stack(
            config=s.config,
            geometry=vllm_geometry(offloading_spec, self.block_size_bytes, s),
            who=f"secondary tier {tier_type!r}",
            store_options=with_job_threads(s.config.store.options),
            thread="kvtier-vllm-store",
        )
        self.stack = stack
        self.tenant = (
            stack.tenant
        )  # docs/security.md: key id, keyed store keys, sealed store
        self.namespace, self.key_prefix, self._key = (
            stack.namespace,
            stack.key_prefix,
            stack.key,
        )
        self._loop, self.store, self.breaker = stack.loop, stack.store, stack.breaker
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
        return [self._key(page_hash_of(k, self.tenant.keyed)) for k in keys]

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
        self._start(self._store(job), job)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._jobs += 1
        self.counters["load_jobs"] += 1
        self.counters["load_keys"] += len(job_metadata.keys)
        self._start(self._load(job_metadata), job_metadata)

    def _rows(self, chunk_ids) -> list[memoryview]:
        bs = self.block_size_bytes
        return [self._flat[int(c) * bs : (int(c) + 1) * bs] for c in chunk_ids]

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
            if item[0] == "probe":
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
        good = [k for k, g in zip(keys, ok) if g]
        if job.is_promotion:
            self.counters["load_ok"] += len(good)
            for k, g in zip(keys, ok):
                if g:
                    self.index.remember(k)
                elif done.answered and k not in done.unknown:
                    self._lost(k)
                else:  # the call failed as a whole, or this row on an error: recomputed, not promoted again, not announced gone
                    self.index.forget(k)
            partial = None if all(ok) else good
        else:
            self.counters["store_ok"] += len(good)
            for k in good:
                self.index.stored(k)
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
        done, self._results = self._results, []
        return done

    @override
    def drain_jobs(self) -> None:
        """Wait for every job and probe to end (each store call ends within its timeout,
        plus, after a timeout, until the store stopped touching the rows); results stay
        queued for the next `get_finished_jobs`."""
        wait(list(self._futures))
        self._take_outcomes()
        for fut in list(self._futures):  # ended, and its callback may not have run yet
            self._ended(fut)

    @override
    def has_pending_work(self) -> bool:
        self._take_outcomes()
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
        self._closed = True
        try:
            self._loop.run(self.store.close())
        except Exception as exc:
            log.warning("kvtier: closing the %s store: %s", self.store.name, exc)
        self._loop.close()
        self._flat.release()
