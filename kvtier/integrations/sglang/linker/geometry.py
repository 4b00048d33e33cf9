"""What names the linker's pages in the store: kvtier's pool over SGLang's device KV
tensors, and the geometry of its pages (`integrations/stack.py` makes the namespace).
Imports no SGLang: it reads SGLang's objects by their attribute names."""

from __future__ import annotations

from kvtier.config import KvtierConfig
from kvtier.errors import KvtierConfigError
from kvtier.integrations.stack import Geometry
from kvtier.tiers.pool import DeviceKVPool


def pool_over(kvcache, page_size: int) -> tuple[DeviceKVPool, bool]:
    """kvtier's pool over SGLang's own per-layer tensors (no copy), and whether it is MLA."""
    if (
        getattr(kvcache, "k_buffer", None) is not None
        and getattr(kvcache, "v_buffer", None) is not None
    ):
        return DeviceKVPool.from_tensors(
            kvcache.k_buffer, kvcache.v_buffer, page_size=page_size
        ), False
    if getattr(kvcache, "kv_buffer", None) is not None and hasattr(
        kvcache, "kv_lora_rank"
    ):
        return DeviceKVPool.from_tensors(
            kvcache.kv_buffer, page_size=page_size, kv_lora_rank=kvcache.kv_lora_rank
        ), True
    raise NotImplementedError(
        f"kvtier linker: SGLang KV pool {type(kvcache).__name__} is not supported "
        "(MHATokenToKVPool and MLATokenToKVPool are)"
    )


def store_group(config: KvtierConfig, page_size: int) -> int:
    """Engine pages in one store page (`store.page_tokens`, store_pages.py): 1 without
    the key, and where SGLang's page is as large or larger (a store page is never less
    than one engine page); a multiple of SGLang's page size otherwise."""
    tokens = config.store.page_tokens
    if tokens is None or tokens <= page_size:
        return 1
    if tokens % page_size:
        origin = config.sources.get("store.page_tokens", "default")
        raise KvtierConfigError(
            f"store.page_tokens={tokens!r}: must be a multiple of SGLang's page size "
            f"{page_size} (--page-size), or at most it ({origin})"
        )
    return tokens // page_size


def geometry_of(
    config: KvtierConfig,
    server_args,
    params,
    pool: DeviceKVPool,
    mla: bool,
    kv_cache_dtype: str | None,
    rank: int,
    size: int,
) -> Geometry:
    """What changes a page's bytes: model, KV dtype, geometry and host layout, page size,
    PP/CP shard, TP rank/size (MLA: one namespace for every rank)."""
    pc = pool.config
    dtype = pc.dtype
    kv_cache_dtype = kv_cache_dtype or getattr(server_args, "kv_cache_dtype", None)
    if kv_cache_dtype and kv_cache_dtype != "auto":
        dtype = f"{dtype}/{kv_cache_dtype}"
    widths = ",".join(map(str, pc.part_widths))
    layout = (
        f"sglang-linker-{'mla' if mla else 'mha'}:layers={pc.num_layers}:widths={widths}"
        f":host={config.mirror.layout}:pp={params.pp_rank}/{params.pp_size}"
        f":cp={params.attn_cp_rank}/{params.attn_cp_size}"
    )
    rank, size = (0, 1) if mla else (rank, size)
    model = getattr(server_args, "model_path", None) or None
    return Geometry(dtype, layout, pc.page_size, rank, size, model)
