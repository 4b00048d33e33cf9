"""The hybrid tree against a reference model of the component rules, token by token:
which prefixes hold FULL KV, SWA KV and a Mamba state on which tier at which slot, which
matches every component accepts, and which SWA KV no live window needs (freed)."""

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

from kvtier.tree import Component, HybridRadixTree, RadixKey, Tier
from kvtier.tree.check import walk

D, H = Tier.DEVICE, Tier.HOST
FULL, SWA, MAMBA = Component.FULL, Component.SWA, Component.MAMBA


def path_tokens(node):
    parts = []
    while node.parent is not None:
        parts.append(node.key.tokens)
        node = node.parent
    return tuple(np.concatenate(parts[::-1]).tolist()) if parts else ()


def prefixes(seq, lo, hi):
    """The prefixes that end at tokens lo..hi-1 (the prefix of token i is seq[:i+1])."""
    return [tuple(seq[: i + 1]) for i in range(max(lo, 0), hi)]


class HybridMachine(RuleBasedStateMachine):
    page_size = 1
    window = 3
    components = (FULL, SWA, MAMBA)

    @initialize()
    def setup(self):
        self.tree = HybridRadixTree(
            page_size=self.page_size,
            components=self.components,
            swa_window=self.window if SWA in self.components else None,
        )
        ps = self.page_size
        self.swa_on, self.mamba_on = SWA in self.components, MAMBA in self.components
        self.wp = -(-self.window // ps) * ps
        # the model: prefix (tuple of tokens) -> slot, per tier
        self.full, self.swa, self.mamba = [{}, {}], [{}, {}], [{}, {}]
        self.anchors = [[], []]  # locked nodes per tier (their paths are stable)
        self.next = {"full": ps, "swa": ps, "mamba": 1}

    # -- helpers ------------------------------------------------------------------------------

    def _slots(self, kind, n):
        start = self.next[kind]
        self.next[kind] += n
        return torch.arange(start, start + n, dtype=torch.int64)

    def _seq(self, pages):
        return [p % 4 for p in pages for _ in range(self.page_size)]

    def _window(self, path):
        return prefixes(path, len(path) - self.wp, len(path))

    def _dead(self):
        """SWA prefixes in no live window: a window of wp tokens that ends at a match point
        (a page boundary; with Mamba, a state on some tier) with SWA KV on some tier for all
        its tokens, or that ends at a lock."""
        swa = set(self.swa[D]) | set(self.swa[H])
        if self.mamba_on:
            ends = set(self.mamba[D]) | set(self.mamba[H])
        else:
            ends = {
                p
                for p in set(self.full[D]) | set(self.full[H])
                if len(p) % self.page_size == 0
            }
        live = set()
        for p in ends:
            win = self._window(p)
            if all(w in swa for w in win):
                live.update(win)
        for tier in (D, H):
            for node in self.anchors[tier]:
                live.update(w for w in self._window(path_tokens(node)) if w in swa)
        return swa - live

    def _settle(self):
        """Drop what is dead; returns the slots dropped per tier."""
        out = [[], []]
        for p in self._dead():
            for tier in (D, H):
                if p in self.swa[tier]:
                    out[tier].append(self.swa[tier].pop(p))
        return out

    def _held(self, tier):
        """Per component, the prefixes a lock on `tier` protects."""
        full, swa, mamba = set(), set(), set()
        for node in self.anchors[tier]:
            path = path_tokens(node)
            full.update(prefixes(path, 0, len(path)))
            swa.update(self._window(path))
            mamba.add(path)
        return full, swa, mamba

    def _check_frees(self, frees, swa_d, swa_h, mamba_d, mamba_h):
        got = [frees.swa_device, frees.swa_host, frees.mamba_device, frees.mamba_host]
        for name, g, want in zip(
            ("swa D", "swa H", "mamba D", "mamba H"),
            got,
            (swa_d, swa_h, mamba_d, mamba_h),
        ):
            assert sorted(g.tolist()) == sorted(want), (
                f"{name} frees {g.tolist()} != {want}"
            )

    def _accepts(self, seq, n, tiers):
        if n == 0:
            return True
        p = tuple(seq[:n])
        if not all(any(q in self.full[t] for t in tiers) for q in prefixes(seq, 0, n)):
            return False
        if self.swa_on and not all(
            any(q in self.swa[t] for t in tiers)
            for q in prefixes(seq, n - self.window, n)
        ):
            return False
        return not self.mamba_on or any(p in self.mamba[t] for t in tiers)

    def _nodes(self, pred):
        return [n for n in walk(self.tree.root) if pred(n)]

    # -- rules --------------------------------------------------------------------------------

    @rule(
        pages=st.lists(st.integers(0, 3), min_size=1, max_size=6),
        swa_from=st.integers(0, 6),
        with_state=st.booleans(),
        reuse=st.booleans(),
    )
    def insert(self, pages, swa_from, with_state, reuse):
        """`reuse`: the request passes back the tree's own SWA and state slots where the
        tree holds them on device (what it matched), as a server's request does."""
        seq = self._seq(pages)
        n = len(seq)
        full = self._slots("full", n)
        swa_start = min(swa_from, len(pages)) * self.page_size if self.swa_on else n
        swa = self._slots("swa", n - swa_start) if self.swa_on else None
        state = (
            int(self._slots("mamba", 1)[0]) if self.mamba_on and with_state else None
        )
        if reuse:
            for i, p in enumerate(prefixes(seq, swa_start, n)):
                if p in self.swa[D]:
                    swa[i] = self.swa[D][p]
            if state is not None and tuple(seq) in self.mamba[D]:
                state = self.mamba[D][tuple(seq)]
        existing = sum(1 for p in prefixes(seq, 0, n) if p in self.full[D])
        r = self.tree.insert(
            RadixKey(seq), full, swa_indices=swa, swa_start=swa_start, mamba_slot=state
        )
        assert r.prefix_len == existing
        for i, p in enumerate(prefixes(seq, 0, n)):
            self.full[D].setdefault(p, int(full[i]))
        unkept_swa, unkept_state = [], []
        for i, p in enumerate(prefixes(seq, swa_start, n)):
            if p in self.swa[D]:
                if self.swa[D][p] != int(swa[i]):
                    unkept_swa.append(int(swa[i]))
            else:
                self.swa[D][p] = int(swa[i])
        if state is not None:
            if tuple(seq) in self.mamba[D]:
                if self.mamba[D][tuple(seq)] != state:
                    unkept_state.append(state)
            else:
                self.mamba[D][tuple(seq)] = state
        dead = self._settle()
        self._check_frees(r.frees, unkept_swa + dead[D], dead[H], unkept_state, [])
        assert [len(a) for a in r.added] == [
            len(a) for a in r.added if a.values[H] is None
        ]

    @rule(pages=st.lists(st.integers(0, 3), max_size=7), tail=st.integers(0, 3))
    def match(self, pages, tail):
        seq = self._seq(pages) + [7] * (tail % self.page_size)
        m = self.tree.match_prefix(RadixKey(seq))
        known = 0  # FULL KV the tree has for the key, on any tier, in whole pages
        while known + 1 <= len(seq) and any(
            tuple(seq[: known + 1]) in f for f in self.full
        ):
            known += 1
        known -= known % self.page_size
        points = range(0, known + 1, self.page_size)
        on_device = max(n for n in points if self._accepts(seq, n, (D,)))
        anywhere = max(n for n in points if self._accepts(seq, n, (D, H)))
        expect = [self.full[D][p] for p in prefixes(seq, 0, on_device)]
        assert m.device_indices.tolist() == expect
        assert len(path_tokens(m.last_device_node)) == on_device
        assert len(path_tokens(m.last_host_node)) == anywhere
        assert m.best_match_node is m.last_host_node
        assert m.host_hit_length == anywhere - on_device

    @rule(pages=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def lock_match(self, pages):
        m = self.tree.match_prefix(RadixKey(self._seq(pages)))
        if m.last_device_node is not self.tree.root:
            self.tree.lock(m.last_device_node)
            self.anchors[D].append(m.last_device_node)

    @rule(i=st.integers(0, 50))
    def lock_any(self, i):
        """A lock on a node no match returned (an inserted request's last node)."""
        nodes = self._nodes(lambda n: n.on_device)
        if nodes:
            node = nodes[i % len(nodes)]
            self.tree.lock(node)
            self.anchors[D].append(node)

    @precondition(lambda self: self.anchors[D])
    @rule(i=st.integers(0, 50))
    def unlock(self, i):
        node = self.anchors[D].pop(i % len(self.anchors[D]))
        frees = self.tree.unlock(node)
        dead = self._settle()
        self._check_frees(frees, dead[D], dead[H], [], [])

    @rule(i=st.integers(0, 50))
    def protect_host(self, i):
        nodes = self._nodes(lambda n: n.backed_up)
        if nodes:
            node = nodes[i % len(nodes)]
            self.tree.protect_host(node)
            self.anchors[H].append(node)

    @precondition(lambda self: self.anchors[H])
    @rule(i=st.integers(0, 50))
    def release_host(self, i):
        node = self.anchors[H].pop(i % len(self.anchors[H]))
        frees = self.tree.release_host(node)
        dead = self._settle()
        self._check_frees(frees, dead[D], dead[H], [], [])

    @rule(i=st.integers(0, 50))
    def backup(self, i):
        nodes = self._nodes(
            lambda n: (
                not n.backed_up and (n.parent is self.tree.root or n.parent.backed_up)
            )
        )
        if not nodes:
            return
        node = nodes[i % len(nodes)]
        path = path_tokens(node)
        slots = self._slots("full", len(node))
        self.tree.mark_backed_up(node, slots)
        for p, s in zip(
            prefixes(path, len(path) - len(node), len(path)), slots.tolist()
        ):
            self.full[H][p] = s

    @rule(i=st.integers(0, 50))
    def load(self, i):
        nodes = self._nodes(lambda n: not n.on_device)
        if not nodes:
            return
        for node in self.tree.nodes_to_load(nodes[i % len(nodes)]):
            path = path_tokens(node)
            slots = self._slots("full", len(node))
            self.tree.mark_loaded(node, slots)
            for p, s in zip(
                prefixes(path, len(path) - len(node), len(path)), slots.tolist()
            ):
                self.full[D][p] = s

    @rule(
        i=st.integers(0, 50),
        component=st.sampled_from([SWA, MAMBA]),
        tier=st.sampled_from([D, H]),
    )
    def set_component(self, i, component, tier):
        """A copy of a node's SWA KV or state lands on a tier (backup, load, the store)."""
        if component not in self.components:
            return
        values = "swa" if component == SWA else "mamba"
        nodes = self._nodes(
            lambda n: n.values[tier] is not None and getattr(n, values)[tier] is None
        )
        if not nodes:
            return
        node = nodes[i % len(nodes)]
        path = path_tokens(node)
        if component == SWA:
            slots = self._slots("swa", len(node))
            frees = self.tree.set_component(node, SWA, tier, slots)
            for p, s in zip(
                prefixes(path, len(path) - len(node), len(path)), slots.tolist()
            ):
                self.swa[tier][p] = s
        else:
            slot = int(self._slots("mamba", 1)[0])
            frees = self.tree.set_component(node, MAMBA, tier, slot)
            self.mamba[tier][path] = slot
        dead = self._settle()
        self._check_frees(frees, dead[D], dead[H], [], [])

    def _drop_full(self, tier, slots):
        """FULL KV left `tier` at `slots`: the components there go with it."""
        by_slot = {s: p for p, s in self.full[tier].items()}
        locked = self._held(tier)[0]
        comps = [[], []]
        for s in slots:
            p = by_slot.pop(s)
            assert p not in locked, "evicted a locked prefix"
            if tier == H:
                assert p not in self.full[D], "host eviction took a node on device"
            del self.full[tier][p]
            if p in self.swa[tier]:
                comps[0].append(self.swa[tier].pop(p))
            if p in self.mamba[tier]:
                comps[1].append(self.mamba[tier].pop(p))
        return comps

    @rule(n=st.integers(0, 12))
    def evict_device(self, n):
        before = self.tree.evictable_size(D)
        r = self.tree.evict_device(n)
        freed = r.device_indices.tolist()
        assert len(freed) == r.evicted_tokens >= min(n, before)
        comps = self._drop_full(D, freed)
        dead = self._settle()
        self._check_frees(r.frees, comps[0] + dead[D], dead[H], comps[1], [])

    @rule(n=st.integers(0, 12))
    def evict_host(self, n):
        r = self.tree.evict_host(n)
        comps = self._drop_full(H, r.host_indices.tolist())
        dead = self._settle()
        self._check_frees(r.frees, dead[D], comps[0] + dead[H], [], comps[1])

    @rule(
        component=st.sampled_from([SWA, MAMBA]),
        tier=st.sampled_from([D, H]),
        n=st.integers(0, 8),
    )
    def evict_component(self, component, tier, n):
        if component not in self.components:
            return
        before = self.tree.component_evictable_size(component, tier)
        r = self.tree.evict_component(component, tier, n)
        store = self.swa if component == SWA else self.mamba
        got = (
            (r.frees.swa_device, r.frees.swa_host)
            if component == SWA
            else (r.frees.mamba_device, r.frees.mamba_host)
        )[tier].tolist()
        assert r.evicted == len(got) >= min(n, before)
        by_slot = {s: p for p, s in store[tier].items()}
        _, swa_held, mamba_held = self._held(tier)
        held = swa_held if component == SWA else mamba_held
        for s in got:
            p = by_slot.pop(s)
            assert p not in held, f"evicted a locked {component!s} value at {p}"
            del store[tier][p]
        dead = self._settle()
        if component == SWA:
            assert not dead[tier], f"dead SWA left on {tier.name}: {dead[tier]}"
            other = dead[1 - tier]
            self._check_frees(
                r.frees,
                *((got, other) if tier == D else (other, got)),
                [],
                [],
            )
        else:
            self._check_frees(
                r.frees,
                dead[D],
                dead[H],
                got if tier == D else [],
                got if tier == H else [],
            )

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def same_as_model(self):
        if not hasattr(self, "tree"):
            return
        self.tree.sanity_check()
        full, swa, mamba = [{}, {}], [{}, {}], [{}, {}]
        for node in walk(self.tree.root):
            path = path_tokens(node)
            ps = prefixes(path, len(path) - len(node), len(path))
            for tier in (D, H):
                for store, values in ((full, node.values), (swa, node.swa)):
                    if values[tier] is not None:
                        store[tier].update(zip(ps, values[tier].tolist()))
                if node.mamba[tier] is not None:
                    mamba[tier][path] = node.mamba[tier]
        assert full == self.full, "FULL KV differs from the model"
        assert swa == self.swa, "SWA KV differs from the model"
        assert mamba == self.mamba, "Mamba states differ from the model"
        for tier in (D, H):
            total = self.tree.component_evictable_size(FULL, tier)
            total += self.tree.component_protected_size(FULL, tier)
            assert total == len(self.full[tier])
            if self.swa_on:
                assert self.tree.component_evictable_size(
                    SWA, tier
                ) + self.tree.component_protected_size(SWA, tier) == len(self.swa[tier])
            if self.mamba_on:
                assert self.tree.component_evictable_size(
                    MAMBA, tier
                ) + self.tree.component_protected_size(MAMBA, tier) == len(
                    self.mamba[tier]
                )


class SwaMambaPage2(HybridMachine):
    page_size = 2
    window = 3  # not a whole number of pages: rounds up to 4 tokens


class SwaOnly(HybridMachine):
    components = (FULL, SWA)
    window = 2


class SwaOnlyPage2(HybridMachine):
    components = (FULL, SWA)
    page_size = 2
    window = 4


class MambaOnly(HybridMachine):
    components = (FULL, MAMBA)
    page_size = 2


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSwaMamba = HybridMachine.TestCase
TestSwaMamba.settings = _settings
TestSwaMambaPage2 = SwaMambaPage2.TestCase
TestSwaMambaPage2.settings = _settings
TestSwaOnly = SwaOnly.TestCase
TestSwaOnly.settings = _settings
TestSwaOnlyPage2 = SwaOnlyPage2.TestCase
TestSwaOnlyPage2.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None
)
TestMambaOnly = MambaOnly.TestCase
TestMambaOnly.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None
)
