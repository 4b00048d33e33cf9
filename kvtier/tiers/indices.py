"""The one join type: a 1-D int64 tensor of slot indices (docs/design.md §2)."""

from __future__ import annotations

import os

import numpy as np
import torch


def check_indices(name: str, indices: object, length: int | None = None) -> torch.Tensor:
    """Return `indices` if it is a 1-D int64 tensor (of `length`, when given); else ValueError."""
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"{name}: expected a 1-D torch.int64 tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int64 or indices.dim() != 1:
        raise ValueError(
            f"{name}: expected a 1-D torch.int64 tensor, got dtype={indices.dtype} shape={tuple(indices.shape)}"
        )
    if length is not None and indices.numel() != length:
        raise ValueError(f"{name}: expected {length} indices, got {indices.numel()}")
    return indices


def check_size(name: str, value: object, minimum: int = 1) -> int:
    """Return `value` if it is an int >= minimum (bools refused); else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")
    return value


def as_numpy(indices: torch.Tensor) -> np.ndarray:
    """The tensor's memory as numpy (a device tensor is copied to the host first). Not
    `.cpu()` on a CPU tensor: even that is a torch call, and on the scheduler thread every
    torch call gives up the GIL (docs/design.md §2)."""
    return (indices if indices.device.type == "cpu" else indices.cpu()).numpy()


def page_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """Every slot of `pages` (page p holds slots [p*page_size, (p+1)*page_size)), in order."""
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).ravel()


def runs(src: torch.Tensor, dst: torch.Tensor, split_every: int = 0) -> list[tuple[int, int, int]]:
    """Merge index pairs into runs `(src_start, dst_start, length)` where both advance by 1.

    With `split_every` > 0, a run never crosses a multiple of it in `dst` (page boundaries
    of a page-first mirror, where consecutive slots of two pages are not adjacent in memory).
    Computed in numpy over the tensors' memory (a few microseconds, not a torch op each).
    """
    s, d = as_numpy(src), as_numpy(dst)
    n = s.shape[0]
    if n == 0:
        return []
    breaks = (np.diff(s) != 1) | (np.diff(d) != 1)
    if split_every > 0:
        breaks |= d[1:] % split_every == 0
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    lengths = np.diff(starts, append=n)
    return list(zip(s[starts].tolist(), d[starts].tolist(), lengths.tolist()))


def check_positive(obj: object, *names: str, integer: bool = False) -> None:
    """Each named field of a config dataclass is a number > 0 (an int when `integer`)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or not value > 0:
            kind = "an integer" if integer else "a number"
            raise ValueError(f"{name}={value!r}: must be {kind} > 0")


def io_threads(most: int = 4) -> int:
    """Default thread count for a store's I/O: up to `most`, but at most half the cores, so
    that on a small machine the scheduler thread keeps a core to itself."""
    return max(1, min(most, (os.cpu_count() or 2) // 2))
