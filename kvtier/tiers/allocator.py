"""Slot allocators. Slot 0 is padding and never handed out.

Contracts shared by both allocators:
- `alloc` returns a 1-D int64 tensor, or None on shortage with no side effect.
- `free` takes back what `alloc` gave, as one list append: allocations take the free
  array's lowest units, then released ones in the order they were freed (a few hundred
  in all are sorted back in first, by Python). No numpy sort on the hot path: it would
  give the GIL up, and sort a pool's worth of units a request.
- `available_size()` is exact at every moment.
- A free of a unit not allocated (a double free), of padding or of one out of range
  raises, before anything changes: a page freed twice would be handed to two owners,
  each writing KV the other reads. Debug mode (constructor flag or env
  KVTIER_DEBUG_POOL=1) also refuses a unit listed twice in one call (a numpy sort).

The bookkeeping is numpy; tensors exist only at the boundary (`torch.from_numpy`, no
copy), and kvtier's own code uses the numpy forms (`alloc_slots`, `free_slots`). These run
on the scheduler thread several times a request: a torch call, a numpy sort or a numpy op
over 500 elements releases the GIL, and on a busy machine getting it back cost ~100 us a
call (measured in `benchmarks/cache.py`); the helpers of `indices.py` keep it.
"""

from __future__ import annotations

import os
from array import array
from collections import deque
from contextlib import contextmanager
from collections.abc import Iterator

import numpy as np
import torch

from kvtier.numpy_gil import GIL_CHUNK, HIGH
from kvtier.tiers.indices import (
    Repeats,
    as_numpy,
    check_indices,
    check_size,
    concat,
    page_slots,
    pages_of,
    tensor,
)


def _debug_default() -> bool:
    return os.environ.get("KVTIER_DEBUG_POOL", "") not in ("", "0")


def _distinct(units: np.ndarray) -> np.ndarray:
    """The distinct values of `units` (a fresh array, any order). Runs of equal values (a
    page's slots side by side, the usual case) collapse in one pass; duplicates left after
    that go through a Python set, not `np.unique` (a numpy sort always gives up the GIL)."""
    out = _collapse_runs(units)
    values = out.tolist()
    distinct = set(values)
    if len(distinct) != len(values):
        out = np.array(sorted(distinct), dtype=np.int64)
    return out


def _pages_touched(pages: np.ndarray, page_size: int) -> np.ndarray:
    """The distinct values of `pages` (the page of each slot freed). Whole pages in slot
    order, each once, are what kvtier frees almost always (tree values, allocations): then
    every run of `page_size` equal values is one page, checked exactly against its first
    value repeated (compared as bytes, keeping the GIL) and taken from there, at about
    two thirds of `_distinct`'s cost. Fewer slots than a page, all of one page (a finished
    request's tail), are that page, found in Python (two numpy calls fewer than
    `_distinct`'s). Anything else goes through `_distinct`."""
    n = pages.shape[0]
    if (
        0 < n < page_size
    ):  # a request's tail, freed at its finish: a few slots of one page
        listed = pages.tolist()
        if listed.count(listed[0]) == n:
            return pages[:1].copy()
    if page_size > 1 and n and n % page_size == 0:
        firsts = pages[::page_size]
        if np.repeat(firsts, page_size).tobytes() == pages.tobytes():
            listed = firsts.tolist()
            if len(set(listed)) == len(listed):
                return firsts.copy()
    return _distinct(pages)


def _collapse_runs(units: np.ndarray) -> np.ndarray:
    """`units` without the repeats inside runs of equal values, in pieces of at most
    GIL_CHUNK (docs/design.md §2)."""
    n = units.size
    if n <= 1:
        return units.copy()
    keep = np.empty(n, dtype=bool)
    keep[0] = True
    parts = []
    for i in range(0, n, GIL_CHUNK):
        j = min(n, i + GIL_CHUNK)
        if i:
            keep[i] = units[i] != units[i - 1]
        np.not_equal(units[i + 1 : j], units[i : j - 1], out=keep[i + 1 : j])
        parts.append(units[i:j][keep[i:j]])
    return concat(parts)


_ZEROS = bytes(4 * GIL_CHUNK)
_ONES = b"\x01" * GIL_CHUNK  # numpy's True, byte by byte


def _put(flags: np.ndarray, units: np.ndarray, value: bool) -> None:
    """`flags[units] = value` in pieces of GIL_CHUNK (keeping the GIL)."""
    for i in range(0, units.shape[0], GIL_CHUNK):
        flags[units[i : i + GIL_CHUNK]] = value


class _FreeList:
    """Free units (slots or pages) 1..n: a sorted array, then released arrays in the order
    they were freed."""

    def __init__(self, n: int, debug: bool) -> None:
        self.n = n
        self.debug = debug
        self.free = np.arange(1, n + 1, dtype=np.int64)
        self.released: deque[np.ndarray] = deque()
        self.released_count = 0
        self.group: list[np.ndarray] | None = None
        self.held = np.zeros(n + 1, dtype=bool)  # handed out and not given back
        self.repeats = Repeats(n + 1)

    def available(self) -> int:
        return self.free.size + self.released_count

    def take(self, k: int) -> np.ndarray | None:
        if k > self.available():
            return None
        if k > self.free.size:
            self.merge()
        if k <= self.free.size:
            out, self.free = self.free[:k], self.free[k:]
        else:
            out = self._take_released(k)
        _put(self.held, out, True)
        return out

    def _take_released(self, k: int) -> np.ndarray:
        """The free array, then released units, oldest first (a part taken in half
        leaves its rest first in line): `k` units joined keeping the GIL."""
        parts, need, released = [self.free], k - self.free.size, self.released
        self.released_count -= need
        self.free = self.free[:0]
        while need:
            part = released[0]
            if part.size <= need:
                parts.append(released.popleft())
                need -= part.size
            else:
                parts.append(part[:need])
                released[0] = part[need:]
                need = 0
        return concat(parts)

    def give(self, units: np.ndarray, what: str) -> None:
        """Take `units` back, each once however often it is listed (the slots of a page-1
        pool touch a page once each, and a repeat is rare: found without a set)."""
        if units.size == 0:
            return
        if not units.flags.c_contiguous:
            units = concat([units])
        self._check(units, what)
        if units.size > 1 and self.repeats.any(
            units
        ):  # one unit (a tail's page) repeats nothing
            units = _distinct(units)
        _put(self.held, units, False)
        if self.group is not None:
            self.group.append(units)
            return
        self.released.append(units)
        self.released_count += units.size

    def _check(self, units: np.ndarray, what: str) -> None:
        """A few microseconds for a request's pages (`all_held`); the reasons are worked
        out only when the check fails."""
        if not self.all_held(units):
            bad = self.not_held(units)
            if bad.min() < 1 or bad.max() > self.n:
                raise ValueError(
                    f"free: {what} {bad[:8].tolist()} out of range 1..{self.n} (0 is padding)"
                )
            raise ValueError(
                f"free: {what} {bad[:8].tolist()} are not allocated (double free?)"
            )
        if self.debug and np.unique(units).size != units.size:
            raise ValueError(f"free: {what} listed twice in one call (double free)")

    def all_held(self, units: np.ndarray) -> bool:
        """Is every unit of `units` in range and handed out? In pieces of GIL_CHUNK, with
        byte compares for the reductions: at page size 1 the scheduler thread frees
        thousands of units at once, and one numpy pass over them gives the GIL up
        (docs/design.md §2). A unit below 0 or past 2**32 has upper 32 bits; one past n
        raises on the lookup; padding 0 is never held."""
        held = self.held
        for i in range(0, units.shape[0], GIL_CHUNK):
            part = units[i : i + GIL_CHUNK]
            k = part.shape[0]
            if part.view(np.uint32)[HIGH::2].tobytes() != _ZEROS[: 4 * k]:
                return False
            try:
                if held[part].tobytes() != _ONES[:k]:
                    return False
            except IndexError:
                return False
        return True

    def not_held(self, units: np.ndarray) -> np.ndarray:
        """The units of `units` that are not handed out: those out of range (padding
        included) if any are, else those free."""
        if units.size == 0:
            return units
        if units.min() < 1 or units.max() > self.n:
            return units[(units < 1) | (units > self.n)]
        held = self.held[units]
        return units[:0] if held.all() else units[~held]

    def merge(self) -> None:
        """A few released units (up to GIL_CHUNK with the free ones) go back into the sorted
        free array, sorted by Python (a numpy sort always gives the GIL up); more stay in
        line (`_take_released`)."""
        if self.released and self.free.size + self.released_count <= GIL_CHUNK:
            units = self.free.tolist()
            for part in self.released:
                units += part.tolist()
            units.sort()
            self.free = np.frombuffer(array("q", units), dtype=np.int64)
            self.released.clear()
            self.released_count = 0

    @contextmanager
    def grouped(self) -> Iterator[None]:
        outer = self.group
        self.group = [] if outer is None else outer
        try:
            yield
        finally:
            if outer is None:
                batch, self.group = self.group, None
                if batch:
                    merged = concat(batch)
                    self.released.append(merged)
                    self.released_count += merged.size


class TokenAllocator:
    """Token-granular slots 1..size."""

    def __init__(self, size: int, debug: bool | None = None) -> None:
        self.size = check_size("size", size)
        self._free = _FreeList(size, _debug_default() if debug is None else debug)

    def available_size(self) -> int:
        return self._free.available()

    def alloc(self, n: int) -> torch.Tensor | None:
        check_size("n", n, minimum=0)
        slots = self._free.take(n)
        return None if slots is None else tensor(slots)

    def free(self, indices: torch.Tensor) -> None:
        self._free.give(concat([as_numpy(check_indices("indices", indices))]), "slots")

    def free_group(self):
        """`with alloc.free_group(): ...` batches every free inside into one concat."""
        return self._free.grouped()

    def clear(self) -> None:
        self._free = _FreeList(self.size, self._free.debug)


class PagedAllocator:
    """Page-granular slots: page p holds slots [p*page_size, (p+1)*page_size); page 0 is padding.

    A request's tokens fill its last partial page before a new page is taken, so the KV of
    one page is always contiguous in the pool.
    """

    def __init__(self, size: int, page_size: int, debug: bool | None = None) -> None:
        check_size("size", size)
        self.page_size = check_size("page_size", page_size)
        if size % page_size:
            raise ValueError(
                f"size={size}: must be a multiple of page_size={page_size}"
            )
        self.size = size
        self.num_pages = size // page_size
        self._free = _FreeList(
            self.num_pages, _debug_default() if debug is None else debug
        )

    def available_size(self) -> int:
        return self._free.available() * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` slots (a multiple of page_size) as whole pages."""
        slots = self.alloc_slots(n)
        return None if slots is None else tensor(slots)

    def alloc_slots(self, n: int) -> np.ndarray | None:
        """`alloc` for kvtier's own scheduler-thread code: numpy slots, no torch call."""
        check_size("n", n, minimum=0)
        if n % self.page_size:
            raise ValueError(
                f"alloc: n={n} must be a multiple of page_size={self.page_size}"
            )
        pages = self._free.take(n // self.page_size)
        return None if pages is None else page_slots(pages, self.page_size)

    def alloc_pages(self, n: int) -> np.ndarray | None:
        """`n` whole pages as page numbers (a prefetch reserves pages, not slots)."""
        pages = self._free.take(check_size("n", n, minimum=0))
        return None if pages is None else concat([pages])

    def free_pages(self, pages: np.ndarray) -> None:
        """Free pages given by number (each listed once)."""
        self._free.give(concat([pages]), "pages")

    def alloc_extend(
        self, prefix_lens: list[int], seq_lens: list[int], last_loc: list[int]
    ) -> torch.Tensor | None:
        """Slots for tokens [prefix_len, seq_len) of each request, concatenated.

        `last_loc[i]` is the slot of request i's last prefix token (ignored when its prefix
        ends on a page boundary). Tokens continue in that page, then take whole new pages.
        """
        ps = self.page_size
        if not len(prefix_lens) == len(seq_lens) == len(last_loc):
            raise ValueError(
                f"alloc_extend: prefix_lens, seq_lens, last_loc differ in length "
                f"({len(prefix_lens)}, {len(seq_lens)}, {len(last_loc)})"
            )
        for i, (p, s) in enumerate(zip(prefix_lens, seq_lens)):
            if not 0 <= p <= s:
                raise ValueError(
                    f"alloc_extend: request {i} has prefix_len={p} > seq_len={s}"
                )
        need = sum(-(-s // ps) - -(-p // ps) for p, s in zip(prefix_lens, seq_lens))
        pages = self._free.take(need)
        if pages is None:
            return None
        out, cursor = [], 0
        for p, s, last in zip(prefix_lens, seq_lens, last_loc):
            in_page = (
                min(s, -(-p // ps) * ps) - p
            )  # tokens that fit the partial last page
            if in_page:
                out.append(np.arange(last + 1, last + 1 + in_page, dtype=np.int64))
            k = -(-s // ps) - -(-p // ps)
            out.append(page_slots(pages[cursor : cursor + k], ps)[: s - p - in_page])
            cursor += k
        return tensor(concat(out))

    def free(self, indices: torch.Tensor) -> None:
        """Free the pages that `indices` touch (a partial tail page frees its whole page)."""
        self.free_slots(as_numpy(check_indices("indices", indices)))

    def free_slots(self, slots: np.ndarray) -> None:
        """`free` for kvtier's own scheduler-thread code: numpy slots, no torch call. The
        free list keeps its own copy: `slots` may be a view of an engine's row, which it
        fills again for its next request (at page size 1 a slot is a page, and the slots
        themselves would be kept: rewritten, they would hand one slot out twice)."""
        if self.page_size == 1:
            pages = concat([slots])  # `give` drops repeats
        else:
            pages = _pages_touched(
                pages_of(slots, self.page_size), self.page_size
            )  # a fresh array
        self._free.give(pages, "pages")

    def free_group(self):
        return self._free.grouped()

    def unallocated(self, slots: np.ndarray) -> np.ndarray:
        """The slots of `slots` whose page is not allocated (free, padding or out of range):
        KV kept there would be overwritten by the page's next owner."""
        pages = pages_of(slots, self.page_size)
        if self._free.all_held(pages):
            return slots[:0]
        bad = self._free.not_held(pages)
        return slots[np.isin(pages, bad)] if bad.size else bad

    def clear(self) -> None:
        self._free = _FreeList(self.num_pages, self._free.debug)
