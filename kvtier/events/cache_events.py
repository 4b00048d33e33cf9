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
`events.tokens` is true.

Pages the store drops (its capacity eviction, Redis expiry and eviction where keyspace
notifications are on, deletes) are `BlockRemoved` `STORAGE` (`watch_store`): the store
tells its watcher, on its loop thread, of each page it stored and dropped, in its order;
the keys wait in a queue that the scheduler thread drains at each backup's end and each
flush. A store page's key is `<prefix>/<namespace>/<hex page hash>`, the hash the tree's
(and, with a tenant key, named the same way), so a removal names the page a `BlockStored`
named; with store pages of several device pages, the key is the last one's hash and the
removal names every device page its store page held (as the backup announced them). A
backup whose page the store dropped again before the scheduler applied it is not
announced stored.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvtier.events.config import EventsConfig
from kvtier.events.publisher import ZmqPublisher
from kvtier.events.wire import all_blocks_cleared, block_removed, block_stored
from kvtier.hashing import split_key

if TYPE_CHECKING:
    from kvtier.backends.base import Store
    from kvtier.tenant_keys import TenantKeys
    from kvtier.tree import RadixTree, TreeNode

TIER_MEDIUM = ("GPU", "CPU")  # by Tier value: DEVICE, HOST
_GONE_KEPT = 1 << 16  # pages dropped from the store remembered, before pruning
_GROUPS_KEPT = 1 << 20  # store pages of several device pages whose pages are remembered


class _Backup(NamedTuple):
    """A backup in flight, as the events will name it."""

    hashes: list[bytes]
    parent: bytes | None
    tokens: np.ndarray
    lead: tuple | None  # (hashes, the hash before them, tokens) of pages above it
    seq: int  # the last store drop drained when it started
    first: int  # its first page's index in its sequence


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
        self._backups: dict[int, deque] = {}  # node id -> its `_Backup`s in flight
        # the store's changes (present, keys), queued by its loop thread (`watch_store`)
        self._store_changes: deque[tuple[bool, list[str]]] = deque()
        self._scope: tuple[str, str] | None = None  # (key prefix, namespace id)
        self._gone: dict[bytes, int] = {}  # name -> seq: dropped, not stored since
        self._seq = itertools.count(1)  # drained store changes, in order
        self._drained = 0  # the seq of the last one drained
        self._group = 1  # device pages in a store page
        # a store page's last page name -> every page's name (store pages of several)
        self._groups: dict[bytes, list[bytes]] = {}

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

    def watch_store(
        self, store: Store, prefix: str, namespace_id: str, store_pages: int = 1
    ) -> None:
        """Announce the pages `store` drops (its keys under `prefix` and this cache's
        namespace, `store_pages` device pages each) as `BlockRemoved` `STORAGE`, from
        the next drain on."""
        self._scope, self._group = (prefix, namespace_id), store_pages
        store.watch(self._queue_store_change)

    def _queue_store_change(self, present: bool, keys: list[str]) -> None:
        """The store's loop thread: queue, nothing else (deque.append is atomic)."""
        self._store_changes.append((present, keys))

    def _drain_store_changes(self) -> None:
        """The store's changes so far, in order: a drop is a `BlockRemoved` `STORAGE` now
        and remembered until the page is stored again (`_gone`)."""
        changes, gone = self._store_changes, self._gone
        while changes:
            present, keys = changes.popleft()
            if present and not gone:
                continue  # nothing to forget: the stores a backup announces itself
            names = self._names_of(keys)
            if present:
                for name in names:
                    gone.pop(name, None)
            elif names:
                self._drained = seq = next(self._seq)
                gone.update(dict.fromkeys(names, seq))
                if self._groups:
                    names = [
                        n for last in names for n in self._groups.pop(last, [last])
                    ]
                self.pending.append(block_removed(names, "STORAGE"))
        if len(gone) > _GONE_KEPT:
            self._prune_gone()

    def _names_of(self, keys: list[str]) -> list[bytes]:
        """The event names of the keys of this cache's pages among `keys`."""
        hashes = []
        for key in keys:
            try:
                prefix, ns, h = split_key(key)
            except ValueError:
                continue  # not a page (a manifest, another application's key)
            if (prefix, ns) == self._scope:
                hashes.append(h)
        return hashes if self.names is None or not hashes else self.names(hashes)

    def _prune_gone(self) -> None:
        """Drops older than every backup in flight cannot concern one (its store came
        after them): forgotten."""
        oldest = min(
            (entry.seq for started in self._backups.values() for entry in started),
            default=self._drained + 1,
        )
        self._gone = {n: s for n, s in self._gone.items() if s >= oldest}

    def backup_started(self, node: TreeNode, lead_in: int = 0) -> None:
        """`node`'s pages are on their way to the store: what they are, taken now (a split
        while the write is out would change the node). `lead_in`: pages above it that go
        with its first page, in one store page (store_pages.py)."""
        hashes, parent = self._chain(node)
        lead = self._lead(node, lead_in) if lead_in else None
        first = _pages_above(node, self.page_size) if self._group > 1 else 0
        self._backups.setdefault(node.id, deque()).append(
            _Backup(
                hashes,
                parent,
                self._tokens(node.key.tokens),
                lead,
                self._drained,
                first,
            )
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
        backup = started.popleft()
        hashes, parent, tokens, lead = backup[:4]
        if not started:
            del self._backups[node.id]
        ok = list(ok or [False] * len(hashes))
        if self._scope is not None:  # a page stored, then dropped before now: not there
            self._drain_store_changes()
            if self._gone or self._group > 1:
                ends = self._store_page_ends(backup)
                for lo, end in ends if self._gone else ():
                    if hashes[end] in self._gone:
                        ok[lo : end + 1] = [False] * (end + 1 - lo)
                if self._group > 1:
                    self._remember_groups(backup, ends, ok)
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

    def _store_page_ends(self, backup: _Backup) -> list[tuple[int, int]]:
        """(First, last) index among the backup's pages of each store page ending in it
        (the first clipped to 0: its earlier pages are the lead's)."""
        g, n = self._group, len(backup.hashes)
        if g == 1:
            return [(i, i) for i in range(n)]
        return [(max(0, e - g + 1), e) for e in range((g - 1 - backup.first) % g, n, g)]

    def _remember_groups(self, backup: _Backup, ends, ok: list[bool]) -> None:
        """Each stored store page's device page names, under its last one's (its key's)."""
        lead = list(backup.lead[0]) if backup.lead is not None else []
        joined, g = lead + backup.hashes, self._group
        for _, end in ends:
            if ok[end]:
                at = end + len(lead)
                self._groups[backup.hashes[end]] = joined[max(0, at - g + 1) : at + 1]
        while len(self._groups) > _GROUPS_KEPT:
            self._groups.pop(next(iter(self._groups)))

    def flush(self) -> None:
        """End of a scheduler step: its events become one batch."""
        if self._scope is not None:
            self._drain_store_changes()
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


def _pages_above(node: TreeNode, page_size: int) -> int:
    """Pages on the path above `node` (its first page's index in its sequence)."""
    n, tokens = node.parent, 0
    while n is not None and n.parent is not None:
        tokens += len(n)
        n = n.parent
    return tokens // page_size


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
