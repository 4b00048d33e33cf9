"""Timing shared by the benchmarks: a candidate and its baseline take turns, round after
round, and each keeps its best round, so a noisy neighbour or a drifting clock speed hurts
both sides alike."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(fn: Callable[[], object], sync: Callable[[], None] = lambda: None) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def alternate(
    fns: dict[str, Callable[[], object]],
    repeat: int,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Best time of each fn over `repeat` rounds, the fns taking turns within a round."""
    for fn in fns.values():
        fn()  # warm-up (and whatever the first timed call needs exists)
    sync()
    best = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            best[k] = min(best[k], timed(fn, sync))
    return best
