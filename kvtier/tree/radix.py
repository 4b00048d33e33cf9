"""The radix tree over device and host tiers (docs/design.md §4).

The tree decides what is worth keeping; it never allocates, frees or copies memory.
Mutations return what the caller must do (free these slots, back up these nodes).
Only the scheduler thread calls it.

Per tier, every token the tree holds is either *evictable* (its node's lock count is 0)
or *protected*; the two sizes move at the statement that changes a lock count. Leaves
that may be evicted are kept in a set per tier, updated wherever a node's predicate can
change (`_refresh`), with a heap by the policy key that an eviction pass pops from
(`leaves.py`).
"""

from __future__ import annotations

import numbers
from contextlib import closing
from functools import partial
from collections.abc import Callable

import numpy as np
import torch

from kvtier.tiers.indices import check_size, check_slots, concat
from kvtier.tree.check import check_tree, is_evictable_leaf, render
from kvtier.tree.components import Component
from kvtier.tree.hash_plan import (
    ChainMemo,
    HashPlan,
    adopt,
    chain_below,
    plan_chains,
    split_hashes,
    take_known,
)
from kvtier.tree.key import RadixKey, edge_prefix
from kvtier.tree.leaves import EvictableLeaves
from kvtier.tree.node import Tier, TreeNode
from kvtier.tree.policy import EvictionPolicy, policy_key
from kvtier.tree.results import (
    DeviceEviction,
    HostEviction,
    HostInsertResult,
    InsertResult,
    KnownHashes,
    MatchResult,
)

D, H = Tier.DEVICE, Tier.HOST
_NONE = np.empty(0, dtype=np.int64)


def joined_slots(parts: list[np.ndarray]) -> np.ndarray:
    """The parts joined (`concat` keeps the GIL); one part is not copied. Node values are
    never written in place, so a view stays right; callers must not write into it either
    (results are read-only). Node values and results are numpy: the tree runs on the
    scheduler thread, where every torch call gives up the GIL (docs/design.md §2); results
    make tensors only when a caller asks (`MatchResult.device_indices`)."""
    if not parts:
        return _NONE
    return concat(parts) if len(parts) > 1 else parts[0]


class RadixTree:
    # a full-attention model's tree; HybridRadixTree (tree/hybrid.py) adds SWA and Mamba
    components: tuple[Component, ...] = (Component.FULL,)

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: str | EvictionPolicy = "lru",
        slru_threshold: int = 2,
        namespace_id: str = "",
        hash_algo: str = "sha256",
    ) -> None:
        if (
            isinstance(page_size, bool)
            or not isinstance(page_size, int)
            or page_size < 1
        ):
            raise ValueError(f"page_size={page_size!r}: must be an integer >= 1")
        self.page_size = page_size
        self.policy = EvictionPolicy.parse(eviction_policy)
        self._key = policy_key(self.policy, slru_threshold)
        self.namespace_id = namespace_id
        self.hash_algo = hash_algo
        self.chains = (
            ChainMemo()
        )  # chains made lately, not hashed again (tree/chain_memo.py)
        # told each time a node's pages appear on or leave a tier, and of resets (KV events:
        # kvtier/events/cache_events.py); None: nobody listens
        self.observer = None
        self.reset()

    def set_observer(self, observer) -> None:
        """Tell `observer` (or nobody, None) of every tier change and reset from now on."""
        self.observer = observer

    def reset(self) -> None:
        """Forget everything (the caller frees the slots it handed over)."""
        if self.observer is not None:
            self.observer.cleared()
        self._next_id = 0
        self.clock = 0
        self.root = self._new_node(RadixKey([]), None)
        self.root.values = [_NONE, _NONE]
        self.root.locks = [1, 1]
        self._evictable = [0, 0]
        self._protected = [0, 0]
        grow = (
            self.policy != EvictionPolicy.MRU
        )  # touches raise every other policy's keys
        self._leaves = [
            EvictableLeaves(self._key, grow),
            EvictableLeaves(self._key, grow),
        ]

    # -- sizes -------------------------------------------------------------------------------

    def evictable_size(self, tier: Tier = D) -> int:
        return self._evictable[tier]

    def protected_size(self, tier: Tier = D) -> int:
        return self._protected[tier]

    def total_size(self, tier: Tier = D) -> int:
        return self._evictable[tier] + self._protected[tier]

    # -- match / insert ----------------------------------------------------------------------

    def match_prefix(self, key: RadixKey, touch: bool = True) -> MatchResult:
        """Longest cached page-aligned prefix of `key`; splits an edge that diverges mid-way.

        Lock `last_device_node` before using `device_indices`: they stay valid only while
        the node is locked. `touch=False` for a re-match of the same request: a request
        counts one hit (hit_count, access clock), however often it is matched.
        """
        if not isinstance(key, RadixKey):
            raise ValueError(
                f"match_prefix: key: expected a RadixKey, got {type(key).__name__}"
            )
        if touch:
            self.clock += 1
        path = self._walk(key)
        last_device, device_values, host_hit, clock = self.root, [], 0, self.clock
        for node in path:
            if touch:
                node.hit_count += 1
                node.last_access = clock
            value = node.values[0]  # Tier.DEVICE
            if value is not None:
                last_device = node
                device_values.append(value)
            else:
                host_hit += len(node)
        deepest = path[-1] if path else self.root
        return MatchResult(
            joined_slots(device_values), last_device, deepest, deepest, host_hit
        )

    def _walk(self, key: RadixKey) -> list[TreeNode]:
        """Matched nodes root-down; the last one is split so the match ends on its end."""
        node, offset, path = self.root, 0, []
        ps, tokens, extra = self.page_size, key.tokens, key.extra_key
        usable = len(tokens) - len(tokens) % ps
        data = (
            tokens.tobytes()
        )  # a whole-edge match is one memcmp: bytes.startswith at an offset
        page_bytes = ps << 3
        while offset < usable:
            start = offset << 3
            page = data[
                start : start + page_bytes
            ]  # == child_key_at(tokens, offset, ...)
            child = node.children.get(page if extra is None else (extra, page))
            if child is None:
                break
            k = _edge_match(child, data, offset, usable, ps)
            diverged = k < len(child)
            if diverged:
                child = self._split(child, k)
            path.append(child)
            node, offset = child, offset + k
            if diverged:
                break
        return path

    def insert(
        self,
        key: RadixKey,
        device_indices: torch.Tensor | np.ndarray,
        priority: int = 0,
        hashes: KnownHashes | None = None,
    ) -> InsertResult:
        """Cache `key` -> `device_indices` (copied). See InsertResult for slot ownership.

        A host-only node on the path takes the given slots (the KV was just recomputed);
        its host copy stays. `hashes`: page hashes of `key` the caller already computed
        (new nodes they cover keep them instead of hashing their pages again).
        """
        self._check_aligned("insert", key)
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ValueError(f"insert: priority={priority!r}: must be an integer")
        slots = check_slots("device_indices", device_indices, len(key))
        _check_hashes("insert", hashes)
        prefix_len, node, added = self._insert(
            self.root, key, slots, D, priority, hashes
        )
        return InsertResult(prefix_len, node, added)

    def insert_host(
        self,
        anchor: TreeNode,
        key: RadixKey,
        host_indices: torch.Tensor | np.ndarray,
        hashes: KnownHashes | None = None,
    ) -> HostInsertResult:
        """Host-only nodes for `key` (continuing below `anchor`) from slots filled by L3.

        `anchor` must be on host (or the root): backed-up nodes form a prefix from the root.
        A device-only node on the path takes the given host slots as its backup.
        """
        self._check_aligned("insert_host", key)
        slots = check_slots("host_indices", host_indices, len(key))
        _check_hashes("insert_host", hashes)
        if anchor is not self.root and not anchor.backed_up:
            raise ValueError(
                f"insert_host: anchor {anchor} is not on host; host nodes need a host parent"
            )
        prefix_len, node, _ = self._insert(anchor, key, slots, H, None, hashes)
        return HostInsertResult(prefix_len, node)

    def _insert(
        self,
        anchor: TreeNode,
        key: RadixKey,
        indices: np.ndarray,
        tier: Tier,
        priority: int | None,
        hashes: KnownHashes | None,
    ) -> tuple[int, TreeNode, list[TreeNode]]:
        """Walk `key` below `anchor`: tokens already on `tier` count into the prefix; nodes
        without a `tier` value take `indices`; the rest becomes a new node."""
        self.clock += 1
        node, offset, prefix_len, added = anchor, 0, 0, []
        ps, tokens, extra, end = self.page_size, key.tokens, key.extra_key, len(key)
        data = tokens.tobytes()
        page_bytes = ps << 3
        while offset < end:
            page = data[
                offset << 3 : (offset << 3) + page_bytes
            ]  # == child_key_at(tokens, offset, ...)
            child = node.children.get(page if extra is None else (extra, page))
            if child is None:
                child = self._add_child(node, key[offset:], tier, indices[offset:])
                if hashes is not None:
                    take_known(
                        child, hashes.leading(offset // ps, len(child) // ps), ps
                    )
                added.append(child)
                offset = end
            else:
                k = _edge_match(child, data, offset, end, ps)
                if k < len(child):
                    child = self._split(child, k)
                if child.values[tier] is not None:
                    assert prefix_len == offset, (
                        f"{child}: on {tier.name} below a node that is not (a hole)"
                    )
                    prefix_len += k
                else:
                    self._set_value(child, tier, concat([indices[offset : offset + k]]))
                offset += k
            child.last_access = self.clock
            if priority is not None:
                child.priority = max(child.priority, priority)
            node = child
        return prefix_len, node, added

    # -- tier moves ---------------------------------------------------------------------------

    def mark_backed_up(
        self, node: TreeNode, host_indices: torch.Tensor | np.ndarray
    ) -> np.ndarray:
        """`node`'s KV is now also at `host_indices`; returns the slots the caller must free
        (numpy, like every slot array inside kvtier).

        If `node` was split while its write was in flight, `host_indices` also covers the
        split-off ancestors (leading part first). A part that got a host copy meanwhile (from
        the store) keeps it, and its share of `host_indices` is returned to be freed.
        """
        host_indices = check_slots("host_indices", host_indices)
        chain, end, n = [], host_indices.size, node
        while end > 0:  # validate first: nothing changes on bad input
            if n is self.root or len(n) > end:
                raise ValueError(
                    f"mark_backed_up: {end} host slots left over at {n}; not a written node"
                )
            chain.append((n, end))
            end -= len(n)
            n = n.parent
        if n is not self.root and not n.backed_up:
            raise ValueError(
                f"mark_backed_up: parent {n} of {node} is not backed up; back up root-down"
            )
        unused = []
        for n, end in reversed(chain):
            part = host_indices[end - len(n) : end]
            if n.backed_up:
                unused.append(part)
            else:
                self._set_value(n, H, concat([part]))
        return concat(unused)

    def nodes_to_load(self, node: TreeNode) -> list[TreeNode]:
        """Host-only nodes from the deepest device ancestor down to `node`, root-down."""
        chain = []
        while node is not self.root and not node.on_device:
            assert node.backed_up, f"{node} holds no data"
            chain.append(node)
            node = node.parent
        return chain[::-1]

    def mark_loaded(self, node: TreeNode, device_indices: torch.Tensor) -> None:
        """`node` (host-only, parent on device) is on device at `device_indices` from now."""
        slots = check_slots("device_indices", device_indices, len(node))
        if node.on_device:
            raise ValueError(f"mark_loaded: {node} is already on device")
        if node.parent is not self.root and not node.parent.on_device:
            raise ValueError(
                f"mark_loaded: parent of {node} is not on device; load root-down"
            )
        self._set_value(node, D, concat([slots]))

    # -- locks --------------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect the device path root..node from eviction until `unlock(node)`."""
        self._lock(node, D, +1)

    def unlock(self, node: TreeNode) -> None:
        self._lock(node, D, -1)

    def protect_host(self, node: TreeNode) -> None:
        """Protect the host path root..node (a host read is in flight) until `release_host`."""
        self._lock(node, H, +1)

    def release_host(self, node: TreeNode) -> None:
        self._lock(node, H, -1)

    def _lock(self, node: TreeNode, tier: Tier, delta: int) -> None:
        bad = self._add_locks(node, tier, delta, self.root)
        if bad is None:
            return
        self._add_locks(
            node, tier, -delta, bad
        )  # bad input changes nothing: undo the path below it
        what = ("lock", "unlock", "protect_host", "release_host")[
            2 * tier + (delta < 0)
        ]
        if bad.values[tier] is None:
            raise ValueError(
                f"{what}: {bad} on the path of {node} is not on {tier.name.lower()}"
            )
        raise ValueError(
            f"{what}: {bad} is not locked ({what} without a matching lock)"
        )

    def _add_locks(
        self, node: TreeNode, tier: Tier, delta: int, stop: TreeNode
    ) -> TreeNode | None:
        """Add `delta` to the lock counts from `node` up to `stop` (excluded), in one pass;
        the first node that may not take it (no value on `tier`, or a count going below
        0) is returned, with the nodes below it changed, the rest not.

        Per path, not per node: only `node` can change leaf-set membership (every node
        above it has a child on the path holding a `tier` value, so it is no leaf before or
        after), and the sizes move once by the tokens whose count left or reached 0."""
        moved, first, bad = 0, node, None
        while node is not stop:
            before = node.locks[tier]
            if node.values[tier] is None or before + delta < 0:
                bad = node
                break
            node.locks[tier] = before + delta
            if (before == 0) != (before + delta == 0):
                moved += len(node)
            node = node.parent
        if moved:
            moved = moved if delta > 0 else -moved
            self._evictable[tier] -= moved
            self._protected[tier] += moved
        if first is not bad and first is not stop:
            if first.locks[tier]:
                self._leaves[tier].discard(first)
            elif is_evictable_leaf(first, tier):
                self._leaves[tier].add(first)
        return bad

    def set_priority(self, node: TreeNode, priority: int) -> None:
        """Nodes root..node take eviction priority `priority` (the priority policy evicts
        the lowest first). A leaf among them is queued again under its key now: a key that
        went down must not wait behind its old heap entry."""
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ValueError(f"set_priority: priority={priority!r}: must be an integer")
        while node is not self.root:
            node.priority = int(priority)
            for leaves in self._leaves:
                if node.id in leaves:
                    leaves.discard(node)
                    leaves.add(node)
            node = node.parent

    # -- eviction -----------------------------------------------------------------------------

    def evict_device(
        self, num_tokens: int, backup_first: bool = False
    ) -> DeviceEviction:
        """Evict at least `num_tokens` device tokens if that many are evictable.

        A backed-up leaf is demoted to host; one that is not is removed, or, with
        `backup_first` (write-back), listed in `needs_backup` and kept.
        """
        check_size("evict_device: num_tokens", num_tokens, minimum=0)
        freed, demoted, removed, needs_backup = [], [], [], []
        evicted = 0
        with closing(
            self._leaves[D].order()
        ) as order:  # closed: what it did not take goes back
            for node in order:
                if evicted >= num_tokens:
                    break
                if node.backed_up and not (backup_first and self._unsaved(node)):
                    demoted.append(node)
                elif backup_first:
                    needs_backup.append(node)
                    continue
                else:
                    removed.append(node)
                freed.append(node.values[D])
                evicted += len(node)
                self._set_value(node, D, None)
                if not node.backed_up:
                    self._remove(node)
        return DeviceEviction(
            joined_slots(freed), evicted, demoted, removed, needs_backup
        )

    def _unsaved(self, node: TreeNode) -> bool:
        """Does `node`, backed up, hold on device what its host copy lacks (a hybrid tree:
        side components)? Write-back then backs it up before evicting it."""
        return False

    def evict_host(self, num_tokens: int) -> HostEviction:
        """Evict at least `num_tokens` host tokens from host-only leaves (they leave the tree)."""
        check_size("evict_host: num_tokens", num_tokens, minimum=0)
        freed, removed, evicted = [], [], 0
        with closing(self._leaves[H].order()) as order:
            for node in order:
                if evicted >= num_tokens:
                    break
                freed.append(node.values[H])
                evicted += len(node)
                self._set_value(node, H, None)
                self._remove(node)
                removed.append(node)
        return HostEviction(joined_slots(freed), evicted, removed)

    # -- hashes -------------------------------------------------------------------------------

    def page_hashes(self, node: TreeNode) -> list[bytes]:
        """Hash chain of `node`'s pages (chained through its ancestors), computed now on
        this thread where not known yet (and kept)."""
        plan = self._hash_plan(node)
        if plan is not None:
            for n, hashes in zip(plan.nodes, plan()):
                n.hashes, n.hash_prefix = hashes, None
        return node.hashes if node is not self.root else []

    def hashing_of(self, node: TreeNode) -> Callable[[], list[bytes]]:
        """A function that returns `node`'s hash chain, which another thread may run: it
        reads only what it takes now (the token arrays of `node` and of its ancestors not
        hashed yet, which no one writes, and the last known hash above them). The tree keeps
        the result only if given it back (`adopt_hashes`)."""
        plan = self._hash_plan(node)
        if plan is None:
            return partial(list, node.hashes if node is not self.root else [])
        return lambda: plan()[-1]

    def adopt_hashes(self, node: TreeNode, hashes: list[bytes]) -> None:
        """Keep a chain `hashing_of(node)` computed. `node` may have been split since: it
        kept its deeper half, whose pages are the chain's last ones (a page's hash is a
        function of the tokens from the root to its end)."""
        adopt(node, hashes, self.page_size)

    def hashing_below(
        self, anchor: TreeNode, key: RadixKey
    ) -> Callable[[], list[bytes]]:
        """A function that computes the hash chain of `key`'s pages as they would hang below
        `anchor` (what a prefetch asks the store for; another thread may run it, as for
        `hashing_of`: the anchor's chain too, where it is not known yet)."""
        return chain_below(
            anchor,
            key.tokens,
            key.extra_key,
            self.root,
            self.page_size,
            self.namespace_id,
            self.hash_algo,
            self.chains,
        )

    def _hash_plan(self, node: TreeNode) -> HashPlan | None:
        return plan_chains(
            node,
            self.root,
            self.page_size,
            self.namespace_id,
            self.hash_algo,
            self.chains,
        )

    # -- structure ----------------------------------------------------------------------------

    def _new_node(self, key: RadixKey, parent: TreeNode | None) -> TreeNode:
        node = TreeNode(self._next_id, key, parent, self.clock)
        self._next_id += 1
        return node

    def _add_child(
        self, parent: TreeNode, key: RadixKey, tier: Tier, indices: np.ndarray
    ) -> TreeNode:
        child = self._new_node(key, parent)
        parent.children[key.child_key(self.page_size)] = child
        self._set_value(child, tier, concat([indices]))
        return child

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut `child`'s edge after `k` tokens; the new upper node is returned and `child`
        (the deeper half) keeps its identity, locks, counts and leaf-set membership."""
        assert 0 < k < len(child) and k % self.page_size == 0, (
            f"bad split of {child} at {k}"
        )
        upper = self._new_node(child.key[:k], child.parent)
        upper.values = [None if v is None else v[:k] for v in child.values]
        upper.locks = list(child.locks)
        upper.hit_count, upper.last_access = child.hit_count, child.last_access
        upper.created, upper.priority = child.created, child.priority
        split_hashes(upper, child, k // self.page_size)
        child.parent.children[child.key.child_key(self.page_size)] = upper
        child.key, child.edge = child.key[k:], None
        child.values = [None if v is None else v[k:] for v in child.values]
        child.parent = upper
        upper.children[child.key.child_key(self.page_size)] = child
        return upper

    def _set_value(self, node: TreeNode, tier: Tier, value: np.ndarray | None) -> None:
        """The one place a node's tier value changes: sizes and leaf sets follow it."""
        sign = (value is not None) - (node.values[tier] is not None)
        if node.locks[tier]:
            self._protected[tier] += sign * len(node)
        else:
            self._evictable[tier] += sign * len(node)
        node.values[tier] = value
        if sign and self.observer is not None:
            self.observer.tier_changed(node, tier, value is not None)
        # the node's own membership: a device value also decides host evictability (only
        # host-only nodes leave the host); its parent's: only the tier whose child changed,
        # and a child that gained a value there makes it no leaf without asking
        self._refresh(node, (D, H) if tier == D else (H,))
        if value is not None:
            self._leaves[tier].discard(node.parent)
        else:
            self._refresh(node.parent, (tier,))

    def _remove(self, node: TreeNode) -> None:
        """Drop an empty leaf. Its parent's membership stays: a child without values never
        kept it from being a leaf (and `_set_value` refreshed it when they went)."""
        assert not node.children and all(v is None for v in node.values), (
            f"removing {node} which holds data"
        )
        del node.parent.children[node.key.child_key(self.page_size)]
        for leaves in self._leaves:
            leaves.discard(node)

    def _refresh(self, node: TreeNode, tiers: tuple[Tier, ...] = (D, H)) -> None:
        for tier in tiers:
            if node is not self.root and is_evictable_leaf(node, tier):
                self._leaves[tier].add(node)
            else:
                self._leaves[tier].discard(node)

    def _check_aligned(self, what: str, key: RadixKey) -> None:
        if not isinstance(key, RadixKey):
            raise ValueError(
                f"{what}: key: expected a RadixKey, got {type(key).__name__}"
            )
        if len(key) % self.page_size:
            raise ValueError(
                f"{what}: key length {len(key)} is not a multiple of page_size={self.page_size}"
            )

    # -- checks -------------------------------------------------------------------------------

    def sanity_check(self) -> None:
        """Recompute every invariant from a full walk; raise one error listing all violations."""
        problems = check_tree(self)
        if problems:
            raise AssertionError(
                "radix tree invariants violated:\n  "
                + "\n  ".join(problems)
                + "\n"
                + self.pretty_print()
            )

    def pretty_print(self) -> str:
        return render(self.root)


def _edge_match(child: TreeNode, data: bytes, offset: int, end: int, ps: int) -> int:
    """Tokens of `child`'s edge that tokens [offset, end) (their bytes are `data`) repeat,
    floored to pages. The whole edge is one memcmp (bytes.startswith at an offset, the
    edge's bytes cached on the node); a divergence is found by halving (`edge_prefix`)."""
    edge = child.edge
    if edge is None:
        edge = child.edge = child.key.tokens.tobytes()
    n = len(edge) >> 3
    if offset + n <= end and data.startswith(edge, offset << 3):
        return n
    return edge_prefix(edge, data, offset, end, ps)


def _check_hashes(what: str, hashes: object) -> None:
    if hashes is not None and not isinstance(hashes, KnownHashes):
        raise ValueError(
            f"{what}: hashes: expected KnownHashes or None, got {type(hashes).__name__}"
        )
