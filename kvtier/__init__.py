"""kvtier: hierarchical KV-cache tiering for LLM serving (docs/embedding.md).

The public face, importable from here (`from kvtier import TieredCache`); each name is
loaded on first use, so `import kvtier` alone (the CLI's help) does not import torch:

    TieredCache, Acquired          the cache a server embeds (kvtier/cache/)
    DeviceKVPool, PoolConfig       the device pool; `DeviceKVPool.from_tensors` wraps an
                                   engine's own KV tensors
    DeviceAllocator                what an engine's own slot allocator must provide
    LayerWaiter                    what a forward waits for (`TieredCache.begin_forward`)
    LeaseBounds, LeaseBoundError   an agent hint's lease bounds per tenant, and the refusal
    KvtierConfig, load_config      configuration (YAML, environment, overrides)
    KvtierError and its subclasses the errors kvtier raises on purpose

Layer map (layers import downward only; see kvtier/README.md):

    cli, engine, integrations -> cache
    cache              -> tree, controller, tiers, backends
    controller         -> tiers, backends
    tree               -> hashing, errors
    tiers, backends    -> hashing, errors, validate
"""

from importlib import import_module

__version__ = "0.1.0"

_HOME = {
    "TieredCache": "kvtier.cache.facade",
    "Acquired": "kvtier.cache.facade",
    "DeviceAllocator": "kvtier.cache.slots",
    "LayerWaiter": "kvtier.controller.layer_waiter",
    "LeaseBoundError": "kvtier.cache.hints",
    "LeaseBounds": "kvtier.cache.hints",
    "DeviceKVPool": "kvtier.tiers.pool",
    "PoolConfig": "kvtier.tiers.pool",
    "KvtierConfig": "kvtier.config",
    "load_config": "kvtier.config",
    "KvtierError": "kvtier.errors",
    "KvtierConfigError": "kvtier.errors",
    "StoreError": "kvtier.errors",
    "StoreTimeout": "kvtier.errors",
    "StoreUnavailable": "kvtier.errors",
    "TransferError": "kvtier.errors",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value  # found once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
