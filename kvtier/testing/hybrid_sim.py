"""The fault simulator over a hybrid model's cache (`HybridTieredCache`): FaultSim's seeded
schedule of arrivals, forwards, polls, copies and store calls that end in any order with
any outcome, aborts, evictions and closes, for a model of three layers, one per component:

| model layer | component | its pool              | what a forward at position p reads            |
|-------------|-----------|-----------------------|-----------------------------------------------|
| 0           | FULL      | KV, 1 head of 2       | K/V of tokens [0, p)                          |
| 1           | SWA       | KV, 1 head of 2       | K/V of tokens [swa_start, p): the window handed and what it computed |
| 2           | MAMBA     | states of 4 floats    | the request's state slot: the state after p   |

The byte oracle, per component: token j's FULL and SWA K/V and the state after L tokens
are each a function of the prefix only (distinct ones), so a forward that reads a byte of
another prefix, another position or another length fails the check (unless its waiter
named its load failed). Prefill is never kept mid-request (the hybrid cache takes no
chunk); a finish keeps the state at its page-aligned length through a snapshot slot.

`plant` puts a known bug into the cache's tree, for the simulator to find:
- `mamba-split`: a split gives the node's state to the upper half, so a match that ends
  there restores a state taken at another length;
- `swa-order`: a restore hands the pieces of an SWA window that spans several nodes in
  the wrong order (bottom-up), so each token's slot holds another token's K/V.

Both patch a private of the tree or the cache (a test's own bug, never shipped).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.errors import TransferError
from kvtier.testing.episodes import Failure, Player, play, run_episodes, schedule
from kvtier.testing.fault_sim import HASH_MODULUS, FaultSim, Req, Setup, reference_kv
from kvtier.testing.misuse import Violation
from kvtier.tiers.components import Component, ComponentSpec
from kvtier.tiers.pool import PoolConfig, StatePoolConfig

LAYERS = (Component.FULL, Component.SWA, Component.MAMBA)
STATE = 4  # floats in a state
PLANTED = ("mamba-split", "swa-order")


def reference_state(tokens: np.ndarray) -> torch.Tensor:
    """The state after all of `tokens` ([STATE] float32; zeros for none)."""
    if len(tokens) == 0:
        return torch.zeros(STATE)
    h = 0
    for t in tokens.tolist():
        h = (h * 1_000_033 + t + 7) % HASH_MODULUS
    return torch.tensor([(h >> (11 * c)) % (1 << 23) for c in range(STATE)]).float()


@dataclass
class HybridSetup(Setup):
    window: int = 4  # SWA window, tokens
    plant: str | None = None

    @classmethod
    def draw_hybrid(cls, rng: random.Random, plant: str | None = None) -> HybridSetup:
        return cls(
            rng.choice([1, 2, 4]),
            rng.choice(["page_first", "layer_first"]),
            "direct",
            rng.choice(["write_through", "write_through_selective", "write_back"]),
            rng.choice(["best_effort", "wait_complete", "timeout"]),
            rng.choice([0.0, 0.25]),
            rng.choice(["sha256", "xxh3_128"]),
            window=rng.choice([1, 3, 4, 8]),
            plant=plant,
        )


@dataclass(eq=False)
class HReq(Req):
    """A request of the hybrid model (its `ref`: [(K, V) FULL, (K, V) SWA] per token)."""

    hit: int = 0
    swa_start: int = 0
    swa_row: torch.Tensor = field(
        default_factory=lambda: torch.empty(0, dtype=torch.int64)
    )  # SWA slots of [swa_start, pos)
    state_slot: int | None = None
    snap: int | None = None


class HybridFaultSim(FaultSim):
    turns: list[
        np.ndarray
    ]  # what the last requests that finished fed: next turns extend them

    def __init__(self, *args, **kwargs) -> None:
        self.turns = []
        super().__init__(*args, **kwargs)

    def make_cache(self, config, **parts):
        from kvtier.cache.hybrid import HybridTieredCache

        s: HybridSetup = self.setup  # type: ignore[assignment]
        ps = s.page_size
        pages = config.pool.size // ps

        def kv(size: int) -> PoolConfig:
            return PoolConfig(
                size=size,
                num_layers=1,
                page_size=ps,
                num_kv_heads=1,
                head_dim=2,
                dtype="float32",
            )

        # smaller side pools than FULL's: their own evictions (SWA tombstones, states
        # dropped) happen while FULL KV stays
        specs = {
            Component.FULL: ComponentSpec(Component.FULL, kv(config.pool.size)),
            Component.SWA: ComponentSpec(
                Component.SWA, kv(ps * (pages * 3 // 4)), window=s.window
            ),
            Component.MAMBA: ComponentSpec(
                Component.MAMBA,
                StatePoolConfig(size=pages // 2, num_layers=1, state_shape=(STATE,)),
            ),
        }
        cache = HybridTieredCache(config, specs, LAYERS, **parts)
        if s.plant is not None:
            plant(cache, s.plant)
        return cache

    # -- the request sequence, with every component -------------------------------------------

    def misuse(self) -> str | None:
        """None: misuse.py's calls are a full-attention caller's (no SWA row)."""
        return None

    def _base(self) -> tuple[np.ndarray, int]:
        base, keep = super()._base()
        if self.turns and self.rng.random() < 0.5:  # a next turn: states are at ends
            base = self.rng.choice(self.turns)
            keep = len(base)
        return base, keep

    def _request(self, rid: str, tokens: np.ndarray) -> HReq:
        return HReq(rid, tokens, reference_kv(tokens))

    def _take(self, req: HReq, got) -> str:
        """The SWA window and the state slot a hit hands, checked."""
        req.hit, req.swa_start = req.pos, got.swa_start
        req.swa_row, req.state_slot, req.snap = got.swa_indices, got.state_slot, None
        want = max(0, req.pos - self._window_tokens())
        if req.swa_start != want or req.swa_row.numel() != req.pos - want:
            raise Violation(
                f"{req.rid}: a hit of {req.pos} handed SWA tokens from {req.swa_start} "
                f"({req.swa_row.numel()} slots); its window starts at {want}"
            )
        if req.state_slot is None:
            raise Violation(f"{req.rid}: acquired without a state slot")
        return f"; swa {req.swa_row.numel()}, tree's {got.swa_tree_len}"

    def _window_tokens(self) -> int:
        ps = self.setup.page_size
        return -(-self.setup.window // ps) * ps

    def forward(self) -> None:
        # (request, tokens this forward, FULL slots, SWA slots, snapshot length)
        batch = [(r, n, *got) for r, n, got in self._batch("pools")]
        if not batch:
            return
        waiter = self._begin(batch)
        for layer, component in enumerate(LAYERS):
            self._land_or_not(list(waiter.loads.values()))
            waiter.wait_layer(layer)
            for req, n, own, swa, snap_at in batch:
                if req.rid not in waiter.bad:
                    self._check_component(req, component)
                self._write_component(req, component, n, own, swa, snap_at)
            self._overlap(layer)
        failed = waiter.failed()
        for req, n, own, swa, _ in batch:
            req.row = torch.cat([req.row, own])
            req.swa_row = torch.cat([req.swa_row, swa])
            if req.rid in failed:
                self.note(f"  {req.rid}: its load failed; abort")
                self._abort(req)
                continue
            req.pos += n
            if req.pos == len(req.tokens):
                self._finish(req)

    def _slots(self, req: HReq, n: int):
        """(FULL slots, SWA slots, snapshot length or None) for tokens [pos, pos + n), or
        None when a pool is short."""
        full = self._grow(req.pos, req.row, n, self.cache.alloc)
        if full is None:
            return None
        swa = self._grow(req.pos, req.swa_row, n, self.cache.alloc_swa)
        if swa is None:
            self._free_new(req.pos, req.row, full, self.cache.free)
            return None
        end, ps = req.pos + n, self.setup.page_size
        aligned = len(req.tokens) - len(req.tokens) % ps
        snap_at = None
        if req.pos < aligned <= end and aligned > req.hit and req.snap is None:
            if self.rng.random() < 0.9:  # else: the finish keeps no state
                req.snap = self.cache.alloc_state(req.rid)
                snap_at = aligned if req.snap is not None else None
        return full[:n], swa[:n], snap_at

    def _free_new(self, pos: int, row: torch.Tensor, slots: torch.Tensor, free) -> None:
        ps = self.setup.page_size
        room = (ps - pos % ps) % ps if row.numel() else 0
        if slots.numel() > room:
            free(slots[room:])

    def _check_component(self, req: HReq, component: Component) -> None:
        if component == Component.MAMBA:
            got = self.cache.component_pool(component).state_buffer(0)[req.state_slot]
            want = reference_state(req.tokens[: req.pos])
            if not torch.equal(got.reshape(-1), want):
                raise Violation(
                    f"WRONG STATE: {req.rid} read the state of slot {req.state_slot} at "
                    f"{req.pos} tokens (hit {req.hit}): not the state after them"
                )
            return
        if component == Component.FULL:
            pool, slots, lo, (k_ref, v_ref) = (
                self.cache.pool,
                req.row[: req.pos],
                0,
                req.ref[0],
            )
        else:
            pool, lo, (k_ref, v_ref) = (
                self.cache.component_pool(component),
                req.swa_start,
                req.ref[1],
            )
            slots = req.swa_row[: req.pos - lo]
        if req.pos <= lo:
            return
        k, v = pool.k_buffer(0)[slots], pool.v_buffer(0)[slots]
        bad = ~(
            (k == k_ref[lo : req.pos]).all(-1).all(-1)
            & (v == v_ref[lo : req.pos]).all(-1).all(-1)
        )
        if bad.any():
            first = int(torch.nonzero(bad)[0])
            raise Violation(
                f"WRONG KV: {req.rid} {component.value} read {int(bad.sum())} wrong tokens of "
                f"[{lo}, {req.pos}), first at token {lo + first} (slot {int(slots[first])})"
            )

    def _write_component(self, req, component, n, own, swa, snap_at) -> None:
        end = req.pos + n
        if component == Component.MAMBA:
            buf = self.cache.component_pool(component).state_buffer(0)
            buf[req.state_slot] = reference_state(req.tokens[:end]).view(STATE)
            if snap_at is not None:
                buf[req.snap] = reference_state(req.tokens[:snap_at]).view(STATE)
            return
        pool, slots, (k, v) = (
            (self.cache.pool, own, req.ref[0])
            if component == Component.FULL
            else (self.cache.component_pool(component), swa, req.ref[1])
        )
        pool.set_kv(0, slots, k[req.pos : end], v[req.pos : end])

    def _finish(self, req: HReq) -> None:
        del self.running[req.rid]
        self.turns = [*self.turns[-7:], req.tokens]
        try:
            self.cache.cache_finished(
                req.rid,
                req.tokens,
                req.row,
                swa_indices=req.swa_row,
                mamba_slot=req.snap,
            )
            self.note(f"  {req.rid} finished (state kept: {req.snap is not None})")
        except TransferError as exc:
            self.note(f"  {req.rid} finish refused: {exc}")

    def _abort(self, req: HReq) -> None:
        self.running.pop(req.rid, None)
        self.waiting.pop(req.rid, None)
        self.cache.abort(
            req.rid,
            req.row if req.row.numel() else None,
            swa_indices=req.swa_row if req.row.numel() else None,
        )


def plant(cache, what: str) -> None:
    """Put the bug `what` (PLANTED) into `cache`, a `HybridTieredCache`."""
    if what not in PLANTED:
        raise ValueError(f"plant={what!r}: allowed: {', '.join(PLANTED)}")
    tree = cache.tree
    if what == "mamba-split":
        split = tree._split

        def bad_split(child, k):
            upper = split(child, k)
            for tier in (0, 1):
                if child.mamba[tier] is not None and upper.mamba[tier] is None:
                    tree._begin(child)
                    tree._begin(upper)
                    upper.mamba[tier], child.mamba[tier] = child.mamba[tier], None
                    tree._end(upper)
                    tree._end(child)
            return upper

        tree._split = bad_split
    else:
        pieces = cache._window_pieces
        cache._window_pieces = lambda node, length: pieces(node, length)[::-1]


def hybrid_player(plant: str | None = None, actions=None) -> Player:
    """The hybrid cache's episodes: each draws its setup from its seed, with `plant`."""

    def one(k: int, ep_seed: int, n: int) -> tuple[HybridSetup, Failure | None]:
        setup = HybridSetup.draw_hybrid(random.Random(ep_seed), plant)
        return setup, play(HybridFaultSim(ep_seed, setup), n, actions)

    flags = " --hybrid" + (f" --plant {plant}" if plant else "")
    return Player(one, "fault sim (hybrid)", flags=flags)


def run_hybrid(
    steps: int,
    seed: int,
    episode: int = 400,
    out=None,
    plant: str | None = None,
    actions=None,
) -> int:
    """`fault_sim.run` over the hybrid cache; returns the number of violations."""
    hybrid = hybrid_player(plant, actions)
    return run_episodes(schedule(steps, seed, episode), hybrid, out)
