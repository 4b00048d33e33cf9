"""A hybrid model's prefixes through the L3 store (file store): a node's backup stores its
SWA KV and state with its FULL pages, each under its component's namespace; a prefetch
restores a prefix only up to a length every component has, byte-equal per component, and
the resumed run's logits equal the uncached run's (`torch.equal`). A damaged SWA page or
state makes that length a miss; an abort during a prefetch leaves nothing held."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.hybrid import LayerKind
from kvtier.tiers.components import Component
from kvtier.tree import Tier
from tests.cache.hybrid_rig import (
    Served,
    acquire,
    check,
    make_hybrid,
    make_model,
    seq,
)
from tests.cache.test_hybrid_cache import all_free, serve

F, S, R = LayerKind.FULL, LayerKind.SWA, LayerKind.RECURRENT
LAYOUTS = {
    "full+swa+mamba": None,
    "full+swa": (F, S, F, S),
    "full+mamba": (F, R, F, R),
}
D, H = Tier.DEVICE, Tier.HOST


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request):
    return make_model(LAYOUTS[request.param])


def rows(pool, slots) -> list[torch.Tensor]:
    """The pool's bytes at `slots`, every layer and part."""
    idx = torch.as_tensor(slots, dtype=torch.int64)
    return [part[:, idx].clone() for part in pool.parts]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def snapshot(cache, tokens) -> dict:
    """Per component, the bytes a restore of `tokens` must give back: the FULL KV of
    every token, the SWA KV of the window ending at the end, the state there."""
    tree = cache.tree
    m = tree.match_prefix(cache.key(tokens.tolist()), touch=False)
    node = m.last_device_node
    assert node.end == len(tokens)
    out = {Component.FULL: rows(cache.pool, m.device_slots)}
    if Component.SWA in cache.side:
        lo = max(0, node.end - tree.wp)
        slots = torch.cat(
            [
                torch.as_tensor(n.swa[D][max(lo - n.start, 0) :])
                for n in reversed(tree.window_nodes(node))
            ]
        )
        out[Component.SWA] = rows(cache.component_pool(Component.SWA), slots)
    if Component.MAMBA in cache.side:
        out[Component.MAMBA] = rows(
            cache.component_pool(Component.MAMBA), [node.mamba[D]]
        )
    return out


def restored(cache, tokens, rid) -> tuple:
    """Acquire `tokens` (through the store prefetch), wait for its load, and read back
    per component what the request was handed; the request is aborted after."""
    got = acquire(cache, tokens, rid)
    waiter = cache.begin_forward([rid])
    for layer in range(len(cache._plan)):
        waiter.wait_layer(layer)
    assert not waiter.failed()
    out = {Component.FULL: rows(cache.pool, got.indices)}
    if Component.SWA in cache.side:
        out[Component.SWA] = rows(cache.component_pool(Component.SWA), got.swa_indices)
    if Component.MAMBA in cache.side:
        out[Component.MAMBA] = rows(
            cache.component_pool(Component.MAMBA), [got.state_slot]
        )
    cache.abort(rid, got.indices, swa_indices=got.swa_indices)
    return got, out


def stored(cache, model, tmp_path, tokens) -> dict:
    """Serve `tokens` (aligned), back everything up, and return the snapshot."""
    serve(cache, model, tokens, "w")
    cache.drain()
    counts = cache.writes.side_stored
    comps = cache.stats()["components"]
    for c in cache.side.sides:  # every side component went to the store, nothing failed
        assert counts[c][0] > 0 and counts[c][1] == 0, (c, counts)
        assert comps[c.value]["store_write_pages"] == counts[c][0]
    snap = snapshot(cache, tokens)
    check(cache)
    return snap


def test_a_flush_then_a_restore_from_the_store_is_byte_equal_per_component(
    model, tmp_path
):
    cache = make_hybrid(model, tmp_path, store="file")
    a = seq(16, 14)
    snap = stored(cache, model, tmp_path, a)
    cache.flush()
    check(cache)
    b = torch.cat([a, seq(3, 15)])
    got, out = restored(cache, b, "r1")
    assert (len(got.indices), got.device_hit, got.host_hit, got.storage_hit) == (
        16,
        0,
        0,
        16,
    )
    for c, want in snap.items():
        assert same(out[c], want), c
    # what the store gave is counted (the replay's store->host bytes): at least the FULL
    # pages, and more where a window or a state came too
    full = 16 // cache.mirror.page_size * cache.mirror.page_bytes
    assert cache.stats()["counters"]["l3_read_bytes"] > full or len(snap) == 1
    assert cache.stats()["counters"]["l3_read_bytes"] >= full
    check(cache)
    r = serve(cache, model, b, "r2")  # logits equal to the uncached run's
    assert r.length == 16
    cache.drain()
    check(cache)
    cache.close()
    check(cache)
    all_free(cache)


def test_a_new_cache_over_the_warm_store_restores(model, tmp_path):
    first = make_hybrid(model, tmp_path, store="file")
    a = seq(14, 21)
    snap = stored(first, model, tmp_path, a)
    first.close()
    cache = make_hybrid(model, tmp_path, store="file")
    b = torch.cat([a, seq(5, 22)])
    got, out = restored(cache, b, "r1")
    assert (len(got.indices), got.storage_hit) == (14, 14)
    for c, want in snap.items():
        assert same(out[c], want), c
    r = serve(cache, model, b, "r2")
    assert r.length == 14 and cache.stats()["counters"]["storage_hit_tokens"] >= 14
    cache.drain()
    check(cache)
    cache.close()
    all_free(cache)


def _damage(cache, tmp_path, component, tokens) -> int:
    """Flip bytes in the stored page of `component` that ends `tokens` (the state, or
    the window's last SWA page); returns the files damaged."""
    node = cache.tree.match_prefix(
        cache.key(tokens.tolist()), touch=False
    ).last_device_node
    ns = cache._specs[component].namespace(cache.namespace).id
    name = node.hashes[-1].hex()
    files = [p for p in (tmp_path / "l3").rglob(f"*{name}*") if ns in str(p)]
    for p in files:
        data = bytearray(p.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 8):
            data[i] ^= 0xFF
        p.write_bytes(bytes(data))
    return len(files)


@pytest.mark.parametrize("component", [Component.SWA, Component.MAMBA])
def test_a_damaged_swa_page_or_state_makes_that_length_not_restorable(
    model, tmp_path, component
):
    """Prefixes of 10 and 16 tokens stored; the window's last SWA page (or the state) of
    16 damaged: 16 is not restorable, a shorter length whose every page verifies is (10
    with states; 14 with SWA alone, whose window [8, 14) is intact), byte-right."""
    cache = make_hybrid(model, tmp_path, store="file")
    if component not in cache.side:
        pytest.skip(f"no {component.value} in this model")
    a = seq(16, 31)
    serve(cache, model, a[:10], "w0")
    stored(cache, model, tmp_path, a)
    assert _damage(cache, tmp_path, component, a) == 1
    cache.flush()
    b = torch.cat([a, seq(3, 32)])
    r = serve(cache, model, b, "r1")  # logits equal to the uncached run's
    want = 10 if Component.MAMBA in cache.side else 14
    assert r.length == r.got.storage_hit == want
    cache.drain()
    check(cache)
    cache.close()
    all_free(cache)


def test_a_damaged_state_with_no_shorter_one_is_a_miss(model, tmp_path):
    cache = make_hybrid(model, tmp_path, store="file")
    if Component.MAMBA not in cache.side:
        pytest.skip("no mamba in this model")
    a = seq(16, 33)
    stored(cache, model, tmp_path, a)
    assert _damage(cache, tmp_path, Component.MAMBA, a) == 1
    cache.flush()
    b = torch.cat([a, seq(3, 34)])
    r = serve(cache, model, b, "r1")  # a miss, and the run from scratch is right
    assert r.length == 0 and r.got.storage_hit == 0
    assert cache.tree.total_size(H) == 0  # nothing of the damaged prefix was kept
    cache.drain()
    check(cache)
    cache.close()
    all_free(cache)


def test_an_abort_during_a_prefetch_frees_everything(model, tmp_path):
    cache = make_hybrid(model, tmp_path, store="file")
    a = seq(16, 41)
    stored(cache, model, tmp_path, a)
    cache.flush()
    b = torch.cat([a, seq(3, 42)])
    got = cache.acquire(b.tolist(), "r1")
    assert not got.ready  # the prefetch is in flight
    cache.abort("r1")
    again = cache.acquire(b.tolist(), "r1")  # a new request, same id: waits for the old
    assert not again.ready
    cache.abort("r1")
    cache.drain()
    check(cache)
    assert cache.tree.total_size(H) == 0  # an aborted prefetch inserts nothing
    assert not cache._prefetches
    r = serve(cache, model, b, "r2")  # and the next request prefetches anew
    assert r.length == 16 and r.got.storage_hit == 16
    cache.drain()
    check(cache)
    cache.close()
    check(cache)
    all_free(cache)


def test_a_request_with_the_same_id_as_an_aborted_prefetch_is_named_when_it_ends(
    model, tmp_path
):
    cache = make_hybrid(model, tmp_path, store="file")
    a = seq(12, 51)
    stored(cache, model, tmp_path, a)
    cache.flush()
    b = torch.cat([a, seq(3, 52)])
    assert not cache.acquire(b.tolist(), "r1").ready
    cache.abort("r1")
    r = Served(cache, model, b, "r1")  # polls until named: not hung
    r.abort()
    cache.drain()
    check(cache)
    cache.close()
    all_free(cache)


def test_a_prefetch_short_of_a_side_components_host_room_is_a_miss_without_leaks(
    model, tmp_path
):
    """The prefetch read every component, but when it is applied a side component's
    mirror has no room (other holders took it all): a miss, and the FULL host slots it
    had already taken go back (they leaked: the host accounting broke)."""
    first = make_hybrid(model, tmp_path, store="file")
    a = seq(14, 61)
    stored(first, model, tmp_path, a)
    first.close()
    cache = make_hybrid(model, tmp_path, store="file")
    b = torch.cat([a, seq(5, 62)])
    assert not cache.acquire(b.tolist(), "r1").ready
    last = list(cache.side.sides)[-1]
    free = cache.controller.component_host_accounting(last).free
    taken = cache.controller.alloc_component_host(last, free)
    for _ in range(10_000):
        if "r1" in cache.poll():
            break
        cache.wait_progress(0.01)
    else:
        raise AssertionError("r1 was never named ready")
    got = cache.acquire(b.tolist(), "r1")
    assert got.ready and got.storage_hit == 0 and len(got.indices) == 0
    cache.abort("r1", got.indices, swa_indices=got.swa_indices)
    cache.controller.free_component_host(last, taken)
    assert cache.tree.total_size(H) == 0
    check(cache)
    cache.close()
    all_free(cache)


def named(cache, rid: str) -> None:
    for _ in range(10_000):
        if rid in cache.poll():
            return
        cache.wait_progress(0.01)
    raise AssertionError(f"{rid} was never named ready")


def test_what_a_prefetch_landed_stays_protected_on_host_until_its_request_acquires(
    model, tmp_path
):
    """Between the poll that names a request ready and its acquire (an engine waits
    there for device room), what its prefetch brought is protected on host: another
    write's eviction could take it, and the request then recomputed everything. Its
    acquire or its abort releases it; a flush releases it too (the request then misses)."""
    cache = make_hybrid(model, tmp_path, store="file")
    a = seq(16, 71)
    stored(cache, model, tmp_path, a)
    cache.flush()
    b = torch.cat([a, seq(3, 72)])
    assert not cache.acquire(b.tolist(), "r1").ready
    named(cache, "r1")
    assert cache.tree.protected_size(H) == 16  # it was 0: evictable while r1 waited
    got = cache.acquire(b.tolist(), "r1")
    assert got.ready and got.storage_hit == 16
    waiter = cache.begin_forward(["r1"])
    for layer in range(len(cache._plan)):
        waiter.wait_layer(layer)
    cache.drain()  # its load (which protects what it reads) applied
    assert cache.tree.protected_size(H) == 0
    cache.abort("r1", got.indices, swa_indices=got.swa_indices)
    check(cache)
    # an abort after the landing releases it
    cache.flush()
    assert not cache.acquire(b.tolist(), "r2").ready
    named(cache, "r2")
    assert cache.tree.protected_size(H) == 16
    cache.abort("r2")
    assert cache.tree.protected_size(H) == 0
    check(cache)
    # a flush drops it (it refused to, with the host protected)
    cache.flush()
    assert not cache.acquire(b.tolist(), "r3").ready
    named(cache, "r3")
    cache.flush()
    assert cache.tree.total_size(H) == 0
    got = cache.acquire(b.tolist(), "r3")
    assert got.ready and len(got.indices) == 0
    cache.abort("r3", got.indices, swa_indices=got.swa_indices)
    check(cache)
    cache.close()
    check(cache)
    all_free(cache)


def test_a_refused_flush_keeps_what_a_landed_prefetch_brought_protected(
    model, tmp_path
):
    """A flush refused while a request holds a device prefix changes nothing: the prefix
    a waiting request's prefetch landed stays protected on host until it acquires it (it
    was released before the refusal, and evictable while the request waited)."""
    cache = make_hybrid(model, tmp_path, store="file")
    a = seq(16, 71)
    stored(cache, model, tmp_path, a)
    cache.flush()
    b = torch.cat([a, seq(3, 72)])
    assert not cache.acquire(b.tolist(), "r1").ready
    named(cache, "r1")
    x = seq(8, 5)
    serve(cache, model, x, "x")
    busy = Served(cache, model, torch.cat([x, seq(4, 6)]), "busy")
    assert busy.length == 8  # it holds x's device prefix
    with pytest.raises(ValueError, match="device tokens are locked by requests"):
        cache.flush()
    assert cache.tree.protected_size(H) == 16  # it was 0 after the refusal
    check(cache)
    got = cache.acquire(b.tolist(), "r1")
    assert got.ready and got.storage_hit == 16
    cache.abort("r1", got.indices, swa_indices=got.swa_indices)
    busy.abort()
    cache.drain()
    assert cache.tree.protected_size(H) == 0
    check(cache)
    cache.close()
    all_free(cache)
