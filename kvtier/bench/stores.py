"""Store throughput against a raw client doing the same bytes, measured in the same run.

file  -> plain write + rename, and readinto
redis -> raw redis-py pipelined SET / MGET of the same values
s3    -> a raw boto3 put_object / get_object loop (moto's server on loopback)

Run: python benchmarks/stores.py   (or: tierctl bench stores)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.bench import servers
from kvtier.hashing import make_key

NS = "0" * 32
SHAPES = [(32, 1 << 20), (8, 8 << 20)]


def _keys(n: int, tag: str) -> list[str]:
    return [make_key(f"bench/{tag}", NS, os.urandom(32)) for _ in range(n)]


def _best(fn, repeat: int) -> float:
    return min(_timed(fn) for _ in range(repeat))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_store(store, n: int, size: int, repeat: int, loop: asyncio.AbstractEventLoop) -> tuple[float, float]:
    pages = [os.urandom(size) for _ in range(n)]
    bufs = [bytearray(size) for _ in range(n)]
    keys = _keys(n, "store")
    t_set = _best(lambda: loop.run_until_complete(store.batch_set(keys, pages)), repeat)
    t_get = _best(lambda: loop.run_until_complete(store.batch_get_into(keys, bufs)), repeat)
    assert bufs[0] == pages[0], "read back differs"
    return n * size / t_set / 1e9, n * size / t_get / 1e9


def raw_file(root: Path, n: int, size: int, repeat: int) -> tuple[float, float]:
    pages = [os.urandom(size) for _ in range(n)]
    paths = [root / f"raw-{i}" for i in range(n)]
    bufs = [bytearray(size) for _ in range(n)]

    def write():
        for p, data in zip(paths, pages):
            tmp = p.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, p)

    def read():
        for p, b in zip(paths, bufs):
            with open(p, "rb") as f:
                f.readinto(b)

    return n * size / _best(write, repeat) / 1e9, n * size / _best(read, repeat) / 1e9


def raw_redis(url: str, n: int, size: int, repeat: int) -> tuple[float, float]:
    import redis

    client = redis.Redis.from_url(url)
    pages = [os.urandom(size) for _ in range(n)]
    keys = [f"raw-{i}" for i in range(n)]

    def write():
        pipe = client.pipeline(transaction=False)
        for k, v in zip(keys, pages):
            pipe.set(k, v)
        pipe.execute()

    got = []
    t_set = _best(write, repeat)
    t_get = _best(lambda: got.append(client.mget(keys)), repeat)
    client.close()
    return n * size / t_set / 1e9, n * size / t_get / 1e9


def raw_s3(url: str, bucket: str, n: int, size: int, repeat: int) -> tuple[float, float]:
    import boto3

    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
    pages = [os.urandom(size) for _ in range(n)]

    def write():
        for i, v in enumerate(pages):
            client.put_object(Bucket=bucket, Key=f"raw-{i}", Body=v)

    def read():
        for i in range(n):
            client.get_object(Bucket=bucket, Key=f"raw-{i}")["Body"].read()

    return n * size / _best(write, repeat) / 1e9, n * size / _best(read, repeat) / 1e9


def run(repeat: int = 3, only: list[str] | None = None) -> dict[str, tuple[float, float]]:
    loop = asyncio.new_event_loop()
    ratios: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        stores = {"memory": lambda: (MemoryStore(MemoryStoreConfig(capacity_bytes=1 << 30)), None),
                  "file": lambda: (FileStore(FileStoreConfig(root=str(root / "store"))),
                                   lambda n, s: raw_file(root, n, s, repeat))}
        redis_server = s3_server = None
        try:
            redis_server = servers.RedisServer(root).start()
            from kvtier.backends.redis_store import RedisStore, RedisStoreConfig
            stores["redis"] = lambda: (RedisStore(RedisStoreConfig(url=redis_server.url)),
                                       lambda n, s: raw_redis(redis_server.url, n, s, repeat))
        except servers.ServerMissing as exc:
            print(f"redis: skipped ({exc})")
        try:
            s3_server = servers.S3Server()
            from kvtier.backends.s3 import S3Store, S3StoreConfig
            cfg = S3StoreConfig(bucket="bench", endpoint_url=s3_server.url, create_bucket=True,
                                access_key_id="bench", secret_access_key="bench")
            stores["s3"] = lambda: (S3Store(cfg), lambda n, s: raw_s3(s3_server.url, "bench", n, s, repeat))
        except ImportError as exc:
            print(f"s3: skipped ({exc})")
        try:
            for name, make in stores.items():
                if only and name not in only:
                    continue
                store, raw = make()
                set_r, get_r = [], []
                for n, size in SHAPES:
                    s_gbs, g_gbs = measure_store(store, n, size, repeat, loop)
                    line = f"{name:7s} {n:2d} x {size >> 20} MiB: set {s_gbs:6.2f} GB/s  get {g_gbs:6.2f} GB/s"
                    if raw is not None:
                        rs, rg = raw(n, size)
                        set_r.append(s_gbs / rs)
                        get_r.append(g_gbs / rg)
                        line += f" | raw set {rs:6.2f} get {rg:6.2f} GB/s"
                    print(line)
                loop.run_until_complete(store.close())
                if set_r:
                    ratios[name] = (min(set_r), min(get_r))
            for name, (s, g) in ratios.items():
                print(f"store {name}: set {s:.2f}x raw, get {g:.2f}x raw")
        finally:
            if redis_server is not None:
                redis_server.stop()
            if s3_server is not None:
                s3_server.stop()
            loop.close()
    return ratios


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", nargs="*", choices=["memory", "file", "redis", "s3"], help="store names")
    args = p.parse_args(argv)
    run(args.repeat, args.only)


if __name__ == "__main__":
    main()
