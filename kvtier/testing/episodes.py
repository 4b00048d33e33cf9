"""The own-cache fault simulators' episodes (fault_sim.py, hybrid_sim.py, tp_sim.py): one
played to its close or its first violation, a run of them from one seed, and the report
of a violation with the command line that replays it."""

from __future__ import annotations

import random
import sys
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

from kvtier.testing.misuse import Violation


class Failure(NamedTuple):
    """An episode's first violation: the step it came at, what was raised, the actions up
    to it, and on which rank (`who`, empty on one rank)."""

    step: int
    exc: Exception
    log: list[str]
    who: str = ""


def play(sim, steps: int, actions=None) -> Failure | None:
    """`steps` steps of `sim` (a `FaultSim`), then its close: the first violation, or
    None. After a violation the cache's threads are stopped. The episode's action log goes
    to `actions` (`write_actions`) either way."""
    i = 0
    try:
        for i in range(steps):  # noqa: B007 (i is reported on a failure)
            sim.step()
        sim.close()
    except Exception as exc:
        sim.stop()
        return Failure(i, exc, sim.log)
    finally:
        write_actions(actions, f"episode {sim.seed}", sim.log)
    return None


def schedule(steps: int, seed: int, episode: int) -> list[tuple[int, int]]:
    """(episode seed, steps) of each episode of a run of `steps` steps from `seed`."""
    master, out, done = random.Random(seed), [], 0
    while done < steps:
        n = min(episode, steps - done)
        out.append((master.randrange(1 << 30), n))
        done += n
    return out


class Player(NamedTuple):
    """What `run_episodes` needs of a simulator: `one(index, episode seed, steps)` plays
    an episode and returns (its setup, its Failure or None); `title` and `where` name the
    run in its summary line; `flags` go into a failure's command line that replays it."""

    one: Callable[[int, int, int], tuple[Any, Failure | None]]
    title: str = "fault sim"
    where: str = ""
    flags: str = ""


def run_episodes(episodes: list[tuple[int, int]], player: Player, out=None) -> int:
    """Each (episode seed, steps) of `episodes` played by `player`, each failure reported
    to `out` (None: the stdout of the call), then the summary line `<title>: <steps>
    steps<where>, <n> violations`. Returns n."""
    # the stdout of the call, not of the import
    out = sys.stdout if out is None else out
    violations = 0
    for k, (ep_seed, n) in enumerate(episodes):
        setup, failure = player.one(k, ep_seed, n)
        if failure is not None:
            violations += 1
            report(out, failure, ep_seed, setup, player.flags)
    steps = sum(n for _, n in episodes)
    print(
        f"{player.title}: {steps} steps{player.where}, {violations} violations",
        file=out,
    )
    return violations


def write_actions(actions, who: str, log: list[str]) -> None:
    """One line per action of an episode, `<who>: <action>`, to `actions` (None: nothing):
    the record two versions of the code are compared by, seed for seed."""
    if actions is not None:
        actions.writelines(f"{who}: {line}\n" for line in log)


def report(out, failure: Failure, ep_seed: int, setup: Any, flags: str = "") -> None:
    """`failure` of the episode `ep_seed` (of `setup`) to `out`: what was raised, the
    command line that replays it (`flags` added), and the last actions before it."""
    step, exc, log, who = failure
    print(
        f"VIOLATION at step {step} of episode seed {ep_seed} ({setup}){' on ' + who if who else ''}",
        file=out,
    )
    print(
        f"  {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
        file=out,
    )
    if not isinstance(exc, Violation):
        print(
            "  " + "".join(traceback.format_exception(exc)[-3:]).replace("\n", "\n  "),
            file=out,
        )
    print(
        f"  reproduce: python benchmarks/fault_sim.py --episode-seed {ep_seed} --steps {step + 1}{flags}",
        file=out,
    )
    print("  the last actions:", file=out)
    for line in log[-25:]:
        print(f"    {line}", file=out)
