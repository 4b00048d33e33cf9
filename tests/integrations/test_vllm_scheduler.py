"""vLLM 0.33.0's real v1 Scheduler on DeviceConfig("cpu") (a weightless config.json, no
tokenizer) with the OffloadingConnector, TieringOffloadingSpec and KvtierTier configured the
way `--kv-transfer-config` configures it: the request waits one step while the tier probes
the store (RETRY: lookup does not wait on it), then is scheduled."""

from __future__ import annotations

import os
import uuid

from tests.integrations import vllm_runtime as rt

MODEL_DIR = os.path.join(os.path.dirname(__file__), "tiny_llama")


def make_scheduler(engine_id: str, tier: dict):
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(
        model=MODEL_DIR,
        tokenizer=MODEL_DIR,
        skip_tokenizer_init=True,
        dtype="float16",
        seed=0,
        max_model_len=2048,
    )
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1 << 22,
        "block_size": 16,
        "secondary_tiers": [tier],
    }
    vc = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=2048,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        cache_config=CacheConfig(
            block_size=16,
            gpu_memory_utilization=0.9,
            cache_dtype="auto",
            enable_prefix_caching=True,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            engine_id=engine_id,
        ),
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = 64
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    kv = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layers,
                FullAttentionSpec(
                    block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16
                ),
            )
        ],
    )
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kv,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=16,
    )


def test_the_v1_scheduler_schedules_a_request_through_kvtier_tier(tmp_path):
    rt.need_vllm()
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvtier.integrations.vllm import KvtierTier

    engine_id = f"kvtiersched{uuid.uuid4().hex[:12]}"
    tier_config = {
        "type": "KvtierTier",
        "module_path": "kvtier.integrations.vllm",
        "kvtier_config": {"store": {"backend": "file", "root": str(tmp_path / "l3")}},
    }
    sched = make_scheduler(engine_id, tier_config)
    try:
        assert type(sched.connector).__name__ == "OffloadingConnector"
        [tier] = sched.connector.connector_scheduler.manager.secondary_tiers
        assert isinstance(tier, KvtierTier) and tier.store.name == "file"
        assert tier.namespace.dtype == "float16" and tier.namespace.page_size == 16
        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=4)
        sp.update_from_generation_config({}, 2)
        req = Request(
            request_id="r1",
            prompt_token_ids=list(range(100, 164)),
            sampling_params=sp,
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(16, sha256),
        )
        sched.add_request(req)
        first = (
            sched.schedule()
        )  # the tier knows none of its 4 chunks: RETRY, one probe goes out
        assert first.num_scheduled_tokens == {}
        assert (
            tier.index.stats()["probes"] == 1 and tier.index.stats()["probe_keys"] == 4
        )
        tier.drain_jobs()  # the probe answers: the store is empty
        second = sched.schedule()
        assert second.num_scheduled_tokens == {"r1": 64}
        assert (
            type(second.kv_connector_metadata).__name__ == "OffloadingConnectorMetadata"
        )
        assert tier.index.stats()["lookup_misses"] >= 1
    finally:
        sched.shutdown()
        for path in rt.shm_segments(engine_id):
            os.unlink(path)
            raise AssertionError(f"{path} outlived the scheduler")
    assert rt.shm_segments(engine_id) == []
