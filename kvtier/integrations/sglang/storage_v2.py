"""SGLang's v2 storage calls for a hybrid model's host pools (SWA, Mamba, sidecars):
`batch_exists_v2 / batch_get_v2 / batch_set_v2`, each pool in a namespace of its own
(storage.py's `KvtierStorageBase` mixes this in)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from typing_extensions import override

from kvtier.errors import KvtierConfigError
from kvtier.hashing import Namespace, make_key
from kvtier.integrations.sglang.keys import page_hash_of
from kvtier.storeio.call import guarded, read_staged


def bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"expected a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}"
        )
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class V2Pool:
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


def hybrid_signature(pools: dict[str, Any], window: int | None) -> str:
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


class StorageV2:
    """The v2 calls of `KvtierStorageBase` (its state, store and loop)."""

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

    def _v2_pool(self, name) -> V2Pool:
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
        got = V2Pool(
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

    def _v2_plan(self, transfers) -> list[tuple[Any, V2Pool, list[int], list[str]]]:
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
        views = [bytes_view(s[i]) for s in staged for i in range(s.shape[0])]
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
                view = bytes_view(page)
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
