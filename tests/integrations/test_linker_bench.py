"""benchmarks/linker.py: the linker against SGLang's HiCache under SGLang's UnifiedRadixCache
(its numbers are the benchmark's business; these check that it runs and what it prints)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_without_sglang_it_says_so_and_exits_0():
    out = run(
        "import sys; sys.modules['sglang'] = None\n"
        "from kvtier.bench.linker import main\n"
        "sys.exit(main(['--requests', '4', '--rounds', '1']))"
    )
    assert out.returncode == 0, out.stderr
    assert "SGLang cannot be loaded here" in out.stdout
    assert "nothing measured" in out.stdout


def test_a_short_run_prints_every_arm_and_the_ratio_lines():
    # the run is a child process: SGLang must not be imported here (its one loader,
    # kvtier.testing.sglang_loader, refuses a process that imported it without it)
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    out = run(
        "import sys\nfrom kvtier.bench.linker import main\n"
        "sys.exit(main(['--requests', '12', '--rounds', '1', '--page-size', '16']))"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "copy kernels are free" in out.stdout
    assert "RustUnifiedTreeCore" in out.stdout  # SGLang's own tree core, not a fallback
    assert re.fullmatch(
        r"linker: page 16 scheduler \d+\.\d\dx HiCache \(host\+file\), \d+\.\d\dx HiCache "
        r"\(host\), restored \d+\.\d\dx HiCache's tokens",
        lines[-3],
    )
    assert re.fullmatch(
        r"tieredcache: page 16 scheduler \d+\.\d\dx HiCache \(host\+file\)", lines[-2]
    )
    # SGLang's linker seam with a linker that keeps nothing: the floor under any linker
    assert re.fullmatch(
        r"linker floor: page 16 scheduler \d+\.\d\dx HiCache \(host\+file\), "
        r"\d+\.\d\dx HiCache \(host\)",
        lines[-1],
    )
    floor = [ln for ln in lines if ln.startswith("  linker floor: SGLang's seam")]
    assert len(floor) == 1 and "restored 0 tokens" in floor[0], out.stdout
    assert (
        out.stdout.count("failed loads 0 ") + out.stdout.count("failed loads 0\n") == 7
    )


@pytest.mark.parametrize("hybrid", ["swa", "mamba"])
def test_a_short_hybrid_run_prints_every_arm_and_its_line(hybrid):
    """SGLang's hybrid cache (FULL+SWA, FULL+MAMBA) as its test kit builds the pools, with
    every arm but TieredCache: each arm's line with its restored tokens and failed loads,
    and the hybrid ratio line last."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    out = run(
        "import sys\nfrom kvtier.bench.linker import main\n"
        "sys.exit(main(['--requests', '12', '--rounds', '1', '--page-size', '16', "
        f"'--hybrid', '{hybrid}']))"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # every host pool of HiCache's hybrid group is unpinned: a pinned one fails each L3
    # prefetch (logged, not raised) and HiCache + file would restore less than it can
    assert "pin_memory" not in out.stderr, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "RustUnifiedTreeCore" in out.stdout  # the server's tree core, not the kit's
    assert re.fullmatch(
        rf"linker hybrid {hybrid}: page 16 scheduler \d+\.\d\dx HiCache \(host\), "
        r"restored (\d+\.\d\dx HiCache's tokens|\d+ tokens, HiCache none)",
        lines[-1],
    )
    assert f"hybrid {hybrid} (" in out.stdout
    rows = {}
    for label in (
        "SGLang, no tiers",
        "SGLang HiCache, host",
        "SGLang HiCache, host + its file L3",
        "kvtier linker, host",
        "kvtier linker, host + kvtier file store",
    ):
        found = [ln for ln in lines if ln.startswith(f"  {label:<48} scheduler ")]
        assert len(found) == 1, (label, out.stdout)
        rows[label] = found[0]
    assert "TieredCache" not in out.stdout
    assert "linker floor" not in out.stdout
    for (
        row
    ) in rows.values():  # how much is restored, and whether a load failed, depends
        # on when the arms' offloads land in 12 requests (timing): the figures live in the
        # benchmark's own runs, this checks each arm ran and reported them
        assert re.search(r"restored \d+ tokens .*failed loads \d+$", row), row
