"""Pool <-> mirror transfer throughput against one contiguous copy_ of the same bytes.

Geometry: Llama-3-8B-like, scaled to fit (8 layers, 8 KV heads, head_dim 128, fp16, page 64),
~1 GiB of pages in random order. Run: python benchmarks/transfer.py [--gib 1.0]  (or: tierctl bench transfer)

`--device cuda`: the pool on the GPU, the mirror pinned; backup (device->host) is compared
with a plain pinned non-blocking `copy_` of the same bytes D2H, load with the same H2D.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvtier.bench.timing import alternate
from kvtier.tiers.mirror import HostMirror, MirrorConfig
from kvtier.tiers.pool import DeviceKVPool, PoolConfig


def best_of(fn, repeat: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def _backup_and_load(
    mirror, pool, dev, host, nbytes: int, repeat: int
) -> tuple[float, float]:
    """GB/s of an all-layer backup, and of a load as the controller runs one."""
    backup = nbytes / best_of(lambda: mirror.backup(pool, dev, host), repeat) / 1e9
    return backup, nbytes / best_of(
        lambda: _load_all_layers(mirror, pool, dev, host), repeat
    ) / 1e9


def _load_all_layers(mirror, pool, dev, host) -> None:
    """A load as the controller runs one: one plan, then layer by layer."""
    plan = mirror.plan(dev, host) if mirror.io == "direct" else None
    for layer in range(pool.num_layers):
        mirror.load_layer(pool, host, dev, layer, plan)


def _record(
    results: dict,
    label: str,
    key: str,
    backup: float,
    backup_base: float,
    backup_unit: str,
    load: float,
    load_base: float,
    load_unit: str,
) -> None:
    print(
        f"{label} backup {backup:6.2f} GB/s ({backup / backup_base:.2f}{backup_unit})  "
        f"load {load:6.2f} GB/s ({load / load_base:.2f}{load_unit})"
    )
    results[f"{key}/backup"] = backup / backup_base
    results[f"{key}/load"] = load / load_base


def _best(results: dict) -> tuple[float, float]:
    """(best backup ratio, best load ratio) over every layout and path."""
    return (
        max(v for k, v in results.items() if k.endswith("/backup")),
        max(v for k, v in results.items() if k.endswith("/load")),
    )


def run_cuda(
    gib: float = 1.0, repeat: int = 3, page_size: int = 64
) -> dict[str, float]:
    """Pool on the GPU, pinned mirror: backup = D2H, load = H2D, against plain pinned copies."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA GPU")
    layers, heads, dim = 8, 8, 128
    token_bytes = layers * 2 * heads * dim * 2
    pages = max(2, int(gib * (1 << 30)) // (token_bytes * page_size))
    size = pages * page_size
    pool = DeviceKVPool(
        PoolConfig(
            size=size,
            num_layers=layers,
            page_size=page_size,
            num_kv_heads=heads,
            head_dim=dim,
            dtype="float16",
            device="cuda",
        )
    )
    for part in pool.parts:
        part.normal_()
    nbytes = size * token_bytes
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = nbytes / best_of(lambda: dev.copy_(host, non_blocking=True), repeat) / 1e9
    d2h = nbytes / best_of(lambda: host.copy_(dev, non_blocking=True), repeat) / 1e9
    host = dev = None
    g = torch.Generator().manual_seed(0)
    offsets = torch.arange(page_size)
    dev_slots = (
        (torch.randperm(pages, generator=g) + 1)[:, None] * page_size + offsets
    ).flatten()
    print(
        f"{pages} pages of {page_size} tokens, {nbytes / 2**30:.2f} GiB on {torch.cuda.get_device_name()}; "
        f"pinned copy_ H2D {h2d:.2f} GB/s, D2H {d2h:.2f} GB/s"
    )
    results = {"h2d": h2d, "d2h": d2h}
    for layout in ("page_first", "layer_first"):
        for io in ("direct", "kernel"):
            mirror = HostMirror(pool, MirrorConfig(ratio=1.0, layout=layout, io=io))
            host_slots = (
                (torch.randperm(pages, generator=g) + 1)[:, None] * page_size + offsets
            ).flatten()
            backup, load = _backup_and_load(
                mirror, pool, dev_slots, host_slots, nbytes, repeat
            )
            _record(
                results,
                f"{layout:12s} {io:8s}",
                f"{layout}/{io}",
                backup,
                d2h,
                "x D2H",
                load,
                h2d,
                "x H2D",
            )
            mirror = None
    best_backup, best_load = _best(results)
    print(
        f"transfer (cuda): best backup {best_backup:.2f}x D2H, best load {best_load:.2f}x H2D"
    )
    return results


def run(gib: float = 1.0, repeat: int = 5, page_size: int = 64) -> dict[str, float]:
    """Each layout and path against a contiguous `copy_` of the same bytes, in rounds that
    alternate memcpy, backup and load (`timing.alternate`): a ratio compares rounds run
    side by side, never a baseline from minutes earlier."""
    layers, heads, dim = 8, 8, 128
    token_bytes = layers * 2 * heads * dim * 2
    pages = max(2, int(gib * (1 << 30)) // (token_bytes * page_size))
    size = pages * page_size
    pool = DeviceKVPool(
        PoolConfig(
            size=size,
            num_layers=layers,
            page_size=page_size,
            num_kv_heads=heads,
            head_dim=dim,
            dtype="float16",
        )
    )
    for layer in pool.buffers:
        for b in layer:
            b.normal_()
    nbytes = size * token_bytes
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.fill_(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # what one copy stream can do: the direct path copies on one thread
    memcpy_1t = nbytes / best_of(lambda: dst.copy_(src), repeat) / 1e9
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    dev_pages = torch.randperm(pages, generator=g) + 1
    offsets = torch.arange(page_size)
    dev = (dev_pages[:, None] * page_size + offsets).flatten()
    print(
        f"{pages} pages of {page_size} tokens, {nbytes / 2**30:.2f} GiB in random page order; "
        f"each row alternates with a contiguous copy_ ({threads} threads) of the same bytes, best of {repeat}"
    )
    results: dict[str, float] = {}
    memcpy_best = 0.0
    for layout in ("page_first", "layer_first"):
        for io in ("direct", "kernel"):
            mirror = HostMirror(pool, MirrorConfig(ratio=1.0, layout=layout, io=io))
            host_pages = torch.randperm(pages, generator=g) + 1
            host = (host_pages[:, None] * page_size + offsets).flatten()
            best = alternate(
                {
                    "memcpy": lambda: dst.copy_(src),
                    "backup": lambda: mirror.backup(pool, dev, host),  # noqa: B023
                    "load": lambda: _load_all_layers(mirror, pool, dev, host),  # noqa: B023
                },
                repeat,
            )
            memcpy, backup, load = (
                nbytes / best[k] / 1e9 for k in ("memcpy", "backup", "load")
            )
            memcpy_best = max(memcpy_best, memcpy)
            path = io if mirror.io == io else f"{io}->{mirror.io}"
            _record(
                results,
                f"{layout:12s} {path:16s} memcpy {memcpy:6.2f} GB/s |",
                f"{layout}/{io}",
                backup,
                memcpy,
                "x",
                load,
                memcpy,
                "x",
            )
            mirror = None
    best_backup, best_load = _best(results)
    results["memcpy"] = memcpy_best
    print(
        f"one-thread memcpy {memcpy_1t:.2f} GB/s; best rows against it: backup "
        f"{best_backup * memcpy_best / memcpy_1t:.2f}x, load {best_load * memcpy_best / memcpy_1t:.2f}x"
    )
    print(
        f"transfer: best backup {best_backup:.2f}x memcpy, best load {best_load:.2f}x memcpy"
    )
    return results


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args(argv)
    (run_cuda if args.device == "cuda" else run)(args.gib, args.repeat)


if __name__ == "__main__":
    main()
