"""What one forward waits for: the host->device loads of the requests in it, layer by
layer (`TieredCache.begin_forward`)."""

from __future__ import annotations

import operator

import numpy as np

from kvtier.tiers.streams import Handle
from kvtier.errors import TransferError
from kvtier.controller.tp import Agreement


class LayerWaiter:
    """The loads one forward must wait for; later loads belong to the next forward.

    The one channel for a failed load (docs/design.md §8): `wait_layer` never raises for a
    failed or late load — it notes the failure and returns, and the forward runs to its
    end (under tensor parallelism every rank's forward runs the same collectives: a rank
    that stopped alone would hang the others). After the forward, `failed()` names the
    requests whose load failed on any rank (agreed in one collective under tensor
    parallelism): their outputs are garbage; abort exactly those, on every rank."""

    def __init__(
        self,
        loads: dict[str, Handle],
        timeout_s: float,
        agreement: Agreement,
        num_layers: int,
    ) -> None:
        self.loads = loads  # request id -> its load, in the caller's (replicated) order
        self.num_layers = num_layers
        self.timeout_s = timeout_s
        self.agreement = agreement
        self.bad: dict[
            str, str
        ] = {}  # request id -> why its load is unusable (this rank)

    def wait_layer(self, layer: int) -> None:
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            layer = self._layer(layer)
        for rid, h in self.loads.items():
            if rid in self.bad:
                continue
            try:
                h.wait_layer(layer, self.timeout_s)
            except TransferError as exc:
                self.bad[rid] = str(exc)
                h.missed = True  # landing later does not mend this forward: the finish is refused

    def _layer(self, layer) -> int:
        """`layer` as an int if it is an integer in [0, num_layers) (a numpy one too), else
        ValueError: -1 returned at once (nothing waited for, and the forward read KV not
        loaded yet), a layer past the last waited out the whole timeout and blamed the load."""
        try:
            index = (
                None if isinstance(layer, (bool, np.bool_)) else operator.index(layer)
            )
        except TypeError:
            index = None
        if index is None or not 0 <= index < self.num_layers:
            raise ValueError(
                f"wait_layer: layer={layer!r}: must be an integer in [0, {self.num_layers})"
            )
        return index

    def failed(self) -> list[str]:
        """After the forward, on every rank: the requests whose load failed on any rank
        (their outputs are garbage; abort them). One collective iff the forward read loads
        and there are several ranks (the loads are the same on every rank)."""
        if not self.loads:
            return []
        rids = list(self.loads)
        mine = [
            int(rid in self.bad or self.loads[rid].error is not None) for rid in rids
        ]
        _, agreed = self.agreement.agree([], mine)
        return [rid for rid, bad in zip(rids, agreed) if bad]
