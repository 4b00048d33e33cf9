"""One tensor-parallel rank of the TP test (run as a subprocess by test_tp.py).

argv: rank world_size port out_file [diverge | fail_loads | fail_late | timeout]

fail_loads: every second host->device load of rank 1 fails after its first layer; rank 0's
never do. fail_late: every second load of rank 1 lands all its layers, then fails after the
forward has asked `failed()` (only `cache_finished` can see it). timeout: prefetches run
under `prefetch_policy: timeout` with deadlines of a few ms, which each rank's clock passes
at its own moment. Either way the ranks must agree on every decision and finish.
"""

import json
import os
import random
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from kvtier.tiers.streams import CpuTransferStream, make_stream
from kvtier.errors import TransferError
from kvtier.controller.tp import Agreement
from tests.controller.helpers import StallingStore, fill, make_cache


AFTER_FORWARD = threading.Event()  # set once the forward has asked failed()


class FailingLoads(CpuTransferStream):
    """A real CPU stream whose every second job fails: after layer 0 (having copied
    nothing), or `late`: after every layer has landed and the forward has asked failed()."""

    def __init__(self, name: str, late: bool) -> None:
        super().__init__(
            name, help_waiters=not late
        )  # a late failure needs the job off the forward's thread
        self.jobs, self.late = 0, late

    def submit(self, job, handle):
        self.jobs += 1
        if self.jobs % 2 == 0 and not self.late:

            def job(h):
                h.layer_done(0)
                raise TransferError("test: this rank's copy failed after layer 0")
        elif self.jobs % 2 == 0:

            def job(h, copy=job):
                copy(h)  # every layer lands and is signalled
                AFTER_FORWARD.wait(30)
                raise TransferError(
                    "test: this rank's copy failed after its last layer"
                )

        return super().submit(job, handle)


def main() -> None:
    rank, world, port, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
    )
    mode = sys.argv[5] if len(sys.argv) > 5 else ""
    diverge = mode == "diverge"
    streams = {}
    if mode in ("fail_loads", "fail_late") and rank == 1:
        streams["stream_factory"] = lambda name, device: (
            FailingLoads(name, mode == "fail_late")
            if name == "load"
            else make_stream(name, device)
        )
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    if (
        diverge and rank == 1
    ):  # a bug on purpose: this rank reports a different decision
        check = Agreement.check
        Agreement.check = lambda self, decisions: check(
            self, [d + 1 for d in decisions]
        )
    # each rank's store answers at its own pace: local completion timing differs
    store = StallingStore(fast_reads=0, stall_s=0.002 * (rank + 1))
    policy = {"prefetch_policy": "best_effort"}
    if mode == "timeout":
        policy = {
            "prefetch_policy": "timeout",
            "prefetch_timeout_base_s": 0.004,
            "prefetch_timeout_per_1k_tokens_s": 0.001,
        }
    cache = make_cache(
        pool_size=64,
        ratio=1.5,
        store_obj=store,
        tp_group=dist.group.WORLD,
        consensus_check=diverge,
        **policy,
        **streams,
    )
    rng = random.Random(7)  # the scheduler's stream: identical on every rank
    jitter = random.Random(100 + rank)  # local timing: different per rank
    prefixes = [np.array([rng.randrange(40) for _ in range(8)]) for _ in range(4)]
    decisions = []
    for step in range(120):
        tokens = np.concatenate(
            [
                rng.choice(prefixes),
                [rng.randrange(40) for _ in range(rng.randrange(1, 9))],
            ]
        )
        rid = f"r{step}"
        got = cache.acquire(tokens, rid)
        while (
            not got.ready
        ):  # readiness comes from agreed numbers: every rank leaves together
            time.sleep(
                jitter.random() * (0.001 if mode == "timeout" else 0.012)
            )  # timeout: many polls
            if rid in cache.poll():
                got = cache.acquire(tokens, rid)
        cached = got.indices.numel()
        mine = cache.alloc(len(tokens) - cached)
        waiter = cache.begin_forward()
        for layer in range(cache.pool.num_layers):
            waiter.wait_layer(layer)  # under TP a failed load does not raise here
        fill(cache, mine, seed=step)
        kv = torch.cat([got.indices, mine])
        failed, refused = rid in waiter.failed(), False
        AFTER_FORWARD.set()
        if failed:
            cache.abort(rid, kv)
        else:
            try:
                cache.cache_finished(rid, tokens, kv)
            except TransferError:  # agreed on every rank: none inserted it
                refused = True
        AFTER_FORWARD.clear()
        decisions.append(
            [
                got.device_hit,
                got.host_hit,
                got.storage_hit,
                cached,
                int(failed),
                int(refused),
            ]
        )
        time.sleep(jitter.random() * 0.003)
        cache.poll()
        if step % 40 == 39:
            cache.flush()
        cache.tree.sanity_check()
        cache.check_accounting()
    cache.close()
    dist.destroy_process_group()  # as an engine does, the cache closed (and alive)
    with open(out, "w") as f:
        json.dump(
            {
                "decisions": decisions,
                "collectives": cache.agreement.collectives,
                "stats": cache.stats()["counters"],
                "threads_left": distributed_threads(),
            },
            f,
        )


def distributed_threads() -> list[str]:
    """This process's native threads of torch.distributed (gloo's loops, rank 0's TCPStore
    server): a joinable one still there at interpreter exit can abort the rank."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # ended meanwhile
            continue
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n)


if __name__ == "__main__":
    main()
