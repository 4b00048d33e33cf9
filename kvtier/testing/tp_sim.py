"""The fault simulator on several tensor-parallel ranks in one process (docs/design.md §8).

Each rank is a `FaultSim` with its own cache, streams and store. The engine's choices come
from one seed on every rank, as a server's replicated scheduler makes them; how each copy
and store call ends is drawn per rank, so a load fails on one rank and lands on another, a
page is stored on one rank only, a write is still running on one rank when another's has
finished. The ranks run on threads; their `Agreement` is a rendezvous of those threads whose
all-reduce takes the MIN, as gloo's does, and which refuses what real ranks would hang or
mix up on: vectors of different lengths, or collectives called from different places.

Checked after every step, besides each rank's own checks (every byte a forward reads, the
tree, the accounting): the ranks' replicated state is the same. That is the engine's
random state (so each rank's engine made the same choices), its requests and their rows,
the tree (keys, locks, device and host slots) and the free slots on each tier. A rank that
enters a collective no other rank enters waits `timeout_s`, then the episode fails as a
divergence naming where each rank waited.

    python benchmarks/fault_sim.py --ranks 2 --steps 4000 --seed 7
"""

from __future__ import annotations

import random
import sys
import threading

import xxhash

from kvtier.controller.tp import Agreement
from kvtier.testing.episodes import (
    Failure,
    Player,
    run_episodes,
    schedule,
    write_actions,
)
from kvtier.testing.fault_sim import FaultSim, Setup
from kvtier.testing.misuse import Violation


class Rendezvous:
    """The ranks' threads meeting: each gives a value, each gets every rank's."""

    def __init__(self, ranks: int, timeout_s: float) -> None:
        self.ranks = ranks
        self.barrier = threading.Barrier(ranks, timeout=timeout_s)
        self.values: list = [None] * ranks
        self.where = ["running"] * ranks

    def gather(self, rank: int, where: str, value) -> list:
        self.where[rank], self.values[rank] = where, value
        self._wait(rank)
        out = list(self.values)
        self._wait(rank)
        self.where[rank] = "running"
        return out

    def _wait(self, rank: int) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise Violation(
                f"ranks diverged: rank {rank} in {self.where[rank]}; the others: "
                f"{', '.join(f'rank {r} in {w}' for r, w in enumerate(self.where) if r != rank)}"
            ) from None

    def abort(self) -> None:
        self.barrier.abort()


class ThreadAgreement(Agreement):
    """`Agreement` over a `Rendezvous` (the consensus check always on)."""

    def __init__(self, rendezvous: Rendezvous, rank: int) -> None:
        super().__init__(None, False)
        self.rendezvous, self._rank = rendezvous, rank
        self.consensus_check = True

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.rendezvous.ranks

    def _all(self, what: str, vec: list[int]) -> list[list[int]]:
        site = f"{what} from {sys._getframe(2).f_code.co_name}"
        got = self.rendezvous.gather(self._rank, site, (site, vec))
        self.collectives += 1
        if any(g[0] != site or len(g[1]) != len(vec) for g in got):
            calls = "; ".join(
                f"rank {r}: {s} of {len(v)}" for r, (s, v) in enumerate(got)
            )
            raise Violation(f"ranks diverged: {calls}")
        return [v for _, v in got]

    def agree(self, mins: list[int], maxs: list[int]) -> tuple[list[int], list[int]]:
        vecs = self._all("agree", list(mins) + [-v for v in maxs])
        out = [min(col) for col in zip(*vecs)] if vecs[0] else []
        return out[: len(mins)], [-v for v in out[len(mins) :]]

    def check(self, decisions: list[int]) -> None:
        vecs = self._all("check", list(decisions))
        if any(v != vecs[0] for v in vecs):
            raise Violation(
                f"ranks diverged: poll decided {vecs[0]} on rank 0, {vecs[1:]} on the others"
            )


def on_ranks(fn, ranks: int) -> list:
    """fn(rank) on one thread per rank, as every rank's scheduler runs it; the results (the
    first exception any rank raised is raised here, once every thread has returned)."""
    out, errors = [None] * ranks, []

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(r,), name=f"tp-sim-rank{r}")
        for r in range(ranks)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def replicated(sim: FaultSim) -> dict[str, object]:
    """What every rank must hold alike after a step, part by part."""
    rows = {
        rid: (req.pos, req.row.numpy().tobytes())
        for rid, req in sorted(sim.running.items())
    }
    return {
        "engine": xxhash.xxh3_64_hexdigest(repr(sim.rng.getstate()).encode()),
        "waiting": sorted(sim.waiting),
        "running": rows,
        **replicated_cache(sim.cache),
    }


def replicated_cache(cache) -> dict[str, object]:
    """What every rank's cache must hold alike between steps: the tree (keys, locks, access
    order, slots on each tier), free slots, requests and prefetches, and whether it is busy."""
    ctl = cache.controller
    nodes, stack = [], [cache.tree.root]
    while stack:
        node = stack.pop()
        nodes.append(
            (
                node.key.tokens.tobytes(),
                tuple(node.locks),
                node.last_access,
                *(None if v is None else v.tobytes() for v in node.values),
            )
        )
        stack.extend(
            sorted(node.children.values(), key=lambda n: n.key.tokens.tobytes())
        )
    prefetches = sorted(
        (rid, p.link.value, p.result) for rid, p in cache.prefetcher.prefetches.items()
    )
    return {
        "tree": xxhash.xxh3_64_hexdigest(repr(nodes).encode()),
        "tree nodes": len(nodes),
        "device free": cache.slots.device_free(),
        "host free": ctl.host_available() if cache.mirror is not None else 0,
        "busy": ctl.busy(),
        "requests": sorted(cache.requests.ids()),
        "request pages": cache.requests.pages,
        "prefetches": prefetches,
    }


def _short(values: list) -> str:
    text = repr(values)
    return (
        text
        if len(text) <= 300
        else xxhash.xxh3_64_hexdigest(text.encode()) + " (long; they differ)"
    )


def run_episode(
    ep_seed: int,
    setup: Setup,
    steps: int,
    ranks: int,
    timeout_s: float = 60.0,
    actions=None,
) -> Failure | None:
    """One episode on `ranks` ranks: None, or the first failure (`who` names its rank)."""
    rendezvous = Rendezvous(ranks, timeout_s)
    sims = [
        FaultSim(
            ep_seed,
            setup,
            faults=random.Random(ep_seed * 1000 + r + 1),
            agreement=ThreadAgreement(rendezvous, r),
        )
        for r in range(ranks)
    ]
    failures: list[Failure] = []

    def rank_main(r: int) -> None:
        sim, step = sims[r], 0
        try:
            for step in range(steps):
                sim.step()
                states = rendezvous.gather(
                    r, f"the check after step {step}", replicated(sim)
                )
                differ = [
                    k for k in states[0] if any(s[k] != states[0][k] for s in states)
                ]
                if differ:
                    raise Violation(
                        f"ranks diverged after step {step}: "
                        + "; ".join(
                            f"{k}: {_short([s[k] for s in states])}" for k in differ
                        )
                    )
            sim.close()
        except Exception as exc:
            failures.append(Failure(step, exc, sim.log, f"rank {r} of {ranks}"))
            rendezvous.abort()

    on_ranks(rank_main, ranks)
    for r, sim in enumerate(sims):
        write_actions(actions, f"episode {ep_seed} rank {r}", sim.log)
    if not failures:
        return None
    for sim in sims:  # stop every rank's threads (the episode is over either way)
        sim.stop()
    first = [
        f for f in failures if "ranks diverged: rank" not in str(f.exc)
    ] or failures  # not a broken barrier
    return first[0]


def tp_player(ranks: int, actions=None) -> Player:
    """Episodes on `ranks` ranks: each draws its setup from its seed."""

    def one(k: int, ep_seed: int, n: int) -> tuple[Setup, Failure | None]:
        setup = Setup.draw(random.Random(ep_seed), allow_kernel=False)
        return setup, run_episode(ep_seed, setup, n, ranks, actions=actions)

    return Player(one, where=f" on {ranks} ranks", flags=f" --ranks {ranks}")


def run(
    steps: int,
    seed: int,
    ranks: int = 2,
    episode: int = 400,
    out=None,
    actions=None,
) -> int:
    """`steps` steps in episodes of `episode`, on `ranks` ranks; the number of violations."""
    tp = tp_player(ranks, actions)
    return run_episodes(schedule(steps, seed, episode), tp, out)
