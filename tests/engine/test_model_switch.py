"""The reference model is chosen by `model:` in the config or `tierctl replay --model`;
`tierctl serve` refuses a hybrid model in one line (replay runs it:
test_hybrid_replay.py)."""

from __future__ import annotations

import threading

import pytest

from kvtier.cli.main import main
from kvtier.cli.replay import model_of
from kvtier.config import load_config
from kvtier.engine.hybrid import HybridModel
from kvtier.engine.model import TinyTransformer, build_model

REFUSAL = "model 'hybrid' needs a cache that holds full-attention KV, sliding-window KV"


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvtier"


def config_file(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text("store:\n  backend: memory\n" + text)
    return str(path)


def test_the_config_and_the_flag_choose_the_model(tmp_path):
    assert load_config(None, env={}).model.kind == "tiny"
    short = load_config(config_file(tmp_path, "model: hybrid\n"), env={})
    assert (short.model.kind, short.model.window) == ("hybrid", 16)
    long = load_config(
        config_file(tmp_path, "model:\n  kind: hybrid\n  window: 9\n"), env={}
    )
    model = model_of(long, seed=3)
    assert isinstance(model, HybridModel) and model.config.window == 9
    assert model.config.seed == 3
    assert isinstance(model_of(long, 0, "tiny"), TinyTransformer)  # the flag wins
    env = load_config(None, env={"KVTIER_MODEL_KIND": "hybrid"})
    assert env.model.kind == "hybrid"
    with pytest.raises(
        ValueError, match="model='mamba': allowed values are tiny, hybrid"
    ):
        build_model("mamba")


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: mamba\n", "model.kind='mamba': allowed values are tiny, hybrid"),
        ("model:\n  window: 0\n", "window=0: must be an integer > 0"),
        ("model:\n  windw: 4\n", "model.windw: unknown key; allowed: kind, window"),
        ("model: 5\n", "model: expected a model name (tiny, hybrid) or a mapping"),
    ],
)
def test_a_bad_model_setting_is_one_line_naming_it(tmp_path, capsys, text, message):
    assert (
        main(["replay", "--config", config_file(tmp_path, text), "--requests", "1"])
        == 2
    )
    assert message in capsys.readouterr().err


def test_serve_refuses_a_hybrid_model_and_closes_its_cache(tmp_path):
    from kvtier.cli.serve import Server

    threads = set(threading.enumerate())
    with pytest.raises(ValueError, match=REFUSAL):
        Server(config_file(tmp_path, "model: hybrid\n"))
    assert not [t for t in set(threading.enumerate()) - threads if t.is_alive()]
