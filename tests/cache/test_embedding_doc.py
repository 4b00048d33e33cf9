"""docs/embedding.md's example runs exactly as written."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"


def test_the_embedding_example_runs_as_written(capsys):
    text = DOC.read_text()
    blocks = list(re.finditer(r"```python\n(.*?)```", text, re.S))
    assert len(blocks) == 1, "docs/embedding.md has one runnable example"
    lines_before = text[: blocks[0].start(1)].count(
        "\n"
    )  # a traceback names the doc's own lines
    exec(
        compile("\n" * lines_before + blocks[0].group(1), str(DOC), "exec"),
        {"__name__": "embedding_example"},
    )
    assert (
        "hits: device 0, host 0, store 24; l3 pages written 6"
        in capsys.readouterr().out
    )
