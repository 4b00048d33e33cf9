"""What names a vLLM chunk in kvtier's store: the namespace of the primary tier's rows and
the page hash of an `OffloadKey` (docs/vllm.md). Reads vLLM's `OffloadingConfig` by its
field names only: this module imports without vLLM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import KvtierConfig, load_config
from kvtier.errors import KvtierConfigError
from kvtier.hashing import KeyedHash, Recent
from kvtier.integrations.stack import Geometry, check_config

# the tier's own keys in vLLM's `secondary_tiers` entry; vLLM pops type, module_path, backpressure
TIER_KEYS = ("kvtier_config", "tenant", "enable_kv_events", "locality", "index_keys")
LOCALITIES = ("LOCAL", "REMOTE")


@dataclass(slots=True, frozen=True)
class TierSettings:
    config: KvtierConfig
    tenant: str | None = None
    enable_kv_events: bool = True
    locality: str | None = None
    index_keys: int = 1 << 20


def tier_settings(tier_type: str, given: Mapping[str, Any]) -> TierSettings:
    """The `secondary_tiers` entry's keys, checked; every error names the key and value."""
    where = f"secondary tier {tier_type!r}"
    unknown = sorted(set(given) - set(TIER_KEYS))
    if unknown:
        raise KvtierConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(TIER_KEYS)}"
        )
    source = given.get("kvtier_config")
    if isinstance(source, str) and source:
        config = load_config(source)
    elif isinstance(source, Mapping):
        config = load_config(None, overrides=source)
    else:
        raise KvtierConfigError(
            f"{where}: kvtier_config={source!r}: give the path of a kvtier YAML, or its "
            "sections as a mapping, with a store: section (docs/vllm.md)"
        )
    check_config(config, where)
    tenant = given.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise KvtierConfigError(
            f"{where}: tenant={tenant!r}: expected a non-empty string (the tenant salt)"
        )
    events = given.get("enable_kv_events", True)
    if not isinstance(events, bool):
        raise KvtierConfigError(
            f"{where}: enable_kv_events={events!r}: expected true or false"
        )
    locality = given.get("locality")
    if locality is not None and locality not in LOCALITIES:
        raise KvtierConfigError(
            f"{where}: locality={locality!r}: allowed values are {', '.join(LOCALITIES)}"
        )
    index_keys = given.get("index_keys", 1 << 20)
    if (
        isinstance(index_keys, bool)
        or not isinstance(index_keys, int)
        or index_keys < 1
    ):
        raise KvtierConfigError(
            f"{where}: index_keys={index_keys!r}: expected an integer >= 1"
        )
    return TierSettings(config, tenant, events, locality, index_keys)


def vllm_geometry(offloading: Any, row_bytes: int, settings: TierSettings) -> Geometry:
    """Everything that changes a primary-tier row's bytes: vLLM's model and KV dtype, the
    row's size and make-up (blocks per chunk, tokens per block of each KV group, KV layout),
    and the workers whose copies it concatenates (TP/PP/CP sizes and the rank), unless
    vLLM says the row is the same under any topology; the tenant salt and the tenant key's
    id keep tenants apart."""
    c = offloading.config
    groups = ",".join(str(g.tokens_per_block) for g in c.groups)
    layout = (
        f"vllm-tier:row={row_bytes}:blocks_per_chunk={c.cache.blocks_per_chunk}"
        f":tokens_per_hash={c.cache.tokens_per_hash}:groups={groups}:kv_layout={c.kv_cache_layout}"
        f":canonical={int(bool(c.canonical_layout))}"
    )
    p = c.parallel
    rank, size = 0, 1
    if not p.is_parallelism_agnostic:
        layout += (
            f":world={p.world_size}:tp={p.tp_size}:pp={p.pp_size}:pcp={p.pcp_size}:dcp={p.dcp_size}"
            f":replicated={int(bool(c.replicated_layout))}"
        )
        rank, size = p.rank, max(1, p.world_size)
    page_size = max(
        1,
        max((g.tokens_per_block for g in c.groups), default=1)
        * c.cache.blocks_per_chunk,
    )
    return Geometry(
        c.model.dtype,
        layout,
        page_size,
        rank,
        size,
        model_id=c.model.name or None,
        tenant_salt=settings.tenant,
    )


def page_hash_of(key: bytes, keyed: KeyedHash | None = None) -> bytes:
    """kvtier's page hash for a vLLM `OffloadKey` (block hash + 4-byte big-endian KV group):
    a 16- or 32-byte block hash of group 0 as it is, any other through a tagged sha256; with
    a tenant's `keyed` hash, every key through it (a key listing then tells nothing of
    vLLM's block hashes, which anyone can compute from the tokens)."""
    if not isinstance(key, bytes) or len(key) < 5:
        raise ValueError(
            f"key={key!r}: expected vLLM's OffloadKey (block hash bytes + 4-byte group index)"
        )
    if keyed is not None:
        return keyed(b"kvtier/vllm-key\x00" + key).digest()
    block, group = key[:-4], key[-4:]
    if group == b"\0\0\0\0" and len(block) in (16, 32):
        return block
    return hashlib.sha256(b"kvtier/vllm-key\x00" + key).digest()


class StoreKeys:
    """vLLM's keys -> their store keys (`page_hash_of`, then the namespace's `key`), the
    recent ones remembered (`Recent`: bounded, any thread may call it): vLLM stores and
    loads a block's key again and again, and each one made afresh is a hash, a hex string
    and a parse to check it (~0.6 us a key, most of a job's cost on vLLM's thread). One
    tier's keys all go through one namespace and one tenant's keyed hash, so an
    `OffloadKey` names one store key for the tier's lifetime."""

    __slots__ = ("_make", "_keyed", "_known")

    def __init__(
        self, key: Callable[[bytes], str], keyed: KeyedHash | None, bound: int = 1 << 15
    ) -> None:
        self._make, self._keyed, self._known = key, keyed, Recent(bound)

    def __call__(self, keys: Iterable[bytes]) -> list[str]:
        return self._known.each(keys, self._new, "vLLM's OffloadKeys")

    def _new(self, key: bytes) -> str:
        return self._known.keep(key, self._make(page_hash_of(key, self._keyed)))
