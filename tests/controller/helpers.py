"""Small caches on CPU, and stores that fail on purpose (real Store subclasses, not mocks)."""

from __future__ import annotations

import asyncio
import itertools

import torch

from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.cache import TieredCache
from kvtier.config import load_config


def make_cache(
    tmp_path=None,
    store: str = "memory",
    pool_size: int = 64,
    page_size: int = 4,
    ratio: float = 2.0,
    layout: str = "page_first",
    write_policy: str = "write_through",
    prefetch_policy: str = "wait_complete",
    store_obj=None,
    tp_group=None,
    stream_factory=None,
    agreement=None,
    clock=None,
    page_tokens: int | None = None,
    **controller,
) -> TieredCache:
    store_section = {"backend": store, "page_tokens": page_tokens}
    if store == "file":
        store_section["root"] = str(tmp_path / "l3")
    overrides = {
        "pool": {
            "size": pool_size,
            "num_layers": 2,
            "page_size": page_size,
            "num_kv_heads": 2,
            "head_dim": 4,
            "dtype": "float32",
        },
        "mirror": {"ratio": ratio, "layout": layout},
        "controller": {
            "write_policy": write_policy,
            "prefetch_policy": prefetch_policy,
            **controller,
        },
        "store": store_section,
    }
    extra = {} if stream_factory is None else {"stream_factory": stream_factory}
    if clock is not None:
        extra["clock"] = clock
    return TieredCache(
        load_config(None, overrides, env={}),
        tp_group=tp_group,
        store=store_obj,
        agreement=agreement,
        **extra,
    )


def fill(
    cache: TieredCache, slots: torch.Tensor, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Write deterministic KV at `slots` (what a forward would do); return it per layer."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(cache.pool.num_layers):
        k = torch.randn(slots.numel(), 2, 4, generator=g)
        v = torch.randn(slots.numel(), 2, 4, generator=g)
        cache.pool.set_kv(layer, slots, k, v)
        out.append((k, v))
    return out


def read(
    cache: TieredCache, slots: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (cache.pool.k_buffer(l)[slots].clone(), cache.pool.v_buffer(l)[slots].clone())
        for l in range(cache.pool.num_layers)
    ]


def same_kv(a, b) -> bool:
    return all(
        torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(a, b)
    )


def settle(cache: TieredCache) -> None:
    """Let every background op finish and apply it."""
    cache.drain()


_ids = itertools.count()


def acquire(cache: TieredCache, tokens, rid: str):
    """Acquire as a server does: a request that must wait polls until it is named ready."""
    got = cache.acquire(tokens, rid)
    while not got.ready:
        if rid in cache.poll():
            got = cache.acquire(tokens, rid)
        else:
            cache.wait_progress(0.01)
    return got


def forward(cache: TieredCache, *request_ids: str) -> None:
    """What a forward does before reading the prefix: wait for every layer's load."""
    waiter = cache.begin_forward(request_ids or None)
    for layer in range(cache.pool.num_layers):
        waiter.wait_layer(layer)


def compute(cache: TieredCache, tokens, seed: int, rid: str | None = None):
    """One request through the embedding sequence: acquire, compute the uncached rest,
    finish. Returns the KV it wrote for the tokens it computed."""
    rid = rid or f"compute-{next(_ids)}"
    got = acquire(cache, tokens, rid)
    cached = got.indices.numel()
    new = cache.alloc(len(tokens) - cached)
    assert new is not None, "pool too small for the test"
    forward(cache, rid)
    kv = fill(cache, new, seed)
    cache.cache_finished(rid, tokens, torch.cat([got.indices, new]))
    return kv


class FailingStore(MemoryStore):
    """A memory store whose reads fail the way a dead server does."""

    async def _get(self, keys):
        raise ConnectionResetError("connection reset by peer")

    async def _get_into(self, keys, parsed, views):
        raise ConnectionResetError("connection reset by peer")


class CorruptingStore(MemoryStore):
    """Serves page number `bad_page` (0-based, per batch position in the key list) damaged."""

    def __init__(self, bad_key_index: int) -> None:
        super().__init__(MemoryStoreConfig())
        self.bad = bad_key_index
        self.order: list[str] = []

    async def _set(self, keys, frames):
        self.order += [k for k in keys if k not in self.order]
        return await super()._set(keys, frames)

    async def _get(self, keys):
        blobs = await super()._get(keys)
        out = []
        for k, b in zip(keys, blobs):
            if b is not None and k in self.order and self.order.index(k) == self.bad:
                b = bytearray(b)
                b[-1] ^= 0xFF
                b = bytes(b)
            out.append(b)
        return out


class StallingStore(MemoryStore):
    """Reads after the first `fast_reads` batches stall for `stall_s` seconds."""

    def __init__(self, fast_reads: int, stall_s: float) -> None:
        super().__init__(MemoryStoreConfig())
        self.fast_reads = fast_reads
        self.stall_s = stall_s
        self.reads = 0

    async def _get(self, keys):
        self.reads += 1
        if self.reads > self.fast_reads:
            await asyncio.sleep(self.stall_s)
        return await super()._get(keys)


def read_back(cache, tokens, rid):
    """A request over `tokens`: acquire, wait for its loads, read its prefix, finish it.
    Returns (what acquire said, the KV the forward read)."""
    got = acquire(cache, tokens, rid)
    forward(cache)
    kv = read(cache, got.indices)
    cache.cache_finished(
        rid, tokens[: got.indices.numel()], got.indices
    )  # nothing computed
    return got, kv
