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


class HybridNode(TreeNode):
    """A node of a tree with side components (`HybridRadixTree`); a full-attention tree
    makes plain `TreeNode`s and pays for none of this.

    Per tier: `swa[tier]` int64 SWA slots, one per token (None: a tombstone, the node and
    its FULL KV stay); `mamba[tier]` the slot of the recurrent state after the node's last
    token (an int, or None). `anchors[tier]`: locks taken at exactly this node (what a
    Mamba state and an SWA window are protected by); `swa_hold[tier]`: anchors at or below
    whose window reaches into this node. `end`: tokens from the root to the node's end.
    `swa_access` / `mamba_access`: the components' own logical clocks (their LRU keys)."""

    __slots__ = (
        "end",
        "swa",
        "mamba",
        "anchors",
        "swa_hold",
        "swa_access",
        "mamba_access",
    )

    def __init__(
        self, node_id: int, key: RadixKey, parent: TreeNode | None, clock: int
    ) -> None:
        super().__init__(node_id, key, parent, clock)
        self.end = (0 if parent is None else parent.end) + key.tokens.shape[0]
        self.swa: list[np.ndarray | None] = [None, None]
        self.mamba: list[int | None] = [None, None]
        self.anchors = [0, 0]
        self.swa_hold = [0, 0]
        self.swa_access = clock
        self.mamba_access = clock

    @property
    def start(self) -> int:
        return self.end - self.key.tokens.shape[0]

    def __repr__(self) -> str:
        tiers = "".join(t for t, v in zip("DH", self.values) if v is not None) or "-"
        swa = "".join(t for t, v in zip("DH", self.swa) if v is not None) or "-"
        mamba = "".join(t for t, v in zip("DH", self.mamba) if v is not None) or "-"
        return (
            f"Node#{self.id}([{self.start},{self.end}), tiers={tiers}, swa={swa}, mamba={mamba}, "
            f"locks={self.locks}, anchors={self.anchors}, swa_hold={self.swa_hold})"
        )
