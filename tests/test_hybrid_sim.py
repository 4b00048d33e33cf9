"""The fault simulator over the hybrid cache (kvtier/testing/hybrid_sim.py): no violation
on the real code, and each planted bug found."""

from __future__ import annotations

import io

import pytest

from kvtier.testing.hybrid_sim import PLANTED, run_hybrid


def test_hybrid_fault_sim_finds_no_violation():
    out = io.StringIO()
    assert run_hybrid(400, seed=0, episode=200, out=out) == 0, out.getvalue()


# a window that spans several nodes and is handed back from them is rarer than a split
# (swa-order: ~1 violation in 1,200 steps, episodes of 400)
STEPS = {"mamba-split": (400, 200), "swa-order": (1200, 400)}


@pytest.mark.parametrize("plant", PLANTED)
def test_hybrid_fault_sim_finds_the_planted_bug(plant):
    out = io.StringIO()
    steps, episode = STEPS[plant]
    assert run_hybrid(steps, seed=0, episode=episode, out=out, plant=plant) > 0
    assert "VIOLATION" in out.getvalue() and f"--plant {plant}" in out.getvalue()


def test_the_command_line_refuses_a_plant_of_the_other_simulator(capsys):
    from kvtier.testing.sim_cli import main

    with pytest.raises(SystemExit):
        main(["--plant", "mamba-split", "--steps", "1"])
    assert "goes with --hybrid" in capsys.readouterr().err


def test_a_reported_violation_replays_from_the_command_line_it_prints(capsys):
    """The report of a violation names the command line that replays its episode; run,
    that command line reports the same violation at the same step."""
    from kvtier.testing.sim_cli import main

    out = io.StringIO()
    assert run_hybrid(400, seed=0, episode=200, out=out, plant="mamba-split") > 0
    lines = out.getvalue().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("VIOLATION"))
    command = lines[first + 2].split("python benchmarks/fault_sim.py ")[1].split()
    assert "--hybrid" in command and "--plant" in command, lines[first + 2]
    assert main(command) == 1
    replayed = capsys.readouterr().out.splitlines()
    assert replayed[:3] == lines[first : first + 3]
    steps = command[command.index("--steps") + 1]
    assert replayed[-1] == f"fault sim (hybrid): {steps} steps, 1 violations"
