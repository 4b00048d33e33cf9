"""The vLLM tier's numbers through vLLM 0.33.0's own stats hooks (SecondaryTierManager's
`build_metric_definitions`, `get_stats`, `config_info_keys`, `config_info`): vLLM's
frontend turns them into Prometheus metrics on its `/metrics`, beside its own
`vllm:kv_offload_*`, and logs them with its other connector stats.

Names are `vllm:kv_offload_kvtier_<name>` (vLLM's prefix, docs/vllm.md lists them); the
config info labels name kvtier's version, store, namespace and tenant key id on vLLM's
`vllm:kv_offload_config_info` series for this tier.
"""

from __future__ import annotations

from typing_extensions import override

from dataclasses import fields
from typing import Any

import kvtier
from kvtier.backends.base import StoreCounters

PREFIX = "vllm:kv_offload_kvtier_"
# Every number `kvtier_stats()` reports that vLLM is told of: vLLM's frontend refuses a
# name it was not given at start, so the list is fixed; a number not on it is left out.
COUNTERS = (
    ("store_jobs", "cascade jobs submitted to the store"),
    ("store_keys", "rows in cascade jobs"),
    ("store_ok", "rows the store took"),
    ("load_jobs", "promotion jobs submitted"),
    ("load_keys", "rows in promotion jobs"),
    ("load_ok", "rows promoted, each verified"),
    ("probes", "batch_exists probes of unknown keys"),
    ("probe_keys", "keys probed"),
    ("lookup_hits", "lookups answered HIT"),
    ("lookup_misses", "lookups answered MISS"),
    ("lookup_retries", "lookups answered RETRY (probe queued)"),
    ("breaker_trips", "times the breaker took the store down"),
    ("calls_skipped_store_down", "store calls skipped while the store was down"),
    *((f.name, f"store {f.name.replace('_', ' ')}") for f in fields(StoreCounters)),
)
GAUGES = (
    ("store_down", "1 while the breaker has the store down"),
    ("index_present", "keys the lookup index knows stored"),
    ("index_verdicts", "probe verdicts the lookup index holds"),
    ("probes_in_flight", "probes on the store thread"),
)
INFO_KEYS = ("kvtier_version", "kvtier_store", "kvtier_namespace", "kvtier_tenant_key")


class TierMetrics:
    """SecondaryTierManager's stats hooks for a tier with `kvtier_stats()`, `store`,
    `namespace` and `tenant`. `get_stats` hands vLLM what grew since its last call
    (counters) and the current gauges; vLLM calls it under its manager lock."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict:
        from vllm.v1.kv_offload.base import (
            OffloadingCounterMetadata,
            OffloadingGaugeMetadata,
        )

        defs: dict = {
            PREFIX + name: OffloadingCounterMetadata(documentation=f"kvtier: {doc}")
            for name, doc in COUNTERS
        }
        for name, doc in GAUGES:
            defs[PREFIX + name] = OffloadingGaugeMetadata(
                documentation=f"kvtier: {doc}"
            )
        return defs

    @override
    def get_stats(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        now = self.kvtier_stats()
        last = getattr(self, "_reported", None) or {}
        stats = OffloadingConnectorStats()
        for name, _ in COUNTERS:
            value = now.get(name)
            if isinstance(value, (int, float)):
                grown = value - last.get(name, 0)
                if grown > 0:
                    stats.increase_counter(PREFIX + name, grown)
        for name, _ in GAUGES:
            value = now.get(name)
            if isinstance(value, (int, float)):
                stats.set_gauge(PREFIX + name, float(value))
        self._reported = now
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return INFO_KEYS

    @override
    def config_info(self) -> dict:
        return dict(
            zip(
                INFO_KEYS,
                (
                    kvtier.__version__,
                    self.store.name,
                    self.namespace.id,
                    self.tenant.key_id or "none",
                ),
            )
        )
