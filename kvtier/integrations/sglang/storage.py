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
from dataclasses import replace
from collections.abc import Sequence

import torch
from typing_extensions import override

from kvtier.backends.base import Store
from kvtier.config import KvtierConfig, load_config
from kvtier.errors import KvtierConfigError, StoreError
from kvtier.hashing import Namespace, key_maker
from kvtier.integrations.sglang import INSTALL_HINT
from kvtier.integrations.sglang.keys import page_hash_of
from kvtier.integrations.sglang.storage_v2 import (
    StorageV2,
    V2Pool,
    bytes_view,
    hybrid_signature,
)
from kvtier.integrations.observe import flat_series, sglang_export, startup_line
from kvtier.integrations.stack import Geometry, Stack, build_stack, check_config
from kvtier.integrations.tenant import StoreTenant
from kvtier.storeio.breaker import Breaker
from kvtier.storeio.call import guarded, read_staged

log = logging.getLogger(__name__)


# extra_config keys this adapter reads; SGLang's own keys pass through untouched
EXTRA_KEYS = ("kvtier_config", "kv_cache_dtype", "sliding_window_size")
WHO = "SGLang's storage backend"


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


class KvtierStorageBase(StorageV2):
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
        and the sliding window (`hybrid_signature`), so two models that differ in any
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
        self._hybrid = hybrid_signature(pools, self._sliding_window(side))
        self._v2_pools: dict[str, V2Pool] = {}
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
                views.append(bytes_view(page))
                continue
            if staging is None:
                staging = torch.empty((len(starts), self.page_bytes), dtype=torch.uint8)
            targets.append(staging[i])
            views.append(bytes_view(staging[i]))
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
        return self._write(keys, [bytes_view(p) for p in pages])

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
            v = bytes_view(t)
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
        return all(self._write(keys, [bytes_view(p) for p in pages]))

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
