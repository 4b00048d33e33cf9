"""kvtier inside SGLang 0.5.23 (docs/sglang.md): its two seams, one module each.

- `KvtierStorage` (`storage.py`): HiCache's L3 storage backend, below SGLang's host pool.
- `KvtierLinker` (`linker/`): the unified-cache external linker, where kvtier owns the
  host tier, the store and the copies below SGLang's tree and device pool.

Both are looked up lazily: this package imports without SGLang installed, and only the
class named is built (each subclasses an SGLang class on first lookup).
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
INSTALL_HINT = f"pip install --no-deps sglang=={SGLANG_VERSION}"


def __getattr__(name: str):
    if name == "KvtierStorage":
        from kvtier.integrations.sglang import storage

        return storage.KvtierStorage
    if name in ("KvtierLinker", "LinkerCollector"):
        from kvtier.integrations.sglang import linker

        return getattr(linker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
