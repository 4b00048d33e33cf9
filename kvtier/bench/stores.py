"""Store throughput against a raw client doing the same bytes, measured in the same run.

file  -> plain write + rename, and readinto, on as many threads as the store uses
redis -> raw redis-py pipelined SET / MGET of the same values
s3    -> raw boto3 put_object / get_object of the same values, as many at once as the store
         sends (moto's server on loopback)

Store and raw rounds alternate (set, raw set, get, raw get, ...); each figure is the best
round, so a noisy neighbour hurts both sides alike. Both sides write the same pages and
read into the same buffers (with buffers of their own, the raw reads ran up to 1.4x faster
after the memory store's run than before it, the store's not: a ratio that measured where
memory lay). The buffers start on page boundaries, as host mirror pages do: a bytearray's
bytes start 16 bytes into a page, and on AMD Zen 3 the kernel's copy from the page cache
runs 3x slower when the destination lies exactly 16 bytes past the source within a page
(the raw file, payload at offset 0: 2.6 GB/s; the store's, past a header of 80 bytes then:
7.5 GB/s), so bytearrays made the raw side look slow. The file store's get verifies a
checksum over every page (xxh3): hashing a 1 MiB page just read takes 0.2x the read's time,
so in the reading thread that pass alone held the store to about 0.83x a plain read; pages
of 1 MiB and more are hashed on a second thread while the next chunk is read. That pass
still costs the most: on a 2-core VM it contends with the reads for memory bandwidth, and
with it patched out, 1 and 8 MiB reads ran at 0.88-0.99x raw instead of 0.72-0.86x
(docs/stores.md). The rest is the event loop's cost: the store call's two thread wake-ups
(through the loop's self-pipe), ~0.4-0.6 ms a call there.

Each store is also measured against the limit it can reach here: the raw client's I/O of
the same bytes plus one xxh3 pass over them (the checksum every store writes into a frame
and verifies on a get), hashed in the calling thread after a raw get and before a raw set.
`against raw + xxh3` then says what kvtier's own overhead is, apart from the checksum's
price. The memory store's raw side is a copy of each page into a dict and back into the
buffers.

Run: python benchmarks/stores.py   (or: tierctl bench stores)
     python benchmarks/stores.py --sealing   what a tenant key costs (kvtier/bench/sealing.py)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import xxhash

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.bench import servers
from kvtier.bench.pages import page_aligned
from kvtier.bench.timing import alternate
from kvtier.hashing import make_key

NS = "0" * 32
SHAPES = [(256, 64 << 10), (32, 1 << 20), (8, 8 << 20)]  # (pages, bytes per page)
SLOW_SMALL = {
    "s3"
}  # moto's server spends ~6 ms a request: 64 KiB pages time moto, not us


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _keys(n: int, tag: str) -> list[str]:
    return [make_key(f"bench/{tag}", NS, os.urandom(32)) for _ in range(n)]


def store_ops(
    store, pages: list[bytes], bufs: list[memoryview], loop: asyncio.AbstractEventLoop
):
    """(set, get) of `pages` through the store, reading back into `bufs`."""
    keys = _keys(len(pages), "store")
    return (
        lambda: loop.run_until_complete(store.batch_set(keys, pages)),
        lambda: loop.run_until_complete(store.batch_get_into(keys, bufs)),
    )


def _threaded(pool, fn, items: list, threads: int) -> None:
    """fn over items, split into `threads` jobs as the store splits a batch."""
    for f in [
        pool.submit(lambda share: [fn(*it) for it in share], items[g::threads])
        for g in range(threads)
    ]:
        f.result()


def raw_file(root: Path, pages: list[bytes], bufs: list[memoryview], threads: int):
    from concurrent.futures import ThreadPoolExecutor

    paths = [root / f"raw-{i}" for i in range(len(pages))]
    pool = ThreadPoolExecutor(threads)

    def write(p, data):
        tmp = p.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, p)

    def read(p, b):
        with open(p, "rb") as f:
            f.readinto(b)

    return (
        lambda: _threaded(pool, write, list(zip(paths, pages)), threads),
        lambda: _threaded(pool, read, list(zip(paths, bufs)), threads),
    )


def raw_memory(pages: list[bytes], bufs: list[memoryview]):
    held: dict[int, bytes] = {}

    def write():
        for i, v in enumerate(pages):
            held[i] = bytearray(v)  # a copy, as the store keeps one

    def read():
        for i, b in enumerate(bufs):
            b[:] = held[i]

    return write, read


def with_checksum(raw_set, raw_get, pages: list[bytes], bufs: list[memoryview]):
    """The raw sides plus one xxh3 pass over the same bytes: before a set, after a get."""

    def hash_all(items) -> None:
        for b in items:
            xxhash.xxh3_64_intdigest(b)

    def checked_set():
        hash_all(pages)
        raw_set()

    def checked_get():
        raw_get()
        hash_all(bufs)

    return checked_set, checked_get


def raw_redis(url: str, pages: list[bytes], bufs: list[memoryview], threads: int):
    import redis

    client = redis.Redis.from_url(url)
    keys = [f"raw-{i}" for i in range(len(pages))]

    def write():
        pipe = client.pipeline(transaction=False)
        for k, v in zip(keys, pages):
            pipe.set(k, v)
        pipe.execute()

    return write, lambda: client.mget(keys)


def raw_s3(
    url: str, bucket: str, pages: list[bytes], bufs: list[memoryview], threads: int
):
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        config=Config(max_pool_connections=threads),
    )
    pool = ThreadPoolExecutor(threads)

    def write(i, v):
        client.put_object(Bucket=bucket, Key=f"raw-{i}", Body=v)

    def read(i):
        client.get_object(Bucket=bucket, Key=f"raw-{i}")["Body"].read()

    return (
        lambda: _threaded(pool, write, list(enumerate(pages)), threads),
        lambda: _threaded(pool, read, [(i,) for i in range(len(pages))], threads),
    )


def run(
    repeat: int = 15, only: list[str] | None = None
) -> dict[str, tuple[float, float, float, float]]:
    """Per store: (set, get) against the raw client, then (set, get) against raw + xxh3,
    each the worst over the page shapes."""
    loop = asyncio.new_event_loop()
    ratios: dict[str, tuple[float, float, float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        file_cfg = FileStoreConfig(root=str(root / "store"))
        stores = {
            "memory": lambda: (
                MemoryStore(MemoryStoreConfig(capacity_bytes=1 << 30)),
                raw_memory,
            ),
            "file": lambda: (
                FileStore(file_cfg),
                lambda p, b: raw_file(root, p, b, file_cfg.max_concurrency),
            ),
        }
        redis_server = s3_server = None
        try:
            redis_server = servers.RedisServer(root).start()
            from kvtier.backends.redis_store import RedisStore, RedisStoreConfig

            stores["redis"] = lambda: (
                RedisStore(RedisStoreConfig(url=redis_server.url)),
                lambda p, b: raw_redis(redis_server.url, p, b, 1),
            )
        except servers.ServerMissing as exc:
            print(f"redis: skipped ({exc})")
        try:
            s3_server = servers.S3Server()
            from kvtier.backends.s3 import S3Store, S3StoreConfig

            cfg = S3StoreConfig(
                bucket="bench",
                endpoint_url=s3_server.url,
                create_bucket=True,
                access_key_id="bench",
                secret_access_key="bench",
            )
            stores["s3"] = lambda: (
                S3Store(cfg),
                lambda p, b: raw_s3(s3_server.url, "bench", p, b, cfg.max_workers),
            )
        except ImportError as exc:
            print(f"s3: skipped ({exc})")
        try:
            for name, make in stores.items():
                if only and name not in only:
                    continue
                store, raw = make()
                set_r, get_r, set_l, get_l = [], [], [], []
                for n, size in SHAPES:
                    if name in SLOW_SMALL and size < 1 << 20:
                        continue
                    # both sides write the same pages and read into the same page-aligned
                    # buffers: where a buffer lies moved raw reads by up to 3x (docstring)
                    pages = [os.urandom(size) for _ in range(n)]
                    bufs = page_aligned(n, size)
                    s_set, s_get = store_ops(store, pages, bufs, loop)
                    fns = {"set": s_set, "get": s_get}
                    if raw is not None:
                        fns["raw set"], fns["raw get"] = raw(pages, bufs)
                        fns["limit set"], fns["limit get"] = with_checksum(
                            fns["raw set"], fns["raw get"], pages, bufs
                        )
                    gbs = {
                        k: n * size / t / 1e9 for k, t in alternate(fns, repeat).items()
                    }
                    bufs[0][:1] = bufs[-1][-1:] = b"?"
                    s_get()
                    assert bufs == pages, "read back differs"
                    line = f"{name:7s} {n:3d} x {_size(size)}: set {gbs['set']:6.2f} GB/s  get {gbs['get']:6.2f} GB/s"
                    if raw is not None:
                        set_r.append(gbs["set"] / gbs["raw set"])
                        get_r.append(gbs["get"] / gbs["raw get"])
                        set_l.append(gbs["set"] / gbs["limit set"])
                        get_l.append(gbs["get"] / gbs["limit get"])
                        line += (
                            f" | raw set {gbs['raw set']:6.2f} get {gbs['raw get']:6.2f} GB/s"
                            f" | raw + xxh3 set {gbs['limit set']:6.2f} get {gbs['limit get']:6.2f} GB/s"
                        )
                    print(line)
                loop.run_until_complete(store.close())
                if set_r:
                    ratios[name] = (min(set_r), min(get_r), min(set_l), min(get_l))
            for name, (s, g, sl, gl) in ratios.items():
                print(
                    f"store {name}: set {s:.2f}x raw, get {g:.2f}x raw; against raw + xxh3: set {sl:.2f}x, "
                    f"get {gl:.2f}x"
                )
        finally:
            if redis_server is not None:
                redis_server.stop()
            if s3_server is not None:
                s3_server.stop()
            loop.close()
    return ratios


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument(
        "--repeat",
        type=int,
        default=15,
        help="alternating rounds; each side keeps its best",
    )
    p.add_argument(
        "--only",
        nargs="*",
        choices=["memory", "file", "redis", "s3"],
        help="store names",
    )
    p.add_argument(
        "--sealing",
        action="store_true",
        help="instead: sealed frames (AES-256-GMAC, AES-256-GCM) against the plain one (kvtier/bench/sealing.py)",
    )
    args = p.parse_args(argv)
    if args.sealing:
        from kvtier.bench import sealing

        sealing.run(args.repeat, args.only)
        return
    run(args.repeat, args.only)


if __name__ == "__main__":
    main()
