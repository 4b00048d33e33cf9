"""The fault simulator in the suite: seeded episodes over page sizes 1/4/16, both mirror
layouts, every write and prefetch policy, with copies and store calls that fail, time out
and complete late, or answer with damaged pages. Every byte a forward reads is checked
(kvtier/testing/fault_sim.py). Replaces the old random-workload stress test (SGLang #9927:
every prefetch ends and returns its slots; LMCache #987: every lock is released)."""

import io

import pytest

from kvtier.testing.fault_sim import run


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_fault_sim_finds_no_violation(seed):
    out = io.StringIO()
    violations = run(1500, seed, episode=300, allow_kernel=seed == 4, out=out)
    assert violations == 0, out.getvalue()
    assert out.getvalue().splitlines()[-1] == "fault sim: 1500 steps, 0 violations"
