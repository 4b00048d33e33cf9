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

    @classmethod
    def _of(cls, tokens: np.ndarray, extra_key: str | None) -> "RadixKey":
        """A key over an int64 array that is already checked (slices of a key)."""
        key = object.__new__(cls)
        key.tokens, key.extra_key = tokens, extra_key
        return key

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, item: slice) -> "RadixKey":
        return RadixKey._of(self.tokens[item], self.extra_key)

    def __repr__(self) -> str:
        head = self.tokens[:8].tolist()
        more = "..." if len(self) > 8 else ""
        return f"RadixKey({head}{more}, len={len(self)}, extra_key={self.extra_key!r})"

    def child_key(self, page_size: int, offset: int = 0) -> Hashable:
        """The first page from `offset` on: what a parent's children are keyed by."""
        return child_key_at(self.tokens, offset, page_size, self.extra_key)

    def match(self, other: "RadixKey", page_size: int) -> int:
        """Length of the common prefix, floored to whole pages (0 if extra keys differ)."""
        if self.extra_key != other.extra_key:
            return 0
        return common_prefix(self.tokens, other.tokens, 0, other.tokens.shape[0], page_size)


def child_key_at(tokens: np.ndarray, offset: int, page_size: int, extra_key: str | None) -> Hashable:
    """The page's token ids as bytes (with the extra key, if any): the same bytes as a
    slice of `tokens.tobytes()`, which the tree's walks use directly."""
    page = tokens[offset:offset + page_size].tobytes()
    return page if extra_key is None else (extra_key, page)


def common_prefix(edge: np.ndarray, tokens: np.ndarray, offset: int, end: int, page_size: int) -> int:
    """Tokens `edge` shares with `tokens[offset:end]`, floored to whole pages."""
    n = min(edge.shape[0], end - offset)
    differ = edge[:n] != tokens[offset:offset + n]
    first = int(differ.argmax())  # the first difference, or 0 when there is none
    common = first if differ[first] else n
    return common - common % page_size
