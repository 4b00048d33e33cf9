"""Regression tests named after the review's eight fail-closed findings (the fault
simulator, tests/test_fault_sim.py, finds them too). Each fails with its fix reverted.
#3, #4, #6 (serve) and #8 (replay) live in tests/engine/test_cli.py."""

import numpy as np
import pytest
import torch

from kvtier.errors import TransferError
from kvtier.engine.engine import Engine
from kvtier.engine.model import ModelConfig, TinyTransformer
from kvtier.engine.workloads import Turn
from kvtier.testing.parts import SimStore, SimStreams
from kvtier.tiers.indices import runs
from kvtier.tiers.mirror import HostMirror, MirrorConfig
from kvtier.tiers.pool import DeviceKVPool, PoolConfig
from tests.controller.helpers import (
    acquire,
    compute,
    fill,
    forward,
    make_cache,
    read,
    same_kv,
    settle,
)

A = np.arange(500, 516)  # 16 tokens = 4 pages of 4


def check(cache):
    cache.tree.sanity_check()
    cache.check_accounting()


class _BrokenLoads(HostMirror):
    """A mirror whose host->device copies fail (a DMA error)."""

    def load_layer(self, pool, host_indices, device_indices, layer, plan=None):
        raise RuntimeError("DMA failed")


def test_1_failed_load_inside_acquire_is_never_served():
    cache = make_cache()
    kv = compute(cache, A, seed=1)
    settle(cache)
    cache.evict(16)
    cache.mirror.__class__ = _BrokenLoads
    got = acquire(
        cache, A, "r1"
    )  # locks the device prefix and starts the load, as a server does
    assert (got.host_hit, got.indices.numel()) == (16, 16)
    waiter = cache.begin_forward(["r1"])
    for layer in range(cache.pool.num_layers):
        waiter.wait_layer(
            layer
        )  # the forward runs to its end: the one channel is failed()
    assert waiter.failed() == ["r1"] and "DMA failed" in waiter.bad["r1"]
    with pytest.raises(
        TransferError, match="nothing was cached"
    ):  # fail closed, even if the server goes on
        cache.cache_finished("r1", A, got.indices)
    settle(cache)
    check(cache)
    m = cache.match_prefix(A, count=False)
    assert (
        m.device_indices.numel() == 0 and m.host_hit_length == 16
    )  # never published on device
    cache.mirror.__class__ = HostMirror
    got = acquire(cache, A, "r2")
    forward(cache, "r2")
    assert same_kv(read(cache, got.indices), kv)  # the host copy was right all along
    cache.cache_finished("r2", A, got.indices)
    settle(cache)
    check(cache)
    assert cache.stats()["counters"]["load_failures"] == 1
    cache.close()


def test_2_a_store_read_that_times_out_keeps_its_host_pages_until_it_stops():
    """The read goes on after its timeout (a file-store thread): its pages stay reserved."""
    import random

    store = SimStore()
    cache = make_cache(store_obj=store)
    rng = random.Random(0)
    assert not cache.acquire(A, "w").ready  # the store may hold A: it answers "no"
    store.resolve(wait_calls(cache, store)[0], "ok", rng)
    wait_until(cache, lambda: "w" in cache.poll())
    got = cache.acquire(A, "w")
    mine = cache.alloc(16)
    fill(cache, mine, seed=2)
    cache.cache_finished("w", A, mine)
    settle_sim(cache, store, rng)  # written through to host and to the store
    cache.flush()
    free = cache.controller.host_available()
    assert not cache.acquire(A, "r").ready
    [exists] = wait_calls(cache, store)
    store.resolve(exists, "ok", rng)
    op = cache.prefetcher.prefetches["r"].op
    wait_until(cache, lambda: op.present == 4)
    cache.poll()  # grants 4 host pages
    [read_call] = wait_calls(cache, store)
    assert store.fire_deadline(read_call)
    wait_until(cache, lambda: "r" in cache.poll() or cache.prefetcher.is_ready("r"))
    got = cache.acquire(A, "r")
    assert got.ready and got.storage_hit == 0  # the request goes on without the store
    assert (
        cache.controller.host_available() == free - 16
    )  # but the pages stay the read's
    check(cache)
    store.resolve(read_call, "ok", rng)  # the late read writes into them now
    wait_until(
        cache,
        lambda: cache.poll() is not None and cache.controller.host_available() == free,
    )
    check(cache)
    cache.abort("r")
    cache.close()


def settle_sim(cache, store, rng):
    """Answer every store call `ok` until the cache is idle."""
    import time

    for _ in range(200):
        cache.poll()
        time.sleep(0.005)
        for call in list(store.pending):
            store.resolve(call, "ok", rng)
        if not cache.controller.busy():
            return
    raise AssertionError("the cache did not become idle")


def wait_calls(cache, store, at_least=1):
    import time

    for _ in range(500):
        if len(store.pending) >= at_least:
            return list(store.pending)
        time.sleep(0.002)
    raise AssertionError("no store call came")


def wait_until(cache, cond):
    import time

    for _ in range(1000):
        if cond():
            return
        time.sleep(0.002)
    raise AssertionError("condition never held")


def test_3_page_size_1_page_first_moves_runs_bitwise():
    assert runs(torch.tensor([5, 6, 7]), torch.tensor([3, 4, 5]), 1) == [
        (5, 3, 1),
        (6, 4, 1),
        (7, 5, 1),
    ]
    pool = DeviceKVPool(
        PoolConfig(
            size=32,
            num_layers=2,
            page_size=1,
            num_kv_heads=2,
            head_dim=4,
            dtype="float32",
        )
    )
    for layer in pool.buffers:
        for b in layer:
            b.copy_(torch.randn(b.shape))
    mirror = HostMirror(pool, MirrorConfig(ratio=1.0, layout="page_first"))
    dev, host, back = (
        torch.tensor([5, 6, 7, 8]),
        torch.tensor([3, 4, 5, 6]),
        torch.tensor([20, 21, 22, 23]),
    )
    mirror.backup(pool, dev, host)
    mirror.load(pool, host, back)
    for layer in range(2):
        for b in pool.buffers[layer]:
            assert torch.equal(b[back], b[dev])


def test_5_a_childs_write_behind_a_failed_parent_write_fails_with_it():
    import random

    streams = SimStreams(random.Random(0))
    cache = make_cache(store="none", stream_factory=streams.factory)
    compute(cache, A[:8], seed=3)
    cache.poll()  # the parent's write is submitted
    compute(cache, A, seed=4)  # a child under it: its write queues behind the parent's
    cache.poll()
    parent_job, child_job = streams.pending
    streams.resolve(parent_job, "fail_before", random.Random(0))
    streams.resolve(child_job, "ok", random.Random(0))
    settle(cache)  # applies both: must not raise, must not leak the child's host slots
    check(cache)
    m = cache.match_prefix(A, count=False)
    assert not m.last_device_node.backed_up and not m.last_device_node.parent.backed_up
    assert cache.controller.host_available() == cache.mirror.size
    assert cache.stats()["counters"]["write_failures"] == 2


def test_6_engine_releases_a_request_too_large_for_the_pool():
    from kvtier.cache import TieredCache
    from kvtier.config import load_config

    cfg = load_config(
        None,
        {
            "pool": {
                "size": 256,
                "num_layers": 4,
                "page_size": 16,
                "num_kv_heads": 2,
                "head_dim": 32,
                "dtype": "float32",
            },
            "store": {"backend": "none"},
        },
        env={},
    )
    cache = TieredCache(cfg)
    engine = Engine(cache, TinyTransformer(ModelConfig()))
    big, small = Turn("a", 0, tuple(range(300)), 4), Turn("b", 0, tuple(range(40)), 4)
    out = engine.run([big, small])
    assert (
        out[0].error
        and out[0].rejected
        and not out[1].error
        and len(out[1].output) == 4
    )
    settle(cache)  # writes in flight hold locks until applied
    check(cache)
    assert cache.tree.protected_size() == 0 and len(cache.requests) == 0
    cache.close()


def test_7_write_back_allocation_that_splits_the_loaded_path_is_harmless():
    """Review #7, confirmed: allocating for a load may apply completions (write-back drains
    through poll) that split a node of the path being loaded. The load must copy the path as
    it is after allocating, and publish nothing until its request inserts."""
    cache = make_cache(write_policy="write_back", pool_size=32)
    kv = compute(cache, A, seed=5)
    cache.evict(16)  # backs up, then demotes: host-only
    settle(cache)
    real_alloc = cache.slots.alloc_device

    def alloc_then_split(n):
        out = real_alloc(n)
        cache.tree.match_prefix(
            cache.key(np.concatenate([A[:8], [9999] * 4])), touch=False
        )  # splits at 8
        return out

    cache.slots.alloc_device = alloc_then_split
    got = acquire(cache, A, "r")
    cache.slots.alloc_device = real_alloc
    forward(cache, "r")
    assert got.host_hit == 16 and same_kv(read(cache, got.indices), kv)
    cache.cache_finished("r", A, got.indices)
    settle(cache)
    check(cache)


def test_8_one_request_counts_one_hit_however_often_it_is_matched():
    cache = make_cache(store="none")
    compute(cache, A, seed=6)
    node = cache.match_prefix(A, count=False).last_device_node
    got = acquire(cache, A, "r")
    forward(cache, "r")
    cache.cache_finished("r", A, got.indices)
    assert node.hit_count == 1
    assert cache.stats()["counters"]["lookup_tokens"] == 32
    check(cache)


def test_poll_goes_on_when_applying_one_completion_raises(monkeypatch):
    cache = make_cache(store="none")
    compute(cache, A[:8], seed=7)
    compute(cache, np.arange(900, 908), seed=8)
    calls = []
    real = cache.tree.mark_backed_up

    def flaky(node, host):
        calls.append(node)
        if len(calls) == 1:
            raise RuntimeError("a bug while applying")
        return real(node, host)

    monkeypatch.setattr(cache.tree, "mark_backed_up", flaky)
    settle(cache)
    assert len(calls) == 2 and cache.stats()["counters"]["apply_errors"] == 1
    check(cache)
    assert cache.match_prefix(
        np.arange(900, 908), count=False
    ).last_device_node.backed_up
