"""HybridTieredCache: `TieredCache` for a hybrid model, whose layers keep FULL KV, SWA KV
and/or a recurrent (Mamba) state (docs/design.md, "Hybrid models: components"). Its tree
is a `HybridRadixTree`; each component has its own pool, mirror and slot allocators
(`cache/components.py`); the one controller moves every component's slots in the same
two-phase ops as FULL KV: a node's write carries its SWA KV and state with its FULL KV, a
request's load carries its window and state with its FULL KV, landing per model layer.

The sequence is `TieredCache`'s, with what a hybrid forward needs besides FULL slots:

    got = cache.acquire(tokens, rid)       # HybridAcquired: FULL slots as before, plus
                                           #   swa_indices (SWA slots of [swa_start, L)) and
                                           #   state_slot (the request's own slot holding the
                                           #   state after exactly L = len(got.indices) tokens)
    slots = cache.alloc(n)                 # FULL slots, as before
    swa = cache.alloc_swa(n)               # SWA slots for n more tokens (whole pages)
    snap = cache.alloc_state(rid)          # a state slot of the request's (a snapshot's target)
    waiter = cache.begin_forward([rid]); waiter.wait_layer(i)   # i: the MODEL's layer index
    cache.cache_finished(rid, tokens, kv, swa_indices=swa_row, mamba_slot=snap)
    cache.abort(rid, kv, swa_indices=swa_row)                   # frees every component's slots

Who owns a side slot (as for FULL, kvtier/README.md "Who owns a slot"):

| slot | owner |
|---|---|
| SWA slots in `got.swa_indices[:got.swa_tree_len]` | the tree (locked for the request) |
| the rest of `got.swa_indices`, `alloc_swa` slots | the request: it passes them back in its SWA row |
| `got.state_slot`, `alloc_state(rid)` slots | the request (the cache keeps the list: a finish or abort frees them) |
| `mamba_slot` given to a finish | the tree (or freed, if the tree had a state there) |

A hit of length L is one every component accepts: FULL KV of [0, L), the SWA KV of the
window [L - W, L) (W rounded up to pages) and the state at exactly L, each on device or
host; a host part is loaded into slots the request owns. A full-attention caller sees
`TieredCache` unchanged: build a `TieredCache` for a FULL-only model. The store
prefetches of hybrid requests live in `cache/hybrid_prefetch.py`.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kvtier.cache.components import SideSlots
from kvtier.cache.facade import Acquired, TieredCache
from kvtier.cache.hybrid_prefetch import HybridPrefetches, SidePrefetch
from kvtier.cache.requests import Held
from kvtier.cache.side_ops import HybridLoads, HybridWrites
from kvtier.config import load_config
from kvtier.controller.config import WritePolicy
from kvtier.controller.controller import ComponentCopy
from kvtier.hashing import key_maker
from kvtier.storeio.writes import Manifest
from kvtier.tiers.components import Component, ComponentSpec
from kvtier.tiers.indices import check_size, check_slots, concat, tensor
from kvtier.tiers.streams import make_stream
from kvtier.tree import HybridRadixTree, Tier
from kvtier.tree.radix import joined_slots

D, H = Tier.DEVICE, Tier.HOST
_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(slots=True, frozen=True)
class HybridAcquired(Acquired):
    """`Acquired` (FULL: `indices`, hits per tier) plus the side components of the prefix,
    L = len(indices) tokens. `device_hit` counts the tokens every component had on device,
    `host_hit` the tokens found on host, `storage_hit` those a store prefetch brought (every
    component of them restorable from it: `controller/side_prefetch.py`); the tree's locked FULL
    slots at the front of `indices` may reach past `device_hit` (FULL KV on device whose
    window or state came from host).

    - `swa_indices`: SWA slots of tokens [swa_start, L), swa_start = max(0, L - W) with W
      the window rounded up to whole pages (empty without SWA, or when L is 0). The first
      `swa_tree_len` are the tree's (locked until the finish/abort; never write them), the
      rest the request's (loaded or copied from host/device into slots it owns).
    - `state_slot`: a state-pool slot the request owns, holding the recurrent state after
      exactly L tokens (zeros when L is 0); the forward advances it in place. None without
      MAMBA, or while not ready.
    """

    swa_indices: torch.Tensor = field(
        default_factory=lambda: torch.empty(0, dtype=torch.int64)
    )
    swa_start: int = 0
    swa_tree_len: int = 0
    state_slot: int | None = None


@dataclass(eq=False)
class SideHeld:
    """What a request holds of the side components: its window [swa_start, L) (`handed`:
    the first `swa_tree_len` the tree's, the rest its own, those in `copied` filled on the
    scheduler thread, the others by its load), and its state slots (the first, from
    `acquire`, the working slot its forward advances)."""

    swa_start: int
    swa_tree_len: int
    handed: np.ndarray
    copied: np.ndarray
    state_slots: list[int]
    row: np.ndarray | None = (
        None  # its SWA row at a finish (an abort from there frees it)
    )


class HybridTieredCache(HybridPrefetches, TieredCache):
    def __init__(
        self,
        config,
        components: Mapping[Component, ComponentSpec],
        layers: Sequence[Component],
        tp_group=None,
        store=None,
        stream_factory=make_stream,
        clock=time.monotonic,
        agreement=None,
    ) -> None:
        """`config` as for `TieredCache` (its `pool` is replaced by the FULL spec's pool);
        `components`: the model's `ComponentSpec` per component (FULL and at least one
        side component; e.g. `HybridModel.component_specs(...)`); `layers`: the component
        of each model layer, bottom up (`Component.FULL` for a full-attention layer, `SWA`
        for a sliding-window one, `MAMBA` for a recurrent one): `begin_forward`'s waiter
        counts the model's layers and a load lands layer i's component data before
        `wait_layer(i)` returns. One rank (no tensor parallelism). The store keeps every
        component's pages, each under its namespace (`tiers/components.py`; store pages of
        one device page: with `store.page_tokens` > page_size it keeps FULL pages only and
        a hybrid request is not prefetched from it)."""
        self._specs = _check_specs(components)
        self._plan = _layer_plan(layers, self._specs)
        swa = self._specs.get(Component.SWA)
        self._window = None if swa is None else swa.window
        super().__init__(
            replace(config, pool=self._specs[Component.FULL].pool),
            tp_group,
            store,
            stream_factory,
            clock,
            agreement,
        )
        if self.agreement.world_size > 1:
            self.close()
            raise ValueError(
                "HybridTieredCache: one rank only (tensor parallelism is not supported)"
            )

    @classmethod
    def from_yaml(
        cls, path: str, components, layers, tp_group=None, **overrides
    ) -> HybridTieredCache:
        """`TieredCache.from_yaml` with the model's components and layer plan."""
        return cls(load_config(path, overrides), components, layers, tp_group)

    def _new_tree(self, *args) -> HybridRadixTree:
        return HybridRadixTree(
            *args, components=tuple(self._specs), swa_window=self._window
        )

    def _wire(self, device_allocator, clock) -> None:
        self.side = SideSlots(
            self._specs, self.config.mirror, self.tree, self.controller
        )
        self._side_held: dict[str, SideHeld] = {}
        # per side component: its store namespace's key maker and manifest
        self._side_store = {}
        prefix = self.config.store.key_prefix
        for c, side in self.side.sides.items():
            if side.mirror is None or self.controller.storage is None:
                continue
            ns = self._specs[c].namespace(self.namespace)
            manifest = Manifest(prefix, ns.id, ns.manifest(side.mirror.page_bytes))
            self._side_store[c] = (key_maker(prefix, ns.id), manifest)
        # what restores read of each side component, per tier it came from (SWA in tokens,
        # MAMBA in states): stats()["components"]
        self._side_hits = {
            (c, t): 0 for c in self.side.sides for t in ("device", "host")
        }
        self._prefetches: dict[str, SidePrefetch] = {}  # store prefetches, by request
        self._named: list[str] = []  # requests named ready outside a poll (a drain)
        self._storage_span = (0, 0)
        super()._wire(device_allocator, clock)

    def _new_writes(self, *args) -> HybridWrites:
        return HybridWrites(self.side, self._side_store, *args)

    def _new_loads(self, *args) -> HybridLoads:
        return HybridLoads(self.side, *args)

    def _forward_layers(self) -> int:
        return len(self._plan)

    def component_pool(self, component: Component):
        """The device pool of `component` (FULL: `self.pool`)."""
        c = Component.parse(component)
        if c == Component.FULL:
            return self.pool
        if c not in self.side:
            raise ValueError(f"component={component!r}: this cache has no {c.value}")
        return self.side.pool(c)

    # -- side slots for requests --------------------------------------------------------------

    def alloc_swa(self, n: int) -> torch.Tensor | None:
        """Whole pages of SWA slots for `n` more tokens (the tail of the last page after
        them), evicting SWA KV on demand; None if short. The request's own: it lists them
        in its SWA row at its finish or abort."""
        self._check_open("alloc_swa")
        self._need(Component.SWA, "alloc_swa")
        pages = -(-check_size("alloc_swa: n", n, minimum=0) // self.page_size)
        slots = self.side.alloc_device(Component.SWA, pages * self.page_size)
        return None if slots is None else tensor(slots)

    def free_swa(self, indices: torch.Tensor) -> None:
        """Give back SWA slots of the request's own (from `alloc_swa`)."""
        self._need(Component.SWA, "free_swa")
        self._free_swa(check_slots("free_swa: indices", indices))

    def _free_swa(self, slots: np.ndarray) -> None:
        if slots.size:
            pages = np.unique(slots // self.page_size)
            self.side.sides[Component.SWA].allocator.free_slots(slots)
            self.side.take_back(Component.SWA, pages.size * self.page_size)

    def alloc_state(self, request_id: str) -> int | None:
        """One state slot for the request (e.g. the target of the snapshot at the aligned
        end that its finish passes as `mamba_slot`), evicting states on demand; None if
        short. Its finish or abort frees it unless the tree took it."""
        self._check_open("alloc_state")
        self._need(Component.MAMBA, "alloc_state")
        sh = self._side_held.get(request_id)
        if sh is None:
            raise ValueError(
                f"alloc_state: request_id={request_id!r} holds nothing (acquire it first)"
            )
        slots = self.side.alloc_device(Component.MAMBA, 1)
        if slots is None:
            return None
        sh.state_slots.append(int(slots[0]))
        return int(slots[0])

    def _need(self, component: Component, what: str) -> None:
        if component not in self.side:
            raise ValueError(f"{what}: this cache has no {component.value} component")

    # -- acquire ------------------------------------------------------------------------------

    def acquire(
        self, tokens, request_id: str, extra_key: str | None = None
    ) -> HybridAcquired:
        """`TieredCache.acquire`, with the restore of every component the match needs:
        the FULL path, the SWA window ending at the match and the state at it. The FULL
        device path is locked; the window's and the state's device parts are used in
        place under that lock (or copied into the request's slots), their host parts (and
        the host FULL path) loaded in one load op per request whose layer i lands before
        `wait_layer(i)`. Never waits: as `TieredCache.acquire`, a first call may start a
        store prefetch of what lies past the match (every component up to the longest
        length each can restore, `controller/side_prefetch.py`) and return `ready=False`,
        holding nothing; a later `poll()` names the request, then acquire it again. The
        prefetch runs to its end (the prefetch policy's early go-ahead is not applied)."""
        self._check_open("acquire")
        if not isinstance(request_id, str):
            raise ValueError(f"acquire: request_id={request_id!r}: must be a str")
        if request_id in self.requests:
            raise ValueError(
                f"acquire: request_id={request_id!r} already holds a prefix; finish or abort it first"
            )
        p = self._prefetches.get(request_id)
        if p is not None and not (p.applied and not p.discarded):
            p.awaited = p.awaited or p.discarded
            return HybridAcquired(False, torch.empty(0, dtype=torch.int64))
        key = self.key(tokens, extra_key)
        if p is None:
            m = self.tree.match_prefix(key)
            if self._start_prefetch(request_id, key, m):
                return HybridAcquired(False, torch.empty(0, dtype=torch.int64))
            self._storage_span = (0, 0)
        else:
            del self._prefetches[request_id]
            m = self.tree.match_prefix(key, touch=False)
            self._storage_span = p.span
        try:
            if (
                self.config.controller.write_policy
                == WritePolicy.WRITE_THROUGH_SELECTIVE
            ):
                self.writes.write_hot_path(m.last_device_node)
            got = self._restore(request_id, key, m.last_host_node, m.device_slots.size)
            if got is None:  # short of room for the host part: the device part alone
                m = self.tree.match_prefix(key, touch=False)  # the try may have evicted
                got = self._restore(
                    request_id, key, m.last_device_node, m.device_slots.size
                )
        finally:
            if p is not None:
                self._release_held(p)
        if got is None:
            raise RuntimeError(
                f"acquire: request_id={request_id!r}: no free state slot "
                f"({self.side.pool(Component.MAMBA).config.size} in the state pool, all "
                "held by requests or locked); finish or abort requests first"
            )
        return got

    def _restore(self, request_id: str, key, node, device_hit: int):
        """Hold the prefix ending at `node` for the request (module docstring); None, with
        nothing held, if the device is short of room for it."""
        tree, root = self.tree, self.tree.root
        length = 0 if node is root else node.end
        chain = [] if node is root else tree.nodes_to_load(node)
        full_dev = chain[0].parent if chain else node
        self.lock(full_dev)
        pieces = self._window_pieces(node, length)
        state = self._state_piece(node)
        direct = full_dev is node and all(t == D for t, _ in pieces)
        pinned = [] if direct else [(Component.SWA, t, s) for t, s in pieces]
        if state is not None:
            pinned.append((Component.MAMBA, state[0], state[1]))
        for c, t, s in pinned:
            self.side.pin(c, t, s)
        own = self._alloc_own(pieces, direct)
        op = None
        if own is not None:
            op = self._load(node, chain, pieces, state, own, direct)
        for c, t, s in pinned:
            self.side.unpin(c, t, s)
        if op is False:  # FULL load short of room
            self._free_own(own)
            own = None
        if own is None:
            self.unlock(full_dev)
            return None
        for tier, slots in pieces:
            self._side_hits[(Component.SWA, tier.name.lower())] += slots.size
        if state is not None:
            self._side_hits[(Component.MAMBA, state[0].name.lower())] += 1
        return self._hold(request_id, key, node, full_dev, length, device_hit, own, op)

    def _window_pieces(self, node, length: int) -> list[tuple[Tier, np.ndarray]]:
        """The SWA slots of the window [length - W, length) ending at `node`, top-down,
        each from device if there, else from host."""
        if Component.SWA not in self.side or node is self.tree.root:
            return []
        lo = max(0, length - self.tree.wp)
        out = []
        for n in reversed(self.tree.window_nodes(node)):
            tier = D if n.swa[D] is not None else H
            out.append((tier, n.swa[tier][max(lo - n.start, 0) :]))
        return out

    def _state_piece(self, node) -> tuple[Tier, np.ndarray] | None:
        if Component.MAMBA not in self.side or node is self.tree.root:
            return None
        tier = D if node.mamba[D] is not None else H
        assert node.mamba[tier] is not None, (
            f"a match ended at {node}, which has no state"
        )
        return tier, np.array([node.mamba[tier]], dtype=np.int64)

    def _alloc_own(self, pieces, direct: bool) -> dict | None:
        """The request's own side slots: its window (unless it reads the tree's in place)
        and its state slot; None (nothing held) if short."""
        own = {}
        if Component.MAMBA in self.side:
            st = self.side.alloc_device(Component.MAMBA, 1)
            if st is None:
                return None
            own[Component.MAMBA] = st
        n = 0 if direct else sum(s.size for _, s in pieces)
        if n:
            swa = self.side.alloc_device(Component.SWA, n)
            if swa is None:
                self._free_own(own)
                return None
            own[Component.SWA] = swa
        return own

    def _free_own(self, own: dict) -> None:
        for c, slots in own.items():
            self.side.free_request(c, slots)

    def _load(self, node, chain, pieces, state, own, direct):
        """Copy the device parts into the request's slots now; start the load of the host
        parts (FULL path, window, state). The load op, None if nothing is on host, False
        if the device is short of room for the FULL part."""
        extras, at = [], 0
        if pieces and not direct:
            dst = own[Component.SWA]
            for tier, src in pieces:
                mine = dst[at : at + src.size]
                at += src.size
                if tier == D:
                    self._copy_swa(src, mine)
                else:
                    extras.append(ComponentCopy(Component.SWA, mine, src))
        if state is not None:
            tier, src = state
            if tier == D:
                self.side.pool(Component.MAMBA).copy_states(
                    tensor(src), tensor(own[Component.MAMBA])
                )
            else:
                extras.append(ComponentCopy(Component.MAMBA, own[Component.MAMBA], src))
        elif Component.MAMBA in own:  # nothing cached: the state before any token
            pool = self.side.pool(Component.MAMBA)
            for layer in range(pool.num_layers):
                pool.state_buffer(layer)[int(own[Component.MAMBA][0])] = 0
        if not chain and not extras:
            return None
        op = self.loads.start_hybrid(node if chain else None, extras, self._plan)
        return False if op is None else op

    def _copy_swa(self, src: np.ndarray, dst: np.ndarray) -> None:
        pool = self.side.pool(Component.SWA)
        s, d = tensor(src), tensor(dst)
        for rows in pool.all_layer_rows():
            rows[:, d] = rows[:, s]

    def _hold(self, rid, key, node, full_dev, length, device_hit, own, op):
        tree_len = 0 if full_dev is self.tree.root else full_dev.end
        load = op or None
        held = Held(full_dev, tree_len, load, key, None)
        self.requests.hold(rid, held)
        loaded = held.loaded
        self.requests.hand_out(loaded // self.page_size)
        extras = () if load is None else load.extras
        loaded_swa = {
            int(x)
            for e in extras
            for x in e.device_slots
            if e.component == Component.SWA
        }
        swa_own = own.get(Component.SWA, _EMPTY)
        copied = np.array(
            [x for x in swa_own.tolist() if x not in loaded_swa], dtype=np.int64
        )
        swa_start = max(0, length - self.tree.wp) if Component.SWA in self.side else 0
        if Component.SWA in own:
            handed, tree_swa = swa_own, 0
        else:  # the tree's, in place: locked with the FULL path (`direct`)
            pieces = self._window_pieces(node, length)
            handed = joined_slots([s for _, s in pieces]) if pieces else _EMPTY
            tree_swa = handed.size
        st = own.get(Component.MAMBA)
        self._side_held[rid] = SideHeld(
            swa_start,
            tree_swa,
            concat([handed]) if handed.size else _EMPTY,
            copied,
            [] if st is None else [int(st[0])],
        )
        lo, hi = self._storage_span
        storage = max(0, min(length, hi) - max(device_hit, lo))
        self._count_lookup(len(key), device_hit, length - device_hit - storage, storage)
        full = joined_slots(self._path_slots(full_dev))
        slots = full if load is None else concat([full, load.device_slots])
        assert slots.size == length, (
            f"acquire: {slots.size} FULL slots for {length} tokens"
        )
        return HybridAcquired(
            True,
            tensor(concat([slots]) if slots.size else _EMPTY),
            device_hit,
            length - device_hit - storage,
            storage,
            tensor(self._side_held[rid].handed),
            swa_start,
            tree_swa,
            None if st is None else int(st[0]),
        )

    def _path_slots(self, node) -> list[np.ndarray]:
        out = []
        while node is not self.tree.root:
            out.append(node.values[D])
            node = node.parent
        return out[::-1]

    # -- the store ----------------------------------------------------------------------------

    def poll(self) -> list[str]:
        """`TieredCache.poll`, and the store prefetches of hybrid requests that ended."""
        ready = super().poll()
        named, self._named = self._named, []
        return ready + named + self._apply_prefetches()

    def drain(self) -> None:
        self._check_open("drain")
        self._end_prefetches()
        super().drain()

    def flush(self) -> None:
        self._end_prefetches()
        # refused as `TieredCache.flush` is, before what waiting requests hold is released
        locked = self.requests.locked_tokens()
        if locked:
            raise ValueError(
                f"flush: {locked} device tokens are locked by requests; finish them first"
            )
        for p in self._prefetches.values():  # flushed too: their requests miss
            self._release_held(p)
        super().flush()

    def close(self) -> None:
        if not self.closed:
            self._end_prefetches()
            for p in self._prefetches.values():
                self._release_held(p)
        super().close()

    # -- finishing a request ------------------------------------------------------------------

    def cache_finished(
        self,
        request_id: str,
        tokens,
        kv_indices: torch.Tensor,
        extra_key: str | None = None,
        priority: int = 0,
        *,
        swa_indices: torch.Tensor | None = None,
        mamba_slot: int | None = None,
    ) -> None:
        """`TieredCache.cache_finished`, plus: `swa_indices`, the request's SWA row for
        tokens [swa_start, len(tokens)) (what `acquire` handed, then its own `alloc_swa`
        slots; the tail of the last page may follow), required with SWA; `mamba_slot`, a
        state slot of the request's holding the state after exactly the page-aligned
        length (None: no state is kept, the prefix is then a hit only up to an earlier
        state). Every other side slot the request owns is freed."""
        self._check_open("cache_finished")
        held = self.requests.require(request_id, "cache_finished")
        sh = self._side_held[request_id]
        key = self.key(tokens, extra_key)
        kv = self._row("cache_finished", kv_indices, len(key))
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ValueError(
                f"cache_finished: priority={priority!r}: must be an integer"
            )
        held.check_finish("cache_finished", request_id, key, kv, self.slots)
        row = self._swa_row("cache_finished", request_id, sh, swa_indices, len(key))
        self._check_state("cache_finished", request_id, sh, mamba_slot)
        aligned = len(key) - len(key) % self.page_size
        if (
            mamba_slot is not None
            and aligned != len(key)
            and int(mamba_slot) == sh.state_slots[0]
        ):
            raise ValueError(
                f"cache_finished: mamba_slot={mamba_slot!r} is the request's working state "
                f"slot, which holds the state after all {len(key)} tokens, not after the "
                f"page-aligned {aligned} the tree keeps: pass a snapshot taken at {aligned} "
                "(alloc_state), or None"
            )
        sh.row = row
        self._check_load(request_id, held, kv)
        given = _EMPTY if row is None else row[: aligned - sh.swa_start]
        r = self.tree.insert(
            key[:aligned],
            kv[:aligned],
            priority,
            held.known_hashes(key, self.page_size),
            swa_indices=None if row is None else given,
            swa_start=sh.swa_start,
            mamba_slot=mamba_slot,
        )
        self._give_back(kv, held.tree_len, r.prefix_len, aligned, len(key))
        if row is not None:  # the tree took or freed [swa_tree_len, aligned)
            self.side.take_back(Component.SWA, given.size - sh.swa_tree_len)
            self._free_swa(row[aligned - sh.swa_start :])
        self._free_states(sh, mamba_slot)
        self.unlock(held.node)
        self.requests.release(request_id)
        del self._side_held[request_id]
        self.writes.after_insert(r.added)
        self.writes.after_finish(r.last_node, sh.swa_start)

    def _swa_row(self, what, request_id, sh: SideHeld, swa_indices, tokens: int):
        """The request's SWA row, checked before anything changes (as its FULL row)."""
        if Component.SWA not in self.side:
            if swa_indices is not None:
                raise ValueError(
                    f"{what}: swa_indices: this cache has no swa component"
                )
            return None
        if swa_indices is None:
            raise ValueError(
                f"{what}: request_id={request_id!r}: swa_indices is required (its SWA row "
                f"for tokens [{sh.swa_start}, {tokens}))"
            )
        row = check_slots(f"{what}: swa_indices", swa_indices)
        want = tokens - sh.swa_start
        whole = -(-tokens // self.page_size) * self.page_size - sh.swa_start
        if not want <= row.shape[0] <= whole:
            raise ValueError(
                f"{what}: swa_indices: expected {want} indices (tokens [{sh.swa_start}, "
                f"{tokens}), up to {whole} with the tail of the last page), got {row.shape[0]}"
            )
        n = sh.handed.size
        if row[:n].tobytes() != sh.handed.tobytes():
            raise ValueError(
                f"{what}: request_id={request_id!r}: swa_indices[:{n}] are not the SWA "
                "slots acquire handed it"
            )
        alloc = self.side.sides[Component.SWA].allocator
        bad = alloc.unallocated(row[n:])
        if bad.size:
            raise ValueError(
                f"{what}: swa_indices {bad[:8].tolist()} are not allocated (freed, or "
                "never from alloc_swa)"
            )
        mine = row[sh.swa_tree_len : want]
        if np.unique(mine).size != mine.size:
            raise ValueError(f"{what}: swa_indices lists a slot more than once")
        return row[:want]

    def _check_state(self, what, request_id, sh: SideHeld, mamba_slot) -> None:
        if mamba_slot is None:
            return
        if Component.MAMBA not in self.side:
            raise ValueError(f"{what}: mamba_slot: this cache has no mamba component")
        if (
            isinstance(mamba_slot, bool)
            or not isinstance(mamba_slot, numbers.Integral)
            or int(mamba_slot) not in sh.state_slots
        ):
            raise ValueError(
                f"{what}: mamba_slot={mamba_slot!r}: not a state slot of request "
                f"{request_id!r} (its slots: {sh.state_slots})"
            )

    def _free_states(self, sh: SideHeld, keep: int | None) -> None:
        """The request's state slots leave it: `keep` to the tree, the rest freed."""
        rest = [s for s in sh.state_slots if s != keep]
        if keep is not None:
            self.side.take_back(Component.MAMBA, 1)
        if rest:
            self.side.free_request(Component.MAMBA, np.array(rest, dtype=np.int64))

    def abort(
        self,
        request_id: str,
        kv_indices: torch.Tensor | None = None,
        *,
        swa_indices: torch.Tensor | None = None,
    ) -> None:
        """`TieredCache.abort`, plus: the request's SWA row (its own slots in it are
        freed; the tree's are unlocked) and every state slot the request owns. Without
        the row, the window `acquire` handed is freed but `alloc_swa` slots are not."""
        p = self._prefetches.get(request_id)
        if p is not None:  # what it landed stays on host for others
            if p.applied:
                self._release_held(p)
                del self._prefetches[request_id]
            else:
                p.discarded = p.op.stop = True
        sh = self._side_held.get(request_id)
        row = None
        if sh is not None and swa_indices is not None:
            row = check_slots("abort: swa_indices", swa_indices)
            n = sh.handed.size
            if row.shape[0] < n or row[:n].tobytes() != sh.handed.tobytes():
                raise ValueError(
                    f"abort: request_id={request_id!r}: swa_indices do not start with the "
                    f"{n} SWA slots acquire handed it"
                )
        held = self.requests.get(request_id)
        super().abort(request_id, kv_indices)  # the load's side slots go with it
        if sh is None or held is None:
            return
        del self._side_held[request_id]
        if row is None:
            row = sh.row
        if sh.copied.size:
            self._free_swa(sh.copied)
        if row is not None and row.shape[0] > sh.handed.size:
            self._free_swa(row[sh.handed.size :])
        loaded = (
            set()
            if held.load is None
            else {
                int(e.device_slots[0])
                for e in held.load.extras
                if e.component == Component.MAMBA
            }
        )
        rest = [s for s in sh.state_slots if s not in loaded]
        if rest:
            self.side.free_request(Component.MAMBA, np.array(rest, dtype=np.int64))

    def cache_unfinished(
        self,
        request_id: str,
        tokens,
        kv_indices: torch.Tensor,
        extra_key: str | None = None,
        *,
        swa_indices: torch.Tensor | None = None,
        mamba_slot: int | None = None,
    ) -> HybridAcquired:
        """Chunked prefill: keep the page-aligned KV so far, as `cache_finished` takes it
        (`swa_indices`: the request's SWA row for [swa_start, len(tokens)); `mamba_slot`:
        the state after exactly the aligned length, required with MAMBA), and hold the
        request on it. Returns the request's prefix anew, as from `acquire`: `indices` the
        canonical FULL slots of [0, aligned) (repoint the row to them), `swa_indices` the
        tree's SWA slots of the window ending there (repoint those positions; its row's
        SWA slots past `aligned` stay its own and follow them in its next row), and its
        working `state_slot`, unchanged."""
        self._check_open("cache_unfinished")
        held = self.requests.require(request_id, "cache_unfinished")
        sh = self._side_held[request_id]
        key = self.key(tokens, extra_key)
        kv = self._row("cache_unfinished", kv_indices, len(key))
        held.check_finish("cache_unfinished", request_id, key, kv, self.slots)
        row = self._swa_row("cache_unfinished", request_id, sh, swa_indices, len(key))
        self._check_state("cache_unfinished", request_id, sh, mamba_slot)
        aligned = len(key) - len(key) % self.page_size
        if mamba_slot is not None and int(mamba_slot) == sh.state_slots[0]:
            raise ValueError(
                f"cache_unfinished: mamba_slot={mamba_slot!r} is the request's working "
                "state slot (its forward goes on from it): pass a snapshot (alloc_state)"
            )
        if Component.MAMBA in self.side and mamba_slot is None and aligned:
            raise ValueError(
                f"cache_unfinished: request_id={request_id!r}: mamba_slot is required (the "
                f"state after exactly {aligned} tokens: the prefix it holds on ends there)"
            )
        sh.row = row
        self._check_load(request_id, held, kv)
        given = _EMPTY if row is None else row[: aligned - sh.swa_start]
        r = self.tree.insert(
            key[:aligned],
            kv[:aligned],
            swa_indices=None if row is None else given,
            swa_start=sh.swa_start,
            mamba_slot=mamba_slot,
        )
        self._give_back(kv, held.tree_len, r.prefix_len, aligned, aligned)
        if row is not None:
            self.side.take_back(Component.SWA, given.size - sh.swa_tree_len)
        if mamba_slot is not None:
            sh.state_slots.remove(int(mamba_slot))
            self.side.take_back(Component.MAMBA, 1)
        m = self.tree.match_prefix(key[:aligned], touch=False)
        assert m.device_slots.size == aligned, "a just-inserted chunk is not on device"
        node = m.last_device_node
        self.lock(node)
        self.unlock(held.node)
        self.requests.hold(request_id, Held(node, aligned, None, key[:aligned]))
        pieces = self._window_pieces(node, aligned)
        handed = joined_slots([s for _, s in pieces]) if pieces else _EMPTY
        handed = concat([handed]) if handed.size else _EMPTY
        swa_start = max(0, aligned - self.tree.wp) if Component.SWA in self.side else 0
        state = sh.state_slots[0] if sh.state_slots else None
        self._side_held[request_id] = SideHeld(
            swa_start, handed.size, handed, _EMPTY, sh.state_slots
        )
        self.writes.after_insert(r.added)
        self.writes.after_finish(r.last_node, sh.swa_start)
        return HybridAcquired(
            True,
            tensor(concat([m.device_slots]) if aligned else _EMPTY),
            aligned,
            0,
            0,
            tensor(handed),
            swa_start,
            handed.size,
            state,
        )

    # -- checks and numbers -------------------------------------------------------------------

    def stats(self) -> dict:
        """`TieredCache.stats`, plus per side component (`components`): what restores read
        from each tier (`hits_device`, `hits_host`: SWA tokens, states) and where its slots
        are (`device_free`, `device_tree`, `host_free`, `host_tree`); with a store, the
        pages its backups stored and failed to store (`store_write_pages`,
        `store_write_failures`; SWA pages, states)."""
        out = super().stats()
        comps = {}
        for c, side in self.side.sides.items():
            tree = self.tree
            entry = {
                "hits_device": self._side_hits[(c, "device")],
                "hits_host": self._side_hits[(c, "host")],
                "device_free": side.allocator.available_size(),
                "device_tree": tree.component_evictable_size(c, D)
                + tree.component_protected_size(c, D),
            }
            if side.mirror is not None:
                entry["host_free"] = self.controller.component_host_accounting(c).free
                entry["host_tree"] = tree.component_evictable_size(
                    c, H
                ) + tree.component_protected_size(c, H)
            if c in self.writes.side_stored:
                stored, failed = self.writes.side_stored[c]
                entry["store_write_pages"], entry["store_write_failures"] = (
                    stored,
                    failed,
                )
            comps[c.value] = entry
        out["components"] = comps
        return out

    def check_accounting(self) -> None:
        """`TieredCache.check_accounting`, and free + tree + requests + ops (+ deferred) ==
        total for every side component's pool and mirror."""
        super().check_accounting()
        problems = self.side.accounting_problems()
        if problems:
            raise AssertionError(
                "kvtier accounting broken:\n  " + "\n  ".join(problems)
            )


def _check_specs(components) -> dict[Component, ComponentSpec]:
    if not isinstance(components, Mapping):
        raise ValueError(
            f"components: expected a mapping of Component to ComponentSpec, got "
            f"{type(components).__name__}"
        )
    specs = {}
    for c, spec in components.items():
        c = Component.parse(c)
        if not isinstance(spec, ComponentSpec) or spec.component != c:
            raise ValueError(
                f"components[{c.value!r}]: expected the ComponentSpec of {c.value}, got {spec!r}"
            )
        specs[c] = spec
    if Component.FULL not in specs or len(specs) < 2:
        raise ValueError(
            f"components: {sorted(c.value for c in specs)}: a hybrid cache needs full and "
            "swa and/or mamba (a full-attention model uses TieredCache)"
        )
    full = specs[Component.FULL].pool.page_size
    swa = specs.get(Component.SWA)
    if swa is not None and swa.pool.page_size != full:
        raise ValueError(
            f"components['swa'].pool.page_size={swa.pool.page_size}: must equal the full "
            f"pool's page_size={full} (the tree keeps both per page)"
        )
    return {c: specs[c] for c in Component if c in specs}


def _layer_plan(layers, specs) -> list[tuple[Component, int]]:
    """Per model layer: its component and its layer in that component's pool."""
    if isinstance(layers, str) or not isinstance(layers, Sequence):
        raise ValueError(f"layers={layers!r}: expected a sequence of components")
    seen = dict.fromkeys(specs, 0)
    plan = []
    for c in layers:
        c = Component.parse(c)
        if c not in specs:
            raise ValueError(f"layers: {c.value!r} has no ComponentSpec in components")
        plan.append((c, seen[c]))
        seen[c] += 1
    for c, n in seen.items():
        if n != specs[c].pool.num_layers:
            raise ValueError(
                f"layers: {n} {c.value} layers, but its pool has num_layers="
                f"{specs[c].pool.num_layers}"
            )
    return plan
