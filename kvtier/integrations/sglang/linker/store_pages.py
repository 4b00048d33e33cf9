"""Store pages of several SGLang engine pages (`store.page_tokens`), for the linker.

SGLang hands the linker runs of chained page keys that start wherever its tree's device
match ended, never a position in the sequence, so a store page cannot be "engine pages
kG..kG+G-1" as in `TieredCache` (kvtier/controller/store_pages.py). A page's own hash
decides instead: a page *ends* a store page when its hash says so (1 page in G, G =
page_tokens / the engine's page size), in every run that holds it, wherever the run starts.

- A *segment* is the pages after one ending page up to and including the next. Stored
  whole, it is one store page keyed by its ending page's hash through a tag and G
  (`segment_hash`): that page's chain fixes every token before it, and so where the segment
  starts; the key names one content.
- A writer knows a segment whole only when its run holds the page that ends the segment
  before it. A run's pages before its first ending page (its head: the run may start inside
  a segment) and after its last (its tail) are stored one engine page per store page, under
  the page's own key, as with G = 1; so is a run that is not one contiguous stretch.
- A reader takes each segment from its store page, else from its pages' own (a segment two
  runs met in, or one whose writer started inside it). A segment that starts before the
  reader's stretch is read whole and its last pages kept. Pages after a stretch's last
  ending page are read from their own store pages only: a lookup that ends inside a segment
  stored whole answers the ending page below.

Everything here runs on the storage thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

SEGMENT_TAG = b"kvtier/sglang-linker-segment\x00"


def ends(hashes: Sequence[bytes], group: int) -> list[int]:
    """Indices of the pages that end a store page (every page when `group` is 1)."""
    if group == 1:
        return list(range(len(hashes)))
    frm = int.from_bytes
    return [i for i, h in enumerate(hashes) if frm(h[:8], "little") % group == 0]


def segment_hash(page_hash: bytes, group: int) -> bytes:
    """The page-hash part of the key of the segment ending at the page of `page_hash`
    (same length; `group` in it: segments of another G are other contents)."""
    return hashlib.blake2b(
        SEGMENT_TAG + group.to_bytes(4, "little") + page_hash,
        digest_size=len(page_hash),
    ).digest()


@dataclass(slots=True, frozen=True)
class Piece:
    """Pages `first`..`last` (inclusive, indices in a stretch) as one store page: a
    segment's (`whole`) or one engine page's own."""

    first: int
    last: int
    whole: bool


def write_plan(hashes: Sequence[bytes], group: int) -> list[Piece]:
    """The store pages a writer of this contiguous run stores: its head and tail one page
    each, every segment it holds whole as one."""
    cut = ends(hashes, group) if group > 1 else []
    if len(cut) < 2:
        return [Piece(i, i, False) for i in range(len(hashes))]
    out = [Piece(i, i, False) for i in range(cut[0] + 1)]
    out += [Piece(a + 1, b, True) for a, b in zip(cut, cut[1:])]
    out += [Piece(i, i, False) for i in range(cut[-1] + 1, len(hashes))]
    return out


def segments(hashes: Sequence[bytes], group: int) -> tuple[list[int], int]:
    """(The ending pages of the stretch, where its tail starts): the reader's segments are
    `[0, e0]`, `(e0, e1]`, ... (the first may start before the stretch)."""
    cut = ends(hashes, group)
    return cut, (cut[-1] + 1 if cut else 0)


async def leading_run(
    hashes: Sequence[bytes],
    group: int,
    key_of: Callable[[bytes], str],
    exists: Callable[[list[str]], Awaitable[int]],
    limit: int | None = None,
) -> int:
    """Pages of the stretch, from its first and at most `limit`, that the store can give:
    each segment from its store page (one that ends past `limit` too: its pages before
    `limit` are read from it) or its pages' own, then the tail's pages. One `exists` (a
    leading run) per segment that two runs met in, and one more."""
    n = len(hashes)
    limit = n if limit is None else min(limit, n)
    cut, tail = segments(hashes, group)
    cut = [e for e in cut if e < limit] + [e for e in cut if e >= limit][:1]
    own_to = limit if tail < limit else tail  # the tail's pages asked about
    at, j = 0, 0
    while at < limit:
        probe = [key_of(segment_hash(hashes[e], group)) for e in cut[j:]]
        probe += [key_of(h) for h in hashes[tail:own_to]]
        found = await exists(probe) if probe else 0
        whole = len(cut) - j
        if found > whole:  # every segment, and some of the tail
            return min(tail + found - whole, limit)
        if found == whole:  # every segment (none: then the tail is the whole stretch)
            return min(cut[-1] + 1 if cut else 0, limit)
        j += found
        at = cut[j - 1] + 1 if j else 0
        mine = [key_of(h) for h in hashes[at : min(cut[j] + 1, limit)]]  # its own pages
        got = await exists(mine)
        if got < len(mine):
            return at + got
        at += got
        j += 1
    return limit
