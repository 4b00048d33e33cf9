"""What is worth keeping: a radix tree over page-aligned token keys, per tier."""

from kvtier.tree.key import RadixKey
from kvtier.tree.node import Tier, TreeNode
from kvtier.tree.policy import EvictionPolicy
from kvtier.tree.radix import RadixTree
from kvtier.tree.results import (
    DeviceEviction,
    HostEviction,
    HostInsertResult,
    InsertResult,
    KnownHashes,
    MatchResult,
)

__all__ = [
    "DeviceEviction",
    "EvictionPolicy",
    "HostEviction",
    "HostInsertResult",
    "InsertResult",
    "KnownHashes",
    "MatchResult",
    "RadixKey",
    "RadixTree",
    "Tier",
    "TreeNode",
]
