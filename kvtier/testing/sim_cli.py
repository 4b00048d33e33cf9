"""`python benchmarks/fault_sim.py`: the fault simulator's command line (fault_sim.py, and
tp_sim.py for `--ranks` above 1)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from kvtier.testing import (
    episodes,
    fault_sim,
    hybrid_sim,
    linker_hybrid_sim,
    linker_sim,
    tp_sim,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=fault_sim.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--episode",
        type=int,
        default=400,
        help="steps between close() and a fresh cache",
    )
    p.add_argument(
        "--episode-seed",
        type=int,
        default=None,
        help="replay one episode (from a violation report)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="tensor-parallel ranks, on threads (tp_sim.py)",
    )
    p.add_argument(
        "--linker",
        action="store_true",
        help="SGLang's calls into kvtier's linker (linker_sim.py)",
    )
    p.add_argument(
        "--hybrid",
        action="store_true",
        help="a hybrid model: kvtier's own cache with FULL, SWA and Mamba components "
        "(hybrid_sim.py); with --linker, the linker's (FULL, SWA) and (FULL, MAMBA) pools "
        "(linker_hybrid_sim.py)",
    )
    p.add_argument(
        "--plant",
        choices=sorted(
            {
                *linker_sim.PLANTED,
                *linker_hybrid_sim.HYBRID_PLANTED,
                *hybrid_sim.PLANTED,
            }
        ),
        help="a known bug, to be found (--linker: "
        f"{', '.join(sorted(linker_sim.PLANTED))}; --linker --hybrid: "
        f"{', '.join(sorted(linker_hybrid_sim.HYBRID_PLANTED))}; --hybrid: "
        f"{', '.join(hybrid_sim.PLANTED)})",
    )
    p.add_argument(
        "--actions",
        metavar="FILE",
        help="write every episode's actions to FILE, one a line (to compare two versions)",
    )
    args = p.parse_args(argv)
    if args.plant in linker_hybrid_sim.HYBRID_PLANTED:
        args.linker = True  # a plant of the linker's hybrid pools
    linker_mode = args.linker or (args.plant in linker_sim.PLANTED)
    planted = (
        (linker_hybrid_sim.HYBRID_PLANTED if args.hybrid else linker_sim.PLANTED)
        if linker_mode
        else hybrid_sim.PLANTED
    )
    if args.plant in hybrid_sim.PLANTED and not (linker_mode or args.hybrid):
        p.error(
            f"--plant {args.plant}: a bug of kvtier's hybrid cache; it goes with --hybrid"
        )
    if args.plant and args.plant not in planted:
        mode = (
            ("--linker --hybrid" if args.hybrid else "--linker")
            if linker_mode
            else "--hybrid"
        )
        p.error(
            f"--plant {args.plant}: with {mode} the planted bugs are "
            f"{', '.join(sorted(planted))}"
        )
    if linker_mode and args.ranks != 1:
        p.error(
            f"--ranks {args.ranks} with --linker: the linker simulator runs one rank "
            "(its ranks' agreement is tested on SGLang's classes, "
            "tests/integrations/test_sglang_linker.py)"
        )
    if args.hybrid and args.ranks != 1:
        p.error("--hybrid runs kvtier's own cache on one rank: not with --ranks")
    args.linker = linker_mode
    logging.basicConfig(
        level=logging.CRITICAL
    )  # the simulator causes failures on purpose
    torch.set_num_threads(1)
    if args.actions is None:
        return _main(args, None)
    with open(args.actions, "w") as actions:
        return _main(args, actions)


def _main(args, actions) -> int:
    """The run the arguments name: every episode of `--steps` from `--seed`, or the one
    episode `--episode-seed` of `--steps` steps; 1 if it found a violation."""
    if args.linker:
        return _linker(args, actions)
    if args.episode_seed is None:
        run = episodes.schedule(args.steps, args.seed, args.episode)
    else:
        run = [(args.episode_seed, args.steps)]
    if args.hybrid:
        player = hybrid_sim.hybrid_player(args.plant, actions)
    elif args.ranks > 1:
        player = tp_sim.tp_player(args.ranks, actions)
    else:
        allow_kernel = os.environ.get("TRITON_INTERPRET") == "1"
        player = fault_sim.player(allow_kernel, actions=actions)
    return 1 if episodes.run_episodes(run, player) else 0


def _linker(args, actions) -> int:
    sim = linker_hybrid_sim if args.hybrid else linker_sim
    if args.episode_seed is None:
        return (
            1
            if sim.run(args.steps, args.seed, args.episode, args.plant, actions=actions)
            else 0
        )
    failure = sim.run_episode(args.episode_seed, args.steps, args.plant, actions)
    if failure is not None:
        step, exc, setup, log = failure
        sim.report(sys.stdout, exc, args.episode_seed, setup, step, log, args.plant)
    print(
        f"linker fault sim: {args.steps} steps, {int(failure is not None)} violations"
    )
    return int(failure is not None)


if __name__ == "__main__":
    sys.exit(main())
