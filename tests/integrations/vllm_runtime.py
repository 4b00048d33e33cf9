"""vLLM 0.33.0's real offloading classes on a CPU-only machine, for the tier tests.

`pip install --no-deps vllm==0.33.0` plus the pure-Python imports `.ci/run` lists gives
the scheduler side (no vllm._C, no GPU worker). `Rig` builds what vLLM builds from
`--kv-transfer-config`: a real `TieringOffloadingSpec` from an `OffloadingConfig`, whose
`get_manager()` makes the shared primary region in /dev/shm, the CPU primary tier and the
secondary tiers through `SecondaryTierFactory` by module path.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import uuid
from importlib.metadata import version

import numpy as np
import pytest

from kvtier.integrations.vllm import INSTALL_HINT, VLLM_VERSION
from tests.servers import IN_CI


def need_vllm():
    """Skip (outside CI) or fail (in CI) without vLLM 0.33.0."""
    problem = None
    if importlib.util.find_spec("vllm") is None:
        problem = (
            f"vLLM is not installed: {INSTALL_HINT} (and the imports .ci/run lists)"
        )
    elif version("vllm") != VLLM_VERSION:
        problem = f"these tests pin vLLM {VLLM_VERSION}; found {version('vllm')}"
    else:
        try:
            import vllm.v1.kv_offload.tiering.spec  # noqa: F401
        except ImportError as exc:
            problem = f"vLLM's tiering modules do not import ({exc}); .ci/run lists what they need"
    if problem:
        if IN_CI:
            pytest.fail(f"{problem}; .ci/run must install it")
        pytest.skip(problem)


def shm_segments(engine_id: str) -> list[str]:
    return glob.glob(f"/dev/shm/vllm_offload_{engine_id}*")


class Rig:
    """A real TieringOffloadingManager with KvtierTier as its one secondary tier."""

    def __init__(
        self,
        kvtier_config,
        chunks: int = 8,
        row_bytes: int = 4096,
        events: bool = True,
        **tier_keys,
    ) -> None:
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self.engine_id = f"kvtiertest{uuid.uuid4().hex[:12]}"
        tier = {
            "type": "KvtierTier",
            "module_path": "kvtier.integrations.vllm",
            "kvtier_config": kvtier_config,
            **tier_keys,
        }
        config = OffloadingConfig(
            groups=(
                OffloadingGroupConfig(
                    tokens_per_block=16,
                    layer_names=("model.layers.0.self_attn.attn",),
                    group_id=0,
                ),
            ),
            worker_kv_bytes_per_block=row_bytes,
            enable_kv_cache_events=events,
            extra_config={
                "cpu_bytes_to_use": chunks * row_bytes,
                "block_size": 16,
                "secondary_tiers": [tier],
            },
            engine_id=self.engine_id,
            model=OffloadingModelConfig(name="tiny-llama", dtype="float16"),
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
        self.spec = TieringOffloadingSpec(config)
        self.mgr = self.spec.get_manager()
        self.tier = self.mgr.secondary_tiers[0]
        self.rows = np.asarray(
            self.mgr.primary_tier.get_kv_memoryview()
        )  # (chunks, row bytes), zero-copy
        self.events: list = []  # taken by the last `store`, and by the `load`s since

    def step(self) -> list:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.mgr.on_schedule_end(
            ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        )
        return list(self.mgr.take_events())

    def settle(self) -> list:
        """Step until the tier has nothing in flight; the events taken meanwhile."""
        events = []
        for _ in range(100):
            self.tier.drain_jobs()
            events += self.step()
            if not self.mgr.has_pending_work():
                return events
        raise AssertionError("the tier still has work after 100 steps")

    def store(self, keys, req_id: str = "writer") -> dict:
        """What vLLM's store path does: primary rows written (by the GPU worker, here by
        hand), complete_store cascades them to the tier. Returns key -> the row's bytes."""
        from vllm.v1.kv_offload.base import ReqContext

        ctx = ReqContext(req_id=req_id)
        self.mgr.on_new_request(ctx)
        out = self.mgr.prepare_store(keys, ctx)
        written = {}
        for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[cid][:] = np.frombuffer(
                os.urandom(self.rows.shape[1]), dtype=np.uint8
            )
            written[key] = self.rows[cid].tobytes()
        self.mgr.complete_store(keys, ctx, success=True)
        self.events = self.settle()
        self.mgr.on_request_finished(ctx)
        self.events += self.settle()
        return written

    def load(self, keys, req_id: str = "reader"):
        """Look `keys` up as vLLM's scheduler does, stepping until every answer settles;
        returns (the answers seen in order per key, the primary rows' bytes of the HITs).
        The events taken meanwhile are added to `events`."""
        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        ctx = ReqContext(req_id=req_id)
        self.mgr.on_new_request(ctx)
        seen = {k: [] for k in keys}
        for _ in range(50):
            answers = [self.mgr.lookup(k, ctx) for k in keys]
            for k, a in zip(keys, answers):
                if not seen[k] or seen[k][-1] is not a:
                    seen[k].append(a)
            if all(a in (LookupResult.HIT, LookupResult.MISS) for a in answers):
                break
            self.events += self.step()
            self.tier.drain_jobs()
        hits = [k for k in keys if seen[k][-1] is LookupResult.HIT]
        got = {}
        if hits:
            spec = self.mgr.prepare_load(hits, ctx)
            got = {k: self.rows[c].tobytes() for k, c in zip(hits, spec.chunk_ids)}
            self.mgr.complete_load(hits, ctx)
        self.mgr.on_request_finished(ctx)
        self.events += self.settle()
        return seen, got

    def close(self) -> None:
        """Shut the manager down (its primary tier removes the region); whatever a failed
        shutdown left in /dev/shm goes too."""
        self.rows = None  # its view of the region: vLLM unmaps it once none is held
        try:
            self.mgr.shutdown()
        finally:
            for path in shm_segments(self.engine_id):
                os.unlink(path)
