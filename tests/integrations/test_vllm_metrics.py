"""kvtier inside a running vLLM: the tier's start-up line, its counters through vLLM's
stats hooks (`get_stats` under the real TieringOffloadingManager, the metric definitions
vLLM's frontend builds its Prometheus metrics from) and its config info series."""

from __future__ import annotations

import logging

import kvtier
from kvtier.integrations.vllm.metrics import INFO_KEYS, PREFIX
from tests.integrations.test_vllm_tier import conf, new_keys, rigs, vllm  # noqa: F401


def test_the_tier_logs_one_start_line_and_reports_through_vllms_stats_hooks(
    tmp_path,
    rigs,  # noqa: F811
    caplog,
):
    """`get_stats` was not implemented: the tier's counters never reached vLLM's
    /metrics, and the start-up line named neither kvtier's version nor the tenant key."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    caplog.set_level(logging.INFO, logger="kvtier.integrations.vllm.tier")
    rig = rigs(conf({"backend": "file", "root": str(tmp_path / "l3")}))
    ns = rig.tier.namespace.id
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("kvtier ")
    ]
    assert lines == [
        f"kvtier {kvtier.__version__} vLLM secondary tier: store file (kvtier), namespace "
        f"{ns}, tenant key none, tiers vLLM GPU -> vLLM CPU primary -> kvtier store file "
        "(tiny-llama, 4096 B/row)"
    ]
    defs = TieringOffloadingSpec.build_metric_definitions(rig.spec.extra_config)
    rig.store(new_keys(4))
    stats = rig.mgr.get_stats()  # the manager's hook: the primary's, then each tier's
    types, values = stats.metric_sections()
    ours = {k: v for k, v in values.items() if k.startswith(PREFIX)}
    assert set(ours) <= set(defs)  # vLLM's frontend asserts each name was defined
    assert ours[PREFIX + "store_ok"] == {(): 4}
    assert ours[PREFIX + "store_keys"] == {(): 4}
    assert ours[PREFIX + "sets"] == {(): 4}
    assert ours[PREFIX + "store_down"] == {(): 0.0}
    assert (
        types[PREFIX + "store_ok"] == "counter"
        and types[PREFIX + "store_down"] == "gauge"
    )
    again = rig.mgr.get_stats()  # counters are what grew since the last call
    _, values = again.metric_sections()
    assert PREFIX + "store_ok" not in values and values[PREFIX + "store_down"] == {
        (): 0.0
    }
    assert set(INFO_KEYS) <= set(
        TieringOffloadingSpec.config_info_keys(rig.spec.extra_config)
    )
    info = [i for i in rig.mgr.config_info() if i.get("kvtier_namespace") == ns]
    assert len(info) == 1 and info[0]["kvtier_version"] == kvtier.__version__
    assert info[0]["kvtier_store"] == "file" and info[0]["kvtier_tenant_key"] == "none"
