"""A tiny deterministic decoder-only transformer whose attention reads K/V from the pool.

Weights come from a seed; fp32 on CPU. Two forwards share every weight:
- `forward_cached`: new tokens of several requests; K/V of earlier tokens come from the
  pool through each request's ReqToTokenPool row (what a serving engine does);
- `forward_dense`: the whole sequence at once, no pool (the oracle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import xxhash

from kvtier.tiers.pool import DeviceKVPool


@dataclass(slots=True, frozen=True)
class ModelConfig:
    vocab: int = 512
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 512
    rope_theta: float = 10000.0
    seed: int = 0

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(slots=True)
class Chunk:
    """One request's share of a forward: tokens [start, start+len(tokens)) at `slots`."""

    row: int  # ReqToTokenPool row holding slots of tokens [0, start+len)
    start: int
    tokens: torch.Tensor  # int64
    slots: torch.Tensor  # int64, where the new tokens' K/V go


class TinyTransformer:
    kind = "tiny"

    def __init__(self, config: ModelConfig = ModelConfig()) -> None:
        self.config = c = config
        g = torch.Generator().manual_seed(c.seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        kv = c.num_kv_heads * c.head_dim
        self.embed = torch.randn(c.vocab, c.hidden, generator=g)
        self.layers = [
            {
                "norm1": torch.ones(c.hidden),
                "wq": w(c.hidden, c.hidden),
                "wk": w(c.hidden, kv),
                "wv": w(c.hidden, kv),
                "wo": w(c.hidden, c.hidden),
                "norm2": torch.ones(c.hidden),
                "w1": w(c.hidden, c.ffn),
                "w3": w(c.hidden, c.ffn),
                "w2": w(c.ffn, c.hidden),
            }
            for _ in range(c.num_layers)
        ]
        self.norm = torch.ones(c.hidden)
        self.head = w(c.hidden, c.vocab)
        self.inv_freq = 1.0 / (
            c.rope_theta
            ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
        )

    def fingerprint(self) -> str:
        """16 hex digits naming these weights: a cache namespace revision, so KV computed by
        another seed's weights is never served to this model."""
        h = xxhash.xxh3_64()
        for t in [
            self.embed,
            self.norm,
            self.head,
            *(w for layer in self.layers for w in layer.values()),
        ]:
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()

    def check_pool(self, pool: DeviceKVPool) -> None:
        p, c = pool.config, self.config
        if (
            p.attention,
            p.num_layers,
            p.num_kv_heads,
            p.head_dim,
            p.v_head_dim or p.head_dim,
            p.dtype,
        ) != ("mha", c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, "float32"):
            raise ValueError(
                f"pool geometry {p.attention} layers={p.num_layers} kv_heads={p.num_kv_heads} head_dim={p.head_dim} "
                f"dtype={p.dtype} does not fit the reference model (mha, {c.num_layers} layers, "
                f"{c.num_kv_heads} kv heads, head_dim {c.head_dim}, float32)"
            )

    # -- pieces ---------------------------------------------------------------------------------

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [n, heads, head_dim]; rotate pairs (even, odd) by position * inv_freq."""
        angles = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    def _qkv(self, layer: dict, x: torch.Tensor, positions: torch.Tensor):
        c = self.config
        h = self._rms(x, layer["norm1"])
        q = (h @ layer["wq"]).view(-1, c.num_heads, c.head_dim)
        k = (h @ layer["wk"]).view(-1, c.num_kv_heads, c.head_dim)
        v = (h @ layer["wv"]).view(-1, c.num_kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int
    ) -> torch.Tensor:
        """q: [n, H, D] at positions q_start.. ; k, v: [m, KVH, D] at positions 0..m-1; causal."""
        c = self.config
        rep = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(c.head_dim)
        qpos = torch.arange(q_start, q_start + q.shape[0])[:, None]
        mask = torch.arange(k.shape[0])[None, :] > qpos
        scores = scores.masked_fill(mask[None], float("-inf"))
        return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v).reshape(
            q.shape[0], -1
        )

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        h = self._rms(x, layer["norm2"])
        return (torch.nn.functional.silu(h @ layer["w1"]) * (h @ layer["w3"])) @ layer[
            "w2"
        ]

    # -- forwards -------------------------------------------------------------------------------

    def forward_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [len, vocab] for every position of one sequence, without any cache."""
        x = self.embed[tokens]
        positions = torch.arange(len(tokens))
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, positions)
            x = x + self._attend(q, k, v, 0) @ layer["wo"]
            x = x + self._mlp(layer, x)
        return self._rms(x, self.norm) @ self.head

    def forward_cached(
        self,
        chunks: list[Chunk],
        pool: DeviceKVPool,
        req_to_token: torch.Tensor,
        wait_layer=None,
    ) -> list[torch.Tensor]:
        """Logits [len(chunk.tokens), vocab] per chunk. Writes the new K/V into the pool and
        reads every earlier token's K/V from it (layer i after `wait_layer(i)`)."""
        xs = [self.embed[ch.tokens] for ch in chunks]
        for i, layer in enumerate(self.layers):
            if wait_layer is not None:
                wait_layer(i)
            for j, ch in enumerate(chunks):
                positions = torch.arange(ch.start, ch.start + len(ch.tokens))
                q, k, v = self._qkv(layer, xs[j], positions)
                pool.set_kv(i, ch.slots, k, v)
                end = ch.start + len(ch.tokens)
                slots = req_to_token[ch.row, :end].to(torch.int64)
                attn = self._attend(
                    q, pool.k_buffer(i)[slots], pool.v_buffer(i)[slots], ch.start
                )
                xs[j] = xs[j] + attn @ layer["wo"]
                xs[j] = xs[j] + self._mlp(layer, xs[j])
        return [self._rms(x, self.norm) @ self.head for x in xs]


MODELS = ("tiny", "hybrid")


def build_model(kind: str, seed: int = 0, window: int = 16):
    """The reference model of `kind` (`model.kind` in the config, `--model`): `tiny`, this
    module's full-attention transformer, or `hybrid` (kvtier/engine/hybrid.py) with
    sliding-window layers of `window`."""
    if kind == "tiny":
        return TinyTransformer(ModelConfig(seed=seed))
    if kind == "hybrid":
        from kvtier.engine.hybrid import HybridConfig, HybridModel

        return HybridModel(HybridConfig(seed=seed, window=window))
    raise ValueError(f"model={kind!r}: allowed values are {', '.join(MODELS)}")
