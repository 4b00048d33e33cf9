"""`KvtierTier` on the file store against vLLM's own file-system tier (`fs`), both built by
vLLM's real `TieringOffloadingSpec(...).get_manager()` over a real shared primary region,
their files in one kind of directory (tmpfs: /dev/shm), measured in the same run.

Each side is driven through the calls vLLM's manager makes: `submit_store` /
`submit_load` of `JOBS` jobs at once (each its own primary rows), `drain_jobs`, then
`get_finished_jobs`; `lookup` of keys whose verdict is cached (a request asked before,
`on_schedule_end` sent the probe and it was answered). The sides take turns within each
round (which goes first alternates); a ratio is kvtier's throughput over vLLM's in the
same round, and the figure printed is the median over the rounds. Rows are random bytes;
stores write fresh keys every round (each side deletes its round's rows untimed).
vLLM's tier writes and reads raw rows; kvtier frames, checksums (or, with a tenant key,
seals) and verifies every one.

Run: python benchmarks/vllm_tier.py [--rounds 25] [--dir /dev/shm]
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

SHAPES = [(16, 1 << 20), (64, 256 << 10)]  # (rows per job, bytes per row)
JOBS = 4  # jobs in flight at once
LOOKUP_PASSES = 200  # lookups of every key per timed lookup round
ROUNDS = 25  # alternating rounds, each figure their median (`--rounds`)


def human_size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def manager(tier: dict, rows: int, row_bytes: int):
    """vLLM's TieringOffloadingManager with `tier` as its one secondary tier over a
    primary region of `rows` rows."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=16, layer_names=("layer.0",), group_id=0
            ),
        ),
        worker_kv_bytes_per_block=row_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": rows * row_bytes, "secondary_tiers": [tier]},
        engine_id=f"kvtierbench{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="bench", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    return TieringOffloadingSpec(config).get_manager()


@dataclass
class Side:
    """One tier under its manager, with `JOBS` jobs' worth of primary rows filled."""

    name: str
    mgr: object
    n: int
    forget: Callable[[list], None]  # deletes a round's stored rows (untimed)
    ids: itertools.count = field(default_factory=itertools.count)
    stored: list = field(default_factory=list)  # JOBS lists of keys the loads read

    def __post_init__(self) -> None:
        self.tier = self.mgr.secondary_tiers[0]
        rows = np.asarray(self.mgr.primary_tier.get_kv_memoryview())
        rows[:] = np.frombuffer(os.urandom(rows.size), dtype=np.uint8).reshape(
            rows.shape
        )
        self.chunks = [
            np.arange(j * self.n, (j + 1) * self.n, dtype=np.int64) for j in range(JOBS)
        ]
        self.stored = self.store()

    def _jobs(self, keys: list[list], promotion: bool) -> None:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.base import TransferJob

        submit = self.tier.submit_load if promotion else self.tier.submit_store
        ctx = ReqContext(req_id=f"bench-{self.name}")
        for job_keys, chunks in zip(keys, self.chunks):
            submit(TransferJob(next(self.ids), job_keys, chunks, promotion, ctx))
        self.tier.drain_jobs()
        results = list(self.tier.get_finished_jobs())
        assert len(results) == JOBS and all(r.success for r in results), (
            f"{self.name}: a job failed: {results}"
        )

    def store(self) -> list[list]:
        keys = [fresh_keys(self.n) for _ in range(JOBS)]
        self._jobs(keys, promotion=False)
        return keys

    def load(self) -> None:
        self._jobs(self.stored, promotion=True)

    def cached_lookups(self, keys: list, req_id: str) -> Callable[[], None]:
        """Lookups of `keys` by one live request once their verdicts are cached."""
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.tiering.base import ScheduleEndContext

        ctx, tier = ReqContext(req_id=req_id), self.tier
        for _ in range(2000):
            answers = [tier.lookup(k, ctx) for k in keys]
            if LookupResult.RETRY not in answers:
                break
            tier.on_schedule_end(ScheduleEndContext((), ()))
            tier.drain_jobs()
            time.sleep(0.001)  # vLLM's probe thread is not drained by drain_jobs
        else:
            raise AssertionError(f"{self.name}: lookups never settled")
        lookup = tier.lookup

        def run() -> None:
            for _ in range(LOOKUP_PASSES):
                for k in keys:
                    lookup(k, ctx)

        return run


def fresh_keys(n: int) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(os.urandom(32), 0) for _ in range(n)]


def kvtier_side(root: str, n: int, size: int, tenant_key: str | None) -> Side:
    config: dict = {"store": {"backend": "file", "root": root, "timeout_s": 30.0}}
    if tenant_key is not None:
        config["namespace"] = {"tenant_key": tenant_key}
    mgr = manager(
        {
            "type": "KvtierTier",
            "module_path": "kvtier.integrations.vllm",
            "kvtier_config": config,
        },
        JOBS * n,
        size,
    )
    tier = mgr.secondary_tiers[0]

    def forget(keys: list) -> None:
        tier._loop.run(tier.store.delete(tier.store_keys(keys)))

    return Side("kvtier", mgr, n, forget)


def vllm_side(root: str, n: int, size: int) -> Side:
    mgr = manager({"type": "fs", "root_dir": root}, JOBS * n, size)
    mapper = mgr.secondary_tiers[0].file_mapper

    def forget(keys: list) -> None:
        for k in keys:
            os.remove(mapper.get_file_name(k))

    return Side("vllm", mgr, n, forget)


@dataclass(slots=True)
class Rounds:
    """Per-round times of each side, for each measure."""

    times: dict = field(default_factory=dict)  # (measure, side) -> [seconds]
    cpu: dict = field(default_factory=dict)  # (measure, side) -> [process seconds]

    def add(self, measure: str, side: str, wall: float, cpu: float) -> None:
        self.times.setdefault((measure, side), []).append(wall)
        self.cpu.setdefault((measure, side), []).append(cpu)

    def ratio(self, measure: str) -> float:
        """Median over rounds of vLLM's time over kvtier's (>1: kvtier faster)."""
        a, b = self.times[(measure, "kvtier")], self.times[(measure, "vllm")]
        return statistics.median(v / k for k, v in zip(a, b))

    def median(self, measure: str, side: str, cpu: bool = False) -> float:
        return statistics.median((self.cpu if cpu else self.times)[(measure, side)])


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def compare(n: int, size: int, rounds: int, base: str, tenant_key: str | None):
    """Both tiers on one shape; the per-round times."""
    tmp = tempfile.mkdtemp(prefix="kvtier-vllm-fs-", dir=base)
    sides = []
    try:
        sides = [
            kvtier_side(f"{tmp}/kvtier", n, size, tenant_key),
            vllm_side(f"{tmp}/vllm", n, size),
        ]
        lookups = {}
        for s in sides:
            hits = [k for keys in s.stored for k in keys]
            lookups[("lookup hit", s.name)] = s.cached_lookups(hits, "hits")
            lookups[("lookup miss", s.name)] = s.cached_lookups(
                fresh_keys(len(hits)), "misses"
            )
        out = Rounds()
        for r in range(rounds + 1):  # round 0 warms up, untimed
            order = sides if r % 2 == 0 else sides[::-1]
            for measure in ("store", "load", "lookup hit", "lookup miss"):
                for s in order:
                    if measure == "store":
                        keys: list = []
                        wall, cpu = _timed(
                            lambda s=s, keys=keys: keys.extend(s.store())
                        )
                        s.forget([k for ks in keys for k in ks])
                    elif measure == "load":
                        wall, cpu = _timed(s.load)
                    else:
                        wall, cpu = _timed(lookups[(measure, s.name)])
                    if r:
                        out.add(measure, s.name, wall, cpu)
        return out
    finally:
        for s in sides:
            s.mgr.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def report(rows: Rounds, n: int, size: int, label: str) -> str:
    gb = JOBS * n * size / 1e9
    keys = JOBS * n * LOOKUP_PASSES
    parts = []
    for m in ("store", "load"):
        k, v = (rows.median(m, s) for s in ("kvtier", "vllm"))
        kc, vc = (rows.median(m, s, cpu=True) for s in ("kvtier", "vllm"))
        parts.append(
            f"{m} {gb / k:5.2f} vs {gb / v:5.2f} GB/s ({rows.ratio(m):.2f}x, "
            f"CPU/GB {kc / vc:.2f}x)"
        )
    for m in ("lookup hit", "lookup miss"):
        k, v = (rows.median(m, s) * 1e9 / keys for s in ("kvtier", "vllm"))
        parts.append(f"{m} {k:4.0f} vs {v:4.0f} ns/key ({1 / rows.ratio(m):.2f}x)")
    return f"{label} {n:3d} x {human_size(size)}: " + " | ".join(parts)


def run(rounds: int = ROUNDS, base: str = "/dev/shm") -> list[str]:
    """Every shape, plain frames and with a tenant key; the summary lines."""
    print(
        f"kvtier / vLLM fs tier, {JOBS} jobs in flight, {rounds} alternating rounds, "
        f"medians of same-round ratios, files under {base}; load: {os.getloadavg()}"
    )
    summary = []
    for label, key in (("plain ", None), ("tenant", os.urandom(32).hex())):
        for n, size in SHAPES:
            rows = compare(n, size, rounds, base, key)
            print(report(rows, n, size, label), flush=True)
            lookup = max(1 / rows.ratio("lookup hit"), 1 / rows.ratio("lookup miss"))
            summary.append(
                f"vllm tier: store {rows.ratio('store'):.2f}x, load "
                f"{rows.ratio('load'):.2f}x vLLM fs tier, lookup {lookup:.2f}x "
                f"(rows {n} x {human_size(size)}{', tenant key' if key else ''})"
            )
    for line in summary:
        print(line)
    return summary
