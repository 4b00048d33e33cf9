"""Agent hints on the SGLang linker's host tier (linker/hints.py): a leased prefix's host
pages survive offloads that evict every other page, leave after the lease on the linker's
clock, pages published later are pinned as they arrive, and a tenant over its bound gets
the error with nothing changed. Engine-free, over a real file store."""

import asyncio
from dataclasses import replace

import pytest
import torch

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.cache.hints import LeaseBoundError
from kvtier.hashing import Namespace
from kvtier.integrations.sglang.linker.core import LinkerCore, LinkerSettings
from kvtier.testing.linker_sim import page_keys
from kvtier.tiers.mirror import MirrorConfig
from kvtier.tiers.pool import DeviceKVPool, PoolConfig
from tests.integrations.test_linker_core import PAGE_BYTES, PS, copied, put, stored


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path, host_pages: int, clock) -> tuple[DeviceKVPool, LinkerCore]:
    pool = DeviceKVPool(
        PoolConfig(
            size=PS * 16,
            num_layers=2,
            page_size=PS,
            num_kv_heads=1,
            head_dim=2,
            dtype="float32",
        )
    )
    s = LinkerSettings(
        Namespace("m", "float32", "sglang-linker-mla", PS, 0, 1),
        mirror=MirrorConfig(size_bytes=PAGE_BYTES * host_pages, layout="page_first"),
    )
    store = FileStore(FileStoreConfig(root=str(tmp_path / "l3")), timeout_s=5.0)
    return pool, LinkerCore(pool, s, store, clock=clock)


def offload(core, pool, keys, first_page: int) -> None:
    slots = torch.cat([put(pool, first_page + i, float(i)) for i in range(len(keys))])
    core.offload(keys, slots)
    copied(core)
    core.pop_completed_offload()
    stored(core)


def test_a_leased_prefix_stays_on_host_through_a_flood_and_leaves_after_it(tmp_path):
    clock = Clock()
    pool, core = make(tmp_path, host_pages=6, clock=clock)
    prefix = page_keys([1, 2])
    offload(core, pool, prefix, 1)
    core.hints.pin(prefix, ttl_s=20)
    for i in range(4):  # 8 more pages through a 6-page host tier
        offload(core, pool, page_keys([10 + 2 * i, 11 + 2 * i]), 4)
    assert all(core.index.get(k) is not None for k in prefix)
    assert core.index.get(page_keys([10])[0]) is None  # the others were evicted
    assert core.check_accounting() == []
    clock.now = 20.0
    core.lookup("r", prefix)  # the linker reaps: the lease ends
    assert core.hints.stats()["expired"] == 1 and not core.index.pins
    for i in range(4):
        offload(core, pool, page_keys([30 + 2 * i, 31 + 2 * i]), 4)
    assert all(core.index.get(k) is None for k in prefix)
    assert core.check_accounting() == []
    core.close()


def test_pages_published_later_are_pinned_and_the_bound_changes_nothing(tmp_path):
    clock = Clock()
    pool, core = make(tmp_path, host_pages=6, clock=clock)
    a, b, c, d = page_keys([1, 2, 3, 4])
    lease = core.hints.pin([a, b], ttl_s=5, tenant="t")  # not offloaded yet
    assert lease.short() and core.hints.stats()["pins_short"] == 1
    offload(core, pool, [a, b], 1)
    core.lookup("r", [a])
    assert sorted(lease.pinned) == sorted([a, b]) and core.check_accounting() == []
    before = (dict(core.index.pins), core.hints.stats()["lease_bytes"])
    asks = (
        f"tenant 't' asks {3 * PAGE_BYTES} bytes of host .* bound is {3 * PAGE_BYTES}"
    )
    with pytest.raises(LeaseBoundError, match=asks):
        core.hints.pin([a, b, c], ttl_s=5, tenant="t")  # bound: 3 pages of 6
    assert (dict(core.index.pins), core.hints.stats()["lease_bytes"]) == before
    core.hints.pin([c], ttl_s=5, tenant="t")
    assert core.hints.prefetch([d]) is False and core.hints.stats()["unhonoured"] == 1
    assert core.hints.release([a, b], tenant="t") == 1
    assert core.check_accounting() == []
    core.reset()  # a flush lets go of every lease
    assert core.hints.stats()["leases"] == 0 and not core.index.pins
    assert core.check_accounting() == []
    core.close()


def test_new_tenant_names_cannot_pin_the_whole_host_tier(tmp_path):
    """Two tenants' bounds (3 pages of 6 each) would pin every host page, and every
    offload after them would find no room: all tenants' leases together hold at most the
    bound too; past it, the error, and nothing changes."""
    clock = Clock()
    pool, core = make(tmp_path, host_pages=6, clock=clock)
    keys = page_keys([1, 2, 3, 4, 5, 6])
    offload(core, pool, keys[:3], 1)
    offload(core, pool, keys[3:], 4)
    core.hints.pin(keys[:3], ttl_s=50, tenant="t1")
    before = (dict(core.index.pins), core.hints.stats()["lease_bytes"])
    with pytest.raises(LeaseBoundError, match="tenant 't2' asks .* all tenants"):
        core.hints.pin(keys[3:], ttl_s=50, tenant="t2")
    assert (dict(core.index.pins), core.hints.stats()["lease_bytes"]) == before
    offload(
        core, pool, page_keys([7, 8, 9]), 1
    )  # the unleased half still takes offloads
    assert core.counters.offload_no_host_room_pages == 0
    assert core.check_accounting() == []
    core.hints.release(keys[:3], tenant="t1")
    core.hints.pin(keys[:3], ttl_s=50, tenant="t2")
    assert core.check_accounting() == []
    core.close()


def flood(core, root, page: int, capacity: int) -> None:
    """Another process on the store's root writes 16 plain pages within `capacity`."""
    flooder = FileStore(FileStoreConfig(root=str(root), capacity_bytes=capacity))
    keys = core.l3.keys(page_keys(range(100, 116)))

    async def run() -> None:
        for k in keys:
            await flooder.batch_set([k], [bytes(page)])
        stats = flooder.stats()
        assert stats["evictions"] >= 12 and stats["leases_broken"] == 0
        await flooder.close()

    asyncio.run(run())


def test_a_store_lease_reaches_the_file_store_and_a_release_ends_it(tmp_path):
    """pin(tiers=("host", "store")) leases the prefix's pages in the file store's table: a
    flood by another process on the root evicts only unleased pages; release ends the
    leases. The linker used to count the store tier as not honoured and tell no store."""
    clock = Clock()
    pool, core = make(tmp_path, host_pages=6, clock=clock)
    prefix, other = page_keys([1, 2]), page_keys([3, 4])
    offload(core, pool, prefix, 1)
    offload(core, pool, other, 3)
    store, leased, plain = core.store, core.l3.keys(prefix), core.l3.keys(other)
    core.hints.pin(prefix, ttl_s=60, tiers=("host", "store"))
    core.quiesce()
    assert all(store._leases.leased(k) for k in leased)
    assert not any(k in store._leases for k in plain)
    stats = core.hints.stats()
    assert (stats["store_hints"], stats["store_hinted_pages"]) == (1, 2)
    assert (stats["unhonoured"], stats["store_hints_failed"]) == (0, 0)
    page = max(store._sizes.values())
    flood(core, tmp_path / "l3", page, 2 * len(leased + plain) * page)

    async def held(keys) -> list[bool]:
        return [await store.batch_exists([k]) == 1 for k in keys]

    assert core.l3.store_loop.run(held(leased)) == [True, True]
    assert core.hints.release(prefix) == 1
    core.quiesce()
    assert not any(k in store._leases for k in leased)
    assert core.hints.stats()["store_hints"] == 2 and not core.index.pins
    assert core.check_accounting() == []
    core.close()


def test_a_page_keeps_the_longest_store_lease_left_and_its_retained_priority(tmp_path):
    """Two store leases share page a: the shorter's pin never shortens a's lease, its
    expiry on the linker's clock leaves a the longer's time, and b's ends; a retain's
    priority outlives both. With no store the same hints are counted as not honoured."""
    clock = Clock()
    pool, core = make(tmp_path, host_pages=6, clock=clock)
    a, b, c = page_keys([1, 2, 3])
    offload(core, pool, [a, b, c], 1)
    store = core.store
    ka, kb, kc = core.l3.keys([a, b, c])
    core.hints.retain([a, b, c], 5)
    core.hints.pin([a], ttl_s=50, tiers=("store",))
    core.hints.pin([a, b], ttl_s=10, tiers=("store",))
    core.quiesce()
    assert store._leases.remaining(ka) > 40 and 0 < store._leases.remaining(kb) <= 10
    assert not store._leases.leased(kc)
    clock.now = 10.0
    core.lookup("r", [a])  # the linker reaps: the shorter lease ends
    core.quiesce()
    assert core.hints.stats()["expired"] == 1
    assert store._leases.remaining(ka) > 30 and not store._leases.leased(kb)
    assert all(store._leases.get(k).priority == 5 for k in (ka, kb, kc))
    assert not core.index.pins and core.hints.stats()["lease_bytes"] == {}
    core.close()

    bare = LinkerCore(core.pool, core.settings, None, clock=clock)
    bare.hints.pin([a], ttl_s=5, tiers=("host", "store"))
    bare.hints.retain([a], 5)
    assert bare.hints.stats()["unhonoured"] == 2
    assert bare.hints.stats()["store_hints"] == 0
    bare.close()

    # MLA: a rank that does not write the shared store pages holds the lease, tells no store
    again = FileStore(FileStoreConfig(root=str(tmp_path / "l3")), timeout_s=5.0)
    quiet = LinkerCore(
        core.pool, replace(core.settings, writes_store=False), again, clock=clock
    )
    quiet.hints.pin([a], ttl_s=5, tiers=("host", "store"))
    stats = quiet.hints.stats()
    assert (stats["leases"], stats["store_hints"], stats["unhonoured"]) == (1, 0, 0)
    quiet.close()
