import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tree import RadixKey, RadixTree, Tier
from kvtier.tree.key import common_prefix

from tests.gil import gil_watch

D, H = Tier.DEVICE, Tier.HOST


def key(tokens, extra=None):
    return RadixKey(np.asarray(tokens, dtype=np.int64), extra)


def test_two_node_prefix_match_lock_insert_evict():
    tree = RadixTree(page_size=1)
    prompt = np.arange(10_000, 10_000 + 2_239)
    first = tree.insert(key(prompt[:512]), torch.arange(1, 513))
    second = tree.insert(key(prompt[:2048]), torch.arange(1, 2049))
    assert first.prefix_len == 0 and second.prefix_len == 512
    assert [len(n) for n in second.added] == [1536]

    m = tree.match_prefix(key(prompt[:2144]))
    assert m.device_indices.tolist() == list(range(1, 2049))
    assert (
        m.last_device_node is second.last_node and len(m.last_device_node) == 1536
    )  # no split
    assert (
        m.host_hit_length == 0
        and m.last_host_node is m.last_device_node is m.best_match_node
    )

    tree.lock(m.last_device_node)
    assert tree.protected_size() == 2048 and tree.evictable_size() == 0

    slots = torch.cat([m.device_indices, torch.arange(3000, 3000 + 191)])
    r = tree.insert(key(prompt), slots)
    assert r.prefix_len == 2048 and [len(n) for n in r.added] == [191]
    leaf = r.last_node
    assert tree.evictable_size() == 191

    tree.unlock(m.last_device_node)
    assert tree.protected_size() == 0 and tree.evictable_size() == 2239
    ev = tree.evict_device(191)
    assert ev.removed == [leaf] and ev.device_indices.tolist() == list(
        range(3000, 3191)
    )
    assert m.last_device_node.id in tree._leaves[D]  # its parent became a leaf
    tree.sanity_check()


def test_mid_edge_split_carries_locks_hashes_hits_and_leaf_membership():
    tree = RadixTree(page_size=2, namespace_id="ns")
    r = tree.insert(key(range(8)), torch.arange(2, 10))
    node = r.last_node
    full_hashes = list(tree.page_hashes(node))
    tree.lock(node)
    tree.match_prefix(key(range(8)))  # hit_count 1
    m = tree.match_prefix(key([0, 1, 2, 3, 99, 98]))  # diverges after 4 tokens
    upper = m.last_device_node
    assert upper is not node and upper.children and node.parent is upper
    assert len(upper) == 4 and len(node) == 4
    assert upper.locks == node.locks == [1, 0]
    assert upper.hit_count == 2 and node.hit_count == 1
    assert upper.hashes + node.hashes == full_hashes
    assert tree.page_hashes(node) == full_hashes[2:]
    assert upper.id not in tree._leaves[D] and node.id not in tree._leaves[D]  # locked
    assert m.device_indices.tolist() == [2, 3, 4, 5]
    tree.unlock(node)  # the handle stays valid across the split
    assert tree.evictable_size() == 8 and tree.protected_size() == 0
    assert node.id in tree._leaves[D] and upper.id not in tree._leaves[D]
    tree.sanity_check()


def test_three_handles_diverge_with_host_only_tail():
    tree = RadixTree(page_size=1)
    a = tree.insert(key([1, 2, 3]), torch.tensor([11, 12, 13])).last_node
    b = tree.insert(key([1, 2, 3, 4, 5]), torch.tensor([11, 12, 13, 14, 15])).last_node
    tree.mark_backed_up(a, torch.tensor([21, 22, 23]))
    tree.mark_backed_up(b, torch.tensor([24, 25]))
    ev = tree.evict_device(2)
    assert ev.demoted == [b] and ev.device_indices.tolist() == [14, 15]
    m = tree.match_prefix(key([1, 2, 3, 4, 5, 6]))
    assert m.last_device_node is a and m.last_host_node is b and m.best_match_node is b
    assert m.host_hit_length == 2 and m.device_indices.tolist() == [11, 12, 13]
    assert tree.nodes_to_load(b) == [b]
    tree.mark_loaded(b, torch.tensor([31, 32]))
    m = tree.match_prefix(key([1, 2, 3, 4, 5]))
    assert m.last_device_node is b and m.host_hit_length == 0
    assert m.device_indices.tolist() == [11, 12, 13, 31, 32]
    tree.sanity_check()


def test_insert_over_host_only_node_adopts_slots():
    tree = RadixTree()
    n = tree.insert(key([1, 2]), torch.tensor([5, 6])).last_node
    tree.mark_backed_up(n, torch.tensor([7, 8]))
    tree.evict_device(2)
    r = tree.insert(key([1, 2, 3]), torch.tensor([40, 41, 42]))
    assert r.prefix_len == 0  # nothing was on device: the caller's slots are all kept
    assert n.values[Tier.DEVICE].tolist() == [40, 41]
    assert n.values[Tier.HOST].tolist() == [7, 8]
    tree.sanity_check()


def test_insert_host_under_anchor_and_host_eviction():
    tree = RadixTree(page_size=2)
    a = tree.insert(key([1, 2]), torch.tensor([2, 3])).last_node
    tree.mark_backed_up(a, torch.tensor([4, 5]))
    r = tree.insert_host(a, key([3, 4, 5, 6]), torch.tensor([6, 7, 8, 9]))
    assert r.prefix_len == 0 and len(r.last_node) == 4 and not r.last_node.on_device
    again = tree.insert_host(a, key([3, 4]), torch.tensor([10, 11]))
    assert again.prefix_len == 2  # already there: the caller frees [10, 11]
    assert tree.total_size(H) == 6
    m = tree.match_prefix(key([1, 2, 3, 4, 5, 6]))
    assert m.host_hit_length == 4 and m.last_device_node is a
    ev = tree.evict_host(1)
    assert sorted(ev.host_indices.tolist()) == [
        8,
        9,
    ]  # split left [3,4] and [5,6]; deepest leaf goes
    tree.sanity_check()
    with pytest.raises(ValueError, match="anchor .* is not on host"):
        b = tree.insert(key([7, 8]), torch.tensor([12, 13])).last_node
        tree.insert_host(b, key([9, 9]), torch.tensor([14, 15]))
    tree.sanity_check()


def test_write_back_lists_leaves_needing_backup():
    tree = RadixTree()
    n = tree.insert(key([1, 2, 3]), torch.tensor([1, 2, 3])).last_node
    ev = tree.evict_device(3, backup_first=True)
    assert ev.needs_backup == [n] and ev.evicted_tokens == 0 and n.on_device
    tree.mark_backed_up(n, torch.tensor([4, 5, 6]))
    ev = tree.evict_device(3, backup_first=True)
    assert ev.demoted == [n] and ev.device_indices.tolist() == [1, 2, 3]
    tree.sanity_check()


def test_extra_keys_never_match():
    tree = RadixTree()
    tree.insert(key([1, 2, 3], "lora-a"), torch.tensor([1, 2, 3]))
    assert tree.match_prefix(key([1, 2, 3], "lora-b")).device_indices.numel() == 0
    assert tree.match_prefix(key([1, 2, 3])).device_indices.numel() == 0
    assert tree.match_prefix(key([1, 2, 3], "lora-a")).device_indices.tolist() == [
        1,
        2,
        3,
    ]
    tree.sanity_check()


def test_split_while_write_in_flight_backs_up_both_halves():
    tree = RadixTree()
    n = tree.insert(key([1, 2, 3, 4]), torch.tensor([1, 2, 3, 4])).last_node
    tree.lock(n)  # the controller holds the node during the write
    tree.match_prefix(key([1, 2, 9]))  # splits n after 2 tokens
    tree.mark_backed_up(n, torch.tensor([11, 12, 13, 14]))
    assert n.values[Tier.HOST].tolist() == [13, 14]
    assert n.parent.values[Tier.HOST].tolist() == [11, 12]
    tree.unlock(n)
    tree.sanity_check()


def _policy_tree(policy):
    tree = RadixTree(eviction_policy=policy, slru_threshold=2)
    a = tree.insert(key([1]), torch.tensor([1])).last_node  # created first
    b = tree.insert(key([2]), torch.tensor([2]), priority=5).last_node
    c = tree.insert(key([3]), torch.tensor([3]), priority=1).last_node
    for _ in range(3):
        tree.match_prefix(key([3]))  # c: 3 hits
    tree.match_prefix(key([1]))  # a: 1 hit, most recent
    tree.match_prefix(key([2]))
    tree.match_prefix(key([2]))  # b: 2 hits, most recent
    return tree, {a.id: "a", b.id: "b", c.id: "c"}


@pytest.mark.parametrize(
    "policy,order",
    [
        ("lru", "cab"),
        ("mru", "bac"),
        ("fifo", "abc"),
        ("lfu", "abc"),
        ("priority", "acb"),
        ("slru", "acb"),
    ],
)
def test_eviction_order_per_policy(policy, order):
    tree, names = _policy_tree(policy)
    got = ""
    while tree.evictable_size():
        ev = tree.evict_device(1)
        got += "".join(names[n.id] for n in ev.removed)
    assert got == order
    tree.sanity_check()


def test_cascade_evicts_parent_after_children():
    tree = RadixTree()
    tree.insert(key([1, 2]), torch.tensor([1, 2]))
    tree.insert(key([1, 2, 3]), torch.tensor([1, 2, 3]))
    tree.insert(key([1, 2, 4]), torch.tensor([1, 2, 4]))
    ev = tree.evict_device(4)
    assert ev.evicted_tokens == 4 and tree.total_size() == 0
    assert sorted(ev.device_indices.tolist()) == [1, 2, 3, 4]
    tree.sanity_check()


def test_bad_input_names_the_problem():
    tree = RadixTree(page_size=4)
    with pytest.raises(
        ValueError, match="key length 3 is not a multiple of page_size=4"
    ):
        tree.insert(key([1, 2, 3]), torch.tensor([4, 5, 6]))
    with pytest.raises(ValueError, match="device_indices: expected a 1-D torch.int64"):
        tree.insert(key([1, 2, 3, 4]), torch.tensor([4, 5, 6, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="expected 4 indices"):
        tree.insert(key([1, 2, 3, 4]), torch.tensor([4, 5]))
    n = tree.insert(key([1, 2, 3, 4]), torch.tensor([4, 5, 6, 7])).last_node
    with pytest.raises(ValueError, match=r"unlock: Node#\d+.* is not locked"):
        tree.unlock(n)
    longer = key([1, 2, 3, 4, 5, 6, 7, 8])
    for kwargs, message in [
        ({"priority": "high"}, "insert: priority='high': must be an integer"),
        ({"hashes": [b"h"]}, "insert: hashes: expected KnownHashes or None, got list"),
    ]:
        with pytest.raises(
            ValueError, match=message
        ):  # refused before the new node is hung
            tree.insert(longer, torch.tensor([4, 5, 6, 7, 8, 9, 10, 11]), **kwargs)
        assert tree.total_size() == 4
    with pytest.raises(ValueError, match="insert: key: expected a RadixKey, got list"):
        tree.insert([1, 2, 3, 4], torch.tensor([4, 5, 6, 7]))
    with pytest.raises(
        ValueError, match="match_prefix: key: expected a RadixKey, got list"
    ):
        tree.match_prefix([1, 2, 3, 4])
    with pytest.raises(
        ValueError, match="evict_device: num_tokens=-4: must be an integer >= 0"
    ):
        tree.evict_device(-4)
    with pytest.raises(
        ValueError, match="eviction_policy='lrx': allowed values are lru"
    ):
        RadixTree(eviction_policy="lrx")
    with pytest.raises(ValueError, match="page_size=0"):
        RadixTree(page_size=0)
    for tokens, message in [
        ([1.5, 2.0], "tokens: expected integer token ids, got dtype float64"),
        ([[1, 2]], r"tokens: expected a 1-D sequence of token ids, got shape \(1, 2\)"),
        ("hello", r"tokens: expected a 1-D sequence of token ids, got shape \(\)"),
        (np.array([True]), "tokens: expected integer token ids, got dtype bool"),
        # named as given, not as the int64 it would wrap to (-9223372036854775808)
        (
            np.array([2**63], dtype=np.uint64),
            r"must be in \[0, 2\*\*32\).*got \[9223372036854775808\]",
        ),
        # a device tensor (meta here, CUDA on a GPU) would be copied, waiting for the device
        (
            torch.zeros(4, dtype=torch.int64, device="meta"),
            "tokens: a meta tensor; pass host",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            RadixKey(tokens)
    tree.sanity_check()


def test_a_lock_refused_midway_up_the_path_changes_nothing():
    """Locks are added in one pass up the path: when a node on it refuses (here an
    ancestor made to look evicted), the counts already raised below it are taken back."""
    tree = RadixTree()
    tree.insert(key([1, 2]), torch.tensor([1, 2]))
    leaf = tree.insert(key([1, 2, 3, 4]), torch.tensor([1, 2, 3, 4])).last_node
    parent = leaf.parent
    tree.lock(parent)  # the parent's count is 1, the leaf's 0: the leaf's lock moves it
    state = lambda: (
        [n.locks[:] for n in (leaf, parent)],
        tree._evictable[:],
        tree._protected[:],
        sorted(tree._leaves[D]),
        sorted(tree._leaves[H]),
    )
    before = state()
    slots, parent.values[D] = parent.values[D], None
    with pytest.raises(
        ValueError, match=r"lock: Node#\d+.* on the path of Node#\d+.* is not on device"
    ):
        tree.lock(leaf)
    parent.values[D] = slots
    assert state() == before
    tree.unlock(parent)
    tree.sanity_check()


def test_sanity_check_lists_every_violation():
    tree = RadixTree()
    n = tree.insert(key([1, 2]), torch.tensor([1, 2])).last_node
    tree._evictable[D] += 5
    n.locks[H] = 1
    with pytest.raises(AssertionError) as err:
        tree.sanity_check()
    text = str(err.value)
    assert (
        "device sizes" in text
        and "host lock 1 on a node not on host" in text
        and "Node#" in text
    )


def test_known_hashes_are_kept_and_the_rest_is_hashed_off_thread_even_across_a_split():
    """An insert keeps the page hashes a prefetch computed and hashes nothing itself; the
    chain made by `hashing_of` on another thread equals the one the tree makes, and is
    right for a node split meanwhile (its deeper half keeps the chain's last pages)."""
    import threading

    from kvtier.tree import KnownHashes

    ps, tokens = 2, np.arange(40, 56)
    whole = RadixTree(page_size=ps, namespace_id="ns")
    chain = whole.page_hashes(whole.insert(key(tokens), torch.arange(2, 18)).last_node)
    tree = RadixTree(page_size=ps, namespace_id="ns")
    node = tree.insert(
        key(tokens), torch.arange(2, 18), hashes=KnownHashes(0, chain[:3])
    ).last_node
    assert node.hashes is None and node.hash_prefix == chain[:3]
    tree.sanity_check()
    compute = tree.hashing_of(node)
    tree.match_prefix(key([40, 41, 42, 43, 1, 2]))  # splits the node after 2 pages
    assert node.parent.hashes == chain[:2] and node.hash_prefix == chain[2:3]
    out = []
    t = threading.Thread(target=lambda: out.append(compute()))
    t.start()
    t.join()
    assert out == [chain]
    tree.adopt_hashes(node, out[0])
    assert node.hashes == chain[2:] and node.hash_prefix is None
    assert (
        tree.hashing_below(node, key([7, 8]))()
        == whole.hashing_below(
            whole.match_prefix(key(tokens)).last_device_node, key([7, 8])
        )()
    )
    tree.sanity_check()


def test_an_observer_that_hashes_a_new_node_leaves_no_stale_known_prefix():
    """An observer (KV events) that asks for a node's chain the moment the node appears,
    before the insert hands it the first hashes a prefetch knew: the node keeps its whole
    chain and no `hash_prefix` beside it, so a later split leaves no stale prefix on the
    deeper half (sanity_check: 'known first page hashes differ')."""
    from kvtier.tree import KnownHashes

    ps, tokens = 2, np.arange(40, 56)
    whole = RadixTree(page_size=ps, namespace_id="ns")
    chain = whole.page_hashes(whole.insert(key(tokens), torch.arange(2, 18)).last_node)
    tree = RadixTree(page_size=ps, namespace_id="ns")

    class Observer:
        def tier_changed(self, node, tier, present):
            tree.page_hashes(node)

        def cleared(self):
            pass

    tree.set_observer(Observer())
    node = tree.insert(
        key(tokens), torch.arange(2, 18), hashes=KnownHashes(0, chain[:3])
    ).last_node
    assert node.hashes == chain and node.hash_prefix is None
    tree.match_prefix(key([40, 41, 42, 43, 1, 2]))  # splits the node after 2 pages
    assert node.hashes == chain[2:] and node.hash_prefix is None
    tree.sanity_check()


@settings(max_examples=300, deadline=None)
@given(
    edge=st.lists(st.integers(0, 2), max_size=40),
    tokens=st.lists(st.integers(0, 2), max_size=50),
    offset=st.integers(0, 10),
    page_size=st.sampled_from([1, 2, 4]),
)
def test_common_prefix_is_the_tokens_before_the_first_difference_floored_to_pages(
    edge, tokens, offset, page_size
):
    """The bytes-halving search (kept the GIL) agrees with a token-by-token count at every
    offset and page size."""
    edge, tokens = np.array(edge, dtype=np.int64), np.array(tokens, dtype=np.int64)
    offset = min(offset, tokens.shape[0])
    n = min(edge.shape[0], tokens.shape[0] - offset)
    same = next((i for i in range(n) if edge[i] != tokens[offset + i]), n)
    assert (
        common_prefix(edge, tokens, offset, tokens.shape[0], page_size)
        == same - same % page_size
    )


def test_a_walk_that_diverges_deep_in_a_long_edge_keeps_the_gil():
    """Matching and inserting a prompt that leaves a 200,000-token edge near its end, on the
    scheduler thread, never let the GIL go (`gil_watch`): the divergence was located with a
    numpy compare and `argmax`, which give it up, and winning it back waited behind the
    storage thread's Python (docs/design.md §2)."""
    tree = RadixTree(page_size=4)
    edge = np.arange(200_000, dtype=np.int64)
    tree.insert(key(edge), torch.arange(4, 200_004))  # slots 0-3: the padding page
    other = edge.copy()
    other[199_990] = -1 + 2**32  # in range, and not the edge's token
    probe = key(other)
    with gil_watch() as progress:
        moved = progress(lambda: tree.match_prefix(probe))
    assert moved == 0
    assert (
        tree.match_prefix(probe).device_indices.numel() == 199_988
    )  # floored to whole pages
    r = tree.insert(probe, torch.arange(200_004, 400_004))
    assert r.prefix_len == 199_988 and len(tree.root.children) == 1
    tree.sanity_check()
