"""TieredCache: the facade a server embeds (docs/embedding.md). It wires the package's
parts — the request table, slot ownership, writes, loads, the prefetcher, the per-poll
completions — over the tree, the controller, the pool, the mirror and the store, and adds
no state of its own beyond them.

Thread: every method runs on the scheduler thread; background work finishes into the
controller's queues and `poll()` applies it. Per request (docs/design.md §8):

    got = cache.acquire(tokens, rid)       # match, lock, start a store prefetch or a host load
    if not got.ready:                      # a prefetch is in flight: keep the request waiting,
        ...                                #   run others; poll() names it when it may go on,
                                           #   then acquire(tokens, rid) again
    slots = cache.alloc(n)                 # whole pages for n tokens, tail included; evicts on demand
    waiter = cache.begin_forward([rid, ...]); waiter.wait_layer(i) before reading layer i
    waiter.failed()                        # after the forward: requests whose load failed: abort
    cache.cache_unfinished(rid, tokens, kv)   # chunked prefill: keep what is computed so far
    cache.cache_finished(rid, tokens, kv)     # insert, free duplicates and the tail, unlock
    cache.abort(rid, kv)                      # on any error, in any state
    ready = cache.poll()                   # every scheduler step, on every rank

`kv` is the request's row of device slots so far: `got.indices` then its own slots (the
tail of the last page may follow).
"""

from __future__ import annotations

import logging
import numbers
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvtier.backends.base import Store
from kvtier.backends.registry import build_store
from kvtier.backends.seal import SealedCodec
from kvtier.cache import report
from kvtier.cache.completions import Completions
from kvtier.cache.hints import Hints, Lease, LeaseBounds
from kvtier.cache.loads import Loads
from kvtier.cache.prefetch import Prefetcher
from kvtier.cache.requests import Held, RequestTable
from kvtier.cache.slots import DeviceAllocator, Slots
from kvtier.cache.writes import Writes
from kvtier.config import KvtierConfig, load_config
from kvtier.controller.config import WritePolicy
from kvtier.controller.controller import CacheController
from kvtier.storeio.cpus import check_cpus
from kvtier.controller.layer_waiter import LayerWaiter
from kvtier.controller.speed import prefill_rate
from kvtier.controller.stats import CacheStats, PrometheusCollector
from kvtier.tiers.streams import make_stream
from kvtier.controller.tp import Agreement
from kvtier.errors import LogOnce, TransferError
from kvtier.events.cache_events import cache_events
from kvtier.hashing import Namespace, key_maker
from kvtier.tiers.allocator import PagedAllocator
from kvtier.tiers.indices import check_size, check_slots, concat, pages_of, tensor
from kvtier.tiers.mirror import HostMirror
from kvtier.tiers.pool import DeviceKVPool
from kvtier.tree import MatchResult, RadixKey, RadixTree, Tier, TreeNode

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
    def __init__(
        self,
        config: KvtierConfig,
        tp_group=None,
        store: Store | None = None,
        stream_factory=make_stream,
        clock=time.monotonic,
        agreement: Agreement | None = None,
        *,
        pool: DeviceKVPool | None = None,
        device_allocator: DeviceAllocator | None = None,
    ) -> None:
        """`pool`: the engine's own KV tensors (`DeviceKVPool.from_tensors`); it describes
        the pool in place of `config.pool`. `device_allocator`: the engine's own slot
        allocator over that pool (`cache.slots.DeviceAllocator`); kvtier then frees the
        slots the tree evicts into it and allocates loads from it. `store` overrides the
        configured one; `stream_factory` and `clock` let a test schedule every copy and
        every deadline itself, and `agreement` (in place of `tp_group`) run several ranks
        in one process."""
        check_cpus(
            config.controller.cpus
        )  # on this machine, before the store connects or a thread starts
        if pool is not None:
            config = replace(config, pool=pool.config)
        self.config = config
        self.pool = DeviceKVPool(config.pool) if pool is None else pool
        self.mirror = (
            HostMirror(self.pool, config.mirror) if config.mirror is not None else None
        )
        if agreement is None:
            agreement = Agreement(tp_group, config.controller.consensus_check or None)
        rank, size = agreement.rank, agreement.world_size
        ns = config.namespace
        keys = ns.tenant_keys()  # docs/security.md: keyed page hashes and sealed frames
        self.namespace = Namespace(
            ns.model_id,
            config.pool.dtype,
            config.pool.page_layout,
            config.pool.page_size,
            rank,
            size,
            ns.tenant_salt,
            revision=ns.revision,
            tenant_key_id=None if keys is None else keys.current.key_id.hex(),
            store_pages=config.store_pages,
        )
        if store is None and config.store.backend != "none" and self.mirror is not None:
            store = build_store(
                config.store.backend, config.store.options, config.store.timeout_s
            )
        if store is not None and keys is not None:
            store.seal_with(SealedCodec(keys.current_only(), ns.encrypt))
        hash_algo = (
            config.tree.hash_algo
            if keys is None
            else keys.current.page_hash(config.tree.hash_algo)
        )
        self.tree = self._new_tree(
            config.pool.page_size,
            config.tree.eviction_policy,
            config.tree.slru_threshold,
            self.namespace.id,
            hash_algo,
        )
        manifest = (
            None
            if self.mirror is None
            else (
                config.store.key_prefix,
                self.namespace.id,
                self.namespace.manifest(self.mirror.page_bytes * config.store_pages),
            )
        )
        self.controller = CacheController(
            self.pool,
            self.mirror,
            store,
            config.controller,
            stream_factory,
            clock,
            manifest,
            config.store_pages,
        )
        if self.controller.storage is not None:
            if (
                config.store.required
            ):  # reach the store once at start, or refuse to start
                self.controller.probe_store(
                    config.store.key_prefix,
                    self.namespace.id,
                    config.store.timeout_s + 5,
                )
        self.agreement = agreement
        self.stats_obj = CacheStats()
        # KV events for routers (docs/events.md): rank 0 speaks for all ranks (they hold the same pages)
        self.events = (
            cache_events(config.events, self.tree, keys)
            if agreement.rank == 0
            else None
        )
        self.tree.set_observer(self.events)
        if self.events is not None and store is not None:  # STORAGE removals too
            self.events.watch_store(
                store, config.store.key_prefix, self.namespace.id, config.store_pages
            )
        self._wire(device_allocator, clock)
        self.closed = False
        log.info("kvtier: %s", self.describe())

    def _wire(self, device_allocator: DeviceAllocator | None, clock) -> None:
        """The parts, each owning its state, each calling only the ones made before it."""
        cfg, ctl, tree, has_mirror = (
            self.config.controller,
            self.controller,
            self.tree,
            self.mirror is not None,
        )
        self.page_size = ps = self.config.pool.page_size
        if device_allocator is None:
            device_allocator = PagedAllocator(self.config.pool.size, ps)
        elif (
            device_allocator.page_size != ps
            or device_allocator.size != self.config.pool.size
        ):
            raise ValueError(
                f"device_allocator: size {device_allocator.size}, page_size {device_allocator.page_size}; "
                f"the pool has size {self.config.pool.size}, page_size {ps}"
            )
        key_of = key_maker(
            self.config.store.key_prefix, tree.namespace_id
        )  # page hash -> store key
        complain = LogOnce(log)
        self.requests = RequestTable()
        self.slots = Slots(
            tree,
            ctl,
            device_allocator,
            cfg,
            self.stats_obj.counters,
            key_of,
            has_mirror,
            back_up=self._back_up,
        )
        self.writes = self._new_writes(
            self.slots, cfg, self.stats_obj, key_of, complain, self.events
        )
        self.loads = self._new_loads(
            self.slots,
            cfg,
            self.stats_obj,
            complain,
            lambda: self.completions.short_of_room(),
        )
        self.prefetcher = Prefetcher(self.slots, cfg, self.stats_obj, key_of, clock)
        self.completions = Completions(
            ctl,
            self.writes,
            self.loads,
            self.prefetcher,
            self.agreement,
            self.stats_obj.counters,
        )
        self.hints = Hints(
            self.slots,
            cfg,
            self.stats_obj,
            self.writes,
            self.prefetcher,
            key_of,
            clock,
            self.agreement,
            self._default_bounds(),
            self.config.tree.eviction_policy.value == "priority",
        )

    def _new_tree(self, *args) -> RadixTree:
        """The tree of a full-attention model (a hybrid cache builds its own)."""
        return RadixTree(*args)

    def _new_writes(self, *args) -> Writes:
        return Writes(*args)

    def _new_loads(self, *args) -> Loads:
        return Loads(*args)

    def _forward_layers(self) -> int:
        """The layers a forward's waiter counts (the pool's; a hybrid model's own)."""
        return self.pool.num_layers

    def _default_bounds(self) -> LeaseBounds:
        """Per tenant and for all tenants together: half the pool, half the mirror, and the
        mirror's size in the store."""
        bpt = self.pool.bytes_per_token
        host = 0 if self.mirror is None else self.mirror.size * bpt
        return LeaseBounds(self.config.pool.size * bpt // 2, host // 2, host)

    def _back_up(self, leaves: list[TreeNode]) -> None:
        """Write-back eviction backs these leaves' paths up first (slots.py calls this)."""
        self.completions.back_up(leaves)

    @classmethod
    def from_yaml(cls, path: str, tp_group=None, **overrides) -> TieredCache:
        return cls(load_config(path, overrides), tp_group)

    def describe(self) -> str:
        """The start-up log line: tree, pool, mirror, policies, threads, store, namespace."""
        return report.describe(self)

    # -- lookups ------------------------------------------------------------------------------

    def key(self, tokens, extra_key: str | None = None) -> RadixKey:
        return tokens if isinstance(tokens, RadixKey) else RadixKey(tokens, extra_key)

    def match_prefix(
        self, tokens, extra_key: str | None = None, count: bool = True
    ) -> MatchResult:
        """Longest cached prefix (low level: `acquire` is the request API). Lock
        `last_device_node` before using `device_indices`. `count=False` for a re-match of
        the same request: it neither counts in stats nor bumps hit counts again."""
        key = self.key(tokens, extra_key)
        m = self.tree.match_prefix(key, touch=count)
        if count:
            self._count_lookup(len(key), m.device_slots.size, m.host_hit_length, 0)
        if (
            count
            and self.config.controller.write_policy
            == WritePolicy.WRITE_THROUGH_SELECTIVE
        ):
            self.writes.write_hot_path(m.last_device_node)
        return m

    def _count_lookup(self, tokens: int, device: int, host: int, storage: int) -> None:
        c = self.stats_obj.counters
        c.lookup_tokens += tokens
        c.device_hit_tokens += device
        c.host_hit_tokens += host
        c.storage_hit_tokens += storage

    def acquire(
        self, tokens, request_id: str, extra_key: str | None = None
    ) -> Acquired:
        """Steps 1-3 of the embedding sequence; never waits on the store or a copy.

        First call: match; if the store may hold pages beyond the match, start a prefetch and
        return `ready=False` holding nothing. Once ready (a later `poll()` names the request):
        take the prefetch, lock the device prefix and start loading the host part into slots
        the request owns. Wait per layer (`begin_forward`) before reading them."""
        self._check_open("acquire")
        if not isinstance(
            request_id, str
        ):  # None reads as "every request" to begin_forward
            raise ValueError(f"acquire: request_id={request_id!r}: must be a str")
        if request_id in self.requests:
            raise ValueError(
                f"acquire: request_id={request_id!r} already holds a prefix; finish or abort it first"
            )
        first = not self.prefetcher.started(request_id)
        if not self.prefetcher.is_ready(request_id):
            return Acquired(False, _EMPTY)
        key = None if first else self.prefetcher.same_key(request_id, tokens, extra_key)
        if key is None:
            key = self.key(tokens, extra_key)
        if first:
            m = self.tree.match_prefix(key)
            if self.prefetcher.start(request_id, key, m):
                return Acquired(False, _EMPTY)
            storage, hashed = 0, None
        else:
            storage, hashed = self.prefetcher.take(request_id, key)
            m = self.tree.match_prefix(
                key, touch=False
            )  # the prefetch hung pages under it
        if self.config.controller.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE:
            self.writes.write_hot_path(m.last_device_node)
        self.lock(m.last_device_node)
        load = self.loads.start(m.last_host_node) if m.host_hit_length else None
        device_hit = m.device_slots.size
        held = Held(m.last_device_node, device_hit, load, key, hashed)
        self.requests.hold(request_id, held)
        loaded = held.loaded
        self.requests.hand_out(loaded // self.page_size)
        storage_hit = min(
            storage, loaded
        )  # prefetched pages are the deepest of the host path
        self._count_lookup(len(key), device_hit, loaded - storage_hit, storage_hit)
        # a copy, never a view of a node's slots: what a request is handed is its own to change
        slots = concat(
            [m.device_slots] if load is None else [m.device_slots, load.device_slots]
        )
        return Acquired(
            True, tensor(slots), device_hit, loaded - storage_hit, storage_hit
        )

    def lock(self, node: TreeNode) -> None:
        if node is not self.tree.root:
            self.tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        if node is not self.tree.root:
            self.tree.unlock(node)

    # -- agent hints (cache/hints.py, docs/embedding.md "Hints") ------------------------------

    def pin(
        self,
        tokens,
        ttl_s: float,
        tiers=("host", "store"),
        extra_key: str | None = None,
        tenant: str = "default",
    ) -> Lease:
        """A lease: the prefix's whole pages stay in `tiers` (device, host, store) for
        `ttl_s` seconds of the cache's clock, or until `release`. Parts of it not in a tier
        yet are taken as they arrive. Over the tenant's bound (`set_lease_bounds`): a
        LeaseBoundError naming tenant, tier, bytes asked and bound; nothing changes."""
        self._check_open("pin")
        return self.hints.pin(self.key(tokens, extra_key), ttl_s, tiers, tenant)

    def release(
        self, tokens, extra_key: str | None = None, tenant: str | None = "default"
    ) -> int:
        """Release `tenant`'s leases of the prefix (None: any tenant's); returns how many."""
        self._check_open("release")
        return self.hints.release(self.key(tokens, extra_key), tenant)

    def prefetch(self, tokens, extra_key: str | None = None) -> bool:
        """Bring the prefix up from the store to host ahead of its request; never waits.
        True if a store prefetch started (False: nothing to fetch, counted)."""
        self._check_open("prefetch")
        return self.hints.prefetch(self.key(tokens, extra_key))

    def demote(self, tokens, extra_key: str | None = None) -> int:
        """For a long pause: write the prefix down to host (and the store) now and drop
        its leases' device pins, so that evicting it from device keeps it. Returns the
        tokens whose write was queued."""
        self._check_open("demote")
        return self.hints.demote(self.key(tokens, extra_key))

    def retain(self, tokens, priority: int, extra_key: str | None = None) -> None:
        """Eviction priority of the prefix's nodes (and its store pages): the `priority`
        eviction policy evicts the lowest first; under another policy it is counted."""
        self._check_open("retain")
        self.hints.retain(self.key(tokens, extra_key), priority)

    def set_lease_bounds(self, bounds: LeaseBounds, tenant: str | None = None) -> None:
        """Bytes per tier a tenant's leases may hold (None: every tenant without its own).
        All tenants' leases together never hold more than the default bounds."""
        self.hints.set_bounds(bounds, tenant)

    # -- device slots for requests ------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor | None:
        """Whole pages for `n` more tokens of a request, evicting on demand; None if short.

        Returns every slot the request now owns: the first `n` for those tokens, then the
        tail of the last page (up to page_size - 1 slots), which the request's next tokens
        fill. A finish takes the row with or without that tail."""
        self._check_open("alloc")
        pages = -(-check_size("alloc: n", n, minimum=0) // self.page_size)
        slots = self.slots.alloc_device(pages * self.page_size)
        if slots is None:
            self.completions.short_of_room()  # writes in flight lock pages: the next poll applies them
            return None
        self.requests.hand_out(pages)
        return tensor(slots)

    def free(self, indices: torch.Tensor) -> None:
        """Give back a request's own slots (not ones `acquire` handed out: `abort` those)."""
        self._free(check_slots("free: indices", indices))

    def _free(self, slots: np.ndarray) -> None:
        if slots.size:
            self.slots.free_device(slots)  # a double free raises here, changing nothing
            self.requests.take_back(len(set(pages_of(slots, self.page_size).tolist())))

    def room(self) -> int:
        """Device tokens `alloc` could hand out now: free, plus what eviction could free."""
        return self.slots.device_free() + self.tree.evictable_size(D)

    def evict(self, num_tokens: int) -> int:
        """Evict at least `num_tokens` device tokens if possible; returns tokens evicted."""
        self._check_open(
            "evict"
        )  # under write_back it would queue writes on a stream that is gone
        evicted = self.slots.evict_device(
            n := check_size("evict: num_tokens", num_tokens, minimum=0)
        )
        if (
            evicted < n
        ):  # an engine's own allocator is short: writes in flight lock pages
            self.completions.short_of_room()
        return evicted

    # -- finishing a request ------------------------------------------------------------------

    def cache_finished(
        self,
        request_id: str,
        tokens,
        kv_indices: torch.Tensor,
        extra_key: str | None = None,
        priority: int = 0,
    ) -> None:
        """The request is done: keep its page-aligned KV, free duplicates and its tail, unlock.

        `kv_indices[i]` holds token i's KV (what `acquire` handed out, then the request's own
        slots), optionally followed by the tail of the last page. A load whose failure
        `failed()` named must have been aborted; one that failed after every layer had
        landed (after `failed()` was asked) is refused here: nothing is kept, everything
        the request held is released, and TransferError is raised (docs/design.md §8)."""
        self._check_open(
            "cache_finished"
        )  # its write would queue on a stream that is gone
        held = self.requests.require(request_id, "cache_finished")
        key = self.key(tokens, extra_key)
        kv = self._row(
            "cache_finished", kv_indices, len(key)
        )  # numpy from here on (docs/design.md §2)
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ValueError(
                f"cache_finished: priority={priority!r}: must be an integer"
            )
        held.check_finish("cache_finished", request_id, key, kv, self.slots)
        self._check_load(request_id, held, kv)
        aligned = len(key) - len(key) % self.page_size
        r = self.tree.insert(
            key[:aligned],
            kv[:aligned],
            priority,
            held.known_hashes(key, self.page_size),
        )
        self._give_back(kv, held.tree_len, r.prefix_len, aligned, len(key))
        self.unlock(held.node)
        self.requests.release(request_id)
        self.writes.after_insert(r.added)

    def cache_unfinished(
        self,
        request_id: str,
        tokens,
        kv_indices: torch.Tensor,
        extra_key: str | None = None,
    ) -> torch.Tensor:
        """Chunked prefill: keep the page-aligned KV so far; returns the canonical slots of
        tokens [0, aligned) — repoint the request's row to them."""
        self._check_open("cache_unfinished")
        held = self.requests.require(request_id, "cache_unfinished")
        key = self.key(tokens, extra_key)
        kv = self._row("cache_unfinished", kv_indices, len(key))
        held.check_finish("cache_unfinished", request_id, key, kv, self.slots)
        self._check_load(request_id, held, kv)
        aligned = len(key) - len(key) % self.page_size
        r = self.tree.insert(key[:aligned], kv[:aligned])
        self._give_back(kv, held.tree_len, r.prefix_len, aligned, aligned)
        m = self.tree.match_prefix(key[:aligned], touch=False)
        assert m.device_slots.size == aligned, "a just-inserted chunk is not on device"
        self.lock(m.last_device_node)
        self.unlock(held.node)
        self.requests.hold(
            request_id, Held(m.last_device_node, aligned, None, key[:aligned])
        )
        self.writes.after_insert(r.added)
        return tensor(
            concat([m.device_slots])
        )  # the request's own copy, as from acquire

    def _row(self, what: str, kv_indices, tokens: int):
        """A finish's row: one slot per token, optionally followed by the tail of the last
        page (as `alloc` hands it out); returns the slots of the tokens."""
        kv = check_slots(f"{what}: kv_indices", kv_indices)
        whole = -(-tokens // self.page_size) * self.page_size
        if not tokens <= kv.shape[0] <= whole:
            raise ValueError(
                f"{what}: kv_indices: expected {tokens} indices (one per token, up to {whole} with the "
                f"tail of the last page), got {kv.shape[0]}"
            )
        return kv[:tokens]

    def abort(
        self, request_id: str, kv_indices: torch.Tensor | np.ndarray | None = None
    ) -> None:
        """Release whatever the request holds, in any state: its prefetch, its lock, the
        slots of its load (once the copy has stopped) and, given its row `kv_indices`, its
        own slots. Unknown or already released requests are a no-op. A row that is not the
        request's (shorter than the prefix it was handed, or with slots it does not own) is
        refused before anything changes, as a finish's is."""
        mine = (
            None if kv_indices is None else check_slots("abort: kv_indices", kv_indices)
        )
        held = self.requests.get(request_id)
        if (
            held is not None and mine is not None
        ):  # refused before anything changes, like a finish
            held.check_row("abort", request_id, mine, self.slots)
        self.prefetcher.take(
            request_id
        )  # stopped; what it landed stays on host for others
        if held is None:
            return
        self.requests.release(request_id)
        self.stats_obj.counters.aborts += 1
        self.unlock(held.node)
        loaded = held.loaded
        if held.load is not None:
            self.requests.take_back(loaded // self.page_size)
            self.loads.orphan(held.load)
        if mine is not None:
            self._free(mine[held.tree_len + loaded :])

    def _check_load(self, request_id: str, held: Held, kv: np.ndarray) -> None:
        """Fail closed: a request whose load did not land intact must not insert anything."""
        load = held.load
        if load is None:
            return
        if not load.handle.is_done():
            load.handle.wait(
                self.config.store.timeout_s + 30.0
            )  # its forward waited already
        ok = (
            load.ok and not load.handle.missed
        )  # a forward that gave up on it read KV not landed
        if (
            self.agreement.world_size > 1
        ):  # every rank inserts, or none: one collective, on every rank
            (ok,), _ = self.agreement.agree([int(ok)], [])
        if ok:
            return
        error = load.handle.error or (
            "a forward gave up waiting for it"
            if load.handle.missed
            else "did not finish"
        )
        self.abort(request_id, kv)
        raise TransferError(
            f"request {request_id!r}: its host->device load failed ({error}); nothing was cached"
        )

    def _give_back(
        self, kv: np.ndarray, tree_len: int, prefix_len: int, aligned: int, end: int
    ) -> None:
        """Request slots [tree_len, end) leave the request: the tree took [prefix_len,
        aligned); duplicates [tree_len, prefix_len) and the tail [aligned, end) are freed,
        in one call (most finishes free a tail only: no free group to open)."""
        parts = [kv[a:b] for a, b in ((tree_len, prefix_len), (aligned, end)) if b > a]
        if parts:
            self.slots.free_device(parts[0] if len(parts) == 1 else concat(parts))
        self.requests.take_back(-(-end // self.page_size) - tree_len // self.page_size)

    # -- steps --------------------------------------------------------------------------------

    def begin_forward(self, request_ids=None) -> LayerWaiter:
        """What the forward about to run must wait for: the loads of the requests in it
        (default: of every request; waiting for more than needed is only slower). A failed
        load is named by the waiter's `failed()` after the forward, on one rank as on many
        (docs/design.md §8): abort those requests. Ids kvtier does not hold (requests that
        never went through it) have nothing to wait for."""
        if isinstance(
            request_ids, str
        ):  # its characters would be looked up, its load never waited for
            raise ValueError(
                f"begin_forward: request_ids={request_ids!r}: expected a list of request ids, "
                f"got one string"
            )
        ids = self.requests.ids() if request_ids is None else request_ids
        loads = {}
        for rid in ids:
            held = self.requests.get(rid)
            if held is not None and held.load is not None:
                loads[rid] = held.load.handle
        return LayerWaiter(
            loads,
            self.config.store.timeout_s + 30.0,
            self.agreement,
            self._forward_layers(),
        )

    def poll(self) -> list[str]:
        """Apply finished background work; returns the waiting requests that may now be
        acquired again. Call every scheduler step on every rank. On one rank, finished
        copies and backups (no request waits for them) may wait a few polls, to be applied
        together (docs/design.md §7); `drain` applies everything."""
        self._check_open("poll")
        self.completions.poll()
        if self.events is not None:
            self.events.flush()
        return self.hints.poll(self.prefetcher.take_ready())

    def report_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed `tokens` of prefill in `seconds`: with this rate, a store load
        expected to take longer than recomputing its tokens is skipped (a miss), so the
        cache never makes a request slower than no cache (docs/design.md §8)."""
        if self.controller.storage is not None:
            self.controller.storage.speed.report_prefill(tokens, seconds)
        else:
            prefill_rate(
                tokens, seconds
            )  # bad values are refused with a store or without

    def set_prefill_rate(self, tokens_per_s: float | None) -> None:
        """A fixed prefill rate instead of measured ones (None: never skip for speed)."""
        if self.controller.storage is not None:
            self.controller.storage.speed.set_prefill_rate(tokens_per_s)

    def busy(self) -> bool:
        """Is any transfer or store op not applied yet? (Writes in flight lock device pages:
        a scheduler short of room polls until they are applied.)"""
        return self.controller.busy()

    def drain(self) -> None:
        """Stop prefetches, wait for every transfer and store op and apply them all. On every
        rank together, like `poll`."""
        self._check_open("drain")
        self.completions.drain()

    def wait_progress(self, timeout: float = 0.005) -> None:
        """For a scheduler with nothing to run: nap until a prefetch moves (or `timeout`).
        A backup's end wakes no nap: no request waits for it."""
        self.controller.wait_progress(timeout)

    def flush(self) -> None:
        """Drop everything on device and host (the store keeps its pages). Refused, before
        anything changes, while requests hold device prefixes; waiting requests are named
        ready by the next poll (their prefetches stop: they end with what landed)."""
        held = self.requests.locked_tokens()
        if held:
            raise ValueError(
                f"flush: {held} device tokens are locked by requests; finish them first"
            )
        self.hints.release_all()  # leases keep nothing through a flush
        self.completions.drain()
        locked = self.tree.protected_size(D)
        if locked:  # only requests lock, and none does: a bug, not bad input
            raise AssertionError(
                f"flush: {locked} device tokens still locked after draining"
            )
        self.slots.evict_all_device()
        if self.mirror is not None:
            hv = self.tree.evict_host(self.tree.total_size(H))
            self.controller.free_host(hv.host_slots)
        assert self.tree.total_size(D) == self.tree.total_size(H) == 0, (
            "flush left tokens in the tree"
        )

    def close(self) -> None:
        """Finish background work, drop device and host contents, stop threads. Requests
        still holding locks (an engine that failed mid-batch) keep their slots: logged.
        A second close does nothing; requests after it are refused (its threads are gone:
        a prefetch started then would never finish)."""
        if self.closed:
            return
        self.closed = True
        self.hints.release_all()
        self.completions.drain()
        if self.tree.protected_size(D):
            log.warning(
                "close: %d device tokens still locked by requests; not flushed",
                self.tree.protected_size(D),
            )
        else:
            self.flush()
        self.controller.close()
        if self.events is not None:
            self.events.close()
        self.agreement.release()  # the engine's process group is the engine's again

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"{what}: this TieredCache is closed")

    # -- checks and numbers -------------------------------------------------------------------

    def check_accounting(self) -> None:
        """free + held by the tree + held by requests/ops == total, for pool and mirror."""
        problems = self.slots.accounting_problems(
            self.requests.pages, self.loads.orphaned_pages
        )
        if problems:
            raise AssertionError(
                "kvtier accounting broken:\n  " + "\n  ".join(problems)
            )

    def stats(self) -> dict:
        """Counters, tier sizes, queues and the store's own numbers (`cache/report.py`),
        and what the agent hints did (`hints`)."""
        out = report.stats(self)
        out["hints"] = self.hints.stats()
        return out

    def metrics_registry(self):
        """A Prometheus CollectorRegistry of this cache's metrics (nothing global)."""
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(PrometheusCollector(self))
        return registry
