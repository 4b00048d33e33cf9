"""A hybrid model served through HybridTieredCache as an engine does: acquire -> forward
-> finish or abort, the logits compared with the uncached run."""

from __future__ import annotations

import torch

from kvtier.cache.hybrid import HybridTieredCache
from kvtier.config import load_config
from kvtier.engine.hybrid import HybridChunk, HybridConfig, HybridModel, HybridPools
from kvtier.engine.hybrid import LayerKind
from kvtier.tiers.components import Component

WINDOW = 6
MAX_CONTEXT = 128
KIND = {
    LayerKind.FULL: Component.FULL,
    LayerKind.SWA: Component.SWA,
    LayerKind.RECURRENT: Component.MAMBA,
}


def make_model(layers=None) -> HybridModel:
    kw = {} if layers is None else {"layers": layers}
    return HybridModel(HybridConfig(window=WINDOW, seed=5, **kw))


def make_hybrid(
    model: HybridModel,
    tmp_path=None,
    store: str = "none",
    tokens: int = 96,
    states: int = 12,
    page_size: int = 2,
    ratio: float = 2.0,
    write_policy: str = "write_through",
    **kw,
) -> HybridTieredCache:
    specs = model.component_specs(tokens, states, page_size)
    store_section = {"backend": store}
    if store == "file":
        store_section["root"] = str(tmp_path / "l3")
    overrides = {
        "pool": {"size": tokens, "num_layers": 1, "page_size": page_size},
        "mirror": {"ratio": ratio},
        "controller": {"write_policy": write_policy},
        "store": store_section,
    }
    cache = HybridTieredCache(
        load_config(None, overrides, env={}),
        specs,
        [KIND[k] for k in model.config.layers],
        **kw,
    )
    for c in (Component.FULL, Component.SWA, Component.MAMBA):
        if c in specs:  # padding slot 0: NaN, so that reading it shows in every logit
            for part in cache.component_pool(c).parts:
                part[:, 0] = float("nan")
    return cache


def seq(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g)


class Served:
    """One request's acquire and forward; `finish` or `abort` it."""

    def __init__(self, cache: HybridTieredCache, model: HybridModel, tokens, rid: str):
        self.cache, self.model, self.tokens, self.rid = cache, model, tokens, rid
        self.got = got = acquire(cache, tokens, rid)
        L, n = len(got.indices), len(tokens) - len(got.indices)
        assert n > 0, "the test leaves at least one token to compute"
        self.length = L
        ps = cache.page_size
        self.full = _alloc(cache, cache.alloc, n)
        swa_pool = Component.SWA in cache.side
        self.swa = (
            _alloc(cache, cache.alloc_swa, n)
            if swa_pool
            else torch.zeros(n, dtype=torch.int64)
        )
        self.aligned = len(tokens) - len(tokens) % ps
        has_state = Component.MAMBA in cache.side
        self.snap = cache.alloc_state(rid) if has_state and self.aligned > L else None
        full_rows = torch.zeros(1, MAX_CONTEXT, dtype=torch.int64)
        swa_rows = torch.zeros(1, MAX_CONTEXT, dtype=torch.int64)
        full_rows[0, :L] = got.indices
        full_rows[0, L : len(tokens)] = self.full[:n]
        if swa_pool:
            swa_rows[0, got.swa_start : L] = got.swa_indices
            swa_rows[0, L : len(tokens)] = self.swa[:n]
        state_pool = (
            cache.component_pool(Component.MAMBA) if has_state else _dummy_state(model)
        )
        pools = HybridPools(
            cache.pool,
            cache.component_pool(Component.SWA) if swa_pool else _dummy_swa(model),
            state_pool,
            full_rows,
            swa_rows,
        )
        snaps = () if self.snap is None else ((self.aligned, self.snap),)
        state_slot = got.state_slot if has_state else 1
        chunk = HybridChunk(
            0, L, tokens[L:], self.full[:n], self.swa[:n], state_slot, snaps
        )
        waiter = cache.begin_forward([rid])
        (self.logits,) = model.forward_cached([chunk], pools, waiter.wait_layer)
        self.failed = waiter.failed()

    def kv_row(self) -> torch.Tensor:
        return torch.cat([self.got.indices, self.full])

    def swa_row(self):
        if Component.SWA not in self.cache.side:
            return None
        return torch.cat([self.got.swa_indices, self.swa])

    def finish(self) -> None:
        self.cache.cache_finished(
            self.rid,
            self.tokens.tolist(),
            self.kv_row(),
            swa_indices=self.swa_row(),
            mamba_slot=self.snap,
        )

    def abort(self) -> None:
        self.cache.abort(self.rid, self.kv_row(), swa_indices=self.swa_row())


def acquire(cache: HybridTieredCache, tokens, rid: str):
    """`acquire` as a scheduler runs it: while a store prefetch is in flight the request
    waits, polled until a poll names it, then acquired again."""
    got = cache.acquire(tokens.tolist(), rid)
    for _ in range(10_000):
        if got.ready:
            return got
        if rid in cache.poll():
            got = cache.acquire(tokens.tolist(), rid)
        else:
            cache.wait_progress(0.01)
    raise AssertionError(f"{rid} was never named ready")


def _alloc(cache, alloc, n):
    """As a server short of room does: apply what finished (writes lock pages), retry."""
    got = alloc(n)
    if got is None:
        cache.drain()
        got = alloc(n)
    assert got is not None, "the test's pools are too small"
    return got


def _dummy_swa(model):
    from kvtier.tiers.pool import DeviceKVPool, PoolConfig

    c = model.config
    return DeviceKVPool(
        PoolConfig(
            size=2,
            num_layers=1,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype="float32",
        )
    )


def _dummy_state(model):
    from kvtier.tiers.pool import DeviceKVPool, StatePoolConfig

    c = model.config
    return DeviceKVPool(
        StatePoolConfig(size=2, num_layers=1, state_shape=c.state_shape)
    )


def check(cache: HybridTieredCache) -> None:
    cache.tree.sanity_check()
    cache.check_accounting()
