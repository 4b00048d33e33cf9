"""What the tree's operations hand back: slots and nodes the caller must act on."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.tree.node import TreeNode


@dataclass(slots=True, frozen=True)
class MatchResult:
    """`device_slots` cover exactly the path root..`last_device_node`.

    `last_host_node` is the deepest matched node on any tier (the load-back target);
    `host_hit_length` the tokens between the two. `best_match_node` anchors L3 prefetch:
    the deepest node the tree knows for this key (nodes exist only while they hold data,
    so it is `last_host_node`).

    Slots the tree hands back may share memory with it: read them, never write into them.
    `device_slots` is numpy (kvtier's own code uses it); `device_indices` the same slots as
    a tensor, made when asked for.
    """

    device_slots: np.ndarray
    last_device_node: TreeNode
    last_host_node: TreeNode
    best_match_node: TreeNode
    host_hit_length: int

    @property
    def device_indices(self) -> torch.Tensor:
        return torch.from_numpy(self.device_slots)


@dataclass(slots=True, frozen=True)
class ComponentFrees:
    """Slots of the side components (SWA KV tokens, Mamba state slots) that the caller frees
    in their pools, per tier: slots it handed to the tree that the tree did not keep, and
    slots the tree let go (evicted, or SWA KV that no live window needs any more)."""

    swa_device: np.ndarray
    swa_host: np.ndarray
    mamba_device: np.ndarray
    mamba_host: np.ndarray

    def __len__(self) -> int:
        return sum(
            a.size
            for a in (
                self.swa_device,
                self.swa_host,
                self.mamba_device,
                self.mamba_host,
            )
        )


@dataclass(slots=True, frozen=True)
class ComponentEviction:
    """`evicted`: SWA tokens or Mamba states let go on the tier asked (what the pool gets
    back there); `frees` lists every slot to free, on both tiers."""

    evicted: int
    frees: ComponentFrees


@dataclass(slots=True, frozen=True)
class InsertResult:
    """The first `prefix_len` tokens were already on device: the caller frees its slots for
    them. Slots past `prefix_len` now belong to the tree. `added` are new device nodes
    (not backed up) in root-to-leaf order."""

    prefix_len: int
    last_node: TreeNode
    added: list[TreeNode] = field(default_factory=list)
    frees: ComponentFrees | None = None  # hybrid trees: SWA/Mamba slots to free


@dataclass(slots=True, frozen=True)
class HostInsertResult:
    """Of the host slots given, the first `prefix_len` tokens were already on host (the
    caller frees them); the rest now belong to the tree."""

    prefix_len: int
    last_node: TreeNode


@dataclass(slots=True, frozen=True)
class DeviceEviction:
    """Free `device_slots` (`device_indices` as a tensor). `demoted` nodes stay on host;
    `removed` left the tree.
    `needs_backup` (write-back only): unlocked leaves that must be backed up before they
    can be evicted."""

    device_slots: np.ndarray
    evicted_tokens: int
    demoted: list[TreeNode]
    removed: list[TreeNode]
    needs_backup: list[TreeNode]
    frees: ComponentFrees | None = (
        None  # hybrid trees: their SWA/Mamba slots, and dead windows
    )

    @property
    def device_indices(self) -> torch.Tensor:
        return torch.from_numpy(self.device_slots)


@dataclass(slots=True, frozen=True)
class HostEviction:
    """Free `host_slots` (`host_indices` as a tensor); `removed` nodes left the tree."""

    host_slots: np.ndarray
    evicted_tokens: int
    removed: list[TreeNode]
    frees: ComponentFrees | None = (
        None  # hybrid trees: their SWA/Mamba slots, and dead windows
    )

    @property
    def host_indices(self) -> torch.Tensor:
        return torch.from_numpy(self.host_slots)


@dataclass(slots=True, frozen=True)
class KnownHashes:
    """Page hashes a caller already computed for part of a key it inserts: pages
    [first, first + len(chain)) of the key (page 0 = the key's first page). A page's hash is
    a function of the tokens from the root to its end, so they are right for the nodes that
    hold those pages however the tree is split; the caller vouches that they were computed
    for this key's tokens, extra key and namespace (`sanity_check` recomputes them)."""

    first: int
    chain: list[bytes]

    def leading(self, start: int, count: int) -> list[bytes]:
        """The known hashes of the key's pages [start, start + count) up to the first unknown
        one (empty if page `start` is not known)."""
        i = start - self.first
        return self.chain[i : i + count] if 0 <= i < len(self.chain) else []
