"""The linker's engine-free core: host tier, store and copies behind SGLang's ten calls.

`KvtierLinker` (shell.py) translates SGLang's `PoolTransfer`s into these calls; the fault
simulator (kvtier/testing/linker_sim.py) makes them directly. Every call comes from
SGLang's scheduler thread; copies run on kvtier's transfer streams, store calls on the
storage thread (`StorageWorker`).

- `offload(keys, device_slots)`: copy the pages the host tier lacks device -> host (the
  write stream; SGLang keeps the node locked until the offload is consumed, so the device
  pages are stable while read). In order, `pop_completed_offload` publishes them on host
  and starts their write to the store (pinned until it settles).
- `lookup(rid, keys)`: pages restorable in chain order, no holes: the host run, then the
  store's leading run (one `batch_exists`, behind the breaker, never waited on past one
  timeout), then the host run again. It promises only what a load queued next can land:
  the store part and the host pages after it are capped at the host room a reservation
  could get then (free, or published and unpinned, less the host pages the load pins).
  A lookup pins nothing (SGLang says nothing when a matched request is aborted, so a pin
  would outlive it); the pages it found become the newest in the LRU. With store pages
  of several engine pages, the last lookup's host pages stay pinned until the next lookup
  or load (one lookup's at most): SGLang matches a request just before its load, and a
  host page evicted in between may be stored only inside a store page that ends past the
  request's pages, which its load could not read.
- `load(rid, keys, device_slots)`: queue; host pages are pinned, the rest are read from
  the store into reserved host pages at once (a storage-thread op). Always True for a
  well-formed call: SGLang needs the same answer on every rank, and a failure is reported
  by `finish_layer_wise_loading`, which SGLang agrees across ranks.
- `start_layer_wise_loading()`: one job for every queued load: wait for its store reads
  (all verified, or the job fails before writing a byte to the device), then copy layer by
  layer; `layer_done_counter.wait_until(i)` waits for layer i only.
- `finish_layer_wise_loading(i)`: until batch i stopped writing device memory; False if
  any page failed (SGLang aborts its requests; the slots are private to them). Pages read
  from the store become host pages when they verified.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.backends.base import Store
from kvtier.storeio.breaker import BreakerConfig
from kvtier.tiers.streams import TransferStream, make_stream
from kvtier.hashing import KeyedHash, Namespace
from kvtier.integrations.sglang.linker.hints import LinkerHints
from kvtier.integrations.sglang.linker.host_index import HostIndex
from kvtier.integrations.sglang.linker.loads import LayerCounter, Loads
from kvtier.integrations.sglang.linker.metrics import LinkerCounters
from kvtier.integrations.sglang.linker.offloads import Offloads
from kvtier.integrations.sglang.linker.store_io import LinkerStore
from kvtier.integrations.sglang.linker.store_ops import StoreOps
from kvtier.tiers.indices import slots_of
from kvtier.tiers.mirror import HostMirror, MirrorConfig
from kvtier.tiers.pool import DeviceKVPool

log = logging.getLogger(__name__)
LOOKED = 256  # store hits whose keys a load may still ask for (matched, not yet loaded)
StreamFactory = Callable[[str, torch.device], TransferStream]


@dataclass(slots=True, frozen=True)
class LinkerSettings:
    namespace: Namespace
    key_prefix: str = "kvtier"
    mirror: MirrorConfig = MirrorConfig()
    breaker: BreakerConfig = BreakerConfig()
    writes_store: bool = (
        True  # False on MLA ranks other than 0: rank 0 writes the shared pages
    )
    max_inflight_bytes: int = 256 << 20
    read_wait_s: float | None = (
        None  # a load's wait for its store reads; None: 4 store timeouts
    )
    cpus: frozenset[int] | None = None
    keyed_hash: KeyedHash | None = (
        None  # a tenant key's (docs/security.md): SGLang's page keys go through it
    )
    store_group: int = 1  # engine pages in a store page, on average (store_pages.py)


class LinkerCore:
    """SGLang's calls, each checked, then handed to the one part that owns its state:
    `index` (host pages and their pins), `offloads`, `loads`, `store_ops` (the store
    calls in flight). Nothing here but that wiring, the lookup that reads the index and
    the store, and the checks that sum the parts."""

    offloads_type: type[Offloads] = Offloads  # the fault simulator plants bugs in them
    loads_type: type[Loads] = Loads

    def __init__(
        self,
        pool: DeviceKVPool,
        settings: LinkerSettings,
        store: Store | None = None,
        *,
        streams: StreamFactory = make_stream,
        clock: Callable[[], float] = time.monotonic,
        forward_stream=None,
    ) -> None:
        self.pool, self.settings, self.store = pool, settings, store
        self.page_size = pool.config.page_size
        self.mirror = HostMirror(pool, settings.mirror)
        self.index = HostIndex(self.mirror.allocator)
        self.counters = LinkerCounters()
        write_stream = streams("linker-write", pool.device)
        load_stream = streams("linker-load", pool.device)
        l3 = (
            None
            if store is None
            else LinkerStore(store, self.mirror, settings, self.counters, clock)
        )
        self.hints = LinkerHints(  # hints.py
            self.index, self.mirror.page_bytes, clock, l3, settings.writes_store
        )
        self.store_ops = StoreOps(
            l3,
            self.index,
            self.counters,
            self.mirror.page_bytes,
            settings.writes_store,
        )
        self.offloads = self.offloads_type(
            pool,
            self.mirror,
            self.index,
            self.store_ops,
            self.counters,
            write_stream,
            forward_stream,
        )
        read_wait_s = (
            settings.read_wait_s
            if settings.read_wait_s is not None
            else 4 * (store.timeout_s if store is not None else 1.0)
        )
        self.loads = self.loads_type(
            pool,
            self.mirror,
            self.index,
            self.store_ops,
            self.counters,
            load_stream,
            read_wait_s,
        )
        self.closed = False
        # store pages of several engine pages: the keys of recent lookups (rid -> keys)
        self._looked: OrderedDict[str, Sequence[str]] = OrderedDict()
        # ... and the last lookup's host pages, pinned until the next lookup or load
        self._held: list[str] = []

    @property
    def l3(self) -> LinkerStore | None:
        return self.store_ops.l3

    @property
    def counter(self) -> LayerCounter:
        """SGLang's `layer_done_counter`."""
        return self.loads.counter

    # -- keys --------------------------------------------------------------------------------

    def _check(self, keys: Sequence[str], device_slots) -> np.ndarray:
        try:  # one C loop: a key that is not a string raises, an empty one reads 0
            good = not isinstance(keys, str) and all(map(str.__len__, keys))
        except TypeError:
            good = False
        if not good:
            raise ValueError(
                "keys: expected a list of SGLang page keys (non-empty strings)"
            )
        slots = slots_of(device_slots)
        if slots.shape[0] != len(keys) * self.page_size:
            raise ValueError(
                f"device_indices has {slots.shape[0]} slots for {len(keys)} pages; expected "
                f"{len(keys) * self.page_size} ({self.page_size} per page)"
            )
        return slots

    # -- offload -----------------------------------------------------------------------------

    def offload(self, keys: Sequence[str], device_slots) -> bool:
        slots = self._check(keys, device_slots)
        self._reap()
        self.offloads.offload(list(keys), slots)
        return True

    def num_completed_offloads(self) -> int:
        self._reap()
        return self.offloads.num_completed()

    def pop_completed_offload(self) -> bool:
        return self.offloads.pop_completed()

    # -- lookup ------------------------------------------------------------------------------

    def lookup(self, rid: str, keys: Sequence[str]) -> int:
        """Pages of `keys`, from the first, that a load queued next can restore."""
        self._reap()
        self._release_held()
        n = len(keys)
        index = self.index
        host, unpinned = index.run(keys)
        end, stored = host, 0
        if end < n and self.store_ops.l3 is not None:
            # the load pins the host run (out of the LRU), then reserves a page per store page
            room = index.room() - unpinned
            if room > 0:
                stored = self.store_ops.leading_run(keys[end:], room)
                end, _ = index.run(keys, end + stored, room - stored)
        if self.settings.store_group > 1:
            if stored:
                self._looked[rid] = (
                    keys  # a load of its first pages reads its store pages
                )
                while len(self._looked) > LOOKED:
                    self._looked.popitem(last=False)
            if end > stored:  # its host pages stay until its load pins them
                self._held = self.index.pin(keys[:end])
        c = self.counters
        c.lookups += 1
        c.lookup_pages += n
        c.host_hit_pages += end - stored
        c.store_hit_pages += stored
        return end

    # -- load --------------------------------------------------------------------------------

    def load(self, rid: str, keys: Sequence[str], device_slots) -> bool:
        slots = self._check(keys, device_slots)
        self._reap()
        around = self._looked.pop(rid, None)
        if around is not None and not (
            len(around) >= len(keys) > 0
            and around[0] == keys[0]
            and around[len(keys) - 1] == keys[-1]
        ):
            around = None
        self.loads.load(rid, list(keys), slots, around)
        self._release_held()  # the load pinned its host pages
        return True

    def _release_held(self) -> None:
        if self._held:
            self.index.unpin(self._held)
            self._held = []

    def cancel_queued_load(self, rid: str) -> bool:
        return self.loads.cancel(rid)

    def start_layer_wise_loading(self) -> int:
        return self.loads.start()

    def finish_layer_wise_loading(self, index: int) -> bool:
        return self.loads.finish(index)

    # -- lifecycle ---------------------------------------------------------------------------

    def quiesce(self) -> None:
        """Every copy and store call this linker started has ended and been applied."""
        self.loads.quiesce()
        self.offloads.quiesce()
        self.store_ops.quiesce()

    def _reap(self) -> None:
        """Settle what the storage thread finished (`StoreOps.reap`); hint leases expire
        or take what arrived (`hints.py`)."""
        self.hints.poll()
        self.store_ops.reap()

    def reset(self) -> None:
        """Quiesce, then drop the host tier (the store keeps its pages). A store call that
        outlived its timeout keeps its pages until it ends (`StoreOps.reap` then frees them)."""
        self.quiesce()
        running = self.store_ops.running()
        if running:
            log.warning(
                "kvtier linker: reset with %d store calls still running; their pages wait for them",
                running,
            )
        self.hints.release_all()
        self._release_held()
        self.index.clear()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.reset()
        self.offloads.close()
        self.loads.close()
        self.store_ops.close()

    # -- checks and numbers ------------------------------------------------------------------

    def check_accounting(self) -> list[str]:
        """Host pages: free + published + reserved == total, and every reserved page has
        exactly one owner op (the parts' sum); pins equal what their owners hold (loads and
        store writes)."""
        problems = self.index.check()
        owned = (
            self.offloads.reserved() + self.loads.reserved() + self.store_ops.reserved()
        )
        if sorted(owned) != sorted(self.index.reserved):
            problems.append(
                f"reserved host pages {sorted(self.index.reserved)[:8]}... are not those ops hold "
                f"{sorted(owned)[:8]}..."
            )
        held: dict[str, int] = {}
        for keys in [
            self._held,
            *self.store_ops.pinned(),
            *self.loads.pinned(),
            *self.hints.pinned(),
        ]:
            for k in keys:
                held[k] = held.get(k, 0) + 1
        if held != self.index.pins:
            problems.append(
                "host pins differ from what lookups, loads and store writes hold"
            )
        return problems

    def stats(self) -> dict:
        alloc = self.mirror.allocator
        out = {
            "counters": self.counters.as_dict(),
            "host": {
                "pages_total": alloc.num_pages,
                "pages_free": alloc.available_size() // self.page_size,
                "pages_published": len(self.index.pages),
                "pages_pinned": len(self.index.pins),
                "pages_evicted": self.index.evicted_pages,
                "pages_quarantined": self.store_ops.quarantined_pages(),
            },
            "queues": {
                "offloads": len(self.offloads.ops),
                "loads_queued": len(self.loads.queued),
                "loads_started": len(self.loads.started),
                "store_writes": len(self.store_ops.backups),
            },
            "namespace": self.settings.namespace.id,
            "hints": self.hints.stats(),
        }
        if self.store_ops.l3 is not None:
            out["store"] = self.store_ops.stats()
        return out
