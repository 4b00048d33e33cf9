"""The install commands the docs give work as written: kvtier is not on PyPI, so no doc or
hint says a bare `pip install kvtier`; and the engine docs' command, run in a fresh venv
holding SGLang's or vLLM's torch pin, installs kvtier and leaves that torch in place.

The venv test is offline: pip resolves with `--no-index` over a folder holding a kvtier
wheel with this tree's metadata (name, version, Python and dependencies from
pyproject.toml), a stand-in `torch` of the engine's version (and 2.13.0, the README's pin,
so a downgrade would be possible), and a stand-in of each of kvtier's dependencies at a
version its requirement allows. Only the resolver's choice is under test; a stand-in is a
dist-info and an empty module. Nothing is built from the tree: a build would need
setuptools in this interpreter (neither the test extra nor .ci/run installs it) and write
build/ and kvtier.egg-info into the source tree."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.servers import IN_CI

ROOT = Path(__file__).resolve().parents[1]
BARE = re.compile(r"(?<![\w/.@-])kvtier(\[[\w,-]*\])?(?![\w/.[-])(?!\s*@)")


def _install_commands(text: str):
    """Every `pip install ...` in `text`, to the end of its command (a line, a code span,
    a comment, a parenthesis or the next command)."""
    for m in re.finditer(r"pip install([^\n`(;#,&|]*)", text):
        yield m.group(0)


def test_no_doc_or_hint_says_pip_install_kvtier_from_an_index():
    """`pip install kvtier` fails ("No matching distribution found"): the engine docs
    started with it and `tierctl replay --plot`'s hint said `pip install 'kvtier[plot]'`."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "kvtier").rglob("*.py")) + sorted(
        (ROOT / "benchmarks").rglob("*.py")
    )
    found = [
        f"{path.relative_to(ROOT)}: {cmd.strip()}"
        for path in files
        for cmd in _install_commands(path.read_text())
        if BARE.search(cmd.replace("'", " ").replace('"', " "))
    ]
    assert found == []
    # the checker itself: what it must catch and what it must let through
    assert BARE.search(" kvtier[plot]") and BARE.search(" kvtier==0.1.0")
    assert not BARE.search(" /path/to/kvtier") and not BARE.search(" -e .[plot]")
    assert not BARE.search(" kvtier[plot] @ file:///src/kvtier")


def _wheel(
    folder: Path, name: str, version: str, metadata: tuple[str, ...] = ()
) -> None:
    """A stand-in wheel: `name` at `version`, an empty module, and `metadata` lines
    (`Requires-Dist: ...`; none: no dependencies)."""
    module = re.sub(r"[-.]", "_", name).lower()
    dist = f"{re.sub(r'[-.]', '_', name)}-{version}"
    head = "".join(f"{line}\n" for line in metadata)
    files = {
        f"{module}/__init__.py": f"__version__ = {version!r}\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{head}",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, body in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(body.encode()).digest())
        record.append(f"{path},sha256={digest.rstrip(b'=').decode()},{len(body)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        for path, body in files.items():
            z.writestr(path, body)


def _project() -> dict:
    """pyproject.toml's [project] table (tomllib: Python 3.11+)."""
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _stand_ins(folder: Path) -> None:
    """kvtier with this tree's metadata, and its dependencies, each at a version its
    requirement allows (not torch)."""
    from packaging.requirements import Requirement

    project = _project()
    deps = project["dependencies"]
    _wheel(
        folder,
        project["name"],
        project["version"],
        (
            f"Requires-Python: {project['requires-python']}",
            *(f"Requires-Dist: {d}" for d in deps),
        ),
    )
    for line in deps:
        req = Requirement(line)
        if req.name == "torch":
            continue
        version = next(
            v
            for v in [*(s.version for s in req.specifier), "1.0"]
            if req.specifier.contains(v)
        )
        _wheel(folder, req.name, version)


def _install_block(doc: str) -> str:
    """The commands of the doc's Install section's first bash block."""
    text = (ROOT / "docs" / doc).read_text()
    section = text[text.index("## Install into") :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    for version in ("2.13.0", "2.14.0", "2.14.1", "2.15.0"):
        _wheel(folder, "torch", version)
    _stand_ins(folder)
    return folder


def _venv_with_torch(tmp_path, wheels, torch: str) -> tuple[Path, dict]:
    """A fresh venv holding `torch` (a stand-in of that version), and the environment
    that keeps pip on the wheel folder and off this machine's pip configuration."""
    if importlib.util.find_spec("ensurepip") is None and not IN_CI:
        pytest.skip("this Python has no ensurepip: python3 -m venv cannot seed pip")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PIP_")},
        "PIP_CONFIG_FILE": os.devnull,  # no machine-wide index, links or constraints
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PYTHONPATH": "",
    }
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"torch=={torch}"], check=True, env=env, timeout=300)
    return python, env


def _run_install_block(tmp_path, wheels, doc: str, python: Path, env: dict):
    """The doc's Install commands as written, pointed at this venv and the built wheel."""
    commands = _install_block(doc)
    assert "/path/to/kvtier" in commands and "torch.__version__" in commands
    script = (
        commands.replace("/tmp/engine-torch.txt", str(tmp_path / "engine-torch.txt"))
        .replace("/path/to/kvtier", str(next(wheels.glob("kvtier-*.whl"))))
        .replace("pip install", f"{python} -m pip install")
        .replace("python -c", f"{python} -c")
    )
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )


def _installed(python: Path, env: dict) -> list[str]:
    code = (
        "from importlib.metadata import version, PackageNotFoundError\n"
        "for name in ('torch', 'kvtier'):\n"
        "    try:\n        print(version(name))\n"
        "    except PackageNotFoundError:\n        print('-')\n"
    )
    out = subprocess.run(  # not from the source tree: its kvtier.egg-info would answer
        [str(python), "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=python.parent,
    )
    return out.stdout.split()


@pytest.mark.parametrize(
    ("doc", "engine_torch"), [("sglang.md", "2.14.1"), ("vllm.md", "2.14.0")]
)
def test_the_engine_docs_install_keeps_the_engines_torch(
    tmp_path, wheels, doc, engine_torch
):
    """SGLang 0.5.23 pins torch 2.14.1 and vLLM 0.33.0 2.14.0; the README's set-up line,
    run in such an environment, would put 2.13.0 in their place. The docs' command, run
    as written in a fresh venv that holds the engine's torch, installs kvtier and leaves
    that torch alone."""
    python, env = _venv_with_torch(tmp_path, wheels, engine_torch)
    out = _run_install_block(tmp_path, wheels, doc, python, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _installed(python, env) == [engine_torch, _project()["version"]]


def test_a_torch_outside_the_supported_range_stops_the_install_and_stays(
    tmp_path, wheels
):
    """The docs say so: with a torch kvtier does not support (2.15.0 here), the command
    stops with pip's conflict instead of replacing the engine's torch."""
    python, env = _venv_with_torch(tmp_path, wheels, "2.15.0")
    out = _run_install_block(tmp_path, wheels, "sglang.md", python, env)
    assert out.returncode != 0
    assert "conflict" in (out.stdout + out.stderr).lower()
    assert _installed(python, env) == ["2.15.0", "-"]


def test_pyproject_says_which_torch_it_supports():
    """The package's torch range takes the engines' pins and CI's."""
    from packaging.requirements import Requirement

    deps = _project()["dependencies"]
    torch = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    assert all(torch.specifier.contains(v) for v in ("2.13.0", "2.14.0", "2.14.1"))
    assert not torch.specifier.contains("2.15.0")  # untested: pip says so, not a crash
