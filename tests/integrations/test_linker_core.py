"""The SGLang linker's core (LinkerCore) over a real file store, driven in the order SGLang
drives it: an offload popped once its copy finished, lookups, loads, the storage thread's
outcomes reaped. Engine-free: LinkerCore needs no SGLang."""

import asyncio
import threading
import time

import numpy as np
import torch

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.hashing import Namespace
from kvtier.integrations.sglang.linker.core import LinkerCore, LinkerSettings
from kvtier.testing.linker_sim import page_keys
from kvtier.tiers.mirror import MirrorConfig
from kvtier.tiers.pool import DeviceKVPool, PoolConfig

PS, LAYERS = 4, 2
PAGE_BYTES = (
    PS * 4 * LAYERS * 4
)  # K and V of one head of 2 float32 per token, per layer


def make(tmp_path, host_pages: int, **settings) -> tuple[DeviceKVPool, LinkerCore]:
    pool = DeviceKVPool(
        PoolConfig(
            size=PS * 16,
            num_layers=LAYERS,
            page_size=PS,
            num_kv_heads=1,
            head_dim=2,
            dtype="float32",
        )
    )
    s = LinkerSettings(
        Namespace("m", "float32", "sglang-linker-mla", PS, 0, 1),
        mirror=MirrorConfig(size_bytes=PAGE_BYTES * host_pages, layout="page_first"),
        **settings,
    )
    return pool, LinkerCore(
        pool, s, FileStore(FileStoreConfig(root=str(tmp_path / "l3")), timeout_s=5.0)
    )


def put(pool: DeviceKVPool, page: int, value: float) -> torch.Tensor:
    """Device page `page` holds `value` everywhere (what a forward left); its slots."""
    slots = torch.arange(page * PS, (page + 1) * PS)
    for layer in range(LAYERS):
        pool.set_kv(
            layer, slots, torch.full((PS, 1, 2), value), torch.full((PS, 1, 2), value)
        )
    return slots


def copied(core: LinkerCore, n: int = 1) -> None:
    for _ in range(3000):
        if core.num_completed_offloads() >= n:
            return
        time.sleep(0.01)
    raise AssertionError("an offload's copy never finished")


def stored(core: LinkerCore) -> None:
    core.l3.drain()
    core.store_ops.reap()


def load(
    core: LinkerCore, pool: DeviceKVPool, key: str, page: int
) -> list[float] | None:
    """SGLang's load of one looked-up page into device page `page`: its KV, or None."""
    slots = torch.arange(page * PS, (page + 1) * PS)
    core.load("r", [key], slots)
    if not core.finish_layer_wise_loading(core.start_layer_wise_loading()):
        return None
    return pool.k_buffer(0)[slots].flatten().unique().tolist()


def test_an_offload_whose_key_a_store_read_published_meanwhile_stores_no_freed_page(
    tmp_path,
):
    """A key's store read published it on host while an offload of the same key was in
    flight. Popping the offload gave its host page back (the key keeps the read's page)
    but still sent that page to the store write; the next offload took the page, and the
    store got its KV under the first key. Only the pages the offload kept are written."""
    pool, core = make(tmp_path, host_pages=3)
    key, x, y, z = page_keys([1, 2, 3, 4])
    core.offload([key], put(pool, 1, 2.0))
    copied(core)
    core.pop_completed_offload()
    stored(core)
    core.offload(
        [x, y, z], torch.cat([put(pool, 2, 5.0), put(pool, 3, 5.0), put(pool, 4, 5.0)])
    )
    copied(core)
    core.pop_completed_offload()
    stored(core)
    assert core.index.get(key) is None  # `key` left host; the store holds it
    core.offload([key], put(pool, 1, 2.0))  # computed again: its offload is in flight
    copied(core)
    assert core.lookup("r", [key]) == 1
    assert load(core, pool, key, 6) == [2.0]  # the store's copy, published on host
    gate = threading.Event()

    async def hold() -> None:  # the storage thread is busy with another call a moment
        gate.wait(30)

    busy = asyncio.run_coroutine_threadsafe(hold(), core.l3.loop)
    freed = int(core.offloads.ops[0].host_pages[0])
    core.pop_completed_offload()  # its page goes back free
    core.offload(
        [page_keys([9])[0]], put(pool, 8, 9.0)
    )  # the next offload takes it first
    copied(core)
    assert int(core.offloads.ops[0].host_pages[0]) == freed
    gate.set()
    busy.result(30)
    core.pop_completed_offload()
    stored(core)
    core.close()
    pool2, reader = make(tmp_path, host_pages=3)  # a restart, another reader
    assert reader.lookup("r", [key]) == 1
    assert load(reader, pool2, key, 6) == [2.0]
    reader.close()


def test_ranks_that_do_not_write_forget_an_unreadable_page_once_it_is_offloaded_again(
    tmp_path,
):
    """MLA under tensor parallelism: every rank remembers a store page that failed
    verification and stops its lookups before it; only a store write made it forget, and
    only rank 0 writes. Once rank 0 stored a good copy again, rank 1 kept stopping there:
    the ranks answered differently and SGLang's agreed prefix missed that page for good."""
    ranks = [make(tmp_path, host_pages=1, writes_store=rank == 0) for rank in (0, 1)]
    key, other = page_keys([1, 2])

    def offload_everywhere(k: str, page: int, value: float) -> None:
        for pool, core in ranks:
            core.offload([k], put(pool, page, value))
        for _, core in ranks:
            copied(core)
            core.pop_completed_offload()
            stored(core)

    offload_everywhere(key, 1, 2.0)
    offload_everywhere(other, 2, 3.0)  # one host page: `key` lives in the store only
    path = ranks[0][1].l3.store.path(ranks[0][1].l3.keys([key])[0])
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF  # the page rots
    path.write_bytes(bytes(blob))
    assert [core.lookup("r", [key]) for _, core in ranks] == [1, 1]
    assert [load(core, pool, key, 5) for pool, core in ranks] == [
        None,
        None,
    ]  # a miss on every rank
    offload_everywhere(key, 1, 2.0)  # recomputed: rank 0 stores a good copy
    offload_everywhere(other, 2, 3.0)
    assert [core.lookup("r", [key]) for _, core in ranks] == [1, 1]
    for _, core in ranks:
        core.close()


def test_host_index_evicts_the_coldest_unpinned_pages_in_order():
    """Eviction takes pages off the LRU's cold end, exactly in order; a lookup's touch makes
    a page the newest; a pinned page is out of the LRU until its last pin goes, then the
    newest; a reservation short of unpinned pages evicts nothing."""
    from kvtier.integrations.sglang.linker.host_index import HostIndex
    from kvtier.tiers.allocator import PagedAllocator

    index = HostIndex(PagedAllocator(6 * PS, PS))
    keys = page_keys([1, 2, 3, 4, 5, 6])
    index.publish(keys, index.reserve(6).tolist())
    assert index.room() == 6 and index.run(keys[1:3]) == (2, 2)  # b, c touched
    pinned = index.pin([keys[0], keys[3], keys[3]])  # a once, d twice
    assert pinned == [keys[0], keys[3], keys[3]] and index.room() == 4
    got = index.reserve(2)  # coldest unpinned: e, f
    assert sorted(index.pages) == sorted([keys[i] for i in (0, 1, 2, 3)])
    assert index.reserve(3) is None and len(index.pages) == 4  # only b, c evictable
    index.unpin([keys[3]])
    assert index.room() == 2  # d keeps one pin
    index.unpin([keys[0], keys[3]])  # a, then d: the newest, in that order
    assert list(index.lru) == [keys[1], keys[2], keys[0], keys[3]]
    index.release(got)
    assert index.check() == [] and index.evicted_pages == 2


def test_a_reservation_hands_its_victims_over_without_freeing_them():
    """A reservation that evicts gives the op the victims themselves (still handed out by
    the allocator): no allocator call once the tier is full, one (for the free pages) when
    part is free; the pages are those the LRU's cold end named, and the counts add up."""
    from kvtier.integrations.sglang.linker.host_index import HostIndex
    from kvtier.tiers.allocator import PagedAllocator

    class Counted(PagedAllocator):
        calls = 0

        def alloc_pages(self, n):
            Counted.calls += 1
            return super().alloc_pages(n)

        def free_pages(self, pages):
            Counted.calls += 1
            return super().free_pages(pages)

    index = HostIndex(Counted(6 * PS, PS))
    keys = page_keys([1, 2, 3, 4, 5, 6])
    first = index.reserve(6)
    index.publish(keys, first)
    coldest = [index.pages[k] for k in keys[:2]]
    Counted.calls = 0
    got = index.reserve(2)  # the tier is full: a and b, the coldest, are the op's now
    assert Counted.calls == 0 and got.tolist() == coldest
    assert sorted(index.pages) == sorted(keys[2:]) and index.check() == []
    index.release(got[:1])  # one page free again
    Counted.calls = 0
    more = index.reserve(2)  # the free page and c, the coldest: one allocator call
    assert Counted.calls == 1 and sorted(more.tolist()) == sorted(
        [coldest[0], first[2]]
    )
    index.release(np.concatenate([got[1:], more]))
    assert index.check() == [] and index.evicted_pages == 3
    assert index.free_pages() == 3 and sorted(index.pages) == sorted(keys[3:])


def test_pin_found_pins_as_pin_does_and_names_each_keys_page():
    """A load's pin (`pin_found`): the published keys pinned, each key's host page (0 for
    one not on host), pins counted on a page pinned already and a key named twice, and
    the LRU left exactly the unpinned pages."""
    from kvtier.integrations.sglang.linker.host_index import HostIndex
    from kvtier.tiers.allocator import PagedAllocator

    index = HostIndex(PagedAllocator(6 * PS, PS))
    keys = page_keys([1, 2, 3, 4, 5, 6])
    index.publish(keys[:4], index.reserve(4))  # e, f not on host
    pages = [index.pages[k] for k in keys[:4]]
    got, host = index.pin_found(keys[:2])  # the usual case: none pinned yet
    assert got == keys[:2] and host.tolist() == pages[:2]
    assert index.room() == 2 + 2 and index.check() == []
    asked = [keys[1], keys[2], keys[4], keys[2]]  # b pinned already, c twice, e absent
    got, host = index.pin_found(asked)
    assert got == [keys[1], keys[2], keys[2]]
    assert host.tolist() == [pages[1], pages[2], 0, pages[2]]
    assert index.pins == {keys[0]: 1, keys[1]: 2, keys[2]: 2}
    assert list(index.lru) == [keys[3]] and index.room() == 2 + 1
    index.unpin([keys[0], keys[1], keys[1], keys[2], keys[2]])
    assert index.pins == {} and index.room() == 6 and index.check() == []


def test_a_load_naming_a_store_page_twice_loses_no_host_page(tmp_path):
    """A load whose keys name one store page twice reads it into two reserved host pages;
    when it ends, one becomes the key's host page and the other goes back free. Publishing
    both at once kept the second under the key and dropped the first from every count:
    neither free, reserved nor published, a host page lost for good on each such load."""
    pool, core = make(tmp_path, host_pages=4)
    (key,) = page_keys([1])
    core.offload([key], put(pool, 1, 2.0))
    copied(core)
    core.pop_completed_offload()
    stored(core)
    core.reset()  # the host tier dropped: `key` lives in the store only
    assert core.index.get(key) is None and core.lookup("r", [key, key]) == 2
    slots = torch.arange(5 * PS, 7 * PS)
    assert core.load("r", [key, key], slots)
    assert core.finish_layer_wise_loading(core.start_layer_wise_loading())
    assert pool.k_buffer(0)[slots].flatten().unique().tolist() == [2.0]
    assert core.check_accounting() == []
    assert core.index.room() == 4  # every host page is free or evictable again
    core.close()


def test_an_offload_naming_a_page_twice_copies_it_once(tmp_path):
    """An offload whose keys name one page twice copies it into one host page and stores
    it once. Both copies were queued under the key, and popping the offload raised
    KeyError into SGLang's scheduler (the second key was no longer in flight), leaving
    both host pages reserved by no op."""
    pool, core = make(tmp_path, host_pages=4)
    key, other = page_keys([1, 2])
    slots = torch.cat([put(pool, 1, 2.0), put(pool, 2, 3.0), put(pool, 3, 2.0)])
    assert core.offload([key, other, key], slots)
    copied(core)
    assert core.pop_completed_offload()
    stored(core)
    assert core.check_accounting() == [] and len(core.index.pages) == 2
    core.reset()  # from the store now
    assert core.lookup("r", [key, other]) == 2
    assert load(core, pool, key, 6) == [2.0]
    assert core.check_accounting() == []
    core.close()


def test_a_host_run_stops_at_the_first_unpublished_page_and_at_the_budget():
    """`run` from `start`: the end of the published run, cut before the page that would
    make its evictable pages more than `budget`; pinned pages are not counted and not
    touched; the evictable pages it covers (only those) become the newest, in run order."""
    from kvtier.integrations.sglang.linker.host_index import HostIndex
    from kvtier.tiers.allocator import PagedAllocator

    index = HostIndex(PagedAllocator(8 * PS, PS))
    keys = page_keys([1, 2, 3, 4, 5, 6, 7, 8])
    index.publish(keys[:6], index.reserve(6).tolist())  # a..f; g, h not published
    index.pin([keys[1], keys[3]])  # b, d out of the LRU
    assert index.run(keys) == (6, 4)  # a c e f touched, in that order
    assert list(index.lru) == [keys[0], keys[2], keys[4], keys[5]]
    assert index.run(keys, 2, 1) == (4, 1)  # from c: c counted, d pinned, e over
    assert list(index.lru) == [keys[0], keys[4], keys[5], keys[2]]
    assert index.run(keys, 1, 0) == (2, 0)  # b pinned: free of the budget; c is not
    assert index.run(keys, 6) == (6, 0) and index.run(keys[6:]) == (0, 0)
    assert index.run(keys[:3] + keys[6:] + keys[3:6]) == (3, 2)  # stops at g
    assert list(index.lru) == [keys[4], keys[5], keys[0], keys[2]]
    index.unpin([keys[1], keys[3]])
    assert index.check() == []


def test_host_eviction_follows_an_lru_model_through_many_touches():
    """Random publishes, runs, pins, unpins and reservations on a small tier, far past the
    point where the index rebuilds its queue of touched batches: the LRU order, the
    victims (coldest first) and room always match a plain ordered-dict model."""
    import random
    from collections import OrderedDict

    from kvtier.integrations.sglang.linker.host_index import HostIndex
    from kvtier.tiers.allocator import PagedAllocator

    rng = random.Random(5)
    index = HostIndex(PagedAllocator(12 * PS, PS))
    keys = page_keys(list(range(1, 31)))
    lru: OrderedDict[str, int] = (
        OrderedDict()
    )  # the model: unpinned published, coldest first
    pinned: dict[str, int] = {}  # key -> page, pinned
    held: list[list[str]] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.08:
            want = rng.sample(
                [k for k in keys if k not in index.pages], rng.randint(1, 4)
            )
            room = index.room()
            pages = index.reserve(len(want))
            if pages is None:
                assert (
                    len(want) - index.free_pages() > len(lru) and index.room() == room
                )
                continue
            short = len(want) - (room - len(lru))
            victims = [lru.popitem(last=False)[0] for _ in range(max(short, 0))]
            assert not any(v in index.pages for v in victims)
            index.publish(want, pages.tolist())
            lru.update(zip(want, pages.tolist()))
        elif op < 0.6:
            budget = rng.choice([None, 0, 1, 3, 6])
            run = rng.sample(
                list(index.pages), min(len(index.pages), rng.randint(1, 12))
            )
            run.insert(rng.randint(0, len(run)), rng.choice(keys))  # maybe unpublished
            end, unpinned = index.run(run, 0, budget)
            n = 0
            for i, k in enumerate(run):
                if k not in pinned and k not in lru:
                    assert end == i
                    break
                if k in lru:
                    if n == budget:
                        assert end == i
                        break
                    lru.move_to_end(k)
                    n += 1
            assert unpinned == n
        elif op < 0.8:
            got = index.pin(rng.sample(keys, 3))
            for k in got:
                if k in lru:
                    pinned[k] = lru.pop(k)
            held.append(got)
        elif held:
            got = held.pop(rng.randrange(len(held)))
            index.unpin(got)
            for k in got:
                if k in pinned and k not in index.pins:
                    lru[k] = pinned.pop(k)
        assert list(index.lru) == list(
            lru
        ) and index.room() == index.free_pages() + len(lru)
    while held:
        index.unpin(held.pop())
    assert index.check() == [] and index.evicted_pages > 100
