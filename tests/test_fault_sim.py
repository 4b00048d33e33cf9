"""The fault simulator in the suite (kvtier/testing/fault_sim.py): episodes over page
sizes 1 and 16, both mirror layouts, every write and prefetch policy, both io paths, with
copies and store calls that fail, time out and complete late, or answer with damaged
pages. Every byte a forward reads is checked, and every slot is free after close.
Replaces the old random-workload stress test (SGLang #9927: every prefetch ends and returns
its slots; LMCache #987: every lock has one release path)."""

import io
import itertools
import re

import pytest

from kvtier.testing.fault_sim import Setup, run

WRITES = ["write_through", "write_through_selective", "write_back"]
PREFETCHES = ["best_effort", "wait_complete", "timeout"]


@pytest.mark.parametrize(
    "page_size,layout",
    [(1, "page_first"), (1, "layer_first"), (16, "page_first"), (16, "layer_first")],
)
def test_fault_sim_every_policy_finds_no_violation(page_size, layout):
    setups = [
        Setup(page_size, layout, "direct", w, p)
        for w, p in itertools.product(WRITES, PREFETCHES)
    ]
    out = io.StringIO()
    steps = 250 * len(setups)
    violations = run(
        steps, seed=page_size * 7 + len(layout), episode=250, out=out, setups=setups
    )
    assert violations == 0, out.getvalue()
    assert out.getvalue().splitlines()[-1] == f"fault sim: {steps} steps, 0 violations"


def test_fault_sim_kernel_io_path_finds_no_violation():
    """The Triton gather/scatter path, run by the interpreter (tests set TRITON_INTERPRET=1)."""
    setups = [
        Setup(4, "page_first", "kernel", "write_through", "wait_complete"),
        Setup(16, "layer_first", "kernel", "write_back", "best_effort"),
    ]
    out = io.StringIO()
    assert run(300, seed=5, episode=150, out=out, setups=setups) == 0, out.getvalue()


@pytest.mark.parametrize("seed", [1, 2])
def test_fault_sim_drawn_setups_find_no_violation(seed):
    out = io.StringIO()
    assert run(2000, seed, episode=400, out=out) == 0, out.getvalue()


def test_fault_sim_with_sealed_pages_finds_no_violation():
    """Pages sealed under a tenant key (docs/security.md): the damaged, swapped and
    truncated pages the store answers with are misses, the bytes every forward reads right."""
    setups = [
        Setup(4, "page_first", "direct", "write_through", "best_effort", sealing="mac"),
        Setup(16, "layer_first", "direct", "write_back", "timeout", sealing="aes-gcm"),
        Setup(
            1,
            "page_first",
            "direct",
            "write_through_selective",
            "wait_complete",
            sealing="aes-gcm",
        ),
    ]
    out = io.StringIO()
    assert run(750, seed=11, episode=250, out=out, setups=setups) == 0, out.getvalue()


def test_fault_sim_with_store_pages_of_several_pages_finds_no_violation():
    """Store pages of 2 and 4 device pages (store.page_tokens, docs/stores.md): reads
    that fail, stall and come back damaged, backups that store a page's first pages from
    its ancestors' host copies; every byte a forward reads right."""
    setups = [
        Setup(
            1, "page_first", "direct", "write_through", "wait_complete", store_pages=4
        ),
        Setup(4, "layer_first", "direct", "write_back", "best_effort", store_pages=2),
        Setup(
            1,
            "layer_first",
            "direct",
            "write_through_selective",
            "timeout",
            store_pages=4,
            sealing="mac",
        ),
        Setup(16, "page_first", "direct", "write_through", "timeout", store_pages=2),
    ]
    out = io.StringIO()
    assert run(1200, seed=13, episode=300, out=out, setups=setups) == 0, out.getvalue()


@pytest.mark.parametrize(
    "flags",
    [[], ["--ranks", "2"], ["--linker"]],
    ids=["own cache", "2 ranks", "linker"],
)
def test_the_action_log_names_every_episode_and_runs_to_its_close(tmp_path, flags):
    """`--actions FILE`: every episode's actions, one a line, named by episode (and rank),
    each through to its close, so the logs of one seed can be compared between two
    versions of the code. (That a run's log does not hang on the machine's load is the
    test below: two runs compared here would differ only on a loaded machine.)"""
    from kvtier.testing.sim_cli import main

    path = tmp_path / "actions.txt"
    args = ["--steps", "120", "--seed", "3", "--episode", "60"]
    assert main([*args, *flags, "--actions", str(path)]) == 0
    lines = path.read_text().splitlines()
    by_episode: dict[str, list[str]] = {}
    for line in lines:
        who, _, action = line.partition(": ")
        by_episode.setdefault(who, []).append(action)
    assert len(by_episode) == (4 if "--ranks" in flags else 2), by_episode.keys()
    assert all(
        re.fullmatch(r"(linker )?episode \d+( rank [01])?", who) for who in by_episode
    ), by_episode.keys()
    assert all("close" in actions for actions in by_episode.values())
    assert len(lines) > 20


def test_a_steps_posts_reach_the_storage_loop_together_when_the_simulator_settles():
    """The store's pending calls, which the seeded simulator picks from, come in the same
    order on every run only if the storage loop takes a step's posted work (ops started,
    grants) in one batch when the simulator settles: run free, the loop could wake between
    two posts of one step or not, as the machine's load had it, and the own-cache action
    log of a seed differed between runs."""
    import asyncio

    from kvtier.testing.fault_sim import FaultSim

    sim = FaultSim(5, Setup(1, "page_first", "direct", "write_through", "best_effort"))
    store_loop = sim.cache.controller.storage.store_loop
    ran = []
    store_loop.post(lambda: ran.append(1))
    store_loop.post(lambda: ran.append(2))

    async def spin():  # the loop's turns: a wake-up posted before them is taken in them
        for _ in range(40):
            await asyncio.sleep(0)

    store_loop.run(spin(), 30)
    assert ran == []  # held while the step runs
    sim.settle()
    assert ran == [1, 2]
    sim.close()
