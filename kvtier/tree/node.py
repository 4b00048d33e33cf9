"""A radix tree node: one edge of tokens and, per tier, the slots holding their KV."""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from kvtier.tree.key import RadixKey


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1


class TreeNode:
    """Owned and mutated by the tree only (on the scheduler thread).

    `values[tier]` is an int64 tensor of slots, one per token of `key`, or None when the
    node's KV is not on that tier. `locks[tier]` counts holders on the path from here down.
    """

    __slots__ = (
        "id",
        "key",
        "parent",
        "children",
        "values",
        "locks",
        "hit_count",
        "last_access",
        "created",
        "priority",
        "hashes",
        "hash_prefix",
        "edge",
    )

    def __init__(
        self, node_id: int, key: RadixKey, parent: TreeNode | None, clock: int
    ) -> None:
        self.id = node_id
        self.key = key
        self.parent = parent
        self.children: dict = {}
        self.values: list[np.ndarray | None] = [None, None]  # int64 slots per tier
        self.locks = [0, 0]
        self.hit_count = 0
        self.last_access = clock
        self.created = clock
        self.priority = 0
        self.hashes: list[bytes] | None = (
            None  # the chain of every page, or None until computed
        )
        self.hash_prefix: list[bytes] | None = (
            None  # while `hashes` is None: those of its first pages, if known
        )
        self.edge: bytes | None = (
            None  # key.tokens as bytes, made on first compare (matches compare bytes)
        )

    @property
    def on_device(self) -> bool:
        return self.values[Tier.DEVICE] is not None

    @property
    def backed_up(self) -> bool:
        return self.values[Tier.HOST] is not None

    def __len__(self) -> int:
        return self.key.tokens.shape[0]

    def __repr__(self) -> str:
        tiers = "".join(t for t, v in zip("DH", self.values) if v is not None) or "-"
        return f"Node#{self.id}(len={len(self)}, tiers={tiers}, locks={self.locks}, hits={self.hit_count})"
