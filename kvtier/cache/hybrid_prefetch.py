"""A hybrid cache's store prefetches, on the scheduler's side: what `HybridTieredCache`
starts when an acquire's match stops short of what the store may hold, and how it hangs
what the prefetch read (every component's pages, verified) in the tree as host copies
(`controller/side_prefetch.py` reads them on the store's side; docs/design.md, "Hybrid
models: components").

`HybridPrefetches` is a mixin of `HybridTieredCache` (kvtier/cache/hybrid.py), whose
state it uses: the tree, the side slots, the controller and the `_prefetches` map.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from kvtier.controller import side_prefetch
from kvtier.controller.side_prefetch import HybridPrefetchOp
from kvtier.hashing import key_maker
from kvtier.tiers.components import Component
from kvtier.tree import KnownHashes, Tier

log = logging.getLogger(__name__)
H = Tier.HOST


@dataclass(eq=False)
class SidePrefetch:
    """A request's store prefetch (`controller/side_prefetch.py`), on the scheduler's side:
    the key, the anchor it hangs under (protected on host until applied), and once
    applied the tokens [lo, hi) it put on host."""

    op: HybridPrefetchOp
    key: object
    anchor: object
    applied: bool = False
    discarded: bool = False  # its request was aborted: nobody takes it
    awaited: bool = False  # and a new request with its id waits: name it at the end
    span: tuple[int, int] = (0, 0)
    # the node it ended at, protected on host from the apply until its request acquires
    # (or aborts): the request may wait for device room meanwhile, and what the prefetch
    # brought must not be evicted for other writes then
    held: object = None


class HybridPrefetches:
    """The store prefetches of a `HybridTieredCache`: started by its `acquire`
    (`_start_prefetch`), applied by its `poll` (`_apply_prefetches`), ended by its drain,
    flush and close (`_end_prefetches`)."""

    def _start_prefetch(self, request_id: str, key, m) -> bool:
        """Start the store prefetch of the pages past the match (`controller/side_prefetch.py`)
        if the store may hold some; True if started (the request waits for a poll)."""
        storage = self.controller.storage
        if storage is None or len(self._side_store) < len(self.side.sides):
            return False
        if storage.group > 1 or not self.config.controller.storage_backup:
            return False  # one store page a device page only (what the backup stores)
        anchor = m.last_host_node
        if anchor is not self.tree.root and not anchor.backed_up:
            return False  # the pages hang under a host copy
        ps = self.page_size
        start = 0 if anchor is self.tree.root else anchor.end
        pages = (len(key) - start) // ps
        if pages <= 0 or pages * ps < self.config.controller.prefetch_min_tokens:
            return False
        prefix = self.config.store.key_prefix
        keys = {None: key_maker(prefix, self.tree.namespace_id)}
        page_bytes = {None: self.mirror.page_bytes}
        for c, (key_of, _) in self._side_store.items():
            keys[c.value] = key_of
            page_bytes[c.value] = self.side.sides[c].mirror.page_bytes
        has_swa = Component.SWA in self.side
        op = HybridPrefetchOp(
            request_id,
            self.tree.hashing_below(self.tree.root, key[: start + pages * ps]),
            start // ps,
            pages,
            self.tree.wp // ps if has_swa else 0,
            Component.MAMBA in self.side,
            keys,
            page_bytes,
        )
        if anchor is not self.tree.root:
            self.tree.protect_host(anchor)
        self._prefetches[request_id] = SidePrefetch(op, key, anchor)
        side_prefetch.submit(storage, op)
        self.stats_obj.counters.prefetches += 1
        return True

    def _apply_prefetches(self) -> list[str]:
        ready = []
        for rid, p in list(self._prefetches.items()):
            if p.applied or not p.op.finished:
                continue
            p.applied = True
            try:
                if not p.discarded:
                    p.span = self._insert_prefetched(p)
            except Exception:  # contained: the request goes on with what the tree has
                self.stats_obj.counters.apply_errors += 1
                log.exception("kvtier: applying the store prefetch of %r failed", rid)
            finally:
                if p.anchor is not self.tree.root:
                    self.tree.release_host(p.anchor)
                    p.anchor = self.tree.root
            if p.discarded:
                del self._prefetches[rid]
            if not p.discarded or p.awaited:
                ready.append(rid)
        return ready

    def _insert_prefetched(self, p: SidePrefetch) -> tuple[int, int]:
        """Host copies of what the op read and verified, every component's, hung in the
        tree; the tokens [lo, hi) of the store part ((0, 0): a miss, nothing kept)."""
        op, ps = p.op, self.page_size
        n = op.length
        self.stats_obj.counters.prefetch_errors += op.error is not None
        if n == 0:
            return 0, 0
        lo, hi = op.first * ps, (op.first + n) * ps
        self.slots.make_host_room(n * ps)
        full = self.controller.alloc_host(n * ps)
        got = {}
        for c, count in (
            (Component.SWA, len(op.swa) * ps),
            (Component.MAMBA, 1 if op.state else 0),
        ):
            if count and full is not None:
                got[c] = self.side.alloc_host(c, count)
                if got[c] is None:
                    break
        if full is None or any(s is None for s in got.values()):  # short: a miss
            if full is not None:
                self.controller.free_host(full)
            for c, slots in got.items():
                if slots is not None:
                    self.side.free_host(c, slots)
            return 0, 0
        _fill(self.mirror, full[::ps] // ps, op.full)
        if Component.SWA in got:
            _fill(
                self.side.sides[Component.SWA].mirror,
                got[Component.SWA][::ps] // ps,
                op.swa,
            )
        if Component.MAMBA in got:
            _fill(
                self.side.sides[Component.MAMBA].mirror,
                got[Component.MAMBA],
                [op.state_bytes],
            )
        r = self.tree.insert_host(
            p.anchor,
            p.key[lo:hi],
            full,
            KnownHashes(0, op.chain[op.first : op.first + n]),
        )
        self.controller.free_host(full[: r.prefix_len])
        node = r.last_node
        assert node.end == hi, f"a prefetch of [{lo}, {hi}) ended at {node}"
        # its window stays live while it is filled in, and all of it stays on host until
        # the request acquires it (`SidePrefetch.held`)
        self.tree.protect_host(node)
        p.held = node
        self._set_prefetched(node, got, hi)
        c = self.stats_obj.counters
        c.l3_read_pages += n
        # the verified bytes it read, every component's (the FULL pages, the window, the state)
        c.l3_read_bytes += sum(len(b) for b in op.full) + sum(len(b) for b in op.swa)
        c.l3_read_bytes += len(op.state_bytes or b"")
        return lo, hi

    def _set_prefetched(self, node, got: dict, hi: int) -> None:
        state = got.get(Component.MAMBA)
        if state is not None:
            if node.mamba[H] is None:
                self.tree.set_component(node, Component.MAMBA, H, int(state[0]))
            else:
                self.side.free_host(Component.MAMBA, state)
        swa = got.get(Component.SWA)
        if swa is None:
            return
        self.tree._cut_window(node)
        start = hi - swa.size
        kept = np.zeros(swa.size, dtype=bool)
        for n in self.tree.window_nodes(node):
            a, b = n.start - start, n.end - start
            if a < 0 or n.swa[H] is not None or n.values[H] is None:
                continue  # the tree has it there (or cannot take it): ours is unused
            self.tree.set_component(n, Component.SWA, H, swa[a:b])
            kept[a:b] = True
        if not kept.all():
            self.side.free_host(Component.SWA, swa[~kept])

    def _release_held(self, p: SidePrefetch) -> None:
        if p.held is not None:
            self.tree.release_host(p.held)
            p.held = None

    def _end_prefetches(self) -> None:
        """Stop every store prefetch, wait for them and apply them (a drain, a flush, a
        close): requests waiting on one are named ready by the next poll."""
        if not self._prefetches:
            return
        for p in self._prefetches.values():
            p.op.stop = True
        storage = self.controller.storage
        if storage is not None:
            storage.drain(self.config.store.timeout_s + 30.0)
        self._named += self._apply_prefetches()


def _fill(mirror, pages: np.ndarray, buffers: list) -> None:
    """Copy verified store pages into host `pages` of `mirror`."""
    data = np.frombuffer(b"".join(buffers), dtype=np.uint8)
    mirror.write_pages(pages, data.reshape(len(buffers), mirror.page_bytes))
