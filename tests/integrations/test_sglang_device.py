"""The SGLang baseline of benchmarks/cache.py: SGLang 0.5.23's own RadixCache, ReqToTokenPool
and token allocators on CPU, driven per request as its scheduler drives them
(kvtier/bench/sglang_device.py). It runs in a child process: loading SGLang by its
real module names must not meet tests/integrations/sglang_runtime.py's bare packages."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.servers import IN_CI

_CHILD = r"""
import json, sys
from kvtier.bench.cache_arms import sglang_device, sglang_unavailable, bare_tree
from kvtier.bench.trace import multiturn
from kvtier.testing.sglang_loader import STUBBABLE, load
why = sglang_unavailable()
if why is not None:
    print(json.dumps({"missing": why})); sys.exit(0)
trace = multiturn(sessions=12, turns=3, system_prompts=2, system_len=256, msg_len=(20, 90), seed=5)
out = {"stubbed": load().stubbed, "expected": sorted(STUBBABLE), "requests": len(trace)}
for page in (1, 16):
    longest = max(len(t.prompt) + len(t.output) for t in trace)
    small = sglang_device(trace, size=-(-2 * longest // page) * page + 4 * page, page=page, in_flight=4)
    big = sglang_device(trace, size=1 << 16, page=page, in_flight=1)
    out[str(page)] = [small.hit_tokens, big.hit_tokens, bare_tree(trace, page).hit_tokens]
print(json.dumps(out))
"""


def _child(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def _skip_or_fail(why: str) -> None:
    if IN_CI:
        pytest.fail(f"{why}; .ci/run must install SGLang and its imports")
    pytest.skip(why)


def test_sglang_cache_serves_the_trace_and_hits_what_a_bare_tree_hits_when_nothing_is_evicted():
    """Each arm ends with every slot free or in the tree and every row free (`check`); with
    room for everything and one request at a time SGLang hits the prompt tokens a bare tree
    hits, less at most a page per request (SGLang leaves a prompt's last token to compute), with a pool of two
    requests it evicts and hits fewer. Only the modules this CPU-only machine cannot
    import are stubbed."""
    r = _child(_CHILD)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "missing" in out:
        _skip_or_fail(out["missing"])
    assert out["stubbed"] == out["expected"]
    for page in ("1", "16"):
        small, big, bare = out[page]
        assert bare - out["requests"] * int(page) <= big <= bare, (page, out[page])
        assert 0 < small < big, (page, out[page])


@pytest.mark.parametrize("page", [1, 16])
def test_bench_cache_measures_against_sglang(page):
    r = _child(
        "from kvtier.bench.cache import main; import sys; main(sys.argv[1:])",
        "--sessions",
        "8",
        "--turns",
        "2",
        "--rounds",
        "1",
        "--page-size",
        str(page),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    if "SGLang: " in r.stdout:
        _skip_or_fail(next(x for x in lines if "SGLang: " in x))
    assert re.fullmatch(
        r"scheduler ratio round by round \(each against the baseline of its own round\): "
        r"\d+\.\d{2}x",
        lines[-3],
    ), lines[-3]  # one round
    assert re.fullmatch(
        r"device only: kvtier \d+\.\d{2}x SGLang device-only", lines[-2]
    ), lines[-2]
    assert re.fullmatch(
        r"cache: hit rate \d\.\d{3}x bound, scheduler \d+\.\d{2}x SGLang device-only",
        lines[-1],
    ), lines[-1]
    assert f", page {page}," in lines[0]
