"""kvtier as SGLang's unified-cache external linker (docs/sglang.md).

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "KvtierLinker",
        "linker_module_path": "kvtier.integrations.sglang.linker",
        "linker_extra_config": {"kvtier_config": "/etc/kvtier/linker.yaml"}}'

SGLang keeps its radix tree and device pool; kvtier owns what lies below: a host tier
keyed by SGLang's page keys over kvtier's host mirror, the store (file, redis, s3 or a
plugin), the copies between them, and the breaker. The engine-free part is `core.py`;
`shell.py` is the `UnifiedCacheLinker` subclass and the only module that imports SGLang,
on first lookup of `KvtierLinker`: this package imports without SGLang installed.
"""

from __future__ import annotations

from kvtier.integrations.sglang import INSTALL_HINT


def __getattr__(name: str):
    if name == "KvtierLinker":
        try:
            from kvtier.integrations.sglang.linker.shell import KvtierLinker
        except ImportError as exc:
            raise ImportError(
                f"kvtier.integrations.sglang.linker.KvtierLinker subclasses SGLang's "
                f"UnifiedCacheLinker, which could not be imported ({exc}); run it inside an SGLang "
                f"install, or for tests: {INSTALL_HINT}"
            ) from exc
        return KvtierLinker
    if name == "LinkerCollector":
        from kvtier.integrations.sglang.linker.metrics import LinkerCollector

        return LinkerCollector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
