"""One TP rank for test_sglang_linker.py's gloo tests: `python -m
tests.integrations.sglang_linker_tp_worker RANK WORLD PORT WORKDIR SCENARIO`.

Each rank runs SGLang's real UnifiedRadixCache with kvtier's linker over its own file store
(its own shard of the KV), in a gloo group that SGLang's cache reduces over. Both ranks
offload the same 8 pages, then a fresh worker per rank (empty host tier) serves a request:
- `short`: rank 1's store lost pages 5..7, rank 0's holds all 8;
- `bad`: rank 1's page 2 no longer verifies (its store still says it holds it).
Writes what SGLang's match and load decided on this rank, and what its linker saw, as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kvtier.testing import sglang_loader
from tests.integrations.sglang_linker_server import (
    TOKENS,
    Server,
    assert_same,
    page_files,
    write_yaml,
)


def main(rank: int, world: int, port: int, workdir: Path, scenario: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    group = dist.new_group(list(range(world)), backend="gloo")
    sg = sglang_loader.load()
    mine = workdir / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    path = write_yaml(mine, {"backend": "file", "root": str(mine / "l3")})
    first = Server(sg, path, tp_group=group)
    want = first.compute(TOKENS, seed=7 + rank)  # each rank's own shard
    first.close()
    if rank == 1:
        files = page_files(sg, first, mine / "l3", TOKENS)
        if scenario == "short":
            for f in files[5:]:
                f.unlink()
        else:
            blob = bytearray(files[2].read_bytes())
            blob[-1] ^= 0x01
            files[2].write_bytes(bytes(blob))
    second = Server(sg, path, tp_group=group)
    req = second.request(TOKENS + [1])
    result = second.match(req, TOKENS + [1])
    local = second.linker.stats()["counters"]["store_hit_pages"]
    n, slots, failed = second.load(req, result)
    same = not failed and (
        assert_same(second.read(slots), [w[:n] for w in want]) is None
    )
    second.allocator.free(slots)
    second.check()
    out = {
        "rank": rank,
        "local_lookup_pages": local,
        "host_hit_length": result.host_hit_length,
        "loaded": n,
        "failed": [r.rid for r in failed],
        "bytes_equal": bool(same),
        "load_failures": second.linker.stats()["counters"]["load_failures"],
    }
    second.close()
    (workdir / f"out{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        Path(sys.argv[4]),
        sys.argv[5],
    )
