"""docs/embedding.md's note on a script saved beside a clone named `kvtier` says what
Python does: there `import kvtier` may import the clone's directory (an empty namespace
package, "module 'kvtier' has no attribute 'DeviceKVPool'"), `kvtier.__file__` tells
which, and `python -P` or another name for the clone fix it. Run against the kvtier this
interpreter has installed (an editable install, as the README's, shows the failure)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "import kvtier\nprint(kvtier.__file__)\nprint(kvtier.DeviceKVPool.__name__)\n"
FROM = "from kvtier import TieredCache\n"


def _clone(parent: Path, name: str) -> None:
    """What a clone looks like from its parent directory: no __init__.py at its root."""
    (parent / name / "kvtier").mkdir(parents=True)
    (parent / name / "pyproject.toml").write_text("[project]\nname = 'kvtier'\n")


def _run(folder: Path, *flags: str, script: str = "s.py"):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, *flags, script],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_embedding_doc_says_what_a_script_beside_a_clone_imports(tmp_path):
    if sys.version_info < (3, 11):  # pyproject allows 3.10, which has no -P
        pytest.skip("python -P, the doc's remedy, is Python 3.11+ (the doc says so)")
    doc = (ROOT / "docs" / "embedding.md").read_text()
    assert "## Where the script lives: not beside a clone named `kvtier`" in doc
    beside = tmp_path / "beside"
    _clone(beside, "kvtier")
    (beside / "s.py").write_text(SCRIPT)
    (beside / "f.py").write_text(FROM)
    fixed = _run(beside, "-P")
    if fixed.returncode != 0 and "No module named 'kvtier'" in fixed.stderr:
        pytest.skip("kvtier is not installed in this interpreter (PYTHONPATH only)")
    assert fixed.returncode == 0, fixed.stderr  # `python -P script.py`
    assert fixed.stdout.split() == [fixed.stdout.split()[0], "DeviceKVPool"]
    assert fixed.stdout.split()[0].endswith(os.path.join("kvtier", "__init__.py"))
    shadowed = _run(beside)
    if shadowed.returncode == 0:  # a regular install wins over the clone's directory
        assert shadowed.stdout.split()[0] != "None"
    else:  # an editable install: the clone's directory wins, as the doc says
        assert shadowed.stdout.split() == ["None"]
        error = shadowed.stderr.strip().splitlines()[-1]
        assert (
            error == "AttributeError: module 'kvtier' has no attribute 'DeviceKVPool'"
        )
        assert error in doc
        error = _run(beside, script="f.py").stderr.strip().splitlines()[-1]
        assert error.startswith("ImportError: cannot import name 'TieredCache'")
        assert error in doc
    renamed = tmp_path / "renamed"
    _clone(renamed, "kvtier-src")
    (renamed / "s.py").write_text(SCRIPT)
    works = _run(renamed)
    assert works.returncode == 0 and works.stdout.split()[1] == "DeviceKVPool"
