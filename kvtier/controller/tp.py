"""Agreement across tensor-parallel ranks.

Every number that changes a tensor shape (acks to apply, prefetched pages to take, whether
to stop a prefetch) is agreed in ONE all-reduce per `poll()`, called unconditionally on
every rank with a vector whose length depends only on replicated scheduler state. MIN
agrees on counts; MAX (sent negated through the same MIN) agrees on "stop".

The optional consensus checker hashes each rank's decisions and all-reduces MIN and MAX of
the digest; if they differ the ranks have diverged: it logs a critical line and exits.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import xxhash

log = logging.getLogger(__name__)
DIVERGED_EXIT_CODE = 70


class Agreement:
    def __init__(self, group=None, consensus_check: bool | None = None) -> None:
        self.group = group
        if consensus_check is None:
            consensus_check = os.environ.get("KVTIER_CONSENSUS_CHECK", "") not in (
                "",
                "0",
            )
        self.consensus_check = consensus_check and group is not None
        self.collectives = 0
        self._rank, self._world_size = 0, 1
        if group is not None:
            import torch.distributed as dist

            self._rank, self._world_size = (
                dist.get_rank(group),
                dist.get_world_size(group),
            )

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def release(self) -> None:
        """Let go of the process group: a closed cache makes no more collectives. An
        engine destroys its group after closing the cache; a reference kept here kept the
        group, its gloo threads and rank 0's TCPStore server thread alive to interpreter
        exit, whose teardown then destroyed a joinable std::thread (std::terminate:
        "terminate called without an active exception", the rank killed by SIGABRT)."""
        self.group = None

    def agree(self, mins: list[int], maxs: list[int]) -> tuple[list[int], list[int]]:
        """(MIN over ranks of `mins`, MAX over ranks of `maxs`) in one collective."""
        if self.group is None:
            return list(mins), list(maxs)
        import torch.distributed as dist

        vec = torch.tensor(list(mins) + [-v for v in maxs], dtype=torch.int64)
        dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=self.group)
        self.collectives += 1
        out = vec.tolist()
        return out[: len(mins)], [-v for v in out[len(mins) :]]

    def check(self, decisions: list[int]) -> None:
        """Exit the process if ranks made different decisions (only when enabled)."""
        if not self.consensus_check:
            return
        import torch.distributed as dist

        digest = (
            xxhash.xxh3_64_intdigest(
                torch.tensor(decisions, dtype=torch.int64).numpy().tobytes()
            )
            >> 2
        )
        vec = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=self.group)
        self.collectives += 1
        if vec[0].item() != -vec[1].item():
            log.critical(
                "kvtier consensus check: ranks diverged (digest min %d != max %d); exiting",
                vec[0].item(),
                -vec[1].item(),
            )
            logging.shutdown()
            sys.stderr.flush()
            os._exit(DIVERGED_EXIT_CODE)
