"""The engine tests' dependencies are one documented install (requirements-engines.txt)
that `.ci/run` uses too, and `pip check` after it reports only the conflicts between the
two engines that the file documents (.ci/pip_check.py)."""

from __future__ import annotations

import importlib.util
import re
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.servers import IN_CI

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location(
        "pip_check", ROOT / ".ci" / "pip_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ours() -> dict[str, Requirement]:
    lines = (ROOT / "requirements-engines.txt").read_text().splitlines()
    reqs = [Requirement(x) for x in lines if x.strip() and not x.startswith("#")]
    return {_checker()._name(r.name): r for r in reqs}


def test_ci_installs_the_engine_tests_dependencies_from_the_documented_file():
    """The list lived only in .ci/run, and left a screen of pip conflicts."""
    run = (ROOT / ".ci" / "run").read_text()
    assert "-r requirements-engines.txt" in run
    assert "python3 .ci/pip_check.py" in run
    assert "xgrammar" not in run  # no second list beside the file
    # the engines go in after their imports: pip prints no conflict screen on the way
    assert run.index("-r requirements-engines.txt") < run.index("--no-deps sglang")
    readme = (ROOT / "README.md").read_text()
    assert "-r requirements-engines.txt" in readme


def _within(ours, theirs) -> bool:
    """Whether every version our specifier allows is one the engine's allows (for the
    operators both files use: ==, >=, <)."""
    pins = [Version(s.version) for s in ours if s.operator == "=="]
    lows = [Version(s.version) for s in ours if s.operator == ">="] + pins
    below = [Version(s.version) for s in ours if s.operator == "<"]
    for s in theirs:
        v = Version(s.version)
        if s.operator == "==" and pins != [v]:
            return False
        if s.operator == ">=" and not any(low >= v for low in lows):
            return False
        if s.operator == "<" and not (
            any(b <= v for b in below) or any(p < v for p in pins)
        ):
            return False
    return True


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_every_pin_satisfies_both_engines_except_the_documented_conflicts(engine):
    """sglang 0.5.23 wants xgrammar==0.2.7 while .ci/run installed 0.2.8, orjson>=3.11.6
    (vLLM) was left at whatever was there, ...: each version in the file satisfies the
    engine's own metadata, or the conflict is one ENGINE_CONFLICTS lists (and the file
    documents)."""
    try:
        theirs = [Requirement(r) for r in requires(engine) or []]
    except PackageNotFoundError:
        if IN_CI:
            pytest.fail(f"{engine} is not installed; .ci/run must install it")
        pytest.skip(f"{engine} is not installed (requirements-engines.txt: README)")
    checker, ours = _checker(), _ours()
    text = (ROOT / "requirements-engines.txt").read_text()
    wrong = []
    for req in theirs:
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = checker._name(req.name)
        if name not in ours or (engine, name) in checker.ENGINE_CONFLICTS:
            continue
        if not _within(ours[name].specifier, req.specifier):
            wrong.append(f"{engine} wants {req}, the file has {ours[name]}")
    assert wrong == []
    for _, name in checker.ENGINE_CONFLICTS:
        assert re.search(rf"^#\s+{re.escape(name)}\s", text, re.M), name


def test_pip_check_allows_only_the_documented_conflicts():
    checker = _checker()
    report = "\n".join(
        [
            "vllm 0.33.0 requires torchvision, which is not installed.",
            "sglang 0.5.23 requires cuda-python, which is not installed.",
            "sglang 0.5.23 has requirement xgrammar==0.2.7, but you have xgrammar 0.2.8.",
            "vllm 0.33.0 has requirement torch==2.14.0, but you have torch 2.13.0+cpu.",
            "vllm 0.33.0 has requirement compressed-tensors==0.17.0, but you have "
            "compressed-tensors 0.18.0.",
            "vllm 0.33.0 has requirement orjson>=3.11.6, but you have orjson 3.8.3.",
            "sglang 0.5.23 has requirement openai-harmony==0.0.4, but you have "
            "openai-harmony 0.0.8.",
            "moto 5.2.1 requires werkzeug, which is not installed.",
        ]
    )
    assert checker.unexpected(report) == [
        "vllm 0.33.0 has requirement orjson>=3.11.6, but you have orjson 3.8.3.",
        "sglang 0.5.23 has requirement openai-harmony==0.0.4, but you have "
        "openai-harmony 0.0.8.",
        "moto 5.2.1 requires werkzeug, which is not installed.",
    ]
    assert checker.unexpected("No broken requirements found.\n") == []
