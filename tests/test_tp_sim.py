"""Tensor-parallel ranks that see different faults still decide alike (kvtier/testing/tp_sim.py):
two ranks on threads, the engine's choices the same on both, each rank's copies and store
calls ending its own way. After every step the ranks' trees, slots and requests must be
the same, and every byte each rank's forwards read is checked.

The episodes below each failed with one fix reverted:
- 253228484: a device->host write that landed on one rank and failed on the other gave
  the node a host copy on one rank only (now the write fails on every rank);
- 1063938749: an ended prefetch's unused host pages went back when the store call settled
  on *this* rank, so host room (which decides writes, grants and evictions) differed (now
  freed in the poll where every rank's call has settled);
- 1014138928: a prefetch whose `batch_exists` failed on one rank left "pages present"
  unknown there, and the other rank's prefetch waited for a grant forever (now an op that
  ends without an answer holds 0 pages);
- 288545018: under `prefetch_policy: timeout` a waiting request was named ready when this
  rank's clock passed its deadline, a poll earlier on one rank than on the other, so the
  ranks' schedulers ran different batches (now: when the ranks agree to stop its prefetch).
Four more tests make each of these happen on purpose, whatever the simulator draws (each
fails with its fix reverted too), and two run drawn episodes on 2 and on 3 ranks."""

import asyncio
import dataclasses
import io
import random
import time

import numpy as np
import pytest
import torch

from kvtier.testing import tp_sim
from kvtier.testing.fault_sim import Setup, settle
from kvtier.testing.parts import SimStore, SimStreams
from kvtier.testing.tp_sim import on_ranks
from tests.controller.helpers import fill, make_cache


def test_a_write_that_lands_on_one_rank_only_fails_on_every_rank():
    """The server's sequence on two ranks; rank 0's device->host write lands, rank 1's fails.
    Before: rank 0 gave the prefix a host copy and rank 1 did not, so once the device copy
    went, rank 0 would load the prefix and rank 1 recompute it: different slots, and the
    next collective mixed up. Now neither keeps it, and both go on alike."""
    rendezvous = tp_sim.Rendezvous(2, timeout_s=30)
    streams = [SimStreams(random.Random(r)) for r in range(2)]
    caches = [
        make_cache(
            store="none",
            pool_size=32,
            stream_factory=streams[r].factory,
            agreement=tp_sim.ThreadAgreement(rendezvous, r),
        )
        for r in range(2)
    ]
    tokens = np.arange(12)

    def serve(r):
        cache = caches[r]
        got = cache.acquire(tokens, "a")
        new = cache.alloc(len(tokens))
        cache.begin_forward(["a"])  # no loads: nothing to wait for
        fill(cache, new, seed=1)
        cache.cache_finished("a", tokens, torch.cat([got.indices, new]))
        cache.poll()  # submits the write

    on_ranks(serve, 2)
    for r, outcome in enumerate(["ok", "fail_before"]):
        [job] = streams[r].pending
        streams[r].resolve(job, outcome, streams[r].rng)
    on_ranks(lambda r: caches[r].poll(), 2)
    states = [tp_sim.replicated_cache(c) for c in caches]
    assert states[0] == states[1]
    assert [c.tree.total_size(1) for c in caches] == [
        0,
        0,
    ]  # no host copy on either rank
    assert [c.stats()["counters"]["write_failures"] for c in caches] == [1, 1]
    evicted = on_ranks(lambda r: caches[r].evict(len(tokens)), 2)
    assert evicted[0] == evicted[1] == len(tokens)
    for c in caches:
        c.tree.sanity_check()
        c.check_accounting()
    on_ranks(lambda r: caches[r].close(), 2)


@pytest.mark.parametrize(
    "ep_seed,steps",
    [(253228484, 46), (1063938749, 329), (1014138928, 400), (288545018, 72)],
)
def test_tp_episodes_that_diverged_now_agree(ep_seed, steps):
    setup = dataclasses.replace(
        Setup.draw(random.Random(ep_seed), allow_kernel=False), store_pages=1
    )  # as drawn then
    failure = tp_sim.run_episode(ep_seed, setup, steps, ranks=2)
    assert failure is None, (
        f"{failure.who}, step {failure.step}: {failure.exc}\n"
        + "\n".join(failure.log[-20:])
    )


@pytest.mark.parametrize("seed,ranks", [(1, 2), (2, 3)])
def test_tp_fault_sim_finds_no_divergence(seed, ranks):
    out = io.StringIO()
    assert tp_sim.run(1200, seed, ranks=ranks, out=out) == 0, out.getvalue()
    assert (
        out.getvalue().splitlines()[-1]
        == f"fault sim: 1200 steps on {ranks} ranks, 0 violations"
    )


def _two_ranks_waiting(prefetch_policy: str, clocks: list[float]):
    """Two ranks, each with a SimStore, and one request ("a") waiting for its prefetch,
    whose `batch_exists` is pending on both ranks."""
    rendezvous = tp_sim.Rendezvous(2, timeout_s=30)
    stores = [SimStore(), SimStore()]
    caches = [
        make_cache(
            store_obj=stores[r],
            prefetch_policy=prefetch_policy,
            clock=lambda r=r: clocks[r],
            agreement=tp_sim.ThreadAgreement(rendezvous, r),
        )
        for r in range(2)
    ]
    tokens = np.arange(16)
    got = on_ranks(lambda r: caches[r].acquire(tokens, "a"), 2)
    assert [g.ready for g in got] == [False, False]
    for c, store in zip(caches, stores):
        settle(c)
        [call] = store.pending
        assert call.op == "exists"
    return caches, stores, tokens


def _close(caches, stores) -> None:
    async def answer_all(store):  # on the store's loop: no call slips in between
        store.auto = random.Random(0)
        store.resolve_all(store.auto)

    for c, store in zip(caches, stores):
        asyncio.run_coroutine_threadsafe(
            answer_all(store), c.controller.storage.loop
        ).result(30)
    on_ranks(lambda r: caches[r].abort("a"), 2)
    on_ranks(lambda r: caches[r].close(), 2)


def test_under_timeout_a_request_is_named_ready_on_every_rank_in_the_same_poll():
    """Rank 0's scheduler reaches a poll later than rank 1's, past the prefetch deadline.
    Before: rank 0 named the request ready and rank 1 did not (its clock had not passed
    the deadline), so rank 0 put it in its next batch and rank 1 did not. Now both name it
    in that poll (the ranks agree to stop its prefetch)."""
    clocks = [0.0, 0.0]
    caches, stores, tokens = _two_ranks_waiting("timeout", clocks)
    clocks[0] = 100.0
    ready = on_ranks(lambda r: caches[r].poll(), 2)
    assert ready == [["a"], ["a"]]
    got = on_ranks(lambda r: caches[r].acquire(tokens, "a"), 2)
    assert [g.ready for g in got] == [True, True] and got[0].indices.numel() == got[
        1
    ].indices.numel() == 0
    assert tp_sim.replicated_cache(caches[0]) == tp_sim.replicated_cache(caches[1])
    _close(caches, stores)


def test_a_prefetch_whose_store_fails_on_one_rank_ends_on_every_rank():
    """Rank 0's store says it holds the request's pages; rank 1's `batch_exists` fails.
    Before: rank 1's prefetch ended with "pages present" unknown, so the agreed count
    stayed unknown and rank 0's prefetch waited for a grant until its store timeout (here
    never). Now rank 1's holds 0 pages, both agree on 0, and the request is named ready
    on both ranks within a few polls, having loaded nothing."""
    caches, stores, tokens = _two_ranks_waiting("wait_complete", [0.0, 0.0])
    [call0], [call1] = stores[0].pending, stores[1].pending
    for k in call0.keys:
        stores[0]._pages[k] = (
            b"held"  # present (a read would not verify: never asked for)
        )
    stores[0].resolve(call0, "ok", random.Random(0))
    stores[1].resolve(call1, "error", random.Random(0))
    ready = [[], []]
    for _ in range(20):
        for c in caches:
            settle(c)
        ready = on_ranks(lambda r: caches[r].poll(), 2)
        if ready != [[], []]:
            break
    assert ready == [["a"], ["a"]]
    got = on_ranks(lambda r: caches[r].acquire(tokens, "a"), 2)
    assert [g.storage_hit for g in got] == [0, 0]
    assert tp_sim.replicated_cache(caches[0]) == tp_sim.replicated_cache(caches[1])
    _close(caches, stores)


def test_an_ended_prefetchs_host_pages_go_back_on_every_rank_in_the_same_poll():
    """Both ranks' stores hold the request's pages; rank 0's read answers, rank 1's runs
    out of time and is still running (it may still write the host pages it was given).
    Before: rank 0 freed its unused pages as soon as its own read settled, rank 1 only once
    the late read returned, so host room differed, and host room decides what a write or a
    grant gets and which host nodes are evicted. Now both keep them until the late read has
    returned, then both free them in the same poll."""
    caches, stores, tokens = _two_ranks_waiting("wait_complete", [0.0, 0.0])
    for store in stores:
        [call] = store.pending
        for k in call.keys:
            store._pages[k] = b"held"  # present; a read of it does not verify (a miss)
        store.resolve(call, "ok", random.Random(0))
    for c in caches:
        settle(c)
    on_ranks(lambda r: caches[r].poll(), 2)  # grants host pages: the reads start
    for c in caches:
        settle(c)
    [read0], [read1] = stores[0].pending, stores[1].pending
    assert read0.op == read1.op == "get_into"
    stores[0].resolve(read0, "ok", random.Random(0))
    assert stores[1].fire_deadline(read1)  # times out, still running
    ready = [[], []]
    for _ in range(20):
        for c in caches:
            settle(c)
        ready = on_ranks(lambda r: caches[r].poll(), 2)
        assert tp_sim.replicated_cache(caches[0]) == tp_sim.replicated_cache(caches[1])
        if ready != [[], []]:
            break
    assert ready == [["a"], ["a"]]
    held = [c.controller.host_available() for c in caches]
    stores[1].resolve(read1, "ok", random.Random(0))  # the late read returns
    settle(caches[1])
    on_ranks(lambda r: caches[r].poll(), 2)
    assert tp_sim.replicated_cache(caches[0]) == tp_sim.replicated_cache(caches[1])
    assert [c.controller.host_available() for c in caches] == [
        held[0] + 16,
        held[1] + 16,
    ]  # freed on both
    _close(caches, stores)


def test_a_read_abandoned_stuck_on_one_rank_holds_back_the_same_host_pages_on_every_rank():
    """Rank 0's store read hangs and its I/O thread is given up on (StoreAbandoned): the
    host pages it was reading into may still be written, so they are held back for good.
    Before: only on rank 0, so its host had fewer free pages than rank 1's, and the next
    request's device->host write got host room on rank 1 and none on rank 0: the ranks sent
    different vectors to the next poll's collective (with gloo, a hang). Now the ranks agree
    that a read was abandoned and hold back the same pages."""
    from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
    from kvtier.errors import StoreAbandoned
    from tests.controller.helpers import compute

    class Stuck(MemoryStore):
        stuck = False

        async def _get_into(self, keys, parsed, views):
            if self.stuck:
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    raise StoreAbandoned("1 I/O thread stuck") from None
            return await super()._get_into(keys, parsed, views)

    rendezvous = tp_sim.Rendezvous(2, timeout_s=60)
    stores = [Stuck(MemoryStoreConfig(), timeout_s=0.3) for _ in range(2)]
    caches = [
        make_cache(
            page_size=4,
            pool_size=64,
            ratio=1.0,
            store_obj=stores[r],
            agreement=tp_sim.ThreadAgreement(rendezvous, r),
        )
        for r in range(2)
    ]
    first, second = (
        np.arange(100, 132),
        np.arange(500, 548),
    )  # 32 and 48 tokens; the host holds 64

    def store_first(r):
        compute(caches[r], first, seed=1, rid="a")
        settle(caches[r])
        caches[r].flush()  # in the store only

    on_ranks(store_first, 2)
    stores[0].stuck = True

    def read_it_back(r):
        got = caches[r].acquire(first, "x")  # rank 0's read hangs, then is abandoned
        while (
            not got.ready
        ):  # the server's loop: poll (a collective) until it is named ready
            got = caches[r].acquire(first, "x") if "x" in caches[r].poll() else got
        caches[r].abort("x", got.indices)
        for _ in range(
            500
        ):  # until its store call has settled on both ranks (polls are collectives)
            settle(caches[r])
            if not on_ranks_done(r):
                break
            time.sleep(0.01)
        return caches[r].controller.quarantined_pages(), caches[
            r
        ].controller.host_available()

    def on_ranks_done(r):  # one collective: is a prefetch op still held on some rank?
        _, (held,) = caches[r].agreement.agree(
            [], [int(bool(caches[r].controller.prefetch_ops()))]
        )
        return held

    held = on_ranks(read_it_back, 2)
    assert held[0] == held[1] and held[0][0] > 0
    stores[0].stuck = False

    def next_request(r):
        compute(caches[r], second, seed=2, rid="b")
        caches[r].poll()
        return tp_sim.replicated_cache(caches[r]), caches[r].stats()["counters"][
            "writes_skipped_no_host_space"
        ]

    after = on_ranks(next_request, 2)
    assert after[0] == after[1]
    for c in caches:
        settle(c)
        c.tree.sanity_check()
        c.check_accounting()
    on_ranks(lambda r: caches[r].close(), 2)
