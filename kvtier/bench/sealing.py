"""What a tenant key costs a store: sealed frames (AES-256-GMAC, AES-256-GCM) against the
plain xxh3 frame, the same pages into the same buffers, in the same run.

First the codecs alone, on the vLLM tier's rows (kvtier/bench/vllm_fs.py): `seal` is what
a store does for each page it writes (its header: the checksum, or the seal), `open` what
it does for each page it reads (verify it, and the payload into the caller's buffer; the
same frames every round, so a sealed frame's key is the one its codec kept), so the
stores' rows below tell the seal's share from the store's. Then for each store and page shape, three stores over the same backend (plain, mac, aes-gcm)
take turns within every round (set, get of each); each figure is the best round. The
ratio is sealed over plain throughput: 1.00x costs nothing. Each store verifies what it
reads (the checksum, the MAC, or the tag) and the pages read back are compared.

Run: python benchmarks/stores.py --sealing   (or: tierctl bench stores --sealing)
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.backends.frame import PLAIN, Frame
from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.backends.seal import SealedCodec
from kvtier.bench import servers
from kvtier.bench.timing import alternate
from kvtier.hashing import make_key
from kvtier.tenant_keys import parse_keys

NS = "0" * 32
SHAPES = [(256, 64 << 10), (32, 1 << 20), (8, 8 << 20)]  # (pages, bytes per page)
SEALINGS = ("plain", "mac", "aes-gcm")
CODEC_SHAPES = [(64, 256 << 10), (16, 1 << 20)]  # the vLLM tier's rows


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _sealed(store, sealing: str, keys):
    if sealing != "plain":
        store.seal_with(SealedCodec(keys, encrypt=sealing == "aes-gcm"))
    return store


def _ops(store, tag: str, pages: list[bytes], bufs: list, loop):
    keys = [make_key(f"bench/{tag}", NS, os.urandom(32)) for _ in pages]
    return (
        lambda: loop.run_until_complete(store.batch_set(keys, pages)),
        lambda: loop.run_until_complete(store.batch_get_into(keys, bufs)),
    )


def _codec_ops(codec, pages: list[bytes], bufs: list):
    """Seal every page (the header a store writes before it), and open every page's frame
    into its buffer."""
    hashes = [os.urandom(32) for _ in pages]
    blobs = [
        b"".join((f.header, f.body))
        for f in (Frame(NS, h, p, codec) for h, p in zip(hashes, pages))
    ]

    def seal() -> None:
        for h, p in zip(hashes, pages):
            Frame(NS, h, p, codec).header  # noqa: B018 (what a store's write makes)

    def open_() -> None:
        for blob, h, buf in zip(blobs, hashes, bufs):
            codec.decode_into(blob, NS, h, buf)

    return seal, open_


def codec_costs(repeat: int, keys) -> None:
    """The codecs' rows (no store), GB/s of payload and µs per page."""
    from kvtier.bench.pages import page_aligned

    codecs = {"plain": PLAIN} | {
        s: SealedCodec(keys, encrypt=s == "aes-gcm") for s in SEALINGS[1:]
    }
    for n, size in CODEC_SHAPES:
        pages = [os.urandom(size) for _ in range(n)]
        bufs = {s: page_aligned(n, size) for s in SEALINGS}
        fns = {}
        for s in SEALINGS:
            fns[f"{s} seal"], fns[f"{s} open"] = _codec_ops(codecs[s], pages, bufs[s])
        best = alternate(fns, repeat)
        assert all(b == pages for b in bufs.values()), "opened pages differ"
        gbs = {k: n * size / t / 1e9 for k, t in best.items()}
        us = {k: t / n * 1e6 for k, t in best.items()}
        print(_row("codec", n, size, gbs, ("seal", "open"), us))


def _row(
    name: str,
    n: int,
    size: int,
    gbs: dict[str, float],
    ops: tuple[str, ...] = ("set", "get"),
    us: dict[str, float] | None = None,
) -> str:
    per_page = lambda k: f" {us[k]:.1f} µs/page" if us else ""
    cells = []
    for op in ops:
        plain = gbs[f"plain {op}"]
        cells.append(
            f"{op} plain {plain:5.2f} GB/s{per_page(f'plain {op}')}, "
            + ", ".join(
                f"{s} {gbs[f'{s} {op}']:5.2f}{per_page(f'{s} {op}')} "
                f"({gbs[f'{s} {op}'] / plain:.2f}x)"
                for s in SEALINGS[1:]
            )
        )
    return f"{name:7s} {n:3d} x {_size(size)}: " + " | ".join(cells)


def run(repeat: int = 15, only: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Rows per store and shape; returns the worst sealed/plain ratio per store, op and sealing."""
    from kvtier.bench.pages import page_aligned

    loop = asyncio.new_event_loop()
    keys = parse_keys(os.urandom(32).hex(), "bench key")
    worst: dict[str, dict[str, float]] = {}
    codec_costs(repeat, keys)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        makers = {
            "memory": lambda s: MemoryStore(MemoryStoreConfig(capacity_bytes=1 << 30)),
            "file": lambda s: FileStore(FileStoreConfig(root=str(root / f"store-{s}"))),
        }
        redis_server = None
        try:
            redis_server = servers.RedisServer(root).start()
            from kvtier.backends.redis_store import RedisStore, RedisStoreConfig

            makers["redis"] = lambda s: RedisStore(
                RedisStoreConfig(url=redis_server.url)
            )
        except servers.ServerMissing as exc:
            print(f"redis: skipped ({exc})")
        try:
            for name, make in makers.items():
                if only and name not in only:
                    continue
                stores = {s: _sealed(make(s), s, keys) for s in SEALINGS}
                for n, size in SHAPES:
                    pages = [os.urandom(size) for _ in range(n)]
                    bufs = {s: page_aligned(n, size) for s in SEALINGS}
                    fns = {}
                    for s in SEALINGS:
                        fns[f"{s} set"], fns[f"{s} get"] = _ops(
                            stores[s], s, pages, bufs[s], loop
                        )
                    gbs = {
                        k: n * size / t / 1e9 for k, t in alternate(fns, repeat).items()
                    }
                    assert all(b == pages for b in bufs.values()), "read back differs"
                    print(_row(name, n, size, gbs))
                    for k, v in gbs.items():
                        s, op = k.split(" ")
                        if s != "plain":
                            w = worst.setdefault(name, {})
                            w[k] = min(w.get(k, float("inf")), v / gbs[f"plain {op}"])
                for store in stores.values():
                    loop.run_until_complete(store.close())
            for name, w in worst.items():
                print(
                    f"sealed {name}: "
                    + ", ".join(f"{k} {v:.2f}x plain" for k, v in sorted(w.items()))
                )
        finally:
            if redis_server is not None:
                redis_server.stop()
            loop.close()
    return worst
