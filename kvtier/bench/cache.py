"""Replay a synthetic multi-turn trace through TieredCache: hit rate per tier against the
infinite-cache bound measured in the same run, and time spent inside kvtier per request.

Device pool ~10% of the working set, a 2x host mirror, the file store.
Run: python benchmarks/cache.py   (or: tierctl bench cache)
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from kvtier.bench.trace import multiturn
from kvtier.cache import TieredCache
from kvtier.config import load_config
from kvtier.tree import RadixKey, RadixTree

PAGE = 16


def infinite_bound(trace) -> tuple[float, int]:
    """(hit rate of a cache that never evicts, tokens it ends up holding)."""
    tree = RadixTree(page_size=PAGE)
    hit = total = 0
    slot = PAGE
    import torch

    for t in trace:
        hit += tree.match_prefix(RadixKey(t.prompt)).device_indices.numel()
        total += len(t.prompt)
        full = np.concatenate([t.prompt, t.output])
        full = full[: len(full) - len(full) % PAGE]
        tree.insert(RadixKey(full), torch.arange(slot, slot + len(full)))
        slot += len(full)
    return hit / total, tree.total_size()


def serve(cache: TieredCache, tokens: np.ndarray, rid: str, naps: list[float]) -> tuple[int, int, int]:
    """One request through the embedding sequence; returns (device, host, storage) hit
    tokens. Time napping while its prefetch runs is added to `naps`: a server would run
    other requests then, so it is not scheduler time."""
    import torch

    got = cache.acquire(tokens, rid)
    while not got.ready:  # one request at a time: nothing else to run while it waits
        if rid in cache.poll():
            got = cache.acquire(tokens, rid)
        else:
            start = time.perf_counter()
            cache.wait_progress()
            naps[0] += time.perf_counter() - start
    cached = got.indices.numel()
    mine = cache.alloc(len(tokens) - cached)
    if mine is None:
        raise RuntimeError("device pool too small for one request")
    waiter = cache.begin_forward()
    for layer in range(cache.pool.num_layers):
        waiter.wait_layer(layer)
    cache.cache_finished(rid, tokens, torch.cat([got.indices, mine]))
    cache.poll()
    return got.device_hit, got.host_hit, got.storage_hit


def run(sessions: int = 150, turns: int = 6, device_fraction: float = 0.10) -> dict:
    trace = multiturn(sessions=sessions, turns=turns, system_prompts=6, system_len=512, msg_len=(32, 200), seed=3)
    bound, working_set = infinite_bound(trace)
    size = max(PAGE * 64, int(working_set * device_fraction) // PAGE * PAGE)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, {
            "pool": {"size": size, "num_layers": 2, "page_size": PAGE, "num_kv_heads": 1, "head_dim": 16,
                     "dtype": "float16"},
            "mirror": {"ratio": 2.0, "layout": "page_first"},
            "controller": {"write_policy": "write_through", "prefetch_policy": "wait_complete"},
            "store": {"backend": "file", "root": tmp, "capacity_bytes": 1 << 34},
        }, env={})
        cache = TieredCache(cfg)
        hits = [0, 0, 0]
        prompt_tokens = 0
        inside, naps = 0.0, [0.0]
        for i, t in enumerate(trace):
            full = np.concatenate([t.prompt, t.output])
            start = time.perf_counter()
            d, h, s = serve(cache, t.prompt, f"r{i}", naps)
            inside += time.perf_counter() - start
            hits = [hits[0] + d, hits[1] + h, hits[2] + s]
            prompt_tokens += len(t.prompt)
            # the generated tokens become part of the session's history (cached as a decode would)
            serve(cache, full, f"o{i}", [0.0])
        cache.close()
    inside -= naps[0]
    bare = bare_tree_seconds(trace)
    rates = [x / prompt_tokens for x in hits]
    total = sum(rates)
    print(f"{len(trace)} requests, {prompt_tokens} prompt tokens, working set {working_set} tokens, "
          f"device pool {size} tokens ({size / working_set:.0%}), mirror 2x, file store")
    print(f"hit rate: device {rates[0]:.3f} + host {rates[1]:.3f} + storage {rates[2]:.3f} = {total:.3f} "
          f"(infinite cache {bound:.3f})")
    print(f"scheduler time inside kvtier: {inside / len(trace) * 1e3:.3f} ms per request (naps waiting for the "
          f"store excluded: {naps[0] / len(trace) * 1e3:.2f} ms); bare RadixTree match+insert of the same requests: "
          f"{bare / len(trace) * 1e3:.3f} ms")
    print(f"cache: hit rate {total / bound:.3f}x bound, scheduler {inside / bare:.2f}x bare tree")
    return {"rates": rates, "bound": bound, "ms_per_request": inside / len(trace) * 1e3, "scheduler_ratio": inside / bare}


def bare_tree_seconds(trace) -> float:
    """Wall time of the same requests' match + insert on a bare RadixTree (no tiers, no
    I/O), the history inserts between them untimed: the floor for scheduler time."""
    import torch

    tree, slot, spent = RadixTree(page_size=PAGE), PAGE, 0.0
    for t in trace:
        full = np.concatenate([t.prompt, t.output])
        prompt = RadixKey(t.prompt[: len(t.prompt) - len(t.prompt) % PAGE])
        fresh = torch.arange(slot, slot + len(prompt), dtype=torch.int64)
        start = time.perf_counter()
        tree.match_prefix(prompt)
        tree.insert(prompt, fresh)
        spent += time.perf_counter() - start
        slot += len(prompt)
        full = RadixKey(full[: len(full) - len(full) % PAGE])
        tree.insert(full, torch.arange(slot, slot + len(full), dtype=torch.int64))
        slot += len(full)
    return spent


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--sessions", type=int, default=150)
    p.add_argument("--turns", type=int, default=6)
    args = p.parse_args(argv)
    run(args.sessions, args.turns)


if __name__ == "__main__":
    main()
