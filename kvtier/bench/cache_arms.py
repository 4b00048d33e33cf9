"""The baselines `kvtier/bench/cache.py` measures kvtier's scheduler time against, on the
same trace and pool size: SGLang's own device prefix cache driven as its scheduler drives
it, and a bare RadixTree. Each returns the scheduler thread's CPU seconds inside the cache
(`time.thread_time` around every cache call; building SGLang's `Req` objects and marking
them finished are the scheduler's own work and stay outside)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.tree import RadixKey, RadixTree


@dataclass(frozen=True, slots=True)
class ArmResult:
    cpu: float  # scheduler-thread CPU seconds inside the cache, whole trace
    hit_tokens: int  # prompt tokens served from the device prefix cache


def sglang_unavailable() -> str | None:
    """Why SGLang's cache cannot be driven in this process, or None when it can."""
    from kvtier.testing.sglang_loader import Unavailable, load

    try:
        load()
    except Unavailable as exc:
        return str(exc)
    return None


def sglang_device(trace, size: int, page: int, in_flight: int) -> ArmResult:
    """SGLang 0.5.23's RadixCache + ReqToTokenPool + token allocator over `size` token slots:
    batches of up to `in_flight` requests (at most one turn per session), each scheduled
    (match + lock) while its tokens fit free + evictable slots, the batch allocated in one
    `alloc_for_extend`-equivalent call (prompt and output together, as kvtier's arm
    allocates them), then each released into the tree."""
    from kvtier.bench.sglang_device import DeviceCache

    longest = max(len(t.prompt) + len(t.output) for t in trace)
    dc = DeviceCache(size, page, max_running=in_flight, max_context=longest + page)
    queue = deque(range(len(trace)))
    cpu, hits = 0.0, 0
    while queue:
        batch, sessions, reserved = [], set(), 0
        while (
            queue and len(batch) < in_flight and trace[queue[0]].session not in sessions
        ):
            t = trace[queue[0]]
            req = dc.new_request(f"r{queue[0]}", t.prompt, len(t.output))
            start = time.thread_time()
            need = dc.schedule(req, len(t.prompt) + len(t.output), reserved)
            cpu += time.thread_time() - start
            if not need:
                if not batch:
                    raise RuntimeError("device pool too small for one request")
                break
            queue.popleft()
            reserved += need
            sessions.add(t.session)
            batch.append((req, t))
        start = time.thread_time()
        dc.allocate(
            [r for r, _ in batch], [len(t.prompt) + len(t.output) for _, t in batch]
        )
        cpu += time.thread_time() - start
        for req, t in batch:
            hits += req.prefix_len
            dc.finish(req, t.output)
            start = time.thread_time()
            dc.release(req)
            cpu += time.thread_time() - start
    dc.check()
    return ArmResult(cpu, hits)


def bare_tree(trace, page: int) -> ArmResult:
    """The same requests' match (prompt) + insert (prompt and output, whole pages) on a
    bare RadixTree: no tiers, no I/O, no locks, no allocator."""
    tree, slot, cpu, hits = RadixTree(page_size=page), page, 0.0, 0
    for t in trace:
        full = np.concatenate([t.prompt, t.output])
        prompt = RadixKey(t.prompt)
        full = RadixKey(full[: len(full) - len(full) % page])
        fresh = torch.arange(slot, slot + len(full), dtype=torch.int64)
        start = time.thread_time()
        hits += tree.match_prefix(prompt).device_slots.size
        tree.insert(full, fresh)
        cpu += time.thread_time() - start
        slot += len(full)
    return ArmResult(cpu, hits)
