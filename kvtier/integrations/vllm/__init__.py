"""kvtier as a vLLM secondary offloading tier (docs/vllm.md).

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592, "block_size": 16,
        "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
                             "kvtier_config": "/etc/kvtier/vllm.yaml"}]}}'

vLLM keeps its GPU blocks and its CPU primary tier; kvtier supplies the store below it
(file, redis, s3 or a plugin, from the YAML's `store:` section), its page frames and
checksums, its namespaces and its breaker. Pinned to vLLM 0.33.0, whose tiering API
changes from release to release.

vLLM is imported only when `KvtierTier` is first looked up: this package imports without
vLLM installed.
"""

from __future__ import annotations

VLLM_VERSION = "0.33.0"
INSTALL_HINT = f"pip install --no-deps vllm=={VLLM_VERSION}"


def _tier_class() -> type:
    try:
        from kvtier.integrations.vllm.tier import KvtierTier
    except ImportError as exc:
        raise ImportError(
            f"kvtier.integrations.vllm.KvtierTier subclasses vLLM's SecondaryTierManager, which could "
            f"not be imported ({type(exc).__name__}: {exc}); run it inside a vLLM {VLLM_VERSION} "
            f"install, or for tests: {INSTALL_HINT} (docs/vllm.md lists its pure-Python "
            "imports)"
        ) from exc
    return KvtierTier


def __getattr__(name: str):
    if name == "KvtierTier":
        return _tier_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
