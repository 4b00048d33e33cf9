"""The agent workload's tool-call pauses, served with hints and without (kvtier/engine/hinted.py,
`tierctl replay --hints`): same outputs, every request verified against an uncached run,
and the pinned sessions resume from device or host."""

import re

import pytest

from kvtier.cache import TieredCache
from kvtier.cli.main import main
from kvtier.cli.replay import with_weights
from kvtier.config import load_config, shipped_default
from kvtier.engine.engine import Engine, verify
from kvtier.engine.hinted import replay, resumed_ratio
from kvtier.engine.model import ModelConfig, TinyTransformer
from kvtier.engine.workloads import Turn, generate, pauses


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvtier"


def test_pauses_are_sessions_idle_while_others_run():
    t = [Turn(s, 0, (1,), 1) for s in "aabcdab"]
    assert pauses(t) == {}  # 3 other turns between: no pause
    t = [Turn(s, 0, (1,), 1) for s in "abcdeab"]
    assert pauses(t) == {0: 5, 1: 6}
    turns = generate("agent", 26, 512)
    assert pauses(turns) == {2: 12, 3: 13, 14: 24, 15: 25}
    assert all(turns[i].session == turns[j].session for i, j in pauses(turns).items())


def test_served_with_hints_gives_the_outputs_of_a_run_without(cache_home):
    """The whole served sequence (acquire -> forward -> finish) under pins, prefetches and
    releases: the same greedy outputs and logits as an uncached run, and the resumed turns
    find their sessions on device or host, which the churn evicts without hints."""
    model = TinyTransformer(ModelConfig(seed=0))
    config = with_weights(load_config(None, base=shipped_default()), model)
    turns = generate("agent", 26, model.config.vocab)
    runs = {}
    for hints in (True, False):
        cache = TieredCache(config)
        run = replay(Engine(cache, model, max_batch=4), turns, hints, keep_logits=True)
        h = cache.stats()["hints"]
        cache.tree.sanity_check()
        cache.check_accounting()
        cache.close()
        cache.tree.sanity_check()
        runs[hints] = run
        assert all(r.error is None for r in run.results) and len(run.results) == 26
        for r in run.results:
            verify(model, r)
        assert len(run.resumed) == 4
        if hints:
            assert run.pins == 4 and h["pins"] == 4 and h["releases"] == 4
            assert h["leases"] == 0
    out = {
        hints: {(r.session, r.turn): r.output for r in run.results}
        for hints, run in runs.items()
    }
    assert out[True] == out[False]
    ps = config.pool.page_size
    with_hints, without = resumed_ratio(runs[True], ps), resumed_ratio(runs[False], ps)
    assert with_hints >= 0.95 and with_hints > without


def test_replay_hints_prints_the_comparison_last(cache_home, capsys):
    args = ["replay", "--workload", "agent", "--requests", "26", "--hints"]
    assert main([*args, "--verify", "0.25"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    m = re.fullmatch(
        r"hints: resumed turns (\d+\.\d\d)x bound with hints, (\d+\.\d\d)x without",
        out[-1],
    )
    assert m, out[-1]
    assert float(m[1]) >= 0.95 and float(m[1]) > float(m[2])
    assert any(line.startswith("verified") for line in out)


def test_replay_hints_refuses_a_plot_before_it_runs(cache_home, capsys, tmp_path):
    plot = str(tmp_path / "hits.png")
    assert main(["replay", "--workload", "agent", "--hints", "--plot", plot]) == 2
    assert "--plot draws one run's hits; --hints replays two" in capsys.readouterr().err
