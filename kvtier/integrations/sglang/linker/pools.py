"""A hybrid model's pools below SGLang's tree: one `LinkerCore` per pool SGLang hands the
linker (KV, SWA, MAMBA), each with its own host tier, pins, LRU, store namespace and
copies; this module joins their answers into SGLang's one call each. Engine-free (the
shell and the fault simulator drive it).

What each pool keeps, and where it can restore (SGLang's page keys are chained: a page's
key names its whole prefix, so a side pool's page under that key is the one computed at
that point of that prefix):

| pool | a page is | offloaded | restorable at length p (pages) |
|---|---|---|---|
| kv | a page of every Full layer | every page of a node | pages [0, p) all there |
| swa | a page of every SWA layer | the node's pages still SWA-resident | the window's `w` pages ending at p |
| mamba | one state slot, every Mamba layer | the state at the node's end, under its last key | the state at page p - 1 |

A lookup answers every length where all pools can restore (a sparse list: SGLang takes
the largest that every rank answered). A side pool's window (`w` pages, SGLang's
`len(transfer.keys)`) is taken from the KV keys at each length, never from the side
keys SGLang sends, which are the longest candidate's.

Offloads are SGLang's, one per node, of all its pools: done when every pool's part is;
a pool's part that failed makes it False (its other pools' pages stay: keys name
content). Loads are per pool; a batch's load is one index over each pool's own batch,
and the forward's wait for model layer g waits for the pool that owns g, its layer only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import is_not, or_
from typing import ClassVar

import numpy as np
import torch

from kvtier.integrations.sglang.linker.core import LinkerCore
from kvtier.integrations.sglang.linker.hints import PoolHints
from kvtier.tiers.indices import slots_of
from kvtier.tiers.pool import DeviceKVPool

KV = "kv"


@dataclass(slots=True, frozen=True)
class StateRowsConfig:
    """A Mamba pool as kvtier sees it: per layer, each state buffer (temporal, conv...)
    one part, its bytes as 2-byte elements (the buffers' own dtypes may differ; copies
    move bits)."""

    size: int
    num_layers: int
    part_widths: tuple[int, ...]
    device: str
    dtype: str = "bfloat16"
    page_size: ClassVar[int] = 1
    attention: ClassVar[str] = "state"

    @property
    def page_layout(self) -> str:
        return f"state-rows:layers={self.num_layers}:widths={','.join(map(str, self.part_widths))}"


class StateRows(DeviceKVPool):
    """kvtier's pool over SGLang's per-layer state buffers (no copy): one slot a page."""

    def __init__(self, layers: list[list[torch.Tensor]]) -> None:
        if not layers or not layers[0]:
            raise ValueError("state pool: no layers or no state buffers")
        rows = layers[0][0].shape[0]
        # a conv-only model's temporal state is empty: no bytes to move, no part
        views = [[_as_rows(t, rows) for t in parts if t.numel()] for parts in layers]
        if not views[0]:
            raise ValueError("state pool: every state buffer is empty")
        widths = tuple(v.shape[1] for v in views[0])
        config = StateRowsConfig(
            rows - 1, len(layers), widths, str(layers[0][0].device)
        )
        self._setup(config, views, None, latent_split=False)


def _as_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` ([rows, ...], any dtype) as [rows, bytes / 2] bfloat16, the same memory."""
    if t.shape[0] != rows or not t.is_contiguous():
        raise ValueError(
            f"state buffer {tuple(t.shape)} {t.dtype}: expected a contiguous [{rows}, ...] tensor"
        )
    raw = t.reshape(rows, -1).view(torch.uint8)
    if raw.shape[1] % 2:
        raise ValueError(
            f"state buffer {tuple(t.shape)} {t.dtype}: {raw.shape[1]} bytes a slot; "
            "kvtier moves states in 2-byte units"
        )
    return raw.view(torch.bfloat16)


def describe(tensors: Sequence[torch.Tensor]) -> str:
    """What a pool's bytes depend on: each buffer's dtype and per-slot shape."""
    return ",".join(
        f"{str(t.dtype).removeprefix('torch.')}[{'x'.join(map(str, t.shape[1:]))}]"
        for t in tensors
    )


@dataclass(slots=True, frozen=True)
class Side:
    """A side pool's part of a transfer: its keys and device slots (None on lookup)."""

    keys: list[str]
    slots: object = None


class PoolsCounter:
    """SGLang's `layer_done_counter` over the pools' own counters: a batch index names
    each pool's batch; `wait_until(g)` waits for model layer g in the pool owning it."""

    def __init__(self, cores: dict[str, LinkerCore], owner: dict[int, tuple[str, int]]):
        self.cores, self.owner = cores, owner
        self.batches: dict[int, dict[str, int]] = {}
        self.producer_index = -1
        self.consumer_index = -1

    def update_producer(self, batch: dict[str, int]) -> int:
        self.producer_index += 1
        self.batches[self.producer_index] = batch
        return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index
        for name, i in self.batches.get(index, {}).items():
            self.cores[name].counter.set_consumer(i)

    def wait_until(self, layer: int) -> None:
        name, local = self.owner.get(layer, (None, 0))
        if name in self.batches.get(self.consumer_index, {}):
            self.cores[name].counter.wait_until(local)

    def finish(self, index: int) -> dict[str, int]:
        return self.batches.pop(index, {})


class PoolCores:
    """SGLang's calls for a hybrid model, each handed to every pool's LinkerCore
    (`cores[name]`, `kv` first); `offloads` names the pools of each offload in flight,
    oldest first. A lookup's `windows[name]` is a side pool's window in pages (SGLang's
    `len(transfer.keys)`: SWA the model's window at most, Mamba 1); `restores[name]` is
    the model's (the pages ending at a length that a restore there needs; None: all)."""

    def __init__(
        self,
        cores: dict[str, LinkerCore],
        owner: dict[int, tuple[str, int]],
        restores: dict[str, int | None] | None = None,
    ) -> None:
        assert next(iter(cores)) == KV, "the KV pool's core comes first"
        self.cores = cores
        self.counter = PoolsCounter(cores, owner)
        # an agent's lease pins, in every pool, what a restore of its prefix needs
        self.hints = PoolHints(
            {name: core.hints for name, core in cores.items()}, restores or {}
        )
        self.offloads: deque[tuple[str, ...]] = deque()  # the pools of each offload
        self.closed = False

    @property
    def kv(self) -> LinkerCore:
        return self.cores[KV]

    @property
    def l3(self):
        return self.kv.l3

    def _core(self, name: str) -> LinkerCore:
        core = self.cores.get(name)
        if core is None:
            raise ValueError(
                f"pool {name!r}: this linker serves pools {sorted(self.cores)}"
            )
        return core

    def _checked(self, kv: Side, sides: dict[str, Side]) -> dict[str, LinkerCore]:
        """Every part's core, each part checked before any core queues one: a bad part
        refused after another pool queued its own would leave that pool's op unmatched."""
        cores = {}
        for name, part in {KV: kv, **sides}.items():
            core = cores[name] = self._core(name)
            keys = part.keys
            if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
                raise ValueError(
                    f"pool {name!r}: keys: expected a list of SGLang page keys "
                    "(non-empty strings)"
                )
            if part.slots is None:
                raise ValueError(f"pool {name!r}: device_indices missing")
            n = slots_of(part.slots).shape[0]
            if n != len(keys) * core.page_size:
                raise ValueError(
                    f"pool {name!r}: device_indices has {n} slots for {len(keys)} "
                    f"pages; expected {len(keys) * core.page_size} "
                    f"({core.page_size} per page)"
                )
        return cores

    # -- offload -----------------------------------------------------------------------

    def offload(self, kv: Side, sides: dict[str, Side]) -> bool:
        parts = {KV: kv, **sides}
        cores = self._checked(kv, sides)
        for name, part in parts.items():
            cores[name].offload(part.keys, part.slots)
        self.offloads.append(tuple(parts))
        return True

    def num_completed_offloads(self) -> int:
        """Offloads, oldest first, whose every pool's part has finished."""
        ready = {
            name: core.num_completed_offloads() for name, core in self.cores.items()
        }
        n = 0
        for names in self.offloads:
            if any(ready[name] == 0 for name in names):
                break
            for name in names:
                ready[name] -= 1
            n += 1
        return n

    def pop_completed_offload(self) -> bool:
        names = self.offloads.popleft()
        done = [self.cores[name].pop_completed_offload() for name in names]
        return all(done)

    # -- lookup ------------------------------------------------------------------------

    def lookup(
        self, rid: str, keys: Sequence[str], windows: dict[str, int]
    ) -> list[int]:
        """Every length p (pages of `keys`) where the KV pages [0, p) and, for each side
        pool in `windows`, its `windows[name]` pages ending at p can be restored by a load
        queued next."""
        end = self.kv.lookup(rid, keys)
        lengths = list(range(1, end + 1))
        for name, window in windows.items():
            if not lengths:
                break
            lengths = self._side_lengths(self._core(name), keys[:end], window, lengths)
        return lengths

    def _side_lengths(
        self, core: LinkerCore, keys: Sequence[str], window: int, lengths: list[int]
    ) -> list[int]:
        """The lengths of `lengths` whose window of `window` pages this pool holds (on
        host, or in its store with host room to read it). Prefix counts make each length
        one subtraction: lookups answer long tails on the scheduler thread."""
        window = max(1, window)
        on_host = list(map(is_not, map(core.index.get, keys), repeat(None)))
        in_store = [False] * len(keys)
        lo = max(0, lengths[0] - window)
        missing = [i for i in range(lo, len(keys)) if not on_host[i]]
        if missing and core.l3 is not None:
            found = core.store_ops.present([keys[i] for i in missing])
            for i, held in zip(missing, found):
                in_store[i] = held
        # held[i]: pages of keys[:i] held; stored[i]: of those, in the store only
        held = np.array([0, *accumulate(map(or_, on_host, in_store))])
        stored = np.array([0, *accumulate(in_store)])
        ends = np.array(lengths)
        starts = np.maximum(ends - window, 0)
        whole = held[ends] - held[starts] == ends - starts
        # its load pins the window's host pages, then reserves one per store page
        fits = (stored[ends] == stored[starts]) | (ends - starts <= core.index.room())
        out = ends[whole & fits].tolist()
        if out:  # the window a load would take is the newest in this pool's LRU
            core.index.run(keys[max(0, out[-1] - window) : out[-1]])
        c = core.counters
        c.lookups += 1
        c.lookup_pages += window
        return out

    # -- load --------------------------------------------------------------------------

    def load(self, rid: str, kv: Side, sides: dict[str, Side]) -> bool:
        parts = {KV: kv, **sides}
        cores = self._checked(kv, sides)
        for name, part in parts.items():
            cores[name].load(rid, part.keys, part.slots)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return any([core.cancel_queued_load(rid) for core in self.cores.values()])

    def start_layer_wise_loading(self) -> int:
        batch = {}
        for name, core in self.cores.items():
            index = core.start_layer_wise_loading()
            if index >= 0:
                batch[name] = index
        return self.counter.update_producer(batch) if batch else -1

    def finish_layer_wise_loading(self, index: int) -> bool:
        batch = self.counter.finish(index)
        done = [
            self.cores[name].finish_layer_wise_loading(i) for name, i in batch.items()
        ]
        return all(done)

    # -- lifecycle ---------------------------------------------------------------------

    def quiesce(self) -> None:
        for core in self.cores.values():
            core.quiesce()

    def reset(self) -> None:
        """Every pool's `reset`; the offloads in flight are dropped (SGLang releases them)."""
        for core in self.cores.values():
            core.reset()
        self.offloads.clear()
        self.counter.batches.clear()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.offloads.clear()
        for core in self.cores.values():
            core.close()

    def check_accounting(self) -> list[str]:
        return [
            f"{name}: {problem}"
            for name, core in self.cores.items()
            for problem in core.check_accounting()
        ]

    def stats(self) -> dict:
        """The KV pool's (SGLang's metrics read them), and every pool's under `pools`."""
        out = self.kv.stats()
        out["pools"] = {name: core.stats() for name, core in self.cores.items()}
        return out
