"""Bitwise lifecycles through every tier, and each write and prefetch policy."""

import re

import numpy as np
import pytest
import torch

from tests.controller.helpers import (
    CorruptingStore,
    FailingStore,
    StallingStore,
    acquire,
    compute,
    fill,
    forward,
    make_cache,
    read,
    read_back,
    same_kv,
    settle,
)
from kvtier.tree import Tier

A = np.arange(100, 116)  # 16 tokens = 4 pages of 4


def check(cache):
    cache.tree.sanity_check()
    cache.check_accounting()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_write_through_demote_load_back_is_bitwise(layout):
    cache = make_cache(layout=layout)
    kv = compute(cache, A, seed=1)
    settle(cache)
    node = cache.match_prefix(A).last_device_node
    assert node.backed_up and cache.stats()["counters"]["writes"] == 1
    assert cache.evict(16) == 16
    m = cache.match_prefix(A, count=False)
    assert (
        m.device_indices.numel() == 0
        and m.host_hit_length == 16
        and m.last_host_node is node
    )
    got, got_kv = read_back(cache, A, "r")
    assert (got.device_hit, got.host_hit) == (0, 16) and same_kv(got_kv, kv)
    assert same_kv(
        read(cache, cache.match_prefix(A, count=False).device_indices), kv
    )  # published on finish
    settle(cache)
    check(cache)
    cache.close()
    check(cache)


@pytest.mark.parametrize("store", ["memory", "file"])
def test_host_eviction_then_prefetch_from_store_is_bitwise(store, tmp_path):
    cache = make_cache(tmp_path, store=store)
    kv = compute(cache, A, seed=2)
    settle(cache)
    assert cache.stats()["counters"]["l3_write_pages"] == 4
    cache.flush()
    check(cache)
    assert not cache.acquire(A, "r1").ready  # the store may hold it: the request waits
    got, got_kv = read_back(cache, A, "r1")
    assert (got.device_hit, got.host_hit, got.storage_hit) == (0, 0, 16) and same_kv(
        got_kv, kv
    )
    c = cache.stats()["counters"]
    assert c["storage_hit_tokens"] == 16 and c["l3_read_pages"] == 4
    settle(cache)
    check(cache)
    cache.close()
    check(cache)


def test_prefetch_continues_beyond_a_host_prefix():
    cache = make_cache()
    B = np.arange(200, 232)
    kv = compute(cache, B, seed=3)
    settle(cache)
    cache.flush()
    half = B[:16]
    got, _ = read_back(cache, half, "a")
    assert got.storage_hit == 16
    cache.evict(16)
    assert cache.match_prefix(B, count=False).host_hit_length == 16
    got, got_kv = read_back(
        cache, B, "b"
    )  # the prefetch continues below the host node: pages 5..8
    assert (got.host_hit, got.storage_hit) == (16, 16) and same_kv(got_kv, kv)
    settle(cache)
    check(cache)


def test_write_through_selective_waits_for_hits():
    cache = make_cache(write_policy="write_through_selective", write_threshold=2)
    compute(cache, A, seed=4)
    settle(cache)
    node = cache.match_prefix(A, count=False).last_device_node
    read_back(cache, A, "hit-1")
    settle(cache)
    assert (
        not node.backed_up and node.hit_count == 1
    )  # one request, one hit (it matches twice)
    read_back(cache, A, "hit-2")  # hit 2: now worth a host copy
    settle(cache)
    assert node.backed_up
    check(cache)


def test_write_back_backs_up_only_on_eviction():
    cache = make_cache(write_policy="write_back", pool_size=32)
    kv = compute(cache, A, seed=5)
    settle(cache)
    node = cache.match_prefix(A, count=False).last_device_node
    assert not node.backed_up
    assert cache.evict(16) == 16  # backs the path up, then demotes it
    assert node.backed_up and not node.on_device
    got, got_kv = read_back(cache, A, "r")
    assert got.host_hit == 16 and same_kv(got_kv, kv)
    settle(cache)
    check(cache)


def test_timeout_policy_stops_with_a_prefix_and_returns_host_slots():
    store = StallingStore(fast_reads=1, stall_s=1.0)
    cache = make_cache(
        prefetch_policy="timeout",
        prefetch_timeout_base_s=0.3,
        prefetch_timeout_per_1k_tokens_s=0.0,
        max_inflight_prefetch_bytes=2 * 2 * 2 * 8 * 4 * 4,
        store_obj=store,
    )
    assert (
        cache.controller.storage.chunk == 2
    )  # 2 pages per read: the second read stalls
    B = np.arange(300, 332)
    compute(cache, B, seed=6)
    settle(cache)
    cache.flush()
    free_before = cache.controller.host_available()
    got = acquire(cache, B, "t")
    assert got.storage_hit == 8  # the first chunk landed before the deadline
    assert (
        cache.stats()["counters"]["prefetch_timed_out"] == 0
    )  # not finished yet: counted at the end
    forward(cache)
    cache.abort("t")
    settle(cache)
    assert cache.stats()["counters"]["prefetch_timed_out"] == 1
    on_host = cache.match_prefix(B, count=False).host_hit_length
    assert on_host in (
        8,
        16,
    )  # the chunk in flight at the stop may still land; no chunk after it
    assert (
        cache.controller.host_available() == free_before - on_host
    )  # the unused pages came back
    check(cache)
    cache.close()


def test_best_effort_takes_what_landed_and_the_rest_arrives_later():
    store = StallingStore(fast_reads=0, stall_s=0.3)
    cache = make_cache(prefetch_policy="best_effort", store_obj=store)
    compute(cache, A, seed=7)
    settle(cache)
    cache.flush()
    assert not cache.acquire(A, "b").ready
    assert cache.poll() == ["b"]  # best effort: ready at the next poll with what landed
    got = cache.acquire(A, "b")
    assert (
        got.ready and got.indices.numel() == 0
    )  # nothing landed yet: the request recomputes
    cache.abort("b")
    settle(cache)
    check(cache)
    cache.close()


@pytest.mark.parametrize("store_cls", ["failing", "corrupting"])
def test_faulty_store_pages_are_misses_and_slots_return(store_cls):
    store = (
        FailingStore() if store_cls == "failing" else CorruptingStore(bad_key_index=2)
    )
    cache = make_cache(store_obj=store)
    kv = compute(cache, A, seed=8)
    settle(cache)
    cache.flush()
    got, got_kv = read_back(cache, A, "f")
    expected = 0 if store_cls == "failing" else 8  # pages before the damaged one
    assert got.storage_hit == expected
    settle(cache)
    if expected:
        assert same_kv(got_kv, [(k[:8], v[:8]) for k, v in kv])
    cache.flush()
    assert cache.controller.host_available() == cache.mirror.size
    stats = cache.stats()
    if store_cls == "failing":
        assert (
            stats["counters"]["prefetch_errors"] == 1 and stats["store"]["errors"] == 1
        )
    else:
        assert stats["store"]["frame_failures"] == 1
    settle(cache)
    check(cache)
    cache.close()


def test_stalled_store_never_blocks_longer_than_its_timeout():
    import time

    store = StallingStore(fast_reads=0, stall_s=30.0)
    store.timeout_s = 0.5
    cache = make_cache(store_obj=store)
    compute(cache, A, seed=9)
    settle(cache)
    cache.flush()
    start = time.monotonic()
    got = acquire(cache, A, "s")
    assert got.storage_hit == 0  # wait_complete, but the store call times out
    assert time.monotonic() - start < 3.0
    cache.abort("s")
    assert cache.stats()["store"]["timeouts"] == 1
    check(cache)
    cache.close()


def test_chunked_prefill_returns_canonical_indices():
    cache = make_cache()
    compute(cache, A[:8], seed=10)
    settle(cache)
    got = acquire(cache, A, "c")
    assert got.indices.numel() == 8
    mine = cache.alloc(len(A) - 8)
    kv_rows = torch.cat([got.indices, mine])
    canon = cache.cache_unfinished("c", A[:14], kv_rows[:14])
    assert torch.equal(canon, kv_rows[:12])
    cache.cache_finished("c", A, kv_rows)
    settle(cache)
    check(cache)


def test_duplicate_compute_frees_the_copy():
    cache = make_cache()
    compute(cache, A, seed=11)
    got = acquire(cache, np.arange(999, 1003), "dup")  # unrelated: nothing cached
    assert got.indices.numel() == 0
    mine = cache.alloc(16)
    free_before = cache.slots.device_free()
    cache.cache_finished("dup", A, mine)  # computed A again without the cache
    assert cache.slots.device_free() == free_before + 16
    settle(cache)
    check(cache)


def test_stats_and_prometheus_metrics():
    from prometheus_client import generate_latest

    cache = make_cache()
    compute(cache, A, seed=12)
    settle(cache)
    read_back(cache, A, "again")
    s = cache.stats()
    assert (
        s["counters"]["device_hit_tokens"] == 16
        and s["counters"]["lookup_tokens"] == 32
    )
    assert (
        s["counters"]["miss_tokens"] == 16
        and s["tiers"]["host"]["evictable_tokens"] == 16
    )
    text = generate_latest(cache.metrics_registry()).decode()
    assert "kvtier_device_hit_tokens_total 16.0" in text
    assert 'kvtier_write_latency_seconds_bucket{le="+Inf"} 1.0' in text
    assert "kvtier_store_l3" not in text and "kvtier_host_evictable_tokens 16.0" in text
    check(cache)
    cache.close()


def test_held_and_waiting_requests_show_in_stats_with_their_age():
    """An operator sees a stuck request before users do: requests held and waiting for a
    prefetch are counted, with the age of the oldest (a Prometheus gauge each)."""
    import time

    from prometheus_client import generate_latest

    cache = make_cache(pool_size=128)
    compute(cache, A, seed=1)
    settle(cache)
    cache.flush()
    assert not cache.acquire(A, "w").ready  # waits for its prefetch
    held = cache.acquire(A[:0], "h")  # holds an empty prefix
    time.sleep(0.02)
    q = cache.stats()["queues"]
    assert q["requests_waiting"] == 1 and q["oldest_waiting_s"] >= 0.02
    assert q["requests_held"] == 1 and q["oldest_held_s"] >= 0.02
    text = generate_latest(cache.metrics_registry()).decode()
    assert (
        "kvtier_queue_requests_waiting 1.0" in text
        and "kvtier_queue_requests_held 1.0" in text
    )
    cache.cache_finished("h", A[:0], held.indices)
    cache.abort("w")
    q = cache.stats()["queues"]
    assert (
        q["requests_waiting"],
        q["oldest_waiting_s"],
        q["requests_held"],
        q["oldest_held_s"],
    ) == (0, 0.0, 0, 0.0)
    check(cache)
    cache.close()


def test_start_log_line_names_every_component(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="kvtier.cache"):
        cache = make_cache()
    line = caplog.text
    for part in (
        "tree page_size=4 eviction=lru",
        "pool mha 2 layers 64 slots",
        "mirror page_first 128 slots",
        "write=write_through prefetch=wait_complete threads on CPUs any",
        "store memory",
        "namespace ",
    ):
        assert part in line
    check(cache)
    cache.close()


def test_child_under_a_half_split_during_its_write_is_written_after_it():
    cache = make_cache()
    compute(cache, A, seed=13)  # one 16-token node; its write is queued, not applied
    other = np.concatenate([A[:4], np.arange(900, 908)])
    compute(
        cache, other, seed=14
    )  # splits the node after 4 tokens; the new child hangs under the upper half
    child = cache.match_prefix(other, count=False).last_device_node
    assert not child.backed_up and not child.parent.backed_up
    settle(cache)
    assert child.parent.backed_up and child.backed_up  # written once its parent landed
    check(cache)


def test_a_chain_under_a_half_split_during_its_write_is_kept_through_eviction():
    """Turns inserted one under another below a half split off during its write (the
    half gets its host copy from that write). Each turn's write is queued at once, behind
    the write it depends on: it is locked until it lands, so eviction cannot drop it, and
    the whole chain reaches host. Refused instead (waiting for the parent), an unwritten
    turn was an unlocked device leaf that eviction removed from every tier: the hit rate
    of `benchmarks/cache.py` fell to 0.875-0.976x bound in some runs."""
    cache = make_cache(pool_size=128)
    compute(cache, A, seed=13)  # one 16-token node; its write is queued, not applied
    tokens, computed = A[:4], []
    for turn in range(
        3
    ):  # each turn extends the last: child, grandchild, great-grandchild
        tokens = np.concatenate([tokens, np.arange(900 + 8 * turn, 908 + 8 * turn)])
        computed.append(compute(cache, tokens, seed=14 + turn))
    chain, n = [], cache.match_prefix(tokens, count=False).last_device_node
    while n is not cache.tree.root:
        chain.append(n)
        n = n.parent
    assert len(chain) == 4 and not any(
        n.backed_up for n in chain
    )  # three turns + the split half
    assert all(n.id in cache.writes.writing for n in chain[:3])  # on their way, locked
    cache.evict(10_000)  # device pressure before any write has landed
    settle(cache)
    assert all(n.backed_up for n in chain), [str(n) for n in chain if not n.backed_up]
    cache.evict(10_000)
    got, kv = read_back(cache, tokens, "again")
    assert (
        got.indices.numel() == len(tokens) and got.device_hit == 0
    )  # all of it, from host
    turns = [
        (
            torch.cat([c[layer][0] for c in computed]),
            torch.cat([c[layer][1] for c in computed]),
        )
        for layer in range(cache.pool.num_layers)
    ]
    assert same_kv(
        [(k[4:], v[4:]) for k, v in kv], turns
    )  # bitwise what the turns computed
    check(cache)


def _named_ready(cache, rid: str, polls: int = 2000) -> bool:
    for _ in range(polls):
        if rid in cache.poll():
            return True
        cache.wait_progress(0.01)
    return False


def test_a_request_id_used_again_after_an_abort_is_named_ready():
    """A request aborted while its prefetch ran, then acquired again under the same id (a
    server retrying it): the old prefetch, stopped and forgotten, still held the id, so the
    new acquire said "not ready" and no poll ever named it: the request waited forever. It
    is named once the old prefetch has ended, and then acquired like any other."""
    cache = make_cache(pool_size=128)
    kvs = compute(cache, A, seed=1)
    settle(cache)
    cache.flush()  # device and host dropped: the store keeps A
    assert not cache.acquire(
        A, "r"
    ).ready  # a prefetch starts; without a poll it cannot end
    cache.abort("r")
    assert not cache.acquire(A, "r").ready
    assert _named_ready(cache, "r")
    got = acquire(cache, A, "r")
    forward(cache, "r")
    assert got.indices.numel() == 16 and same_kv(read(cache, got.indices), kvs)
    cache.cache_finished("r", A, got.indices)
    check(cache)
    cache.close()


def test_a_flush_refused_or_done_never_strands_a_waiting_request():
    """flush() drained first, stopping and forgetting every prefetch, even those of
    requests still waiting for them, which no poll then named: they waited forever. And
    a flush refused for a locked prefix had done that already. Refused, it now changes
    nothing (the waiting request gets every page); done, it names the waiting request."""
    cache = make_cache(pool_size=128)
    B = A + 1000
    kvs = compute(cache, B, seed=2)
    settle(cache)
    cache.flush()  # the store keeps B
    compute(cache, A, seed=1)
    held = acquire(cache, A, "holder")
    assert held.device_hit == 16  # it holds A's prefix on device
    assert not cache.acquire(B, "b").ready
    with pytest.raises(
        ValueError, match="flush: 16 device tokens are locked by requests"
    ):
        cache.flush()
    assert _named_ready(cache, "b")
    got = acquire(cache, B, "b")
    assert got.storage_hit == 16
    forward(cache, "b")
    assert same_kv(read(cache, got.indices), kvs)
    cache.cache_finished("b", B, got.indices)
    cache.cache_finished("holder", A, held.indices)
    cache.flush()
    assert not cache.acquire(B, "b2").ready
    cache.flush()  # b2 waits for its prefetch: it is stopped, and b2 named ready
    assert _named_ready(cache, "b2")
    got = acquire(cache, B, "b2")
    mine = cache.alloc(16 - got.indices.numel())
    forward(cache, "b2")
    cache.abort("b2", torch.cat([got.indices, mine]))
    check(cache)
    cache.close()


def test_a_prefetch_is_not_taken_by_an_acquire_with_other_tokens():
    """The pages a prefetch hashed belong to the tokens it was started for. An acquire named
    ready that comes back with other tokens (the same id, its prompt changed) was handed
    those hashes: its pages went to the store under another prompt's keys, and were served
    for that prompt later. The hashes are dropped and its own are made."""
    from kvtier.hashing import page_hashes

    cache = make_cache(pool_size=128)
    compute(cache, A, seed=1)
    settle(cache)
    cache.flush()
    assert not cache.acquire(A, "r").ready
    assert _named_ready(cache, "r")
    other = np.concatenate([A[:8], np.arange(900, 908)])
    got = cache.acquire(other, "r")
    assert (
        got.ready and got.indices.numel() == 8
    )  # A's first 2 pages, which the prefetch brought
    mine = cache.alloc(8)
    forward(cache, "r")
    fill(cache, mine, seed=2)
    cache.cache_finished("r", other, torch.cat([got.indices, mine]))
    settle(cache)
    node = cache.match_prefix(other).last_device_node
    assert (
        cache.tree.page_hashes(node)[-1]
        == page_hashes(other, 4, cache.namespace.id)[-1]
    )
    check(cache)
    cache.close()


@pytest.mark.parametrize("same_prompt", [True, False])
def test_prompt_pages_hashed_for_the_prefetch_are_not_hashed_again(same_prompt):
    """The prefetch hashed the prompt's pages to ask the store; the finished request's new
    node keeps those hashes, and its backup hashes the output's on the storage thread and
    hands the whole chain back (sanity_check recomputes each from the root). A finished key
    that does not start with the hashed prompt gets none and is hashed from the root."""
    cache = make_cache()
    prompt = np.arange(300, 316)
    got = acquire(
        cache, prompt, "r"
    )  # the store holds nothing: a prefetch asked, found 0
    new = cache.alloc(24)
    forward(cache, "r")
    finished = np.concatenate(
        [prompt if same_prompt else prompt + 1, np.arange(900, 908)]
    )
    cache.cache_finished("r", finished, torch.cat([got.indices, new]))
    node = cache.match_prefix(finished, count=False).last_device_node
    assert cache.stats()["counters"]["prefetches"] == 1
    assert node.parent is cache.tree.root and len(node) == 24
    assert node.hashes is None  # the output's pages: hashed when backed up
    if same_prompt:  # the prompt's 4 pages kept
        assert node.hash_prefix is not None and len(node.hash_prefix) == 4
    else:
        assert node.hash_prefix is None
    cache.tree.sanity_check()  # before any backup hashed the rest
    settle(cache)
    assert (
        node.hashes is not None and len(node.hashes) == 6 and node.hash_prefix is None
    )
    check(cache)
    cache.close()


@pytest.mark.parametrize("headroom", [0.0, 0.125])
def test_an_allocation_that_finds_a_tier_short_evicts_the_headroom_beyond_it(headroom):
    """Evictions come in batches: a short tier frees what the request needs and
    `evict_headroom` of the tier beyond it (0: exactly what it needs), and the KV that
    stays is still served bitwise."""
    cache = make_cache(pool_size=128, ratio=1.0, evict_headroom=headroom)
    extra = int(128 * headroom)  # 16 tokens = 4 pages, on device and on host alike
    prompts = [
        np.arange(1000 * i, 1000 * i + 16) for i in range(8)
    ]  # 8 nodes of 4 pages fill both tiers
    kvs = [compute(cache, p, seed=i) for i, p in enumerate(prompts)]
    settle(cache)
    assert cache.slots.device_free() == 0
    assert cache.controller.host_available() == 0

    compute(
        cache, np.arange(9000, 9016), seed=9
    )  # 4 new pages: both tiers short by 16 tokens
    settle(cache)
    assert cache.slots.device_free() == extra
    assert cache.controller.host_available() == extra
    assert (
        cache.stats()["counters"]["device_evicted_tokens"] == 16 + extra
    )  # whole nodes, oldest first
    assert cache.stats()["counters"]["host_evicted_tokens"] == 16 + extra

    got, kv = read_back(cache, prompts[7], "newest")
    assert got.device_hit == 16
    assert same_kv(kv, kvs[7])
    check(cache)
    cache.close()


def test_evict_headroom_out_of_range_is_refused_naming_the_field():
    with pytest.raises(
        ValueError,
        match=r"evict_headroom=0\.9: must be a fraction of the tier in \[0, 0\.5\]",
    ):
        make_cache(evict_headroom=0.9)


def test_a_request_s_own_slots_bad_sizes_and_indices_are_refused_naming_them():
    cache = make_cache()
    free = cache.slots.device_free()
    for bad in (-1, "8", 8.0):
        with pytest.raises(
            ValueError, match=f"alloc: n={bad!r}: must be an integer >= 0"
        ):
            cache.alloc(bad)
    with pytest.raises(
        ValueError, match="free: indices: expected a 1-D torch.int64 tensor, got list"
    ):
        cache.free([4, 5, 6, 7])
    mine = cache.alloc(np.int64(6))  # sizes computed from arrays are numpy integers
    assert (
        mine.numel() == 8 and cache.slots.device_free() == free - 8
    )  # the 6 and the rest of their page
    cache.free(mine)
    assert cache.slots.device_free() == free
    with pytest.raises(
        ValueError,
        match=r"free: pages \[\d+, \d+\] are not allocated \(double free\?\)",
    ):
        cache.free(
            mine
        )  # twice: the accounting (free + requests) would have balanced it
    check(cache)
    cache.close()


def test_a_closed_cache_refuses_requests_and_closes_once(tmp_path):
    """After close its threads are gone: a prefetch started then would never finish, and
    the request would wait forever. So requests are refused; a second close does nothing
    (it failed on the closed event loop)."""
    cache = make_cache(tmp_path, store="file")
    compute(cache, A, seed=1)
    cache.close()
    cache.close()
    for call in (
        lambda: cache.acquire(A, "late"),
        cache.poll,
        lambda: cache.alloc(4),
        lambda: cache.evict(4),
    ):
        with pytest.raises(RuntimeError, match="this TieredCache is closed"):
            call()
    assert len(cache.requests) == 0


def test_begin_forward_refuses_one_string_for_its_request_ids():
    """`begin_forward("r1")` would look up "r" and "1", find no load and let the forward
    read r1's prefix before it landed."""
    cache = make_cache()
    with pytest.raises(
        ValueError,
        match="begin_forward: request_ids='r1': expected a list of request ids",
    ):
        cache.begin_forward("r1")
    assert cache.begin_forward(["r1"]).loads == {}  # not held: nothing to wait for
    check(cache)
    cache.close()


def test_wait_layer_refuses_a_layer_outside_the_pool():
    """wait_layer(-1) returned at once, nothing waited for, and the forward read the last
    layer's KV before its load landed; wait_layer(2) of a 2-layer pool waited out the whole
    timeout and then blamed the load. Both are named; a numpy integer is a layer."""
    cache = make_cache(pool_size=128)
    compute(cache, A, seed=1)
    settle(cache)
    cache.evict(128)
    got = cache.acquire(A, "b")
    assert got.ready and got.host_hit == 16  # its load is in flight
    waiter = cache.begin_forward(["b"])
    for layer in (-1, 2, 1.0, True, "0"):
        with pytest.raises(
            ValueError,
            match=rf"wait_layer: layer={re.escape(repr(layer))}: must be an integer in \[0, 2\)",
        ):
            waiter.wait_layer(layer)
    for layer in (np.int64(0), 1):
        waiter.wait_layer(layer)
    cache.cache_finished("b", A, got.indices)
    check(cache)
    cache.close()


@pytest.mark.parametrize(
    "field, value",
    [
        ("extra_key", 7),
        ("extra_key", b"lora"),
        ("extra_key", "\udcff"),
        ("request_id", None),
        ("request_id", 7),
    ],
)
def test_acquire_refuses_an_extra_key_or_request_id_of_another_type(field, value):
    """An extra key that is not a str matched in the tree, then failed to hash on the
    storage thread (its prefetch, and every backup of the request's pages, logged a
    traceback); a request id of None reads as "every request" to begin_forward. Both are
    refused where they come in, and the cache holds nothing of the request."""
    cache = make_cache()
    compute(cache, A, seed=1)
    args = {"extra_key": value} if field == "extra_key" else {}
    rid = value if field == "request_id" else "r"
    with pytest.raises(ValueError, match=f"{field}={re.escape(repr(value))}: must be"):
        cache.acquire(np.concatenate([A, A + 1]), rid, **args)
    assert len(cache.requests) == 0 and cache.prefetcher.prefetches == {}
    check(cache)
    cache.close()


def test_finishing_with_tokens_other_than_the_handed_prefix_changes_nothing():
    """A request handed A's KV that finishes with other tokens (or another extra key), a
    kv row of the wrong length, or a priority that is not a number, is refused before
    anything changes: kept under other tokens, A's KV would be served for them (and its
    slots owned twice). The request still holds what it held, and finishes normally."""
    cache = make_cache()
    A = np.arange(100, 116)
    kvs = compute(cache, A, seed=1)
    got = acquire(cache, np.concatenate([A, [7, 7, 7, 7]]), "b")
    assert got.device_hit == 16
    row = torch.cat([got.indices, cache.alloc(4)])
    other = np.concatenate([A[:8], np.arange(900, 908), [7, 7, 7, 7]])
    for args, kwargs, message in [
        ((other, row), {}, "do not start with the 16 tokens it was handed KV for"),
        (
            (np.concatenate([A, [7, 7, 7, 7]]), row),
            {"extra_key": "lora-1"},
            "extra_key='lora-1'",
        ),
        (
            (np.concatenate([A, [7, 7, 7, 7]]), row[:-1]),
            {},
            "kv_indices: expected 20 indices .*, got 19",
        ),
        (
            (A, row),
            {},
            r"expected 16 indices \(one per token, up to 16 with the tail of the last page\), got 20",
        ),
        (
            (np.concatenate([A, [7, 7, 7, 7]]), row),
            {"priority": "high"},
            "priority='high': must be an integer",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            cache.cache_finished("b", *args, **kwargs)
        check(cache)
    assert (
        "b" in cache.requests
        and cache.match_prefix(other, count=False).device_indices.numel() == 8
    )
    cache.cache_finished(
        "b", np.concatenate([A, [7, 7, 7, 7]]), row, priority=np.int64(3)
    )
    assert same_kv(read_back(cache, A, "again")[1], kvs)
    check(cache)
    cache.close()


def test_finishing_with_slots_the_request_does_not_own_changes_nothing():
    """Slots a finish keeps must be the request's: the ones its prefix was loaded into, as
    handed, then allocated ones. A freed (stale) slot was kept in the tree: the next request
    was handed its page and overwrote the KV the tree served for these tokens; the request
    count went negative and balanced the accounting. Refused before anything changes."""
    cache = make_cache(pool_size=128)
    A = np.arange(100, 116)
    kvs = compute(cache, A, seed=1)
    settle(cache)
    cache.evict(128)  # A is on host only now
    tokens = np.concatenate([A, [7, 7, 7, 7]])
    got = acquire(cache, tokens, "b")
    assert got.host_hit == 16
    mine = cache.alloc(4)
    spare = cache.alloc(16)
    stale = cache.alloc(4)
    cache.free(stale)
    forward(cache, "b")
    for row, message in [
        (torch.cat([got.indices, stale]), r"kv_indices \[\d+, .*\] are not allocated"),
        (
            torch.cat([got.indices, torch.tensor([0, 1, 2, 3])]),
            r"kv_indices \[0, 1, 2, 3\] are not allocated",
        ),
        (
            torch.cat([spare, mine]),
            r"kv_indices\[0:16\] are not the slots its prefix was loaded into",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            cache.cache_finished("b", tokens, row)
        check(cache)
    assert "b" in cache.requests
    cache.free(spare)
    cache.cache_finished("b", tokens, torch.cat([got.indices, mine]))
    assert same_kv(read_back(cache, A, "again")[1], kvs)
    check(cache)
    cache.close()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_finish_whose_row_lists_a_slot_twice_changes_nothing(page_size):
    """Two tokens' KV in one slot: the tree kept the row as given, so one of those tokens
    was served the other's KV from then on (a wrong byte, never a miss). Each slot the
    the request owns (its loaded prefix, then its own) must appear once; a row that
    repeats one, among its own or onto a loaded slot, is refused before anything changes,
    naming the slot. The right row then finishes as usual."""
    cache = make_cache(pool_size=128, page_size=page_size)
    kvs = compute(cache, A, seed=1)
    settle(cache)
    cache.evict(
        128
    )  # A is on host only now: the next request loads it into slots it owns
    tokens = np.concatenate([A, A + 1])
    got = acquire(cache, tokens, "b")
    assert got.host_hit == 16
    mine = cache.alloc(16)
    forward(cache, "b")
    fill(cache, mine, seed=2)
    loaded = got.indices[-1:]
    for row, slot in [
        (torch.cat([got.indices, mine[:15], mine[3:4]]), mine[3]),
        (torch.cat([got.indices, loaded, mine[1:]]), loaded[0]),
    ]:
        with pytest.raises(
            ValueError, match=rf"kv_indices lists slots \[{int(slot)}\] more than once"
        ):
            cache.cache_finished("b", tokens, row)
        assert "b" in cache.requests
        check(cache)
    cache.cache_finished("b", tokens, torch.cat([got.indices, mine]))
    assert same_kv(read_back(cache, A, "again")[1], kvs)
    check(cache)
    cache.close()


def test_a_tree_slot_in_a_finishs_own_part_is_never_handed_out_twice():
    """Nothing knows whose a slot is, so a finish whose own part names a slot of the
    prefix the tree holds is kept (the engine's forward overwrote that KV already). The
    tree then holds the slot twice; eviction frees what it holds scanning for repeats, so
    the slot is queued once (freed as listed, it was handed to two owners)."""
    cache = make_cache(pool_size=64, page_size=1)
    compute(cache, A, seed=1)
    cache.drain()
    tokens = np.concatenate([A, A + 1000])
    got = acquire(cache, tokens, "b")
    assert got.device_hit == 16
    mine = cache.alloc(16)
    forward(cache, "b")
    cache.cache_finished(
        "b", tokens, torch.cat([got.indices, mine[:15], got.indices[:1]])
    )
    cache.free(mine[15:16])
    cache.drain()
    cache.evict(64)
    slots = cache.alloc(cache.slots.device_free()).tolist()
    assert len(slots) == len(set(slots)) == 64  # every slot once
    cache.close()


def test_an_abort_with_a_row_the_request_does_not_own_changes_nothing():
    """abort(rid, row) released the lock and forgot the request, then raised on a stale slot
    in the row: the request's other slots were never freed (a leak the accounting showed).
    A row shorter than the prefix handed freed nothing of the request's own. Both are
    refused before anything changes; the right row then releases everything."""
    cache = make_cache(pool_size=128)
    compute(cache, A, seed=1)
    tokens = np.concatenate([A, A + 1])
    got = acquire(cache, tokens, "b")
    mine = cache.alloc(16)
    stale = cache.alloc(4)
    cache.free(stale)
    for row, message in [
        (torch.cat([got.indices, mine[:-4], stale]), "are not allocated"),
        (got.indices[:-1], "covers at least the 16 it was handed"),
    ]:
        with pytest.raises(ValueError, match=message):
            cache.abort("b", row)
        assert "b" in cache.requests
        check(cache)
    cache.abort("b", torch.cat([got.indices, mine]))
    assert len(cache.requests) == 0 and cache.requests.pages == 0
    check(cache)
    cache.close()


def test_write_back_never_waits_for_a_backup_to_free_the_headroom():
    """Under write_back, evicting a node that is not backed up means waiting for its write.
    A demand that backed-up nodes can meet never waits just to free the headroom."""
    cache = make_cache(pool_size=128, write_policy="write_back", evict_headroom=0.125)
    prompts = [
        np.arange(1000 * i, 1000 * i + 16) for i in range(8)
    ]  # 8 nodes of 4 pages fill the pool
    for i, p in enumerate(prompts):
        compute(cache, p, seed=i)
    cache.evict(
        16
    )  # nothing backed up: every leaf is written (waited for), the oldest demoted
    fresh = np.arange(9000, 9016)
    compute(cache, fresh, seed=8)  # not backed up: write_back writes on eviction only
    held = {
        f"held-{i}": acquire(cache, prompts[i], f"held-{i}") for i in range(2, 8)
    }  # locked: not evictable
    writes = cache.stats()["counters"]["writes"]

    compute(
        cache, np.arange(9100, 9116), seed=9
    )  # short by 16: prompts[1], backed up, covers it
    assert cache.stats()["counters"]["writes"] == writes, (
        "a write was waited for only to free the headroom"
    )
    assert (
        cache.slots.device_free() == 0
    )  # the headroom would have needed `fresh` written
    m = cache.match_prefix(fresh, count=False)
    assert m.device_slots.size == 16 and not m.last_device_node.backed_up
    for i, (rid, got) in enumerate(held.items(), start=2):
        forward(cache, rid)
        cache.cache_finished(rid, prompts[i], got.indices)
    check(cache)
    cache.close()


def test_pages_that_leave_host_become_the_newest_in_the_store(tmp_path):
    """A page hit on device or host never reaches the store, so the store's own access
    order would evict first what is used most. When host evicts a page, the store's copy is
    the one left: it becomes the store's newest, and an older page makes room instead.

    Device 32 tokens, host 32, a file store of 8 pages: A and B fill device and host (and
    the store, A oldest); C needs device and host room, so A goes to host and then leaves
    it (B stays on device); C's backup makes the store evict 4 pages: B's, not A's."""
    from kvtier.backends import frame
    from kvtier.backends.file import FileStore, FileStoreConfig

    page_file = (
        4 * 2 * 2 * 2 * 4 * 4 + frame.HEADER_SIZE
    )  # 4 tokens x layers x K,V x heads x dim x fp32
    store = FileStore(
        FileStoreConfig(root=str(tmp_path / "l3"), capacity_bytes=8 * page_file)
    )
    cache = make_cache(pool_size=32, ratio=1.0, store_obj=store)
    B, C = np.arange(200, 216), np.arange(300, 316)
    kv_a = compute(cache, A, seed=1)
    settle(cache)
    compute(cache, B, seed=2)
    settle(cache)
    compute(cache, C, seed=3)
    settle(cache)
    assert (
        cache.match_prefix(A, count=False).host_hit_length == 0
    )  # A lives on in the store only
    assert store.stats()["evictions"] == 4
    cache.evict(
        16
    )  # device room: B goes to host only, so host can make room for A's pages
    got, got_kv = read_back(cache, A, "again")
    assert got.storage_hit == 16 and same_kv(got_kv, kv_a)
    settle(cache)
    check(cache)
    cache.close()


def test_pages_that_leave_host_are_touched_in_redis(redis_server):
    """The same with Redis, which keeps its own eviction order (maxmemory-policy; LFU here,
    exact with lfu-log-factor 0): when A's pages leave host, the server sees them used;
    B's pages, still on device, are not touched."""
    import time

    import redis

    from kvtier.backends.redis_store import RedisStore, RedisStoreConfig
    from tests.backends.stores import exact_lfu

    raw = redis.Redis.from_url(redis_server.url)
    raw.flushdb()
    store = RedisStore(RedisStoreConfig(url=redis_server.url))
    cache = make_cache(pool_size=32, ratio=1.0, store_obj=store)
    try:
        with exact_lfu(raw):
            B, C = np.arange(200, 216), np.arange(300, 316)
            compute(cache, A, seed=1)
            settle(cache)
            compute(cache, B, seed=2)
            settle(cache)
            before = {k: raw.object("freq", k) for k in raw.scan_iter(match="*/*/*")}
            assert (
                len([k for k in before if b"manifest" not in k]) == 8
            )  # A's 4 pages and B's
            compute(
                cache, C, seed=3
            )  # A goes to host, then leaves it; B stays on device
            settle(cache)
            assert cache.match_prefix(A, count=False).host_hit_length == 0
            for _ in range(
                1000
            ):  # the touch goes out in the background on the storage thread
                if store.touched >= 4:
                    break
                time.sleep(0.01)
            gained = sorted(k for k, f in before.items() if raw.object("freq", k) > f)
            assert len(gained) == 4 and store.touched == 4
            cache.evict(
                16
            )  # device room: B goes to host only, so host can make room for A's pages
            got, _ = read_back(
                cache, A, "again"
            )  # the touched pages are A's: read back from Redis
            assert got.storage_hit == 16
            assert (
                sorted(k for k, f in before.items() if raw.object("freq", k) > f + 1)
                == gained
            )
            settle(cache)
            check(cache)
    finally:
        cache.close()
        raw.close()


def test_the_second_acquire_reads_the_tokens_it_is_given_not_the_first_ones():
    """The second acquire of a request reuses its first key only for the same tokens: a
    buffer the engine refilled in between is the prompt now."""
    from tests.controller.helpers import compute, make_cache, settle

    cache = make_cache()
    compute(cache, np.arange(100, 116), seed=1)
    settle(cache)
    cache.flush()
    tokens = np.arange(100, 116)
    assert not cache.acquire(tokens, "r").ready
    tokens[:] = np.arange(300, 316)  # refilled in place: nothing of it is cached
    while "r" not in cache.poll():
        cache.wait_progress(0.01)
    got = cache.acquire(tokens, "r")
    assert got.ready and got.indices.numel() == 0, (
        "the first acquire's tokens were matched"
    )
    cache.abort("r")
    settle(cache)
    cache.flush()  # the prefetch hung the pages on host: from the store again
    again = np.arange(100, 116)
    assert not cache.acquire(again, "s").ready
    while "s" not in cache.poll():
        cache.wait_progress(0.01)
    got = cache.acquire(again, "s")  # the same tokens: the prefetched prefix
    assert got.storage_hit == 16
    cache.abort("s", got.indices)
    settle(cache)
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()


@pytest.mark.parametrize("ending", ["finish", "abort"])
def test_a_row_the_engine_fills_again_after_a_finish_or_abort_frees_the_slots_it_held(
    ending,
):
    """Review: at page size 1 the free list kept the slots it was given, a view of the
    engine's row (an int64 CPU tensor, as kvtier hands out); the engine filling that row
    for its next request rewrote them. A finish whose slots were all duplicates (two
    requests computed one prompt at once), or an abort, then handed one slot out several
    times (two requests writing one slot's KV) and lost the freed ones."""
    cache = make_cache(pool_size=64, page_size=1)
    prompt = np.arange(100, 108)
    assert acquire(cache, prompt, "a").indices.numel() == 0
    row_a = cache.alloc(len(prompt))
    if ending == "finish":
        assert (
            acquire(cache, prompt, "b").indices.numel() == 0
        )  # computed again, side by side
    else:
        acquire(cache, np.arange(200, 208), "b")
    row_b = cache.alloc(len(prompt)).clone()  # the engine's own row for b
    forward(cache, "a", "b")
    cache.cache_finished("a", prompt, row_a)
    own = row_b.tolist()
    if (
        ending == "finish"
    ):  # the tree holds the prompt already: b's slots are all duplicates
        cache.cache_finished("b", prompt, row_b)
    else:
        cache.abort("b", row_b)
    row_b.fill_(
        int(row_a[0])
    )  # the engine's next request reuses the row: a slot the tree holds
    taken = []
    while (more := cache.alloc(1)) is not None:
        taken += more.tolist()
    assert len(taken) == len(set(taken)), "a slot handed out twice"
    assert set(own) <= set(taken), "slots the request gave back were lost"
    assert int(row_a[0]) not in taken, "a slot the tree holds was handed out"
    cache.free(torch.tensor(taken))
    check(cache)


def test_a_load_a_forward_gave_up_on_is_refused_at_finish_even_if_it_lands_later():
    """A forward's wait for a layer times out: `failed()` names the request, whose outputs
    are garbage. If the engine finishes it instead of aborting it after the copy landed, the
    finish is refused (TransferError) and nothing is kept: it was accepted, the tree kept
    KV computed from unloaded inputs, and the next request was served it."""
    import random

    from kvtier.errors import TransferError
    from kvtier.testing.parts import SimStreams

    streams = SimStreams(random.Random(0))
    cache = make_cache(stream_factory=streams.factory, store="none")
    first = np.arange(1, 9)
    got = cache.acquire(first, "r1")
    row = cache.alloc(8)
    kv = fill(cache, row, seed=5)
    cache.cache_finished("r1", first, torch.cat([got.indices, row]))
    cache.poll()
    while streams.pending:  # its write to host lands
        streams.resolve(streams.pending[0], "ok", None)
    cache.drain()
    assert cache.evict(8) == 8  # on host only now
    longer = np.arange(1, 13)
    got = cache.acquire(longer, "r2")
    assert got.host_hit == 8
    own = cache.alloc(4)
    waiter = cache.begin_forward(["r2"])
    waiter.timeout_s = 0.0  # the copy has not run: every layer's wait gives up
    for layer in range(cache.pool.num_layers):
        waiter.wait_layer(layer)
    fill(cache, own, seed=6)  # outputs computed from KV that was not there
    assert waiter.failed() == ["r2"]
    while streams.pending:
        streams.resolve(
            streams.pending[0], "ok", None
        )  # the copy lands after the forward
    with pytest.raises(
        TransferError,
        match="'r2': its host->device load failed \\(a forward gave up waiting",
    ):
        cache.cache_finished("r2", longer, torch.cat([got.indices, own]))
    again = cache.acquire(longer, "r3")
    assert (
        again.ready and again.indices.numel() == 8
    )  # the first 8 only: nothing of r2 was kept
    while streams.pending:  # its load from host
        streams.resolve(streams.pending[0], "ok", None)
    forward(cache, "r3")
    assert same_kv(read(cache, again.indices), kv)
    cache.abort("r3", again.indices)
    check(cache)
    cache.close()


def test_a_closed_cache_refuses_finishes_and_the_request_is_let_go_by_abort():
    """A finish after close queued a write on a stream that was gone: the node stayed locked,
    its host slots reserved and the cache busy for good. It is refused; abort still lets the
    request go (how an engine releases what it held at shutdown)."""
    cache = make_cache()
    compute(cache, A[:8], seed=1)
    got = acquire(cache, A, "b")
    row = torch.cat([got.indices, cache.alloc(16 - got.indices.numel())])
    cache.close()
    for call in (
        lambda: cache.cache_finished("b", A, row),
        lambda: cache.cache_unfinished("b", A, row),
    ):
        with pytest.raises(RuntimeError, match="this TieredCache is closed"):
            call()
    assert not cache.busy() and cache.controller.queue_sizes()["writes"] == 0
    cache.abort("b", row)
    assert len(cache.requests) == 0 and cache.tree.protected_size(Tier.DEVICE) == 0
    check(cache)


def test_a_prefetch_stopped_before_its_grant_evicts_no_host_kv_for_it():
    """The store answered (the pages are there) and the request is aborted before the poll
    that grants host room: nothing will be read. Before: that poll still evicted cached host
    KV to make room for the pages, then stopped the prefetch and freed the room again."""
    import time

    cache = make_cache(page_size=4, pool_size=64, ratio=0.5)  # host: 32 tokens
    compute(cache, A, seed=1)
    settle(cache)
    cache.flush()  # A is in the store only
    for i, base in enumerate((200, 300)):  # two prompts cached on host (and device)
        compute(cache, np.arange(base, base + 12), seed=2 + i)
        settle(cache)
    cache.evict(64)  # their device copies go: their KV is on host only, 24 tokens of 32
    before = cache.stats()["counters"]["host_evicted_tokens"]
    got = cache.acquire(A, "x")
    assert not got.ready
    op = cache.prefetcher.prefetches["x"].op
    deadline = time.monotonic() + 30
    while op.present is None and time.monotonic() < deadline:
        time.sleep(0.001)  # the store answered; the op waits for the next poll's grant
    assert op.present == 4
    cache.abort("x")
    settle(cache)
    assert cache.stats()["counters"]["host_evicted_tokens"] == before
    assert cache.tree.total_size(Tier.HOST) == 24 and not op.granted
    check(cache)
    cache.close()
