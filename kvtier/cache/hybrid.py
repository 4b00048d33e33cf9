"""HybridTieredCache: `TieredCache` for a hybrid model, whose layers keep FULL KV, SWA KV
and/or a recurrent (Mamba) state (docs/design.md, "Hybrid models: components"). Its tree
is a `HybridRadixTree`; each component has its own pool, mirror and slot allocators
(`cache/components.py`); the one controller moves every component's slots in the same
two-phase ops as FULL KV: a node's write carries its SWA KV and state with its FULL KV, a
request's load carries its window and state with its FULL KV, landing per model layer.

The sequence is `TieredCache`'s, with what a hybrid forward needs besides FULL slots:

    got = cache.acquire(tokens, rid)       # HybridAcquired: FULL slots as before, plus
                                           #   swa_indices (SWA slots of [swa_start, L)) and
                                           #   state_slot (the request's own slot holding the
                                           #   state after exactly L = len(got.indices) tokens)
    slots = cache.alloc(n)                 # FULL slots, as before
    swa = cache.alloc_swa(n)               # SWA slots for n more tokens (whole pages)
    snap = cache.alloc_state(rid)          # a state slot of the request's (a snapshot's target)
    waiter = cache.begin_forward([rid]); waiter.wait_layer(i)   # i: the MODEL's layer index
    cache.cache_finished(rid, tokens, kv, swa_indices=swa_row, mamba_slot=snap)
    cache.abort(rid, kv, swa_indices=swa_row)                   # frees every component's slots

Who owns a side slot (as for FULL, kvtier/README.md "Who owns a slot"):

| slot | owner |
|---|---|
| SWA slots in `got.swa_indices[:got.swa_tree_len]` | the tree (locked for the request) |
| the rest of `got.swa_indices`, `alloc_swa` slots | the request: it passes them back in its SWA row |
| `got.state_slot`, `alloc_state(rid)` slots | the request (the cache keeps the list: a finish or abort frees them) |
| `mamba_slot` given to a finish | the tree (or freed, if the tree had a state there) |

A hit of length L is one every component accepts: FULL KV of [0, L), the SWA KV of the
window [L - W, L) (W rounded up to pages) and the state at exactly L, each on device or
host; a host part is loaded into slots the request owns. A full-attention caller sees
`TieredCache` unchanged: build a `TieredCache` for a FULL-only model.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.cache.facade import Acquired, TieredCache
from kvtier.tiers.components import Component, ComponentSpec
from kvtier.tiers.streams import make_stream


@dataclass(slots=True, frozen=True)
class HybridAcquired(Acquired):
    """`Acquired` (FULL: `indices`, hits per tier) plus the side components of the prefix,
    L = len(indices) tokens:

    - `swa_indices`: SWA slots of tokens [swa_start, L), swa_start = max(0, L - W) with W
      the window rounded up to whole pages (empty without SWA, or when L is 0). The first
      `swa_tree_len` are the tree's (locked until the finish/abort; never write them), the
      rest the request's (loaded or copied from host/device into slots it owns).
    - `state_slot`: a state-pool slot the request owns, holding the recurrent state after
      exactly L tokens (zeros when L is 0); the forward advances it in place. None without
      MAMBA, or while not ready.
    """

    swa_indices: torch.Tensor = field(
        default_factory=lambda: torch.empty(0, dtype=torch.int64)
    )
    swa_start: int = 0
    swa_tree_len: int = 0
    state_slot: int | None = None


class HybridTieredCache(TieredCache):
    def __init__(
        self,
        config,
        components: Mapping[Component, ComponentSpec],
        layers: Sequence[Component],
        tp_group=None,
        store=None,
        stream_factory=make_stream,
        clock=time.monotonic,
        agreement=None,
    ) -> None:
        """`config` as for `TieredCache` (its `pool` is replaced by the FULL spec's pool);
        `components`: the model's `ComponentSpec` per component (FULL required; e.g.
        `HybridModel.component_specs(...)`); `layers`: the component of each model layer,
        bottom up (`Component.FULL` for a full-attention layer, `SWA` for a sliding-window
        one, `MAMBA` for a recurrent one): `begin_forward`'s waiter counts the model's
        layers and a load lands layer i's component data before `wait_layer(i)` returns.
        Tensor parallelism is not supported yet (one rank)."""
        raise NotImplementedError

    # -- side slots for requests --------------------------------------------------------------

    def alloc_swa(self, n: int) -> torch.Tensor | None:
        """Whole pages of SWA slots for `n` more tokens (the tail of the last page after
        them), evicting SWA KV on demand; None if short. The request's own: it lists them
        in its SWA row at its finish or abort."""
        raise NotImplementedError

    def free_swa(self, indices: torch.Tensor) -> None:
        """Give back SWA slots of the request's own (from `alloc_swa`)."""
        raise NotImplementedError

    def alloc_state(self, request_id: str) -> int | None:
        """One state slot for the request (e.g. the target of the snapshot at the aligned
        end that its finish passes as `mamba_slot`), evicting states on demand; None if
        short. Its finish or abort frees it unless the tree took it."""
        raise NotImplementedError

    # -- the request sequence (as TieredCache, plus the side components) ----------------------

    def acquire(
        self, tokens, request_id: str, extra_key: str | None = None
    ) -> HybridAcquired:
        """`TieredCache.acquire`, with the restore of every component the match needs:
        the FULL path, the SWA window ending at the match and the state at it. Device
        parts are locked (or copied into the request's slots); host parts protected and
        loaded, in one load op per request whose layer i lands before `wait_layer(i)`."""
        raise NotImplementedError

    def cache_finished(
        self,
        request_id: str,
        tokens,
        kv_indices: torch.Tensor,
        extra_key: str | None = None,
        priority: int = 0,
        *,
        swa_indices: torch.Tensor | None = None,
        mamba_slot: int | None = None,
    ) -> None:
        """`TieredCache.cache_finished`, plus: `swa_indices`, the request's SWA row for
        tokens [swa_start, len(tokens)) (what `acquire` handed, then its own `alloc_swa`
        slots; the tail of the last page may follow), required with SWA; `mamba_slot`, a
        state slot of the request's holding the state after exactly the page-aligned
        length (None: no state is kept, the prefix is then a hit only up to an earlier
        state). Every other side slot the request owns is freed."""
        raise NotImplementedError

    def cache_unfinished(
        self, request_id: str, tokens, kv_indices: torch.Tensor, extra_key=None
    ) -> torch.Tensor:
        """Chunked prefill is not supported for a hybrid model yet: ValueError."""
        raise ValueError(
            "cache_unfinished: chunked prefill is not supported for a hybrid model; "
            "run the request's prefill in one chunk"
        )

    def abort(
        self,
        request_id: str,
        kv_indices: torch.Tensor | None = None,
        *,
        swa_indices: torch.Tensor | None = None,
    ) -> None:
        """`TieredCache.abort`, plus: the request's SWA row (its own slots in it are
        freed; the tree's are unlocked) and every state slot the request owns."""
        raise NotImplementedError
