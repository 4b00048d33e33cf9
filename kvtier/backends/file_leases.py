"""The file store's leases and priorities (`Store.hint`, docs/stores.md): the order its
capacity eviction takes pages in, and the table every process sharing the root reads.

Eviction order: pages of a negative priority (lowest first), then plain pages (no lease,
priority 0) least recently used first, then pages of a positive priority (lowest first),
then leased pages (lowest priority, soonest lease end first). A write whose pages do not
fit beside the leased ones evicts its own pages (they are reported not stored); a lease is
broken only where leased pages alone hold more than the capacity (it was lowered, or
other processes' leases fill it): the capacity always holds.

The table lives in `<root>/.kvtier-leases` (JSON: `{"format": 1, "hints": {key: [until,
priority]}}`, `until` on the store's clock: wall time unless a test passes its own), read
and written under the root's lock, re-read only when the file changed. Anyone who can
write the root can write it: an entry that does not parse is dropped. A table that cannot
be read or written (no regular file there, a full disk) fails no store call: the failure
is counted and logged, and this process keeps the leases it holds in memory.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path

from kvtier.backends.file_io import read_file, write_small
from kvtier.backends.leases import Hint, Leases
from kvtier.hashing import validate_key

LEASES = ".kvtier-leases"
LEASES_LIMIT = 64 << 20  # bytes of the table read at most (a longer one is none)


def eviction_order(sizes: OrderedDict[str, int], leases: Leases) -> Iterator[str]:
    """Indexed keys in the order capacity eviction takes them (above). The caller takes
    each key it gets off `sizes` before asking for the next. Costs what it skips, not
    the index: plain pages are walked from the least recently used on, past the hinted
    ones in front of them (the whole index is walked only to rank negative priorities,
    and at the end, when only hinted pages are left)."""
    hints = leases.hints
    if not hints:  # every page plain: least recently used first
        while sizes:
            yield next(iter(sizes))
        return
    now = leases.clock()

    def held(hint: Hint) -> bool:
        return hint.until is not None and hint.until > now

    low = {k for k, h in hints.items() if h.priority < 0 and not held(h) and k in sizes}
    if low:
        rank = {k: i for i, k in enumerate(sizes) if k in low}
        yield from sorted(low, key=lambda k: (hints[k].priority, rank[k]))
    skipped = 0  # hinted pages in front: everything before them was taken
    while chunk := list(islice(sizes, skipped, skipped + _CHUNK)):
        for key in chunk:
            hint = hints.get(key)
            if hint is not None and (hint.priority != 0 or held(hint)):
                skipped += 1
            else:
                yield key
    ranked = sorted(
        ((held(h), h.priority, h.until if held(h) else 0.0, i), k)
        for i, k in enumerate(sizes)
        if (h := hints.get(k)) is not None
    )
    yield from (k for _, k in ranked)


_CHUNK = 64  # index keys looked at a time


class SharedLeases:
    """The root's lease table file, mirrored in `leases`. Every method runs under the
    root's lock (`FileStore._shared`)."""

    def __init__(
        self, root: Path, leases: Leases, failed: Callable[[str], None]
    ) -> None:
        self.path = root / LEASES
        self.leases = leases
        self._seen: tuple | None = None  # (inode, size, mtime_ns) of the file read last
        self._failed = failed  # told of a table it could not read or write

    def sync(self) -> None:
        """Re-read the file if another process (or a rewrite) changed it."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._seen is not None:
                self.leases.replace_all({})
                self._seen = None
            return
        seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        if seen != self._seen:
            try:
                raw = read_file(self.path, limit=LEASES_LIMIT)
            except OSError as exc:  # kept as held: read again at the next look
                self._failed(f"reading the lease table: {exc}")
                return
            self.leases.replace_all(_parse(raw))
            self._seen = seen

    def save(self) -> None:
        """Write the table (ended leases of priority 0 dropped), renamed in whole."""
        self.leases.expire()
        data = {
            "format": 1,
            "hints": {k: [h.until, h.priority] for k, h in self.leases.hints.items()},
        }
        try:
            write_small(self.path, json.dumps(data, sort_keys=True).encode())
            st = os.stat(self.path)
        except OSError as exc:  # kept in memory: written with the next change
            self._failed(f"writing the lease table: {exc}")
            return
        self._seen = (st.st_ino, st.st_size, st.st_mtime_ns)


def _parse(raw: bytes) -> dict[str, Hint]:
    if len(raw) > LEASES_LIMIT:
        return {}
    try:
        hints = json.loads(raw).get("hints", {})
    except (ValueError, AttributeError, RecursionError):
        return {}
    out: dict[str, Hint] = {}
    if not isinstance(hints, dict):
        return out
    for key, entry in hints.items():
        try:
            until, priority = entry
            validate_key(key)
        except (TypeError, ValueError):
            continue
        if (until is None or isinstance(until, (int, float))) and (
            isinstance(priority, int) and not isinstance(priority, bool)
        ):
            out[key] = Hint(None if until is None else float(until), priority)
    return out
