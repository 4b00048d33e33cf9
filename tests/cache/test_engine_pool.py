"""A TieredCache over KV tensors the engine (here: the test) allocated, and over slots the
engine's own allocator hands out: every page it computed reads back bit-exact after
device -> host -> store -> device."""

import numpy as np
import pytest
import torch

from kvtier import DeviceKVPool, TieredCache, load_config
from kvtier.backends.memory import MemoryStore, MemoryStoreConfig

PS, PAGES, LAYERS = 4, 16, 3


def engine_tensors(attention: str):
    """What an engine allocates: per layer K and V `[rows, heads, dim]` (MHA) or one latent
    `[rows, 1, rank + rope]` (MLA), rows = size + page_size, zeroed."""
    rows = PAGES * PS + PS
    if attention == "mla":
        return [
            torch.zeros(rows, 1, 12, dtype=torch.bfloat16) for _ in range(LAYERS)
        ], None
    return (
        [torch.zeros(rows, 2, 8, dtype=torch.float16) for _ in range(LAYERS)],
        [torch.zeros(rows, 2, 4, dtype=torch.float16) for _ in range(LAYERS)],
    )


class EngineAllocator:
    """An engine's own page allocator (free pages in a list), behind kvtier's DeviceAllocator."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size, self.page_size = size, page_size
        self.free = list(range(1, size // page_size + 1))

    def available_size(self) -> int:
        return len(self.free) * self.page_size

    def alloc_slots(self, n: int):
        pages = n // self.page_size
        if pages > len(self.free):
            return None
        taken, self.free = self.free[:pages], self.free[pages:]
        return (
            np.asarray(taken, dtype=np.int64)[:, None] * self.page_size
            + np.arange(self.page_size)
        ).reshape(-1)

    def free_slots(self, slots) -> None:
        pages = sorted(set((np.asarray(slots) // self.page_size).tolist()))
        if set(pages) & set(self.free):
            raise ValueError(
                f"free_slots: pages {pages} are not allocated (double free?)"
            )
        self.free += pages

    def free_group(self):
        from contextlib import nullcontext

        return nullcontext()

    def unallocated(self, slots):
        slots = np.asarray(slots)
        pages = slots // self.page_size
        return slots[
            np.isin(pages, self.free)
            | (pages < 1)
            | (pages > self.size // self.page_size)
        ]


def make(pool, allocator=None):
    cfg = load_config(
        None,
        {
            "mirror": {"ratio": 1.0, "layout": "page_first"},
            "controller": {
                "write_policy": "write_through",
                "prefetch_policy": "wait_complete",
            },
            "store": {"backend": "none"},
        },
        env={},
    )
    store = MemoryStore(MemoryStoreConfig(capacity_bytes=1 << 24))
    return TieredCache(cfg, store=store, pool=pool, device_allocator=allocator)


def layer_parts(k, v):
    return [[kl] if v is None else [kl, vl] for kl, vl in zip(k, v or k)]


def fill_random(parts, slots, seed):
    """The engine's forward writes KV at `slots` of its own tensors (random bits, NaNs too)."""
    g = torch.Generator().manual_seed(seed)
    for layer in parts:
        for t in layer:
            raw = torch.randint(
                0,
                256,
                (slots.numel(), *t.shape[1:], t.element_size()),
                generator=g,
                dtype=torch.uint8,
            )
            t.view(torch.uint8).view(t.shape[0], *t.shape[1:], t.element_size())[
                slots
            ] = raw


def acquire(cache, tokens, rid):
    """As a server does: a request whose prefetch runs waits until a poll names it."""
    got = cache.acquire(tokens, rid)
    while not got.ready:
        if rid in cache.poll():
            got = cache.acquire(tokens, rid)
        else:
            cache.wait_progress(0.01)
    return got


def read_bytes(parts, slots):
    return [[t[slots].view(torch.uint8).clone() for t in layer] for layer in parts]


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("own_allocator", [False, True])
def test_every_page_reads_back_bit_exact_after_device_host_store_device(
    attention, own_allocator
):
    k, v = engine_tensors(attention)
    pool = DeviceKVPool.from_tensors(
        k, v, page_size=PS, kv_lora_rank=8 if attention == "mla" else None
    )
    allocator = EngineAllocator(PAGES * PS, PS) if own_allocator else None
    cache = make(pool, allocator)
    assert cache.pool is pool and cache.config.pool == pool.config
    parts = layer_parts(k, v)
    tokens = np.arange(
        1000, 1000 + 10 * PS + 2
    )  # 10 whole pages and 2 tokens of an 11th
    got = acquire(cache, tokens, "a")  # the store is asked first: it holds nothing yet
    assert got.indices.numel() == 0
    mine = cache.alloc(len(tokens))
    assert (
        mine.numel() == 11 * PS
    )  # whole pages: the request owns the tail of the last one
    fill_random(parts, mine[: len(tokens)], seed=1)
    want = read_bytes(parts, mine[: 10 * PS])  # what the cache keeps: the whole pages
    cache.cache_finished("a", tokens, mine)
    cache.drain()  # written through to host, backed up to the store
    assert cache.stats()["counters"]["l3_write_pages"] == 10
    cache.flush()  # device and host dropped: only the store holds the pages
    for layer in parts:
        for t in layer:
            t.view(torch.uint8).fill_(
                0xAB
            )  # nothing left on device to read by accident
    got = acquire(
        cache, tokens, "b"
    )  # a prefetch from the store, then a load to device
    assert got.storage_hit == 10 * PS and got.indices.numel() == 10 * PS
    waiter = cache.begin_forward(["b"])
    for layer in range(LAYERS):
        waiter.wait_layer(layer)
    assert waiter.failed() == []
    back = read_bytes(parts, got.indices)
    for want_layer, back_layer in zip(want, back):
        for a, b in zip(want_layer, back_layer):
            assert torch.equal(a, b)
    cache.abort("b", got.indices)
    cache.check_accounting()
    cache.tree.sanity_check()
    cache.close()
    if own_allocator:
        assert (
            allocator.available_size() == PAGES * PS
        )  # every slot back in the engine's allocator


def test_an_allocator_of_another_geometry_is_refused():
    k, v = engine_tensors("mha")
    pool = DeviceKVPool.from_tensors(k, v, page_size=PS)
    with pytest.raises(
        ValueError,
        match=r"device_allocator: size 32, page_size 4; the pool has size 64, page_size 4",
    ):
        make(pool, EngineAllocator(32, PS))
