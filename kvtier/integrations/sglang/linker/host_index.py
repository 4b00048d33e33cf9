"""The linker's host tier index: SGLang page key -> host mirror page, with LRU eviction
and pins.

SGLang keeps the prefix tree; its page keys are chained hashes (a page's key names its
whole prefix), so this index is flat. A page is in one of three states:

| state | held by | visible to lookup |
|---|---|---|
| free | the mirror's allocator | no |
| reserved | an op (an offload's copy, a load's store read) until it ends | no |
| published | this index, under its key; evictable unless pinned | yes |

A pin (a load or a store write reading the page) keeps a published page from eviction;
pins count, and each is released once by its owner. The evictable pages (published, no
pin) sit in one LRU, coldest first: a pinned page is out of it until its last pin goes.
Every call costs what it touches or returns (a run of keys, the victims it evicts), never
the size of the tier; each reservation and eviction is one allocator call.
Scheduler thread only.
"""

from __future__ import annotations

import operator
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from itertools import compress, filterfalse, islice, repeat

import numpy as np

from kvtier.tiers.allocator import PagedAllocator


_count = Counter.update  # adds one per key, in C for a dict
ONES = repeat(1)


class HostIndex:
    def __init__(self, allocator: PagedAllocator) -> None:
        self.allocator = allocator
        self.pages: dict[str, int] = {}  # published
        self.lru: OrderedDict[str, int] = (
            OrderedDict()
        )  # published, unpinned; coldest first
        self.pins: dict[str, int] = {}
        # reserved pages, by page number: one vector write per op, not a set op per page
        self._reserved = np.zeros(allocator.num_pages + 1, dtype=bool)
        self.evicted_pages = 0

    @property
    def reserved(self) -> set[int]:
        """The pages reserved by ops (for the checks: a pass over the tier)."""
        return set(np.flatnonzero(self._reserved).tolist())

    def get(self, key: str) -> int | None:
        return self.pages.get(key)

    def free_pages(self) -> int:
        return self.allocator.available_size() // self.allocator.page_size

    def room(self) -> int:
        """Pages a reservation could get now: free, or published and unpinned."""
        return self.free_pages() + len(self.lru)

    def run(
        self, keys: Sequence[str], start: int = 0, budget: int | None = None
    ) -> tuple[int, int]:
        """(end, unpinned): the end of the run of `keys` from `start` published here, and
        how many of them are evictable now (the run stops before the page that would make
        that more than `budget`). Each is touched (made the newest in the LRU)."""
        pages, lru = self.pages, self.lru
        i, n, unpinned = start, len(keys), 0
        while i < n:
            key = keys[i]
            if key not in pages:
                break
            if key in lru:
                if budget is not None and unpinned == budget:
                    break
                lru.move_to_end(key)
                unpinned += 1
            i += 1
        return i, unpinned

    def reserve(self, n: int) -> np.ndarray | None:
        """`n` pages for an op, evicting unpinned pages (coldest first) when short; None
        (and nothing evicted) if pins leave too few."""
        short = n - self.free_pages()
        if short > 0:
            if short > len(self.lru):
                return None
            lru = self.lru
            keys = list(islice(lru, short))  # the cold end, taken by C loops
            victims = np.fromiter(map(lru.pop, keys), dtype=np.int64, count=short)
            deque(map(self.pages.__delitem__, keys), maxlen=0)
            self.allocator.free_pages(victims)
            self.evicted_pages += short
        pages = self.allocator.alloc_pages(n)
        assert pages is not None, (
            "host allocator short after eviction: its count is wrong"
        )
        self._reserved[pages] = True
        return pages

    def publish(self, keys: Sequence[str], pages: Sequence[int]) -> list[bool]:
        """Reserved pages whose bytes landed and verified become their keys': True each. A
        key already published keeps its page, and this one goes back: False (the caller
        must not use it any more). One allocator call for all that go back."""
        known, lru = self.pages, self.lru
        self._reserved[pages] = False
        fresh = dict(zip(keys, pages))
        # the usual case, in C loops: keys distinct, none published (a key named twice
        # keeps its first page below; the other goes back)
        if len(fresh) == len(keys) and known.keys().isdisjoint(fresh):
            known.update(fresh)
            lru.update(fresh)
            return [True] * len(fresh)
        kept, back = [], []
        for key, page in zip(keys, pages):
            if key in known:
                back.append(page)
                kept.append(False)
                continue
            known[key] = lru[key] = page
            kept.append(True)
        if back:
            self.allocator.free_pages(np.array(back, dtype=np.int64))
        return kept

    def release(self, pages: np.ndarray) -> None:
        """Reserved pages whose op ended without publishing them."""
        if len(pages):
            self._reserved[pages] = False
            self.allocator.free_pages(np.asarray(pages, dtype=np.int64))

    def pin(self, keys: Sequence[str]) -> list[str]:
        """Pin the published ones of `keys`; returns those (the caller unpins exactly them)."""
        pages, pins, lru = self.pages, self.pins, self.lru
        got = list(compress(keys, map(pages.__contains__, keys)))
        once = dict.fromkeys(got, 1)
        if len(once) == len(got) and pins.keys().isdisjoint(once):  # the usual case
            deque(map(lru.__delitem__, got), maxlen=0)
            pins.update(once)
            return got
        fresh = list(dict.fromkeys(filterfalse(pins.__contains__, got)))
        deque(map(lru.__delitem__, fresh), maxlen=0)  # out of the LRU while pinned
        pins.update(dict.fromkeys(fresh, 0))
        _count(pins, got)
        return got

    def unpin(self, keys: Sequence[str]) -> None:
        """Drop one pin of each; a page whose last pin goes is the newest in the LRU."""
        pins, pages = self.pins, self.pages
        if len(set(keys)) == len(keys):  # the usual case, in C loops
            held = list(map(pins.pop, keys))
            if held.count(1) == len(held):  # each loses its last pin
                self.lru.update(zip(keys, map(pages.__getitem__, keys)))
                return
            pins.update(zip(keys, map(operator.sub, held, ONES)))
        else:
            for k in keys:
                pins[k] -= 1
        freed = list(
            dict.fromkeys(compress(keys, map(operator.not_, map(pins.get, keys, ONES))))
        )
        if freed:
            deque(map(pins.__delitem__, freed), maxlen=0)
            self.lru.update(zip(freed, map(pages.__getitem__, freed)))

    def clear(self) -> None:
        """Every published page back to free, but those still pinned (their owner op has
        not ended) and reserved ones, which their ops give back."""
        if self.lru:
            for k in self.lru:
                del self.pages[k]
            self.allocator.free_pages(np.array(list(self.lru.values()), dtype=np.int64))
            self.lru.clear()

    def check(self) -> list[str]:
        """free + published + reserved == total, no page twice, pins only on published
        keys, the LRU exactly the unpinned published pages."""
        problems = []
        published = list(self.pages.values())
        if len(set(published)) != len(published):
            problems.append("a host page is published under two keys")
        if set(published) & self.reserved:
            problems.append("a host page is both published and reserved")
        free = self.free_pages()
        if free + len(published) + len(self.reserved) != self.allocator.num_pages:
            problems.append(
                f"host pages: free {free} + published {len(published)} + reserved "
                f"{len(self.reserved)} != {self.allocator.num_pages}"
            )
        stray = [k for k in self.pins if k not in self.pages]
        if stray:
            problems.append(f"{len(stray)} pins on keys that are not published")
        unpinned = {k: p for k, p in self.pages.items() if k not in self.pins}
        if unpinned != dict(self.lru):
            problems.append("the host LRU is not exactly the unpinned published pages")
        return problems
