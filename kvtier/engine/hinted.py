"""A replay that gives the cache an agent's hints at its tool-call pauses (`tierctl replay
--hints`): when a session's turn ends in a pause (`workloads.pauses`), its KV so far is
pinned on host and in the store; before the turn that resumes it is queued, that prefix is
prefetched; once the resumed turn has finished, the lease is released. Turns are queued
in trace order, a batch's worth at a time, a resumed turn once its session's last turn
has ended; the same driver without hints is the baseline.

What it measures (`resumed_ratio`): hit tokens served from device or host on resumed
turns, over what a cache that never evicts would hit on them (the bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.cache.hints import LeaseBoundError
from kvtier.engine.engine import Engine, Result
from kvtier.engine.workloads import Turn, pauses
from kvtier.tree import RadixKey, RadixTree

LEASE_S = 600.0  # the pause's lease; released when the resumed turn ends
TIERS = ("host", "store")


@dataclass(slots=True, frozen=True)
class HintedRun:
    results: list[Result]  # in the order they ended
    resumed: list[Result]  # the turns that resumed a session after a pause
    pins: int
    pins_refused: int  # over the session's lease bound (advice: the run goes on)
    prefetches: int


def replay(
    engine: Engine, turns: list[Turn], hints: bool, keep_logits: bool = False
) -> HintedRun:
    """Serve `turns` through `engine`, with the pause hints or without them."""
    cache, window = engine.cache, engine.max_batch
    pause = pauses(turns)
    resumes = set(pause.values())
    resume_of = {
        j: i for i, j in pause.items()
    }  # resumed turn -> the turn paused after
    ended: set[int] = set()
    pinned: dict[str, np.ndarray] = {}  # session -> the tokens its lease holds
    index: dict[str, int] = {}  # ticket -> turn index
    results, resumed = [], []
    pins = refused = prefetches = 0
    i = 0
    while i < len(turns) or engine.pending():
        while (
            i < len(turns)
            and len(index) < window
            and (i not in resumes or resume_of[i] in ended)
        ):
            session = turns[i].session
            if hints and i in resumes and session in pinned:
                prefetches += cache.prefetch(pinned[session])
            index[engine.submit(turns[i])] = i
            i += 1
        for r in engine.step(keep_logits):
            j = index.pop(r.ticket)
            ended.add(j)
            results.append(r)
            if j in resumes:
                resumed.append(r)
                if hints and r.session in pinned:
                    cache.release(pinned.pop(r.session), tenant=r.session)
            if hints and j in pause and r.error is None:
                fed = np.asarray(r.prompt + r.output[:-1], dtype=np.int64)
                try:
                    cache.pin(fed, LEASE_S, TIERS, tenant=r.session)
                except LeaseBoundError:
                    refused += 1
                    continue
                pinned[r.session] = fed
                pins += 1
    return HintedRun(results, resumed, pins, refused, prefetches)


def resumed_ratio(run: HintedRun, page_size: int) -> float:
    """Hit tokens from device or host on resumed turns, over the bound on them."""
    bound = infinite_hits(run.results, page_size)
    ids = {id(r) for r in run.resumed}
    best = sum(b for r, b in zip(run.results, bound) if id(r) in ids)
    got = sum(r.device_hit + r.host_hit for r in run.resumed)
    return got / best if best else 0.0


def infinite_hits(results: list[Result], page_size: int) -> list[int]:
    """Per request, in order, the prompt tokens a cache that never evicts would hit."""
    tree = RadixTree(page_size=page_size)
    out, slot = [], page_size
    for r in results:
        key = np.asarray(r.prompt[:-1], dtype=np.int64)
        out.append(tree.match_prefix(RadixKey(key)).device_slots.size)
        fed = np.asarray(r.prompt + r.output[:-1], dtype=np.int64)
        fed = fed[: len(fed) - len(fed) % page_size]
        tree.insert(RadixKey(fed), torch.arange(slot, slot + len(fed)))
        slot += len(fed)
    return out
