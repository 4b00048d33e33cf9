"""The radix tree of a hybrid model: FULL KV plus SWA KV and/or Mamba states per node
(docs/design.md, "Hybrid models: components").

Everything `RadixTree` does holds for the FULL component; this subclass adds, per node and
tier, the side components and their rules:

- match: a node counts only where every component accepts it. FULL: its KV is on the tier
  (any tier: on device or host). SWA: the `swa_window` tokens that end there (or all of
  them, from the root) hold SWA KV on the tier. MAMBA: a state was stored at exactly that
  node. `last_device_node` is the deepest node all accept on device, `last_host_node`
  (= `best_match_node`) the deepest they accept on device or host.
- a component value on a tier needs the node's FULL KV on that tier: evicting the FULL KV
  takes the node's components on that tier with it.
- SWA KV outside every live window (`windows.py`) is freed at once; a split keeps the SWA
  KV with the tokens it belongs to and the Mamba state with the lower half (a state
  belongs to its node's end).
- locks: `lock(node)` protects the FULL path, the SWA window ending at `node` and the Mamba
  state at `node`, on the tier locked (host: `protect_host`).
- per component and tier: evictable / protected sizes (SWA in tokens, Mamba in states)
  and an LRU of what may be evicted, by the component's own logical clock.

Every mutating call that can let slots go returns them as `ComponentFrees`.
"""

from __future__ import annotations

import numbers
from contextlib import closing

import numpy as np
import torch

from kvtier.tiers.indices import check_size, check_slots, concat
from kvtier.tree.check import check_components
from kvtier.tree.components import Component, parse_components
from kvtier.tree.key import RadixKey
from kvtier.tree.leaves import EvictableLeaves
from kvtier.tree.node import HybridNode, Tier
from kvtier.tree.radix import RadixTree, joined_slots
from kvtier.tree.results import (
    ComponentEviction,
    ComponentFrees,
    DeviceEviction,
    HostEviction,
    InsertResult,
    KnownHashes,
    MatchResult,
)
from kvtier.tree.windows import holds_reaching, is_live, near, swa_present

D, H = Tier.DEVICE, Tier.HOST
SWA, MAMBA = 0, 1  # side-component index (sizes, sets, frees)
_NONE = np.empty(0, dtype=np.int64)
_INF = float("inf")


class HybridRadixTree(RadixTree):
    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: str = "lru",
        slru_threshold: int = 2,
        namespace_id: str = "",
        hash_algo: str = "sha256",
        *,
        components=(Component.FULL, Component.SWA, Component.MAMBA),
        swa_window: int | None = None,
    ) -> None:
        if (
            isinstance(page_size, bool)
            or not isinstance(page_size, int)
            or page_size < 1
        ):
            raise ValueError(f"page_size={page_size!r}: must be an integer >= 1")
        self.components, self.wp = parse_components(components, swa_window, page_size)
        self.swa_window = swa_window if Component.SWA in self.components else None
        self.has_swa = Component.SWA in self.components
        self.has_mamba = Component.MAMBA in self.components
        super().__init__(
            page_size, eviction_policy, slru_threshold, namespace_id, hash_algo
        )

    def reset(self) -> None:
        super().reset()
        self._side_evictable = [[0, 0], [0, 0]]  # [SWA tokens, Mamba states][tier]
        self._side_protected = [[0, 0], [0, 0]]
        swa_key, mamba_key = (lambda n: (n.swa_access,)), (lambda n: (n.mamba_access,))
        self._side_sets = [
            [EvictableLeaves(swa_key, True), EvictableLeaves(swa_key, True)],
            [EvictableLeaves(mamba_key, True), EvictableLeaves(mamba_key, True)],
        ]
        self._freed: list[list[list[np.ndarray]]] = [[[], []], [[], []]]
        self._sink = getattr(self, "_sink", None)
        self._dropped: list[
            HybridNode
        ] = []  # FULL went from a tier: settle around them

    # -- sizes ---------------------------------------------------------------------------------

    def component_evictable_size(self, component: Component, tier: Tier = D) -> int:
        """SWA: tokens; MAMBA: states; FULL: `evictable_size`."""
        if component == Component.FULL:
            return self.evictable_size(tier)
        return self._side_evictable[self._side(component)][tier]

    def component_protected_size(self, component: Component, tier: Tier = D) -> int:
        if component == Component.FULL:
            return self.protected_size(tier)
        return self._side_protected[self._side(component)][tier]

    def _side(self, component: object) -> int:
        c = Component.parse(component)
        if c == Component.FULL or c not in self.components:
            have = ", ".join(x.name.lower() for x in self.components[1:]) or "none"
            raise ValueError(
                f"component={component!r}: not a side component of this tree (it has: {have})"
            )
        return SWA if c == Component.SWA else MAMBA

    # -- per-node bookkeeping (the one place side values, holds and sizes change) ------------

    def _new_node(self, key: RadixKey, parent) -> HybridNode:
        node = HybridNode(self._next_id, key, parent, self.clock)
        self._next_id += 1
        return node

    def _account(self, node: HybridNode, sign: int) -> None:
        for tier in (D, H):
            v = node.swa[tier]
            if v is not None:
                sizes = (
                    self._side_protected
                    if node.swa_hold[tier]
                    else self._side_evictable
                )
                sizes[SWA][tier] += sign * v.shape[0]
            if node.mamba[tier] is not None:
                sizes = (
                    self._side_protected if node.anchors[tier] else self._side_evictable
                )
                sizes[MAMBA][tier] += sign

    def _refresh_side(self, node: HybridNode) -> None:
        for i, values, hold in (
            (SWA, node.swa, node.swa_hold),
            (MAMBA, node.mamba, node.anchors),
        ):
            for tier in (D, H):
                if values[tier] is not None and not hold[tier]:
                    self._side_sets[i][tier].add(node)
                else:
                    self._side_sets[i][tier].discard(node)

    def _begin(self, node: HybridNode) -> None:
        self._account(node, -1)

    def _end(self, node: HybridNode) -> None:
        self._account(node, +1)
        self._refresh_side(node)

    def _drop(self, node: HybridNode, side: int, tier: Tier) -> int:
        """Let a side value go on `tier` (its slots into the frees); returns its size."""
        self._begin(node)
        if side == SWA:
            v, node.swa[tier] = node.swa[tier], None
            self._freed[SWA][tier].append(v)
            size = v.shape[0]
        else:
            v, node.mamba[tier] = node.mamba[tier], None
            self._freed[MAMBA][tier].append(np.array([v], dtype=np.int64))
            size = 1
        self._end(node)
        return size

    def set_frees_sink(self, sink) -> None:
        """`sink(frees)` is handed every `ComponentFrees` a call lets go, as the call returns
        them (a cache frees them there, whoever made the call: a write's unlock, an
        eviction); None: only returned. The tree still frees nothing itself."""
        self._sink = sink

    def take_frees(self) -> ComponentFrees:
        """Slots let go since the last call that returned frees (none, after every public
        call that can let slots go): what is left over, to the sink too."""
        return self._take_frees()

    def _take_frees(self) -> ComponentFrees:
        f = self._freed
        out = ComponentFrees(
            joined_slots(f[SWA][D]),
            joined_slots(f[SWA][H]),
            joined_slots(f[MAMBA][D]),
            joined_slots(f[MAMBA][H]),
        )
        self._freed = [[[], []], [[], []]]
        if self._sink is not None and len(out):
            self._sink(out)
        return out

    # -- structure -----------------------------------------------------------------------------

    def _set_value(self, node, tier, value) -> None:
        if value is None and node.values[tier] is not None:
            for side, values in ((SWA, node.swa), (MAMBA, node.mamba)):
                if values[tier] is not None:
                    self._drop(node, side, tier)
            self._dropped.append(node)
        super()._set_value(node, tier, value)

    def _remove(self, node: HybridNode) -> None:
        super()._remove(node)
        for sets in self._side_sets:
            for s in sets:
                s.discard(node)

    def _split(self, child: HybridNode, k: int) -> HybridNode:
        """The upper half takes the SWA KV of its tokens, no Mamba state (the state is the
        end's) and the holds of the windows that reach into it."""
        self._begin(child)
        upper = super()._split(child, k)
        for tier in (D, H):
            v = child.swa[tier]
            if v is not None:
                upper.swa[tier], child.swa[tier] = v[:k], v[k:]
            if self.has_swa and child.locks[tier]:
                upper.swa_hold[tier] = holds_reaching(child, upper.end, self.wp, tier)
        upper.swa_access, upper.mamba_access = child.swa_access, child.mamba_access
        self._end(upper)
        self._end(child)
        return upper

    def _cut(self, node: HybridNode, pos: int) -> None:
        """Make `pos` (tokens from the root) a node boundary on the path root..node."""
        n = node
        while n is not self.root and n.end > pos:
            if n.start < pos:
                self._split(n, pos - n.start)
                return
            n = n.parent

    def _cut_window(self, node: HybridNode) -> None:
        """A window that ends at `node` starts on a node boundary, so that the nodes it
        covers are exactly its tokens (what it keeps alive and protects)."""
        if self.has_swa and node.end > self.wp:
            self._cut(node, node.end - self.wp)

    def window_nodes(self, node: HybridNode) -> list[HybridNode]:
        """The nodes of the SWA window that ends at `node`, `node` first: what a restore
        that ends there needs the SWA KV of (empty without SWA)."""
        return self._window(node) if self.has_swa else []

    def _window(self, node: HybridNode) -> list[HybridNode]:
        """The nodes of the window that ends at `node` (its end first)."""
        out, n, lo = [], node, node.end - self.wp
        while n is not self.root and n.end > lo:
            out.append(n)
            n = n.parent
        return out

    def _in_tree(self, node: HybridNode) -> bool:
        p = node.parent
        return (
            p is not None and p.children.get(node.key.child_key(self.page_size)) is node
        )

    def _settle(self, nodes: list[HybridNode]) -> None:
        """Free the SWA KV (both tiers) of every node that no live window needs; `nodes`
        are the candidates (all of them are checked before any is freed)."""
        if not self.has_swa:
            return
        seen, dead = set(), []
        for n in nodes:
            if n.id in seen or n is self.root:
                continue
            seen.add(n.id)
            if swa_present(n) and not is_live(n, self.wp, self.has_mamba, self.root):
                dead.append(n)
        for n in dead:
            for tier in (D, H):
                if n.swa[tier] is not None:
                    self._drop(n, SWA, tier)

    def _around(self, points: list[HybridNode]) -> list[HybridNode]:
        """Every node whose windows a change at `points` can touch (a point that left the
        tree: its ancestors that a window through it covered)."""
        out = []
        for x in points:
            lo = x.start - self.wp
            if self._in_tree(x):
                out += near(x, lo, x.end + self.wp, self.root)
                continue
            y = x.parent
            while y is not self.root and not self._in_tree(y):
                y = y.parent
            out += near(y, lo, y.end, self.root)
        return out

    # -- match ---------------------------------------------------------------------------------

    def match_prefix(self, key: RadixKey, touch: bool = True) -> MatchResult:
        """Longest prefix of `key` every component accepts (module docstring); the three
        handles mean what they mean in `RadixTree.match_prefix`: `device_indices` are the
        FULL device slots of root..`last_device_node`, `host_hit_length` the tokens from
        there to `last_host_node`, the deepest node restorable from device or host."""
        if not isinstance(key, RadixKey):
            raise ValueError(
                f"match_prefix: key: expected a RadixKey, got {type(key).__name__}"
            )
        if touch:
            self.clock += 1
        path = self._walk(key)
        root, w, swa, mamba = self.root, self.swa_window, self.has_swa, self.has_mamba
        dev, anyt, dev_count = root, root, 0
        run_d = run_a = _INF  # SWA tokens present just above, on device / on any tier
        for i, node in enumerate(path):
            if touch:
                node.hit_count += 1
                node.last_access = self.clock
            if swa:
                on_d = node.swa[D] is not None
                run_d = run_d + len(node) if on_d else 0
                run_a = run_a + len(node) if on_d or node.swa[H] is not None else 0
            ok_any = (not swa or run_a >= w) and (
                not mamba or node.mamba[D] is not None or node.mamba[H] is not None
            )
            if not ok_any:
                continue
            anyt = node
            if (
                node.values[D] is not None
                and (not swa or run_d >= w)
                and (not mamba or node.mamba[D] is not None)
            ):
                dev, dev_count = node, i + 1
        if touch and path:
            self._touch(dev)
            self._touch(anyt)
        slots = joined_slots([n.values[D] for n in path[:dev_count]])
        host_hit = (anyt.end if anyt is not root else 0) - (
            dev.end if dev is not root else 0
        )
        return MatchResult(slots, dev, anyt, anyt, host_hit)

    def _touch(self, node: HybridNode) -> None:
        """The matched end: its state and its window are recently used."""
        if node is self.root:
            return
        node.mamba_access = self.clock
        for n in self._window(node) if self.has_swa else ():
            n.swa_access = self.clock

    # -- insert --------------------------------------------------------------------------------

    def insert(
        self,
        key: RadixKey,
        device_indices: torch.Tensor | np.ndarray,
        priority: int = 0,
        hashes: KnownHashes | None = None,
        *,
        swa_indices: torch.Tensor | np.ndarray | None = None,
        swa_start: int = 0,
        mamba_slot: int | None = None,
    ) -> InsertResult:
        """`RadixTree.insert` for FULL; then the SWA KV of tokens [swa_start, len(key)) at
        `swa_indices` (SWA-pool slots; the request freed those before `swa_start`) and the
        Mamba state after the key's last token at `mamba_slot`.

        A node that already holds SWA KV (a Mamba state) on device keeps it, and the given
        slots for it are listed in `frees` (but for the slots it holds itself: a request
        passes back the window it matched); so is given SWA KV outside every live window.
        Slots not listed there belong to the tree."""
        self._check_aligned("insert", key)
        swa = self._check_swa_args(key, swa_indices, swa_start)
        if mamba_slot is not None:
            self._side(Component.MAMBA)
            mamba_slot = check_size("insert: mamba_slot", mamba_slot, minimum=1)
        r = super().insert(key, device_indices, priority, hashes)
        last, fresh = r.last_node, []
        first_added = r.added[0].start if r.added else None
        if mamba_slot is not None:  # first: its window's cut comes before the SWA KV
            self._set_mamba(last, D, mamba_slot)
        if swa is not None and swa.shape[0]:
            self._cut(last, swa_start)
            n = last
            while n is not self.root and n.start >= swa_start:
                part = swa[n.start - swa_start : n.end - swa_start]
                if n.swa[D] is None:
                    self._begin(n)
                    n.swa[D] = concat([part])
                    n.swa_access = self.clock
                    self._end(n)
                    fresh.append(n)
                else:  # the slots it holds were the request's from its match: not dups
                    self._freed[SWA][D].append(part[part != n.swa[D]])
                n = n.parent
        self._settle(fresh)
        added = r.added
        if first_added is not None:  # window cuts may have split the new nodes
            added, n = [], last
            while n is not self.root and n.start >= first_added:
                added.append(n)
                n = n.parent
            added.reverse()
        return InsertResult(r.prefix_len, last, added, self._take_frees())

    def _check_swa_args(self, key, swa_indices, swa_start) -> np.ndarray | None:
        if swa_indices is None:
            return None
        self._side(Component.SWA)
        if (
            isinstance(swa_start, bool)
            or not isinstance(swa_start, numbers.Integral)
            or not 0 <= swa_start <= len(key)
            or swa_start % self.page_size
        ):
            raise ValueError(
                f"insert: swa_start={swa_start!r}: must be a multiple of page_size={self.page_size} "
                f"in [0, {len(key)}]"
            )
        return check_slots("swa_indices", swa_indices, len(key) - int(swa_start))

    def _set_mamba(self, node: HybridNode, tier: Tier, slot: int) -> None:
        if node is self.root or node.mamba[tier] is not None:
            if node.mamba[tier] != slot:  # its own slot given back is no duplicate
                self._freed[MAMBA][tier].append(np.array([slot], dtype=np.int64))
            return
        self._begin(node)
        node.mamba[tier] = slot
        node.mamba_access = self.clock
        self._end(node)
        self._cut_window(node)

    def set_component(
        self,
        node: HybridNode,
        component: Component,
        tier: Tier,
        slots: torch.Tensor | np.ndarray | int,
    ) -> ComponentFrees:
        """`node`'s SWA KV (one slot per token) or Mamba state (one slot) is now also at
        `slots` on `tier`: a copy landed (backup, load back, store). The node's FULL KV
        must be on `tier`, and the component not yet. SWA KV that lies in no live window
        comes straight back in the frees."""
        side = self._side(component)
        tier = Tier(tier)
        if node is self.root or not self._in_tree(node):
            raise ValueError(f"set_component: {node} is not a node of this tree")
        if node.values[tier] is None:
            raise ValueError(
                f"set_component: {node} has no FULL KV on {tier.name.lower()}; components need it"
            )
        values = node.swa if side == SWA else node.mamba
        if values[tier] is not None:
            raise ValueError(
                f"set_component: {node} already holds its {component!s} on {tier.name.lower()}"
            )
        if side == MAMBA:
            self._set_mamba(node, tier, check_size("set_component: slots", slots, 1))
            return self._take_frees()
        v = check_slots("slots", slots, len(node))
        self._begin(node)
        node.swa[tier] = concat([v])
        node.swa_access = self.clock
        self._end(node)
        self._settle([node])
        return self._take_frees()

    # -- locks ---------------------------------------------------------------------------------

    def _lock(self, node, tier, delta) -> None:
        if delta < 0 and node is not self.root and not node.anchors[tier]:
            # a FULL-only tree takes an unlock of any locked node on the path; here the
            # window and the state belong to the node the lock was taken at
            what = "unlock" if tier == D else "release_host"
            raise ValueError(
                f"{what}: no lock was taken at {node} (unlock the node you locked)"
            )
        super()._lock(node, tier, delta)  # raises, changing nothing, on a bad path
        if node is self.root:
            return
        if delta > 0:
            self._cut_window(node)
        self._begin(node)
        node.anchors[tier] += delta
        self._end(node)
        for n in self._window(node) if self.has_swa else ():
            before = n.swa_hold[tier]
            if (before == 0) != (before + delta == 0):
                self._begin(n)
                n.swa_hold[tier] = before + delta
                self._end(n)
            else:
                n.swa_hold[tier] = before + delta
        if delta < 0 and not (node.anchors[D] or node.anchors[H]):
            self._settle(self._window(node))

    def unlock(self, node) -> ComponentFrees:
        """As `RadixTree.unlock`; returns the SWA KV the lock's window kept alive alone."""
        self._lock(node, D, -1)
        return self._take_frees()

    def release_host(self, node) -> ComponentFrees:
        self._lock(node, H, -1)
        return self._take_frees()

    # -- eviction ------------------------------------------------------------------------------

    def evict_device(
        self, num_tokens: int, backup_first: bool = False
    ) -> DeviceEviction:
        """`RadixTree.evict_device`; each node that leaves the device drops its SWA KV and
        Mamba state there, and SWA KV their windows alone kept is freed (`frees`)."""
        r = super().evict_device(num_tokens, backup_first)
        return DeviceEviction(
            r.device_slots,
            r.evicted_tokens,
            r.demoted,
            r.removed,
            r.needs_backup,
            self._settle_dropped(),
        )

    def _unsaved(self, node: HybridNode) -> bool:
        """Its SWA KV or state is on device and not on host (write-back saves them first)."""
        return (node.swa[D] is not None and node.swa[H] is None) or (
            node.mamba[D] is not None and node.mamba[H] is None
        )

    def evict_host(self, num_tokens: int) -> HostEviction:
        r = super().evict_host(num_tokens)
        return HostEviction(
            r.host_slots, r.evicted_tokens, r.removed, self._settle_dropped()
        )

    def _settle_dropped(self) -> ComponentFrees:
        dropped, self._dropped = self._dropped, []
        self._settle(self._around(dropped))
        return self._take_frees()

    def evict_component(
        self, component: Component, tier: Tier, amount: int
    ) -> ComponentEviction:
        """Let at least `amount` SWA tokens (Mamba states) go on `tier`, least recently
        used first, if that many are evictable; the nodes and their FULL KV stay (an SWA
        tombstone, a node without a state). A value held by a lock is never taken; a host
        copy may go while the device one stays (no tier needs the other's)."""
        side = self._side(component)
        tier = Tier(tier)
        check_size("evict_component: amount", amount, minimum=0)
        evicted = 0
        with closing(self._side_sets[side][tier].order()) as order:
            for node in order:
                if evicted >= amount:
                    break
                before = self._freed_size(side, tier)
                self._drop(node, side, tier)
                self._settle(self._around([node]))
                evicted += self._freed_size(side, tier) - before
        return ComponentEviction(evicted, self._take_frees())

    def _freed_size(self, side: int, tier: Tier) -> int:
        return sum(a.shape[0] for a in self._freed[side][tier])

    # -- checks --------------------------------------------------------------------------------

    def sanity_check(self) -> None:
        """`RadixTree.sanity_check` plus every component rule and total, recomputed."""
        problems = check_components(self)
        if problems:
            raise AssertionError(
                "hybrid tree component invariants violated:\n  "
                + "\n  ".join(problems)
                + "\n"
                + self.pretty_print()
            )
        super().sanity_check()


def make_tree(
    components=(Component.FULL,), swa_window: int | None = None, **kwargs
) -> RadixTree:
    """The tree for a model's component set: a `RadixTree` for FULL alone (no component
    bookkeeping at all), a `HybridRadixTree` otherwise."""
    # the window's rounding is the tree's business (it checks page_size first)
    comps, _ = parse_components(components, swa_window, 1)
    if comps == (Component.FULL,):
        return RadixTree(**kwargs)
    return HybridRadixTree(components=comps, swa_window=swa_window, **kwargs)
