"""The device KV pool: where a forward reads and writes KV, by slot index.

MHA: per layer K `[size+page_size, heads, head_dim]` and V `[size+page_size, heads, v_head_dim]`.
MLA: per layer one latent `[size+page_size, 1, kv_lora_rank+rope_dim]`.
State (`StatePoolConfig`: a recurrent layer's fixed-size state per sequence, e.g. Mamba's):
per layer one `[size+1, *state_shape]`; page_size is 1, so a slot is a page and a
sequence's state is one slot, copied, mirrored and stored as a page like token KV.
Rows 0..page_size-1 are page 0: padding, never handed out.

A pool either allocates its tensors (`DeviceKVPool(config)`: one tensor per part for all
layers) or wraps an engine's own per-layer tensors (`DeviceKVPool.from_tensors`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvtier.tiers.indices import check_indices, check_size

Attention = Literal["mha", "mla"]
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


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
    rope_dim: int = (
        64  # 0 where the split of an engine's latent is not known (from_tensors)
    )
    dtype: str = "float16"
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in (
            "size",
            "num_layers",
            "page_size",
            "num_kv_heads",
            "head_dim",
            "kv_lora_rank",
        ):
            check_size(name, getattr(self, name))
        check_size("rope_dim", self.rope_dim, minimum=0)
        if self.v_head_dim is not None:
            check_size("v_head_dim", self.v_head_dim)
        if self.size % self.page_size:
            raise ValueError(
                f"size={self.size}: must be a multiple of page_size={self.page_size}"
            )
        if self.attention not in ("mha", "mla"):
            raise ValueError(
                f"attention={self.attention!r}: allowed values are mha, mla"
            )
        parse_dtype(self.dtype)
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"device={self.device!r}: allowed: cpu, cuda or cuda:N (a torch device)"
            ) from None

    @property
    def page_layout(self) -> str:
        """What fixes the bytes of a page: attention kind and geometry, in the frame order."""
        if self.attention == "mla":
            return f"mla:layers={self.num_layers}:lora={self.kv_lora_rank}:rope={self.rope_dim}"
        return (
            f"mha:layers={self.num_layers}:heads={self.num_kv_heads}:head_dim={self.head_dim}"
            f":v={self.v_head_dim or self.head_dim}"
        )

    @property
    def part_widths(self) -> tuple[int, ...]:
        """Elements per token per layer of each buffer a layer has (K, V) or (latent,)."""
        if self.attention == "mla":
            return (self.kv_lora_rank + self.rope_dim,)
        return (
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * (self.v_head_dim or self.head_dim),
        )


@dataclass(slots=True, frozen=True)
class StatePoolConfig:
    """A pool of recurrent states (a Mamba-like layer's): per layer one fixed-size state
    of `state_shape` per slot, a sequence's state in one slot. A slot is a page (page_size
    1), so the mirror, the controller and the store move states as they move token pages."""

    size: int
    num_layers: int
    state_shape: tuple[int, ...]
    dtype: str = "float32"
    device: str = "cpu"
    page_size: ClassVar[int] = 1
    attention: ClassVar[str] = "state"

    def __post_init__(self) -> None:
        check_size("size", self.size)
        check_size("num_layers", self.num_layers)
        shape = self.state_shape
        if isinstance(shape, list):  # from YAML
            shape = tuple(shape)
            object.__setattr__(self, "state_shape", shape)
        if (
            not isinstance(shape, tuple)
            or not shape
            or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape
            )
        ):
            raise ValueError(
                f"state_shape={shape!r}: a tuple of integers >= 1 (one slot's shape)"
            )
        parse_dtype(self.dtype)
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"device={self.device!r}: allowed: cpu, cuda or cuda:N (a torch device)"
            ) from None

    @property
    def page_layout(self) -> str:
        """What fixes the bytes of a slot: layers and the state's shape."""
        return f"state:layers={self.num_layers}:shape={'x'.join(map(str, self.state_shape))}"

    @property
    def part_widths(self) -> tuple[int, ...]:
        """Elements per slot per layer (one buffer a layer)."""
        return (math.prod(self.state_shape),)


def usable_device(device: str) -> torch.device:
    """`device` as a torch device this torch can allocate on (a one-line error if not)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"pool.device={device!r}: this torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}); use pool.device: cpu"
        )
    return dev


class DeviceKVPool:
    """KV bytes on the device (CPU tensors when there is no GPU). Slot 0 is padding."""

    def __init__(self, config: PoolConfig | StatePoolConfig) -> None:
        c = config
        dtype, device = parse_dtype(c.dtype), usable_device(c.device)
        rows = c.size + c.page_size
        if c.attention == "state":
            shapes = [(rows, *c.state_shape)]
        elif c.attention == "mla":
            shapes = [(rows, 1, c.kv_lora_rank + c.rope_dim)]
        else:
            shapes = [
                (rows, c.num_kv_heads, c.head_dim),
                (rows, c.num_kv_heads, c.v_head_dim or c.head_dim),
            ]
        # One tensor per part for all layers, so a backup copies a slot run of every layer at
        # once; buffers[layer][part] are views of it.
        parts = [
            torch.zeros(c.num_layers, *s, dtype=dtype, device=device) for s in shapes
        ]
        self._setup(
            c, [[part[layer] for part in parts] for layer in range(c.num_layers)], parts
        )

    def _setup(
        self,
        config: PoolConfig,
        buffers: list[list[torch.Tensor]],
        parts: list[torch.Tensor] | None,
        latent_split: bool = True,
    ) -> None:
        self.config = c = config
        self.dtype = parse_dtype(c.dtype)
        self.device = usable_device(c.device)
        self.parts = (
            parts  # the all-layer tensors, or None where each layer is its own tensor
        )
        self.buffers = buffers
        self._latent_split = latent_split
        self._rows = [[b.view(b.shape[0], -1) for b in bufs] for bufs in buffers]
        # counted per applied transfer on the scheduler thread: computed once
        self.bytes_per_token = sum(c.part_widths) * self.dtype.itemsize * c.num_layers

    @classmethod
    def from_tensors(
        cls,
        k_buffers: list[torch.Tensor],
        v_buffers: list[torch.Tensor] | None = None,
        *,
        page_size: int,
        kv_lora_rank: int | None = None,
    ) -> DeviceKVPool:
        """A pool over an engine's own per-layer tensors (no copy; the engine keeps writing them).

        MHA: `k_buffers[layer]` and `v_buffers[layer]` each `[rows, heads, head_dim]`
        (SGLang's MHATokenToKVPool). MLA: `v_buffers=None` and `k_buffers[layer]` the latent
        `[rows, 1, kv_lora_rank + rope_dim]` (MLATokenToKVPool); pass `kv_lora_rank` for
        `v_buffer` views. rows = size + page_size: rows 0..page_size-1 are padding."""
        check_size("page_size", page_size)
        k_buffers = list(k_buffers)
        if not k_buffers:
            raise ValueError(
                "from_tensors: k_buffers is empty; one tensor per layer is needed"
            )
        parts_of = [[k] for k in k_buffers]
        if v_buffers is not None:
            v_buffers = list(v_buffers)
            if len(v_buffers) != len(k_buffers):
                raise ValueError(
                    f"from_tensors: {len(k_buffers)} k_buffers but {len(v_buffers)} v_buffers"
                )
            parts_of = [[k, v] for k, v in zip(k_buffers, v_buffers)]
        first = parts_of[0]
        for layer, bufs in enumerate(parts_of):
            for name, buf, ref in zip(("k_buffers", "v_buffers"), bufs, first):
                _check_buffer(f"{name}[{layer}]", buf, ref)
        k0 = first[0]
        rows, heads = k0.shape[0], k0.shape[1]
        if rows <= page_size or (rows - page_size) % page_size:
            raise ValueError(
                f"from_tensors: {rows} rows; must be size + page_size with size a positive "
                f"multiple of page_size={page_size}"
            )
        if k0.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"from_tensors: dtype {k0.dtype}: allowed dtypes are {', '.join(DTYPES)}"
            )
        common = dict(
            size=rows - page_size,
            num_layers=len(k_buffers),
            page_size=page_size,
            dtype=DTYPE_NAMES[k0.dtype],
            device=str(k0.device),
        )
        if v_buffers is None:
            if heads != 1:
                raise ValueError(
                    f"from_tensors: k_buffers[0] has shape {tuple(k0.shape)}; an MLA latent is "
                    "[rows, 1, kv_lora_rank + rope_dim] (for MHA pass v_buffers)"
                )
            width = k0.shape[2]
            if (
                kv_lora_rank is not None
                and not 0 < check_size("kv_lora_rank", kv_lora_rank) <= width
            ):
                raise ValueError(
                    f"kv_lora_rank={kv_lora_rank}: must be in [1, {width}] (the latent's width)"
                )
            rank = width if kv_lora_rank is None else kv_lora_rank
            config = PoolConfig(
                attention="mla", kv_lora_rank=rank, rope_dim=width - rank, **common
            )
        else:
            if kv_lora_rank is not None:
                raise ValueError(
                    "from_tensors: kv_lora_rank is for MLA (v_buffers=None) only"
                )
            v0 = first[1]
            if v0.shape[:2] != k0.shape[:2]:
                raise ValueError(
                    f"from_tensors: v_buffers[0] has shape {tuple(v0.shape)}, k_buffers[0] "
                    f"{tuple(k0.shape)}: rows and heads must match"
                )
            config = PoolConfig(
                attention="mha",
                num_kv_heads=heads,
                head_dim=k0.shape[2],
                v_head_dim=None if v0.shape[2] == k0.shape[2] else v0.shape[2],
                **common,
            )
        pool = cls.__new__(cls)
        pool._setup(
            config,
            parts_of,
            None,
            latent_split=v_buffers is not None or kv_lora_rank is not None,
        )
        return pool

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.buffers[layer][0]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """V for MHA; for MLA the first kv_lora_rank channels of the latent (a view)."""
        if self.config.attention == "state":
            raise ValueError("v_buffer: a state pool has no V (state_buffer)")
        if self.config.attention == "mla":
            if not self._latent_split:
                raise ValueError(
                    "v_buffer: this MLA pool was made without kv_lora_rank (from_tensors)"
                )
            return self.buffers[layer][0][..., : self.config.kv_lora_rank]
        return self.buffers[layer][1]

    def rows(self, layer: int) -> list[torch.Tensor]:
        """2-D `[slots, width]` views of each buffer of `layer`: what transfers copy. Made
        once: a load's copy may run on the scheduler thread, and `view` gives up the GIL."""
        return list(self._rows[layer])

    @property
    def stacked(self) -> bool:
        """Do all layers of a part share one tensor (so one copy covers every layer)?"""
        return self.parts is not None

    def all_layer_rows(self) -> list[torch.Tensor]:
        """3-D `[layers, slots, width]` views, one per part: what all-layer backups copy
        (stacked pools only; a pool over per-layer tensors is copied layer by layer)."""
        if self.parts is None:
            raise ValueError(
                "all_layer_rows: the layers of this pool are separate tensors (from_tensors)"
            )
        return [p.view(p.shape[0], p.shape[1], -1) for p in self.parts]

    def set_kv(
        self,
        layer: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None = None,
    ) -> None:
        """Write K and V (MHA) or the latent `k` (MLA, `v` must be None) at slots `loc`."""
        check_indices("loc", loc)
        if self.config.attention == "state":
            raise ValueError("set_kv: a state pool holds states (set_states)")
        if (v is None) != (self.config.attention == "mla"):
            raise ValueError(
                f"set_kv: v is {'required' if v is None else 'not allowed'} for {self.config.attention}"
            )
        for buf, value in zip(self.buffers[layer], (k,) if v is None else (k, v)):
            if value.shape[0] != loc.numel():
                raise ValueError(
                    f"set_kv: {loc.numel()} slots but {value.shape[0]} rows of KV"
                )
            buf[loc] = value.to(self.dtype).view(-1, *buf.shape[1:])

    # -- state slots (StatePoolConfig) ------------------------------------------------------

    def _state_only(self, what: str) -> None:
        if self.config.attention != "state":
            raise ValueError(
                f"{what}: for a state pool (StatePoolConfig), this one is "
                f"{self.config.attention!r}"
            )

    def state_buffer(self, layer: int) -> torch.Tensor:
        """`[size+1, *state_shape]`: layer `layer`'s state of every slot (slot 0 padding)."""
        self._state_only("state_buffer")
        return self.buffers[layer][0]

    def set_states(self, layer: int, slots: torch.Tensor, states: torch.Tensor) -> None:
        """Write `states` `[len(slots), *state_shape]` into layer `layer`'s `slots`."""
        self._state_only("set_states")
        check_indices("slots", slots)
        buf = self.buffers[layer][0]
        if tuple(states.shape) != (slots.numel(), *buf.shape[1:]):
            raise ValueError(
                f"set_states: {tuple(states.shape)} for {slots.numel()} slots of shape "
                f"{tuple(buf.shape[1:])}"
            )
        buf[slots] = states.to(self.dtype)

    def copy_states(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's state of slots `src` into slots `dst` (on the device): a cached
        state is copied into a request's own slot, which its forward then advances, and
        a request's state is copied out at a node boundary."""
        self._state_only("copy_states")
        check_indices("src", src)
        check_indices("dst", dst)
        if src.numel() != dst.numel():
            raise ValueError(
                f"copy_states: {src.numel()} sources, {dst.numel()} targets"
            )
        for (buf,) in self.buffers:
            buf[dst] = buf[src]


def _check_buffer(name: str, buf: object, ref: torch.Tensor) -> None:
    """`buf` must be a contiguous 3-D tensor like `ref` (same shape, dtype, device)."""
    if not isinstance(buf, torch.Tensor):
        raise ValueError(
            f"from_tensors: {name} is a {type(buf).__name__}, not a torch.Tensor"
        )
    if buf.dim() != 3:
        raise ValueError(
            f"from_tensors: {name} has shape {tuple(buf.shape)}; [rows, heads, dim] is needed"
        )
    if buf is not ref and (
        buf.shape != ref.shape or buf.dtype != ref.dtype or buf.device != ref.device
    ):
        raise ValueError(
            f"from_tensors: {name} is {tuple(buf.shape)} {buf.dtype} on {buf.device}; layer 0 is "
            f"{tuple(ref.shape)} {ref.dtype} on {ref.device}: every layer must match"
        )
    if not buf.is_contiguous():
        raise ValueError(
            f"from_tensors: {name} is not contiguous; transfers copy rows of contiguous memory"
        )
