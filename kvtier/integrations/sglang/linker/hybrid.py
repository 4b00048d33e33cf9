"""What SGLang hands a hybrid model's linker, read by attribute names (no SGLang import):
the Full, SWA and Mamba device pools, which pool owns each model layer, and the name of
each pool's pages in the store.

- (FULL, SWA): `SWAKVPool`, whose `full_kv_pool` and `swa_kv_pool` are MHA pools and
  whose `layers_mapping` gives each model layer's (pool layer, is SWA); the SWA pool is
  indexed by its own slots (`full_to_swa_index_mapping`), which SGLang's SWA transfers
  carry.
- (FULL, MAMBA): `HybridLinearKVPool` (`full_kv_pool`, `full_attention_layer_id_mapping`)
  and the request pool's `MambaPool` (`mamba_cache.temporal`, `.conv`; `mamba_map`): a
  state slot holds every Mamba layer's temporal and conv states.

Every pool's namespace names the whole model's signature (each pool's buffers, dtypes and
per-slot shapes, and the sliding window), so two models that differ in any of them never
share a page of any pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvtier.integrations.sglang.linker.core import LinkerCore, LinkerSettings
from kvtier.integrations.sglang.linker.pools import KV, PoolCores, StateRows, describe
from kvtier.integrations.stack import Geometry, build_stack
from kvtier.tiers.pool import DeviceKVPool

SIDES = ("swa", "mamba")


@dataclass(slots=True)
class SidePool:
    name: str
    pool: DeviceKVPool
    tensors: list[
        torch.Tensor
    ]  # SGLang's buffers of one layer (what a slot's bytes are)
    page_size: int
    restore_pages: int | None  # the pages ending at a length a restore there needs


@dataclass(slots=True)
class HybridPlan:
    full: object  # SGLang's Full-attention KV pool
    owner: dict[int, tuple[str, int]]  # model layer -> (pool, its layer)
    sides: list[SidePool] = field(default_factory=list)
    signature: str = ""


def plan_of(kvcache, req_to_token_pool, components: set[str], page_size: int, window):
    """The pools of a hybrid model's caches; None for a Full-only one."""
    unknown = sorted(components - {"full", *SIDES})
    if unknown:
        raise ValueError(
            f"kvtier linker: tree components {unknown} are not supported (full, swa and "
            "mamba are)"
        )
    if components <= {"full"}:
        return None
    start = int(getattr(kvcache, "start_layer", 0) or 0)
    plan = HybridPlan(getattr(kvcache, "full_kv_pool", None), {})
    if plan.full is None:
        raise NotImplementedError(
            f"kvtier linker: SGLang KV pool {type(kvcache).__name__} has no full_kv_pool "
            "(SWAKVPool and HybridLinearKVPool have)"
        )
    if "swa" in components:
        swa = kvcache.swa_kv_pool
        for g, (local, is_swa) in kvcache.layers_mapping.items():
            plan.owner[g - start] = ("swa" if is_swa else KV, local)
        pool = DeviceKVPool.from_tensors(
            swa.k_buffer, swa.v_buffer, page_size=page_size
        )
        plan.sides.append(
            SidePool(
                "swa",
                pool,
                [swa.k_buffer[0], swa.v_buffer[0]],
                page_size,
                -(-window // page_size) if window else None,  # SGLang's window pages
            )
        )
    else:
        for g, local in kvcache.full_attention_layer_id_mapping.items():
            plan.owner[g - start] = (KV, local)
    if "mamba" in components:
        _refuse_unmoved_states(req_to_token_pool)
        cache = req_to_token_pool.mamba_pool.mamba_cache
        layers = [
            [cache.temporal[i], *(c[i] for c in cache.conv)]
            for i in range(cache.temporal.shape[0])
        ]
        for g, local in req_to_token_pool.mamba_map.items():
            plan.owner[g - start] = ("mamba", local)
        plan.sides.append(SidePool("mamba", StateRows(layers), layers[0], 1, 1))
    buffers = getattr(plan.full, "k_buffer", None) or plan.full.kv_buffer  # MHA, MLA
    full = [buffers[0]]
    sig = ";".join(
        [f"kv[{describe(full)}]"]
        + [
            f"{s.name}[layers={s.pool.num_layers}:{describe(s.tensors)}]"
            for s in plan.sides
        ]
    )
    plan.signature = sig + (f";window={window}" if "swa" in components else "")
    return plan


def _refuse_unmoved_states(req_to_token_pool) -> None:
    """A Mamba request pool whose cached states are not the `mamba_cache` rows the tree's
    slots name: with SGLang's int8 checkpoints a node's state is a slot of the checkpoint
    pool, so reading the active pool at that number would store another request's state;
    PLE side states (short conv, n-gram context) ride on the slot and would not be
    restored with it. Under SGLang's unified memory pool the tree's Mamba values are
    virtual slot ids (the pool's `mamba_v2p_table` maps them to physical rows) and the
    states strided views of one shared buffer, which the linker cannot read as rows."""
    if getattr(req_to_token_pool, "mamba_v2p_table", None) is not None:
        raise ValueError(
            "kvtier linker: the Mamba pool is SGLang's unified memory pool "
            "(--enable-unified-memory is on): the tree's Mamba values are virtual "
            "slot ids into one shared buffer, and the linker moves the rows of a "
            "plain Mamba pool only; run without --enable-unified-memory (off is the "
            "only setting allowed)"
        )
    if getattr(req_to_token_pool, "mamba_ckpt_pool", None) is not None:
        raise ValueError(
            "kvtier linker: mamba_ckpt_pool is set (SGLang's "
            "--enable-int8-mamba-checkpoint): the tree's Mamba states are int8 "
            "checkpoint slots, and the linker moves the active pool's states only; "
            "run without that flag"
        )
    side = [
        name
        for name in ("short_conv_pool", "ngram_pool")
        if getattr(getattr(req_to_token_pool, name, None), "enabled", False)
    ]
    if side:
        raise ValueError(
            f"kvtier linker: Mamba side states {side} are enabled: the linker moves "
            "each slot's temporal and conv states only (none of them is allowed)"
        )


def kv_geometry(geometry: Geometry, plan: HybridPlan) -> Geometry:
    """The KV pool's geometry in a hybrid model: its own, and the model's signature."""
    return replace(geometry, layout=f"{geometry.layout}:hybrid={plan.signature}")


def side_cores(
    kv: LinkerCore,
    plan: HybridPlan,
    config,
    geometry: Geometry,
    settings: LinkerSettings,
    tp: tuple[int, int],
    shard: str,
    forward_stream=None,
) -> PoolCores:
    """A core per side pool over the KV core: each its own store stack (namespace
    `sglang-linker-pool=<name>:...`), split over TP ranks (SWA heads and Mamba states are,
    even where the KV is MLA), its host tier in the KV's ratio of host to device pages,
    writing its own pages."""
    cores = {KV: kv}
    ratio = kv.mirror.allocator.num_pages * kv.page_size / kv.pool.config.size
    mirror = replace(settings.mirror, ratio=ratio, size_bytes=None)
    try:
        for side in plan.sides:
            g = Geometry(
                "/".join(
                    dict.fromkeys(
                        str(t.dtype).removeprefix("torch.") for t in side.tensors
                    )
                ),
                f"sglang-linker-pool={side.name}:layers={side.pool.num_layers}:"
                f"{describe(side.tensors)}:host={settings.mirror.layout}:{shard}"
                f":hybrid={plan.signature}",
                side.page_size,
                tp[0],
                tp[1],
                geometry.model_id,
            )
            stack = build_stack(
                config=config, geometry=g, who="the SGLang linker", store_required=False
            )
            own = replace(
                settings,
                namespace=stack.namespace,
                mirror=mirror,
                writes_store=True,
                keyed_hash=stack.keyed,
                store_group=1,  # a side pool's pages (windows, states) are stored one a key
            )
            cores[side.name] = LinkerCore(
                side.pool, own, stack.store, forward_stream=forward_stream
            )
    except BaseException:
        for name, core in cores.items():
            if name != KV:
                core.close()
        raise
    return PoolCores(cores, plan.owner, {s.name: s.restore_pages for s in plan.sides})
