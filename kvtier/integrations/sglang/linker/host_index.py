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
pin) are ordered by a logical clock kept per host page number: a touch (publish, a
lookup's run, the last unpin) stamps its pages with the next ticks, in order, as one
vector write, and queues the batch; eviction takes the oldest stamps off the queue's cold
end, skipping entries a later touch, a pin or an eviction made stale, so a pinned page is
out of the LRU until its last pin goes, then the newest. The queue is rebuilt from the
evictable pages once it holds twice the tier (amortised: at least a tier of touches each).
Every call costs what it touches or returns (a run of keys, the victims it evicts): per
page, a dict op on its key and vector writes, no Python step; each reservation and
eviction is one allocator call.
Scheduler thread only.
"""

from __future__ import annotations

import operator
from collections import Counter, deque
from collections.abc import Sequence
from itertools import compress, filterfalse, islice, repeat, takewhile

import numpy as np

from kvtier.tiers.allocator import PagedAllocator


_count = Counter.update  # adds one per key, in C for a dict
ONES = repeat(1)


class HostIndex:
    def __init__(self, allocator: PagedAllocator) -> None:
        self.allocator = allocator
        self.pages: dict[str, int] = {}  # published
        self.pins: dict[str, int] = {}
        total = allocator.num_pages + 1
        # by page number, one vector write per op: reserved; published and unpinned (the
        # LRU's members); the key a published page holds; its last touch's stamp
        self._reserved = np.zeros(total, dtype=bool)
        self._evictable = np.zeros(total, dtype=bool)
        self._key = np.full(total, None, dtype=object)
        self._clock = np.zeros(total, dtype=np.int64)
        self._evictable_count = 0
        self._tick = 0
        # touched batches, oldest first: (stamps, pages); an entry is live while its page
        # is evictable and still carries that stamp
        self._touched: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._queued = 0
        self.evicted_pages = 0

    @property
    def reserved(self) -> set[int]:
        """The pages reserved by ops (for the checks: a pass over the tier)."""
        return set(np.flatnonzero(self._reserved).tolist())

    @property
    def lru(self) -> dict[str, int]:
        """The evictable pages, key -> page, coldest first (for the checks and tests: a
        pass over the tier)."""
        pages = np.flatnonzero(self._evictable)
        pages = pages[np.argsort(self._clock[pages], kind="stable")]
        return dict(zip(self._key[pages].tolist(), pages.tolist()))

    def get(self, key: str) -> int | None:
        return self.pages.get(key)

    def free_pages(self) -> int:
        return self.allocator.available_size() // self.allocator.page_size

    def room(self) -> int:
        """Pages a reservation could get now: free, or published and unpinned."""
        return self.free_pages() + self._evictable_count

    def _pages_of(self, keys: Sequence[str]) -> np.ndarray:
        return np.fromiter(
            map(self.pages.__getitem__, keys), dtype=np.int64, count=len(keys)
        )

    def _touch(self, pages: np.ndarray) -> None:
        """Make evictable `pages` the newest, in order."""
        n = len(pages)
        if not n:
            return
        stamps = np.arange(self._tick, self._tick + n, dtype=np.int64)
        self._tick += n
        self._clock[pages] = stamps
        self._touched.append((stamps, pages))
        self._queued += n
        if self._queued > 2 * len(self._clock) + 16:  # stale entries: rebuild
            live = np.flatnonzero(self._evictable)
            live = live[np.argsort(self._clock[live], kind="stable")]
            self._touched = deque([(self._clock[live], live)])
            self._queued = len(live)

    def _coldest(self, n: int) -> np.ndarray:
        """The `n` evictable pages with the oldest stamps, oldest first (n <= evictable)."""
        taken, touched = [], self._touched
        while n:
            stamps, pages = touched.popleft()
            self._queued -= len(pages)
            live = self._evictable[pages] & (self._clock[pages] == stamps)
            stamps, pages = stamps[live], pages[live]
            if len(pages) > n:
                touched.appendleft((stamps[n:], pages[n:]))
                self._queued += len(pages) - n
                pages = pages[:n]
            taken.append(pages)
            n -= len(pages)
        return np.concatenate(taken) if taken else np.zeros(0, np.int64)

    def run(
        self, keys: Sequence[str], start: int = 0, budget: int | None = None
    ) -> tuple[int, int]:
        """(end, unpinned): the end of the run of `keys` from `start` published here, and
        how many of them are evictable now (the run stops before the page that would make
        that more than `budget`). Each is touched (made the newest in the LRU)."""
        # C loops and vector ops, no Python step per page: one dict op per key (page
        # numbers start at 1, so the first miss ends the run)
        found = list(takewhile(bool, map(self.pages.get, islice(keys, start, None))))
        pages = np.fromiter(found, dtype=np.int64, count=len(found))
        evictable = self._evictable[pages]
        touched = pages[evictable]
        end = len(found)
        if budget is not None and len(touched) > budget:
            end = int(np.flatnonzero(evictable)[budget])
            touched = touched[:budget]
        self._touch(touched)
        return start + end, len(touched)

    def reserve(self, n: int) -> np.ndarray | None:
        """`n` pages for an op, evicting unpinned pages (coldest first) when short; None
        (and nothing evicted) if pins leave too few. The victims go to the op as they are
        (the allocator still counts them handed out): at most one allocator call, for the
        free pages taken, and none once the tier is full."""
        free = self.free_pages()
        short = n - free
        if short > 0:
            if short > self._evictable_count:
                return None
            victims = self._coldest(short)
            deque(map(self.pages.__delitem__, self._key[victims].tolist()), maxlen=0)
            self._key[victims] = None
            self._evictable[victims] = False
            self._evictable_count -= short
            self.evicted_pages += short
            if free:
                taken = self.allocator.alloc_pages(free)
                assert taken is not None, "host allocator short: its count is wrong"
                pages = np.concatenate((taken, victims))
            else:
                pages = victims
        else:
            pages = self.allocator.alloc_pages(n)
            assert pages is not None, "host allocator short: its count is wrong"
        self._reserved[pages] = True
        return pages

    def _published(self, keys: Sequence[str], pages: np.ndarray) -> None:
        """`pages`, just published under `keys`, join the LRU as its newest."""
        key = np.empty(len(keys), dtype=object)
        key[:] = keys
        self._key[pages] = key
        self._evictable[pages] = True
        self._evictable_count += len(pages)
        self._touch(pages)

    def publish(
        self, keys: Sequence[str], pages: Sequence[int] | np.ndarray
    ) -> list[bool]:
        """Reserved pages whose bytes landed and verified become their keys': True each. A
        key already published keeps its page, and this one goes back: False (the caller
        must not use it any more). One allocator call for all that go back."""
        known = self.pages
        pages = np.asarray(pages, dtype=np.int64)
        self._reserved[pages] = False
        fresh = dict(zip(keys, pages.tolist()))
        # the usual case, in C loops: keys distinct, none published (a key named twice
        # keeps its first page below; the other goes back)
        if len(fresh) == len(keys) and known.keys().isdisjoint(fresh.keys()):
            known.update(fresh)
            self._published(keys, pages)
            return [True] * len(fresh)
        kept, back, new, new_pages = [], [], [], []
        for key, page in zip(keys, pages.tolist()):
            if key in known:
                back.append(page)
                kept.append(False)
                continue
            known[key] = page
            new.append(key)
            new_pages.append(page)
            kept.append(True)
        self._published(new, np.array(new_pages, dtype=np.int64))
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
        pages, pins = self.pages, self.pins
        got = list(compress(keys, map(pages.__contains__, keys)))
        once = dict.fromkeys(got, 1)
        if len(once) == len(got) and pins.keys().isdisjoint(once):  # the usual case
            fresh = got
            pins.update(once)
        else:
            fresh = list(dict.fromkeys(filterfalse(pins.__contains__, got)))
            pins.update(dict.fromkeys(fresh, 0))
            _count(pins, got)
        # out of the LRU while pinned
        self._evictable[self._pages_of(fresh)] = False
        self._evictable_count -= len(fresh)
        return got

    def pin_found(self, keys: Sequence[str]) -> tuple[list[str], np.ndarray]:
        """`pin`, and each key's host page (0: not published), from one dict op per key
        (a load pins its host pages and needs them)."""
        host = np.fromiter(
            map(self.pages.get, keys, repeat(0)), dtype=np.int64, count=len(keys)
        )
        found = host != 0
        got = list(keys) if found.all() else list(compress(keys, found.tolist()))
        pins = self.pins
        once = dict.fromkeys(got, 1)
        if len(once) == len(got) and pins.keys().isdisjoint(once.keys()):
            pins.update(once)  # the usual case: none pinned yet, each once
            self._evictable[host[found]] = False  # out of the LRU while pinned
            self._evictable_count -= len(got)
            return got, host
        fresh = list(dict.fromkeys(filterfalse(pins.__contains__, got)))
        pins.update(dict.fromkeys(fresh, 0))
        _count(pins, got)
        self._evictable[self._pages_of(fresh)] = False
        self._evictable_count -= len(fresh)
        return got, host

    def pin_fresh(self, keys: Sequence[str], pages: np.ndarray) -> list[str]:
        """`pin` for `keys` just published at `pages` (an offload's store write): their
        pages are known, so no dict op looks them up again."""
        pins = self.pins
        once = dict.fromkeys(keys, 1)
        if len(once) != len(keys) or not pins.keys().isdisjoint(once.keys()):
            return self.pin(keys)
        pins.update(once)
        self._evictable[pages] = False  # out of the LRU while pinned
        self._evictable_count -= len(keys)
        return list(keys)

    def unpin(self, keys: Sequence[str], pages: np.ndarray | None = None) -> None:
        """Drop one pin of each; a page whose last pin goes is the newest in the LRU.
        `pages`: those of `keys`, in order, when the caller knows them."""
        pins = self.pins
        if len(set(keys)) == len(keys):  # the usual case, in C loops
            held = list(map(pins.pop, keys))
            if held.count(1) == len(held):  # each loses its last pin
                if pages is not None and len(pages) == len(keys):
                    self._evictable[pages] = True
                    self._evictable_count += len(pages)
                    self._touch(pages)
                else:
                    self._unpinned(keys)
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
            self._unpinned(freed)

    def _unpinned(self, keys: Sequence[str]) -> None:
        """Published `keys` whose last pin went join the LRU as its newest, in order."""
        pages = self._pages_of(keys)
        self._evictable[pages] = True
        self._evictable_count += len(pages)
        self._touch(pages)

    def clear(self) -> None:
        """Every published page back to free, but those still pinned (their owner op has
        not ended) and reserved ones, which their ops give back."""
        if self._evictable_count:
            pages = np.flatnonzero(self._evictable)
            deque(map(self.pages.__delitem__, self._key[pages].tolist()), maxlen=0)
            self._key[pages] = None
            self._evictable[pages] = False
            self._evictable_count = 0
            self.allocator.free_pages(pages.astype(np.int64))
        self._touched.clear()
        self._queued = 0

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
        lru = self.lru
        if unpinned != lru or self._evictable_count != len(lru):
            problems.append("the host LRU is not exactly the unpinned published pages")
        if any(self._key[p] != k for k, p in self.pages.items()):
            problems.append("a published host page does not name its key")
        return problems
