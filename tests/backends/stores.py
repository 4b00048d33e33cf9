"""Store factories for the conformance suite, each with raw access for fault injection."""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from collections.abc import Callable

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.backends.redis_store import RedisStore, RedisStoreConfig
from kvtier.backends.s3 import S3Store, S3StoreConfig
from kvtier.hashing import make_key

NS = "0123456789abcdef0123456789abcdef"
OTHER_NS = "fedcba9876543210fedcba9876543210"
SEALING = os.environ.get(
    "STORE_TEST_SEALING", "plain"
)  # plain, mac or aes-gcm: how the suite's stores frame
SEALINGS = ("plain", "mac", "aes-gcm")
TEST_KEY = "5e" * 32  # a tenant key for tests only


def sealed_harness(h: Harness, sealing: str | None = None) -> Harness:
    """`h` whose stores frame with `sealing` (default: SEALING): plain, or sealed with
    TEST_KEY (AES-256-GMAC, or AES-256-GCM)."""
    sealing = SEALING if sealing is None else sealing
    if sealing not in SEALINGS:
        raise ValueError(
            f"STORE_TEST_SEALING={sealing!r}: allowed {', '.join(SEALINGS)}"
        )
    if sealing == "plain":
        return h
    from kvtier.backends.seal import SealedCodec
    from kvtier.tenant_keys import parse_keys

    codec, make = (
        SealedCodec(parse_keys(TEST_KEY, "test key"), encrypt=sealing == "aes-gcm"),
        h.make,
    )

    def make_sealed():
        store = make()
        store.seal_with(codec)
        return store

    h.make = make_sealed
    return h


def version_1_frame(ns: str, h: bytes, payload: bytes) -> bytes:
    """A page as an older kvtier framed it (version 1): an 80-byte header, the payload at
    offset 80, its xxh3 good."""
    import struct

    import xxhash

    header = struct.pack(
        "<4sHH16sB32sQQ7x",
        b"KVTP",
        1,
        0,
        bytes.fromhex(ns),
        len(h),
        h.ljust(32, b"\0"),
        len(payload),
        xxhash.xxh3_64_intdigest(payload),
    )
    return header + payload


def new_key(ns: str = NS) -> str:
    return make_key("kvtier/test", ns, os.urandom(32))


async def write_lets_go_in_time(store) -> bool:
    """A write to a hung server: StoreTimeout at the store's timeout, and (`settled`) its
    threads let go of the caller's page within 30 s, long before the sockets' own timeouts
    the caller set (120 s). True if they did."""
    import asyncio

    import pytest

    from kvtier.errors import StoreTimeout

    with pytest.raises(StoreTimeout) as err:
        await store.batch_set([new_key()], [b"x" * 4096])
    await asyncio.wait({err.value.settled}, timeout=30)
    return err.value.settled.done()


@dataclass
class Harness:
    name: str
    make: Callable[[], object]  # a new store over the same data
    raw_get: Callable[[str], bytes]
    raw_put: Callable[[str, bytes], None]
    persistent: bool
    overwrites: bool
    capacity: bool


def memory_harness(_) -> Harness:
    store = MemoryStore(MemoryStoreConfig(capacity_bytes=64 << 20))
    return Harness(
        "memory",
        lambda: store,
        lambda k: store._pages[k],
        lambda k, b: store._pages.__setitem__(k, b),
        persistent=False,
        overwrites=True,
        capacity=True,
    )


def file_harness(tmp_path) -> Harness:
    cfg = FileStoreConfig(root=str(tmp_path / "l3"), capacity_bytes=64 << 20)
    first = FileStore(cfg)

    def raw_put(k: str, b: bytes) -> None:
        first.path(k).parent.mkdir(parents=True, exist_ok=True)
        first.path(k).write_bytes(b)

    return Harness(
        "file",
        lambda: FileStore(cfg),
        lambda k: first.path(k).read_bytes(),
        raw_put,
        persistent=True,
        overwrites=True,
        capacity=True,
    )


def redis_harness(url: str, cluster: bool, name: str) -> Harness:
    import redis
    from redis.cluster import RedisCluster

    raw = RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    cfg = RedisStoreConfig(url=url, cluster=cluster)
    return Harness(
        name,
        lambda: RedisStore(cfg),
        raw.get,
        raw.set,
        persistent=True,
        overwrites=True,
        capacity=False,
    )


def s3_harness(url: str) -> Harness:
    import boto3

    bucket = f"kvtier-{uuid.uuid4().hex[:12]}"
    cfg = S3StoreConfig(
        bucket=bucket,
        endpoint_url=url,
        create_bucket=True,
        access_key_id="testing",
        secret_access_key="testing",
    )
    client = boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    return Harness(
        "s3",
        lambda: S3Store(cfg),
        lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(),
        lambda k, b: client.put_object(Bucket=bucket, Key=k, Body=b),
        persistent=True,
        overwrites=False,
        capacity=False,
    )


@contextlib.contextmanager
def exact_lfu(raw):
    """The Redis server evicting by LFU, its counter exact (lfu-log-factor 0): OBJECT FREQ
    then counts every access. Its settings come back after."""
    from redis.cluster import RedisCluster

    every = (
        {"target_nodes": RedisCluster.ALL_NODES}
        if isinstance(raw, RedisCluster)
        else {}
    )  # a cluster: each node
    policy = raw.config_get("maxmemory-policy")["maxmemory-policy"]
    factor = raw.config_get("lfu-log-factor")["lfu-log-factor"]
    raw.config_set("maxmemory-policy", "allkeys-lfu", **every)
    raw.config_set("lfu-log-factor", 0, **every)
    try:
        yield
    finally:
        raw.config_set("maxmemory-policy", policy, **every)
        raw.config_set("lfu-log-factor", factor, **every)
