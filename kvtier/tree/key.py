"""Token keys for the radix tree, kept in numpy buffers (cheap to slice, compare and hash)."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch

from kvtier.numpy_gil import GIL_CHUNK, HIGH, shared_bytes
from kvtier.tiers.indices import concat


class RadixKey:
    """Token ids plus an optional `extra_key` (LoRA id, tenant...).

    Keys with different extra keys never match: the extra key is part of every child key.
    A key owns its ids (a copy of what it was made from): changing the caller's buffer
    afterwards changes no key, and so nothing the tree holds.
    """

    __slots__ = ("tokens", "extra_key")

    def __init__(self, tokens, extra_key: str | None = None) -> None:
        if isinstance(tokens, torch.Tensor) and tokens.device.type != "cpu":
            raise ValueError(
                f"tokens: a {tokens.device} tensor; pass host token ids (a list, a numpy array or a CPU "
                f"tensor): a copy from the device would wait for it on the scheduler thread"
            )
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(
                f"tokens: expected a 1-D sequence of token ids, got shape {arr.shape}"
            )
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(
                f"tokens: expected integer token ids, got dtype {arr.dtype}"
            )
        if (
            arr.dtype == np.uint64 and arr.size and arr.max() > 0xFFFFFFFF
        ):  # before int64 wraps them negative
            _refuse_range(arr[arr > 0xFFFFFFFF])
        own = np.ascontiguousarray(arr, dtype=np.int64)
        if (
            own is tokens or not own.flags.owndata
        ):  # the caller's memory (an array, a view, a tensor)
            # copied: the tree keeps keys, and a view of a buffer the engine refills for its
            # next batch would rewrite cached prompts under their KV. `concat` joins bytes
            # keeping the GIL; numpy's copy gives it up past 500 ids (docs/design.md §2)
            own = concat([own])
        self.tokens = own
        self.extra_key = _check_extra_key(extra_key)
        _check_range(self.tokens)

    @classmethod
    def _of(cls, tokens: np.ndarray, extra_key: str | None) -> RadixKey:
        """A key over an int64 array that is already checked (slices of a key)."""
        key = object.__new__(cls)
        key.tokens, key.extra_key = tokens, extra_key
        return key

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, item: slice) -> RadixKey:
        return RadixKey._of(self.tokens[item], self.extra_key)

    def __repr__(self) -> str:
        head = self.tokens[:8].tolist()
        more = "..." if len(self) > 8 else ""
        return f"RadixKey({head}{more}, len={len(self)}, extra_key={self.extra_key!r})"

    def child_key(self, page_size: int, offset: int = 0) -> Hashable:
        """The first page from `offset` on: what a parent's children are keyed by."""
        return child_key_at(self.tokens, offset, page_size, self.extra_key)

    def match(self, other: RadixKey, page_size: int) -> int:
        """Length of the common prefix, floored to whole pages (0 if extra keys differ)."""
        if self.extra_key != other.extra_key:
            return 0
        return common_prefix(
            self.tokens, other.tokens, 0, other.tokens.shape[0], page_size
        )


def same_prefix(a: RadixKey, b: RadixKey, n: int) -> bool:
    """Do `a` and `b` both have `n` tokens or more, the same first `n` and the same extra key?"""
    return (
        a.extra_key == b.extra_key
        and len(a) >= n
        and len(b) >= n
        and a.tokens[:n].tobytes() == b.tokens[:n].tobytes()
    )


def _check_extra_key(extra_key):
    """None or a str that encodes as UTF-8 (page hashes include it: docs/formats.md). Else
    ValueError naming it: another type matched in the tree but failed to hash on the storage
    thread, in the prefetch and in every backup of the request's pages."""
    if extra_key is None:
        return None
    if isinstance(extra_key, str):
        try:
            extra_key.encode()
            return extra_key
        except UnicodeEncodeError:
            pass
    raise ValueError(
        f"extra_key={extra_key!r}: must be None or a str that encodes as UTF-8 (LoRA id, tenant...)"
    )


def _check_range(tokens: np.ndarray) -> None:
    """Token ids must fit the page hash's encoding, little-endian uint32 (docs/formats.md):
    an id outside [0, 2**32) would hash like another one (-1 like 4294967295), so two
    prompts the tree tells apart would share stored pages. The upper halves must all be
    zero; counted in pieces of GIL_CHUNK: one numpy pass over a long prompt would give the
    GIL up (docs/design.md §2)."""
    high = tokens.view(np.uint32)[HIGH::2]
    for i in range(0, high.shape[0], GIL_CHUNK):
        if np.count_nonzero(high[i : i + GIL_CHUNK]):
            _refuse_range(tokens[(tokens < 0) | (tokens > 0xFFFFFFFF)])


def _refuse_range(bad: np.ndarray) -> None:
    raise ValueError(
        f"tokens: ids must be in [0, 2**32) (a page hash encodes each as uint32), got "
        f"{bad[:4].tolist()}{' ...' if bad.size > 4 else ''}"
    )


def child_key_at(
    tokens: np.ndarray, offset: int, page_size: int, extra_key: str | None
) -> Hashable:
    """The page's token ids as bytes (with the extra key, if any): the same bytes as a
    slice of `tokens.tobytes()`, which the tree's walks use directly."""
    page = tokens[offset : offset + page_size].tobytes()
    return page if extra_key is None else (extra_key, page)


def common_prefix(
    edge: np.ndarray, tokens: np.ndarray, offset: int, end: int, page_size: int
) -> int:
    """Tokens `edge` shares with `tokens[offset:end]`, floored to whole pages."""
    n = min(edge.shape[0], end - offset)
    return edge_prefix(
        edge[:n].tobytes(), tokens[offset : offset + n].tobytes(), 0, n, page_size
    )


def edge_prefix(edge: bytes, data: bytes, offset: int, end: int, page_size: int) -> int:
    """`common_prefix` of int64 tokens given as bytes (`data` holds tokens [0, end) at
    least), keeping the GIL (`shared_bytes`; numpy's compare gave it up mid-walk)."""
    n = min(len(edge) >> 3, end - offset)
    common = shared_bytes(edge, 0, data, offset << 3, n << 3) >> 3
    return common - common % page_size
