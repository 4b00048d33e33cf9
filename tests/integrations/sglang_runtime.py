"""SGLang 0.5.23's real host pools for the storage backend's tests, over the modules
kvtier's one SGLang loader gives (`kvtier.testing.sglang_loader.load()`, passed as `sg`).

`make_mha_pool` / `make_mla_pool` build real host pools through `HostKVCache.__init__`
(its real allocation, `alloc`, `free`); only the device-pointer tables for GPU transfers
are skipped.
"""

from __future__ import annotations

import torch


def storage_config(
    sg,
    *,
    model="meta-llama/Llama-3.1-8B",
    mla=False,
    tp_rank=0,
    tp_size=1,
    page_first=True,
    extra=None,
    dp_rank=0,
):
    return sg.hicache_storage.HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        dp_rank=dp_rank,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config=extra,
    )


def _host_init(sg, pool, *, dtype, layers, page_size, pages, layout) -> None:
    sg.base.HostKVCache.__init__(
        pool,
        dtype=dtype,
        device_capacity_tokens=page_size * pages // 2,
        size_per_token=pool.get_size_per_token(),
        start_layer=0,
        end_layer=layers - 1,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=False,
        device="cpu",
        host_token_capacity=page_size * pages,
    )


def make_mha_pool(
    sg,
    layout="page_first",
    *,
    layers=2,
    heads=2,
    head_dim=8,
    page_size=4,
    pages=32,
    dtype=torch.bfloat16,
):
    """A real MHATokenToKVPoolHost (the attributes its __init__ sets before HostKVCache's)."""
    pool = object.__new__(sg.mha.MHATokenToKVPoolHost)
    pool.target_layer_num = pool.layer_num = layers
    pool._transfer_device = torch.device("cpu")
    pool.dtype, pool.head_dim, pool.v_head_dim, pool.head_num = (
        dtype,
        head_dim,
        head_dim,
        heads,
    )
    pool.head_group_num, pool.page_size = 1, page_size
    _host_init(
        sg,
        pool,
        dtype=dtype,
        layers=layers,
        page_size=page_size,
        pages=pages,
        layout=layout,
    )
    return pool


def make_mla_pool(
    sg,
    layout="page_first",
    *,
    layers=2,
    lora=16,
    rope=4,
    page_size=4,
    pages=32,
    dtype=torch.bfloat16,
):
    """A real MLATokenToKVPoolHost (the attributes its __init__ sets before HostKVCache's)."""
    pool = object.__new__(sg.mla.MLATokenToKVPoolHost)
    pool._is_dummy, pool.override_kv_cache_dim, pool.dtype, pool.layout = (
        False,
        None,
        dtype,
        layout,
    )
    pool.kv_lora_rank, pool.qk_rope_head_dim, pool.kv_cache_dim = (
        lora,
        rope,
        lora + rope,
    )
    pool.layer_num = pool.target_layer_num = layers
    pool._size_per_token = (lora + rope) * layers * dtype.itemsize
    pool._transfer_device = torch.device("cpu")
    _host_init(
        sg,
        pool,
        dtype=dtype,
        layers=layers,
        page_size=page_size,
        pages=pages,
        layout=layout,
    )
    return pool
