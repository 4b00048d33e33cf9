"""The hit rate of a cache that never evicts, for a hybrid model: only restorable lengths count.

A full-attention prefix is restorable at any page boundary the cache holds. A hybrid
model's is restorable only at a length L where a recurrent state was taken after exactly L
tokens (a state cannot be rewound or advanced without recomputing), with the SWA window
that ends at L whole; a cache that never evicts keeps the window before every state it
keeps, so the states decide. Which lengths have a state is the engine's choice, passed as
`state_points`; `chunk_state_points` is an engine that takes one at every page-aligned
prefill chunk end and at the page-aligned end of what a finished request fed,
`finish_state_points` one that takes a state only where a request finishes (kvtier's
hybrid reference engine, `engine/hybrid_engine.py`: its cache keeps a hybrid prefix at
`cache_finished` only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvtier.hashing import page_hashes

_NS = "0" * 32  # the hashes only need to tell token prefixes apart, within this run


def chunk_state_points(chunk_size: int) -> Callable[[int, int], list[int]]:
    """States at every prefill chunk end (`chunk_size` apart) inside the prompt and at the
    end of what was fed, as lengths before they are floored to a page."""

    def points(prompt_len: int, fed_len: int) -> list[int]:
        return [*range(chunk_size, prompt_len, chunk_size), fed_len]

    return points


def finish_state_points(prompt_len: int, fed_len: int) -> list[int]:
    """A state only at the end of what a finished request fed (floored to a page)."""
    return [fed_len]


def restorable_hit_rate(
    requests: Iterable[tuple[Sequence[int], Sequence[int]]],
    page_size: int,
    state_points: Callable[[int, int], Iterable[int]],
) -> float:
    """Cached prompt tokens over all prompt tokens, for `(prompt, fed)` pairs in the order
    served (`fed`: what the request's KV covers when it finishes, its prompt and all but
    its last output). A request hits the longest length L < len(prompt) at which an earlier
    request took a state (`state_points(len(prompt), len(fed))`, each floored to a page,
    since the cache holds whole pages) over the same first L tokens."""
    with_state: set[bytes] = set()  # chain hash of the last page of each state's prefix
    hit = total = 0
    for prompt, fed in requests:
        key = np.asarray(prompt[:-1], dtype=np.int64)
        hashes = page_hashes(key, page_size, _NS, algo="xxh3_128")
        hit += page_size * next(
            (i + 1 for i in range(len(hashes) - 1, -1, -1) if hashes[i] in with_state),
            0,
        )
        total += len(prompt)
        seq = np.asarray(fed, dtype=np.int64)
        chain = page_hashes(seq, page_size, _NS, algo="xxh3_128")
        for n in state_points(len(prompt), len(fed)):
            pages = min(n, len(fed)) // page_size
            if pages:
                with_state.add(chain[pages - 1])
    return hit / max(total, 1)
