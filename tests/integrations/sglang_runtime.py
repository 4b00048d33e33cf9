"""Load SGLang 0.5.23's real HiCache classes without its runtime.

`pip install --no-deps sglang==0.5.23` puts the package on disk, but importing it runs
package `__init__`s that need SGLang's full runtime (and a torch of its own). This loads
only the files the adapter meets, by their real module names:

- `sglang/srt/mem_cache/hicache_storage.py` (HiCacheStorage, HiCacheStorageConfig),
- `sglang/srt/mem_cache/storage/backend_factory.py` (the `dynamic` loader SGLang uses),
- `sglang/srt/mem_cache/pool_host/{base,common,mha,mla}.py` (the host pools) and
  `storage/mmap/mmap_allocator.py` (their allocator), `sglang/srt/environ.py`.

Package `__init__`s are replaced by bare packages over the real directories, and modules
that only GPU transfer paths use (kernels, device pool info, platform probes) by stubs
whose names are inert. `make_mha_pool` / `make_mla_pool` build real host pools through
`HostKVCache.__init__` (its real allocation, `alloc`, `free`); only the device-pointer
tables for GPU transfers are skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import torch

VERSION = "0.5.23"

_PACKAGES = (
    "sglang",
    "sglang.srt",
    "sglang.srt.mem_cache",
    "sglang.srt.mem_cache.pool_host",
    "sglang.srt.mem_cache.storage",
)
_STUBS = (
    "sglang.srt.utils",
    "sglang.srt.runtime_context",
    "sglang.srt.mem_cache.host_memory",
    "sglang.srt.platforms",
    "sglang.kernels",
    "sglang.kernels.ops",
    "sglang.kernels.ops.kvcache",
    "sglang.kernels.ops.kvcache.hicache",
    "sglang.srt.mem_cache.device_pool_info",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.hisparse",
    "sglang.srt.mem_cache.pool_host.page_unified",
    "sglang.srt.mem_cache.pool_host.npu_memfabric",
    "sglang.srt.layers",
    "sglang.srt.layers.dcp",
    "sglang.srt.layers.dcp.layout",
)


class _Stub(types.ModuleType):
    """A module whose every name is inert: `is_*` probes say False, others are empty classes."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = (
            (lambda *a, **k: False)
            if name.startswith("is_")
            else type(
                name,
                (),
                {
                    "__init__": lambda self, *a, **k: None,
                    "__init_subclass__": classmethod(lambda cls, **k: None),
                },
            )
        )
        setattr(self, name, value)
        return value


class Missing(Exception):
    pass


def load() -> types.SimpleNamespace:
    """The real modules, loaded once per process. Raises Missing when SGLang is absent."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise Missing(
            f"SGLang is not installed: pip install --no-deps sglang=={VERSION}"
        )
    root = list(spec.submodule_search_locations)[0]
    from importlib.metadata import version

    if version("sglang") != VERSION:
        raise Missing(f"these tests pin SGLang {VERSION}; found {version('sglang')}")
    if not isinstance(sys.modules.get("sglang"), types.ModuleType) or not getattr(
        sys.modules["sglang"], "_kvtier_bare", False
    ):
        for name in _PACKAGES:
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.join(root, *name.split(".")[1:])]
            pkg._kvtier_bare = True
            sys.modules[name] = pkg
        for name in _STUBS:
            sys.modules[name] = _Stub(name)
        sys.modules["sglang.srt.mem_cache.host_memory"].available_host_memory_bytes = (
            lambda *a, **k: 1 << 40
        )
        if importlib.util.find_spec("msgspec") is None:
            sys.modules["msgspec"] = _Stub("msgspec")
    mods = {
        "hicache_storage": "sglang.srt.mem_cache.hicache_storage",
        "backend_factory": "sglang.srt.mem_cache.storage.backend_factory",
        "base": "sglang.srt.mem_cache.pool_host.base",
        "mha": "sglang.srt.mem_cache.pool_host.mha",
        "mla": "sglang.srt.mem_cache.pool_host.mla",
    }
    return types.SimpleNamespace(
        **{k: importlib.import_module(v) for k, v in mods.items()}
    )


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
