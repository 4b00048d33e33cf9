"""kvtier as SGLang's HiCache L3 storage backend (docs/sglang.md).

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierStorage",
        "kvtier_config": "/etc/kvtier/sglang.yaml", "interface_v1": 1}'

SGLang keeps its own radix tree, device pool and host pool; kvtier supplies the store
(file, redis, redis cluster, s3 or a plugin, from the YAML's `store:` section), its page
frames and checksums, and its breaker. A page whose frame does not verify is `False` for
its key, and its bytes never reach SGLang's host pool as a hit.

SGLang's page hashes (64 hex digits) become the hash part of kvtier's key; the namespace
part names what SGLang's keys leave out: model, KV dtype, the host layout (the flat page's
byte order depends on it), page size, geometry, TP rank/size (MLA: replicated, one
namespace for all ranks), PP/CP/DCP shard, tenant salt, weights revision and tenant key id.
With a tenant key (`namespace.tenant_key`, docs/security.md), SGLang's page hashes go
through the tenant's keyed hash before they become keys, and every page is sealed.

A hybrid model's other host pools (SWA, Mamba, sidecars) go through SGLang's v2 calls
(`batch_exists_v2 / batch_get_v2 / batch_set_v2`), each pool in a namespace of its own that
also names every pool's geometry and the sliding window; a trailing window (SWA, a Mamba
state) is read all or nothing.

SGLang is imported only when `KvtierStorage` is first looked up: this module imports
without SGLang installed. Every store call runs on one private event-loop thread; SGLang's
prefetch and backup threads block on it the way they block on their own backends' I/O,
never longer than the store's timeout (plus, after a timeout, until the store has stopped
touching the call's buffers).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Sequence

import torch
from typing_extensions import override

from kvtier.backends.base import Store
from kvtier.config import KvtierConfig, load_config
from kvtier.errors import KvtierConfigError, StoreError
from kvtier.hashing import Namespace, key_maker, make_key
from kvtier.integrations.sglang import INSTALL_HINT
from kvtier.integrations.sglang.keys import page_hash_of
from kvtier.integrations.observe import flat_series, sglang_export, startup_line
from kvtier.integrations.stack import Geometry, Stack, build_stack, check_config
from kvtier.integrations.tenant import StoreTenant
from kvtier.storeio.breaker import Breaker
from kvtier.storeio.call import guarded, read_staged

log = logging.getLogger(__name__)


# extra_config keys this adapter reads; SGLang's own keys pass through untouched
EXTRA_KEYS = ("kvtier_config", "kv_cache_dtype", "sliding_window_size")
WHO = "SGLang's storage backend"


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"expected a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}"
        )
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def geometry_of(storage_config, pool, kv_cache_dtype: str | None = None) -> Geometry:
    """What changes the bytes of a page of SGLang's host pool: KV dtype, the host layout
    (the flat page's byte order depends on it), page size, geometry, TP rank/size (MLA:
    replicated, one namespace for all ranks), PP/CP/DCP shard, the DP rank."""
    sc = storage_config
    dtype = str(pool.dtype).removeprefix("torch.")
    if kv_cache_dtype:
        dtype = f"{dtype}/{kv_cache_dtype}"
    shard = f"pp={sc.pp_rank}/{sc.pp_size}:cp={sc.attn_cp_rank}/{sc.attn_cp_size}"
    if sc.is_mla_model:
        layout = (
            f"sglang-mla:layers={pool.layer_num}:dim={pool.kv_cache_dim}:lora={pool.kv_lora_rank}"
            f":rope={pool.qk_rope_head_dim}:host={pool.layout}:{shard}"
        )
        if sc.dcp_size > 1:
            layout += f":dcp={sc.dcp_rank}/{sc.dcp_size}:lps={sc.logical_page_size}:tp={sc.tp_size}"
        rank, size = (
            0,
            1,
        )  # MLA KV is the same on every TP rank: one namespace, one writer
    else:
        layout = (
            f"sglang-mha:layers={pool.layer_num}:heads={pool.head_num}:head_dim={pool.head_dim}"
            f":v={getattr(pool, 'v_head_dim', pool.head_dim)}:host={pool.layout}:{shard}"
        )
        if sc.dp_rank:
            layout += f":dp={sc.dp_rank}"
        rank, size = sc.tp_rank, sc.tp_size
    return Geometry(dtype, layout, pool.page_size, rank, size, sc.model_name or None)


@dataclass(frozen=True)
class _V2Pool:
    """One host pool the v2 calls read and write: SGLang's pool, kvtier's namespace for
    it, the bytes of one key's page and its flat dtype, host slots per key."""

    name: str
    host: Any
    namespace: Namespace
    page_bytes: int
    flat_dtype: torch.dtype
    slots: int


# what a host pool's page bytes depend on, where the pool has it
_GEOMETRY = (
    "layer_num",
    "head_num",
    "head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "kv_cache_dim",
    "num_mamba_layers",
    "temporal_state_shape",
    "temporal_dtype",
    "conv_state_shapes",
    "conv_dtype",
    "size_per_token",
    "page_size",
    "layout",
)


def _fmt(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    if isinstance(value, torch.Size):
        return "x".join(str(int(d)) for d in value)
    return str(value)


def _pool_dtype(host) -> str:
    dtypes = [getattr(host, a, None) for a in ("dtype", "temporal_dtype", "conv_dtype")]
    return "/".join(dict.fromkeys(_fmt(d) for d in dtypes if d is not None))


def _pool_geometry(host) -> str:
    """The host pool's class and every geometry field it has: layers, heads, head dims,
    Mamba state shapes and dtypes, bytes per slot, page size and host layout."""
    parts = [type(host).__name__, f"dtype={_pool_dtype(host)}"]
    for name in _GEOMETRY:
        value = getattr(host, name, None)
        if value is not None:
            parts.append(f"{name}={_fmt(value)}")
    return ",".join(parts)


def _hybrid_signature(pools: dict[str, Any], window: int | None) -> str:
    """Every registered host pool's name and geometry, and the sliding window: what a
    hybrid model's pages depend on beyond one pool's own shape."""
    sig = ";".join(f"{n}[{_pool_geometry(pools[n])}]" for n in sorted(pools))
    return sig + (f";window={window}" if window is not None else "")


def _v2_policy(t) -> str:
    """A transfer's hit policy, refused unless kvtier serves it."""
    policy = getattr(t.hit_policy, "value", t.hit_policy)
    if policy not in ("all_pages", "trailing_pages"):
        raise ValueError(
            f"pool {str(t.name)!r}: hit_policy={policy!r}: kvtier serves "
            "'all_pages' and 'trailing_pages' (SGLang 0.5.23's HiCache sends no other)"
        )
    return policy


class KvtierStorageBase:
    """The backend proper; `KvtierStorage` adds SGLang's `HiCacheStorage` as a base."""

    def __init__(self, storage_config, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        path = extra.get("kvtier_config")
        if not path or not isinstance(path, str):
            raise KvtierConfigError(
                f"extra_config.kvtier_config={path!r}: give the path of a kvtier YAML with a store: section "
                "(docs/sglang.md)"
            )
        kv_cache_dtype = extra.get("kv_cache_dtype")
        if kv_cache_dtype is not None and (
            not isinstance(kv_cache_dtype, str) or not kv_cache_dtype
        ):
            raise KvtierConfigError(
                f"extra_config.kv_cache_dtype={kv_cache_dtype!r}: expected SGLang's "
                "--kv-cache-dtype value, e.g. 'fp8_e4m3'"
            )
        config: KvtierConfig = load_config(path)
        # refused now: the store itself waits for the host pool (register_mem_pool_host)
        check_config(config, WHO)
        self.kvtier_config = config
        self.storage_config = storage_config
        self.kv_cache_dtype = kv_cache_dtype
        self.key_prefix = config.store.key_prefix
        # built by register_mem_pool_host (the namespace needs the pool's geometry)
        self.stack: Stack | None = None
        self.store: Store | None = None
        self.breaker: Breaker | None = None
        self.tenant = StoreTenant()
        self.mem_pool_host = None
        self.namespace: Namespace | None = None
        self.page_bytes = 0
        self._manifest_written = False
        self._closed = False
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []
        self.counters = {"get_pages": 0, "get_ok": 0, "set_pages": 0, "set_ok": 0}
        # kvtier's counters in SGLang's /metrics (integrations/observe.py)
        self._export = None

    # -- SGLang's registration -------------------------------------------------------------

    @override
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Name the namespace from the host pool SGLang reads and writes through, and
        build the store (once: SGLang registers one pool per backend)."""
        if self._closed:  # close() already ran: a store built now would never be closed
            raise RuntimeError("kvtier SGLang backend: closed")
        if self.stack is not None:
            raise RuntimeError(
                "kvtier SGLang backend: register_mem_pool_host() called twice"
            )
        stack = build_stack(
            config=self.kvtier_config,
            geometry=geometry_of(
                self.storage_config, mem_pool_host, self.kv_cache_dtype
            ),
            who=WHO,
            thread="kvtier-sglang-store",
        )
        self.stack, self.mem_pool_host = stack, mem_pool_host
        self.store, self.breaker, self._loop = stack.store, stack.breaker, stack.loop
        self.tenant, self.namespace = stack.tenant, stack.namespace
        self._kv_key = (
            stack.key
        )  # re-made if a hybrid model's pools rename the namespace
        dummy = mem_pool_host.get_dummy_flat_data_page()
        self.page_bytes = dummy.numel() * dummy.element_size()
        ns = self.namespace
        log.info(
            startup_line(
                "SGLang storage backend",
                self.kvtier_config,
                ns.id,
                self.tenant.key_id,
                f"SGLang device -> SGLang host ({ns.dtype}, {ns.page_size} tokens and "
                f"{self.page_bytes} B/page) -> kvtier store {self.store.name}",
            )
        )
        self._export = sglang_export(
            lambda: flat_series("kvtier_storage", self.kvtier_stats()),
            {  # DP attention: tp_rank is group-local, and MLA is one namespace for all
                "tp_rank": str(self.storage_config.tp_rank),
                "dp_rank": str(getattr(self.storage_config, "dp_rank", 0) or 0),
                "namespace": ns.id,
            },
        )

    @override
    def on_host_pools_registered(self) -> None:
        """SGLang registered every host pool (the anchor, then each pool by name). A
        hybrid model's pools (SWA, Mamba, sidecars) are served through the v2 calls;
        the namespace of each, the KV pool's included, then names every pool's geometry
        and the sliding window (`_hybrid_signature`), so two models that differ in any
        of them never share a page."""
        pools = self._registered()
        side = sorted(n for n in pools if n != "kv")
        if not side:
            return
        if self.namespace is None:
            raise RuntimeError(
                "kvtier SGLang backend: register_mem_pool_host() must come before the "
                "host pools"
            )
        self._hybrid = _hybrid_signature(pools, self._sliding_window(side))
        self._v2_pools: dict[str, _V2Pool] = {}
        kv = self.namespace
        self.namespace = replace(kv, layout=f"{kv.layout}:hybrid={self._hybrid}")
        self._kv_key = key_maker(self.key_prefix, self.namespace.id)
        if self._export is not None:  # no I/O yet, so no series: they get this label
            self._export.labels["namespace"] = self.namespace.id
        log.info(
            "kvtier SGLang backend: serving host pools %s through the v2 calls; "
            "KV namespace %s, %s",
            ", ".join(side),
            self.namespace.id,
            ", ".join(f"{n} {self._v2_pool(n).namespace.id}" for n in side),
        )

    def _keys(self, keys: Sequence[str]) -> list[str]:
        if self._closed:  # its loop is gone: a call would wait on it forever
            raise RuntimeError("kvtier SGLang backend: closed")
        if self.namespace is None:
            raise RuntimeError(
                "kvtier SGLang backend: register_mem_pool_host() must come before any I/O"
            )
        if isinstance(keys, str):
            raise ValueError(
                "keys: expected a list of SGLang page hashes, got one string"
            )
        key, keyed = self._kv_key, self.stack.keyed
        return [key(page_hash_of(k, keyed)) for k in keys]

    # -- store calls -----------------------------------------------------------------------

    def _exists(self, keys: Sequence[str]) -> int:
        full = self._keys(keys)
        if not full:
            return 0
        return self._loop.run(
            guarded(self.breaker, lambda: self.store.batch_exists(full), 0)
        )

    def _read(self, keys: Sequence[str], views: list[memoryview]) -> list[bool]:
        full = self._keys(keys)
        if not full:
            return []
        start = time.perf_counter()
        ok = self._loop.run(read_staged(self.breaker, self.store, full, views)) or [
            False
        ] * len(full)
        self._record(
            "get", self._prefetch_pgs, self._prefetch_bw, len(full), sum(ok), start
        )
        return list(ok)

    def _write(self, keys: Sequence[str], pages: list[memoryview]) -> list[bool]:
        full = self._keys(keys)
        if not full:
            return []
        for k, p in zip(keys, pages):
            if len(p) != self.page_bytes:
                raise ValueError(
                    f"page for key {k!r} is {len(p)} bytes; this pool's pages are {self.page_bytes}"
                )
        start = time.perf_counter()
        ok = self._loop.run(
            guarded(self.breaker, lambda: self._set(full, pages), [False] * len(full))
        )
        self._record(
            "set", self._backup_pgs, self._backup_bw, len(full), sum(ok), start
        )
        return list(ok)

    async def _set(self, full: list[str], pages: list[memoryview]) -> list[bool]:
        if (
            not self._manifest_written
        ):  # docs/formats.md: a namespace's manifest precedes its first page
            await self.store.put_manifest(
                self.key_prefix,
                self.namespace.id,
                self.namespace.manifest(self.page_bytes),
            )
            self._manifest_written = True
        return await self.store.batch_set(full, pages)

    def _record(
        self, op: str, pgs: list, bw: list, pages: int, good: int, start: float
    ) -> None:
        """Count one batch (SGLang calls from its prefetch and backup threads at once)."""
        elapsed = time.perf_counter() - start
        with self._metrics_lock:
            self.counters[f"{op}_pages"] += pages
            self.counters[f"{op}_ok"] += good
            pgs.append(pages)
            if good and elapsed > 0:
                bw.append(
                    good * self.page_bytes / elapsed / 1e9
                )  # GB/s, as SGLang's histograms expect
        if self._export is not None:
            self._export.tick()

    # -- host pool pages -------------------------------------------------------------------

    def _page_starts(
        self, keys: Sequence[str], host_indices: torch.Tensor
    ) -> list[int]:
        ps = self.mem_pool_host.page_size
        if host_indices.numel() != len(keys) * ps:
            raise ValueError(
                f"host_indices has {host_indices.numel()} slots for {len(keys)} keys; "
                f"expected {len(keys) * ps} ({ps} per page)"
            )
        return host_indices[::ps].tolist()

    # -- v1: host indices (SGLang's zero-copy interface) -----------------------------------

    @override
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info=None
    ) -> list[bool]:
        """Read pages into SGLang's host pool, each copied in once it verified (`_read`
        reads into buffers of its own: a read given up on stuck writes none of SGLang's
        pages). A page that misses or fails verification is False and its host slots are
        untouched (SGLang frees them)."""
        pool = self.mem_pool_host
        starts = self._page_starts(keys, host_indices)
        targets: list[torch.Tensor | None] = []
        views: list[memoryview] = []
        staging = None
        for i, start in enumerate(starts):
            page = pool.get_data_page(start, flat=False)
            if page.is_contiguous():  # read in place
                targets.append(None)
                views.append(_bytes_view(page))
                continue
            if staging is None:
                staging = torch.empty((len(starts), self.page_bytes), dtype=torch.uint8)
            targets.append(staging[i])
            views.append(_bytes_view(staging[i]))
        ok = self._read(keys, views)
        for good, start, staged in zip(ok, starts, targets):
            if good and staged is not None:
                pool.set_from_flat_data_page(start, staged.view(pool.dtype))
        return ok

    @override
    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info=None
    ) -> list[bool]:
        pool = self.mem_pool_host
        starts = self._page_starts(keys, host_indices)
        pages = [pool.get_data_page(start, flat=True).contiguous() for start in starts]
        return self._write(keys, [_bytes_view(p) for p in pages])

    # -- the legacy interface: flat page tensors --------------------------------------------

    @override
    def exists(self, key: str) -> bool:
        return self._exists([key]) == 1

    @override
    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        """How many of `keys`, from the first, the store holds."""
        if self._export is not None:
            self._export.tick()
        return self._exists(keys)

    @override
    def get(
        self, key: str, target_location: torch.Tensor | None = None, target_sizes=None
    ) -> torch.Tensor | None:
        return self.batch_get(
            [key], None if target_location is None else [target_location]
        )[0]

    @override
    def batch_get(
        self,
        keys: list[str],
        target_locations: list[torch.Tensor] | None = None,
        target_sizes=None,
    ) -> list[torch.Tensor | None]:
        if target_locations is None:
            target_locations = [
                self.mem_pool_host.get_dummy_flat_data_page() for _ in keys
            ]
        if len(target_locations) != len(keys):
            raise ValueError(
                f"batch_get: {len(keys)} keys but {len(target_locations)} target locations"
            )
        views = []
        for k, t in zip(keys, target_locations):
            v = _bytes_view(t)
            if len(v) != self.page_bytes:
                raise ValueError(
                    f"target for key {k!r} is {len(v)} bytes; this pool's pages are {self.page_bytes}"
                )
            views.append(v)
        ok = self._read(keys, views)
        return [t if good else None for t, good in zip(target_locations, ok)]

    @override
    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location=None,
        target_sizes=None,
    ) -> bool:
        return self.batch_set([key], None if value is None else [value])

    @override
    def batch_set(
        self,
        keys: list[str],
        values: list[torch.Tensor] | None = None,
        target_locations=None,
        target_sizes=None,
    ) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError(
                f"batch_set: {len(keys)} keys need as many page tensors, got "
                f"{None if values is None else len(values)}"
            )
        pages = [v.contiguous() for v in values]
        return all(self._write(keys, [_bytes_view(p) for p in pages]))

    # -- v2: a hybrid model's host pools (SWA, Mamba, sidecars) ---------------------------

    def _registered(self) -> dict[str, Any]:
        return {
            str(n): p
            for n, p in (getattr(self, "registered_pools", None) or {}).items()
        }

    def _sliding_window(self, side: list[str]) -> int | None:
        """The SWA window in tokens (extra_config.sliding_window_size) where an SWA pool is
        registered: SGLang hands a storage backend no window, and the window changes every
        page the model computes."""
        if not any("swa" in n.split("_") for n in side):
            return None
        extra = self.storage_config.extra_config or {}
        w = extra.get("sliding_window_size")
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise KvtierConfigError(
                f"extra_config.sliding_window_size={w!r}: host pools {side} include a "
                "sliding-window pool; give the model's window in tokens (an integer >= 1, "
                "the model config's sliding_window), docs/sglang.md"
            )
        return w

    def _v2_pool(self, name) -> _V2Pool:
        """The host pool SGLang registered under `name`, its namespace and page size."""
        key = str(name)
        pools = getattr(self, "_v2_pools", None)
        if pools is None:
            pools = self._v2_pools = {}
        got = pools.get(key)
        if got is not None:
            return got
        self._keys(())  # closed / not registered: the same errors as every call
        if key == "kv":
            host, ns = self.mem_pool_host, self.namespace
        else:
            host = self._registered().get(key)
            if host is None:
                raise ValueError(
                    f"pool {key!r}: not registered with this backend (registered: "
                    f"{sorted(self._registered())}); SGLang registers a pool through "
                    "register_mem_host_pool_v2 before its first transfer"
                )
            ns = self._pool_namespace(key, host)
        sample = host.get_data_page(0, flat=True)
        got = _V2Pool(
            key,
            host,
            ns,
            sample.numel() * sample.element_size(),
            sample.dtype,
            int(getattr(host, "page_size", 1) or 1),
        )
        pools[key] = got
        return got

    def _pool_namespace(self, name: str, host) -> Namespace:
        """A side pool's namespace: the KV pool's model, salt, revision and tenant key;
        its own geometry and dtype, with `kv_cache_dtype` as the KV's (fp8 KV changes every
        pool's bytes); the whole model's `hybrid` signature. Mamba state and
        MHA-shaped pools (an SWA or draft pool: heads) are split over TP ranks even where
        the KV (MLA) is replicated: each rank has its own namespace, so a rank that did
        not write a page misses it rather than read another rank's heads."""
        sc = self.storage_config
        kv = self.namespace
        shard = f"pp={sc.pp_rank}/{sc.pp_size}:cp={sc.attn_cp_rank}/{sc.attn_cp_size}"
        if sc.dp_rank:
            shard += f":dp={sc.dp_rank}"
        if sc.dcp_size > 1:  # each DCP rank holds its own shard of every pool's pages
            shard += f":dcp={sc.dcp_rank}/{sc.dcp_size}:lps={sc.logical_page_size}:tp={sc.tp_size}"
        sharded = name == "mamba" or getattr(host, "head_num", None) is not None
        rank, size = (sc.tp_rank, sc.tp_size) if sharded else (kv.tp_rank, kv.tp_size)
        dtype = _pool_dtype(host)
        if self.kv_cache_dtype:  # fp8 KV: uint8 pools; every pool's bytes depend on it
            dtype = f"{dtype}/{self.kv_cache_dtype}"
        return replace(
            kv,
            dtype=dtype,
            layout=f"sglang-pool={name}:{_pool_geometry(host)}:{shard}"
            f":hybrid={getattr(self, '_hybrid', '')}",
            page_size=int(getattr(host, "page_size", 1) or 1),
            tp_rank=rank,
            tp_size=size,
        )

    def _v2_plan(self, transfers) -> list[tuple[Any, _V2Pool, list[int], list[str]]]:
        """(transfer, pool, first host slot of each key, kvtier keys) per transfer."""
        if isinstance(transfers, (str, bytes)) or not isinstance(
            transfers, (list, tuple)
        ):
            raise ValueError(
                f"transfers: expected a list of SGLang PoolTransfer, got {type(transfers).__name__}"
            )
        plan = []
        for t in transfers:
            pool = self._v2_pool(t.name)
            _v2_policy(t)
            keys = list(t.keys or [])
            idx = t.host_indices
            n = 0 if idx is None else idx.numel()
            if n != len(keys) * pool.slots:
                raise ValueError(
                    f"pool {pool.name!r}: host_indices has {n} slots for {len(keys)} keys; "
                    f"expected {len(keys) * pool.slots} ({pool.slots} per key)"
                )
            starts = idx.reshape(-1)[:: pool.slots].tolist() if keys else []
            full = [
                make_key(
                    self.key_prefix,
                    pool.namespace.id,
                    page_hash_of(k, self.tenant.keyed),
                )
                for k in keys
            ]
            plan.append((t, pool, starts, full))
        return plan

    @override
    def batch_exists_v2(
        self, keys: list[str], pool_transfers=None, extra_info=None
    ) -> Any:
        """The KV prefix the store holds and, for each pool in `pool_transfers`, the
        prefix lengths (in pages) where that pool can restore: ALL_PAGES, its page of
        every KV page up to there; TRAILING_PAGES (SWA, Mamba), its pages of the
        `len(transfer.keys)` KV pages ending there. SGLang sends placeholders as a
        trailing pool's keys: only their number, the window, counts; the pages tested
        are the pool's own objects of `keys`. `restorable_prefix_pages` is every length
        where all pools can restore, a sparse list (SGLang intersects it across ranks)."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

        if self._export is not None:
            self._export.tick()
        if isinstance(keys, str):
            raise ValueError(
                "keys: expected a list of SGLang page hashes, got one string"
            )
        keys = list(keys)
        transfers = list(pool_transfers or [])
        for t in transfers:  # refused before any store call, whatever the store holds
            self._v2_pool(t.name)
            _v2_policy(t)
        kv_pages = self._exists(keys)
        hits: dict = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t in transfers:
            if not restorable:
                break
            pool = self._v2_pool(t.name)
            policy = getattr(t.hit_policy, "value", t.hit_policy)
            full = [
                make_key(
                    self.key_prefix,
                    pool.namespace.id,
                    page_hash_of(k, self.tenant.keyed),
                )
                for k in keys[:kv_pages]
            ]
            if policy == "all_pages":
                boundary = self._loop.run(
                    guarded(
                        self.breaker, lambda full=full: self.store.batch_exists(full), 0
                    )
                )
                ok = set(range(1, boundary + 1))
            else:  # trailing_pages
                window = max(1, len(t.keys or []))
                present = self._loop.run(self._present(full))
                ok = {p for p in restorable if all(present[max(0, p - window) : p])}
            if ok:
                hits[t.name] = max(ok)
            restorable = [p for p in restorable if p in ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    async def _present(self, full: list[str]) -> list[bool]:
        """Whether the store holds each key, in one call (a failed call: none held)."""
        return await guarded(
            self.breaker, lambda: self.store.exists_each(full), [False] * len(full)
        )

    @override
    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        """Read each transfer's pages (`keys`, into `host_indices`) from the store, one
        store call for all. A page is copied into SGLang's host pool only once its frame
        verified; a TRAILING_PAGES transfer (an SWA window, a Mamba state) is all or
        nothing: one page that misses or fails verification makes every page of it
        False, and none of its host slots is written. Returns {pool: [bool per key]}."""
        plan = self._v2_plan(transfers)
        full = [k for _, _, _, f in plan for k in f]
        staged = [
            torch.empty((len(f), pool.page_bytes), dtype=torch.uint8)
            for _, pool, _, f in plan
        ]
        views = [_bytes_view(s[i]) for s in staged for i in range(s.shape[0])]
        ok_all: list[bool] = []
        if full:
            ok_all = self._loop.run(
                read_staged(self.breaker, self.store, full, views)
            ) or [False] * len(full)
        out: dict = {}
        at = 0
        for (t, pool, starts, f), pages in zip(plan, staged):
            ok = list(ok_all[at : at + len(f)])
            at += len(f)
            if getattr(
                t.hit_policy, "value", t.hit_policy
            ) == "trailing_pages" and not all(ok):
                ok = [False] * len(ok)
            for i, (good, start) in enumerate(zip(ok, starts)):
                if good:
                    pool.host.set_from_flat_data_page(
                        start, pages[i].view(pool.flat_dtype)
                    )
            out[t.name] = ok
        self._count("get", len(full), sum(sum(v) for v in out.values()))
        return out

    @override
    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        """Write each transfer's pages (`host_indices`, under `keys`) to the store, each
        pool in its own namespace, one store call for all. Returns {pool: [bool per key]}."""
        plan = self._v2_plan(transfers)
        pages: list[memoryview] = []
        spaces: dict[str, tuple[Namespace, int]] = {}
        for _, pool, starts, _ in plan:
            spaces[pool.namespace.id] = (pool.namespace, pool.page_bytes)
            for start in starts:
                page = pool.host.get_data_page(start, flat=True).contiguous()
                view = _bytes_view(page)
                if len(view) != pool.page_bytes:
                    raise ValueError(
                        f"pool {pool.name!r}: page at host slot {start} is {len(view)} "
                        f"bytes; this pool's pages are {pool.page_bytes}"
                    )
                pages.append(view)
        full = [k for _, _, _, f in plan for k in f]
        ok_all: list[bool] = []
        if full:
            ok_all = self._loop.run(
                guarded(
                    self.breaker,
                    lambda: self._set_v2(spaces, full, pages),
                    [False] * len(full),
                )
            )
        out: dict = {}
        at = 0
        for t, _, _, f in plan:
            out[t.name] = list(ok_all[at : at + len(f)])
            at += len(f)
        self._count("set", len(full), sum(ok_all))
        return out

    async def _set_v2(
        self,
        spaces: dict[str, tuple[Namespace, int]],
        full: list[str],
        pages: list[memoryview],
    ) -> list[bool]:
        written = getattr(self, "_manifests", None)
        if written is None:
            written = self._manifests = set()
        for ns_id, (ns, page_bytes) in spaces.items():
            if ns_id not in written:  # docs/formats.md: the manifest precedes the pages
                await self.store.put_manifest(
                    self.key_prefix, ns_id, ns.manifest(page_bytes)
                )
                written.add(ns_id)
        return await self.store.batch_set(full, pages)

    def _count(self, op: str, pages: int, good: int) -> None:
        with self._metrics_lock:
            self.counters[f"{op}_pages"] += pages
            self.counters[f"{op}_ok"] += good
        if self._export is not None:
            self._export.tick()

    # -- operations ------------------------------------------------------------------------

    @override
    def clear(self) -> bool:
        """Delete this namespace's pages, and those of a hybrid model's other pools (other
        models, tenants and ranks keep theirs)."""
        if self.namespace is None:
            return True
        spaces = {self.namespace.id}
        spaces.update(
            self._v2_pool(n).namespace.id for n in self._registered() if n != "kv"
        )
        mine = tuple(f"{self.key_prefix}/{ns}/" for ns in sorted(spaces))

        async def run() -> int:
            n = 0
            async for batch in self.store.scan():
                keys = [p.key for p in batch if p.key.startswith(mine)]
                if keys:
                    n += await self.store.delete(keys)
            return n

        try:
            n = self._loop.run(run())
        except StoreError as exc:
            log.error(
                "kvtier: clearing namespace %s failed: %s", self.namespace.id, exc
            )
            return False
        log.info("kvtier: cleared %d pages of namespace %s", n, self.namespace.id)
        return True

    def kvtier_stats(self) -> dict:
        """Everything kvtier counts: the store's counters, the breaker, this adapter's pages."""
        return {
            "namespace": None if self.namespace is None else self.namespace.id,
            **self.counters,
            **({} if self.store is None else self.store.stats()),
            **({} if self.breaker is None else self.breaker.stats()),
        }

    @override
    def get_stats(self):
        """SGLang's StorageMetrics (per-batch pages and GB/s since the last call), or None
        where SGLang's metrics module cannot be imported."""
        with self._metrics_lock:
            taken = (
                self._prefetch_pgs,
                self._backup_pgs,
                self._prefetch_bw,
                self._backup_bw,
            )
            self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw = (
                [],
                [],
                [],
                [],
            )
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:
            return None
        m = StorageMetrics()
        m.prefetch_pgs.extend(taken[0])
        m.backup_pgs.extend(taken[1])
        m.prefetch_bandwidth.extend(taken[2])
        m.backup_bandwidth.extend(taken[3])
        return m

    def close(self) -> None:
        """Close the store and stop its loop; a second close does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._export is not None:  # the last numbers reach SGLang's /metrics
            self._export.export()
        if self.stack is None:  # never registered: nothing was built
            return
        try:
            self._loop.run(self.store.close())
        except StoreError as exc:
            log.warning("kvtier: closing the %s store: %s", self.store.name, exc)
        self.stack.close()


_CLASS: type | None = None


def _storage_class() -> type:
    global _CLASS
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    except Exception as exc:
        raise ImportError(
            f"kvtier.integrations.sglang.KvtierStorage subclasses SGLang's HiCacheStorage, "
            f"which could not be imported ({type(exc).__name__}: {exc}); run it inside an "
            f"SGLang install, or for tests: {INSTALL_HINT}"
        ) from exc
    if _CLASS is None or HiCacheStorage not in _CLASS.__bases__:  # SGLang loaded anew
        _CLASS = type(
            "KvtierStorage",
            (KvtierStorageBase, HiCacheStorage),
            {"__module__": __name__, "__doc__": KvtierStorageBase.__doc__},
        )
    return _CLASS


def __getattr__(name: str):
    if name == "KvtierStorage":
        return _storage_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
