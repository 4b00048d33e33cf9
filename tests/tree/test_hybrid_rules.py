"""Each component rule of the hybrid tree on a toy tree with exact slots."""

import numpy as np
import pytest
import torch

from kvtier.tree import (
    Component,
    HybridRadixTree,
    RadixKey,
    RadixTree,
    Tier,
    TreeNode,
    make_tree,
)

D, H = Tier.DEVICE, Tier.HOST
FULL, SWA, MAMBA = Component.FULL, Component.SWA, Component.MAMBA


def key(tokens):
    return RadixKey(np.asarray(tokens, dtype=np.int64))


def ar(a, b):
    return torch.arange(a, b, dtype=torch.int64)


def test_full_only_tree_is_the_plain_tree():
    tree = make_tree((FULL,), page_size=2)
    assert type(tree) is RadixTree and tree.components == (FULL,)
    r = tree.insert(key(range(4)), ar(2, 6))
    assert type(r.last_node) is TreeNode and r.frees is None
    assert tree.evict_device(4).frees is None
    hybrid = make_tree(("full", "swa"), swa_window=4, page_size=2)
    assert isinstance(hybrid, HybridRadixTree) and hybrid.components == (FULL, SWA)
    tree.sanity_check()
    hybrid.sanity_check()


def test_swa_match_needs_the_window_that_ends_there_on_the_tier():
    tree = HybridRadixTree(page_size=2, components=(FULL, SWA), swa_window=4)
    r = tree.insert(key(range(4)), ar(2, 6), swa_indices=ar(100, 104))
    assert len(r.frees) == 0  # every page ends a window that runs from the root
    # the request freed its SWA KV of [4, 6): a tombstone there; [6, 12) is 6 tokens,
    # more than the window, so every window in it is complete and kept
    r = tree.insert(key(range(12)), ar(2, 14), swa_indices=ar(106, 112), swa_start=6)
    assert r.prefix_len == 4 and len(r.frees) == 0
    tomb, tail = r.added
    assert (tomb.start, tomb.end, tomb.swa[D]) == (4, 6, None)
    assert tail.swa[D].tolist() == list(range(106, 112))
    m = tree.match_prefix(key(range(12)))
    assert m.device_indices.tolist() == list(range(2, 14))  # [8, 12) is there
    m = tree.match_prefix(key(range(10)))
    assert m.device_indices.tolist() == list(range(2, 12))  # [6, 10) is there
    m = tree.match_prefix(key(range(8)))
    assert m.device_indices.tolist() == list(range(2, 6))  # [4, 8) is not: stops at 4
    assert m.last_device_node.end == 4 and m.host_hit_length == 0
    tree.sanity_check()


def test_mamba_match_needs_a_state_at_exactly_that_node_and_host_counts_as_host_hit():
    tree = HybridRadixTree(page_size=1, components=(FULL, MAMBA))
    px = tree.insert(key([1, 2, 3, 4, 5]), ar(1, 6), mamba_slot=7)
    assert px.frees.mamba_device.tolist() == []
    # P+Y: the FULL KV of P = [1, 2, 3] is there, but no state at its end: no hit
    m = tree.match_prefix(key([1, 2, 3, 9, 9]))
    assert m.last_device_node is tree.root and m.host_hit_length == 0
    m = tree.match_prefix(key([1, 2, 3, 4, 5, 6]))
    assert m.last_device_node is px.last_node and m.device_indices.tolist() == [
        1,
        2,
        3,
        4,
        5,
    ]
    # the state moves to host only: restorable from host, not on device
    p = px.last_node.parent
    tree.mark_backed_up(p, ar(11, 14))
    tree.mark_backed_up(px.last_node, ar(14, 16))
    tree.set_component(px.last_node, MAMBA, H, 3)
    assert tree.evict_component(MAMBA, D, 1).frees.mamba_device.tolist() == [7]
    m = tree.match_prefix(key([1, 2, 3, 4, 5]))
    assert m.last_device_node is tree.root and m.device_indices.tolist() == []
    assert m.last_host_node is px.last_node and m.host_hit_length == 5
    tree.sanity_check()


def test_split_keeps_swa_kv_with_its_tokens_and_the_state_with_the_lower_half():
    tree = HybridRadixTree(page_size=1, components=(FULL, SWA, MAMBA), swa_window=8)
    r = tree.insert(key(range(6)), ar(1, 7), swa_indices=ar(21, 27), mamba_slot=5)
    node = r.last_node
    assert node.swa[D].tolist() == list(range(21, 27)) and node.mamba[D] == 5
    other = tree.insert(
        key([0, 1, 2, 3, 9]), ar(40, 45), swa_indices=ar(50, 55), mamba_slot=6
    )
    upper = node.parent
    assert upper.end == 4 and node.start == 4
    assert upper.swa[D].tolist() == [21, 22, 23, 24] and node.swa[D].tolist() == [
        25,
        26,
    ]
    assert upper.mamba == [None, None] and node.mamba[D] == 5
    # the second insert's first 4 tokens were there: its SWA slots for them come back
    assert sorted(other.frees.swa_device.tolist()) == [50, 51, 52, 53]
    assert other.last_node.swa[D].tolist() == [54] and other.last_node.mamba[D] == 6
    tree.sanity_check()


def test_insert_frees_the_swa_kv_outside_the_window_of_its_state():
    tree = HybridRadixTree(page_size=2, components=(FULL, SWA, MAMBA), swa_window=3)
    r = tree.insert(key(range(12)), ar(2, 14), swa_indices=ar(102, 114), mamba_slot=1)
    # the window (3 tokens, 2 pages = 4 tokens) ends at 12: [8, 12) is kept, [0, 8) freed
    assert r.frees.swa_device.tolist() == list(range(102, 110))
    assert [(n.start, n.end) for n in r.added] == [(0, 8), (8, 12)]
    assert r.added[0].swa == [None, None] and r.added[1].swa[D].tolist() == [
        110,
        111,
        112,
        113,
    ]
    # without a state nothing ends a window: all of it is freed at once
    r = tree.insert(key([7] * 6), ar(20, 26), swa_indices=ar(120, 126))
    assert r.frees.swa_device.tolist() == list(range(120, 126))
    assert tree.component_evictable_size(SWA) == 4
    tree.sanity_check()


def test_a_lock_keeps_its_window_and_unlock_frees_what_it_alone_kept():
    tree = HybridRadixTree(page_size=1, components=(FULL, SWA, MAMBA), swa_window=4)
    r = tree.insert(key(range(8)), ar(1, 9), swa_indices=ar(10, 18), mamba_slot=1)
    leaf = r.last_node
    assert r.frees.swa_device.tolist() == [10, 11, 12, 13]
    m = tree.match_prefix(key([0, 1, 2, 3, 4, 5, 9]))  # splits the leaf at 6
    assert m.last_device_node is tree.root  # no state at 6: no hit
    mid = leaf.parent
    assert (mid.start, mid.end) == (4, 6)
    tree.lock(mid)  # its window [2, 6): only [4, 6) holds SWA KV
    assert tree.component_protected_size(SWA) == 2
    assert tree.component_evictable_size(SWA) == 2
    ev = tree.evict_component(MAMBA, D, 1)  # the state at 8 goes: its window is dead
    assert ev.frees.mamba_device.tolist() == [1]
    assert ev.frees.swa_device.tolist() == [16, 17]  # [6, 8): no lock, no state
    assert mid.swa[D].tolist() == [14, 15]  # [4, 6): the lock's window keeps it
    frees = tree.unlock(mid)
    assert frees.swa_device.tolist() == [14, 15]
    assert tree.component_evictable_size(SWA) == tree.component_protected_size(SWA) == 0
    tree.sanity_check()


def test_evicting_full_kv_takes_the_components_on_that_tier():
    tree = HybridRadixTree(page_size=1, components=(FULL, SWA, MAMBA), swa_window=2)
    r = tree.insert(key([1, 2, 3]), ar(1, 4), swa_indices=ar(11, 14), mamba_slot=2)
    node = r.last_node
    assert r.frees.swa_device.tolist() == [11]
    tree.mark_backed_up(node, ar(31, 34))
    tree.set_component(node, MAMBA, H, 9)
    upper = node.parent  # the state's window [1, 3) starts on a node boundary
    assert (upper.start, node.start) == (0, 1)
    ev = tree.evict_device(3)
    assert ev.demoted == [node, upper] and sorted(ev.device_indices.tolist()) == [
        1,
        2,
        3,
    ]
    # the device copies go with the FULL KV; the host state stays, and no window is
    # complete on either tier any more (the SWA KV was on device only)
    assert ev.frees.mamba_device.tolist() == [2]
    assert ev.frees.swa_device.tolist() == [12, 13]
    assert node.mamba == [None, 9] and node.swa == [None, None]
    m = tree.match_prefix(key([1, 2, 3]))
    assert m.last_host_node is tree.root  # the window is gone on both tiers
    hev = tree.evict_host(3)
    assert hev.removed == [node, upper] and hev.frees.mamba_host.tolist() == [9]
    tree.sanity_check()


def test_component_eviction_is_lru_by_its_own_clock_and_skips_locked_values():
    tree = HybridRadixTree(page_size=1, components=(FULL, MAMBA))
    a = tree.insert(key([1, 1]), ar(1, 3), mamba_slot=1).last_node
    b = tree.insert(key([2, 2]), ar(3, 5), mamba_slot=2).last_node
    c = tree.insert(key([3, 3]), ar(5, 7), mamba_slot=3).last_node
    tree.match_prefix(key([1, 1]))  # a is the most recently used state now
    tree.lock(b)
    ev = tree.evict_component(MAMBA, D, 2)
    assert ev.evicted == 2 and ev.frees.mamba_device.tolist() == [3, 1]
    assert b.mamba[D] == 2 and a.mamba[D] is None and c.mamba[D] is None
    assert tree.component_protected_size(MAMBA) == 1
    assert tree.evict_component(MAMBA, D, 5).evicted == 0  # the locked one stays
    tree.unlock(b)
    assert tree.evict_component(MAMBA, D, 5).frees.mamba_device.tolist() == [2]
    assert tree.total_size(D) == 6  # the nodes and their FULL KV stay
    tree.sanity_check()


def test_sanity_check_recomputes_the_component_totals_and_windows():
    tree = HybridRadixTree(page_size=1, components=(FULL, SWA, MAMBA), swa_window=2)
    node = tree.insert(
        key([1, 2, 3, 4]), ar(1, 5), swa_indices=ar(11, 15), mamba_slot=1
    ).last_node
    tree.sanity_check()
    tree._side_evictable[0][D] += 1
    with pytest.raises(AssertionError, match="swa DEVICE sizes"):
        tree.sanity_check()
    tree._side_evictable[0][D] -= 1
    node.parent.swa[D] = np.array([11, 12], dtype=np.int64)  # kept outside every window
    tree._side_evictable[0][D] += 2
    with pytest.raises(AssertionError, match="in no live window"):
        tree.sanity_check()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(components=(SWA,), swa_window=4), "must include FULL"),
        (dict(components=(FULL, SWA)), "swa_window=None"),
        (dict(components=(FULL, SWA), swa_window=0), "swa_window=0"),
        (dict(components=(FULL, MAMBA), swa_window=4), "only a tree with an SWA"),
        (dict(components=(FULL, "mlp")), "'mlp' is not a component"),
        (dict(components="full"), "expected a collection"),
    ],
)
def test_bad_component_sets_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridRadixTree(**kwargs)


@pytest.mark.parametrize("page_size", [0, "2"])
def test_make_tree_refuses_a_bad_page_size_by_name(page_size):
    with pytest.raises(ValueError, match=f"page_size={page_size!r}"):
        make_tree((FULL, SWA), swa_window=4, page_size=page_size)


def test_bad_component_input_changes_nothing():
    tree = HybridRadixTree(page_size=2, components=(FULL, MAMBA))
    with pytest.raises(ValueError, match="not a side component of this tree"):
        tree.insert(key(range(4)), ar(2, 6), swa_indices=ar(2, 6))
    with pytest.raises(ValueError, match="mamba_slot=0"):
        tree.insert(key(range(4)), ar(2, 6), mamba_slot=0)
    assert tree.total_size(D) == 0
    node = tree.insert(key(range(4)), ar(2, 6)).last_node
    with pytest.raises(ValueError, match="no FULL KV on host"):
        tree.set_component(node, MAMBA, H, 3)
    with pytest.raises(ValueError, match="not a node of this tree"):
        tree.set_component(tree.root, MAMBA, D, 3)
    swa_tree = HybridRadixTree(page_size=2, components=(FULL, SWA), swa_window=2)
    with pytest.raises(ValueError, match="swa_start=1"):
        swa_tree.insert(key(range(4)), ar(2, 6), swa_indices=ar(2, 5), swa_start=1)
    with pytest.raises(ValueError, match="swa_indices: expected 2 indices"):
        swa_tree.insert(key(range(4)), ar(2, 6), swa_indices=ar(2, 5), swa_start=2)
    assert swa_tree.total_size(D) == 0
    tree.sanity_check()
    swa_tree.sanity_check()


def test_unlock_must_name_the_node_that_was_locked():
    tree = HybridRadixTree(page_size=1, components=(FULL, SWA, MAMBA), swa_window=2)
    leaf = tree.insert(
        key([1, 2, 3]), ar(1, 4), swa_indices=ar(11, 14), mamba_slot=2
    ).last_node
    tree.lock(leaf)
    assert [n.end for n in tree.window_nodes(leaf)] == [3]  # [1, 3) is one node
    with pytest.raises(ValueError, match="no lock was taken at"):
        tree.unlock(leaf.parent)
    assert leaf.locks[D] == 1 and tree.component_protected_size(MAMBA) == 1
    assert len(tree.unlock(leaf)) == 0
    tree.sanity_check()


def test_insert_never_lists_a_slot_the_tree_keeps():
    """A request matches a prefix, locks it, computes on and inserts: the SWA slots of the
    window it matched are the tree's own, and given back they must not come back to be
    freed (the pool would hand out a slot the tree still reads). Same for a state slot."""
    tree = HybridRadixTree(page_size=1, components=(FULL, SWA, MAMBA), swa_window=2)
    tree.insert(key([1, 2, 3, 4]), ar(1, 5), swa_indices=ar(11, 15), mamba_slot=3)
    m = tree.match_prefix(key([1, 2, 3, 4, 5, 6]))
    assert m.device_indices.tolist() == [1, 2, 3, 4]
    tree.lock(m.last_device_node)
    window = [n.swa[D].tolist() for n in tree.window_nodes(m.last_device_node)]
    assert window == [[13, 14]]
    # its SWA KV of [2, 6): the matched window (the tree's) and two fresh slots
    r = tree.insert(
        key([1, 2, 3, 4, 5, 6]),
        ar(1, 7),
        swa_indices=torch.tensor([13, 14, 15, 16]),
        swa_start=2,
        mamba_slot=4,
    )
    assert r.frees.swa_device.tolist() == [] and r.frees.mamba_device.tolist() == []
    assert r.last_node.swa[D].tolist() == [15, 16] and r.last_node.mamba[D] == 4
    tree.unlock(m.last_device_node)
    # inserting the matched end again with its own state slot frees nothing either
    r = tree.insert(key([1, 2, 3, 4]), ar(1, 5), mamba_slot=3)
    assert len(r.frees) == 0
    # a fresh duplicate is still listed
    r = tree.insert(key([1, 2, 3, 4]), ar(1, 5), mamba_slot=9)
    assert r.frees.mamba_device.tolist() == [9]
    tree.sanity_check()


def test_a_window_on_host_alone_is_no_device_hit():
    """FULL KV on device and the SWA window on host only: the device handle must stop
    short (its KV would be served without the window's SWA KV), the host handle not."""
    tree = HybridRadixTree(page_size=1, components=(FULL, SWA), swa_window=2)
    node = tree.insert(key([1, 2, 3]), ar(1, 4)).last_node  # no SWA KV given
    tree.mark_backed_up(node, ar(11, 14))
    assert len(tree.set_component(node, SWA, H, ar(21, 24))) == 0
    m = tree.match_prefix(key([1, 2, 3]))
    assert m.last_device_node is tree.root and m.device_indices.tolist() == []
    assert m.last_host_node is node and m.host_hit_length == 3
    assert tree.nodes_to_load(node) == []  # its FULL KV is on device: only SWA to load
    assert len(tree.set_component(node, SWA, D, ar(31, 34))) == 0
    m = tree.match_prefix(key([1, 2, 3]))
    assert m.last_device_node is node and m.device_indices.tolist() == [1, 2, 3]
    tree.sanity_check()


def test_swa_eviction_is_lru_by_the_windows_matches_touch():
    tree = HybridRadixTree(page_size=1, components=(FULL, SWA), swa_window=2)
    a, b, c = (
        tree.insert(
            key([t, t]), ar(2 * t, 2 * t + 2), swa_indices=ar(10 * t, 10 * t + 2)
        )
        for t in (1, 2, 3)
    )
    tree.match_prefix(key([1, 1]))  # a's window is the most recently used now
    ev = tree.evict_component(SWA, D, 2)
    assert ev.evicted == 2 and ev.frees.swa_device.tolist() == [20, 21]
    assert b.last_node.swa == [None, None] and a.last_node.swa[D] is not None
    assert tree.evict_component(SWA, D, 1).frees.swa_device.tolist() == [30, 31]
    tree.sanity_check()
