"""Calls a buggy engine makes, for the fault simulator: each must raise ValueError and
change nothing (docs/fault-sim.md). The request it picks keeps going afterwards as if the
call had never been made, which is what proves "nothing changed" beyond the counts."""

from __future__ import annotations

import numpy as np
import torch


class Violation(Exception):
    """A rule the fault simulator checks was broken."""


def fingerprint(cache) -> tuple:
    """What a refused call must leave as it was: free and held slots on each tier, what the
    tree holds and locks, what requests hold, the prefetches and their flags."""
    ctl, tree = cache.controller, cache.tree
    prefetches = tuple(
        sorted(
            (rid, p.want_stop, p.link.value)
            for rid, p in cache.prefetcher.prefetches.items()
        )
    )
    return (
        cache.slots.device_free(),
        ctl.host_available() if cache.mirror is not None else 0,
        tree.total_size(0),
        tree.total_size(1),
        tree.protected_size(0),
        tree.protected_size(1),
        cache.requests.pages,
        tuple(sorted(cache.requests.ids())),
        prefetches,
    )


def misuse(sim) -> str | None:
    """One bad call on a running request of `sim` (a FaultSim); what was called, or None
    when no running request has what the call needs. Raises Violation if
    the call is accepted or changes anything."""
    if not sim.running:
        return None
    req = sim.running[sim.rng.choice(sorted(sim.running))]
    cache, ps = sim.cache, sim.setup.page_size
    held = cache.requests.get(req.rid)
    row, tokens = req.row, req.tokens[: req.row.numel()]
    calls = [
        ("acquire again", lambda: cache.acquire(tokens, req.rid)),
        ("extra_key 7", lambda: cache.acquire(tokens, req.rid + "-x", extra_key=7)),
        (
            "kv of the wrong length",
            lambda: (
                cache.cache_finished(
                    req.rid, tokens, torch.cat([row, row[:1].repeat(ps)])
                )
                if row.numel()
                else cache.cache_finished(req.rid, tokens, torch.tensor([1]))
            ),
        ),  # past the last page's tail
        ("wait_layer(-1)", lambda: cache.begin_forward([req.rid]).wait_layer(-1)),
    ]
    if held.handed:
        other = tokens.copy()
        other[held.handed - 1] = (int(other[held.handed - 1]) + 1) % sim.vocab
        calls += [
            ("other tokens", lambda: cache.cache_finished(req.rid, other, row)),
            ("a short row", lambda: cache.abort(req.rid, row[: held.handed - 1])),
        ]
    free = np.flatnonzero(~cache.slots.device._free.held[1:]) + 1  # pages nobody holds
    if row.numel() > held.handed and free.size:
        stale = row.clone()
        stale[-1] = int(free[0]) * ps
        calls += [
            ("a free slot", lambda: cache.cache_finished(req.rid, tokens, stale)),
            ("a free slot, abort", lambda: cache.abort(req.rid, stale)),
        ]
    what, call = sim.rng.choice(calls)
    before = fingerprint(cache)
    try:
        call()
    except ValueError:
        pass
    else:
        raise Violation(f"misuse accepted: {what} on {req.rid}")
    if fingerprint(cache) != before:
        raise Violation(
            f"misuse changed state: {what} on {req.rid}: {before} -> {fingerprint(cache)}"
        )
    return f"{what} on {req.rid}"
