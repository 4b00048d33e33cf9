"""The tree against a reference model: which token prefixes live on which tier, at which slot."""

from contextlib import closing

import numpy as np
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtier.hashing import page_hashes
from kvtier.tree import RadixKey, RadixTree, Tier
from kvtier.tree import KnownHashes
from kvtier.tree.check import walk

D, H = Tier.DEVICE, Tier.HOST


def path_tokens(node):
    parts = []
    while node.parent is not None:
        parts.append(node.key.tokens)
        node = node.parent
    return tuple(np.concatenate(parts[::-1]).tolist()) if parts else ()


class TreeMachine(RuleBasedStateMachine):
    page_size = 1
    policy = "lru"

    @initialize()
    def setup(self):
        self.tree = RadixTree(page_size=self.page_size, eviction_policy=self.policy)
        self.dev: dict[tuple, int] = {}  # token prefix -> device slot
        self.host: dict[tuple, int] = {}  # token prefix -> host slot
        self.next_slot = [self.page_size, self.page_size]
        self.locked = []  # device-locked nodes
        self.host_locked = []  # host-protected nodes

    def _slots(self, tier, n):
        start = self.next_slot[tier]
        self.next_slot[tier] += n
        return torch.arange(start, start + n, dtype=torch.int64)

    def _seq(self, pages, alphabet):
        return np.asarray(
            [t for p in pages for t in [p % alphabet] * self.page_size], dtype=np.int64
        )

    @rule(
        pages=st.lists(st.integers(0, 3), min_size=1, max_size=6),
        known=st.none() | st.tuples(st.integers(0, 6), st.integers(0, 6)),
    )
    def insert(self, pages, known):
        """`known`: hand the tree the page hashes of pages [first, first + count) (computed
        like a prefetch does); sanity_check recomputes every kept hash from the root."""
        seq = self._seq(pages, 4)
        slots = self._slots(D, len(seq))
        existing = sum(
            1 for i in range(len(seq)) if tuple(seq[: i + 1].tolist()) in self.dev
        )
        hashes = None
        if known is not None:
            first, count = known
            chain = page_hashes(seq, self.page_size, self.tree.namespace_id)[
                first : first + count
            ]
            hashes = KnownHashes(min(first, len(pages)), chain)
        r = self.tree.insert(RadixKey(seq), slots, hashes=hashes)
        assert r.prefix_len == existing
        for i in range(len(seq)):
            p = tuple(seq[: i + 1].tolist())
            if p not in self.dev:
                self.dev[p] = int(slots[i])

    @rule(pages=st.lists(st.integers(0, 3), max_size=7), tail=st.integers(0, 3))
    def match(self, pages, tail):
        seq = np.concatenate(
            [self._seq(pages, 4), np.full(tail % self.page_size, 7)]
        ).astype(np.int64)
        m = self.tree.match_prefix(RadixKey(seq))
        expect, host_hit, i = [], 0, 0
        while i + 1 <= len(seq) and tuple(seq[: i + 1].tolist()) in self.dev:
            expect.append(self.dev[tuple(seq[: i + 1].tolist())])
            i += 1
        while i + 1 <= len(seq) and tuple(seq[: i + 1].tolist()) in self.host:
            host_hit += 1
            i += 1
        assert m.device_indices.tolist() == expect
        assert m.host_hit_length == host_hit
        assert len(path_tokens(m.last_device_node)) == len(expect)
        assert len(path_tokens(m.last_host_node)) == len(expect) + host_hit

    @rule(pages=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def lock(self, pages):
        m = self.tree.match_prefix(RadixKey(self._seq(pages, 4)))
        if m.last_device_node is not self.tree.root:
            self.tree.lock(m.last_device_node)
            self.locked.append(m.last_device_node)

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 50))
    def unlock(self, i):
        self.tree.unlock(self.locked.pop(i % len(self.locked)))

    @rule(i=st.integers(0, 50))
    def protect_host(self, i):
        nodes = [n for n in walk(self.tree.root) if n.backed_up]
        if nodes:
            node = nodes[i % len(nodes)]
            self.tree.protect_host(node)
            self.host_locked.append(node)

    @precondition(lambda self: self.host_locked)
    @rule(i=st.integers(0, 50))
    def release_host(self, i):
        self.tree.release_host(self.host_locked.pop(i % len(self.host_locked)))

    def _locked_prefixes(self, nodes):
        out = set()
        for n in nodes:
            toks = path_tokens(n)
            out |= {toks[: i + 1] for i in range(len(toks))}
        return out

    def _policy_order(self, tier):
        """The reference: evictable leaves sorted by (policy key, id)."""
        leaves = self.tree._leaves[tier].nodes.values()
        return sorted(leaves, key=lambda n: (self.tree._key(n), n.id))

    @rule(n=st.integers(0, 12))
    def evict_device(self, n):
        before = self.tree.evictable_size(D)
        first = self._policy_order(D)[:1]
        first_slots = first[0].values[D].tolist() if first else []
        r = self.tree.evict_device(n)
        freed = r.device_indices.tolist()
        if n and first:
            assert freed[: len(first_slots)] == first_slots, (
                "the first victim is not the policy's first leaf"
            )
        assert len(freed) == len(set(freed)) == r.evicted_tokens >= min(n, before)
        by_slot = {s: p for p, s in self.dev.items()}
        assert set(freed) <= set(by_slot), "freed a slot the tree did not hold"
        locked = self._locked_prefixes(self.locked)
        for s in freed:
            p = by_slot[s]
            assert p not in locked, "evicted a locked prefix"
            del self.dev[p]

    @rule(n=st.integers(0, 12))
    def evict_host(self, n):
        r = self.tree.evict_host(n)
        freed = r.host_indices.tolist()
        by_slot = {s: p for p, s in self.host.items()}
        locked = self._locked_prefixes(self.host_locked)
        for s in freed:
            p = by_slot.pop(s)
            assert p not in self.dev and p not in locked
            del self.host[p]

    @rule(i=st.integers(0, 50))
    def backup(self, i):
        nodes = [
            n
            for n in walk(self.tree.root)
            if not n.backed_up and (n.parent is self.tree.root or n.parent.backed_up)
        ]
        if not nodes:
            return
        node = nodes[i % len(nodes)]
        toks = path_tokens(node)
        slots = self._slots(H, len(node))
        self.tree.mark_backed_up(node, slots)
        for j, s in enumerate(slots.tolist()):
            self.host[toks[: len(toks) - len(node) + j + 1]] = s

    @rule(i=st.integers(0, 50))
    def load(self, i):
        nodes = [n for n in walk(self.tree.root) if not n.on_device]
        if not nodes:
            return
        for node in self.tree.nodes_to_load(nodes[i % len(nodes)]):
            toks = path_tokens(node)
            slots = self._slots(D, len(node))
            self.tree.mark_loaded(node, slots)
            for j, s in enumerate(slots.tolist()):
                self.dev[toks[: len(toks) - len(node) + j + 1]] = s

    @rule(i=st.integers(0, 50))
    def hash_path(self, i):
        """The tree's lazy hashing, mixed with hashes handed in by inserts."""
        nodes = walk(self.tree.root)
        if nodes:
            assert (
                len(self.tree.page_hashes(nodes[i % len(nodes)]))
                == len(nodes[i % len(nodes)]) // self.page_size
            )

    @invariant()
    def eviction_order_is_the_policy_order(self):
        """A pass that evicts nothing yields every leaf in policy order and leaves that
        order as it was, whether it ran to the end or stopped halfway."""
        if not hasattr(self, "tree"):
            return
        for tier in (D, H):
            expect = [n.id for n in self._policy_order(tier)]
            with closing(self.tree._leaves[tier].order()) as order:
                assert [n.id for _, n in zip(range(len(expect) // 2), order)] == expect[
                    : len(expect) // 2
                ]
            for _ in range(2):
                with closing(self.tree._leaves[tier].order()) as order:
                    assert [n.id for n in order] == expect

    @invariant()
    def consistent(self):
        if not hasattr(self, "tree"):
            return
        self.tree.sanity_check()
        assert self.tree.total_size(D) == len(self.dev)
        assert self.tree.total_size(H) == len(self.host)


class TreeMachinePage4(TreeMachine):
    page_size = 4


class TreeMachinePage16(TreeMachine):
    page_size = 16


class TreeMachineLFU(TreeMachine):
    policy = "lfu"


class TreeMachineMRU(
    TreeMachine
):  # keys shrink on a touch: the order heapifies per pass
    policy = "mru"


_settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestTreePage1 = TreeMachine.TestCase
TestTreePage1.settings = _settings
TestTreePage4 = TreeMachinePage4.TestCase
TestTreePage4.settings = _settings
TestTreePage16 = TreeMachinePage16.TestCase
TestTreePage16.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
TestTreeLFU = TreeMachineLFU.TestCase
TestTreeLFU.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestTreeMRU = TreeMachineMRU.TestCase
TestTreeMRU.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
