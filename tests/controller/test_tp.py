"""Two ranks with gloo on CPU agree on every decision; a rank that diverges is caught."""

import json
import os
import subprocess
import sys

from kvtier.controller.tp import DIVERGED_EXIT_CODE
from tests.servers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_ranks(tmp_path, *extra, timeout=240):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs, outs = [], []
    for rank in range(2):
        out = tmp_path / f"rank{rank}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.controller.tp_worker", str(rank), "2", str(port),
                                       str(out), *extra], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    codes, logs = [], []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a TP rank hung")
        codes.append(p.returncode)
        logs.append(stdout.decode(errors="replace"))
    return codes, logs, outs


def test_two_ranks_agree_on_every_decision(tmp_path):
    codes, logs, outs = run_ranks(tmp_path)
    assert codes == [0, 0], logs
    results = [json.loads(o.read_text()) for o in outs]
    assert results[0]["decisions"] == results[1]["decisions"]
    assert results[0]["collectives"] == results[1]["collectives"] > 100  # one per poll, on both ranks
    assert results[0]["stats"]["storage_hit_tokens"] == results[1]["stats"]["storage_hit_tokens"]
    assert sum(d[1] for d in results[0]["decisions"]) > 0  # host hits happened (store hits depend on timing)


def test_diverging_rank_is_caught_and_exits(tmp_path):
    codes, logs, _ = run_ranks(tmp_path, "diverge")
    assert DIVERGED_EXIT_CODE in codes, logs
    assert any("ranks diverged" in log for log in logs)
