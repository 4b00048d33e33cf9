"""What is worth keeping: a radix tree over page-aligned token keys, per tier."""

from kvtier.tree.components import Component
from kvtier.tree.hybrid import HybridRadixTree, make_tree
from kvtier.tree.key import RadixKey
from kvtier.tree.node import HybridNode, Tier, TreeNode
from kvtier.tree.policy import EvictionPolicy
from kvtier.tree.radix import RadixTree
from kvtier.tree.results import (
    ComponentEviction,
    ComponentFrees,
    DeviceEviction,
    HostEviction,
    HostInsertResult,
    InsertResult,
    KnownHashes,
    MatchResult,
)

__all__ = [
    "Component",
    "ComponentEviction",
    "ComponentFrees",
    "DeviceEviction",
    "EvictionPolicy",
    "HostEviction",
    "HostInsertResult",
    "HybridNode",
    "HybridRadixTree",
    "InsertResult",
    "KnownHashes",
    "MatchResult",
    "RadixKey",
    "RadixTree",
    "Tier",
    "TreeNode",
    "make_tree",
]
