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


def check_components(tree) -> list[str]:
    """A hybrid tree's side components, recomputed from a full walk: values and where they
    may be, lock anchors and window holds (from the FULL lock counts), per-component sizes
    and evictable sets, slots held once, and no SWA KV outside every live window."""
    root, ps, wp, problems = tree.root, tree.page_size, tree.wp, []
    nodes = walk(root)
    if any(v is not None for v in root.swa + root.mamba):
        problems.append("the root holds a component value")
    evictable, protected = [[0, 0], [0, 0]], [[0, 0], [0, 0]]
    held: list[list[list]] = [[[], []], [[], []]]
    for node in nodes:
        problems += _check_parts(tree, node)
        for tier in Tier:
            anchors = node.locks[tier] - sum(
                c.locks[tier] for c in node.children.values()
            )
            if node.anchors[tier] != anchors:
                problems.append(
                    f"{node}: {tier.name} anchors {node.anchors[tier]}, locks say {anchors}"
                )
            hold = _hold(node, wp, tier) if tree.has_swa else 0
            if node.swa_hold[tier] != hold:
                problems.append(
                    f"{node}: {tier.name} swa_hold {node.swa_hold[tier]}, recomputed {hold}"
                )
            for side, value, size, lock in (
                (0, node.swa[tier], len(node), hold),
                (1, node.mamba[tier], 1, anchors),
            ):
                if value is None:
                    continue
                (protected if lock else evictable)[side][tier] += size
                held[side][tier].append(
                    np.atleast_1d(np.asarray(value, dtype=np.int64))
                )
                member = not lock
                if member != (node.id in tree._side_sets[side][tier]):
                    problems.append(
                        f"{node}: {('swa', 'mamba')[side]} {tier.name} evictable-set membership "
                        f"is {not member}, predicate says {member}"
                    )
    live = {n.id for n in nodes}
    for side, name in ((0, "swa"), (1, "mamba")):
        for tier in Tier:
            t = tree._side_evictable[side][tier], tree._side_protected[side][tier]
            if t != (evictable[side][tier], protected[side][tier]):
                problems.append(
                    f"{name} {tier.name} sizes: tracked evictable/protected={t}, recomputed "
                    f"{(evictable[side][tier], protected[side][tier])}"
                )
            members = tree._side_sets[side][tier]
            if set(members) - live:
                problems.append(f"{name} {tier.name} evictable set holds removed nodes")
            for nid in members:
                n = members.nodes[nid]
                values = n.swa if side == 0 else n.mamba
                if values[tier] is None:
                    problems.append(
                        f"{n}: in the {name} {tier.name} evictable set without a value"
                    )
            problems += members.problems(f"{name} {tier.name}")
            if held[side][tier]:
                slots = np.concatenate(held[side][tier])
                if np.unique(slots).size != slots.size:
                    problems.append(f"{name} {tier.name}: some slot is held twice")
                if (slots < (ps if side == 0 else 1)).any():
                    problems.append(f"{name} {tier.name}: the tree holds padding slots")
    if tree.has_swa:
        problems += _check_windows(tree, nodes)
    return problems


def _check_parts(tree, node) -> list[str]:
    out = []
    if node.end != (0 if node.parent is tree.root else node.parent.end) + len(node):
        out.append(f"{node}: end {node.end} is not its parent's end plus its length")
    for tier in Tier:
        name = tier.name.lower()
        swa, mamba = node.swa[tier], node.mamba[tier]
        if (swa is not None and not tree.has_swa) or (
            mamba is not None and not tree.has_mamba
        ):
            out.append(f"{node}: holds a component the tree does not have")
        if swa is not None and (
            not isinstance(swa, np.ndarray)
            or swa.dtype != np.int64
            or swa.size != len(node)
        ):
            out.append(f"{node}: {name} SWA value is not {len(node)} int64 slots")
        if mamba is not None and (
            isinstance(mamba, bool) or not isinstance(mamba, int)
        ):
            out.append(f"{node}: {name} Mamba value {mamba!r} is not one int slot")
        if (swa is not None or mamba is not None) and node.values[tier] is None:
            out.append(f"{node}: a component on {name} without its FULL KV there")
    return out


def _hold(node, wp: int, tier: Tier) -> int:
    """Locks at or below `node` whose window (wp tokens ending at the lock) reaches it."""
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        anchors = n.locks[tier] - sum(c.locks[tier] for c in n.children.values())
        if n.end - wp < node.end:
            total += anchors
        stack.extend(n.children.values())
    return total


def _check_windows(tree, nodes) -> list[str]:
    """Every SWA value lies in a live window: the wp tokens ending at a match point (any
    page boundary; with Mamba, a node end with a state on some tier) all hold SWA KV on
    some tier, or they end at a lock. A state's or a lock's window starts on a node
    boundary (so its nodes are exactly its tokens)."""
    from kvtier.tree.windows import swa_present

    ps, wp, root, out, live = tree.page_size, tree.wp, tree.root, [], set()
    for m in nodes:
        ends = []
        anchored = bool(m.anchors[0] or m.anchors[1])
        if tree.has_mamba:
            if m.mamba[0] is not None or m.mamba[1] is not None or anchored:
                ends.append(m.end)
        else:
            ends += range(m.start + ps, m.end + 1, ps)
        for end in ends:
            lo, window, n = end - wp, [], m
            while n is not root and n.end > lo:
                window.append(n)
                n = n.parent
            if (end == m.end and anchored) or (
                tree.has_mamba and m.mamba != [None, None]
            ):
                if lo > 0 and window[-1].start != lo:
                    out.append(
                        f"{m}: the window ending at {end} does not start on a node boundary"
                    )
            if (end == m.end and anchored) or all(swa_present(n) for n in window):
                live.update(n.id for n in window)
    for n in nodes:
        if swa_present(n) and n.id not in live:
            out.append(f"{n}: SWA KV in no live window (it should have been freed)")
    return out
