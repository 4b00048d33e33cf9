"""A tiny deterministic hybrid model: full-attention, sliding-window and recurrent layers.

Weights come from a seed; fp32 on CPU. What a run that resumes from a cached prefix of
length L needs, per kind of layer (`HybridModel.needs`):

| layer kind  | cached piece                          | token positions it covers   |
|-------------|---------------------------------------|-----------------------------|
| `full`      | K/V of every prefix token             | [0, L)                      |
| `swa`       | K/V of the last `window` prefix tokens | [max(0, L - window), L)     |
| `recurrent` | the state after exactly L tokens      | one fixed-size slot         |

A query at position p of a `swa` layer attends to positions [max(0, p - window), p]:
itself and the `window` tokens before it, so the window is exactly the last `window`
tokens of any prefix it resumes from.

Bit-exactness: both forwards (`forward_dense`, the oracle, and `forward_cached`, over the
pools) compute every token by the same per-token step, with the same tensor shapes for the
same position: a matmul, a reduction or a vectorized elementwise op over a differently
shaped batch may round differently (tails, blocking), and then a resumed run would equal
the uncached one only within a tolerance. So a resumed run's logits are `torch.equal` to
the uncached run's, and any wrong piece (a state of another boundary, a window missing a
token) shows as different logits.

The cached forward reads three pools (`HybridPools`): the full layers' KV pool and the
SWA layers' KV pool (token-indexed, each through its own `[rows, max_context]` table of
slots per request) and the state pool (`StatePoolConfig`, one slot per
sequence; the request's slot holds its state at its chunk's start and is advanced in
place).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from enum import Enum

import torch
import xxhash

from kvtier.tiers.components import Component, ComponentSpec
from kvtier.tiers.pool import DeviceKVPool, PoolConfig, StatePoolConfig


class LayerKind(str, Enum):
    FULL = "full"
    SWA = "swa"
    RECURRENT = "recurrent"


_DEFAULT_LAYERS = (
    LayerKind.FULL,
    LayerKind.SWA,
    LayerKind.RECURRENT,
    LayerKind.SWA,
    LayerKind.FULL,
    LayerKind.RECURRENT,
)


@dataclass(slots=True, frozen=True)
class HybridConfig:
    """`layers`: the kind of each layer, bottom up. `window`: tokens before a query that a
    sliding-window layer sees. A recurrent layer's state is `[num_heads, head_dim]`."""

    vocab: int = 512
    layers: tuple[LayerKind, ...] = _DEFAULT_LAYERS
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    window: int = 16
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        allowed = ", ".join(k.value for k in LayerKind)
        if isinstance(self.layers, str):
            raise ValueError(
                f"layers={self.layers!r}: a sequence of layer kinds ({allowed}), not a string"
            )
        kinds = []
        for k in self.layers:
            try:
                kinds.append(LayerKind(k))
            except ValueError:
                raise ValueError(
                    f"layers: {k!r} is not a layer kind; allowed: {allowed}"
                ) from None
        object.__setattr__(self, "layers", tuple(kinds))
        for name in ("vocab", "num_heads", "num_kv_heads", "head_dim", "ffn", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads}: must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if not kinds:
            raise ValueError("layers=(): a model needs at least one layer")

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    def count(self, kind: LayerKind) -> int:
        return sum(k == kind for k in self.layers)

    @property
    def state_shape(self) -> tuple[int, ...]:
        """One recurrent layer's state per sequence."""
        return (self.num_heads, self.head_dim)


@dataclass(slots=True, frozen=True)
class Needs:
    """What a run resuming after `length` cached tokens reads from the cache."""

    length: int
    full: range  # positions whose full-layer K/V it reads
    swa: range  # positions whose SWA-layer K/V it reads
    # the recurrent state after exactly this many tokens (None: no recurrent layer)
    state_at: int | None


@dataclass(slots=True)
class HybridChunk:
    """One request's share of a forward: tokens [start, start+len(tokens)).

    `row`: the request's row in both slot tables (`HybridPools.full_rows`, `swa_rows`);
    `slots`, `swa_slots`: where the new tokens' K/V go in the full and SWA pools (the
    tables must already list them); `state_slot`: holds the state after `start` tokens and
    is left holding the state after the chunk; `snapshots`: (length, slot) pairs, each
    length in (start, end]: the state after `length` tokens is also copied to `slot` (what
    a cache keeps at a node boundary)."""

    row: int
    start: int
    tokens: torch.Tensor  # int64
    slots: torch.Tensor  # int64
    swa_slots: torch.Tensor  # int64
    state_slot: int
    snapshots: tuple[tuple[int, int], ...] = field(default=())


@dataclass(slots=True)
class HybridPools:
    """Where a cached forward reads and writes: per component a pool, and the token
    components' `[rows, max_context]` tables of slots (int32 or int64)."""

    full: DeviceKVPool
    swa: DeviceKVPool
    state: DeviceKVPool
    full_rows: torch.Tensor
    swa_rows: torch.Tensor


_COMPONENT_OF = {
    LayerKind.FULL: Component.FULL,
    LayerKind.SWA: Component.SWA,
    LayerKind.RECURRENT: Component.MAMBA,
}


class HybridModel:
    kind = "hybrid"

    def __init__(self, config: HybridConfig = HybridConfig()) -> None:
        self.config = c = config
        g = torch.Generator().manual_seed(c.seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        kv = c.num_kv_heads * c.head_dim
        self.embed = torch.randn(c.vocab, c.hidden, generator=g)
        self.layers: list[dict[str, torch.Tensor]] = []
        for kind in c.layers:
            if kind == LayerKind.RECURRENT:
                wa, ba = w(c.hidden, c.hidden), torch.randn(c.hidden, generator=g)
                mixer = {
                    "waug": torch.cat(
                        [wa, w(c.hidden, c.hidden), w(c.hidden, c.hidden)], 1
                    ),
                    "ba": ba,
                }
            else:  # q, k and v of a token in one matmul
                mixer = {
                    "wqkv": torch.cat(
                        [w(c.hidden, c.hidden), w(c.hidden, kv), w(c.hidden, kv)], 1
                    )
                }
            wo = w(c.hidden, c.hidden)
            w1, w3 = w(c.hidden, c.ffn), w(c.hidden, c.ffn)
            self.layers.append(
                {
                    "norm1": torch.ones(c.hidden),
                    **mixer,
                    "wo": wo,
                    "norm2": torch.ones(c.hidden),
                    "w13": torch.cat([w1, w3], 1),  # gate and up in one matmul
                    "w2": w(c.ffn, c.hidden),
                }
            )
        self.norm = torch.ones(c.hidden)
        self.head = w(c.hidden, c.vocab)
        self._rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.inv_freq = 1.0 / (
            c.rope_theta
            ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
        )
        # the index of each layer among those of its kind: its layer in that kind's pool
        seen = dict.fromkeys(LayerKind, 0)
        self.pool_layer = []
        for kind in c.layers:
            self.pool_layer.append(seen[kind])
            seen[kind] += 1

    def fingerprint(self) -> str:
        """16 hex digits naming these weights and the layer plan (a namespace revision)."""
        h = xxhash.xxh3_64()
        h.update(
            f"hybrid:{','.join(k.value for k in self.config.layers)}:window={self.config.window}".encode()
        )
        for t in [
            self.embed,
            self.norm,
            self.head,
            *(w for layer in self.layers for w in layer.values()),
        ]:
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()

    def needs(self, length: int) -> Needs:
        """What a run resuming after `length` cached tokens reads (the module's table)."""
        c = self.config
        return Needs(
            length,
            range(0, length) if c.count(LayerKind.FULL) else range(0),
            range(max(0, length - c.window), length)
            if c.count(LayerKind.SWA)
            else range(0),
            length if c.count(LayerKind.RECURRENT) else None,
        )

    def component_specs(
        self,
        tokens: int,
        states: int,
        page_size: int = 1,
        swa_tokens: int | None = None,
    ) -> dict[Component, ComponentSpec]:
        """The tiers' components this model needs (those it has layers of): full and SWA
        KV pools of `tokens` (`swa_tokens`) slots in pages of `page_size`, and `states`
        state slots; float32. Their namespaces name the window and the state's shape."""
        c = self.config

        def kv(kind: LayerKind, size: int) -> PoolConfig:
            return PoolConfig(
                size=size,
                num_layers=c.count(kind),
                page_size=page_size,
                num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                dtype="float32",
            )

        specs = {}
        if c.count(LayerKind.FULL):
            specs[Component.FULL] = ComponentSpec(
                Component.FULL, kv(LayerKind.FULL, tokens)
            )
        if c.count(LayerKind.SWA):
            size = tokens if swa_tokens is None else swa_tokens
            specs[Component.SWA] = ComponentSpec(
                Component.SWA, kv(LayerKind.SWA, size), window=c.window
            )
        if c.count(LayerKind.RECURRENT):
            state = StatePoolConfig(
                size=states,
                num_layers=c.count(LayerKind.RECURRENT),
                state_shape=c.state_shape,
            )
            specs[Component.MAMBA] = ComponentSpec(Component.MAMBA, state)
        return specs

    def layer_components(self) -> tuple[Component, ...]:
        """The component each layer's cached piece belongs to, bottom up (the cache's
        `layers`: a load lands layer i's piece before `wait_layer(i)` returns)."""
        return tuple(_COMPONENT_OF[kind] for kind in self.config.layers)

    def check_pools(self, pools: HybridPools) -> None:
        """Each pool must have this model's geometry (float32): a clear error otherwise."""
        c = self.config
        for name, pool, kind in (
            ("full", pools.full, LayerKind.FULL),
            ("swa", pools.swa, LayerKind.SWA),
        ):
            p = pool.config
            want = ("mha", c.count(kind), c.num_kv_heads, c.head_dim, "float32")
            got = (p.attention, p.num_layers, p.num_kv_heads, p.head_dim, p.dtype)
            if got != want or (p.v_head_dim or p.head_dim) != c.head_dim:
                raise ValueError(
                    f"{name} pool: (attention, layers, kv_heads, head_dim, dtype) = {got}; "
                    f"the hybrid model's {name} layers need {want}"
                )
        p = pools.state.config
        want = ("state", c.count(LayerKind.RECURRENT), c.state_shape, "float32")
        got = (p.attention, p.num_layers, getattr(p, "state_shape", None), p.dtype)
        if got != want:
            raise ValueError(
                f"state pool: (attention, layers, state_shape, dtype) = {got}; the hybrid "
                f"model's recurrent layers need {want}"
            )

    def check_pool(self, pool: DeviceKVPool) -> None:
        """The engine's one-pool check: a hybrid model needs three pools."""
        raise ValueError(
            "model 'hybrid' needs a cache that holds full-attention KV, sliding-window KV "
            f"and recurrent state slots; this cache has one {pool.config.attention} pool "
            "(use the default model, or a cache with those components)"
        )

    # -- pieces (one token at a time: see the module docstring) ---------------------------

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def _rotation(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of `position`'s angles, made once per position."""
        got = self._rotations.get(position)
        if got is None:
            angles = float(position) * self.inv_freq
            got = self._rotations[position] = (angles.cos(), angles.sin())
        return got

    def _qkv(self, layer: dict, h: torch.Tensor, position: int):
        """h: [1, hidden] (normed) -> q [H, D], k [KVH, D], v [KVH, D]: one matmul, and
        one rotation of q's and k's heads together."""
        c = self.config
        qkv = (h @ layer["wqkv"]).view(-1, c.head_dim)
        qk, v = qkv[: c.num_heads + c.num_kv_heads], qkv[c.num_heads + c.num_kv_heads :]
        cos, sin = self._rotation(position)
        x1, x2 = qk[:, 0::2], qk[:, 1::2]
        rotated = torch.empty_like(qk)
        rotated[:, 0::2] = x1 * cos - x2 * sin
        rotated[:, 1::2] = x1 * sin + x2 * cos
        return rotated[: c.num_heads], rotated[c.num_heads :], v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """One query q [H, D] over the keys it sees, k and v [m, KVH, D] -> [1, H*D].
        Elementwise products and reductions, no batched matmul (module docstring)."""
        c = self.config
        rep = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = (k * q[None]).sum(-1) / math.sqrt(c.head_dim)  # [m, H]
        probs = scores.softmax(0)
        return (probs[:, :, None] * v).sum(0).reshape(1, -1)

    def _recur(
        self, layer: dict, h: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A gated linear recurrence: s' = a * s + (1 - a) * u, y = (s' * silu(g)) wo.
        h: [1, hidden]; state: [hidden] -> (mixer output [1, hidden], new state)."""
        a, u, g = (h @ layer["waug"])[0].chunk(3)
        a = torch.sigmoid(a + layer["ba"])
        new = a * state + (1 - a) * u
        return (new * torch.nn.functional.silu(g))[None] @ layer["wo"], new

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        gate, up = (self._rms(x, layer["norm2"]) @ layer["w13"]).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ layer["w2"]

    def _token(self, x: torch.Tensor, p: int, states: list, kv, wait) -> torch.Tensor:
        """Token at position p, embedded x [1, hidden], through every layer; returns its
        logits [vocab]. `states[i]`: recurrent layer i's state, advanced in place;
        `kv(i, k, v, p)` keeps the token's K/V of attention layer i and returns the keys
        and values the query sees; `wait(i)` comes before layer i."""
        for i, layer in enumerate(self.layers):
            wait(i)
            h = self._rms(x, layer["norm1"])
            if self.config.layers[i] == LayerKind.RECURRENT:
                y, states[i] = self._recur(layer, h, states[i])
            else:
                q, k, v = self._qkv(layer, h, p)
                y = self._attend(q, *kv(i, k, v, p)) @ layer["wo"]
            x = x + y
            x = x + self._mlp(layer, x)
        return (self._rms(x, self.norm) @ self.head)[0]

    def _lo(self, kind: LayerKind, position: int) -> int:
        """The first position a query at `position` sees in a layer of `kind`."""
        return max(0, position - self.config.window) if kind == LayerKind.SWA else 0

    # -- forwards -------------------------------------------------------------------------

    def forward_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [len, vocab] for every position of one sequence, without any cache."""
        c, n = self.config, len(tokens)
        keys = [
            None
            if kind == LayerKind.RECURRENT
            else torch.zeros(n, c.num_kv_heads, c.head_dim)
            for kind in c.layers
        ]
        values = [None if k is None else torch.zeros_like(k) for k in keys]
        states = [
            torch.zeros(c.hidden) if kind == LayerKind.RECURRENT else None
            for kind in c.layers
        ]
        kv = functools.partial(self._dense_kv, keys, values)
        out = [
            self._token(self.embed[tokens[p : p + 1]], p, states, kv, _no_wait)
            for p in range(n)
        ]
        return torch.stack(out) if out else torch.zeros(0, c.vocab)

    def _dense_kv(self, keys: list, values: list, i: int, k, v, p: int):
        keys[i][p], values[i][p] = k, v
        seen = torch.arange(self._lo(self.config.layers[i], p), p + 1)
        return keys[i][seen], values[i][seen]

    def forward_cached(
        self, chunks: list[HybridChunk], pools: HybridPools, wait_layer=None
    ) -> list[torch.Tensor]:
        """Logits [len(chunk.tokens), vocab] per chunk. Writes the new tokens' K/V into the
        full and SWA pools, reads earlier tokens' K/V from them through the slot tables
        (only the window for SWA layers), and advances each chunk's state slot. Nothing of
        layer i (K/V, state) is read before `wait_layer(i)`, called once per forward with
        the model's layer index."""
        waited = set()

        def wait(i: int) -> None:
            if wait_layer is not None and i not in waited:
                wait_layer(i)
                waited.add(i)

        return [self._chunk(ch, pools, wait) for ch in chunks]

    def _chunk(self, ch: HybridChunk, pools: HybridPools, wait) -> torch.Tensor:
        c, n = self.config, len(ch.tokens)
        if ch.slots.numel() != n or ch.swa_slots.numel() != n:
            raise ValueError(
                f"chunk: {n} tokens but {ch.slots.numel()} full slots and "
                f"{ch.swa_slots.numel()} swa slots"
            )
        slot = int(ch.state_slot)
        states: list[torch.Tensor | None] = [None] * len(c.layers)

        def wait_then_read(i: int) -> None:
            """A layer's state is read once its load has landed (after `wait(i)`)."""
            wait(i)
            if states[i] is None and c.layers[i] == LayerKind.RECURRENT:
                buf = pools.state.state_buffer(self.pool_layer[i])
                states[i] = buf[slot].reshape(-1).clone()

        snapshots = dict(ch.snapshots)
        outside = [n_ for n_ in snapshots if not ch.start < n_ <= ch.start + n]
        if outside:
            raise ValueError(
                f"chunk: snapshot lengths {sorted(outside)} are outside "
                f"({ch.start}, {ch.start + n}]"
            )
        out = []
        for j in range(n):
            p = ch.start + j
            kv = functools.partial(self._pool_kv, ch, pools, j)
            out.append(
                self._token(
                    self.embed[ch.tokens[j : j + 1]], p, states, kv, wait_then_read
                )
            )
            if p + 1 in snapshots:
                self._put_states(pools.state, snapshots[p + 1], states)
        self._put_states(pools.state, slot, states)
        return torch.stack(out) if out else torch.zeros(0, c.vocab)

    def _pool_kv(
        self, ch: HybridChunk, pools: HybridPools, j: int, i: int, k, v, p: int
    ):
        """Write token j's K/V of layer i into its pool; the K/V its query sees, read back
        from the pool through the request's slot table."""
        kind, li = self.config.layers[i], self.pool_layer[i]
        pool, rows, new = (
            (pools.full, pools.full_rows, ch.slots)
            if kind == LayerKind.FULL
            else (pools.swa, pools.swa_rows, ch.swa_slots)
        )
        pool.set_kv(li, new[j : j + 1], k[None], v[None])
        seen = rows[ch.row, self._lo(kind, p) : p + 1].to(torch.int64)
        return pool.k_buffer(li)[seen], pool.v_buffer(li)[seen]

    def _put_states(self, pool: DeviceKVPool, slot: int, states: list) -> None:
        for i, s in enumerate(states):
            if s is not None:
                pool.state_buffer(self.pool_layer[i])[slot] = s.view(
                    self.config.state_shape
                )


def _no_wait(layer: int) -> None:
    pass
