"""Agent hints (docs/embedding.md, "Hints"): leases that keep a prefix in named tiers, a
store prefetch ahead of a request, a write-through before a long pause, an eviction
priority. Scheduler thread only, like the rest of the cache.

Hints are advice. One that cannot be honoured (the prefix is not in a tier, there is no
mirror or store, a store call fails) changes a counter (`stats()`), never an output, and
never waits: store calls go through the controller's storage thread. The one refusal is a
lease over its tenant's bound, in bytes per tier, or over the bound of all tenants'
leases together (the cache's default bounds: tenants are names callers give): `pin`
raises `LeaseBoundError` (tenant, tier, bytes asked, bound) and nothing changes.

A lease holds the tree's own locks: `lock` on the deepest device node of its prefix,
`protect_host` on the deepest host node, so pinned pages are out of eviction in those
tiers exactly as a request's prefix is. Pages of the prefix not in a tier when it was
pinned (a write still in flight, a request still computing them) are taken as they
arrive, at each poll. A lease expires on the cache's clock (the one `TieredCache` was
given; tests drive it), read once per poll; under tensor parallelism a lease goes once
every rank's clock has passed that rank's end of it (agreed by MIN), so every rank
releases it in the same poll.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from kvtier.cache.prefetch import Prefetcher
from kvtier.cache.slots import Part, Slots
from kvtier.cache.writes import Writes
from kvtier.controller.config import ControllerConfig
from kvtier.controller.stats import CacheStats
from kvtier.controller.storage import PageKeys
from kvtier.controller.tp import Agreement
from kvtier.tree import RadixKey, Tier, TreeNode

log = logging.getLogger(__name__)
D, H = Tier.DEVICE, Tier.HOST
# a hint prefetch's id in the prefetcher: no request id of an engine holds a NUL
HINT_PREFIX = "\x00hint-"


class HintTier(str, Enum):
    DEVICE = "device"
    HOST = "host"
    STORE = "store"

    @classmethod
    def parse(cls, value) -> HintTier:
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(t.value for t in cls)
            raise ValueError(
                f"tiers: {value!r} is not a tier; allowed: {allowed}"
            ) from None


class LeaseBoundError(ValueError):
    """A tenant's leases would hold more bytes of a tier than its bound."""


@dataclass(slots=True, frozen=True)
class LeaseBounds:
    """Bytes of each tier one tenant's leases may hold at once (asked, whole prefixes)."""

    device_bytes: int
    host_bytes: int
    store_bytes: int

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "store_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"lease bounds: {name}={v!r}: must be an integer >= 0")

    def of(self, tier: HintTier) -> int:
        return getattr(self, f"{tier.value}_bytes")


@dataclass(eq=False)
class Lease:
    """A prefix kept in `tiers` until `expires` (the cache's clock) or its release.
    `nodes[tier]`: the node whose path that tier's lock is held on (device, host);
    `covered[tier]`: tokens of the prefix that lock covers."""

    id: int
    tenant: str
    key: RadixKey
    tiers: frozenset[HintTier]
    asked: int  # bytes of each tier it counts against its tenant's bound
    expires: float
    nodes: dict[Tier, TreeNode] = field(default_factory=dict)
    covered: dict[Tier, int] = field(default_factory=dict)
    store_keys: PageKeys | None = None

    @property
    def tokens(self) -> int:
        return len(self.key)

    def short(self) -> bool:
        """Does a tree tier it names still miss part of the prefix?"""
        return any(
            self.covered.get(t, 0) < self.tokens for t in (D, H) if _named(self, t)
        )


@dataclass(slots=True)
class HintCounters:
    pins: int = 0
    pins_short: int = 0  # a named tier held only part of the prefix when pinned
    pins_refused: int = 0  # over a tenant's bound
    releases: int = 0
    expired: int = 0
    prefetches: int = 0
    prefetches_noop: int = 0  # nothing to fetch: on host already, no store, too short
    demotes: int = 0
    demote_tokens: int = 0  # device->host writes queued by demote
    retains: int = 0
    retains_unordered: int = 0  # the eviction policy does not order by priority
    store_hints: int = (
        0  # Store.hint calls sent (the store thread counts what they did)
    )
    unhonoured: int = 0  # hints that could not be honoured at all


class Hints(Part):
    def __init__(
        self,
        slots: Slots,
        config: ControllerConfig,
        stats: CacheStats,
        writes: Writes,
        prefetcher: Prefetcher,
        key_of: Callable[[bytes], str],
        clock: Callable[[], float],
        agreement: Agreement,
        bounds: LeaseBounds,
        priority_orders: bool,
    ) -> None:
        super().__init__(slots, config, stats)
        self.writes = writes
        self.prefetcher = prefetcher
        self.key_of = key_of
        self.clock = clock
        self.agreement = agreement
        self.bounds = bounds
        self.tenant_bounds: dict[str, LeaseBounds] = {}
        # all tenants together: a tenant is a name the caller gives, so bounds per tenant
        # alone let new names lease the whole pool (and starve every request)
        self.total = bounds
        self.priority_orders = priority_orders
        self.bytes_per_token = self.ctl.pool.bytes_per_token
        self.leases: dict[int, Lease] = {}  # by id, in pin order (replicated)
        self.held: dict[tuple[str, HintTier], int] = {}  # asked bytes by tenant, tier
        self.held_total: dict[HintTier, int] = {}  # asked bytes by tier, all tenants
        self.fetching: list[str] = []  # ids of hint prefetches not taken back yet
        self.hint_counters = HintCounters()
        self._next = 0

    # -- leases -------------------------------------------------------------------------------

    def set_bounds(self, bounds: LeaseBounds, tenant: str | None = None) -> None:
        if not isinstance(bounds, LeaseBounds):
            raise ValueError(
                f"bounds: expected LeaseBounds, got {type(bounds).__name__}"
            )
        if tenant is None:
            self.bounds = bounds
        else:
            self.tenant_bounds[check_tenant(tenant)] = bounds

    def pin(self, key: RadixKey, ttl_s: float, tiers: Iterable, tenant: str) -> Lease:
        """Keep `key`'s page-aligned prefix in `tiers` for `ttl_s` seconds of the cache's
        clock, or until released. Over the tenant's bound: LeaseBoundError, nothing changed."""
        tenant = check_tenant(tenant)
        ttl = check_ttl(ttl_s)
        named = parse_tiers(tiers)
        key = key[: len(key) - len(key) % self.page_size]
        if not len(key):
            raise ValueError(
                f"pin: the prefix is shorter than a page ({self.page_size} tokens): "
                "nothing to keep"
            )
        asked = len(key) * self.bytes_per_token
        for tier in sorted(named, key=list(HintTier).index):
            bound = self.tenant_bounds.get(tenant, self.bounds).of(tier)
            have = self.held.get((tenant, tier), 0)
            if have + asked > bound:
                self.hint_counters.pins_refused += 1
                raise LeaseBoundError(
                    f"pin: tenant {tenant!r} asks {asked} bytes of {tier.value} "
                    f"({len(key)} tokens) holding {have}; its bound is {bound} bytes"
                )
            total, bound = self.held_total.get(tier, 0), self.total.of(tier)
            if total + asked > bound:
                self.hint_counters.pins_refused += 1
                raise LeaseBoundError(
                    f"pin: tenant {tenant!r} asks {asked} bytes of {tier.value} "
                    f"({len(key)} tokens) while all tenants' leases hold {total}; their "
                    f"bound together is {bound} bytes"
                )
        lease = Lease(self._next, tenant, key, named, asked, self.clock() + ttl)
        self._next += 1
        for tier in named:
            self.held[(tenant, tier)] = self.held.get((tenant, tier), 0) + asked
            self.held_total[tier] = self.held_total.get(tier, 0) + asked
        self.leases[lease.id] = lease
        self.hint_counters.pins += 1
        if HintTier.HOST in named and self.ctl.mirror is None:
            lease.covered[H] = lease.tokens  # no host tier: nothing to take, ever
            self.hint_counters.unhonoured += 1
        self._take(lease)
        if lease.short():
            self.hint_counters.pins_short += 1
        if HintTier.STORE in named:
            if self.ctl.storage is None:
                self.hint_counters.unhonoured += 1
            else:
                lease.store_keys = self._store_keys(key)
                self._tell_store_leases(key, None)
        return lease

    def release(self, key: RadixKey | None, tenant: str | None) -> int:
        """Release the leases of `key` (None: every lease) held by `tenant` (None: any
        tenant's); returns how many."""
        aligned = None if key is None else key[: len(key) - len(key) % self.page_size]
        gone = [
            lease
            for lease in self.leases.values()
            if (tenant is None or lease.tenant == tenant)
            and (aligned is None or _same_key(lease.key, aligned))
        ]
        for lease in gone:
            self._drop(lease)
        self.hint_counters.releases += len(gone)
        return len(gone)

    def release_all(self) -> int:
        return self.release(None, None)

    def _drop(self, lease: Lease) -> None:
        del self.leases[lease.id]
        for tier in lease.tiers:
            self.held[(lease.tenant, tier)] -= lease.asked
            if not self.held[(lease.tenant, tier)]:
                del self.held[(lease.tenant, tier)]
            self.held_total[tier] -= lease.asked
        node = lease.nodes.pop(D, None)
        if node is not None:
            self.tree.unlock(node)
        node = lease.nodes.pop(H, None)
        if node is not None:
            self.tree.release_host(node)
        if lease.store_keys is not None:  # its pages other leases hold keep theirs
            self._tell_store_leases(lease.key, None)

    def _take(self, lease: Lease) -> None:
        """Lock as much of the prefix as each named tree tier holds now (deeper than before)."""
        want = [
            t
            for t in (D, H)
            if _named(lease, t) and lease.covered.get(t, 0) < lease.tokens
        ]
        if not want:
            return
        m = self.tree.match_prefix(lease.key, touch=False)
        for tier in want:
            node = (
                m.last_device_node if tier == D else _deepest_on_host(m.last_host_node)
            )
            depth = _depth(node)
            if node is self.tree.root or depth <= lease.covered.get(tier, 0):
                continue
            if tier == D:
                self.tree.lock(node)
            else:
                self.tree.protect_host(node)
            old = lease.nodes.get(tier)
            if old is not None:
                (self.tree.unlock if tier == D else self.tree.release_host)(old)
            lease.nodes[tier], lease.covered[tier] = node, depth

    # -- the other hints ----------------------------------------------------------------------

    def prefetch(self, key: RadixKey) -> bool:
        """Start bringing `key`'s prefix from the store up to host (a store prefetch, the
        one a request would start); True if one started. Never waits: it lands over later
        polls, and a request that acquires the prefix then finds it on host (and loads it
        to device as its forward runs)."""
        rid = f"{HINT_PREFIX}{self._next}"
        m = self.tree.match_prefix(key, touch=False)
        if not self.prefetcher.start(rid, key, m):
            self.hint_counters.prefetches_noop += 1
            return False
        self._next += 1
        self.fetching.append(rid)
        self.hint_counters.prefetches += 1
        return True

    def demote(self, key: RadixKey) -> int:
        """Write `key`'s prefix down to host now (and, from there, to the store), and let
        go of the device pins leases hold on it: for a long pause, its device pages may
        then be evicted without the prefix being dropped. Returns the tokens queued."""
        m = self.tree.match_prefix(key, touch=False)
        node, queued = m.last_device_node, 0
        self.hint_counters.demotes += 1
        if self.ctl.mirror is None or node is self.tree.root:
            self.hint_counters.unhonoured += 1
        else:
            before = set(self.writes.writing)
            self.writes.write_paths([node])
            queued = _newly_written(node, before, self.writes.writing)
        self.hint_counters.demote_tokens += queued
        aligned = key[: len(key) - len(key) % self.page_size]
        for lease in self.leases.values():
            held = lease.nodes.pop(D, None) if _same_key(lease.key, aligned) else None
            if held is not None:
                self.tree.unlock(held)
                lease.covered[D] = lease.tokens  # not taken again
        return queued

    def retain(self, key: RadixKey, priority: int) -> None:
        """Give `key`'s prefix eviction priority `priority` (the priority policy evicts the
        lowest first; the store is told too)."""
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ValueError(f"retain: priority={priority!r}: must be an integer")
        self.hint_counters.retains += 1
        if not self.priority_orders:
            self.hint_counters.retains_unordered += 1
        m = self.tree.match_prefix(key, touch=False)
        if m.best_match_node is not self.tree.root:
            self.tree.set_priority(m.best_match_node, int(priority))
        elif self.ctl.storage is None:
            self.hint_counters.unhonoured += 1
        if self.ctl.storage is not None:  # the store's leases stay as they are
            self._tell_store_leases(key, int(priority))

    # -- each poll ----------------------------------------------------------------------------

    def poll(self, ready: list[str]) -> list[str]:
        """Expire leases, take what arrived for short ones, take back ended hint prefetches;
        returns `ready` without the hints' own prefetches."""
        if self.leases:
            self._expire()
            for lease in list(self.leases.values()):
                if lease.short():
                    self._take(lease)
        if self.fetching:
            self.fetching = [
                rid for rid in self.fetching if not self.prefetcher.take_ended(rid)
            ]
        return (
            [rid for rid in ready if not rid.startswith(HINT_PREFIX)]
            if ready
            else ready
        )

    def _expire(self) -> None:
        now = self.clock()
        leases = list(self.leases.values())
        due = [int(lease.expires <= now) for lease in leases]
        # the lease table is replicated: every rank asks, in the same polls, with a vector
        # of its length. Each rank pinned at its own clock reading, so each lease's end
        # differs by rank: a lease goes once every rank's own end has passed (MIN of the
        # flags), in the same poll everywhere
        if self.agreement.world_size > 1:
            due, _ = self.agreement.agree(due, [])
        for lease, gone in zip(leases, due):
            if gone:
                self._drop(lease)
                self.hint_counters.expired += 1

    # -- the store ----------------------------------------------------------------------------

    def _store_keys(self, key: RadixKey) -> PageKeys:
        """The store keys of `key`'s pages, hashed and keyed by the storage thread."""
        storage = self.ctl.storage
        pages = len(key) // self.page_size
        hashing = self.tree.hashing_below(self.tree.root, key)
        g = 1 if storage is None else storage.group
        if g == 1:
            return PageKeys(hashing, self.key_of, pages)
        # a store page of g pages is keyed by its last page (controller/store_pages.py)
        return PageKeys(lambda: hashing()[g - 1 :: g], self.key_of, pages // g)

    def _tell_store_leases(self, key: RadixKey, priority: int | None) -> None:
        """Tell the store, for `key`'s store pages, the lease each keeps now (and
        `priority`: a `retain`'s; None keeps the pages' own, so a pin, a release or an
        expiry never undoes a retain): the longest
        time left of the store leases that hold it (a lease holds the pages of its own
        prefix, shared with any other lease's), None where none does (its lease ends), in
        runs of pages alike. Store.hint's None releases a page's lease: a page two leases
        hold keeps it while either does."""
        storage = self.ctl.storage
        if storage is None:
            return
        g, ps = storage.group, self.page_size
        n = len(key) // ps // g
        now, left = self.clock(), [None] * n
        for lease in self.leases.values():
            if lease.store_keys is None:
                continue
            t = max(lease.expires - now, 0.001)
            for j in range(min(_common(lease.key, key) // (ps * g), n)):
                if left[j] is None or left[j] < t:
                    left[j] = t
        hashing = self.tree.hashing_below(self.tree.root, key)
        a = 0
        for b in range(1, n + 1):
            if b == n or left[b] != left[a]:
                # a store page of g pages is keyed by its last page (controller/store_pages.py)
                keys = PageKeys(
                    lambda a=a, b=b: hashing()[g - 1 :: g][a:b], self.key_of, b - a
                )
                self._tell_store(keys, left[a], priority)
                a = b

    def _tell_store(
        self, keys: PageKeys, lease_s: float | None, priority: int | None
    ) -> None:
        storage = self.ctl.storage
        if storage is None or not len(keys):
            return
        storage.hint(keys, lease_s, priority)
        self.hint_counters.store_hints += 1

    # -- numbers ------------------------------------------------------------------------------

    def stats(self) -> dict:
        out = {
            f: getattr(self.hint_counters, f) for f in HintCounters.__dataclass_fields__
        }
        out["leases"] = len(self.leases)
        out["lease_bytes"] = {
            f"{t}/{tier.value}": b for (t, tier), b in list(self.held.items())
        }
        storage = self.ctl.storage
        out["store_hinted_pages"] = 0 if storage is None else storage.hinted_pages
        out["store_hints_failed"] = 0 if storage is None else storage.hints_failed
        return out


def _named(lease: Lease, tier: Tier) -> bool:
    return (HintTier.DEVICE if tier == D else HintTier.HOST) in lease.tiers


def _depth(node: TreeNode) -> int:
    n = 0
    while node.parent is not None:
        n += len(node)
        node = node.parent
    return n


def _deepest_on_host(node: TreeNode) -> TreeNode:
    """The deepest node at or above `node` on host (host nodes form a prefix of the path)."""
    while node.parent is not None and not node.backed_up:
        node = node.parent
    return node


def _newly_written(node: TreeNode, before: set[int], after: set[int]) -> int:
    """Tokens of the path to `node` whose write was queued since `before`."""
    n = 0
    while node.parent is not None:
        n += len(node) if node.id in after and node.id not in before else 0
        node = node.parent
    return n


def _common(a: RadixKey, b: RadixKey) -> int:
    """Tokens `a` and `b` share from their start (0 under different extra keys)."""
    if a.extra_key != b.extra_key:
        return 0
    n = min(len(a), len(b))
    differ = np.flatnonzero(a.tokens[:n] != b.tokens[:n])
    return int(differ[0]) if differ.size else n


def _same_key(a: RadixKey, b: RadixKey) -> bool:
    return (
        a.extra_key == b.extra_key
        and len(a) == len(b)
        and a.tokens.tobytes() == b.tokens.tobytes()
    )


def check_tenant(tenant) -> str:
    if not isinstance(tenant, str) or not tenant or len(tenant) > 256:
        raise ValueError(
            f"tenant={tenant!r}: must be a non-empty string of at most 256"
        )
    return tenant


def check_ttl(ttl_s) -> float:
    if (
        isinstance(ttl_s, bool)
        or not isinstance(ttl_s, numbers.Real)
        or not 0 < ttl_s < math.inf
    ):
        raise ValueError(f"pin: ttl_s={ttl_s!r}: must be a number of seconds > 0")
    return float(ttl_s)


def parse_tiers(tiers) -> frozenset[HintTier]:
    if isinstance(tiers, str):
        tiers = [tiers]
    named = frozenset(HintTier.parse(t) for t in tiers)
    if not named:
        raise ValueError("pin: tiers: name at least one of device, host, store")
    return named
