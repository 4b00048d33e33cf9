"""Agent hints on the linker's host tier: the API `TieredCache` offers (docs/embedding.md,
"Agent hints"), over SGLang's page keys and the host index's pins (`HostIndex.pin`).

A lease pins the prefix's published host pages until it expires on the linker's clock
(checked whenever the linker reaps, at each lookup) or is released; pages published later
(an offload still copying) are pinned as they arrive. Each tenant's leases hold at most a
bound of host bytes, and all tenants' leases together the same bound: over either, `pin`
raises LeaseBoundError naming tenant, tier, bytes asked and bound, and nothing changes.
SGLang owns the device tier, its tree and the
order of its evictions: a device lease, `prefetch` and `demote` are advice it cannot
honour here, counted (`stats()`), never an error. A lease naming the `store` tier, and
`retain(priority)`, go on to the linker's store (`LinkerStore.hint`: one guarded call on its
store loop, in order, never waited for), for the store keys of the prefix's pages; a
release or an expiry tells the store each page's lease left, the longest of the live store
leases holding the page, None (released) where none does. With no store they are counted
as not honoured. Scheduler thread only, like the linker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.cache.hints import (
    HintTier,
    LeaseBoundError,
    check_tenant,
    check_ttl,
    parse_tiers,
)
from kvtier.integrations.sglang.linker.host_index import HostIndex
from kvtier.integrations.sglang.linker.store_io import LinkerStore


@dataclass(eq=False)
class LinkerLease:
    id: int
    tenant: str
    keys: tuple[str, ...]
    asked: int  # host bytes it counts against its tenant's bound
    expires: float
    host: bool = True  # it pins the prefix's host pages
    store: bool = False  # the store holds the prefix's pages for it
    pinned: list[str] = field(default_factory=list)  # what it holds pins on

    def short(self) -> bool:
        return self.host and len(self.pinned) < len(self.keys)


@dataclass(slots=True)
class LinkerHintCounters:
    pins: int = 0
    pins_short: int = 0
    pins_refused: int = 0
    releases: int = 0
    expired: int = 0
    unhonoured: int = 0  # device leases, prefetch, demote; store ones with no store
    retains: int = 0
    store_hints: int = (
        0  # LinkerStore.hint calls sent (its thread counts what they did)
    )


class LinkerHints:
    def __init__(
        self,
        index: HostIndex,
        page_bytes: int,
        clock: Callable[[], float],
        store: LinkerStore | None = None,
        tells_store: bool = True,
    ) -> None:
        self.index, self.store = index, store
        # MLA: every rank holds the lease, the rank that writes the shared store pages
        # alone tells the store (the others' calls would repeat its, out of its order)
        self.tells_store = tells_store
        self.page_bytes = page_bytes
        self.clock = clock
        # per tenant, and for all tenants together (a tenant is a name the caller gives)
        self.bound = index.allocator.num_pages * page_bytes // 2
        self.leases: dict[int, LinkerLease] = {}
        self.held: dict[str, int] = {}  # host bytes asked, by tenant
        self.counters = LinkerHintCounters()
        self._next = 0

    def pin(
        self,
        keys: Sequence[str],
        ttl_s: float,
        tiers=("host",),
        tenant: str = "default",
    ) -> LinkerLease:
        ttl = check_ttl(ttl_s)
        tenant, keys, named, asked = self.admit(keys, tiers, tenant)
        have = self.held.get(tenant, 0)
        honoured = {HintTier.HOST} | ({HintTier.STORE} if self.store else set())
        self.counters.unhonoured += bool(named - honoured)
        lease = LinkerLease(self._next, tenant, keys, asked, self.clock() + ttl)
        lease.host = HintTier.HOST in named
        lease.store = HintTier.STORE in named and self.store is not None
        self._next += 1
        self.counters.pins += 1
        if not (HintTier.HOST in named or lease.store):
            return lease  # nothing here holds it
        self.leases[lease.id] = lease
        if HintTier.HOST in named:
            self.held[tenant] = have + asked
            self._take(lease)
            self.counters.pins_short += lease.short()
        if lease.store:
            self._tell_store(keys, None)
        return lease

    def admit(self, keys: Sequence[str], tiers, tenant: str):
        """A pin's checked arguments and the host bytes it asks: `LeaseBoundError` where
        they pass its tenant's bound or all tenants' (nothing changes)."""
        tenant, named = check_tenant(tenant), parse_tiers(tiers)
        keys = tuple(_keys("pin", keys))
        asked = len(set(keys)) * self.page_bytes if HintTier.HOST in named else 0
        have = self.held.get(tenant, 0)
        if HintTier.HOST in named and have + asked > self.bound:
            self.counters.pins_refused += 1
            raise LeaseBoundError(
                f"pin: tenant {tenant!r} asks {asked} bytes of host ({len(keys)} pages) "
                f"holding {have}; its bound is {self.bound} bytes"
            )
        total = sum(self.held.values())
        if HintTier.HOST in named and total + asked > self.bound:
            self.counters.pins_refused += 1
            raise LeaseBoundError(
                f"pin: tenant {tenant!r} asks {asked} bytes of host ({len(keys)} pages) "
                f"while all tenants' leases hold {total}; their bound together is "
                f"{self.bound} bytes"
            )
        return tenant, keys, named, asked

    def release(
        self, keys: Sequence[str] | None, tenant: str | None = "default"
    ) -> int:
        """Release `tenant`'s (None: anyone's) leases of exactly `keys` (None: all)."""
        want = None if keys is None else tuple(_keys("release", keys))
        gone = [
            lease
            for lease in self.leases.values()
            if (tenant is None or lease.tenant == tenant)
            and (want is None or lease.keys == want)
        ]
        for lease in gone:
            self._drop(lease)
        self.counters.releases += len(gone)
        return len(gone)

    def release_all(self) -> int:
        return self.release(None, None)

    def prefetch(self, keys: Sequence[str]) -> bool:
        _keys("prefetch", keys)
        self.counters.unhonoured += 1
        return False

    def demote(self, keys: Sequence[str]) -> int:
        _keys("demote", keys)
        self.counters.unhonoured += 1
        return 0

    def retain(self, keys: Sequence[str], priority: int) -> None:
        _keys("retain", keys)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"retain: priority={priority!r}: must be an integer")
        self.counters.retains += 1
        if self.store is None:
            self.counters.unhonoured += 1
            return
        self._tell_store(keys, int(priority))  # the pages' leases stay as they are

    def poll(self) -> None:
        """Expire leases on the clock; pin what arrived for the short ones."""
        if not self.leases:
            return
        now = self.clock()
        for lease in list(self.leases.values()):
            if lease.expires <= now:
                self._drop(lease)
                self.counters.expired += 1
            elif lease.short():
                self._take(lease)

    def pinned(self) -> list[list[str]]:
        """The pins each lease holds (the linker's accounting counts them)."""
        return [lease.pinned for lease in self.leases.values()]

    def stats(self) -> dict:
        out = {
            f: getattr(self.counters, f)
            for f in LinkerHintCounters.__dataclass_fields__
        }
        out["leases"] = len(self.leases)
        out["lease_bytes"] = dict(self.held)
        if self.store is not None:
            out["store_hinted_pages"] = self.store.hinted_pages
            out["store_hints_failed"] = self.store.hints_failed
        return out

    def _take(self, lease: LinkerLease) -> None:
        have = set(lease.pinned)
        fresh = [k for k in dict.fromkeys(lease.keys) if k not in have]
        lease.pinned += self.index.pin(fresh)

    def _drop(self, lease: LinkerLease) -> None:
        del self.leases[lease.id]
        if lease.asked:
            self.held[lease.tenant] -= lease.asked
            if not self.held[lease.tenant]:
                del self.held[lease.tenant]
        if lease.pinned:
            self.index.unpin(lease.pinned)
        lease.pinned = []
        if lease.store:  # its pages other leases hold keep theirs
            self._tell_store(lease.keys, None)

    def _tell_store(self, keys: Sequence[str], priority: int | None) -> None:
        """Tell the store, for the pages of `keys`, the lease each keeps now (and
        `priority`: a `retain`'s; None keeps the pages' own, so a pin, a release or an
        expiry never undoes a retain): the longest time left of the live store leases
        holding the page, None where none does (its lease ends), in runs of pages alike
        (the rule `TieredCache`'s hints follow, kvtier/cache/hints.py)."""
        if self.store is None or not self.tells_store:
            return
        keys = list(dict.fromkeys(keys))
        now, left = self.clock(), dict.fromkeys(keys)
        for lease in self.leases.values():
            if not lease.store:
                continue
            t = max(lease.expires - now, 0.001)
            for k in lease.keys:
                if k in left and (left[k] is None or left[k] < t):
                    left[k] = t
        a = 0
        for b in range(1, len(keys) + 1):
            if b == len(keys) or left[keys[b]] != left[keys[a]]:
                self.store.hint(keys[a:b], left[keys[a]], priority)
                self.counters.store_hints += 1
                a = b


class PoolHints:
    """A hybrid model's hints (pools.py): one lease pins, in every pool, the pages a
    restore of the prefix at its full length needs: the KV pool's every page, and each side
    pool's `windows[name]` pages ending there (SWA: the window; Mamba: the state at the
    last page; None: every page). Each pool's lease is its own `LinkerHints`' (its host
    index, bound and store), all of them made, released and retained together; a pin that
    one pool's bound refuses pins in none. They end on the same clock with the same TTL,
    each as its core reaps (the scheduler's every step)."""

    def __init__(self, pools: dict[str, LinkerHints], windows: dict[str, int | None]):
        self.pools = pools  # the KV pool's first
        self.windows = windows
        self.kv = next(iter(pools.values()))

    def _parts(self, what: str, keys: Sequence[str]) -> list[tuple[LinkerHints, list]]:
        keys = _keys(what, keys)
        parts = [(self.kv, keys)]
        for name, hints in list(self.pools.items())[1:]:
            window = self.windows.get(name)
            parts.append((hints, keys[-window:] if window else keys))
        return parts

    def pin(
        self,
        keys: Sequence[str],
        ttl_s: float,
        tiers=("host",),
        tenant: str = "default",
    ) -> LinkerLease:
        """Every pool's lease (the KV pool's is returned), or none of them."""
        check_ttl(ttl_s)
        tiers = tiers if isinstance(tiers, str) else tuple(tiers)  # read once a pool
        parts = self._parts("pin", keys)
        for hints, part in parts:
            hints.admit(part, tiers, tenant)
        return [hints.pin(part, ttl_s, tiers, tenant) for hints, part in parts][0]

    def release(
        self, keys: Sequence[str] | None, tenant: str | None = "default"
    ) -> int:
        """Every pool's leases of the prefix `keys` (None: all); the KV pool's count."""
        if keys is None:
            return [h.release(None, tenant) for h in self.pools.values()][0]
        return [h.release(part, tenant) for h, part in self._parts("release", keys)][0]

    def release_all(self) -> int:
        return self.release(None, None)

    def retain(self, keys: Sequence[str], priority: int) -> None:
        for hints, part in self._parts("retain", keys):
            hints.retain(part, priority)

    def prefetch(self, keys: Sequence[str]) -> bool:
        return self.kv.prefetch(keys)

    def demote(self, keys: Sequence[str]) -> int:
        return self.kv.demote(keys)

    def poll(self) -> None:
        for hints in self.pools.values():
            hints.poll()

    def stats(self) -> dict:
        """The KV pool's, and every pool's under `pools`."""
        out = self.kv.stats()
        out["pools"] = {name: h.stats() for name, h in self.pools.items()}
        return out


def _keys(what: str, keys) -> list[str]:
    if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"{what}: keys: expected a list of non-empty page key strings")
    if not keys:
        raise ValueError(f"{what}: keys: empty; name the prefix's pages")
    return list(keys)
