"""The hybrid reference model: a run resumed from cached pieces (full KV of the prefix,
SWA KV of its last `window` tokens, the recurrent state at exactly its end) equals the
uncached run bit for bit, and any wrong piece shows."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.hybrid import (
    HybridChunk,
    HybridConfig,
    HybridModel,
    HybridPools,
    LayerKind,
)
from kvtier.tiers.pool import DeviceKVPool, PoolConfig, StatePoolConfig

WINDOW = 8
CONFIG = HybridConfig(window=WINDOW, seed=3)
MAX_CONTEXT = 128
POISON = 1  # a slot of NaN K/V (and a NaN state): reading it makes every logit NaN


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(CONFIG)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, CONFIG.vocab, (n,), generator=torch.Generator().manual_seed(seed)
    )


class Rig:
    """Three pools and two slot tables; slot 1 of each pool is poison, slots from 2 on are
    handed out in order."""

    def __init__(self, model: HybridModel) -> None:
        c = model.config

        def kv(kind: LayerKind) -> DeviceKVPool:
            return DeviceKVPool(
                PoolConfig(
                    size=512,
                    num_layers=c.count(kind),
                    page_size=1,
                    num_kv_heads=c.num_kv_heads,
                    head_dim=c.head_dim,
                    dtype="float32",
                )
            )

        state = DeviceKVPool(
            StatePoolConfig(
                size=16,
                num_layers=c.count(LayerKind.RECURRENT),
                state_shape=c.state_shape,
            )
        )
        rows = torch.zeros(4, MAX_CONTEXT, dtype=torch.int64)
        self.pools = HybridPools(
            kv(LayerKind.FULL), kv(LayerKind.SWA), state, rows, rows.clone()
        )
        for pool in (self.pools.full, self.pools.swa, state):
            for part in pool.parts:
                part[:, POISON] = float("nan")
        self.model = model
        self.next = {"full": 2, "swa": 2, "state": 2}

    def take(self, what: str, n: int) -> torch.Tensor:
        first = self.next[what]
        self.next[what] += n
        return torch.arange(first, first + n)

    def new_state(self) -> int:
        slot = int(self.take("state", 1)[0])
        self.pools.state.copy_states(torch.tensor([0]), torch.tensor([slot]))  # zeros
        return slot

    def run(self, row, seq, start, state_slot, chunk=1000, snapshots=()):
        """Feed seq[start:] in chunks of `chunk`; logits of those positions."""
        out = []
        for a in range(start, len(seq), chunk):
            b = min(len(seq), a + chunk)
            full, swa = self.take("full", b - a), self.take("swa", b - a)
            self.pools.full_rows[row, a:b] = full
            self.pools.swa_rows[row, a:b] = swa
            snaps = tuple((n, s) for n, s in snapshots if a < n <= b)
            ch = HybridChunk(row, a, seq[a:b], full, swa, state_slot, snaps)
            out += self.model.forward_cached([ch], self.pools)
        return torch.cat(out)

    def resume(self, row, src_row, length, state_from, window_drop=None):
        """Row `row` starts from `src_row`'s first `length` tokens as a cache would hand
        them back: the full slots shared, the SWA window copied into fresh slots (earlier
        positions point at poison), the state copied from slot `state_from`."""
        p = self.pools
        p.full_rows[row, :length] = p.full_rows[src_row, :length]
        p.swa_rows[row, :length] = POISON
        lo = max(0, length - WINDOW)
        fresh = self.take("swa", length - lo)
        src = p.swa_rows[src_row, lo:length]
        for part in p.swa.parts:
            part[:, fresh] = part[:, src]
        p.swa_rows[row, lo:length] = fresh
        if window_drop is not None:  # that position's SWA KV is missing (zeros)
            p.swa_rows[row, window_drop] = 0
        slot = int(self.take("state", 1)[0])
        p.state.copy_states(torch.tensor([state_from]), torch.tensor([slot]))
        return slot


def test_chunked_prefill_and_batches_equal_the_uncached_run_bitwise(model):
    seq_a, seq_b = tokens(45, 1), tokens(30, 2)
    dense_a, dense_b = model.forward_dense(seq_a), model.forward_dense(seq_b)
    for chunk in (1, 7, 16, 45):
        rig = Rig(model)
        assert torch.equal(rig.run(0, seq_a, 0, rig.new_state(), chunk), dense_a)
    # two requests in one forward, each in its own chunk
    rig = Rig(model)
    sa, sb = rig.new_state(), rig.new_state()
    chunks = []
    for row, seq, slot in ((0, seq_a, sa), (1, seq_b, sb)):
        full, swa = rig.take("full", len(seq)), rig.take("swa", len(seq))
        rig.pools.full_rows[row, : len(seq)] = full
        rig.pools.swa_rows[row, : len(seq)] = swa
        chunks.append(HybridChunk(row, 0, seq, full, swa, slot))
    got = model.forward_cached(chunks, rig.pools)
    assert torch.equal(got[0], dense_a) and torch.equal(got[1], dense_b)


def test_greedy_decode_equals_the_uncached_argmax(model):
    rig = Rig(model)
    seq = tokens(20, 4)
    slot = rig.new_state()
    logits = rig.run(0, seq, 0, slot)
    out = [int(logits[-1].argmax())]
    for _ in range(12):
        fed = torch.cat([seq, torch.tensor(out)])
        out.append(int(rig.run(0, fed, len(fed) - 1, slot)[-1].argmax()))
    dense = model.forward_dense(torch.cat([seq, torch.tensor(out[:-1])]))
    assert dense[len(seq) - 1 :].argmax(-1).tolist() == out


@pytest.mark.parametrize("length", [1, 5, WINDOW, WINDOW + 1, 24, 33])
def test_a_run_resumed_from_the_three_pieces_equals_the_uncached_run(model, length):
    """Full KV of the prefix, the SWA KV of its last WINDOW tokens (everything before
    points at NaN: never read), the state taken at exactly `length`."""
    rig = Rig(model)
    first = tokens(40, 5)
    snap = int(rig.take("state", 1)[0])
    rig.run(0, first, 0, rig.new_state(), chunk=7, snapshots=((length, snap),))
    second = torch.cat([first[:length], tokens(20, 6)])
    slot = rig.resume(1, 0, length, snap)
    got = rig.run(1, second, length, slot, chunk=6)
    assert torch.equal(got, model.forward_dense(second)[length:])


def test_a_state_from_another_boundary_gives_other_logits(model):
    rig = Rig(model)
    first, length = tokens(40, 7), 20
    snaps = {n: int(rig.take("state", 1)[0]) for n in (length - 1, length, length + 1)}
    rig.run(
        0,
        first,
        0,
        rig.new_state(),
        chunk=5,
        snapshots=tuple((n, s) for n, s in snaps.items()),
    )
    second = torch.cat([first[:length], tokens(10, 8)])
    want = model.forward_dense(second)[length:]
    slot = rig.resume(1, 0, length, snaps[length])
    assert torch.equal(rig.run(1, second, length, slot), want)
    for other in (length - 1, length + 1):
        slot = rig.resume(2, 0, length, snaps[other])
        got = rig.run(2, second, length, slot)
        assert not torch.equal(got, want)
        assert not torch.isnan(got).any()  # a wrong state is wrong bytes, not a crash


@pytest.mark.parametrize("drop", ["oldest", "newest"])
def test_a_window_missing_a_token_gives_other_logits(model, drop):
    rig = Rig(model)
    first, length = tokens(40, 9), 25
    snap = int(rig.take("state", 1)[0])
    rig.run(0, first, 0, rig.new_state(), chunk=8, snapshots=((length, snap),))
    second = torch.cat([first[:length], tokens(10, 10)])
    want = model.forward_dense(second)[length:]
    position = length - WINDOW if drop == "oldest" else length - 1
    slot = rig.resume(1, 0, length, snap, window_drop=position)
    got = rig.run(1, second, length, slot)
    assert not torch.equal(got, want)
    # the window is exactly WINDOW tokens: one more before it is never read (poison above)
    slot = rig.resume(2, 0, length, snap)
    assert torch.equal(rig.run(2, second, length, slot), want)


def test_needs_names_the_pieces_a_resumed_run_reads(model):
    n = model.needs(20)
    assert (n.full, n.swa, n.state_at) == (range(0, 20), range(20 - WINDOW, 20), 20)
    assert model.needs(3).swa == range(0, 3)
    only_full = HybridModel(HybridConfig(layers=("full",)))
    assert only_full.needs(5).swa == range(0) and only_full.needs(5).state_at is None


def test_bad_config_and_pools_are_refused_by_name(model):
    with pytest.raises(
        ValueError,
        match="layers: 'mamba' is not a layer kind; allowed: full, swa, recurrent",
    ):
        HybridConfig(layers=("full", "mamba"))
    with pytest.raises(ValueError, match="layers='full': a sequence of layer kinds"):
        HybridConfig(layers="full")
    with pytest.raises(ValueError, match="window=0"):
        HybridConfig(window=0)
    rig = Rig(model)
    model.check_pools(rig.pools)
    bad = DeviceKVPool(
        PoolConfig(
            size=8,
            num_layers=2,
            page_size=1,
            num_kv_heads=2,
            head_dim=8,
            dtype="float32",
        )
    )
    rig.pools.swa = bad
    with pytest.raises(ValueError, match="swa pool"):
        model.check_pools(rig.pools)
    with pytest.raises(ValueError, match="needs a cache that holds"):
        model.check_pool(bad)
    with pytest.raises(ValueError, match="snapshot lengths"):
        rig.model.forward_cached(
            [
                HybridChunk(
                    0,
                    0,
                    tokens(3, 1),
                    torch.arange(2, 5),
                    torch.arange(2, 5),
                    2,
                    ((4, 3),),
                )
            ],
            Rig(model).pools,
        )


def test_the_fingerprint_names_weights_and_layer_plan():
    a = HybridModel(HybridConfig(seed=1)).fingerprint()
    assert a == HybridModel(HybridConfig(seed=1)).fingerprint()
    assert a != HybridModel(HybridConfig(seed=2)).fingerprint()
    assert a != HybridModel(HybridConfig(seed=1, window=9)).fingerprint()


def test_nothing_of_a_layer_is_read_before_its_load_lands(model):
    """Each layer's cached pieces (full KV, the SWA window, the state) land only when the
    forward waits for that layer, as a host->device load does: the resumed run still
    equals the uncached one, and it waited once per layer, in order."""
    rig, length = Rig(model), 21
    first = tokens(40, 11)
    snap = int(rig.take("state", 1)[0])
    rig.run(0, first, 0, rig.new_state(), chunk=9, snapshots=((length, snap),))
    p, lo = rig.pools, length - WINDOW
    full_src, swa_src = (
        p.full_rows[0, :length].clone(),
        p.swa_rows[0, lo:length].clone(),
    )
    full_dst, swa_dst = rig.take("full", length), rig.take("swa", WINDOW)
    state_dst = int(rig.take("state", 1)[0])  # zeros until its layer lands
    p.full_rows[1, :length], p.swa_rows[1, lo:length] = full_dst, swa_dst
    waited = []

    def land(i: int) -> None:
        waited.append(i)
        layer = model.pool_layer[i]
        kind = model.config.layers[i]
        if kind == LayerKind.RECURRENT:
            buf = p.state.state_buffer(layer)
            buf[state_dst] = buf[snap]
            return
        pool, src, dst = (
            (p.full, full_src, full_dst)
            if kind == LayerKind.FULL
            else (p.swa, swa_src, swa_dst)
        )
        for rows in pool.rows(layer):
            rows[dst] = rows[src]

    second = torch.cat([first[:length], tokens(12, 12)])
    n = len(second) - length
    full, swa = rig.take("full", n), rig.take("swa", n)
    p.full_rows[1, length : len(second)] = full
    p.swa_rows[1, length : len(second)] = swa
    chunk = HybridChunk(1, length, second[length:], full, swa, state_dst)
    (got,) = model.forward_cached([chunk], p, land)
    assert waited == list(range(len(model.config.layers)))
    assert torch.equal(got, model.forward_dense(second)[length:])


def test_component_specs_build_the_pools_the_model_checks(model):
    from kvtier.tiers.components import Component
    from kvtier.hashing import Namespace

    specs = model.component_specs(tokens=64, states=8, page_size=4, swa_tokens=32)
    assert list(specs) == [Component.FULL, Component.SWA, Component.MAMBA]
    assert (
        specs[Component.SWA].window == WINDOW and specs[Component.SWA].pool.size == 32
    )
    pools = {k: DeviceKVPool(s.pool) for k, s in specs.items()}
    rows = torch.zeros(1, 8, dtype=torch.int64)
    model.check_pools(
        HybridPools(
            pools[Component.FULL],
            pools[Component.SWA],
            pools[Component.MAMBA],
            rows,
            rows.clone(),
        )
    )
    base = Namespace("m", "float32", "x", 4)
    other = HybridModel(HybridConfig(window=WINDOW + 1, seed=3))
    theirs = other.component_specs(tokens=64, states=8, page_size=4, swa_tokens=32)
    # the window is the SWA pages' geometry only; what else differs between two models
    # (their weights, and so every state) the base's revision names (`fingerprint`)
    assert model.fingerprint() != other.fingerprint()
    for kind in (Component.FULL, Component.MAMBA):
        assert specs[kind].namespace(base).id == theirs[kind].namespace(base).id
    swa_ns = specs[Component.SWA].namespace(base).id
    assert swa_ns != theirs[Component.SWA].namespace(base).id
    assert HybridModel(HybridConfig(layers=("full",))).component_specs(8, 1).keys() == {
        Component.FULL
    }
