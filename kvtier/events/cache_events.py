"""KV events of kvtier's own cache: where its pages are, for a KV-aware router (docs/events.md).

The tree tells this sink each time a node's pages appear on or leave a tier (`tier_changed`,
from the one place the tree changes a tier value) and when it is emptied (`cleared`); the
cache tells it when pages reached the store (`backup_started` / `backup_done`) and when a
scheduler step ends (`flush`: the step's events become one batch, in the order they
happened). Mediums: device pool `GPU`, host mirror `CPU`, the store `STORAGE`.

Block hashes are the cache's own page hash chain (`RadixTree.page_hashes`: what the tree
matches on), each block's parent the page before it; not the store's salted keys. With a
tenant key (docs/security.md, "KV events") the page hashes are the store keys' too, so an
event names each page by `EventHashes`: a keyed hash of its page hash under a subkey of
its own, from which no store key follows (nor the reverse), and the same page always
gets the same name, so parents still chain; and `token_ids` are withheld unless
`events.tokens` is true. Store evictions are not seen by the cache: `STORAGE` says
stored, never removed.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.events.config import EventsConfig
from kvtier.events.publisher import ZmqPublisher
from kvtier.events.wire import all_blocks_cleared, block_removed, block_stored

if TYPE_CHECKING:
    from kvtier.tenant_keys import TenantKeys
    from kvtier.tree import RadixTree, TreeNode

TIER_MEDIUM = ("GPU", "CPU")  # by Tier value: DEVICE, HOST
_NO_TOKENS = np.empty(0, np.int64)


class EventHashes:
    """A tenant's names for its pages in KV events: keyed BLAKE2b of the page hash under
    the tenant key's event subkey (`TenantKey.event_key`), 8 bytes (what goes on the
    wire). A router that holds the tenant key computes a prompt's chain the same way."""

    def __init__(self, event_key: bytes) -> None:
        self._key = event_key

    def __call__(self, hashes: Sequence[bytes]) -> list[bytes]:
        return [
            hashlib.blake2b(
                h, key=self._key, digest_size=8, person=b"kvtier-event"
            ).digest()
            for h in hashes
        ]

    def __repr__(self) -> str:
        return "EventHashes(<tenant event key>)"


class CacheEvents:
    def __init__(
        self,
        publisher,
        tree: RadixTree,
        names: EventHashes | None = None,
        token_ids: bool = True,
    ) -> None:
        """`publisher`: anything with `publish(events)` and `close()` (ZmqPublisher).
        `names`: what a page hash is called on the wire (None: itself); `token_ids`:
        whether `BlockStored` carries the block's tokens (else an empty list)."""
        self.publisher = publisher
        self.tree = tree
        self.names = names
        self.token_ids = token_ids
        self.page_size = tree.page_size
        self.pending: list[dict[str, Any]] = []
        self._backups: dict[
            int, deque
        ] = {}  # node id -> (hashes, parent, tokens) of backups in flight

    def _hashes(self, node: TreeNode) -> list[bytes]:
        hashes = self.tree.page_hashes(node)
        return hashes if self.names is None else self.names(hashes)

    def _last(self, node: TreeNode) -> bytes:
        last = self.tree.page_hashes(node)[-1]
        return last if self.names is None else self.names([last])[0]

    def _tokens(self, tokens):
        return tokens if self.token_ids else _NO_TOKENS

    def _chain(self, node: TreeNode) -> tuple[list[bytes], bytes | None]:
        hashes = self._hashes(node)
        parent = node.parent
        before = (
            self._last(parent)
            if parent is not None and parent is not self.tree.root
            else None
        )
        return hashes, before

    def tier_changed(self, node: TreeNode, tier: int, present: bool) -> None:
        hashes, parent = self._chain(node)
        medium = TIER_MEDIUM[int(tier)]
        if present:
            self.pending.append(
                block_stored(
                    hashes,
                    parent,
                    self._tokens(node.key.tokens),
                    self.page_size,
                    medium,
                )
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
            (hashes, parent, self._tokens(node.key.tokens), lead)
        )

    def _lead(
        self, node: TreeNode, pages: int
    ) -> tuple[list[bytes], bytes | None, np.ndarray]:
        """(Hashes, the hash before them, tokens) of the last `pages` pages above `node`."""
        ps, root = self.page_size, self.tree.root
        hashes, tokens, before, n = [], [], None, node.parent
        while pages > 0 and n is not None and n is not root:
            chain = self._hashes(n)
            take = min(pages, len(chain))
            hashes[:0] = chain[len(chain) - take :]
            tokens.insert(0, self._tokens(n.key.tokens[(len(chain) - take) * ps :]))
            pages -= take
            before = chain[len(chain) - take - 1] if take < len(chain) else None
            n = n.parent
            if before is None and n is not None and n is not root:
                before = self._last(n)
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

    def stats(self) -> dict:
        """The publisher's counters (docs/events.md), or none for one without them."""
        stats = getattr(self.publisher, "stats", None)
        return {} if stats is None else stats()

    def close(self) -> None:
        self.flush()
        self.publisher.close()


def cache_events(
    config: EventsConfig | None, tree: RadixTree, keys: TenantKeys | None = None
) -> CacheEvents | None:
    """The sink for a cache's `events:` section (None: no section, no events); `keys`:
    the tenant's key ring, whose current key names the pages and withholds tokens."""
    if config is None:
        return None
    names = None if keys is None else EventHashes(keys.current.event_key)
    token_ids = config.tokens if config.tokens is not None else keys is None
    return CacheEvents(ZmqPublisher(config), tree, names, token_ids)
