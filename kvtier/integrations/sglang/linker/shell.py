"""`KvtierLinker`: SGLang 0.5.23's `UnifiedCacheLinker` over kvtier's `LinkerCore`.

The one place that imports SGLang (from `kvtier.integrations.sglang.linker.__getattr__`).
SGLang builds it in the cache-owning worker as `KvtierLinker(server_args, params, *,
components, extra_config, forward_stream)` and attaches it with `init_cache_linker`;
`pools`, `layer_done_counter` and `forward_stream` are the attributes SGLang reads.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from typing_extensions import override

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

from kvtier.config import load_config
from kvtier.errors import KvtierConfigError
from kvtier.integrations.observe import linker_series, sglang_export, startup_line
from kvtier.integrations.sglang.linker.core import LinkerCore, LinkerSettings
from kvtier.integrations.sglang.linker.geometry import (
    geometry_of,
    pool_over,
    store_group,
)
from kvtier.integrations.sglang.linker.hybrid import kv_geometry, plan_of, side_cores
from kvtier.integrations.sglang.linker.pools import KV, Side
from kvtier.integrations.stack import build_stack

log = logging.getLogger(__name__)
EXTRA_KEYS = ("kvtier_config", "kv_cache_dtype")


def parse_extra(extra: Any) -> dict:
    """`linker_extra_config`: `kvtier_config` (a YAML path or a shipped config's name),
    optional `kv_cache_dtype` (SGLang's --kv-cache-dtype when not in the server args)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise KvtierConfigError(
            f"linker_extra_config: unknown keys {unknown}; allowed: {', '.join(EXTRA_KEYS)}"
        )
    path = extra.get("kvtier_config")
    if not isinstance(path, str) or not path:
        raise KvtierConfigError(
            f"linker_extra_config.kvtier_config={path!r}: give a kvtier YAML path or a "
            "shipped config name (default, redis, s3, ...; docs/sglang.md)"
        )
    dtype = extra.get("kv_cache_dtype")
    if dtype is not None and (not isinstance(dtype, str) or not dtype):
        raise KvtierConfigError(
            f"linker_extra_config.kv_cache_dtype={dtype!r}: expected SGLang's --kv-cache-dtype "
            "value, e.g. 'fp8_e4m3'"
        )
    return extra


def tp_of(params) -> tuple[int, int]:
    group = params.attn_tp_cache_group or params.tp_cache_group
    if group is None or not (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    ):
        return 0, 1
    return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(
        group=group
    )


def _kv(transfers: list[PoolTransfer]) -> PoolTransfer:
    names = [t.name for t in transfers]
    if names != [PoolName.KV]:
        raise ValueError(
            f"kvtier linker: transfers for pools {[str(n) for n in names]}; it restores the KV "
            "pool only (Full attention)"
        )
    return transfers[0]


def _parts(transfers: list[PoolTransfer]) -> tuple[Side, dict[str, Side]]:
    """A hybrid model's transfers: the KV pool's, and each side pool's by name."""
    parts: dict[str, Side] = {}
    for t in transfers:
        name = getattr(t.name, "value", t.name)
        if name in parts:
            raise ValueError(f"kvtier linker: two transfers for pool {name!r}")
        slots = t.device_indices
        parts[name] = Side(
            list(t.keys or []), None if slots is None else slots.to(torch.int64)
        )
    kv = parts.pop(KV, None)
    if kv is None:
        raise ValueError(
            f"kvtier linker: transfers for pools {sorted(parts)} without the KV pool's"
        )
    return kv, parts


LENGTHS = 16  # restorable lengths a lookup names besides its longest


def restorable(pages: int, asked: int) -> list[int]:
    """The restorable prefix lengths a lookup answers: `pages`, and the multiples below it
    of a stride set by how many pages were asked about (the same on every rank). SGLang
    intersects the ranks' sets, so ranks that found different lengths still agree on one
    less than a stride short of the shorter; and it marks each length in a mask one
    tensor write at a time, so a long tail at page 1 named every length for ~2 µs each."""
    if pages <= 0:
        return []
    stride = -(-asked // LENGTHS)
    return [*range(stride, pages, stride), pages]


def thinned(lengths: list[int], asked: int) -> list[int]:
    """A hybrid model's restorable lengths (sparse: where every pool can restore), as
    `restorable` names a Full model's: the longest, and those below it on the same stride
    (the same on every rank, so the ranks' sets still meet there). A set of at most
    `LENGTHS + 1` is named whole: sparse lengths (Mamba's node ends) seldom fall on the
    stride, and two ranks' thinned sets could miss a length both hold."""
    if len(lengths) <= LENGTHS + 1:
        return list(lengths)
    stride, last = -(-asked // LENGTHS), lengths[-1]
    return [p for p in lengths[:-1] if p % stride == 0] + [last]


class KvtierLinker(UnifiedCacheLinker):
    """kvtier's host tier and stores below SGLang's radix tree and device pool."""

    def __init__(
        self, server_args, params, *, components, extra_config=None, forward_stream=None
    ) -> None:
        extra = parse_extra(extra_config)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        plan = plan_of(  # None for a Full-only model (hybrid.py)
            kvcache,
            params.req_to_token_pool,
            {ComponentType(c).name.lower() for c in components},
            params.page_size,
            getattr(params, "sliding_window_size", None),
        )
        config = load_config(extra["kvtier_config"])
        if config.mirror is None:
            raise KvtierConfigError(
                f"mirror: null in {extra['kvtier_config']}: the linker's host tier needs a "
                "mirror section (ratio or size_bytes)"
            )
        pool, mla = pool_over(kvcache if plan is None else plan.full, params.page_size)
        group = store_group(config, params.page_size)
        # the linker groups engine pages itself (store_pages.py): its store keys carry the
        # group, so the namespace stays that of one engine page per store page
        config = replace(config, store=replace(config.store, page_tokens=None))
        rank, size = tp_of(params)
        geometry = geometry_of(
            config,
            server_args,
            params,
            pool,
            mla,
            extra.get("kv_cache_dtype"),
            rank,
            size,
        )
        if plan is not None:
            geometry = kv_geometry(geometry, plan)
        # the store's calls run on the core's storage worker, which takes the breaker's config
        stack = build_stack(
            config=config,
            geometry=geometry,
            who="the SGLang linker",
            store_required=False,
        )
        ns, store, c = stack.namespace, stack.store, config.controller
        settings = LinkerSettings(
            ns,
            stack.key_prefix,
            config.mirror,
            stack.breaker_config,
            writes_store=not mla or rank == 0,
            max_inflight_bytes=c.max_inflight_prefetch_bytes,
            cpus=stack.cpus,
            keyed_hash=stack.keyed,
            store_group=group,
        )
        kv_core = LinkerCore(pool, settings, store, forward_stream=forward_stream)
        self.core = kv_core
        try:  # a failure from here closes every core built so far (their threads joined)
            self.pools = {PoolName.KV: pool}
            self.hybrid = plan is not None
            if plan is not None:  # a core per side pool beside the KV's (pools.py)
                shard = f"pp={params.pp_rank}/{params.pp_size}:cp={params.attn_cp_rank}/{params.attn_cp_size}"
                self.core = side_cores(
                    kv_core,
                    plan,
                    config,
                    geometry,
                    settings,
                    (rank, size),
                    shard,
                    forward_stream,
                )
                self.pools.update({PoolName(s.name): s.pool for s in plan.sides})
            self.layer_done_counter = self.core.counter
            if PoolName.MAMBA in self.pools:  # Mamba layers wait on the request pool
                params.req_to_token_pool.register_layer_transfer_counter(
                    self.core.counter
                )
            self.forward_stream = forward_stream
            host = f"{kv_core.mirror.allocator.num_pages} pages x {kv_core.mirror.page_bytes} B"
            tiers = f"SGLang device -> kvtier host ({host}, {config.mirror.layout})"
            if plan is not None:
                tiers += "; " + ", ".join(
                    f"{n} pool: {c.mirror.allocator.num_pages} pages x {c.mirror.page_bytes} B"
                    for n, c in self.core.cores.items()
                    if n != KV
                )
            if store is not None:
                tiers += f" -> kvtier store {store.name}"
                if group > 1:
                    tiers += f" (store pages of {group} engine pages on average)"
            log.info(
                startup_line(
                    "SGLang linker",
                    config,
                    ns.id,
                    stack.tenant.key_id,
                    f"{tiers}; tp {rank}/{size}",
                )
            )
            self._export = sglang_export(  # kvtier's counters in SGLang's /metrics
                lambda: linker_series(self.stats()),
                {"tp_rank": str(rank), "namespace": ns.id},
            )
        except BaseException:
            self.core.close()  # the KV core, or every pool's once side_cores returned
            raise

    @override
    def record_offload_ready(self) -> list:
        return []  # the core orders its copy after the forward stream itself

    @override
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        if self.hybrid:
            kv, sides = _parts(transfers)
            windows = {name: len(side.keys) for name, side in sides.items()}
            return thinned(self.core.lookup(rid, kv.keys, windows), len(kv.keys))
        keys = list(_kv(transfers).keys or [])
        return restorable(self.core.lookup(rid, keys), len(keys))

    @override
    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        if self.hybrid:
            return self.core.load(rid, *_parts(transfers))
        kv = _kv(transfers)
        return self.core.load(rid, list(kv.keys or []), kv.device_indices)

    @override
    def start_layer_wise_loading(self) -> int:
        return self.core.start_layer_wise_loading()

    @override
    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.core.finish_layer_wise_loading(counter_index)

    @override
    def cancel_queued_load(self, rid: str) -> bool:
        return self.core.cancel_queued_load(rid)

    @override
    def offload(
        self, transfers: list[PoolTransfer], session_id: str | None = None
    ) -> bool:
        if self.hybrid:
            return self.core.offload(*_parts(transfers))
        kv = _kv(transfers)
        return self.core.offload(list(kv.keys or []), kv.device_indices)

    @override
    def num_completed_offloads(self) -> int:
        if self._export is not None:  # SGLang asks every step, on the scheduler thread
            self._export.tick()
        return self.core.num_completed_offloads()

    @override
    def pop_completed_offload(self) -> bool:
        return self.core.pop_completed_offload()

    @override
    def reset(self) -> None:
        self.core.reset()

    @override
    def close(self) -> None:
        self.core.close()
        if self._export is not None:  # the last numbers reach SGLang's /metrics
            self._export.export()

    def stats(self) -> dict:
        return self.core.stats()
