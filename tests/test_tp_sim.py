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
  ranks' schedulers ran different batches (now: when the ranks agree to stop its prefetch)."""

import io
import random
import threading

import numpy as np
import pytest
import torch

from kvtier.testing import tp_sim
from kvtier.testing.fault_sim import Setup
from kvtier.testing.parts import SimStreams
from tests.controller.helpers import fill, make_cache


def on_ranks(fn, ranks: int) -> list:
    """fn(rank) on one thread per rank, as every rank's scheduler runs it; the results."""
    out, errors = [None] * ranks, []

    def run(r):
        try:
            out[r] = fn(r)
        except Exception as exc:  # noqa: BLE001 - re-raised below, on the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_a_write_that_lands_on_one_rank_only_fails_on_every_rank():
    """The server's sequence on two ranks; rank 0's device->host write lands, rank 1's fails.
    Before: rank 0 gave the prefix a host copy and rank 1 did not, so once the device copy
    went, rank 0 would load the prefix and rank 1 recompute it: different slots, and the
    next collective mixed up. Now neither keeps it, and both go on alike."""
    rendezvous = tp_sim.Rendezvous(2, timeout_s=30)
    streams = [SimStreams(random.Random(r)) for r in range(2)]
    caches = [make_cache(store="none", pool_size=32, stream_factory=streams[r].factory,
                         agreement=tp_sim.ThreadAgreement(rendezvous, r)) for r in range(2)]
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
    assert [c.tree.total_size(1) for c in caches] == [0, 0]  # no host copy on either rank
    assert [c.stats()["counters"]["write_failures"] for c in caches] == [1, 1]
    evicted = on_ranks(lambda r: caches[r].evict(len(tokens)), 2)
    assert evicted[0] == evicted[1] == len(tokens)
    for c in caches:
        c.tree.sanity_check()
        c.check_accounting()
    on_ranks(lambda r: caches[r].close(), 2)


@pytest.mark.parametrize("ep_seed,steps", [(253228484, 46), (1063938749, 329), (1014138928, 400), (288545018, 72)])
def test_tp_episodes_that_diverged_now_agree(ep_seed, steps):
    setup = Setup.draw(random.Random(ep_seed), allow_kernel=False)
    failure = tp_sim.run_episode(ep_seed, setup, steps, ranks=2)
    assert failure is None, f"rank {failure[0]}, step {failure[1]}: {failure[2]}\n" + "\n".join(failure[3][-20:])


@pytest.mark.parametrize("seed,ranks", [(1, 2), (2, 3)])
def test_tp_fault_sim_finds_no_divergence(seed, ranks):
    out = io.StringIO()
    assert tp_sim.run(1200, seed, ranks=ranks, out=out) == 0, out.getvalue()
    assert out.getvalue().splitlines()[-1] == f"fault sim: 1200 steps on {ranks} ranks, 0 violations"
