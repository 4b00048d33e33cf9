"""numpy gives up the GIL for an elementwise op over more than 500 elements
(NPY_BEGIN_THREADS_THRESHOLDED) and for every sort. On the scheduler thread each hand-off
may cost a switch interval (docs/design.md §2), so its hot paths work in pieces of at most
GIL_CHUNK elements. No torch here: the CLI's help must not import it."""

import sys

GIL_CHUNK = 500
HIGH = (
    1 if sys.byteorder == "little" else 0
)  # the upper 32 bits of an int64, viewed as two uint32s


def shared_bytes(a: bytes, a_at: int, b: bytes, b_at: int, n: int) -> int:
    """How many of the `n` bytes from `a[a_at]` and `b[b_at]` are the same before the first
    that differs (`n` if none does), keeping the GIL: numpy's compare and its `argmax` give
    it up, and a memoryview compare unpacks byte by byte (2 ms for 800 KB). Halving the
    window the first difference lies in, each step one memcmp (`startswith`) of a copy of
    its lower half: about `n` bytes copied in all, ~60 us for 800 KB."""
    if b.startswith(a[a_at : a_at + n], b_at):
        return n
    lo, hi = 0, n  # bytes [0, lo) are the same; the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if b.startswith(a[a_at + lo : a_at + mid], b_at + lo):
            lo = mid
        else:
            hi = mid
    return lo
