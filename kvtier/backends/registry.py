"""Store registry: built-ins by name, third parties by entry point or `module:Class`.

A store class takes `(config, timeout_s=...)`; its `config_class` (a frozen dataclass)
is what the YAML `store:` section's backend options map onto.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from kvtier.errors import KvtierConfigError

ENTRY_POINT_GROUP = "kvtier.backends"
BUILTINS: dict[str, tuple[str, str, str]] = {
    "memory": ("kvtier.backends.memory", "MemoryStore", "MemoryStoreConfig"),
    "file": ("kvtier.backends.file", "FileStore", "FileStoreConfig"),
    "redis": ("kvtier.backends.redis_store", "RedisStore", "RedisStoreConfig"),
    "s3": ("kvtier.backends.s3", "S3Store", "S3StoreConfig"),
}


def known_names() -> list[str]:
    return sorted(
        set(BUILTINS) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    )


def resolve(backend: str) -> tuple[type, type | None]:
    """(store class, its options dataclass or None) for a backend name or `module:Class`."""
    if backend in BUILTINS:
        module, cls, cfg = BUILTINS[backend]
        mod = _import(backend, module)
        return getattr(mod, cls), getattr(mod, cfg)
    if ":" in backend:
        module, _, attr = backend.partition(":")
        cls = getattr(_import(backend, module), attr, None)
        if cls is None:
            raise KvtierConfigError(
                f"store.backend={backend!r}: module {module!r} has no attribute {attr!r}"
            )
        return cls, getattr(cls, "config_class", None)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == backend:
            try:
                cls = ep.load()
            except Exception as exc:
                raise KvtierConfigError(
                    f"store.backend={backend!r}: plugin {ep.value!r} failed to load: {exc}"
                ) from exc
            return cls, getattr(cls, "config_class", None)
    raise KvtierConfigError(
        f"store.backend={backend!r}: unknown store; known: none, {', '.join(known_names())}, or 'module:Class'"
    )


def _import(backend: str, module: str):
    try:
        return importlib.import_module(module)
    except Exception as exc:
        raise KvtierConfigError(
            f"store.backend={backend!r}: cannot import {module!r}: {exc}"
        ) from exc


def build_store(backend: str, options=None, timeout_s: float = 5.0):
    """A store instance for `backend` with its options (a config dataclass, a dict, or None)."""
    cls, options_cls = resolve(backend)
    if options is None and options_cls is not None:
        options = options_cls()
    elif isinstance(options, dict) and options_cls is not None:
        options = options_cls(**options)
    return cls(options, timeout_s=timeout_s)
