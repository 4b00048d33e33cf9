"""kvtier inside a running SGLang: the unified-cache linker's start-up line, and its
counters on SGLang's own /metrics in the multiprocess mode SGLang runs (--enable-metrics),
through SGLang's real UnifiedRadixCache driving the linker."""

from __future__ import annotations

import logging

import kvtier
from tests.integrations.prom_multiproc import multiproc, scrape  # noqa: F401
from tests.integrations.sglang_linker_server import TOKENS, Server, write_yaml
from tests.integrations.test_sglang_linker import sg  # noqa: F401  (the fixture)


def test_the_linker_logs_one_start_line_and_reaches_sglangs_metrics(
    sg,  # noqa: F811
    multiproc,  # noqa: F811
    tmp_path,
    caplog,
):
    """LinkerCollector was never registered where SGLang's /metrics reads (a collector in
    the scheduler process is invisible to its multiprocess scrape), and the start-up line
    named neither kvtier's version nor the tenant key id."""
    caplog.set_level(logging.INFO, logger="kvtier.integrations.sglang.linker.shell")
    path = write_yaml(tmp_path, {"backend": "file", "root": str(tmp_path / "l3")})
    server = Server(sg, path)
    linker = server.linker
    ns = linker.stats()["namespace"]
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("kvtier ")
    ]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"kvtier {kvtier.__version__} SGLang linker: store file (kvtier), namespace {ns}, "
        "tenant key none, tiers SGLang device -> kvtier host ("
    )
    assert lines[0].endswith("-> kvtier store file; tp 0/1")
    server.compute(TOKENS, seed=3)  # offloads, consumed through check_hicache_events
    assert linker.stats()["counters"]["offload_pages"] == 8
    server.check()
    server.close()  # waits for the store writes; the last numbers are exported then
    counters = linker.stats()["counters"]
    got = scrape(multiproc)
    labels = (("namespace", ns), ("tp_rank", "0"))
    assert got[("kvtier_linker_offload_pages_total", labels)] == 8
    assert got[("kvtier_linker_l3_write_pages_total", labels)] == 8
    assert counters["l3_write_pages"] == 8
    assert got[("kvtier_linker_host_pages_total", labels)] > 0
    assert got[("kvtier_linker_store_store_down", labels)] == 0
