"""SGLang 0.5.23's own modules on a machine without its runtime (CPU only, no GPU kernels),
for kvtier's tests and benchmarks: the one loader of them.

`pip install --no-deps sglang==0.5.23` plus its pure-Python imports (requirements-engines.txt)
puts the package on disk; its package `__init__`s import the whole runtime. `load()`
imports each `sglang.*` module under its real name, and one whose own code raises at import
(a GPU kernel probe, a model config that needs torchvision) becomes an inert stub:
`is_*`/`use_*`/`can_*` say False, other names are empty classes. Only `STUBBABLE` may be
stubbed: any other failure (or a stubbed module of `MODULES`) is `Unavailable`, so a module
the code under test needs never silently turns into a stub. SGLang's compiled modules (its
Rust tree core) load through their own loader.

The modules are loaded once per process, under the names of `MODULES`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
import warnings
from typing import Any

from kvtier.integrations.sglang import INSTALL_HINT, SGLANG_VERSION

MODULES = {
    # the HiCache L3 storage backend's seam and SGLang's host pools
    "hicache_storage": "sglang.srt.mem_cache.hicache_storage",
    "backend_factory": "sglang.srt.mem_cache.storage.backend_factory",
    "base": "sglang.srt.mem_cache.pool_host.base",
    "mha": "sglang.srt.mem_cache.pool_host.mha",
    "mla": "sglang.srt.mem_cache.pool_host.mla",
    # the device prefix cache and the scheduler's helpers around it
    "memory_pool": "sglang.srt.mem_cache.memory_pool",
    "allocator": "sglang.srt.mem_cache.allocator",
    "radix_cache": "sglang.srt.mem_cache.radix_cache",
    "cache_init_params": "sglang.srt.mem_cache.cache_init_params",
    "common": "sglang.srt.mem_cache.common",
    "allocation": "sglang.srt.mem_cache.allocation",
    "bpc": "sglang.srt.mem_cache.base_prefix_cache",
    "schedule_batch": "sglang.srt.managers.schedule_batch",
    "sampling_params": "sglang.srt.sampling.sampling_params",
    "server_args": "sglang.srt.server_args",
    "environ": "sglang.srt.environ",
    "runtime_context": "sglang.srt.runtime_context",
    # the unified radix cache, its linker seam and its test kit
    "urc": "sglang.srt.mem_cache.unified_radix_cache",
    "ucl": "sglang.srt.mem_cache.unified_cache.unified_cache_linker",
    "factory": "sglang.srt.mem_cache.unified_cache.linker_factory",
    "component_type": "sglang.srt.mem_cache.unified_cache.component_type",
    "fx": "sglang.test.kits.unified_radix_cache.fixtures",
    "cfg": "sglang.test.kits.unified_radix_cache.config",
}
# what raises at import on a CPU-only machine with SGLang's pure-Python imports installed
STUBBABLE = frozenset(
    {
        "sglang.benchmark.datasets.mmmu",
        "sglang.srt.configs.deepseek_ocr",
        "sglang.srt.multimodal.internvl_utils",
        "sglang.srt.utils.hf_transformers.common",
    }
)


class Unavailable(Exception):
    """SGLang's modules cannot be loaded here; the message says why."""


class _Inert(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name.startswith(("is_", "use_", "can_")):
            value: Any = lambda *a, **k: False
        else:
            value = type(
                name,
                (),
                {
                    "__init__": lambda self, *a, **k: None,
                    "__init_subclass__": classmethod(lambda cls, **k: None),
                },
            )
        object.__setattr__(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader, failed: dict[str, str]) -> None:
        self.real, self.failed = real, failed

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        try:
            self.real.exec_module(module)
        except Exception as exc:  # its own code raised: an inert stub, recorded
            first = str(exc).splitlines()[0][:160] if str(exc) else ""
            self.failed[module.__name__] = f"{type(exc).__name__}: {first}"
            module.__class__ = _Inert


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of every pure-Python `sglang.*` module; a compiled one keeps its
    own (the wrapper cannot create an extension module)."""

    def __init__(self) -> None:
        self.failed: dict[str, str] = {}

    def find_spec(self, name, path, target=None):
        if name != "sglang" and not name.startswith("sglang."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        if not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            spec.loader = _Loader(spec.loader, self.failed)
        return spec


_loaded: types.SimpleNamespace | None = None


def load() -> types.SimpleNamespace:
    """SGLang's modules (attributes named as in `MODULES`), loaded once per process, with
    `stubbed`: the modules that raised at import, sorted. Raises Unavailable."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if importlib.util.find_spec("sglang") is None:
        raise Unavailable(f"sglang is not installed ({INSTALL_HINT})")
    from importlib.metadata import version

    if version("sglang") != SGLANG_VERSION:
        raise Unavailable(
            f"sglang {version('sglang')} is installed; kvtier pins {SGLANG_VERSION}"
        )
    if "sglang" in sys.modules:
        raise Unavailable(
            "sglang was imported in this process without this loader; run this in its own process"
        )
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    quiet = [logging.getLogger(n) for n in ("sglang", "vllm")]
    levels = [lg.level for lg in quiet]
    try:
        for lg in quiet:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mods = {k: importlib.import_module(v) for k, v in MODULES.items()}
    except ImportError as exc:
        raise Unavailable(
            f"an SGLang import failed ({exc}); .ci/run lists the packages SGLang needs here"
        ) from exc
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    bad = sorted(set(finder.failed) - STUBBABLE) or sorted(
        set(finder.failed) & set(MODULES.values())
    )
    if bad:
        first = [f"{k}: {finder.failed[k]}" for k in bad[:3]]
        raise Unavailable(
            f"{len(bad)} SGLang modules failed to import, e.g. " + "; ".join(first)
        )
    mods["fx"].get_device = lambda *a, **k: (
        "cpu"
    )  # 0.5.23's raises without an accelerator
    _loaded = types.SimpleNamespace(**mods, stubbed=sorted(finder.failed))
    return _loaded
