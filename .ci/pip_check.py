"""`pip check` for the engine tests' environment (requirements-engines.txt): passes when
the only problems left are the engines' runtime dependencies the tests never import
(SGLang and vLLM go in with --no-deps) and the version conflicts between the two engines
and kvtier that no single environment can satisfy (ENGINE_CONFLICTS, documented in
requirements-engines.txt). Any other line fails, printed."""

from __future__ import annotations

import re
import subprocess
import sys

ENGINES = {"sglang", "vllm"}
# (engine, package): the engines disagree with each other, or with kvtier's torch in CI
ENGINE_CONFLICTS = {
    ("sglang", "torch"),
    ("vllm", "torch"),
    ("sglang", "openai"),
    ("sglang", "xgrammar"),
    ("vllm", "compressed-tensors"),
}
MISSING = re.compile(r"^(\S+) \S+ requires (\S+), which is not installed\.$")
MISMATCH = re.compile(r"^(\S+) \S+ has requirement ([A-Za-z0-9_.\-]+)")


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def unexpected(report: str) -> list[str]:
    """The lines of `pip check`'s output that are neither kind of expected problem."""
    bad = []
    for line in filter(None, map(str.strip, report.splitlines())):
        missing, mismatch = MISSING.match(line), MISMATCH.match(line)
        if missing and _name(missing[1]) in ENGINES:
            continue
        if mismatch and (_name(mismatch[1]), _name(mismatch[2])) in ENGINE_CONFLICTS:
            continue
        if line == "No broken requirements found.":
            continue
        bad.append(line)
    return bad


def main() -> int:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True
    )
    bad = unexpected(out.stdout + out.stderr)
    for line in bad:
        print(f"pip check: {line}", file=sys.stderr)
    print(f"pip check: {'FAILED' if bad else 'ok'} (engine conflicts as documented)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
