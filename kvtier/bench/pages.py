"""Host buffers laid out as the mirror's pages are, for the store benchmarks."""

from __future__ import annotations

import mmap


def page_aligned(n: int, size: int) -> list[memoryview]:
    """n writable buffers of `size` bytes, each starting on a page boundary (one anonymous
    mapping), as host mirror pages do."""
    step = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    whole = memoryview(mmap.mmap(-1, max(1, n * step)))
    return [whole[i * step : i * step + size] for i in range(n)]
