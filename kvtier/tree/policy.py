"""Eviction policies: each maps a node to a sort key; the smallest key is evicted first."""

from __future__ import annotations

from enum import Enum
from collections.abc import Callable

from kvtier.tree.node import TreeNode


class EvictionPolicy(str, Enum):
    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"
    MRU = "mru"
    PRIORITY = "priority"
    SLRU = "slru"

    @classmethod
    def parse(cls, value: str | EvictionPolicy) -> EvictionPolicy:
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(p.value for p in cls)
            raise ValueError(
                f"eviction_policy={value!r}: allowed values are {allowed}"
            ) from None


PolicyKey = Callable[[TreeNode], tuple]


def policy_key(policy: EvictionPolicy, slru_threshold: int = 2) -> PolicyKey:
    """Node -> sort key. Ties are broken by the caller with the node id (deterministic)."""
    keys: dict[EvictionPolicy, PolicyKey] = {
        EvictionPolicy.LRU: lambda n: (n.last_access,),
        EvictionPolicy.MRU: lambda n: (-n.last_access,),
        EvictionPolicy.FIFO: lambda n: (n.created,),
        EvictionPolicy.LFU: lambda n: (n.hit_count, n.last_access),
        EvictionPolicy.PRIORITY: lambda n: (n.priority, n.last_access),
        # Segmented LRU: probationary nodes (fewer hits than the threshold) go first.
        EvictionPolicy.SLRU: lambda n: (n.hit_count >= slru_threshold, n.last_access),
    }
    return keys[policy]
