"""The one join type: a 1-D int64 tensor of slot indices (docs/design.md §2)."""

from __future__ import annotations

import functools
import operator

import numpy as np
import torch

from kvtier.numpy_gil import GIL_CHUNK


def check_indices(
    name: str, indices: object, length: int | None = None
) -> torch.Tensor:
    """Return `indices` if it is a 1-D int64 tensor (of `length`, when given); else ValueError."""
    if not isinstance(indices, torch.Tensor):
        raise ValueError(
            f"{name}: expected a 1-D torch.int64 tensor, got {type(indices).__name__}"
        )
    if indices.dtype != torch.int64 or indices.dim() != 1:
        raise ValueError(
            f"{name}: expected a 1-D torch.int64 tensor, got dtype={indices.dtype} shape={tuple(indices.shape)}"
        )
    if length is not None and indices.numel() != length:
        raise ValueError(f"{name}: expected {length} indices, got {indices.numel()}")
    return indices


def check_size(name: str, value: object, minimum: int = 1) -> int:
    """`value` as an int if it is an integer >= minimum (a numpy integer too: sizes an
    engine computes from arrays are; bools refused); else ValueError naming it."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            number = operator.index(value)
        except TypeError:
            number = None
        if number is not None and number >= minimum:
            return number
    raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")


def as_numpy(indices: torch.Tensor) -> np.ndarray:
    """The tensor's memory as numpy (a device tensor is copied to the host first). Not
    `.cpu()` on a CPU tensor: even that is a torch call, and on the scheduler thread every
    torch call gives up the GIL (docs/design.md §2)."""
    return (indices if indices.is_cpu else indices.cpu()).numpy()


def page_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """Every slot of `pages` (page p holds slots [p*page_size, (p+1)*page_size)), in order:
    each page repeated (`np.repeat` keeps the GIL), then times the page size plus the
    offsets within a page, in flat pieces of at most GIL_CHUNK slots, so the GIL is kept."""
    if page_size == 1:
        return concat([pages])
    out = np.repeat(
        pages if pages.dtype == np.int64 else pages.astype(np.int64), page_size
    )
    offsets = _offsets(page_size)
    step, n = offsets.shape[0], out.shape[0]
    for i in range(
        0, n, step
    ):  # a piece starts at a page's first slot: `step` is whole pages
        j = min(n, i + step)
        np.multiply(out[i:j], page_size, out=out[i:j])
        np.add(out[i:j], offsets[: j - i], out=out[i:j])
    return out


@functools.lru_cache(maxsize=8)
def _offsets(page_size: int) -> np.ndarray:
    """0..page_size-1 repeated over as many whole pages as fit in GIL_CHUNK (at least one)."""
    return np.tile(np.arange(page_size, dtype=np.int64), max(1, GIL_CHUNK // page_size))


def pages_of(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The page of every slot (`slots // page_size`), keeping the GIL."""
    if page_size == 1:
        return slots
    out = np.empty_like(slots)
    for i in range(0, slots.shape[0], GIL_CHUNK):
        np.floor_divide(slots[i : i + GIL_CHUNK], page_size, out=out[i : i + GIL_CHUNK])
    return out


def concat(parts: list[np.ndarray]) -> np.ndarray:
    """The int64 arrays `parts` joined into a fresh writable array. The bytes are joined by
    CPython (a memcpy that keeps the GIL), not by `np.concatenate`, which gives it up past
    500 elements. A part that is not C-contiguous is refused by the buffer protocol
    (TypeError) and copied first; asking every part for its flags cost more than the join."""
    try:
        joined = bytearray().join(parts)
    except TypeError:
        joined = bytearray().join([np.ascontiguousarray(p) for p in parts])
    return np.frombuffer(joined, dtype=np.int64)


class Repeats:
    """Finds units listed twice among units in [0, n), without a sort (a numpy sort always
    gives the GIL up): each unit's position is scattered into a scratch row and read back,
    and a repeated unit reads its last position at its first. In pieces of GIL_CHUNK
    (docs/design.md §2): a few microseconds for a request's slots. Positions are int32 (4
    bytes of scratch a unit), so a call takes fewer than 2**31 units."""

    def __init__(self, n: int) -> None:
        self._seen = np.zeros(n, dtype=np.int32)
        self._order = np.arange(0, dtype=np.int32)

    def any(self, units: np.ndarray) -> bool:
        """Is a unit of `units` (each in [0, n)) listed twice?"""
        k, seen = units.shape[0], self._seen
        if k > self._order.shape[0]:
            self._order = np.arange(k, dtype=np.int32)
        order = self._order
        for i in range(0, k, GIL_CHUNK):
            seen[units[i : i + GIL_CHUNK]] = order[i : min(k, i + GIL_CHUNK)]
        for i in range(0, k, GIL_CHUNK):
            if (
                seen[units[i : i + GIL_CHUNK]].tobytes()
                != order[i : min(k, i + GIL_CHUNK)].tobytes()
            ):
                return True
        return False

    @staticmethod
    def which(units: np.ndarray) -> np.ndarray:
        """The units listed twice or more, each once, in ascending order (an error's message:
        this one sorts)."""
        values, counts = np.unique(units, return_counts=True)
        return values[counts > 1]


def tensor(slots: np.ndarray) -> torch.Tensor:
    """A tensor over `slots` (no copy), for a caller outside kvtier: the one torch call an
    API that hands slots back makes (every torch call gives up the GIL)."""
    return torch.from_numpy(slots)


def slots_of(indices: torch.Tensor | np.ndarray) -> np.ndarray:
    """numpy slots of what a caller handed in: a tensor is viewed once (`as_numpy`)."""
    return indices if isinstance(indices, np.ndarray) else as_numpy(indices)


def check_slots(name: str, indices: object, length: int | None = None) -> np.ndarray:
    """numpy slots of `indices`: a 1-D int64 tensor, or numpy array (kvtier's own callers),
    of `length` slots when given; else ValueError naming it."""
    if isinstance(indices, np.ndarray):
        if indices.dtype != np.int64 or indices.ndim != 1:
            raise ValueError(
                f"{name}: expected 1-D int64 slots, got numpy dtype={indices.dtype} shape={indices.shape}"
            )
        slots = indices
    else:
        slots = as_numpy(check_indices(name, indices))
    if length is not None and slots.shape[0] != length:
        raise ValueError(f"{name}: expected {length} indices, got {slots.shape[0]}")
    return slots


def runs(
    src: torch.Tensor | np.ndarray, dst: torch.Tensor | np.ndarray, split_every: int = 0
) -> list[tuple[int, int, int]]:
    """Merge index pairs into runs `(src_start, dst_start, length)` where both advance by 1.

    With `split_every` > 0, a run never crosses a multiple of it in `dst` (page boundaries
    of a page-first mirror, where consecutive slots of two pages are not adjacent in memory).
    Computed in numpy over the tensors' memory (a few microseconds, not a torch op each), in
    pieces of GIL_CHUNK pairs: one pass over a long load's slots gave the GIL up on the copy
    thread, which then waited behind other threads' Python to win it back (docs/design.md §2).
    """
    s, d = slots_of(src), slots_of(dst)
    n = s.shape[0]
    if d.shape[0] != n:
        raise ValueError(f"runs: {n} source slots but {d.shape[0]} destination slots")
    if n == 0:
        return []
    starts = [0]
    for i in range(1, n, GIL_CHUNK):  # a break before pair k: k starts a run
        j = min(n, i + GIL_CHUNK)
        breaks = (s[i:j] - s[i - 1 : j - 1] != 1) | (d[i:j] - d[i - 1 : j - 1] != 1)
        if split_every > 0:
            breaks |= d[i:j] % split_every == 0
        starts += (np.flatnonzero(breaks) + i).tolist()
    firsts_s, firsts_d = [], []
    for k in range(0, len(starts), GIL_CHUNK):
        at = starts[k : k + GIL_CHUNK]
        firsts_s += s[at].tolist()
        firsts_d += d[at].tolist()
    ends = starts[1:] + [n]
    return [
        (a, b, end - start)
        for a, b, start, end in zip(firsts_s, firsts_d, starts, ends)
    ]
