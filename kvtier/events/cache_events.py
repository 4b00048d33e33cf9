"""KV events of kvtier's own cache: where its pages are, for a KV-aware router (docs/events.md).

The tree tells this sink each time a node's pages appear on or leave a tier (`tier_changed`,
from the one place the tree changes a tier value) and when it is emptied (`cleared`); the
cache tells it when pages reached the store (`backup_started` / `backup_done`) and when a
scheduler step ends (`flush`: the step's events become one batch, in the order they
happened). Mediums: device pool `GPU`, host mirror `CPU`, the store `STORAGE`.

Block hashes are the cache's own page hash chain (`RadixTree.page_hashes`: what the tree
matches on), each block's parent the page before it; not the store's salted keys.
Store evictions are not seen by the cache: `STORAGE` says stored, never removed.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.events.config import EventsConfig
from kvtier.events.publisher import ZmqPublisher
from kvtier.events.wire import all_blocks_cleared, block_removed, block_stored

if TYPE_CHECKING:
    from kvtier.tree import RadixTree, TreeNode

TIER_MEDIUM = ("GPU", "CPU")  # by Tier value: DEVICE, HOST


class CacheEvents:
    def __init__(self, publisher, tree: RadixTree) -> None:
        """`publisher`: anything with `publish(events)` and `close()` (ZmqPublisher)."""
        self.publisher = publisher
        self.tree = tree
        self.page_size = tree.page_size
        self.pending: list[dict[str, Any]] = []
        self._backups: dict[
            int, deque
        ] = {}  # node id -> (hashes, parent, tokens) of backups in flight

    def _chain(self, node: TreeNode) -> tuple[list[bytes], bytes | None]:
        hashes = self.tree.page_hashes(node)
        parent = node.parent
        before = (
            self.tree.page_hashes(parent)[-1]
            if parent is not None and parent is not self.tree.root
            else None
        )
        return hashes, before

    def tier_changed(self, node: TreeNode, tier: int, present: bool) -> None:
        hashes, parent = self._chain(node)
        medium = TIER_MEDIUM[int(tier)]
        if present:
            self.pending.append(
                block_stored(hashes, parent, node.key.tokens, self.page_size, medium)
            )
        else:
            self.pending.append(block_removed(hashes, medium))

    def cleared(self) -> None:
        self._backups.clear()  # node ids start again
        self.pending.append(all_blocks_cleared())

    def backup_started(self, node: TreeNode, lead_in: int = 0) -> None:
        """`node`'s pages are on their way to the store: what they are, taken now (a split
        while the write is out would change the node). `lead_in`: pages above it that go
        with its first page, in one store page (store_pages.py)."""
        hashes, parent = self._chain(node)
        lead = self._lead(node, lead_in) if lead_in else None
        self._backups.setdefault(node.id, deque()).append(
            (hashes, parent, node.key.tokens, lead)
        )

    def _lead(
        self, node: TreeNode, pages: int
    ) -> tuple[list[bytes], bytes | None, np.ndarray]:
        """(Hashes, the hash before them, tokens) of the last `pages` pages above `node`."""
        ps, root = self.page_size, self.tree.root
        hashes, tokens, before, n = [], [], None, node.parent
        while pages > 0 and n is not None and n is not root:
            chain = self.tree.page_hashes(n)
            take = min(pages, len(chain))
            hashes[:0] = chain[len(chain) - take :]
            tokens.insert(0, n.key.tokens[(len(chain) - take) * ps :])
            pages -= take
            before = chain[len(chain) - take - 1] if take < len(chain) else None
            n = n.parent
            if before is None and n is not None and n is not root:
                before = self.tree.page_hashes(n)[-1]
        return (
            hashes,
            before,
            np.concatenate(tokens) if tokens else np.empty(0, np.int64),
        )

    def backup_done(self, node: TreeNode, ok: list[bool] | None) -> None:
        """The store holds the pages where `ok` is True: one BlockStored per run of them;
        and the pages above it stored with its first page, if that was."""
        started = self._backups.get(node.id)
        if not started:
            return
        hashes, parent, tokens, lead = started.popleft()
        if not started:
            del self._backups[node.id]
        ok = ok or [False] * len(hashes)
        if lead is not None and lead[0] and ok and ok[0]:
            self.pending.append(
                block_stored(lead[0], lead[1], lead[2], self.page_size, "STORAGE")
            )
        i, ps = 0, self.page_size
        while i < len(hashes):
            if not ok[i]:
                i += 1
                continue
            j = i
            while j < len(hashes) and ok[j]:
                j += 1
            before = parent if i == 0 else hashes[i - 1]
            self.pending.append(
                block_stored(
                    hashes[i:j], before, tokens[i * ps : j * ps], ps, "STORAGE"
                )
            )
            i = j

    def flush(self) -> None:
        """End of a scheduler step: its events become one batch."""
        if self.pending:
            events, self.pending = self.pending, []
            self.publisher.publish(events)

    def close(self) -> None:
        self.flush()
        self.publisher.close()


def cache_events(config: EventsConfig | None, tree: RadixTree) -> CacheEvents | None:
    """The sink for a cache's `events:` section (None: no section, no events)."""
    if config is None:
        return None
    return CacheEvents(ZmqPublisher(config), tree)
