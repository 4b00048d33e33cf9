"""Radix tree throughput on a synthetic multi-turn trace, and match time vs tree size.

Run: python benchmarks/tree.py   (or: tierctl bench tree)
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

from kvtier.bench.trace import multiturn
from kvtier.tree import RadixKey, RadixTree


def replay(trace, page_size: int) -> dict[str, float]:
    tree = RadixTree(page_size=page_size)
    keys = []
    for t in trace:
        full = np.concatenate([t.prompt, t.output])
        keys.append(
            (RadixKey(t.prompt), RadixKey(full[: len(full) - len(full) % page_size]))
        )
    slots = torch.arange(
        page_size, page_size + sum(len(k[1]) for k in keys), dtype=torch.int64
    )
    matched, used = 0, 0
    start = time.perf_counter()
    for prompt, full in keys:
        matched += tree.match_prefix(prompt).device_slots.size
        tree.insert(
            full, slots[used : used + len(full)]
        )  # fresh slots, as an allocator would give
        used += len(full)
    both = time.perf_counter() - start
    start = time.perf_counter()
    matched_again = 0
    for prompt, _ in keys:
        matched_again += tree.match_prefix(prompt).device_slots.size
    match_only = time.perf_counter() - start
    tree.sanity_check()
    tokens = sum(len(k[0]) for k in keys)
    return {
        "ops": len(keys),
        "insert_match_ops_s": len(keys) / both,
        "match_ops_s": len(keys) / match_only,
        "matched": matched,
        "matched_again": matched_again,
        "key_tokens": tokens,
    }


def scaling(page_size: int = 1, repeat: int = 2000) -> tuple[float, float, float]:
    """Seconds per fixed 2k-token match against trees of ~1k and ~100k nodes, and the ratio."""
    rng = np.random.default_rng(1)
    probe = rng.integers(
        32000, 64000, 2048
    )  # disjoint from the filler: the probe stays one node
    times = []
    for nodes in (1_000, 100_000):
        tree = RadixTree(page_size=page_size)
        tree.insert(RadixKey(probe), torch.arange(1, 2049))
        base = rng.integers(0, 32000, (nodes, 2 * page_size))
        for i, row in enumerate(base):
            tree.insert(
                RadixKey(row),
                torch.arange(10_000 + i * len(row), 10_000 + (i + 1) * len(row)),
            )
        key = RadixKey(probe)
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeat):
                tree.match_prefix(key)
            rounds.append((time.perf_counter() - start) / repeat)
        times.append(min(rounds))
    return times[0], times[1], times[1] / times[0]


def eviction_scaling(page_size: int = 16, evictions: int = 500) -> tuple[float, float]:
    """Seconds per one-page eviction (LRU, nothing locked) in trees of ~1k and ~50k leaves:
    a pass pops what it evicts, so this should not grow with the tree."""
    rng = np.random.default_rng(2)
    times = []
    for leaves in (1_000, 50_000):
        tree = RadixTree(page_size=page_size)
        rows = rng.integers(0, 32000, (leaves, 2 * page_size))
        for i, row in enumerate(rows):
            tree.insert(
                RadixKey(row),
                torch.arange(page_size + i * len(row), page_size + (i + 1) * len(row)),
            )
        for i in range(0, leaves, 7):
            tree.match_prefix(
                RadixKey(rows[i])
            )  # touched leaves: their heap keys go stale
        start = time.perf_counter()
        for _ in range(evictions):
            tree.evict_device(page_size)
        times.append((time.perf_counter() - start) / evictions)
        tree.sanity_check()
    return times[0], times[1]


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--sessions", type=int, default=400)
    p.add_argument("--turns", type=int, default=8)
    args = p.parse_args(argv)
    trace = multiturn(sessions=args.sessions, turns=args.turns)
    for ps in (1, 16):
        gc.collect()  # the previous run's tree must not be collected on this run's clock
        r = replay(trace, ps)
        print(
            f"page {ps:2d}: {r['ops']} requests, {r['key_tokens'] / 1e6:.2f}M key tokens | "
            f"insert+match {r['insert_match_ops_s']:8.0f} ops/s | match {r['match_ops_s']:8.0f} ops/s | "
            f"matched tokens {r['matched']} (again {r['matched_again']})"
        )
    small, large, ratio = scaling()
    print(
        f"scaling: one 2k-token match {small * 1e6:.1f} us at ~1k nodes, {large * 1e6:.1f} us at ~100k nodes"
    )
    few, many = eviction_scaling()
    print(
        f"eviction: one page {few * 1e6:.1f} us at ~1k leaves, {many * 1e6:.1f} us at ~50k leaves "
        f"({many / few:.2f}x)"
    )
    print(f"tree: match time ratio 100k/1k nodes {ratio:.2f}x")


if __name__ == "__main__":
    main()
