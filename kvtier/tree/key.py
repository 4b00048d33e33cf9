"""Token keys for the radix tree, kept in numpy buffers (cheap to slice, compare and hash)."""

from __future__ import annotations

from typing import Hashable

import numpy as np


class RadixKey:
    """Token ids plus an optional `extra_key` (LoRA id, tenant...).

    Keys with different extra keys never match: the extra key is part of every child key.
    """

    __slots__ = ("tokens", "extra_key")

    def __init__(self, tokens, extra_key: str | None = None) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens: expected a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"tokens: expected integer token ids, got dtype {arr.dtype}")
        self.tokens = arr.astype(np.int64, copy=False)
        self.extra_key = extra_key

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, item: slice) -> "RadixKey":
        return RadixKey(self.tokens[item], self.extra_key)

    def __repr__(self) -> str:
        head = self.tokens[:8].tolist()
        more = "..." if len(self) > 8 else ""
        return f"RadixKey({head}{more}, len={len(self)}, extra_key={self.extra_key!r})"

    def child_key(self, page_size: int) -> Hashable:
        """The edge's first page: what a parent's children are keyed by."""
        page = int(self.tokens[0]) if page_size == 1 else self.tokens[:page_size].tobytes()
        return page if self.extra_key is None else (self.extra_key, page)

    def match(self, other: "RadixKey", page_size: int) -> int:
        """Length of the common prefix, floored to whole pages (0 if extra keys differ)."""
        if self.extra_key != other.extra_key:
            return 0
        n = min(len(self), len(other))
        diff = np.flatnonzero(self.tokens[:n] != other.tokens[:n])
        common = int(diff[0]) if diff.size else n
        return common - common % page_size
