"""The request table: what each request holds between `acquire` and its finish — a lock on
a tree node, a load, its own device pages — and what its finish must match
(docs/design.md §8). Scheduler thread only, like the rest of `TieredCache`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kvtier.cache.slots import Slots
from kvtier.controller.controller import LoadOp
from kvtier.tree import KnownHashes, RadixKey, TreeNode
from kvtier.tree.key import same_prefix


@dataclass(eq=False)
class Held:
    """A lock on `node` (its `tree_len` tokens) and a load, for the prefix of `key` the
    request was handed (those tokens and the loaded ones after them)."""

    node: TreeNode
    tree_len: int
    load: LoadOp | None
    key: RadixKey
    hashes: KnownHashes | None = None  # page hashes its prefetch computed for `key`
    since: float = field(
        default_factory=time.monotonic
    )  # for stats only (the oldest held request)

    @property
    def loaded(self) -> int:
        return 0 if self.load is None else self.load.device_slots.size

    @property
    def handed(self) -> int:
        return self.tree_len + self.loaded

    def known_hashes(self, key: RadixKey, page_size: int) -> KnownHashes | None:
        """The page hashes the request's prefetch computed, if the finished key starts with
        the tokens they were computed from (a hash covers every token before its page too):
        its prompt pages are not hashed a second time when they are backed up."""
        hashes = self.hashes
        if hashes is None:
            return None
        return (
            hashes
            if same_prefix(
                key, self.key, (hashes.first + len(hashes.chain)) * page_size
            )
            else None
        )

    def check_finish(
        self, what: str, request_id: str, key: RadixKey, kv: np.ndarray, slots: Slots
    ) -> None:
        """A finish (`what`) with `key` and slots `kv` keeps the KV it was handed under the
        tokens it was computed for, in slots nobody else owns; else ValueError, before
        anything changes:

        - the tokens start with the prefix the request was handed (same extra key): that
          KV, kept under other tokens, would be served for them;
        - past the tree's part, the slots are the request's own: the ones its prefix was
          loaded into, as handed, then allocated ones. A slot not allocated (freed, or made
          up) kept in the tree would go to the next request, whose KV would overwrite it;
        - each of those slots is listed once: one slot kept for two tokens serves one of
          them the other's KV.
        """
        n = self.handed
        if not same_prefix(key, self.key, n):
            raise ValueError(
                f"{what}: request_id={request_id!r}: tokens (extra_key={key.extra_key!r}) do not start "
                f"with the {n} tokens it was handed KV for (extra_key={self.key.extra_key!r})"
            )
        self.check_row(what, request_id, kv, slots)
        twice = slots.repeated(kv[self.tree_len :])
        if twice.size:
            raise ValueError(
                f"{what}: request_id={request_id!r}: kv_indices lists slots {twice[:8].tolist()} more "
                f"than once: two tokens' KV cannot share a slot (one would be served the other's)"
            )

    def check_row(
        self, what: str, request_id: str, kv: np.ndarray, slots: Slots
    ) -> None:
        """`kv` is the request's row: it covers the prefix it was handed, past the tree's
        part the slots are the request's own (see `check_finish`); else ValueError."""
        start, n = self.tree_len, self.handed
        if kv.shape[0] < n:  # its own slots past the prefix would go unfreed
            raise ValueError(
                f"{what}: request_id={request_id!r}: kv_indices has {kv.shape[0]} slots; the request's "
                f"row covers at least the {n} it was handed"
            )
        if n > start and kv[start:n].tobytes() != self.load.device_slots.tobytes():
            raise ValueError(
                f"{what}: request_id={request_id!r}: kv_indices[{start}:{n}] are not the slots its "
                f"prefix was loaded into"
            )
        bad = slots.unallocated(kv[n:])
        if bad.size:
            raise ValueError(
                f"{what}: request_id={request_id!r}: kv_indices {bad[:8].tolist()} are not allocated "
                f"(freed, or never from alloc): KV kept there would be overwritten by the page's next owner"
            )


class RequestTable:
    """Requests that hold a prefix, by id (in acquire order), and the device pages handed to
    requests and not given back yet (loaded prefixes and `alloc`s, tails included)."""

    def __init__(self) -> None:
        self._held: dict[str, Held] = {}
        self.pages = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def get(self, request_id: str) -> Held | None:
        return self._held.get(request_id)

    def require(self, request_id: str, what: str) -> Held:
        held = self._held.get(request_id)
        if held is None:
            raise ValueError(
                f"{what}: request_id={request_id!r} holds nothing (acquire it first, once it is ready)"
            )
        return held

    def hand_out(self, pages: int) -> None:
        """`pages` device pages more are the requests' (a load's slots, an `alloc`)."""
        self.pages += pages

    def take_back(self, pages: int) -> None:
        """`pages` device pages left the requests (freed, or kept by the tree)."""
        self.pages -= pages

    def ids(self) -> list[str]:
        return list(self._held)

    def hold(self, request_id: str, held: Held) -> None:
        self._held[request_id] = held

    def release(self, request_id: str) -> Held:
        return self._held.pop(request_id)

    def locked_tokens(self) -> int:
        return sum(h.tree_len for h in self._held.values())

    def ages(self) -> tuple[int, float]:
        """(Requests held, age in seconds of the oldest): from any thread, a snapshot."""
        now, held = time.monotonic(), list(self._held.values())
        return len(held), max((now - h.since for h in held), default=0.0)
