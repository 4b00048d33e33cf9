"""Load SGLang 0.5.23's real UnifiedRadixCache, its CPU pools and its test kit on a
CPU-only machine, for the linker tests.

Every `sglang.*` module is imported under its real name; one whose own code raises at
import (a GPU kernel probe, a model config that needs torchvision) becomes an inert stub:
`is_*`/`use_*`/`can_*` say False, other names are empty classes. `STUBBABLE` is the set
that may be stubbed; `load()` fails naming any other (so a module the linker path needs
never silently turns into a stub). `unload()` forgets every sglang module and the finder,
so tests/integrations/sglang_runtime.py (bare packages) can load its own afterwards.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

VERSION = "0.5.23"
STUBBABLE = frozenset(
    {
        "sglang.benchmark.datasets.mmmu",
        "sglang.srt.configs.deepseek_ocr",
        "sglang.srt.multimodal.internvl_utils",
        "sglang.srt.utils.hf_transformers.common",
    }
)
MODULES = {
    "fx": "sglang.test.kits.unified_radix_cache.fixtures",
    "cfg": "sglang.test.kits.unified_radix_cache.config",
    "ucl": "sglang.srt.mem_cache.unified_cache.unified_cache_linker",
    "factory": "sglang.srt.mem_cache.unified_cache.linker_factory",
    "bpc": "sglang.srt.mem_cache.base_prefix_cache",
    "rc": "sglang.srt.mem_cache.radix_cache",
    "memory_pool": "sglang.srt.mem_cache.memory_pool",
    "cip": "sglang.srt.mem_cache.cache_init_params",
    "urc": "sglang.srt.mem_cache.unified_radix_cache",
    "sb": "sglang.srt.managers.schedule_batch",
    "sp": "sglang.srt.sampling.sampling_params",
    "server_args": "sglang.srt.server_args",
}


class Missing(Exception):
    pass


class _Stub(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name.startswith(("is_", "use_", "can_")):
            value = lambda *a, **k: False
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
    def __init__(self, real, stubbed: dict) -> None:
        self.real, self.stubbed = real, stubbed

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        try:
            self.real.exec_module(module)
        except Exception as exc:
            self.stubbed[module.__name__] = f"{type(exc).__name__}: {exc}"
            module.__class__ = _Stub


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.stubbed: dict[str, str] = {}

    def find_spec(self, name, path, target=None):
        if name != "sglang" and not name.startswith("sglang."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.stubbed)
        return spec


_FINDER: _Finder | None = None


def _forget() -> None:
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]
    for name in [
        n
        for n in sys.modules
        if n.startswith("kvtier.integrations.sglang.linker.shell")
    ]:
        del sys.modules[name]


def load() -> types.SimpleNamespace:
    """The real modules (and the linker's shell over them). Raises Missing without SGLang."""
    global _FINDER
    _forget()  # another loader's sglang modules (bare packages) must not be reused
    if importlib.util.find_spec("sglang") is None:
        raise Missing(
            f"SGLang is not installed: pip install --no-deps sglang=={VERSION} (and the pure-Python "
            "imports .ci/run installs)"
        )
    from importlib.metadata import version

    if version("sglang") != VERSION:
        raise Missing(f"these tests pin SGLang {VERSION}; found {version('sglang')}")
    _FINDER = _Finder()
    sys.meta_path.insert(0, _FINDER)
    try:
        mods = {k: importlib.import_module(v) for k, v in MODULES.items()}
    except ImportError as exc:
        unload()
        raise Missing(
            f"an SGLang import failed ({exc}); .ci/run lists the packages SGLang needs here"
        ) from exc
    bad = sorted(set(_FINDER.stubbed) - STUBBABLE)
    needed = sorted(set(_FINDER.stubbed) & set(MODULES.values()))
    if bad or needed:
        reasons = {k: _FINDER.stubbed[k] for k in bad or needed}
        unload()
        raise AssertionError(
            f"SGLang modules failed to import and were stubbed: {reasons}"
        )
    mods["fx"].get_device = lambda *a, **k: (
        "cpu"
    )  # 0.5.23's get_device() raises without an accelerator
    from kvtier.integrations.sglang.linker import shell

    mods["shell"] = shell
    mods["stubbed"] = frozenset(_FINDER.stubbed)
    return types.SimpleNamespace(**mods)


def unload() -> None:
    global _FINDER
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _FINDER = None
    _forget()
