"""The linker fault simulator's hybrid setups (kvtier/testing/linker_hybrid_sim.py): SGLang's
calls into kvtier's linker for a (FULL, SWA) or (FULL, MAMBA) model, every pool's copies
and store calls failing, timing out and finishing late, with a byte oracle per pool."""

import io

import pytest

from kvtier.testing import linker_hybrid_sim as hybrid_sim


def test_drawn_hybrid_episodes_have_no_violations():
    out = io.StringIO()
    assert hybrid_sim.run(3000, seed=20261206, episode=300, out=out) == 0, (
        out.getvalue()
    )


FOUND_AS = {
    "swa-window-shifted": "finished True but its swa page",
    "mamba-state-from-another-boundary": "whose mamba page",
    "side-window-of-the-longest-only": "whose mamba page",
}


@pytest.mark.parametrize("plant", sorted(hybrid_sim.HYBRID_PLANTED))
def test_each_planted_hybrid_bug_is_found(plant):
    """An SWA window restored one page early hands a request another window's bytes; a
    Mamba length answered where only an earlier boundary holds a state (restoring that
    state), or checked at the longest length only, answers a length whose state was
    never taken."""
    out = io.StringIO()
    assert hybrid_sim.run(4000, seed=1, episode=400, plant=plant, out=out) > 0
    assert FOUND_AS[plant] in out.getvalue()


def test_a_full_only_plant_is_refused_with_hybrid(capsys):
    from kvtier.testing.sim_cli import main

    with pytest.raises(SystemExit) as exc:
        main(
            ["--linker", "--hybrid", "--plant", "unverified-store-read", "--steps", "1"]
        )
    assert exc.value.code == 2
    assert "with --linker --hybrid the planted bugs are" in capsys.readouterr().err
