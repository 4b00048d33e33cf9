"""HybridTieredCache over real pools, mirrors and stores, driven as an engine drives it
(acquire -> forward -> finish or abort) with the hybrid reference model: every resumed
run's logits equal the uncached run's (`torch.equal`), so a window or state restored
wrong, or claimed where it is missing, shows."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvtier.engine.hybrid import LayerKind
from kvtier.errors import TransferError
from kvtier.testing.parts import SimStreams
from kvtier.tiers.components import Component
from kvtier.tree import Tier
from tests.cache.hybrid_rig import Served, check, make_hybrid, make_model, seq

F, S, R = LayerKind.FULL, LayerKind.SWA, LayerKind.RECURRENT
LAYOUTS = {
    "full+swa+mamba": None,  # the model's default: F S R S F R
    "full+swa": (F, S, F, S),
    "full+mamba": (F, R, F, R),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request):
    return make_model(LAYOUTS[request.param])


def all_free(cache) -> None:
    """Nothing is held anywhere: every component's pool and mirror is free."""
    assert cache.slots.device_free() == cache.config.pool.size
    for c, side in cache.side.sides.items():
        assert side.allocator.available_size() == side.pool.config.size, c
        if side.mirror is not None:
            free = cache.controller.component_host_accounting(c).free
            assert free == side.mirror.size, c


def claims_hold(cache, tokens) -> None:
    """The match's handles claim only what is there: at `last_device_node` the window's
    SWA KV and the state on device, at `last_host_node` on device or host."""
    tree = cache.tree
    m = tree.match_prefix(cache.key(tokens.tolist()), touch=False)
    for node, tiers in (
        (m.last_device_node, (Tier.DEVICE,)),
        (m.last_host_node, (Tier.DEVICE, Tier.HOST)),
    ):
        if node is tree.root:
            continue
        for n in tree.window_nodes(node):
            assert any(n.swa[t] is not None for t in tiers), (node, n)
        if Component.MAMBA in cache.side:
            assert any(node.mamba[t] is not None for t in tiers), node


def serve(cache, model, tokens, rid, dense=None):
    """Serve and finish one request; its logits must equal the uncached run's."""
    dense = model.forward_dense(tokens) if dense is None else dense
    r = Served(cache, model, tokens, rid)
    assert not r.failed
    assert torch.equal(r.logits, dense[r.length :]), (rid, r.length)
    r.finish()
    return r


def test_a_request_resumes_bitwise_from_device_and_from_host(model):
    cache = make_hybrid(model)
    a = seq(20, 1)
    b = torch.cat([a, seq(7, 2)])
    c = torch.cat([b, seq(3, 3)])
    serve(cache, model, a, "r1")
    cache.drain()
    check(cache)
    r = serve(cache, model, b, "r2")
    assert (r.length, r.got.device_hit, r.got.host_hit) == (20, 20, 0)
    cache.drain()
    check(cache)
    assert cache.evict(1000) == 26  # every node is backed up: host keeps them all
    check(cache)
    comps = cache.stats()["components"]
    r = serve(cache, model, c, "r3")
    assert (r.length, r.got.device_hit, r.got.host_hit) == (26, 0, 26)
    after = cache.stats()["components"]
    for name, entry in after.items():  # the window and the state came from host
        assert entry["hits_host"] > comps[name]["hits_host"], name
        assert entry["hits_device"] == comps[name]["hits_device"], name
    cache.drain()
    check(cache)
    cache.close()
    check(cache)
    all_free(cache)


@pytest.mark.parametrize("component", [Component.SWA, Component.MAMBA])
def test_a_device_evicted_window_or_state_comes_back_from_host_byte_equal(
    model, component
):
    """FULL KV stays on device; the window (or the state) is evicted there alone and
    comes back from host through a load of the side component only."""
    cache = make_hybrid(model)
    if component not in cache.side:
        pytest.skip(f"no {component.value} in this model")
    a = seq(18, 4)
    serve(cache, model, a, "r1")
    cache.drain()
    ev = cache.tree.evict_component(component, Tier.DEVICE, 1000)
    assert ev.evicted > 0
    check(cache)
    b = torch.cat([a, seq(5, 5)])
    m = cache.match_prefix(b.tolist(), count=False)
    assert m.device_slots.size < 18 and m.host_hit_length > 0
    r = serve(cache, model, b, "r2")
    assert r.length == 18 and r.got.host_hit > 0
    assert r.got.host_hit == 18 - r.got.device_hit
    cache.drain()
    check(cache)
    cache.close()
    all_free(cache)


def test_random_evictions_never_give_a_length_whose_pieces_are_missing(model):
    """Requests over shared prefixes, with evictions of every component on every tier
    in between: whatever length a match gives, the pieces it restores are the right
    bytes (the logits equal the uncached run's), and the accounting holds throughout."""
    rng = random.Random(11)
    cache = make_hybrid(model, tokens=80, states=10)
    served = [seq(10, 20 + i) for i in range(3)]  # sessions: each turn extends one
    hits = 0
    for step in range(16):
        base = rng.choice(served[-6:])
        if base.numel() > 40:
            base = base[:10]
        tokens = torch.cat([base, seq(rng.randrange(3, 12), 100 + step)])
        claims_hold(cache, tokens)
        r = serve(cache, model, tokens, f"r{step}")
        served.append(tokens)
        hits += r.length
        if rng.random() < 0.5:
            cache.drain()
        what = rng.choice(["device", "host", "swa", "mamba", "none"])
        if what == "device":
            cache.evict(rng.randrange(2, 40))
        elif what == "host":
            cache.drain()
            ev = cache.tree.evict_host(rng.randrange(2, 40))
            cache.controller.free_host(ev.host_slots)
        elif what in ("swa", "mamba") and Component(what) in cache.side:
            tier = rng.choice([Tier.DEVICE, Tier.HOST])
            cache.tree.evict_component(Component(what), tier, rng.randrange(1, 12))
        check(cache)
    assert hits > 0
    cache.close()
    check(cache)
    all_free(cache)


def test_abort_frees_every_component_in_any_state(model):
    """Aborted before its forward with a load still in flight (the load's slots are freed
    when the copy stops), after its forward, and without its SWA row."""
    streams = SimStreams(random.Random(3))
    cache = make_hybrid(model, stream_factory=streams.factory)
    a = seq(16, 7)
    streams.auto = random.Random(0)  # copies run as they are submitted
    streams.auto.choice = lambda seq_: "ok"
    serve(cache, model, a, "r1")
    cache.drain()
    cache.evict(1000)
    streams.auto = None  # held until resolved
    b = torch.cat([a, seq(4, 8)])
    got = cache.acquire(b.tolist(), "r2")  # a load from host, held pending
    assert got.host_hit == 16 and streams.pending
    cache.abort("r2")
    check(cache)
    streams.resolve_all(random.Random(1))
    cache.drain()
    check(cache)
    streams.auto = random.Random(0)
    streams.auto.choice = lambda seq_: "ok"
    r = Served(cache, model, b, "r3")
    assert torch.equal(r.logits, model.forward_dense(b)[16:])
    r.abort()
    cache.drain()
    check(cache)
    r = Served(cache, model, b, "r4")
    cache.abort("r4", r.kv_row())  # no SWA row: its alloc_swa slots it frees itself
    if r.swa_row() is not None:
        cache.free_swa(r.swa)
    cache.drain()
    check(cache)
    cache.close()
    check(cache)
    all_free(cache)


def test_a_failed_load_is_named_and_its_request_aborted_without_leaks(model):
    streams = SimStreams(random.Random(3))
    cache = make_hybrid(model, stream_factory=streams.factory)
    streams.auto = random.Random(0)
    streams.auto.choice = lambda seq_: "ok"
    a = seq(16, 9)
    serve(cache, model, a, "r1")
    cache.drain()
    cache.evict(1000)
    b = torch.cat([a, seq(4, 10)])
    streams.auto.choice = lambda seq_: "fail_before"
    got = cache.acquire(b.tolist(), "r2")
    assert got.host_hit == 16
    waiter = cache.begin_forward(["r2"])
    for layer in range(len(model.config.layers)):
        waiter.wait_layer(layer)
    assert waiter.failed() == ["r2"]
    cache.abort("r2", got.indices, swa_indices=got.swa_indices)
    cache.drain()
    check(cache)
    got = cache.acquire(b.tolist(), "r2b")  # fails again; its finish is refused
    with pytest.raises(TransferError, match="load failed"):
        cache.cache_finished(
            "r2b",
            b[:16].tolist(),
            got.indices,
            swa_indices=got.swa_indices if Component.SWA in cache.side else None,
        )
    assert cache.match_prefix(b.tolist(), count=False).last_device_node is (
        cache.tree.root
    )
    cache.drain()
    check(cache)
    streams.auto.choice = lambda seq_: "ok"
    serve(cache, model, b, "r3")  # the host copy is still good
    cache.drain()
    check(cache)
    cache.close()
    all_free(cache)


def test_a_failed_write_keeps_no_side_component_on_host(model):
    """A write that fails rolls back with its side components: nothing of the node is
    on host, and its side host slots are free."""
    streams = SimStreams(random.Random(3))
    cache = make_hybrid(model, stream_factory=streams.factory)
    streams.auto = random.Random(0)
    streams.auto.choice = lambda seq_: "fail_before"
    a = seq(16, 12)
    serve(cache, model, a, "r1")
    cache.drain()
    check(cache)
    node = cache.match_prefix(a.tolist(), count=False).last_device_node
    assert node.values[Tier.HOST] is None
    assert node.swa[Tier.HOST] is None and node.mamba[Tier.HOST] is None
    cache.evict(1000)
    streams.auto.choice = lambda seq_: "ok"
    r = serve(cache, model, torch.cat([a, seq(3, 13)]), "r2")
    assert r.length == 0  # nothing left: a miss, never wrong bytes
    cache.drain()
    check(cache)
    cache.close()
    all_free(cache)


def test_the_file_store_keeps_every_component_and_a_flushed_prefix_comes_back_from_it(
    model, tmp_path
):
    """After a flush the prefix comes back from the store, every component with it, and
    the resumed run is right (tests/cache/test_hybrid_store.py checks the bytes)."""
    cache = make_hybrid(model, tmp_path, store="file")
    a = seq(16, 14)
    serve(cache, model, a, "r1")
    cache.drain()
    assert cache.stats()["counters"]["l3_write_pages"] > 0
    cache.flush()
    check(cache)
    r = serve(cache, model, torch.cat([a, seq(3, 15)]), "r2")
    assert (r.length, r.got.storage_hit) == (16, 16)
    cache.drain()
    check(cache)
    cache.close()
    all_free(cache)


def test_finish_refuses_a_foreign_swa_row_or_state_before_anything_changes(model):
    cache = make_hybrid(model)
    if Component.SWA not in cache.side or Component.MAMBA not in cache.side:
        pytest.skip("needs both side components")
    a = seq(12, 16)
    r = Served(cache, model, a, "r1")
    with pytest.raises(ValueError, match="swa_indices is required"):
        cache.cache_finished("r1", a.tolist(), r.kv_row())
    with pytest.raises(ValueError, match="mamba_slot=.*not a state slot"):
        cache.cache_finished(
            "r1", a.tolist(), r.kv_row(), swa_indices=r.swa_row(), mamba_slot=3
        )
    bad = r.swa_row().clone()
    bad[-1] = bad[0]
    with pytest.raises(ValueError, match="more than once|not allocated"):
        cache.cache_finished("r1", a.tolist(), r.kv_row(), swa_indices=bad)
    r.finish()
    cache.drain()
    check(cache)
    cache.close()
    all_free(cache)


def test_finish_refuses_the_working_state_at_an_unaligned_length(model):
    """The working state slot holds the state after every token; at an unaligned length
    that is not the state at the aligned end the tree keeps: kept there, a later hit at
    that end would resume from the wrong state. Refused before anything changes."""
    cache = make_hybrid(model)
    if Component.MAMBA not in cache.side:
        pytest.skip("no mamba in this model")
    a = seq(21, 40)  # pages of 2: the tree keeps [0, 20)
    r = Served(cache, model, a, "r1")
    with pytest.raises(ValueError, match="working state slot"):
        cache.cache_finished(
            "r1",
            a.tolist(),
            r.kv_row(),
            swa_indices=r.swa_row(),
            mamba_slot=r.got.state_slot,
        )
    check(cache)
    r.finish()  # with its snapshot at 20
    cache.drain()
    check(cache)
    r = serve(cache, model, torch.cat([a[:20], seq(3, 41)]), "r2")
    assert r.length == 20
    cache.drain()
    check(cache)
    cache.close()
    all_free(cache)


def test_construction_errors_name_the_field():
    model = make_model()
    specs = model.component_specs(32, 4, 2)
    with pytest.raises(ValueError, match="layers: 1 full layers"):
        make_hybrid_with(model, specs, [Component.FULL, Component.SWA, Component.MAMBA])
    with pytest.raises(ValueError, match="needs full and"):
        make_hybrid_with(model, {Component.FULL: specs[Component.FULL]}, ["full"])
    with pytest.raises(ValueError, match="ssm"):
        make_hybrid_with(model, specs, ["ssm"])


def make_hybrid_with(model, specs, layers):
    from kvtier.cache.hybrid import HybridTieredCache
    from kvtier.config import load_config

    cfg = load_config(None, {"store": {"backend": "none"}}, env={})
    return HybridTieredCache(cfg, specs, layers)


def test_the_slots_a_copy_reads_are_not_reused_while_it_runs():
    """A write in flight reads its node's SWA slots: evicting them meanwhile defers the
    free until the write is applied (the copy read what the tree held)."""
    model = make_model((F, S, F, S))  # without states every window is live: SWA stays
    streams = SimStreams(random.Random(3))
    cache = make_hybrid(model, stream_factory=streams.factory)
    a = seq(16, 17)
    r = Served(cache, model, a, "r1")
    r.finish()  # its write is pending
    cache.controller.flush_writes()
    assert streams.pending
    side = cache.side.sides[Component.SWA]
    before = side.allocator.available_size()
    cache.tree.evict_component(Component.SWA, Tier.DEVICE, 1000)
    assert side.deferred[Tier.DEVICE] and side.allocator.available_size() == before
    check(cache)
    streams.resolve_all(random.Random(0))
    cache.drain()
    assert not side.deferred[Tier.DEVICE]
    check(cache)
    cache.close()
    all_free(cache)
    np.testing.assert_array_equal(side.pins[Tier.DEVICE].most_common(1), [])


def test_chunked_prefill_keeps_each_chunk_and_resumes_bitwise(model):
    """cache_unfinished after each chunk (with the state snapshot at its aligned end):
    the chunks are in the tree, the rest of the run is bitwise the uncached one, and a
    later request hits the chunk ends."""
    from kvtier.engine.hybrid import HybridChunk, HybridPools
    from tests.cache.hybrid_rig import MAX_CONTEXT, _dummy_state, _dummy_swa

    cache = make_hybrid(model)
    has_swa, has_state = Component.SWA in cache.side, Component.MAMBA in cache.side
    tokens = seq(23, 30)
    dense = model.forward_dense(tokens)
    got = cache.acquire(tokens.tolist(), "r1")
    full_rows = torch.zeros(1, MAX_CONTEXT, dtype=torch.int64)
    swa_rows = torch.zeros(1, MAX_CONTEXT, dtype=torch.int64)
    pools = HybridPools(
        cache.pool,
        cache.component_pool(Component.SWA) if has_swa else _dummy_swa(model),
        cache.component_pool(Component.MAMBA) if has_state else _dummy_state(model),
        full_rows,
        swa_rows,
    )
    work = got.state_slot if has_state else 1
    out, start, swa_start = [], 0, 0
    for end in (8, 14, 23):  # chunks start on page boundaries (pages of 2)
        n = end - start
        full = cache.alloc(n)
        swa = cache.alloc_swa(n) if has_swa else torch.zeros(n, dtype=torch.int64)
        full_rows[0, start:end] = full[:n]
        swa_rows[0, start:end] = swa[:n]
        snap = cache.alloc_state("r1") if has_state else None
        aligned = end - end % cache.page_size
        snaps = () if snap is None or aligned <= start else ((aligned, snap),)
        ch = HybridChunk(0, start, tokens[start:end], full[:n], swa[:n], work, snaps)
        out += model.forward_cached([ch], pools, cache.begin_forward(["r1"]).wait_layer)
        kv = full_rows[0, :end]
        row = swa_rows[0, swa_start:end] if has_swa else None
        if end == 23:
            cache.cache_finished(
                "r1", tokens.tolist(), kv, swa_indices=row, mamba_slot=snap
            )
            break
        got = cache.cache_unfinished(
            "r1", tokens[:end].tolist(), kv, swa_indices=row, mamba_slot=snap
        )
        full_rows[0, : len(got.indices)] = got.indices
        if has_swa:
            swa_rows[0, got.swa_start : len(got.indices)] = got.swa_indices
        swa_start, start = got.swa_start, end
        assert got.state_slot == (work if has_state else None)
        check(cache)
    assert torch.equal(torch.cat(out), dense)
    cache.drain()
    check(cache)
    r = serve(cache, model, torch.cat([tokens[:15], seq(4, 31)]), "r2")
    assert r.length == 14  # the second chunk's aligned end, from the tree
    cache.drain()
    check(cache)
    cache.close()
    all_free(cache)


def test_host_slots_a_load_reads_are_not_reused_while_it_runs(model):
    """A request's load of its window (and state) from host, the FULL KV on device: the
    tree lets those host slots go meanwhile (evicted there), every free host slot is then
    taken and overwritten, and still the load reads what the tree held (its host slots
    were deferred, not freed), so the run equals the uncached one."""
    streams = SimStreams(random.Random(3))
    cache = make_hybrid(model, stream_factory=streams.factory)
    streams.auto = random.Random(0)
    streams.auto.choice = lambda seq_: "ok"
    a = seq(20, 50)
    serve(cache, model, a, "r1")
    cache.drain()
    for c in cache.side.sides:
        cache.tree.evict_component(c, Tier.DEVICE, 1000)
    check(cache)
    streams.auto = None
    b = torch.cat([a, seq(5, 51)])
    real = cache.acquire

    def acquire_then_reuse(tokens, rid, extra_key=None):
        got = real(tokens, rid, extra_key)
        assert got.host_hit == 20 and streams.pending  # the side parts' load, held
        for c, side in cache.side.sides.items():
            assert cache.tree.evict_component(c, Tier.HOST, 1000).evicted > 0
            assert side.deferred[Tier.HOST]
            free = cache.controller.component_host_accounting(c).free
            taken = cache.controller.alloc_component_host(c, free)
            ps, m = side.mirror.page_size, side.mirror
            for layer in range(m.num_layers):
                for part in range(len(m.widths)):
                    m.view(layer, part)[taken // ps, taken % ps] = float("nan")
            cache.controller.free_component_host(c, taken)
        check(cache)
        ok = random.Random(0)
        ok.choice = lambda seq_: "ok"
        while streams.pending:
            streams.resolve(streams.pending[0], "ok", ok)
        return got

    cache.acquire = acquire_then_reuse
    serve(cache, model, b, "r2")
    cache.acquire = real
    cache.drain()
    check(cache)
    for side in cache.side.sides.values():
        assert not side.deferred[Tier.HOST]
    cache.close()


def test_sides_a_finish_puts_on_a_node_already_on_host_are_written_through(model):
    """A finish whose end falls inside another request's node, already on host: the
    split's upper half takes the state and the window there (SWA alone: the window that
    replaces a tombstone), on device only, and write-through writes them to host too; after the device is evicted the next turn
    restores that length from host, bitwise."""
    cache = make_hybrid(model)
    a = seq(20, 21)
    serve(cache, model, a, "r1")
    cache.drain()
    if (
        Component.MAMBA not in cache.side
    ):  # every window is kept: drop them (tombstones)
        for tier in (Tier.DEVICE, Tier.HOST):
            cache.tree.evict_component(Component.SWA, tier, 1000)
    serve(cache, model, a[:10], "r2")  # nothing at 10 yet: computed, then kept there
    cache.drain()
    check(cache)
    node = cache.match_prefix(a[:10].tolist(), count=False).last_device_node
    assert node.end == 10 and node.values[Tier.HOST] is not None
    for values in (node.swa, node.mamba):
        assert (values[Tier.DEVICE] is None) == (values[Tier.HOST] is None)
    assert cache.evict(1000) == 20
    check(cache)
    r = serve(cache, model, torch.cat([a[:10], seq(5, 22)]), "r3")
    assert (r.length, r.got.device_hit, r.got.host_hit) == (10, 0, 10)
    cache.drain()
    check(cache)
    cache.close()
    check(cache)
    all_free(cache)


def test_write_back_saves_the_sides_of_a_backed_up_node_before_evicting_it(model):
    """Write-back: a finish puts its state and window on a node whose FULL KV is on host
    (split from one an eviction backed up); the next device eviction writes them to host
    before it drops them, and the next turn restores that length from host, bitwise."""
    cache = make_hybrid(model, write_policy="write_back")
    a = seq(20, 31)
    serve(cache, model, a, "r1")
    assert cache.evict(1000) == 20  # backed up, then evicted
    if (
        Component.MAMBA not in cache.side
    ):  # every window is kept: drop them (tombstones)
        cache.tree.evict_component(Component.SWA, Tier.HOST, 1000)
    serve(cache, model, a[:10], "r2")  # nothing at 10 yet: computed, then kept there
    check(cache)
    assert cache.evict(1000) == 10
    check(cache)
    r = serve(cache, model, torch.cat([a[:10], seq(5, 32)]), "r3")
    assert (r.length, r.got.device_hit, r.got.host_hit) == (10, 0, 10)
    cache.drain()
    check(cache)
    cache.close()
    check(cache)
    all_free(cache)
