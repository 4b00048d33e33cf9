"""What one forward waits for: the host->device loads of the requests in it, layer by
layer (`TieredCache.begin_forward`)."""

from __future__ import annotations

from kvtier.controller.streams import Handle, TransferError
from kvtier.controller.tp import Agreement


class LayerWaiter:
    """The loads one forward must wait for; later loads belong to the next forward.

    One rank: a failed or late load raises TransferError from `wait_layer` (the forward
    stops; abort its requests). Under tensor parallelism it must not: every rank's forward
    runs the same collectives, and a rank that stopped alone would hang the others. There
    `wait_layer` notes the failure and returns; the forward runs to its end on every rank,
    and `failed()` then names the requests whose load failed on any rank, agreed in one
    collective: abort exactly those, on every rank (docs/design.md §8)."""

    def __init__(self, loads: dict[str, Handle], timeout_s: float, agreement: Agreement, defer: bool) -> None:
        self.loads = loads  # request id -> its load, in the caller's (replicated) order
        self.timeout_s = timeout_s
        self.agreement = agreement
        self.defer = defer
        self.bad: dict[str, str] = {}  # request id -> why its load is unusable (this rank)

    def wait_layer(self, layer: int) -> None:
        for rid, h in self.loads.items():
            if rid in self.bad:
                continue
            try:
                h.wait_layer(layer, self.timeout_s)
            except TransferError as exc:
                if not self.defer:
                    raise
                self.bad[rid] = str(exc)

    def failed(self) -> list[str]:
        """After the forward, on every rank: the requests whose load failed on any rank
        (their outputs are garbage; abort them). One collective iff the forward read loads,
        which is the same on every rank."""
        if not self.loads:
            return []
        rids = list(self.loads)
        mine = [int(rid in self.bad or self.loads[rid].error is not None) for rid in rids]
        _, agreed = self.agreement.agree([], mine)
        return [rid for rid, bad in zip(rids, agreed) if bad]
