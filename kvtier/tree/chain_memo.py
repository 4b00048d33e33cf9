"""Page hash chains made recently, to take again instead of hashing the same tokens twice.

A returning conversation's history usually left host long ago: its nodes are gone from
the tree, and with them their hashes, so every prefetch hashed the whole history again on
the storage thread (at page size 1 a SHA-256 per token: about 780 a request in
`benchmarks/cache.py`, a quarter of that thread's time, and as long before the store is
asked). The memo keeps the chains the storage thread made (prefetches and backups) by
where they start: the hash before their first page (None at the root), the extra key and
their first pages' token bytes. A chain asked for again is taken from a kept one as far as
its tokens are the kept chain's (the longest such), then from the next kept chain that
starts where that one ends (a backup's, which continues a prefetch's), and only the rest is
hashed.

A page's hash is a function of the hash before it and its tokens, nothing else
(docs/formats.md): a chain kept for the token bytes it was made from and the hash it
started from is the chain `page_hashes` makes for them, page for page, so a taken chain is
the one hashing would give. The memo belongs to one tree (one namespace, page size and hash
function; a change of those empties it) and holds up to `MEMO_BYTES` of hashes and token
bytes, oldest chain out first. Any thread may use it: one lock around its dicts, never around hashing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from kvtier.hashing import KeyedHash, page_hashes_of_bytes, token_bytes
from kvtier.numpy_gil import shared_bytes

MEMO_BYTES = (
    24 << 20
)  # what the kept chains may take: their hashes and their tokens' bytes
HASH_BYTES = 80  # one kept hash: a 32-byte bytes object (~65) and its slot in a tuple
PER_START = 4  # kept chains with the same start and first pages: the newest ones
HEAD_TOKENS = (
    16  # tokens of a chain's first pages that key it (whole pages, one at least)
)


class ChainMemo:
    def __init__(self, max_bytes: int = MEMO_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._setting: tuple | None = (
            None  # (page size, namespace id, hash function) it holds chains of
        )
        self._chains: dict[
            tuple, list[tuple[int, bytes, tuple[bytes, ...]]]
        ] = {}  # start -> kept, newest last
        self._order: OrderedDict[int, tuple] = (
            OrderedDict()
        )  # kept entry -> its start, oldest first
        self._next = 0
        self._bytes = 0
        self.taken = self.hashed = 0  # pages taken from the memo, pages hashed

    def page_hashes(
        self,
        tokens: np.ndarray,
        page_size: int,
        namespace_id: str,
        extra_key: str | None,
        prev: bytes | None,
        algo: str | KeyedHash,
    ) -> list[bytes]:
        """`kvtier.hashing.page_hashes` of the same arguments, taken from kept chains as far
        as they go; the chain made is kept."""
        step = 4 * page_size
        data = token_bytes(tokens[: len(tokens) - len(tokens) % page_size])
        head = max(1, HEAD_TOKENS // page_size) * step
        setting = (page_size, namespace_id, algo)
        out: list[bytes] = []
        at, start = 0, prev
        with self._lock:
            if self._setting != setting:
                self._clear(setting)
            while at < len(data):
                got = self._longest(start, extra_key, data, at, head, step)
                if not got:
                    break
                out += got
                at += len(got) * step
                start = got[-1]
        rest = page_hashes_of_bytes(
            data[at:], page_size, namespace_id, extra_key, start, algo
        )
        chain = out + rest
        with self._lock:
            self.taken += len(out)
            self.hashed += len(rest)
            if rest and self._setting == setting:
                self._keep(
                    (prev, extra_key, data[:head]), data, tuple(chain)
                )  # all of it if shorter
        return chain

    def _longest(
        self, start, extra_key, data: bytes, at: int, head: int, step: int
    ) -> tuple[bytes, ...]:
        """The hashes of the most pages of `data[at:]` that one chain kept under `start`
        covers: among those keyed by the same first pages (`head` bytes, or all of a shorter
        chain's), the whole overlap if it matches, else the pages before the first that differs."""
        rest = len(data) - at
        kept = (
            self._chains.get((start, extra_key, data[at : at + head]))
            if rest >= head
            else None
        )
        if not kept:  # a chain shorter than `head` is keyed by all its pages
            for pages in range(min(rest, head - step) // step, 0, -1):
                kept = self._chains.get(
                    (start, extra_key, data[at : at + pages * step])
                )
                if kept:
                    break
        best: tuple[bytes, ...] = ()
        for entry, tokens, chain in kept or ():
            n = min(len(tokens), rest) // step  # pages both have
            if n <= len(best):
                continue
            n = (
                shared_bytes(tokens, 0, data, at, n * step) // step
            )  # the pages before the first that differs
            if n > len(best):
                best, used = chain[:n], entry
        if best:
            self._order.move_to_end(used)  # the chain taken from is the newest now
        return best

    def _keep(self, start: tuple, data: bytes, chain: tuple[bytes, ...]) -> None:
        for i, (_, tokens, _) in enumerate(self._chains.get(start, ())):
            if data.startswith(tokens):  # the new chain covers that one
                self._drop(start, i)
                break
        if len(self._chains.get(start, ())) >= PER_START:
            self._drop(start, 0)
        kept = self._chains.setdefault(start, [])
        entry = self._next
        self._next += 1
        kept.append((entry, data, chain))
        self._order[entry] = start
        self._bytes += _cost(data, chain)
        while self._bytes > self.max_bytes:
            oldest, where = next(iter(self._order.items()))
            entries = self._chains[where]
            self._drop(where, next(i for i, e in enumerate(entries) if e[0] == oldest))

    def _drop(self, start: tuple, i: int) -> None:
        kept = self._chains[start]
        entry, data, chain = kept.pop(i)
        del self._order[entry]
        self._bytes -= _cost(data, chain)
        if not kept:
            del self._chains[start]

    def _clear(self, setting: tuple) -> None:
        self._setting = setting
        self._chains.clear()
        self._order.clear()
        self._bytes = 0


def _cost(data: bytes, chain: tuple[bytes, ...]) -> int:
    return len(data) + HASH_BYTES * len(chain)
