"""The fault simulator's linker mode (kvtier/testing/linker_sim.py): SGLang's calls into
kvtier's linker with copies and store calls failing, timing out and finishing late."""

import io

import pytest

from kvtier.testing import linker_sim


def test_drawn_episodes_have_no_violations():
    out = io.StringIO()
    assert linker_sim.run(3000, seed=20261201, episode=300, out=out) == 0, (
        out.getvalue()
    )


FOUND_AS = {
    "unverified-store-read": "finished True but page",
    "early-offload-completion": "finished True but page",
    "lookup-ignores-host-room": "pages its load cannot land: no host room",
    "lookup-counts-pinned-room": "pages its load cannot land: no host room",
}


@pytest.mark.parametrize("plant", sorted(linker_sim.PLANTED))
def test_each_planted_bug_is_found(plant):
    """A load that does not check its store reads verified, and an offload reported
    complete before its copy ran: both hand a request bytes that are not its KV. A lookup
    that promises store pages without the host room to read them into: the load queued
    right after it fails (SGLang would abort the request); so does one that counts the
    host pages its load will pin as room for the store pages after them."""
    out = io.StringIO()
    assert linker_sim.run(4000, seed=1, episode=400, plant=plant, out=out) > 0
    assert FOUND_AS[plant] in out.getvalue()


def test_ranks_with_the_linker_simulator_are_refused_not_ignored(capsys):
    """It ran one rank whatever --ranks said, so `--linker --ranks 2` passed as if two
    ranks had agreed."""
    from kvtier.testing.sim_cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--linker", "--ranks", "2", "--steps", "1"])
    assert exc.value.code == 2
    assert "--ranks 2 with --linker" in capsys.readouterr().err
