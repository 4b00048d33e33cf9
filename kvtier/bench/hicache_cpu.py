"""The four CPU stand-ins that let SGLang 0.5.23's HiCache run on a machine without CUDA,
for `kvtier/bench/linker.py` only: the benchmark applies them in its own process, nothing
in kvtier's package does.

Only what has no CPU implementation in 0.5.23 is replaced:

1. `pool_host/common.py: _cuda_host_register` -> no-op (pinning needs an NVIDIA driver).
2. every `transfer_kv_*` kernel of `sgl_kernel.kvcacheio` (imported only on CUDA/ROCm/XPU;
   the Mamba host pool's state copies among them)
   -> a no-op that counts its calls. On a GPU each is one asynchronous launch costing the
   launching thread a few µs; here it is ~0.1 µs and moves no bytes: HiCache's copies are
   free, which favours it (kvtier's copies are real memcpys, on its own threads).
3. `torch.cpu.Stream.synchronize` -> no-op (l2_transfer's error path calls it).
4. after init_hicache, the host pools' `pin_memory` -> False (`unpin`): the L3 -> host
   prefetch allocates scratch pages with `torch.zeros(..., pin_memory=...)`, which CPU
   torch refuses, and every L3 prefetch would fail silently.
"""

from __future__ import annotations

import importlib
from collections import Counter

KERNELS = (
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "transfer_kv_mamba_lf_pf",
    "transfer_kv_mamba_pf_lf",
)
MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.dsa",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.unified",
    "sglang.srt.mem_cache.pool_host.page_unified",
    "sglang.srt.mem_cache.pool_host.hisparse",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.hisparse_memory_pool",
)


class Shims:
    """Installed once per process (`install`); `calls` counts the stubbed kernels' calls."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.installed = False

    def _noop(self, name: str):
        calls = self.calls

        def launch(*args, **kwargs):  # an asynchronous GPU launch, modelled as free
            calls[name] += 1

        launch.__name__ = name
        return launch

    def install(self) -> list[str]:
        """Stand-ins 1-3 (after SGLang's host pool modules can be imported, before a
        HiCache is built); returns 'module.name' of each kernel injected."""
        if self.installed:
            return []
        import torch

        common = importlib.import_module("sglang.srt.mem_cache.pool_host.common")
        common._cuda_host_register = lambda *a, **k: None
        torch.cpu.Stream.synchronize = lambda self: None
        injected = []
        for modname in MODULES:
            try:
                mod = importlib.import_module(modname)
            except Exception:  # a module this build cannot import on CPU
                continue
            for name in KERNELS:
                if not hasattr(mod, name):
                    setattr(mod, name, self._noop(name))
                    injected.append(f"{modname.rsplit('.', 1)[1]}.{name}")
        self.installed = True
        return injected

    @staticmethod
    def unpin(cache_controller) -> int:
        """Stand-in 4: host pools allocate unpinned scratch pages. Returns how many changed."""
        n = 0
        for name in ("mem_pool_host", "storage_host_pool"):
            pool = getattr(cache_controller, name, None)
            # a hybrid model's host pool is a group: one host pool per device pool
            members = [pool] + [e.host_pool for e in getattr(pool, "entries", ())]
            for member in members:
                if member is not None and getattr(member, "pin_memory", False):
                    member.pin_memory = False
                    n += 1
        return n
