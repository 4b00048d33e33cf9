"""The linker's host tier index: SGLang page key -> host mirror page, with LRU eviction
and pins.

SGLang keeps the prefix tree; its page keys are chained hashes (a page's key names its
whole prefix), so this index is flat. A page is in one of three states:

| state | held by | visible to lookup |
|---|---|---|
| free | the mirror's allocator | no |
| reserved | an op (an offload's copy, a load's store read) until it ends | no |
| published | this index, under its key; evictable unless pinned | yes |

A pin (a load or a store write reading the page, a lookup that promised it) keeps a
published page from eviction; pins count, and each is released once by its owner.
Scheduler thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvtier.tiers.allocator import PagedAllocator


class HostIndex:
    def __init__(self, allocator: PagedAllocator) -> None:
        self.allocator = allocator
        self.pages: OrderedDict[str, int] = (
            OrderedDict()
        )  # published, least recently used first
        self.pins: dict[str, int] = {}
        self.reserved: set[int] = set()
        self.evicted_pages = 0

    def get(self, key: str) -> int | None:
        return self.pages.get(key)

    def run(self, keys: Sequence[str], start: int = 0) -> int:
        """The end of the run of `keys` from `start` that is published here."""
        i = start
        while i < len(keys) and keys[i] in self.pages:
            self.pages.move_to_end(keys[i])
            i += 1
        return i

    def reserve(self, n: int) -> np.ndarray | None:
        """`n` pages for an op, evicting unpinned pages (least recently used first) when
        short; None (and nothing evicted) if pins leave too few."""
        short = n - self.allocator.available_size() // self.allocator.page_size
        if short > 0:
            victims = [k for k in self.pages if k not in self.pins][:short]
            if len(victims) < short:
                return None
            for key in victims:
                self.allocator.free_pages(
                    np.array([self.pages.pop(key)], dtype=np.int64)
                )
            self.evicted_pages += len(victims)
        pages = self.allocator.alloc_pages(n)
        assert pages is not None, (
            "host allocator short after eviction: its count is wrong"
        )
        self.reserved.update(pages.tolist())
        return pages

    def publish(self, key: str, page: int) -> bool:
        """A reserved page whose bytes landed and verified becomes `key`'s: True. A key
        already published keeps its page, and this one goes back: False (the caller must
        not use it any more)."""
        self.reserved.remove(page)
        if key in self.pages:
            self.allocator.free_pages(np.array([page], dtype=np.int64))
            return False
        self.pages[key] = page
        return True

    def release(self, pages: np.ndarray) -> None:
        """Reserved pages whose op ended without publishing them."""
        if len(pages):
            for p in pages.tolist():
                self.reserved.remove(p)
            self.allocator.free_pages(np.asarray(pages, dtype=np.int64))

    def pin(self, keys: Sequence[str]) -> list[str]:
        """Pin the published ones of `keys`; returns those (the caller unpins exactly them)."""
        got = [k for k in keys if k in self.pages]
        for k in got:
            self.pins[k] = self.pins.get(k, 0) + 1
        return got

    def unpin(self, keys: Sequence[str]) -> None:
        for k in keys:
            left = self.pins[k] - 1
            if left:
                self.pins[k] = left
            else:
                del self.pins[k]

    def clear(self) -> None:
        """Every published page back to free, but those still pinned (their owner op has
        not ended) and reserved ones, which their ops give back."""
        drop = [k for k in self.pages if k not in self.pins]
        if drop:
            self.allocator.free_pages(
                np.array([self.pages.pop(k) for k in drop], dtype=np.int64)
            )

    def check(self) -> list[str]:
        """free + published + reserved == total, no page twice, pins only on published keys."""
        problems = []
        published = list(self.pages.values())
        if len(set(published)) != len(published):
            problems.append("a host page is published under two keys")
        if set(published) & self.reserved:
            problems.append("a host page is both published and reserved")
        free = self.allocator.available_size() // self.allocator.page_size
        if free + len(published) + len(self.reserved) != self.allocator.num_pages:
            problems.append(
                f"host pages: free {free} + published {len(published)} + reserved "
                f"{len(self.reserved)} != {self.allocator.num_pages}"
            )
        stray = [k for k in self.pins if k not in self.pages]
        if stray:
            problems.append(f"{len(stray)} pins on keys that are not published")
        return problems
