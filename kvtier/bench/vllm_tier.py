"""The vLLM tier against vLLM's own file-system tier (the default, `--baseline fs`:
kvtier/bench/vllm_fs.py), or its cost over its store (`--baseline store`): cascades and
promotions through `KvtierTier` against the same store called directly with the same
rows, measured in the same run.

Both sides use one store configuration and the rows of one real vLLM primary region
(`TieringOffloadingSpec.get_manager()` over /dev/shm). The tier side submits one
`TransferJob` per round (fresh keys for stores, so every round writes) and waits for its
`JobResult` (`drain_jobs`, then `get_finished_jobs`); the direct side awaits
`batch_set` / `batch_get_into` of those rows on a loop of its own. Rounds alternate (tier
store, direct store, ..., then tier load, direct load, ...); each figure is the best round. The tier's
extra cost is a hand-off to its store thread and back, and its key and index bookkeeping.

Run: python benchmarks/vllm_tier.py [--baseline fs|store]   (needs vLLM 0.33.0: pip install
--no-deps vllm==0.33.0 and the pure-Python imports in requirements-engines.txt)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from kvtier.backends.registry import build_store
from kvtier.bench import servers
from kvtier.bench.timing import alternate
from kvtier.bench.vllm_fs import ROUNDS, human_size, manager
from kvtier.hashing import make_key

SHAPES = [(64, 256 << 10), (16, 1 << 20), (4, 8 << 20)]  # (rows per job, bytes per row)


def _manager(kvtier_config: dict, rows: int, row_bytes: int):
    """vLLM's manager with KvtierTier as its one secondary tier."""
    tier = {
        "type": "KvtierTier",
        "module_path": "kvtier.integrations.vllm",
        "kvtier_config": kvtier_config,
    }
    return manager(tier, rows, row_bytes)


def _pair(
    kvtier_config: dict, n: int, size: int, loop: asyncio.AbstractEventLoop
) -> tuple[dict, object, object]:
    """The four timed functions, the manager and the direct store, over one primary region."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from kvtier.config import load_config
    from kvtier.integrations.vllm.keys import page_hash_of

    mgr = _manager(kvtier_config, n, size)
    tier = mgr.secondary_tiers[0]
    view = mgr.primary_tier.get_kv_memoryview()
    np.asarray(view)[:] = np.frombuffer(os.urandom(n * size), dtype=np.uint8).reshape(
        n, size
    )
    flat = view.cast("B")
    rows = [flat[i * size : (i + 1) * size] for i in range(n)]
    cfg = load_config(None, kvtier_config)
    direct = build_store(cfg.store.backend, cfg.store.options, cfg.store.timeout_s)
    chunk_ids = np.arange(n, dtype=np.int32)
    ids, ctx = itertools.count(), ReqContext(req_id="bench")
    full = lambda keys: [
        make_key(tier.key_prefix, tier.namespace.id, page_hash_of(k)) for k in keys
    ]
    fresh = lambda: [make_offload_key(os.urandom(32), 0) for _ in range(n)]

    def job(keys, promotion: bool) -> None:
        run = tier.submit_load if promotion else tier.submit_store
        run(TransferJob(next(ids), keys, chunk_ids, promotion, ctx))
        tier.drain_jobs()
        [result] = tier.get_finished_jobs()
        assert result.success, "a tier job failed"

    stored = fresh()
    job(stored, False)
    fns = {
        "tier set": lambda: job(fresh(), False),
        "direct set": lambda: loop.run_until_complete(
            direct.batch_set(full(fresh()), rows)
        ),
        "tier get": lambda: job(stored, True),
        "direct get": lambda: loop.run_until_complete(
            direct.batch_get_into(full(stored), rows)
        ),
    }
    return fns, mgr, direct


def run(
    repeat: int = 9, only: list[str] | None = None
) -> dict[str, tuple[float, float]]:
    loop = asyncio.new_event_loop()
    ratios: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        stores = {"file": {"backend": "file", "root": str(root / "store")}}
        redis_server = None
        try:
            redis_server = servers.RedisServer(root).start()
            stores["redis"] = {"backend": "redis", "url": redis_server.url}
        except servers.ServerMissing as exc:
            print(f"redis: skipped ({exc})")
        try:
            for name, section in stores.items():
                if only and name not in only:
                    continue
                set_r, get_r = [], []
                for n, size in SHAPES:
                    fns, mgr, direct = _pair(
                        {"store": {"timeout_s": 30.0, **section}}, n, size, loop
                    )
                    try:
                        # stores and loads in rounds of their own: a load right after a store's
                        # fresh writes (dirty pages, evicted cache) would pay for them
                        best = alternate(
                            {k: fns[k] for k in ("tier set", "direct set")}, repeat
                        )
                        best |= alternate(
                            {k: fns[k] for k in ("tier get", "direct get")}, repeat
                        )
                        gbs = {k: n * size / t / 1e9 for k, t in best.items()}
                    finally:
                        mgr.shutdown()
                        loop.run_until_complete(direct.close())
                    set_r.append(gbs["tier set"] / gbs["direct set"])
                    get_r.append(gbs["tier get"] / gbs["direct get"])
                    print(
                        f"{name:6s} {n:3d} x {human_size(size)}: tier set {gbs['tier set']:6.2f} get "
                        f"{gbs['tier get']:6.2f} GB/s | store direct set {gbs['direct set']:6.2f} get "
                        f"{gbs['direct get']:6.2f} GB/s"
                    )
                ratios[name] = (min(set_r), min(get_r))
            for name, (s, g) in ratios.items():
                print(
                    f"vLLM tier on {name}: store {s:.2f}x, load {g:.2f}x the store called directly (worst shape)"
                )
        finally:
            if redis_server is not None:
                redis_server.stop()
            loop.close()
    return ratios


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=9,
        help="alternating rounds; each side keeps its best",
    )
    p.add_argument(
        "--baseline",
        choices=["fs", "store"],
        default="fs",
        help="fs: vLLM's own file-system tier on the same rows and directory kind "
        "(kvtier/bench/vllm_fs.py); store: kvtier's store called directly",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="fs: alternating rounds (medians; on a shared 2-core VM a run of 9 "
        "moved the median ratio by up to 0.1 from one run to the next)",
    )
    p.add_argument("--dir", default="/dev/shm", help="fs: where both tiers' files go")
    p.add_argument("--only", nargs="*", choices=["file", "redis"], help="store names")
    args = p.parse_args(argv)
    _require_vllm(prog or "vllm_tier")
    if args.baseline == "fs":
        from kvtier.bench.vllm_fs import run as run_fs

        run_fs(args.rounds, args.dir)
    else:
        run(args.repeat, args.only)


def _require_vllm(prog: str) -> None:
    """Without vLLM's offloading classes there is nothing to measure: one line naming the
    install, exit 2 (as `tierctl`'s other missing pieces), not a traceback."""
    try:
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
    except ImportError as exc:
        sys.stderr.write(
            f"{prog}: needs vLLM 0.33.0's offloading classes ({exc}): pip install "
            "--no-deps vllm==0.33.0 and its pure-Python imports, requirements-engines.txt "
            "in a kvtier clone (README: Run the tests)\n"
        )
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
