"""kvtier's SGLang linker against SGLang's own HiCache, like for like: SGLang 0.5.23's
`UnifiedRadixCache` (its Rust tree core) driven through the calls its scheduler makes per
request, on CPU, with

1. no tiers (the device pool alone),
2. HiCache's host tier,
3. HiCache's host tier + SGLang's `file` L3 backend,
4. kvtier's linker, host tier only,
5. kvtier's linker, host tier + kvtier's file store,
6. kvtier's own `TieredCache` (its own tree), host tier + file store (`kvtier/bench/cache.py`'s
   scheduler loop),
7. the linker floor: SGLang's linker seam with the smallest correct linker (`FloorLinker`:
   every offload accepted and complete at once, nothing copied or kept, every lookup a
   miss), so its figure is what SGLang's own side of the seam costs with kvtier free,

on the same trace (the first `--requests` of `benchmarks/cache.py`'s, seed 3), the same device
pool (10% of the working set), host tier 2x the device pool, write-through, store directories
of the same kind (tmpfs when /dev/shm exists). The arms take turns, round after round; each
figure is the median of its rounds of the scheduler thread's CPU time per request
(`time.thread_time` around every cache call), with the process's CPU time beside it (which
adds the store and copy threads).

Per batch of up to `--in-flight` requests: each request is matched (`match_kv_cache`: the
linker's lookup), pinned, given its row, loaded back when it hit below the device
(`init_load_back`: the linker's load; HiCache's host -> device), and locked; HiCache with
the file backend first prefetches from L3 (`prefetch_from_storage`, then
`check_prefetch_progress` until done: the wait_complete policy; naps between polls are not
counted). Then the batch starts its loads (`ready_to_load_host_cache`), allocates its slots
(`alloc_token_slots` / `alloc_paged_token_slots_extend`), runs the forward's per-layer
waits (the KV pool's layer counter), checks its loads (`finish_external_linker_loads`), and
each request is released into the tree (`release_kv_cache`, which offloads: write-through);
`check_hicache_events` runs once per step.

HiCache needs four CPU stand-ins (`kvtier/bench/hicache_cpu.py`), which this benchmark
applies to its own process: its copy kernels become free no-ops, which flatters HiCache.
Without SGLang the benchmark says so and exits 0.

`--hybrid swa` / `--hybrid mamba` run SGLang's hybrid cache instead (FULL+SWA: `SWAKVPool`, a
128-token window; FULL+MAMBA: `HybridLinearKVPool` beside `HybridReqToTokenPool`'s Mamba2
states), its pools built as SGLang's test kit builds them and its tree as the server does,
with every arm but TieredCache (it has no hybrid pools) and the same trace, pools, host ratio
and write policy. A Mamba state is cached where a finished request's forward last tracked it
(the chunk grid: 64 tokens or the page), so a length restores only there; the loop, like the
Full one, inserts a request only when it finishes, so the state a server's prefill tracks at
a branching point (a shared system prompt's end) is not modelled, and a trace of first turns
(the first 150 requests) restores no Mamba prefix in any arm.

Run: python benchmarks/linker.py --page-size 1 --page-size 16   (--requests 60 for a quick run)
     python benchmarks/linker.py --hybrid swa --hybrid mamba --page-size 16
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile

import torch

from kvtier.bench.cache import infinite_bound
from kvtier.bench.linker_arms import SHIMS, TREE_CORES, ArmRun, tiered_arm, urc_arm
from kvtier.bench.trace import multiturn
from kvtier.testing import sglang_loader

ARMS = (
    "sglang",
    "hicache",
    "hicache_file",
    "linker",
    "linker_file",
    "tieredcache",
    "linker_floor",
)
LABELS = {
    "sglang": "SGLang, no tiers",
    "hicache": "SGLang HiCache, host",
    "hicache_file": "SGLang HiCache, host + its file L3",
    "linker": "kvtier linker, host",
    "linker_file": "kvtier linker, host + kvtier file store",
    "tieredcache": "kvtier TieredCache (own tree), host + file store",
    "linker_floor": "linker floor: SGLang's seam, kvtier free",
}


# a hybrid run: the arms on SGLang's tree (TieredCache has no hybrid pools)
HYBRID_ARMS = tuple(a for a in ARMS if a not in ("tieredcache", "linker_floor"))
HYBRID = {
    "swa": "full-attention layers 1, 3; sliding-window layers 0, 2",
    "mamba": "full-attention layers 1, 3; Mamba2 layers 0, 2",
}


def run(
    page: int,
    requests: int = 300,
    rounds: int = 3,
    in_flight: int = 8,
    device_fraction: float = 0.10,
    sg=None,
    hybrid: str | None = None,
) -> dict:
    trace = multiturn(
        sessions=150,
        turns=6,
        system_prompts=6,
        system_len=512,
        msg_len=(32, 200),
        seed=3,
    )[:requests]
    _, working_set = infinite_bound(trace, page)
    longest = max(len(t.prompt) + len(t.output) for t in trace)
    size = max(
        page * 64,
        -(-2 * longest // page) * page,
        int(working_set * device_fraction) // page * page,
    )
    arms = ARMS if hybrid is None else HYBRID_ARMS
    runs: dict[str, list[ArmRun]] = {k: [] for k in arms}
    for _ in range(rounds):
        for kind in arms:
            gc.collect()
            with tempfile.TemporaryDirectory() as root:
                if kind == "tieredcache":
                    out = tiered_arm(trace, size, page, in_flight)
                else:
                    out = urc_arm(sg, kind, trace, size, page, in_flight, root, hybrid)
            runs[kind].append(out)
    n = len(trace)
    med = {k: statistics.median(r.cpu for r in v) / n * 1e6 for k, v in runs.items()}
    proc = {
        k: statistics.median(r.process for r in v) / n * 1e6 for k, v in runs.items()
    }
    head = "" if hybrid is None else f"hybrid {hybrid} ({HYBRID[hybrid]}), "
    print(
        f"{head}page {page}: {n} requests ({in_flight} in flight), working set {working_set} tokens, "
        f"device pool {size} tokens ({size / working_set:.0%}), host 2x, write-through, "
        f"stores on {tempfile.gettempdir()}; {rounds} alternating rounds, medians"
    )
    for k in arms:
        last = runs[k][-1]
        print(
            f"  {LABELS[k]:<48} scheduler {med[k]:8.0f} µs/request  process {proc[k]:8.0f} "
            f"µs/request  restored {last.restored} tokens  device hits {last.device_hit}  "
            f"failed loads {last.failed_loads}"
        )
    for k in arms:
        last = runs[k][-1]
        print(
            f"  {k} by call (µs/request, last round): "
            + ", ".join(
                f"{c} {v[0] / n * 1e6:.0f}" for c, v in sorted(last.by_call.items())
            )
        )

    def same(a: str, b: str) -> str:
        return " / ".join(f"{x.cpu / y.cpu:.2f}x" for x, y in zip(runs[a], runs[b]))

    print(
        f"  same-round ratios, linker+file / HiCache host+file: {same('linker_file', 'hicache_file')}"
    )
    print(f"  same-round ratios, linker / HiCache host: {same('linker', 'hicache')}")
    if hybrid is not None:
        return {
            "page": page,
            "hybrid": hybrid,
            "us": med,
            "process_us": proc,
            "X": med["linker_file"] / med["hicache_file"],
            "Y": med["linker"] / med["hicache"],
            "Z": runs["linker"][-1].restored / max(1, runs["hicache"][-1].restored),
            "restored": runs["linker"][-1].restored,
            "hicache_restored": runs["hicache"][-1].restored,
        }
    print(
        f"  same-round ratios, TieredCache / HiCache host+file: {same('tieredcache', 'hicache_file')}"
    )
    ratios = {
        "X": med["linker_file"] / med["hicache_file"],
        "Y": med["linker"] / med["hicache"],
        "Z": runs["linker_file"][-1].restored
        / max(1, runs["hicache_file"][-1].restored),
        "W": med["tieredcache"] / med["hicache_file"],
        "F": med["linker_floor"] / med["hicache_file"],
        "G": med["linker_floor"] / med["hicache"],
    }
    print(
        f"  kvtier's own share above the floor: linker host "
        f"{med['linker'] - med['linker_floor']:.0f} µs/request, linker host + file store "
        f"{med['linker_file'] - med['linker_floor']:.0f} µs/request"
    )
    return {"page": page, "us": med, "process_us": proc, **ratios}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--page-size", type=int, action="append", help="1 and 16 by default")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument(
        "--hybrid",
        choices=sorted(HYBRID),
        action="append",
        help="run SGLang's hybrid cache (FULL+SWA, FULL+MAMBA) instead of the Full one, "
        "with every arm but TieredCache; repeatable",
    )
    args = p.parse_args(argv)
    pages = args.page_size or [1, 16]
    try:
        sg = sglang_loader.load()
    except sglang_loader.Unavailable as exc:
        print(
            f"linker benchmark: SGLang cannot be loaded here ({exc}); nothing measured"
        )
        return 0
    if os.path.isdir("/dev/shm") and "TMPDIR" not in os.environ:
        tempfile.tempdir = "/dev/shm"  # every arm's store on tmpfs
    logging.getLogger("sglang").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print(
        "HiCache runs on CPU with stand-ins for its CUDA-only calls (kvtier/bench/hicache_cpu.py): "
        "its copy kernels are free no-ops, which flatters HiCache"
    )
    if args.hybrid:
        results = [
            run(page, args.requests, args.rounds, args.in_flight, sg=sg, hybrid=h)
            for h in args.hybrid
            for page in pages
        ]
    else:
        results = [
            run(page, args.requests, args.rounds, args.in_flight, sg=sg)
            for page in pages
        ]
    print(
        f"SGLang tree core: {', '.join(sorted(TREE_CORES))}; copy kernels HiCache launched "
        f"(free here): {sum(SHIMS.calls.values())}"
    )
    for r in results:
        if "hybrid" in r:
            restored = (
                f"restored {r['Z']:.2f}x HiCache's tokens"
                if r["hicache_restored"]
                else f"restored {r['restored']} tokens, HiCache none"
            )
            print(
                f"linker hybrid {r['hybrid']}: page {r['page']} scheduler {r['Y']:.2f}x "
                f"HiCache (host), {restored}"
            )
            continue
        print(
            f"linker: page {r['page']} scheduler {r['X']:.2f}x HiCache (host+file), "
            f"{r['Y']:.2f}x HiCache (host), restored {r['Z']:.2f}x HiCache's tokens"
        )
        print(
            f"tieredcache: page {r['page']} scheduler {r['W']:.2f}x HiCache (host+file)"
        )
        print(
            f"linker floor: page {r['page']} scheduler {r['F']:.2f}x HiCache (host+file), "
            f"{r['G']:.2f}x HiCache (host)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
