"""The device KV pool: where a forward reads and writes KV, by slot index.

MHA: per layer K `[size+page_size, heads, head_dim]` and V `[size+page_size, heads, v_head_dim]`.
MLA: per layer one latent `[size+page_size, 1, kv_lora_rank+rope_dim]`.
Rows 0..page_size-1 are page 0: padding, never handed out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvtier.tiers.indices import check_indices, check_size

Attention = Literal["mha", "mla"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: allowed values are {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(slots=True, frozen=True)
class PoolConfig:
    size: int
    num_layers: int
    page_size: int = 1
    attention: Attention = "mha"
    num_kv_heads: int = 1
    head_dim: int = 64
    v_head_dim: int | None = None
    kv_lora_rank: int = 512
    rope_dim: int = 64
    dtype: str = "float16"
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("size", "num_layers", "page_size", "num_kv_heads", "head_dim", "kv_lora_rank", "rope_dim"):
            check_size(name, getattr(self, name))
        if self.v_head_dim is not None:
            check_size("v_head_dim", self.v_head_dim)
        if self.size % self.page_size:
            raise ValueError(f"size={self.size}: must be a multiple of page_size={self.page_size}")
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention={self.attention!r}: allowed values are mha, mla")
        parse_dtype(self.dtype)
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device={self.device!r}: allowed: cpu, cuda or cuda:N (a torch device)") from None

    @property
    def part_widths(self) -> tuple[int, ...]:
        """Elements per token per layer of each buffer a layer has (K, V) or (latent,)."""
        if self.attention == "mla":
            return (self.kv_lora_rank + self.rope_dim,)
        return (self.num_kv_heads * self.head_dim, self.num_kv_heads * (self.v_head_dim or self.head_dim))


class DeviceKVPool:
    """KV bytes on the device (CPU tensors when there is no GPU). Slot 0 is padding."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.dtype = parse_dtype(config.dtype)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"pool.device={config.device!r}: this torch sees no CUDA device "
                             f"(torch {torch.__version__}, CUDA {torch.version.cuda}); use pool.device: cpu")
        rows = config.size + config.page_size
        c = config
        if c.attention == "mla":
            shapes = [(rows, 1, c.kv_lora_rank + c.rope_dim)]
        else:
            shapes = [(rows, c.num_kv_heads, c.head_dim), (rows, c.num_kv_heads, c.v_head_dim or c.head_dim)]
        # One tensor per part for all layers, so a backup copies a slot run of every layer at
        # once; buffers[layer][part] are views of it.
        self.parts = [torch.zeros(c.num_layers, *s, dtype=self.dtype, device=self.device) for s in shapes]
        self.buffers = [[part[layer] for part in self.parts] for layer in range(c.num_layers)]
        self._rows = [[b.view(b.shape[0], -1) for b in bufs] for bufs in self.buffers]
        # counted per applied transfer on the scheduler thread: computed once
        self.bytes_per_token = sum(c.part_widths) * self.dtype.itemsize * c.num_layers

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.buffers[layer][0]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """V for MHA; for MLA the first kv_lora_rank channels of the latent (a view)."""
        if self.config.attention == "mla":
            return self.buffers[layer][0][..., : self.config.kv_lora_rank]
        return self.buffers[layer][1]

    def rows(self, layer: int) -> list[torch.Tensor]:
        """2-D `[slots, width]` views of each buffer of `layer`: what transfers copy. Made
        once: a load's copy may run on the scheduler thread, and `view` gives up the GIL."""
        return list(self._rows[layer])

    def all_layer_rows(self) -> list[torch.Tensor]:
        """3-D `[layers, slots, width]` views, one per part: what all-layer backups copy."""
        return [p.view(p.shape[0], p.shape[1], -1) for p in self.parts]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Write K and V (MHA) or the latent `k` (MLA, `v` must be None) at slots `loc`."""
        check_indices("loc", loc)
        if (v is None) != (self.config.attention == "mla"):
            raise ValueError(f"set_kv: v is {'required' if v is None else 'not allowed'} for {self.config.attention}")
        for buf, value in zip(self.buffers[layer], (k,) if v is None else (k, v)):
            if value.shape[0] != loc.numel():
                raise ValueError(f"set_kv: {loc.numel()} slots but {value.shape[0]} rows of KV")
            buf[loc] = value.to(self.dtype).view(-1, *buf.shape[1:])
