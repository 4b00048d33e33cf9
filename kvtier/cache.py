"""TieredCache: the facade a server embeds (tree + controller + pool + mirror + store).

Thread: every method runs on the scheduler thread; background work finishes into the
controller's queues and `poll()` applies it. Per request (DESIGN §8):

    got = cache.acquire(tokens, rid)          # = match, lock, prefetch (L3 -> host) beyond
                                              #   the match, load back (host -> device), relock
    slots = cache.alloc(n)                     # evicts on demand
    waiter = cache.begin_forward(); waiter.wait_layer(i) before reading layer i
    cache.cache_finished(tokens, kv, got.node, len(got.indices))  # insert, free dups, unlock
    cache.poll()                               # every scheduler step, on every rank
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvtier.backends.base import Store
from kvtier.backends.registry import build_store
from kvtier.cache_sync import Applier
from kvtier.config import KvtierConfig, load_config
from kvtier.controller.config import WritePolicy
from kvtier.controller.controller import CacheController
from kvtier.controller.stats import CacheStats, PrometheusCollector
from kvtier.controller.tp import Agreement
from kvtier.hashing import Namespace
from kvtier.tiers.mirror import HostMirror
from kvtier.tiers.pool import DeviceKVPool
from kvtier.tree import MatchResult, RadixKey, RadixTree, Tier, TreeNode

log = logging.getLogger(__name__)
D, H = Tier.DEVICE, Tier.HOST


class LayerWaiter:
    """The loads one forward must wait for; later loads belong to the next forward."""

    def __init__(self, handles: list, timeout_s: float) -> None:
        self.handles = handles
        self.timeout_s = timeout_s

    def wait_layer(self, layer: int) -> None:
        for h in self.handles:
            h.wait_layer(layer, self.timeout_s)


@dataclass(slots=True, frozen=True)
class Acquired:
    """A request's cached prefix, locked at `node`: `indices` are its device slots (pass
    `node` and `len(indices)` as `cached_len` to `cache_finished`). The hits say where the
    prefix was found: on device, on host (loaded back), in the store (prefetched)."""

    node: TreeNode
    indices: torch.Tensor
    device_hit: int
    host_hit: int
    storage_hit: int


class TieredCache:
    def __init__(self, config: KvtierConfig, tp_group=None, store: Store | None = None) -> None:
        self.config = config
        self.pool = DeviceKVPool(config.pool)
        self.mirror = HostMirror(self.pool, config.mirror) if config.mirror is not None else None
        rank, size = _tp_rank_size(tp_group)
        self.namespace = Namespace(config.namespace.model_id, config.pool.dtype, _layout(config), config.pool.page_size,
                                   rank, size, config.namespace.tenant_salt)
        if store is None and config.store.backend != "none" and self.mirror is not None:
            store = build_store(config.store.backend, config.store.options, config.store.timeout_s)
        self.tree = RadixTree(config.pool.page_size, config.tree.eviction_policy, config.tree.slru_threshold,
                              self.namespace.id, config.tree.hash_algo)
        self.controller = CacheController(self.pool, self.mirror, store, config.controller)
        self.agreement = Agreement(tp_group, config.controller.consensus_check or None)
        self.stats_obj = CacheStats()
        self.sync = Applier(self)
        self.page_size = config.pool.page_size
        self.request_pages = 0  # device pages handed to requests and not yet given back
        self._new_loads: list = []
        log.info("kvtier: %s", self.describe())

    @classmethod
    def from_yaml(cls, path: str, tp_group=None, **overrides) -> "TieredCache":
        return cls(load_config(path, overrides), tp_group)

    def describe(self) -> str:
        c = self.config
        mirror = "none" if self.mirror is None else (
            f"{c.mirror.layout} {self.mirror.size} slots ({'pinned' if self.mirror.pinned else 'plain memory'}) io={self.mirror.io}")
        store = self.controller.store
        return (f"tree page_size={c.pool.page_size} eviction={c.tree.eviction_policy.value} hash={c.tree.hash_algo} | "
                f"pool {c.pool.attention} {c.pool.num_layers} layers {c.pool.size} slots {c.pool.dtype} {c.pool.device} | "
                f"mirror {mirror} | write={c.controller.write_policy.value} prefetch={c.controller.prefetch_policy.value} | "
                f"store {store.name if store else 'none'} | namespace {self.namespace.id}")

    # -- lookups ------------------------------------------------------------------------------

    def key(self, tokens, extra_key: str | None = None) -> RadixKey:
        return tokens if isinstance(tokens, RadixKey) else RadixKey(tokens, extra_key)

    def match_prefix(self, tokens, extra_key: str | None = None, count: bool = True) -> MatchResult:
        """Longest cached prefix. Lock `last_device_node` before using `device_indices`.
        `count=False` for a re-match of the same request (stats count each request once)."""
        key = self.key(tokens, extra_key)
        m = self.tree.match_prefix(key)
        if count:
            c = self.stats_obj.counters
            c.lookup_tokens += len(key)
            c.device_hit_tokens += m.device_indices.numel()
            c.host_hit_tokens += m.host_hit_length
        if self.config.controller.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE:
            self.sync.write_hot_path(m.last_device_node)
        return m

    def acquire(self, tokens, request_id: str, extra_key: str | None = None) -> Acquired:
        """Steps 1-3 of the embedding sequence in one call: match, lock, prefetch from the
        store beyond the match (per the prefetch policy), load the host part back, and lock
        the final device prefix. Wait per layer (`begin_forward`) before reading it."""
        key = self.key(tokens, extra_key)
        m = self.match_prefix(key)
        self.lock(m.last_device_node)
        storage = self.take_prefetch(request_id) if self.prefetch(request_id, key, m) else 0
        final = self.match_prefix(key, count=False)
        if final.host_hit_length and self.load_back(final.last_host_node):
            final = self.match_prefix(key, count=False)
        self.lock(final.last_device_node)
        self.unlock(m.last_device_node)
        return Acquired(final.last_device_node, final.device_indices, m.device_indices.numel(),
                        m.host_hit_length, storage)

    def lock(self, node: TreeNode) -> None:
        if node is not self.tree.root:
            self.tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        if node is not self.tree.root:
            self.tree.unlock(node)

    # -- device slots for requests ------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` device slots in whole pages for a request, evicting on demand; None if short."""
        pages = -(-n // self.page_size)
        slots = self._alloc_device(pages * self.page_size)
        if slots is None:
            return None
        self.request_pages += pages
        return slots[:n]

    def free(self, indices: torch.Tensor) -> None:
        """Give back a request's own slots (an aborted or finished request's tail)."""
        if indices.numel():
            self.request_pages -= torch.unique(indices // self.page_size).numel()
            self.controller.device_alloc.free(indices)

    def _alloc_device(self, n: int) -> torch.Tensor | None:
        alloc = self.controller.device_alloc
        if alloc.available_size() < n:
            self.evict(n - alloc.available_size())
        return alloc.alloc(n)

    def evict(self, num_tokens: int) -> int:
        """Evict at least `num_tokens` device tokens if possible; returns tokens evicted."""
        return self.sync.evict_device(num_tokens)

    # -- inserts ------------------------------------------------------------------------------

    def cache_finished(self, tokens, kv_indices: torch.Tensor, last_node: TreeNode, cached_len: int,
                       extra_key: str | None = None, priority: int = 0) -> None:
        """A request is done: keep its page-aligned KV, free duplicates and its tail, unlock.

        `kv_indices[:cached_len]` came from the cache (locked at `last_node`); the rest are
        the request's own slots, owned by the tree or freed after this call."""
        key = self.key(tokens, extra_key)
        aligned = len(key) - len(key) % self.page_size
        r = self.tree.insert(key[:aligned], kv_indices[:aligned], priority)
        self._give_back(kv_indices, cached_len, r.prefix_len, aligned, len(key))
        self.unlock(last_node)
        self.sync.after_insert(r.added)

    def cache_unfinished(self, tokens, kv_indices: torch.Tensor, last_node: TreeNode, cached_len: int,
                         extra_key: str | None = None) -> tuple[torch.Tensor, TreeNode, int]:
        """Chunked prefill: keep the page-aligned KV so far; returns (canonical slots for
        tokens [0, new_cached_len), the new locked node, new_cached_len). The caller
        repoints its request row to the canonical slots."""
        key = self.key(tokens, extra_key)
        aligned = len(key) - len(key) % self.page_size
        r = self.tree.insert(key[:aligned], kv_indices[:aligned])
        self._give_back(kv_indices, cached_len, r.prefix_len, aligned, aligned)
        m = self.tree.match_prefix(key[:aligned])
        assert m.device_indices.numel() == aligned, "a just-inserted chunk is not on device"
        self.lock(m.last_device_node)
        self.unlock(last_node)
        self.sync.after_insert(r.added)
        return m.device_indices, m.last_device_node, aligned

    def _give_back(self, kv: torch.Tensor, cached_len: int, prefix_len: int, aligned: int, end: int) -> None:
        """Request slots [cached_len, end) leave the request: duplicates and the tail are freed."""
        with self.controller.device_alloc.free_group():
            if prefix_len > cached_len:
                self.controller.device_alloc.free(kv[cached_len:prefix_len])
            if end > aligned:
                self.controller.device_alloc.free(kv[aligned:end])
        self.request_pages -= -(-end // self.page_size) - cached_len // self.page_size

    # -- host -> device -----------------------------------------------------------------------

    def load_back(self, node: TreeNode) -> int:
        """Start loading the host-only path ending at `node` onto device; returns tokens.

        All or nothing: 0 if the path is shorter than `load_back_min_tokens` or the device
        cannot make room. The loaded path stays locked until its copy has landed."""
        return self.sync.load_back(node)

    def begin_forward(self) -> LayerWaiter:
        """The loads submitted so far belong to the forward about to run."""
        handles, self._new_loads = self._new_loads, []
        return LayerWaiter(handles, self.config.store.timeout_s + 30.0)

    # -- L3 -----------------------------------------------------------------------------------

    def prefetch(self, request_id: str, tokens, match: MatchResult, extra_key: str | None = None) -> bool:
        """Start reading pages beyond `match` from the store into the mirror."""
        return self.sync.start_prefetch(request_id, self.key(tokens, extra_key), match)

    def prefetch_done(self, request_id: str) -> bool:
        return self.sync.prefetch_done(request_id)

    def take_prefetch(self, request_id: str) -> int:
        """Apply the prefetch policy; returns tokens the prefetch put on host for this
        request. Re-match (count=False) afterwards to see them as host hits."""
        return self.sync.take_prefetch(request_id)

    # -- steps --------------------------------------------------------------------------------

    def poll(self) -> None:
        """Apply finished background work. Call every scheduler step on every rank."""
        self.sync.poll()

    def flush(self) -> None:
        """Drop everything on device and host (the store keeps its pages)."""
        self.sync.drain()
        locked = self.tree.protected_size(D)
        if locked:
            raise ValueError(f"flush: {locked} device tokens are locked by requests; finish them first")
        ev = self.tree.evict_device(self.tree.total_size(D))
        self.controller.device_alloc.free(ev.device_indices)
        if self.mirror is not None:
            hv = self.tree.evict_host(self.tree.total_size(H))
            self.controller.free_host(hv.host_indices)
        assert self.tree.total_size(D) == self.tree.total_size(H) == 0, "flush left tokens in the tree"

    def close(self) -> None:
        """Finish background work, drop device and host contents, stop threads. Requests
        still holding locks (an engine that failed mid-batch) keep their slots: logged."""
        self.sync.drain()
        if self.tree.protected_size(D):
            log.warning("close: %d device tokens still locked by requests; not flushed", self.tree.protected_size(D))
        else:
            self.flush()
        self.controller.close()

    # -- checks and numbers -------------------------------------------------------------------

    def check_accounting(self) -> None:
        """free + held by the tree + held by requests/ops == total, for pool and mirror."""
        problems = []
        dev_free = self.controller.device_alloc.available_size()
        dev_tree, dev_req = self.tree.total_size(D), self.request_pages * self.page_size
        if dev_free + dev_tree + dev_req != self.config.pool.size:
            problems.append(f"device: free {dev_free} + tree {dev_tree} + requests {dev_req} != {self.config.pool.size}")
        if self.mirror is not None:
            host_free, in_flight = self.controller.host_accounting()
            host_tree = self.tree.total_size(H)
            if host_free + host_tree + in_flight != self.mirror.size:
                problems.append(f"host: free {host_free} + tree {host_tree} + in flight {in_flight} != {self.mirror.size}")
        if problems:
            raise AssertionError("kvtier accounting broken:\n  " + "\n  ".join(problems))

    def stats(self) -> dict:
        tiers = {"device": self._tier_sizes(D, self.config.pool.size, self.controller.device_alloc.available_size())}
        if self.mirror is not None:
            tiers["host"] = self._tier_sizes(H, self.mirror.size, self.controller.host_available())
        c = self.controller
        out = {"counters": self.stats_obj.as_dict(), "tiers": tiers,
               "queues": {"writes": len(c.writes), "loads": len(c.loads), "backups": len(c.backups),
                          "prefetches": len(c.prefetches)}}
        if c.store is not None:
            out["store"] = c.store.stats()
        return out

    def _tier_sizes(self, tier: Tier, total: int, free: int) -> dict:
        return {"total_tokens": total, "free_tokens": free, "evictable_tokens": self.tree.evictable_size(tier),
                "protected_tokens": self.tree.protected_size(tier)}

    def metrics_registry(self):
        """A Prometheus CollectorRegistry of this cache's metrics (nothing global)."""
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(PrometheusCollector(self))
        return registry


def _tp_rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _layout(config: KvtierConfig) -> str:
    """What fixes the bytes of a page: attention kind and geometry, in the frame order."""
    p = config.pool
    if p.attention == "mla":
        return f"mla:layers={p.num_layers}:lora={p.kv_lora_rank}:rope={p.rope_dim}"
    return f"mha:layers={p.num_layers}:heads={p.num_kv_heads}:head_dim={p.head_dim}:v={p.v_head_dim or p.head_dim}"
