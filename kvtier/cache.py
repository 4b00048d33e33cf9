"""TieredCache: the facade a server embeds (tree + controller + pool + mirror + store).

Thread: every method runs on the scheduler thread; background work finishes into the
controller's queues and `poll()` applies it. Per request (docs/design.md §8):

    got = cache.acquire(tokens, rid)       # match, lock, start a store prefetch or a host load
    if not got.ready:                      # a prefetch is in flight: keep the request waiting,
        ...                                #   run others; poll() names it when it may go on,
                                           #   then acquire(tokens, rid) again
    slots = cache.alloc(n)                 # the uncached suffix; evicts on demand
    waiter = cache.begin_forward([rid, ...]); waiter.wait_layer(i) before reading layer i
    cache.cache_unfinished(rid, tokens, kv)   # chunked prefill: keep what is computed so far
    cache.cache_finished(rid, tokens, kv)     # insert, free duplicates and the tail, unlock
    cache.abort(rid, kv)                      # on any error, in any state
    ready = cache.poll()                   # every scheduler step, on every rank

`kv` is the request's row of device slots so far: `got.indices` then its own slots.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.backends.base import Store
from kvtier.backends.registry import build_store
from kvtier.cache_sync import Applier
from kvtier.config import KvtierConfig, load_config
from kvtier.controller.config import WritePolicy
from kvtier.controller.controller import CacheController
from kvtier.controller.cpus import check_cpus
from kvtier.controller.layer_waiter import LayerWaiter
from kvtier.controller.speed import prefill_rate
from kvtier.controller.stats import CacheStats, PrometheusCollector
from kvtier.controller.streams import TransferError, make_stream
from kvtier.controller.tp import Agreement
from kvtier.errors import StoreError, StoreUnavailable
from kvtier.hashing import Namespace
from kvtier.held import Held
from kvtier.tiers.indices import check_size, check_slots, concat, pages_of, tensor
from kvtier.tiers.mirror import HostMirror
from kvtier.tiers.pool import DeviceKVPool
from kvtier.tree import MatchResult, RadixKey, RadixTree, Tier, TreeNode
from kvtier.tree.check import tier_slots

log = logging.getLogger(__name__)
D, H = Tier.DEVICE, Tier.HOST


@dataclass(slots=True, frozen=True)
class Acquired:
    """A request's cached prefix. `ready` False: a store prefetch is in flight and nothing
    is held; keep the request waiting and acquire it again once `poll()` names it.

    When ready, `indices` are the prefix's device slots (the first `device_hit` are the
    tree's, locked; the rest are being loaded from host into slots the request owns).
    `device_hit + host_hit + storage_hit == len(indices)`: where each token was found."""

    ready: bool
    indices: torch.Tensor
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0


_EMPTY = torch.empty(0, dtype=torch.int64)


class TieredCache:
    def __init__(self, config: KvtierConfig, tp_group=None, store: Store | None = None, stream_factory=make_stream,
                 clock=time.monotonic, agreement: Agreement | None = None) -> None:
        """`store` overrides the configured one; `stream_factory` and `clock` let a test
        schedule every copy and every deadline itself, and `agreement` (in place of
        `tp_group`) run several ranks in one process."""
        check_cpus(config.controller.cpus)  # on this machine, before the store connects or a thread starts
        self.config = config
        self.pool = DeviceKVPool(config.pool)
        self.mirror = HostMirror(self.pool, config.mirror) if config.mirror is not None else None
        if agreement is None:
            agreement = Agreement(tp_group, config.controller.consensus_check or None)
        rank, size = agreement.rank, agreement.world_size
        ns = config.namespace
        self.namespace = Namespace(ns.model_id, config.pool.dtype, _layout(config), config.pool.page_size,
                                   rank, size, ns.tenant_salt, revision=ns.revision)
        if store is None and config.store.backend != "none" and self.mirror is not None:
            store = build_store(config.store.backend, config.store.options, config.store.timeout_s)
        self.tree = RadixTree(config.pool.page_size, config.tree.eviction_policy, config.tree.slru_threshold,
                              self.namespace.id, config.tree.hash_algo)
        self.controller = CacheController(self.pool, self.mirror, store, config.controller, stream_factory, clock)
        if self.controller.storage is not None:
            self.controller.storage.manifest = (config.store.key_prefix, self.namespace.id,
                                                self.namespace.manifest(self.mirror.page_bytes))
            if config.store.required:
                self._probe_store()
        self.agreement = agreement
        self.stats_obj = CacheStats()
        self.sync = Applier(self.tree, self.controller, config.controller, config.store.key_prefix, self.stats_obj,
                            self.agreement, self.mirror is not None, clock)
        self.page_size = config.pool.page_size
        self.request_pages = 0  # device pages handed to requests and not yet given back
        self.requests: dict[str, Held] = {}
        self.closed = False
        log.info("kvtier: %s", self.describe())

    def _probe_store(self) -> None:
        """store.required: reach the store once at start, or refuse to start (one line)."""
        storage = self.controller.storage
        probe = storage.store.get_manifest(self.config.store.key_prefix, self.namespace.id)
        try:
            asyncio.run_coroutine_threadsafe(probe, storage.loop).result(self.config.store.timeout_s + 5)
        except (StoreError, TimeoutError) as exc:
            self.controller.close()
            raise StoreUnavailable(f"store.required: the {storage.store.name} store cannot be reached at start: "
                                   f"{str(exc) or type(exc).__name__}") from exc

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
                f"mirror {mirror} | write={c.controller.write_policy.value} prefetch={c.controller.prefetch_policy.value} "
                f"threads on CPUs {c.controller.cpus or 'any'} | "
                f"store {store.name if store else 'none'} | namespace {self.namespace.id}")

    # -- lookups ------------------------------------------------------------------------------

    def key(self, tokens, extra_key: str | None = None) -> RadixKey:
        return tokens if isinstance(tokens, RadixKey) else RadixKey(tokens, extra_key)

    def match_prefix(self, tokens, extra_key: str | None = None, count: bool = True) -> MatchResult:
        """Longest cached prefix (low level: `acquire` is the request API). Lock
        `last_device_node` before using `device_indices`. `count=False` for a re-match of
        the same request: it neither counts in stats nor bumps hit counts again."""
        key = self.key(tokens, extra_key)
        m = self.tree.match_prefix(key, touch=count)
        if count:
            self._count_lookup(len(key), m.device_slots.size, m.host_hit_length, 0)
        if count and self.config.controller.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE:
            self.sync.write_hot_path(m.last_device_node)
        return m

    def _count_lookup(self, tokens: int, device: int, host: int, storage: int) -> None:
        c = self.stats_obj.counters
        c.lookup_tokens += tokens
        c.device_hit_tokens += device
        c.host_hit_tokens += host
        c.storage_hit_tokens += storage

    def acquire(self, tokens, request_id: str, extra_key: str | None = None) -> Acquired:
        """Steps 1-3 of the embedding sequence; never waits on the store or a copy.

        First call: match; if the store may hold pages beyond the match, start a prefetch and
        return `ready=False` holding nothing. Once ready (a later `poll()` names the request):
        take the prefetch, lock the device prefix and start loading the host part into slots
        the request owns. Wait per layer (`begin_forward`) before reading them."""
        self._check_open("acquire")
        if not isinstance(request_id, str):  # None reads as "every request" to begin_forward
            raise ValueError(f"acquire: request_id={request_id!r}: must be a str")
        if request_id in self.requests:
            raise ValueError(f"acquire: request_id={request_id!r} already holds a prefix; finish or abort it first")
        key = self.key(tokens, extra_key)
        first = request_id not in self.sync.prefetches
        if not self.sync.is_ready(request_id):
            return Acquired(False, _EMPTY)
        if first:
            m = self.tree.match_prefix(key)
            if self.sync.start_prefetch(request_id, key, m):
                return Acquired(False, _EMPTY)
            storage, hashed = 0, None
        else:
            storage, hashed = self.sync.take_prefetch(request_id, key)
            m = self.tree.match_prefix(key, touch=False)  # the prefetch hung pages under it
        if self.config.controller.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE:
            self.sync.write_hot_path(m.last_device_node)
        self.lock(m.last_device_node)
        load = self.sync.start_load(m.last_host_node) if m.host_hit_length else None
        device_hit = m.device_slots.size
        self.requests[request_id] = Held(m.last_device_node, device_hit, load, key, hashed)
        loaded = 0 if load is None else load.device_slots.size
        self.request_pages += loaded // self.page_size
        storage_hit = min(storage, loaded)  # prefetched pages are the deepest of the host path
        self._count_lookup(len(key), device_hit, loaded - storage_hit, storage_hit)
        # a copy, never a view of a node's slots: what a request is handed is its own to change
        slots = concat([m.device_slots] if load is None else [m.device_slots, load.device_slots])
        return Acquired(True, tensor(slots), device_hit, loaded - storage_hit, storage_hit)

    def lock(self, node: TreeNode) -> None:
        if node is not self.tree.root:
            self.tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        if node is not self.tree.root:
            self.tree.unlock(node)

    # -- device slots for requests ------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` device slots in whole pages for a request, evicting on demand; None if short."""
        self._check_open("alloc")
        pages = -(-check_size("alloc: n", n, minimum=0) // self.page_size)
        slots = self.sync.alloc_device(pages * self.page_size)
        if slots is None:
            return None
        self.request_pages += pages
        return tensor(slots[:n])

    def free(self, indices: torch.Tensor) -> None:
        """Give back a request's own slots (not ones `acquire` handed out: `abort` those)."""
        self._free(check_slots("free: indices", indices))

    def _free(self, slots: np.ndarray) -> None:
        if slots.size:
            self.controller.device_alloc.free_slots(slots)  # a double free raises here, changing nothing
            self.request_pages -= len(set(pages_of(slots, self.page_size).tolist()))

    def evict(self, num_tokens: int) -> int:
        """Evict at least `num_tokens` device tokens if possible; returns tokens evicted."""
        return self.sync.evict_device(check_size("evict: num_tokens", num_tokens, minimum=0))

    # -- finishing a request ------------------------------------------------------------------

    def cache_finished(self, request_id: str, tokens, kv_indices: torch.Tensor, extra_key: str | None = None,
                       priority: int = 0) -> None:
        """The request is done: keep its page-aligned KV, free duplicates and its tail, unlock.

        `kv_indices[i]` holds token i's KV (what `acquire` handed out, then the request's own
        slots). If a load the request depended on failed, nothing is kept, everything the
        request held is released, and TransferError is raised: its KV was never right."""
        held = self._held(request_id, "cache_finished")
        key = self.key(tokens, extra_key)
        kv = check_slots("cache_finished: kv_indices", kv_indices, len(key))  # numpy from here on (docs/design.md §2)
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ValueError(f"cache_finished: priority={priority!r}: must be an integer")
        held.check_finish("cache_finished", request_id, key, kv, self.controller.device_alloc)
        self._check_load(request_id, held, kv)
        aligned = len(key) - len(key) % self.page_size
        r = self.tree.insert(key[:aligned], kv[:aligned], priority, held.known_hashes(key, self.page_size))
        self._give_back(kv, held.tree_len, r.prefix_len, aligned, len(key))
        self.unlock(held.node)
        del self.requests[request_id]
        self.sync.after_insert(r.added)

    def cache_unfinished(self, request_id: str, tokens, kv_indices: torch.Tensor,
                         extra_key: str | None = None) -> torch.Tensor:
        """Chunked prefill: keep the page-aligned KV so far; returns the canonical slots of
        tokens [0, aligned) — repoint the request's row to them."""
        held = self._held(request_id, "cache_unfinished")
        key = self.key(tokens, extra_key)
        kv = check_slots("cache_unfinished: kv_indices", kv_indices, len(key))
        held.check_finish("cache_unfinished", request_id, key, kv, self.controller.device_alloc)
        self._check_load(request_id, held, kv)
        aligned = len(key) - len(key) % self.page_size
        r = self.tree.insert(key[:aligned], kv[:aligned])
        self._give_back(kv, held.tree_len, r.prefix_len, aligned, aligned)
        m = self.tree.match_prefix(key[:aligned], touch=False)
        assert m.device_slots.size == aligned, "a just-inserted chunk is not on device"
        self.lock(m.last_device_node)
        self.unlock(held.node)
        self.requests[request_id] = Held(m.last_device_node, aligned, None, key[:aligned])
        self.sync.after_insert(r.added)
        return tensor(concat([m.device_slots]))  # the request's own copy, as from acquire

    def abort(self, request_id: str, kv_indices: torch.Tensor | np.ndarray | None = None) -> None:
        """Release whatever the request holds, in any state: its prefetch, its lock, the
        slots of its load (once the copy has stopped) and, given its row `kv_indices`, its
        own slots. Unknown or already released requests are a no-op. A row that is not the
        request's (shorter than the prefix it was handed, or with slots it does not own) is
        refused before anything changes, as a finish's is."""
        mine = None if kv_indices is None else check_slots("abort: kv_indices", kv_indices)
        held = self.requests.get(request_id)
        if held is not None and mine is not None:  # refused before anything changes, like a finish
            held.check_row("abort", request_id, mine, self.controller.device_alloc)
        self.sync.take_prefetch(request_id)  # stopped; what it landed stays on host for others
        if held is None:
            return
        del self.requests[request_id]
        self.stats_obj.counters.aborts += 1
        self.unlock(held.node)
        loaded = 0
        if held.load is not None:
            loaded = held.load.device_slots.size
            self.request_pages -= loaded // self.page_size
            self.sync.orphan_load(held.load)
        if mine is not None:
            self._free(mine[held.tree_len + loaded:])

    def _held(self, request_id: str, what: str) -> Held:
        held = self.requests.get(request_id)
        if held is None:
            raise ValueError(f"{what}: request_id={request_id!r} holds nothing (acquire it first, once it is ready)")
        return held

    def _check_load(self, request_id: str, held: Held, kv: np.ndarray) -> None:
        """Fail closed: a request whose load did not land intact must not insert anything."""
        load = held.load
        if load is None:
            return
        if not load.handle.is_done():
            load.handle.wait(self.config.store.timeout_s + 30.0)  # its forward waited already
        ok = load.ok
        if self.agreement.world_size > 1:  # every rank inserts, or none: one collective, on every rank
            (ok,), _ = self.agreement.agree([int(ok)], [])
        if ok:
            return
        error = load.handle.error or "did not finish"
        self.abort(request_id, kv)
        raise TransferError(f"request {request_id!r}: its host->device load failed ({error}); nothing was cached")

    def _give_back(self, kv: np.ndarray, tree_len: int, prefix_len: int, aligned: int, end: int) -> None:
        """Request slots [tree_len, end) leave the request: the tree took [prefix_len,
        aligned); duplicates [tree_len, prefix_len) and the tail [aligned, end) are freed."""
        with self.controller.device_alloc.free_group():
            if prefix_len > tree_len:
                self.controller.device_alloc.free_slots(kv[tree_len:prefix_len])
            if end > aligned:
                self.controller.device_alloc.free_slots(kv[aligned:end])
        self.request_pages -= -(-end // self.page_size) - tree_len // self.page_size

    # -- steps --------------------------------------------------------------------------------

    def begin_forward(self, request_ids=None) -> LayerWaiter:
        """What the forward about to run must wait for: the loads of the requests in it
        (default: of every request; waiting for more than needed is only slower). A failed
        load raises TransferError at every forward of its request until it is aborted; under
        tensor parallelism it is reported by `failed()` after the forward instead. Ids
        kvtier does not hold (requests that never went through it) have nothing to wait for."""
        if isinstance(request_ids, str):  # its characters would be looked up, its load never waited for
            raise ValueError(f"begin_forward: request_ids={request_ids!r}: expected a list of request ids, "
                             f"got one string")
        ids = self.requests if request_ids is None else request_ids
        loads = {}
        for rid in ids:
            held = self.requests.get(rid)
            if held is not None and held.load is not None:
                loads[rid] = held.load.handle
        return LayerWaiter(loads, self.config.store.timeout_s + 30.0, self.agreement,
                           defer=self.agreement.world_size > 1, num_layers=self.pool.num_layers)

    def poll(self) -> list[str]:
        """Apply finished background work; returns the waiting requests that may now be
        acquired again. Call every scheduler step on every rank."""
        self._check_open("poll")
        self.sync.poll()
        ready, self.sync.newly_ready = self.sync.newly_ready, []
        return ready

    def report_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed `tokens` of prefill in `seconds`: with this rate, a store load
        expected to take longer than recomputing its tokens is skipped (a miss), so the
        cache never makes a request slower than no cache (docs/design.md §8)."""
        if self.controller.storage is not None:
            self.controller.storage.speed.report_prefill(tokens, seconds)
        else:
            prefill_rate(tokens, seconds)  # bad values are refused with a store or without

    def set_prefill_rate(self, tokens_per_s: float | None) -> None:
        """A fixed prefill rate instead of measured ones (None: never skip for speed)."""
        if self.controller.storage is not None:
            self.controller.storage.speed.set_prefill_rate(tokens_per_s)

    def wait_progress(self, timeout: float = 0.005) -> None:
        """For a scheduler with nothing to run: nap until a store op moves (or `timeout`)."""
        self.controller.wait_progress(timeout)

    def flush(self) -> None:
        """Drop everything on device and host (the store keeps its pages). Refused, before
        anything changes, while requests hold device prefixes; waiting requests are named
        ready by the next poll (their prefetches stop: they end with what landed)."""
        held = sum(h.tree_len for h in self.requests.values())
        if held:
            raise ValueError(f"flush: {held} device tokens are locked by requests; finish them first")
        self.sync.drain()
        locked = self.tree.protected_size(D)
        if locked:  # only requests lock, and none does: a bug, not bad input
            raise AssertionError(f"flush: {locked} device tokens still locked after draining")
        ev = self.tree.evict_device(self.tree.total_size(D))
        self.controller.device_alloc.free_slots(ev.device_slots)
        if self.mirror is not None:
            hv = self.tree.evict_host(self.tree.total_size(H))
            self.controller.free_host(hv.host_slots)
        assert self.tree.total_size(D) == self.tree.total_size(H) == 0, "flush left tokens in the tree"

    def close(self) -> None:
        """Finish background work, drop device and host contents, stop threads. Requests
        still holding locks (an engine that failed mid-batch) keep their slots: logged.
        A second close does nothing; requests after it are refused (its threads are gone:
        a prefetch started then would never finish)."""
        if self.closed:
            return
        self.closed = True
        self.sync.drain()
        if self.tree.protected_size(D):
            log.warning("close: %d device tokens still locked by requests; not flushed", self.tree.protected_size(D))
        else:
            self.flush()
        self.controller.close()

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"{what}: this TieredCache is closed")

    # -- checks and numbers -------------------------------------------------------------------

    def check_accounting(self) -> None:
        """free + held by the tree + held by requests/ops == total, for pool and mirror."""
        problems = []
        dev_free = self.controller.device_alloc.available_size()
        dev_tree, dev_req = self.tree.total_size(D), self.request_pages * self.page_size
        if dev_req < 0:  # a negative count would balance pages the tree holds but never allocated
            problems.append(f"device: requests hold {dev_req} slots")
        strays = self.controller.device_alloc.unallocated(tier_slots(self.tree, D))
        if strays.size:
            problems.append(f"device: the tree holds slots whose pages are not allocated: {strays[:8].tolist()}")
        dev_ops = self.sync.orphaned_pages * self.page_size
        if dev_free + dev_tree + dev_req + dev_ops != self.config.pool.size:
            problems.append(f"device: free {dev_free} + tree {dev_tree} + requests {dev_req} + orphaned loads "
                            f"{dev_ops} != {self.config.pool.size}")
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
                          "prefetches": len(c.prefetches), **self._request_ages(),
                          "host_pages_quarantined": sum(p.size for p in c.quarantined)}}
        if c.store is not None:
            out["store"] = {**c.store.stats(), **c.storage.breaker.stats(), **c.storage.speed.stats()}
        return out

    def _request_ages(self) -> dict:
        """Requests held (acquired, not finished) and waiting for a prefetch, with the age of
        the oldest of each: one that only grows is a request an engine forgot, or one never
        named ready. Read from any thread (a metrics scrape): snapshots, taken atomically."""
        now, held = time.monotonic(), list(self.requests.values())
        waiting = [p.op.started for p in list(self.sync.prefetches.values()) if not (p.ready or p.discard)]
        return {"requests_held": len(held), "oldest_held_s": max((now - h.since for h in held), default=0.0),
                "requests_waiting": len(waiting),
                "oldest_waiting_s": max((time.perf_counter() - t for t in waiting), default=0.0)}

    def _tier_sizes(self, tier: Tier, total: int, free: int) -> dict:
        return {"total_tokens": total, "free_tokens": free, "evictable_tokens": self.tree.evictable_size(tier),
                "protected_tokens": self.tree.protected_size(tier)}

    def metrics_registry(self):
        """A Prometheus CollectorRegistry of this cache's metrics (nothing global)."""
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(PrometheusCollector(self))
        return registry


def _layout(config: KvtierConfig) -> str:
    """What fixes the bytes of a page: attention kind and geometry, in the frame order."""
    p = config.pool
    if p.attention == "mla":
        return f"mla:layers={p.num_layers}:lora={p.kv_lora_rank}:rope={p.rope_dim}"
    return f"mha:layers={p.num_layers}:heads={p.num_kv_heads}:head_dim={p.head_dim}:v={p.v_head_dim or p.head_dim}"
