"""Store pages of several device pages (`store.page_tokens`, docs/stores.md): whole store
pages only, the first pages of one read from its ancestors' host copies, a prefetch that
starts inside one, damaged and stalled store pages, and the config that refuses the rest."""

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.config import load_config
from kvtier.errors import KvtierConfigError
from tests.controller.helpers import (
    CorruptingStore,
    FailingStore,
    StallingStore,
    acquire,
    compute,
    fill,
    forward,
    make_cache,
    read,
    read_back,
    same_kv,
    settle,
)

PS, TOKENS = 2, 8  # device pages of 2 tokens, store pages of 4 device pages


def check(cache):
    cache.tree.sanity_check()
    cache.check_accounting()


def part(kv, start, stop):
    return [(k[start:stop], v[start:stop]) for k, v in kv]


class KeptStore(MemoryStore):
    """A memory store that remembers the keys it was given to touch and to store."""

    def __init__(self) -> None:
        super().__init__(MemoryStoreConfig())
        self.touched: list[str] = []
        self.stored: list[str] = []

    async def _set(self, keys, frames):
        self.stored += list(keys)
        return await super()._set(keys, frames)

    def touch(self, keys) -> None:
        self.touched += list(keys)
        super().touch(keys)


@pytest.mark.parametrize("store", ["memory", "file"])
def test_whole_store_pages_are_stored_and_read_back_bitwise(store, tmp_path):
    """20 tokens = 10 pages: store pages 0-3 and 4-7 are stored, pages 8-9 wait for a
    longer sequence (not a failure); read back, 16 tokens come from the store."""
    cache = make_cache(tmp_path, store=store, page_size=PS, page_tokens=TOKENS)
    seq = np.arange(100, 120)
    kv = compute(cache, seq, seed=1)
    settle(cache)
    c = cache.stats()["counters"]
    assert (c["l3_write_pages"], c["l3_write_failures"]) == (8, 0)
    cache.flush()
    got, got_kv = read_back(cache, seq, "r")
    assert (got.device_hit, got.host_hit, got.storage_hit) == (0, 0, 16)
    assert same_kv(got_kv, part(kv, 0, 16))
    assert cache.stats()["counters"]["l3_read_pages"] == 8
    settle(cache)
    check(cache)
    cache.close()


def test_a_longer_sequence_stores_the_pages_its_prefix_left_and_reads_them_from_its_ancestor():
    """The second request extends the first (20 -> 32 tokens): its node starts at page 10,
    so the store page of pages 8-11 takes pages 8-9 from the first node's host copy."""
    store = KeptStore()
    cache = make_cache(store_obj=store, page_size=PS, page_tokens=TOKENS)
    first = np.arange(100, 120)
    kv1 = compute(cache, first, seed=1)
    settle(cache)
    assert len(store.stored) == 2
    store_page = TOKENS // PS * cache.controller.mirror.page_bytes
    assert cache.stats()["counters"]["l3_write_bytes"] == 2 * store_page
    longer = np.concatenate([first, np.arange(500, 512)])
    kv2 = compute(cache, longer, seed=2)  # 20 tokens cached: computes 12
    settle(cache)
    c = cache.stats()["counters"]
    assert len(store.stored) == 4 and c["l3_write_failures"] == 0
    assert (
        c["l3_write_bytes"] == 4 * store_page
    )  # what crossed: pages 8-9 from the ancestor's copy too
    cache.flush()
    got, got_kv = read_back(cache, longer, "r")
    assert got.storage_hit == 32
    want = [
        (torch.cat([k1, k2]), torch.cat([v1, v2]))
        for (k1, v1), (k2, v2) in zip(kv1, kv2)
    ]
    assert same_kv(got_kv, want)
    settle(cache)
    check(cache)
    cache.close()


def test_a_prefetch_that_starts_inside_a_store_page_takes_only_the_pages_past_the_match():
    """The tree holds pages 0-2 (computed again, with other bytes); the prefetch of pages
    3-7 reads store pages 0-3 and 4-7 and takes page 3 of the first: the store's page 3,
    not its page 0."""
    cache = make_cache(page_size=PS, page_tokens=TOKENS)
    seq = np.arange(100, 116)
    kv = compute(cache, seq, seed=1)
    settle(cache)
    cache.flush()
    kv_head = compute(cache, seq[:6], seed=99)  # no whole store page: recomputed
    settle(cache)
    got, got_kv = read_back(cache, seq, "r")
    assert (got.device_hit, got.storage_hit) == (6, 10)
    c = cache.stats()["counters"]
    assert c["l3_read_pages"] == 5  # pages 3-7: what the tree took
    assert (
        c["l3_read_bytes"] == 2 * TOKENS // PS * cache.controller.mirror.page_bytes
    )  # two whole store pages crossed
    assert same_kv(
        got_kv,
        [
            (torch.cat([kh, k[6:]]), torch.cat([vh, v[6:]]))
            for (kh, vh), (k, v) in zip(kv_head, kv)
        ],
    )
    settle(cache)
    check(cache)
    cache.close()


class SecondSetFails(MemoryStore):
    """A memory store whose second `batch_set` fails the way a dead server does."""

    def __init__(self) -> None:
        super().__init__(MemoryStoreConfig())
        self.sets = 0

    async def _set(self, keys, frames):
        self.sets += 1
        if self.sets == 2:
            raise ConnectionResetError("connection reset by peer")
        return await super()._set(keys, frames)


def test_a_backup_whose_second_call_fails_counts_the_store_page_its_first_call_stored(
    monkeypatch,
):
    """One store page a call (a chunk of one): the node's second call fails. Its first store
    page is in the store and counted so, in pages and bytes; the second's pages are
    failures. Read back, the first store page comes from the store."""
    from kvtier.controller import storage

    monkeypatch.setattr(storage, "CHUNK_BYTES", 1)
    cache = make_cache(store_obj=SecondSetFails(), page_size=PS, page_tokens=TOKENS)
    seq = np.arange(100, 116)  # 8 pages: two store pages, one node
    kv = compute(cache, seq, seed=1)
    settle(cache)
    c = cache.stats()["counters"]
    store_page = TOKENS // PS * cache.controller.mirror.page_bytes
    assert (c["l3_write_pages"], c["l3_write_failures"], c["l3_write_bytes"]) == (
        4,
        4,
        store_page,
    )
    cache.flush()
    got, got_kv = read_back(cache, seq, "r")
    assert (got.device_hit, got.host_hit, got.storage_hit) == (0, 0, 8)
    assert same_kv(got_kv, part(kv, 0, 8))
    settle(cache)
    check(cache)
    cache.close()


@pytest.mark.parametrize("store_cls", ["failing", "corrupt"])
def test_a_store_page_that_fails_or_does_not_verify_is_a_miss_and_slots_return(
    store_cls,
):
    store = (
        FailingStore() if store_cls == "failing" else CorruptingStore(bad_key_index=1)
    )
    cache = make_cache(store_obj=store, page_size=PS, page_tokens=TOKENS)
    seq = np.arange(100, 124)  # 3 store pages
    kv = compute(cache, seq, seed=3)
    settle(cache)
    cache.flush()
    got, got_kv = read_back(cache, seq, "f")
    expected = (
        0 if store_cls == "failing" else 8
    )  # the store page before the damaged one
    assert got.storage_hit == expected and same_kv(got_kv, part(kv, 0, expected))
    settle(cache)
    cache.flush()
    assert cache.controller.host_available() == cache.mirror.size
    assert cache.controller.quarantined_pages() == 0
    check(cache)
    cache.close()


def test_a_stalled_store_page_read_times_out_and_quarantines_no_host_page():
    """A read abandoned stuck writes into a buffer of its own, never into host pages: they
    all come back."""
    store = StallingStore(fast_reads=0, stall_s=30.0)
    store.timeout_s = 0.5
    cache = make_cache(store_obj=store, page_size=PS, page_tokens=TOKENS)
    seq = np.arange(100, 116)
    compute(cache, seq, seed=4)
    settle(cache)
    cache.flush()
    got = acquire(cache, seq, "s")
    assert got.storage_hit == 0
    cache.abort("s")
    settle(cache)
    assert (
        cache.controller.quarantined_pages() == 0
        and cache.stats()["store"]["timeouts"] == 1
    )
    cache.flush()
    assert cache.controller.host_available() == cache.mirror.size
    check(cache)
    cache.close()


def test_pages_that_leave_host_touch_the_store_pages_that_hold_them():
    """Only keys of store pages are touched: the last page of each, never a page's own key."""
    store = KeptStore()
    cache = make_cache(
        store_obj=store, page_size=PS, page_tokens=TOKENS, pool_size=32, ratio=1.0
    )
    compute(cache, np.arange(100, 116), seed=1)
    settle(cache)
    compute(cache, np.arange(200, 216), seed=2)
    settle(cache)
    compute(
        cache, np.arange(300, 316), seed=3
    )  # host room: the first sequence leaves host
    settle(cache)
    settle(cache)
    assert store.touched and set(store.touched) <= set(store.stored)
    check(cache)
    cache.close()


def test_the_start_line_names_the_store_page():
    cache = make_cache(page_size=PS, page_tokens=TOKENS)
    assert "store memory (store pages of 8 tokens) |" in cache.describe()
    cache.close()


def test_store_pages_have_their_own_namespace():
    pool = {"size": 64, "num_layers": 2, "page_size": PS}

    def ns(tokens):
        from kvtier.cache import TieredCache

        cache = TieredCache(
            load_config(
                None,
                {"pool": pool, "store": {"backend": "memory", "page_tokens": tokens}},
                env={},
            )
        )
        try:
            return cache.namespace.id
        finally:
            cache.close()

    assert (
        ns(None) == ns(PS) != ns(TOKENS)
    )  # one device page a store page: the ids of before


@pytest.mark.parametrize(
    "tokens,why",
    [
        (6, "store.page_tokens=6: must be a multiple of pool.page_size=4"),
        (0, "page_tokens=0: must be an integer > 0"),
        (-8, "page_tokens=-8: must be an integer > 0"),
    ],
)
def test_a_store_page_that_is_not_whole_device_pages_is_refused_naming_it(tokens, why):
    with pytest.raises(KvtierConfigError, match=why.replace("(", r"\(")):
        load_config(
            None,
            {
                "pool": {"size": 64, "num_layers": 2, "page_size": 4},
                "store": {"backend": "memory", "page_tokens": tokens},
            },
            env={},
        )


class SwitchStore(MemoryStore):
    """A memory store that fails every call, the way a dead server does, while `broken`."""

    def __init__(self) -> None:
        super().__init__(MemoryStoreConfig())
        self.broken = False

    def _check_up(self):
        if self.broken:
            raise ConnectionResetError("connection reset by peer")

    async def _set(self, keys, frames):
        self._check_up()
        return await super()._set(keys, frames)

    async def _exists(self, keys):
        self._check_up()
        return await super()._exists(keys)


def _down_store():
    """A cache whose store went down (its breaker tripped by three failed backups), and the
    clock that lets it probe again."""
    now = [0.0]
    store = SwitchStore()
    cache = make_cache(
        store_obj=store, page_size=PS, page_tokens=TOKENS, clock=lambda: now[0]
    )
    store.broken = True
    for i in range(3):
        compute(cache, np.arange(1000 * i, 1000 * i + 16), seed=i)
        settle(cache)
    assert cache.stats()["store"]["store_down"]
    now[0] += 3600.0  # a probe is due
    return cache, store, now


def test_a_backup_with_no_whole_store_page_is_no_probe_of_a_store_that_is_down():
    """Review: a node of fewer pages than a store page, none of them a store page's last,
    was a backup that made no store call; while the store was down it took the probe and
    never ended it, so the store was skipped for good, even once it answered again."""
    cache, store, _ = _down_store()
    prompt = np.arange(
        0, 16
    )  # on device: no prefetch (which would probe the store itself)
    got = acquire(cache, prompt, "decode")
    assert got.device_hit == 16
    out = cache.alloc(2)
    forward(cache, "decode")
    fill(cache, out, seed=5)
    cache.cache_finished(
        "decode", np.concatenate([prompt, [7, 7]]), torch.cat([got.indices, out])
    )  # one page more
    settle(cache)
    store.broken = False
    compute(cache, np.arange(5000, 5016), seed=6)
    settle(cache)
    assert not cache.stats()["store"]["store_down"]
    assert cache.stats()["counters"]["l3_write_pages"] == 8
    check(cache)
    cache.close()


def test_a_prefetch_with_no_whole_store_page_does_not_say_a_store_that_is_down_answers():
    """Review: a prefetch of fewer pages than a store page asked the store nothing, and the
    breaker took that for an answer: a dead store counted as up again."""
    cache, store, _ = _down_store()
    got = acquire(
        cache, np.arange(7000, 7006), "short"
    )  # 3 pages: no store page ends in them
    cache.abort("short")
    settle(cache)
    assert got.storage_hit == 0 and cache.stats()["store"]["store_down"]
    check(cache)
    cache.close()


def prefix_kv(tokens, lo, hi):
    """KV of positions lo..hi-1 as a function of the tokens up to each: whatever tier or
    store page serves a position, its bytes are these or it is a miss."""
    rows = []
    for i in range(lo, hi):
        seed = int.from_bytes(
            hashlib.sha256(np.asarray(tokens[: i + 1], np.int64).tobytes()).digest()[
                :4
            ],
            "little",
        )
        rows.append(
            torch.randn(2, 2, 2, 4, generator=torch.Generator().manual_seed(seed))
        )  # layer, K/V, head, dim
    t = torch.stack(rows) if rows else torch.empty(0, 2, 2, 2, 4)
    return [(t[:, layer, 0], t[:, layer, 1]) for layer in range(2)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ps=st.sampled_from([1, 2, 4]),
    group=st.integers(2, 4),
    layout=st.sampled_from(["page_first", "layer_first"]),
    write_policy=st.sampled_from(["write_through", "write_back"]),
    data=st.data(),
)
def test_store_pages_serve_exactly_the_kv_of_each_prefix(
    ps, group, layout, write_policy, data
):
    """Requests over prompts that share prefixes of every length, with flushes and device
    evictions between them: each prefix handed back, from device, host or store pages of
    several pages, holds the KV of exactly its tokens."""
    cache = make_cache(
        page_size=ps,
        page_tokens=ps * group,
        pool_size=64 // ps * ps,
        ratio=1.0,
        layout=layout,
        write_policy=write_policy,
    )
    prompts = [
        data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=28), label="first")
    ]
    for i in range(data.draw(st.integers(6, 14), label="requests")):
        base = data.draw(st.sampled_from(prompts), label="base")
        how = data.draw(
            st.sampled_from(["again", "prefix", "extend", "fork"]), label="how"
        )
        cut = (
            len(base)
            if how in ("again", "extend")
            else data.draw(st.integers(1, len(base)), label="cut")
        )
        more = (
            []
            if how in ("again", "prefix")
            else data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=12))
        )
        prompt = (base[:cut] + more)[:28]
        prompts.append(prompt)
        tokens = np.array(prompt, np.int64)
        got = acquire(cache, tokens, f"r{i}")
        forward(cache, f"r{i}")
        cached = got.indices.numel()
        assert same_kv(read(cache, got.indices), prefix_kv(tokens, 0, cached)), (i, got)
        new = cache.alloc(len(tokens) - cached)
        assert new is not None
        for layer, (k, v) in enumerate(prefix_kv(tokens, cached, len(tokens))):
            cache.pool.set_kv(layer, new[: len(tokens) - cached], k, v)
        cache.cache_finished(f"r{i}", tokens, torch.cat([got.indices, new]))
        then = data.draw(st.sampled_from(["flush", "evict", "go on"]), label="then")
        if then == "flush":
            settle(cache)
            cache.flush()
        elif then == "evict":  # device pages go (under write-back, backed up first)
            settle(cache)
            cache.evict(data.draw(st.integers(1, 32), label="tokens"))
        cache.tree.sanity_check()
    settle(cache)
    check(cache)
    cache.close()


def _serve(cache, tokens, rid):
    """The server's sequence with the KV of `prefix_kv`: acquire, check what is handed
    back, compute the rest, finish. Returns what acquire said."""
    got = acquire(cache, tokens, rid)
    forward(cache, rid)
    cached = got.indices.numel()
    assert same_kv(read(cache, got.indices), prefix_kv(tokens, 0, cached)), (rid, got)
    new = cache.alloc(len(tokens) - cached)
    for layer, (k, v) in enumerate(prefix_kv(tokens, cached, len(tokens))):
        cache.pool.set_kv(layer, new, k, v)
    cache.cache_finished(rid, tokens, torch.cat([got.indices, new]))
    return got


def test_a_store_page_takes_its_first_pages_from_three_ancestors_in_order():
    """Nodes of 1, 1, 1 and 3 pages (a conversation growing a page at a time), store pages
    of 4: the fourth node's backup stores pages 0-3, three of them from three ancestors'
    host copies, oldest first."""
    store = KeptStore()
    cache = make_cache(store_obj=store, page_size=PS, page_tokens=TOKENS)
    seq = np.arange(300, 312)  # 6 pages
    for i, end in enumerate([2, 4, 6, 12]):
        _serve(cache, seq[:end], f"grow{i}")
        settle(cache)
    assert len(store.stored) == 1  # pages 0-3; pages 4-5 wait for a longer sequence
    cache.flush()
    got = _serve(cache, seq, "back")
    assert got.storage_hit == 8
    settle(cache)
    check(cache)
    cache.close()


@pytest.mark.parametrize("tokens", [None, 2])
def test_a_node_split_while_its_write_is_out_is_stored_whole(tokens):
    """Review: a request split a prefix whose device->host write was still out; the write
    gave both halves host copies, but only the lower half went on to the store, so once host
    and device let go, the store held none of the prefix's first pages (a leading run: 0
    tokens served). Both halves are backed up now (one device page a store page too)."""
    cache = make_cache(page_size=1, page_tokens=tokens, pool_size=64)
    seq = np.arange(100, 110)
    got = acquire(cache, seq, "a")
    new = cache.alloc(10)
    forward(cache, "a")
    fill(cache, new, seed=1)
    cache.cache_finished("a", seq, new)  # its write is queued, not yet applied
    other = acquire(cache, np.concatenate([seq[:6], [7, 7]]), "b")  # splits it at 6
    cache.abort("b", other.indices)
    settle(cache)
    cache.flush()
    got = acquire(cache, seq, "c")
    assert got.storage_hit == 10
    cache.abort("c", got.indices)
    settle(cache)
    check(cache)
    cache.close()


@pytest.mark.parametrize(
    "tokens", [PS, TOKENS]
)  # one device page a store page, and four
def test_l3_read_bytes_count_the_verified_store_pages_past_a_damaged_one(tokens):
    """A read batch [good, damaged, good, ...]: the pages past the damaged one crossed and
    verified (the store counts them), though only the leading run lands. l3_read_bytes
    counted the leading run only."""
    store = CorruptingStore(bad_key_index=1)
    cache = make_cache(store_obj=store, page_size=PS, page_tokens=tokens)
    seq = np.arange(100, 124)  # 12 device pages
    compute(cache, seq, seed=1)
    settle(cache)
    cache.flush()
    verified = store.counters.get_bytes
    got, _ = read_back(cache, seq, "b")
    settle(cache)
    assert got.storage_hit == tokens and store.counters.frame_failures == 1
    assert (
        cache.stats()["counters"]["l3_read_bytes"]
        == store.counters.get_bytes - verified
        > tokens // PS * cache.mirror.page_bytes
    )
    check(cache)
    cache.close()
