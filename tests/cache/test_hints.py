"""Agent hints on TieredCache (cache/hints.py): leases through floods and their expiry on
the cache's clock, the per-tenant bound, prefetch that never waits, demote, retain, and
what the store is told. Real stores (memory; subclasses that record or hold back calls)."""

import asyncio
import os
import threading

import numpy as np
import pytest
import torch

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.cache import TieredCache
from kvtier.cache.hints import LeaseBoundError, LeaseBounds
from kvtier.config import load_config
from kvtier.testing import tp_sim
from kvtier.testing.tp_sim import on_ranks
from kvtier.tree import Tier
from tests.backends.stores import new_key
from tests.controller.helpers import (
    acquire,
    compute,
    forward,
    make_cache,
    read,
    read_back,
    same_kv,
    settle,
)

D, H = Tier.DEVICE, Tier.HOST
A = np.arange(100, 116)  # 16 tokens = 4 pages of 4


class Clock:
    """The cache's clock, moved by the test only."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def check(cache):
    cache.tree.sanity_check()
    cache.check_accounting()


def flood(cache, first: int, count: int) -> list[np.ndarray]:
    """`count` requests of 16 new tokens each, settled one by one (device, host churn)."""
    out = []
    for i in range(first, first + count):
        tokens = np.arange(1000 + 16 * i, 1016 + 16 * i)
        compute(cache, tokens, seed=i)
        settle(cache)
        cache.poll()
        out.append(tokens)
    return out


def until_fetched(cache) -> None:
    """Poll as a scheduler does until the hints' prefetches ended (a drain would stop them)."""
    for _ in range(10_000):
        if not cache.hints.fetching:
            return
        cache.poll()
        cache.wait_progress(0.01)
    raise AssertionError("a hint's prefetch never ended")


def where(cache, tokens) -> tuple[int, int]:
    """(device tokens, host-only tokens) of the cached prefix of `tokens`."""
    m = cache.match_prefix(tokens, count=False)
    return m.device_slots.size, m.host_hit_length


def on_host(cache, tokens) -> bool:
    m = cache.match_prefix(tokens, count=False)
    node = m.last_host_node
    return node is not cache.tree.root and node.backed_up


def test_pinned_prefix_survives_a_flood_then_leaves_after_its_lease():
    clock = Clock()
    cache = make_cache(clock=clock)  # device 64 tokens, host 128
    kv = compute(cache, A, seed=1)
    settle(cache)
    cache.pin(A, ttl_s=30, tiers=("device", "host"))
    others = flood(
        cache, 1, 12
    )  # 192 tokens through a 64-token pool and 128-token mirror
    assert where(cache, A) == (16, 0) and on_host(cache, A)
    assert where(cache, others[0]) == (0, 0) and not on_host(cache, others[0])
    got, got_kv = read_back(cache, A, "r")  # the pinned pages are the ones computed
    assert got.device_hit == 16 and same_kv(got_kv, kv)
    clock.now = 29.0
    cache.poll()
    assert cache.stats()["hints"]["leases"] == 1
    clock.now = 30.0  # the lease ends: the next poll lets go of it
    cache.poll()
    assert cache.stats()["hints"]["leases"] == 0
    assert cache.stats()["hints"]["expired"] == 1
    flood(cache, 20, 12)
    assert where(cache, A) == (0, 0) and not on_host(cache, A)
    check(cache)
    cache.close()
    check(cache)


def test_host_pin_taken_once_the_write_lands_and_survives_host_churn():
    """Pinned right after the finish: its write is in flight, so the host lock is taken by
    the poll that applies it; the device copy may go, the host one stays."""
    cache = make_cache(store="none")
    kv = compute(cache, A, seed=1)
    lease = cache.pin(A, ttl_s=60, tiers=["host"])
    settle(cache)
    cache.poll()
    assert lease.covered[H] == 16 and not lease.short()
    flood(cache, 1, 12)
    assert where(cache, A) == (0, 16)
    got, got_kv = read_back(cache, A, "r")
    assert got.host_hit == 16 and same_kv(got_kv, kv)
    assert cache.release(A) == 1
    flood(cache, 20, 12)
    assert where(cache, A) == (0, 0)
    check(cache)
    cache.close()


def test_over_the_tenant_bound_is_refused_and_nothing_changes():
    cache = make_cache()
    bpt = cache.pool.bytes_per_token
    compute(cache, A, seed=1)
    B = np.arange(300, 316)
    compute(cache, B, seed=2)
    settle(cache)
    cache.set_lease_bounds(LeaseBounds(24 * bpt, 24 * bpt, 24 * bpt))
    cache.pin(A, 10, ("device", "host"), tenant="t1")
    before = (
        cache.tree.protected_size(D),
        cache.tree.protected_size(H),
        cache.stats()["hints"]["lease_bytes"],
    )
    with pytest.raises(LeaseBoundError) as err:
        cache.pin(B, 10, ("device", "host"), tenant="t1")
    msg = str(err.value)
    for part in ("'t1'", "device", f"{16 * bpt} bytes", f"{24 * bpt} bytes"):
        assert part in msg
    after = (
        cache.tree.protected_size(D),
        cache.tree.protected_size(H),
        cache.stats()["hints"]["lease_bytes"],
    )
    assert after == before and cache.stats()["hints"]["leases"] == 1
    assert cache.stats()["hints"]["pins_refused"] == 1
    cache.pin(B, 10, ("device", "host"), tenant="t2")  # another tenant's own bound
    assert cache.stats()["hints"]["leases"] == 2
    with pytest.raises(ValueError, match="tiers: 'gpu' is not a tier"):
        cache.pin(B, 10, ("gpu",), tenant="t2")
    with pytest.raises(ValueError, match="ttl_s=0"):
        cache.pin(B, 0, ("host",))
    check(cache)
    cache.close()
    check(cache)


class GatedStore(MemoryStore):
    """A memory store whose page reads wait until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(MemoryStoreConfig())
        self.gate = threading.Event()
        self.reads_waiting = 0

    async def _wait(self) -> None:
        self.reads_waiting += 1
        while not self.gate.is_set():
            await asyncio.sleep(0.002)

    async def _get(self, keys):
        await self._wait()
        return await super()._get(keys)

    async def _get_into(self, keys, parsed, views):
        await self._wait()
        return await super()._get_into(keys, parsed, views)


def test_prefetch_returns_while_the_store_holds_its_read_and_lands_on_host():
    store = GatedStore()
    cache = make_cache(store_obj=store)
    kv = compute(cache, A, seed=3)
    settle(cache)
    cache.flush()  # only the store has it
    assert cache.prefetch(A) is True
    for _ in range(3):  # the scheduler goes on: nothing waits for the store
        assert cache.poll() == []
    assert where(cache, A) == (0, 0)
    store.gate.set()
    until_fetched(cache)
    assert where(cache, A) == (0, 16)  # landed on host, verified, ahead of its request
    got, got_kv = read_back(cache, A, "r")
    assert got.ready and got.host_hit == 16 and same_kv(got_kv, kv)
    assert cache.prefetch(A) is False  # on device and host already: nothing to fetch
    h = cache.stats()["hints"]
    assert h["prefetches"] == 1 and h["prefetches_noop"] == 1
    settle(cache)
    cache.poll()
    assert not cache.prefetcher.prefetches  # the hint's prefetch was taken back
    check(cache)
    cache.close()
    check(cache)


def test_demote_writes_a_write_back_prefix_down_so_eviction_keeps_it():
    cache = make_cache(write_policy="write_back", store="none")
    kv = compute(cache, A, seed=4)
    assert not on_host(cache, A)
    assert cache.demote(A) == 16
    settle(cache)
    cache.poll()
    assert on_host(cache, A)
    assert cache.evict(64) >= 16  # a long pause: its device pages go, the prefix stays
    assert where(cache, A) == (0, 16)
    got, got_kv = read_back(cache, A, "r")
    assert same_kv(got_kv, kv)
    check(cache)
    cache.close()


def test_retain_orders_priority_eviction_both_ways():
    config = load_config(
        None,
        {
            "pool": {
                "size": 64,
                "num_layers": 2,
                "page_size": 4,
                "num_kv_heads": 2,
                "head_dim": 4,
                "dtype": "float32",
            },
            "tree": {"eviction_policy": "priority"},
            "store": {"backend": "none"},
        },
        env={},
    )
    cache = TieredCache(config)
    B = np.arange(300, 316)
    compute(cache, A, seed=1)
    compute(cache, B, seed=2)  # B is newer: evicted last on a tie
    settle(cache)  # writes in flight lock their nodes
    cache.retain(A, 5)
    assert cache.evict(16) == 16
    assert where(cache, A)[0] == 16 and where(cache, B)[0] == 0
    compute(cache, B, seed=2)
    settle(cache)
    cache.retain(A, -1)  # lowered below B's: A goes first now
    check(cache)  # the heap holds A under its lowered key
    assert cache.evict(16) == 16
    assert where(cache, A)[0] == 0 and where(cache, B)[0] == 16
    assert cache.stats()["hints"]["retains_unordered"] == 0
    check(cache)
    cache.close()


class HintedStore(MemoryStore):
    """A memory store that records what `hint` it is given."""

    def __init__(self) -> None:
        super().__init__(MemoryStoreConfig())
        self.hints: list[tuple[list, float | None, int]] = []
        self.stored: list[str] = []

    async def _set(self, keys, frames):
        self.stored += keys
        return await super()._set(keys, frames)

    async def hint(self, keys, *, lease_s, priority=0):
        self.hints.append((list(keys), lease_s, priority))
        return len(keys)


def test_store_lease_and_release_reach_the_store_with_its_page_keys():
    store = HintedStore()
    clock = Clock()
    cache = make_cache(store_obj=store, clock=clock)
    compute(cache, A, seed=1)
    settle(cache)
    stored = sorted(store.stored)
    cache.pin(A, 45, ("store",))
    cache.controller.wait_idle()  # the storage thread's calls (a drain waits for no hint)
    [(keys, lease_s, prio)] = store.hints
    # a pin carries no priority (None: the page keeps its own), a retain does
    assert sorted(keys) == stored and len(keys) == 4 and (lease_s, prio) == (45, None)
    cache.retain(A, 3)
    clock.now = 40.0
    cache.release(A)
    cache.controller.wait_idle()
    assert [(h[1], h[2]) for h in store.hints[1:]] == [(45.0, 3), (None, None)]
    assert cache.stats()["hints"]["store_hinted_pages"] == 12
    check(cache)
    cache.close()


def test_a_retains_priority_outlives_a_pin_and_its_release_in_the_store(tmp_path):
    """retain(priority=5), then pin and release: the file store still takes the prefix's
    pages last. Pin and release told the store priority 0, overwriting the retain's: the
    prefix's pages, the oldest, were the first a flood evicted."""
    clock = Clock()
    root = tmp_path / "l3"
    store = FileStore(FileStoreConfig(root=str(root)), clock=clock)
    cache = make_cache(store_obj=store, clock=clock)
    compute(cache, A, seed=1)
    settle(cache)
    pages = dict(store._sizes)  # A's store pages: key -> file bytes
    assert len(pages) == 4
    cache.retain(A, 5)
    cache.pin(A, 45, ("store",))
    cache.controller.wait_idle()
    clock.now = 10.0
    cache.release(A)
    cache.controller.wait_idle()
    check(cache)
    cache.close()
    # another process on the root, with room for A's pages and as much again: a flood of
    # plain pages evicts its own oldest, never the retained ones
    page = max(pages.values())
    flooder = FileStore(
        FileStoreConfig(root=str(root), capacity_bytes=2 * sum(pages.values())),
        clock=clock,
    )

    async def flood_store() -> list[str]:
        keys = [new_key() for _ in range(16)]
        for k in keys:
            await flooder.batch_set([k], [os.urandom(page)])
        held = [k for k in pages if await flooder.batch_exists([k]) == 1]
        await flooder.close()
        return held

    assert asyncio.run(flood_store()) == list(pages)
    assert flooder.stats()["evictions"] >= 12 and flooder.leases_broken == 0


def test_a_retains_priority_outlives_a_pin_and_its_release_in_s3_tags(s3_server):
    """The same through TieredCache onto the S3 store: the pages' priority tag stays 5
    after a pin and its release (they tagged it 0)."""
    from tests.backends.test_leases import s3_store, s3_tags

    store = s3_store(s3_server.url)
    clock = Clock()
    cache = make_cache(store_obj=store, clock=clock)
    compute(cache, A, seed=1)
    settle(cache)
    cache.controller.wait_idle()
    pages = sorted(
        o["Key"]
        for o in store.client.list_objects_v2(Bucket=store.config.bucket)["Contents"]
        if not o["Key"].endswith("manifest.json")
    )
    assert len(pages) == 4
    cache.retain(A, 5)
    cache.pin(A, 45, ("store",))
    cache.controller.wait_idle()
    assert {s3_tags(store, k)["kvtier-priority"] for k in pages} == {"5"}
    clock.now = 10.0
    cache.release(A)
    cache.controller.wait_idle()
    plain = {"kvtier-lease-until": "0", "kvtier-priority": "5"}
    assert all(s3_tags(store, k) == plain for k in pages)
    assert cache.stats()["hints"]["store_hinted_pages"] == 12
    check(cache)
    cache.close()


def test_flush_and_close_let_go_of_leases():
    cache = make_cache()
    compute(cache, A, seed=1)
    settle(cache)
    cache.pin(A, 100, ("device", "host"))
    cache.flush()
    assert cache.stats()["hints"]["leases"] == 0 and where(cache, A) == (0, 0)
    compute(cache, A, seed=1)
    settle(cache)
    cache.pin(A, 100, ("device", "host"))
    cache.close()
    assert cache.tree.total_size(D) == 0
    check(cache)


def test_a_pinned_prefix_serves_the_same_kv_as_an_unpinned_one():
    """acquire -> forward -> finish over a pinned prefix, and abort, as without hints."""
    cache = make_cache()
    kv = compute(cache, A, seed=1)
    settle(cache)
    cache.pin(A, 100, ("device", "host", "store"))
    longer = np.arange(100, 124)  # A and 8 more tokens
    got = acquire(cache, longer, "r1")
    assert got.device_hit == 16
    forward(cache, "r1")
    assert same_kv(read(cache, got.indices), kv)
    cache.abort("r1", got.indices)
    got = acquire(cache, longer, "r2")
    new = cache.alloc(8)
    forward(cache, "r2")
    cache.cache_finished("r2", longer, torch.cat([got.indices, new]))
    settle(cache)
    cache.poll()
    assert where(cache, longer)[0] == 24
    cache.release(A)
    check(cache)
    cache.close()
    check(cache)


def test_tensor_parallel_ranks_let_a_lease_go_in_the_same_poll():
    """Each rank reads its own clock; a lease ends when the ranks' MIN passes it, so both
    unlock in the same poll and their trees stay the same (else rank 0 would evict the
    prefix while rank 1 still held it: different hits, different shapes)."""
    rendezvous = tp_sim.Rendezvous(2, timeout_s=30)
    clocks = [Clock(), Clock()]
    caches = [
        make_cache(
            store="none",
            clock=clocks[r],
            agreement=tp_sim.ThreadAgreement(rendezvous, r),
        )
        for r in range(2)
    ]

    def start(r):
        compute(caches[r], A, seed=1)
        settle(caches[r])
        caches[r].pin(A, 30, ("device", "host"))

    on_ranks(start, 2)
    clocks[0].now, clocks[1].now = 31.0, 29.0  # rank 0's clock runs ahead
    on_ranks(lambda r: caches[r].poll(), 2)
    assert [c.stats()["hints"]["leases"] for c in caches] == [1, 1]
    clocks[1].now = 30.0
    on_ranks(lambda r: caches[r].poll(), 2)
    assert [c.stats()["hints"]["leases"] for c in caches] == [0, 0]
    assert tp_sim.replicated_cache(caches[0]) == tp_sim.replicated_cache(caches[1])
    for c in caches:
        check(c)
    on_ranks(lambda r: caches[r].close(), 2)


def test_tensor_parallel_ranks_that_pinned_at_different_clocks_agree_on_the_expiry():
    """Each rank pins when its own scheduler gets the hint, at its own clock reading, so
    the ranks' ends of one lease differ (by microseconds in a server, by 0.5 s here). The
    lease must still go in the same poll on every rank: else one rank's table empties
    while the other's does not, their trees differ, and the next poll's collectives do
    not pair (the rank that still holds a lease makes one more)."""
    rendezvous = tp_sim.Rendezvous(2, timeout_s=30)
    clocks = [Clock(), Clock()]
    caches = [
        make_cache(
            store="none",
            clock=clocks[r],
            agreement=tp_sim.ThreadAgreement(rendezvous, r),
        )
        for r in range(2)
    ]

    def start(r):
        compute(caches[r], A, seed=1)
        settle(caches[r])

    on_ranks(start, 2)
    clocks[1].now = 0.5  # rank 1 gets the hint half a second later on its clock
    on_ranks(lambda r: caches[r].pin(A, 30, ("device", "host")), 2)
    clocks[0].now = clocks[1].now = 30.2  # past rank 0's end (30), not rank 1's (30.5)
    on_ranks(lambda r: caches[r].poll(), 2)
    leases = [c.stats()["hints"]["leases"] for c in caches]
    assert leases in ([1, 1], [0, 0]), leases
    assert tp_sim.replicated_cache(caches[0]) == tp_sim.replicated_cache(caches[1])
    clocks[0].now = clocks[1].now = 31.0
    on_ranks(lambda r: caches[r].poll(), 2)  # both ends passed: both let go
    assert [c.stats()["hints"]["leases"] for c in caches] == [0, 0]
    assert tp_sim.replicated_cache(caches[0]) == tp_sim.replicated_cache(caches[1])
    for c in caches:
        check(c)
    on_ranks(lambda r: caches[r].close(), 2)


def test_new_tenant_names_cannot_lease_more_than_the_bound_of_all_tenants_together():
    """A tenant is a name the caller gives (a field of the HTTP body): were the bound per
    tenant only, two names would lock the whole device pool, and every request after
    them would fail for want of device room. All tenants' leases together hold at most
    the default bound (half the device pool): past it, the error, and nothing changes."""
    cache = make_cache(
        store="none"
    )  # device 64 tokens: each tenant and all may lease 32
    bpt = cache.pool.bytes_per_token
    prefixes = [np.arange(100 + 16 * i, 116 + 16 * i) for i in range(3)]
    for i, p in enumerate(prefixes):
        compute(cache, p, seed=i)
    settle(cache)
    for i, p in enumerate(prefixes[:2]):
        cache.pin(p, 100, ("device",), tenant=f"t{i}")
    assert cache.tree.protected_size(D) == 32
    before = cache.stats()["hints"]["lease_bytes"]
    with pytest.raises(LeaseBoundError) as err:
        cache.pin(prefixes[2], 100, ("device",), tenant="t2")
    msg = str(err.value)
    for part in ("'t2'", "device", f"{16 * bpt} bytes", f"{32 * bpt} bytes"):
        assert part in msg, msg
    assert cache.tree.protected_size(D) == 32
    assert cache.stats()["hints"]["lease_bytes"] == before
    assert cache.stats()["hints"]["leases"] == 2
    kv = cache.alloc(32)  # half the pool stays for requests
    assert kv is not None
    cache.free(kv)
    cache.release(prefixes[0], tenant="t0")
    cache.pin(prefixes[2], 100, ("device",), tenant="t2")  # room again
    check(cache)
    cache.close()
    check(cache)


class LeasingStore(MemoryStore):
    """A memory store that keeps what `hint` says as Store.hint documents it: a lease of
    `lease_s` more seconds on each page, None releases the page's lease."""

    def __init__(self) -> None:
        super().__init__(MemoryStoreConfig())
        self.leased: dict[str, float] = {}
        self.stored: list[str] = []

    async def _set(self, keys, frames):
        self.stored += keys
        return await super()._set(keys, frames)

    async def hint(self, keys, *, lease_s, priority=0):
        for k in keys:
            if lease_s is None:
                self.leased.pop(k, None)
            else:
                self.leased[k] = lease_s
        return len(keys)


def test_a_store_lease_ends_only_when_no_lease_holds_its_pages():
    """Two leases of one prefix (two tenants, or one over a longer prefix): the release
    or expiry of one must not tell the store to let go of pages the other still holds,
    nor a retain of a prefix no lease names exactly."""
    store = LeasingStore()
    clock = Clock()
    cache = make_cache(store_obj=store, clock=clock)
    longer = np.arange(100, 124)  # A and 2 more pages
    compute(cache, longer, seed=1)
    settle(cache)
    pages = store.stored[:]
    assert len(pages) == 6

    def leased():
        cache.controller.wait_idle()
        return dict(store.leased)

    cache.pin(A, 30, ("store",), tenant="t1")
    cache.pin(A, 60, ("store",), tenant="t2")
    cache.pin(longer, 90, ("store",), tenant="t3")
    assert len(leased()) == 6
    cache.release(A, tenant="t1")
    assert len(leased()) == 6  # t2's and t3's leases hold them
    cache.retain(A, 2)  # no lease names A alone: its pages keep theirs
    assert len(leased()) == 6
    clock.now = 61.0
    cache.poll()  # t2's lease ends: t3's still holds every page
    assert cache.stats()["hints"]["leases"] == 1 and len(leased()) == 6
    assert min(leased().values()) == pytest.approx(29.0)  # t3's time left, 90 - 61
    cache.release(longer, tenant="t3")
    assert leased() == {}
    check(cache)
    cache.close()
