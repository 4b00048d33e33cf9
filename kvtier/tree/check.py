"""Tree invariants recomputed from scratch (used by `RadixTree.sanity_check`)."""

from __future__ import annotations

import numpy as np

from kvtier.hashing import page_hashes
from kvtier.tree.node import Tier, TreeNode

H = Tier.HOST


def walk(root: TreeNode) -> list[TreeNode]:
    """Every node but the root, parents before children, children in id order."""
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        if node is not root:
            out.append(node)
        stack.extend(sorted(node.children.values(), key=lambda c: -c.id))
    return out


def tier_slots(tree, tier: Tier) -> np.ndarray:
    """Every slot the tree holds on `tier` (a full walk: for checks, not for a hot path)."""
    values = [n.values[tier] for n in walk(tree.root) if n.values[tier] is not None]
    return np.concatenate(values) if values else np.empty(0, dtype=np.int64)


def check_tree(tree) -> list[str]:
    ps, root, problems = tree.page_size, tree.root, []
    if root.locks != [1, 1]:
        problems.append(f"root locks are {root.locks}, expected [1, 1]")
    nodes = walk(root)
    evictable, protected = [0, 0], [0, 0]
    held: list[list[np.ndarray]] = [[], []]
    for node in nodes:
        problems += _check_node(node, ps, root)
        for tier in Tier:
            value = node.values[tier]
            if value is not None:
                (protected if node.locks[tier] else evictable)[tier] += len(node)
                held[tier].append(value)
            expected = is_evictable_leaf(node, tier)
            if expected != (node.id in tree._leaves[tier]):
                problems.append(
                    f"{node}: {tier.name} leaf-set membership is {not expected}, predicate says {expected}"
                )
    problems += _check_hashes(tree, nodes)
    live = {n.id for n in nodes}
    for tier in Tier:
        name = tier.name.lower()
        if (
            evictable[tier] != tree._evictable[tier]
            or protected[tier] != tree._protected[tier]
        ):
            problems.append(
                f"{name} sizes: tracked evictable={tree._evictable[tier]} protected={tree._protected[tier]}, "
                f"recomputed evictable={evictable[tier]} protected={protected[tier]}"
            )
        stale = set(tree._leaves[tier]) - live
        if stale:
            problems.append(f"{name} leaf set holds removed nodes {sorted(stale)}")
        problems += tree._leaves[tier].problems(name)
        if held[tier]:
            slots = np.concatenate(held[tier])
            if np.unique(slots).size != slots.size:
                problems.append(f"{name}: some slot is held by two tokens of the tree")
            if (slots < ps).any():
                problems.append(
                    f"{name}: the tree holds padding slots (< page_size={ps})"
                )
    return problems


def _check_node(node: TreeNode, ps: int, root: TreeNode) -> list[str]:
    out = []
    parent = node.parent
    if parent is None or parent.children.get(node.key.child_key(ps)) is not node:
        out.append(f"{node}: parent does not list it under its child key")
    if len(node) == 0 or len(node) % ps:
        out.append(
            f"{node}: key length {len(node)} is not a positive multiple of page_size={ps}"
        )
    if all(v is None for v in node.values):
        out.append(f"{node}: holds no data on any tier")
    for tier in Tier:
        value = node.values[tier]
        name = tier.name.lower()
        if value is not None and (
            not isinstance(value, np.ndarray)
            or value.dtype != np.int64
            or value.size != len(node)
        ):
            out.append(
                f"{node}: {name} value is {type(value).__name__} {getattr(value, 'dtype', '')} of "
                f"{getattr(value, 'size', '?')} slots for {len(node)} tokens (want int64 numpy)"
            )
        if value is not None and parent is not root and parent.values[tier] is None:
            out.append(f"{node}: on {name} but its parent {parent} is not (a hole)")
        if node.locks[tier] < 0 or (node.locks[tier] and value is None):
            out.append(
                f"{node}: {name} lock {node.locks[tier]} on a node {'not ' if value is None else ''}on {name}"
            )
        if parent is not root and parent.locks[tier] < node.locks[tier]:
            out.append(
                f"{node}: {name} lock {node.locks[tier]} exceeds its parent's {parent.locks[tier]}"
            )
    if node.hashes is not None and len(node.hashes) != len(node) // ps:
        out.append(
            f"{node}: {len(node.hashes)} page hashes for {len(node) // ps} pages"
        )
    return out


def _check_hashes(tree, nodes: list[TreeNode]) -> list[str]:
    """Every page hash a node keeps equals its chain recomputed from the root: a wrong one
    would store or look up pages under another prefix's key."""
    out, last = [], {tree.root.id: None}  # node id -> hash of its last page, recomputed
    for node in nodes:  # parents first
        fresh = page_hashes(
            node.key.tokens,
            tree.page_size,
            tree.namespace_id,
            node.key.extra_key,
            last[node.parent.id],
            tree.hash_algo,
        )
        last[node.id] = fresh[-1] if fresh else last[node.parent.id]
        known = node.hash_prefix
        if known is not None and (
            node.hashes is not None or known != fresh[: len(known)]
        ):
            out.append(
                f"{node}: known first page hashes differ from the chain recomputed from the root"
            )
        if node.hashes is not None and node.hashes != fresh:
            bad = (
                next(i for i, (a, b) in enumerate(zip(node.hashes, fresh)) if a != b)
                if len(node.hashes) == len(fresh)
                else "count"
            )
            out.append(
                f"{node}: kept page hashes differ from the chain recomputed from the root (page {bad})"
            )
    return out


def render(root: TreeNode, max_lines: int = 200) -> str:
    lines, stack = [], [(root, 0)]
    while stack:
        if len(lines) == max_lines:
            lines.append(f"... ({len(stack)} more subtrees not shown)")
            break
        node, depth = stack.pop()
        head = node.key.tokens[:4].tolist()
        lines.append(
            f"{'  ' * depth}{node!r} key={head}{'...' if len(node) > 4 else ''}"
        )
        stack.extend(
            (c, depth + 1) for c in sorted(node.children.values(), key=lambda c: -c.id)
        )
    return "\n".join(lines)


def is_evictable_leaf(node: TreeNode, tier: Tier) -> bool:
    """May `node` be evicted from `tier` now? (The leaf-set predicate, recomputed by checks.)"""
    if node.values[tier] is None or node.locks[tier]:
        return False
    if tier == H and node.values[Tier.DEVICE] is not None:
        return False  # host eviction only takes nodes that are not on device
    for c in node.children.values():
        if c.values[tier] is not None:
            return False
    return True
