"""One conformance suite, run against every store: with plain frames, or with every page
sealed under a tenant key when STORE_TEST_SEALING is `mac` or `aes-gcm` (.ci/run runs it
so too)."""

import asyncio
import os

import pytest

from kvtier.backends import frame
from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.hashing import split_key
from kvtier.backends.frame import FrameError
from tests.backends.stores import (
    OTHER_NS,
    SEALING,
    file_harness,
    memory_harness,
    new_key,
    redis_harness,
    s3_harness,
    sealed_harness,
    version_1_frame,
)

STORES = ["memory", "file", "redis", "redis_cluster", "s3"]


@pytest.fixture(params=STORES)
def harness(request, tmp_path):
    return sealed_harness(_harness(request, tmp_path))


def _harness(request, tmp_path):
    name = request.param
    if name == "memory":
        return memory_harness(tmp_path)
    if name == "file":
        return file_harness(tmp_path)
    if name == "redis":
        return redis_harness(request.getfixturevalue("redis_server").url, False, name)
    if name == "redis_cluster":
        return redis_harness(
            request.getfixturevalue("redis_cluster")[0].url, True, name
        )
    return s3_harness(request.getfixturevalue("s3_server").url)


@pytest.fixture
async def store(harness):
    s = harness.make()
    yield s
    await s.close()


def page(n: int = 4096, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(256)) * (n // 256)


async def test_leading_run_exists(store):
    keys = [new_key() for _ in range(4)]
    assert (
        await store.batch_set([keys[0], keys[1], keys[3]], [page(), page(), page()])
        == [True] * 3
    )
    assert await store.batch_exists(keys) == 2
    assert await store.batch_exists(keys[2:]) == 0
    assert await store.batch_exists(keys[:2]) == 2


async def test_missing_keys_are_misses(store):
    keys = [new_key(), new_key()]
    assert await store.batch_get(keys) == [None, None]
    buf = bytearray(4096)
    assert await store.batch_get_into(keys[:1], [buf]) == [False]
    assert store.stats()["misses"] == 3


async def test_round_trip_and_read_into_buffer(store):
    keys = [new_key() for _ in range(3)]
    pages = [page(seed=i) for i in range(3)]
    assert await store.batch_set(keys, pages) == [True] * 3
    assert await store.batch_get(keys) == pages
    bufs = [bytearray(4096) for _ in keys]
    assert await store.batch_get_into(keys, bufs) == [True] * 3
    assert [bytes(b) for b in bufs] == pages


async def test_overwrite_or_skip(store, harness):
    k = new_key()
    await store.batch_set([k], [page(seed=1)])
    assert await store.batch_set([k], [page(seed=2)]) == [True]
    expected = page(seed=2) if harness.overwrites else page(seed=1)
    assert await store.batch_get([k]) == [expected]


async def test_8_mib_pages(store):
    keys = [new_key(), new_key()]
    big = [os.urandom(8 << 20), os.urandom(8 << 20)]
    assert await store.batch_set(keys, big) == [True, True]
    assert await store.batch_get(keys) == big
    buf = bytearray(8 << 20)
    assert (
        await store.batch_get_into(keys[1:], [buf]) == [True] and bytes(buf) == big[1]
    )


async def test_empty_batches(store):
    assert await store.batch_exists([]) == 0
    assert await store.batch_get([]) == []
    assert await store.batch_set([], []) == []
    assert await store.batch_get_into([], []) == []
    assert await store.delete([]) == 0


async def test_two_tasks_writing_the_same_key(store):
    k = new_key()
    a, b = page(seed=3), page(seed=4)
    results = await asyncio.gather(store.batch_set([k], [a]), store.batch_set([k], [b]))
    assert results == [[True], [True]]
    assert (await store.batch_get([k]))[0] in (a, b)  # one whole page, never a mix


async def test_delete(store):
    keys = [new_key(), new_key()]
    await store.batch_set(keys, [page(), page()])
    assert await store.delete(keys + [new_key()]) == 2
    assert await store.batch_exists(keys) == 0


async def test_close_and_reopen(store, harness):
    k = new_key()
    await store.batch_set([k], [page(seed=5)])
    await store.close()
    again = harness.make()
    try:
        expected = [page(seed=5)] if harness.persistent else [None]
        if harness.persistent:
            assert await again.batch_exists([k]) == 1
            assert await again.batch_get([k]) == expected
    finally:
        await again.close()


async def test_a_page_written_by_another_client_later_is_seen(store, harness):
    """Two processes on one store (TP ranks sharing MLA pages, replicas): a page the other
    wrote after this one opened is found, read and verified."""
    other = harness.make()
    try:
        keys = [new_key(), new_key()]
        await other.batch_set(keys[:1], [page(seed=11)])
        assert await store.batch_exists(keys) == 1
        buf = bytearray(4096)
        assert await store.batch_get_into(keys[:1], [buf]) == [True] and bytes(
            buf
        ) == page(seed=11)
        await other.batch_set(keys[1:], [page(seed=12)])
        assert await store.batch_get(keys) == [page(seed=11), page(seed=12)]
    finally:
        if other is not store:
            await other.close()


async def test_exists_each_answers_every_key_another_client_wrote(store, harness):
    """`exists_each` answers each key, past missing ones too (a Mamba state is held only
    at some pages), including pages another process wrote after this one opened."""
    other = harness.make()
    try:
        keys = [new_key() for _ in range(5)]
        await other.batch_set([keys[1], keys[3]], [page(seed=1), page(seed=3)])
        await store.batch_set([keys[4]], [page(seed=4)])
        assert await store.exists_each(keys) == [False, True, False, True, True]
        assert await store.exists_each([]) == []
    finally:
        if other is not store:
            await other.close()


@pytest.mark.parametrize(
    "damage", ["flip", "truncate", "foreign_namespace", "other_hash", "garbage"]
)
async def test_damaged_page_is_a_miss(store, harness, damage):
    k = new_key()
    payload = page(seed=6)
    await store.batch_set([k], [payload])
    blob = bytearray(harness.raw_get(k))
    _, ns, h = split_key(k)
    if damage == "flip":
        blob[frame.HEADER_SIZE + 100] ^= 0x01
    elif damage == "truncate":
        blob = blob[:-17]
    elif damage == "foreign_namespace":
        blob = bytearray(frame.encode(OTHER_NS, h, payload))
    elif damage == "other_hash":
        blob = bytearray(frame.encode(ns, os.urandom(32), payload))
    else:
        blob = bytearray(b"not a frame")
    harness.raw_put(k, bytes(blob))
    assert await store.batch_get([k]) == [None]
    buf = bytearray(len(payload))
    assert await store.batch_get_into([k], [buf]) == [False]
    assert store.stats()["frame_failures"] == 2


@pytest.mark.parametrize("size", [4096, 16])
async def test_an_older_kvtiers_version_1_frame_is_a_miss_that_says_so(
    store, harness, size
):
    """A page an older kvtier framed (version 1: an 80-byte header) misses after an
    upgrade, on every store: never its bytes (its payload is at offset 80, not 128), never
    an exception out of the call; `check` (tierctl store verify) names the version. A page
    smaller than the new header's 128 bytes too."""
    k = new_key()
    _, ns, h = split_key(k)
    harness.raw_put(k, version_1_frame(ns, h, page(seed=9)[:size]))
    [why] = await store.check([k])
    assert isinstance(why, FrameError)
    if SEALING == "plain":
        assert "frame version 1 (an older kvtier), this build reads 3" in str(why)
    assert await store.batch_get([k]) == [None]
    buf = bytearray(size)
    assert await store.batch_get_into([k], [buf]) == [False]
    assert store.stats()["frame_failures"] == 2


@pytest.mark.parametrize("used_by", ["get", "touch"])
@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_capacity_is_enforced_lru(kind, used_by, tmp_path):
    """A read, or a touch (the page just left the host mirror), makes a page the newest."""
    cap = 3 * (4096 + frame.HEADER_SIZE)
    store = (
        MemoryStore(MemoryStoreConfig(capacity_bytes=cap))
        if kind == "memory"
        else FileStore(FileStoreConfig(root=str(tmp_path), capacity_bytes=cap))
    )
    keys = [new_key() for _ in range(4)]
    await store.batch_set(keys[:3], [page()] * 3)
    if used_by == "get":
        await store.batch_get(
            [keys[0]]
        )  # keys[0] is now most recent; keys[1] is the LRU page
    else:
        store.touch([keys[0], new_key()])  # a key the store does not hold is ignored
    await store.batch_set([keys[3]], [page()])
    assert [await store.batch_exists([k]) for k in keys] == [1, 0, 1, 1]
    assert store.stats()["evictions"] == 1 and store.used_bytes <= cap
    if kind == "file":
        files = [
            p
            for p in tmp_path.rglob("*")
            if p.is_file() and not p.name.startswith(".kvtier")
        ]
        assert len(files) == 3 and sum(p.stat().st_size for p in files) <= cap
    await store.close()


async def test_scan_check_and_manifest(store, harness):
    """What `tierctl store` stands on: a streamed listing, verification without hit/miss
    counts, and the namespace manifest, on every store."""
    ns = os.urandom(16).hex()
    keys = [new_key(ns) for _ in range(5)]
    assert await store.batch_set(keys, [page(seed=i) for i in range(5)]) == [True] * 5
    seen = {}
    async for batch in store.scan(batch=2):
        seen.update({p.key: p for p in batch if split_key(p.key)[1] == ns})
    assert set(seen) == set(keys) and all(
        p.size == store.codec.frame_size(4096) for p in seen.values()
    )
    if harness.name in ("file", "s3"):
        assert all(p.mtime is not None for p in seen.values())
    blob = bytearray(harness.raw_get(keys[2]))
    blob[-1] ^= 0xFF
    harness.raw_put(keys[2], bytes(blob))
    gets = store.stats()["gets"]
    verdicts = await store.check(keys + [new_key(ns)])
    assert verdicts[:2] + verdicts[3:] == [
        None,
        None,
        None,
        None,
        "missing",
    ] and isinstance(verdicts[2], FrameError)
    assert str(verdicts[2]).startswith(
        {"plain": "checksum", "mac": "MAC", "aes-gcm": "AES-GCM tag"}[SEALING]
    )
    assert store.stats()["gets"] == gets
    assert await store.get_manifest("kvtier/test", ns) is None
    await store.put_manifest("kvtier/test", ns, {"format": 1, "model_id": "m"})
    assert (await store.get_manifest("kvtier/test", ns))["model_id"] == "m"
    async for batch in store.scan():
        assert all("manifest" not in p.key for p in batch)  # never listed as a page


@pytest.mark.parametrize(
    "damage",
    [
        "none",
        "flip_first",
        "flip_last",
        "one_byte_short",
        "one_byte_more",
        "header_only",
    ],
)
async def test_file_store_pages_bigger_than_a_hash_chunk(tmp_path, damage):
    """Pages over 1 MiB are written in chunks hashed in cache, and read back with their
    checksum made on a hashing thread: the same frame, and every kind of damage anywhere
    in it is still a miss."""
    from kvtier.backends import file_io as file_backend

    harness = file_harness(tmp_path)
    store = harness.make()
    size = 2 * file_backend._HASH_CHUNK + 4096 * 3  # two whole chunks and a partial one
    k, payload = new_key(), os.urandom(size)
    assert await store.batch_set([k], [payload]) == [True]
    blob = bytearray(harness.raw_get(k))
    _, ns, h = split_key(k)
    assert bytes(blob) == frame.encode(
        ns, h, payload
    )  # byte for byte the one-shot frame
    if damage == "flip_first":
        blob[frame.HEADER_SIZE + 5] ^= 0x80
    elif damage == "flip_last":
        blob[-1] ^= 0x01
    elif damage == "one_byte_short":
        blob = blob[:-1]
    elif damage == "one_byte_more":
        blob += b"\0"
    elif damage == "header_only":
        blob = blob[: frame.HEADER_SIZE]
    harness.raw_put(k, bytes(blob))
    buf = bytearray(size)
    assert await store.batch_get_into([k], [buf]) == [damage == "none"]
    if damage == "none":
        assert bytes(buf) == payload
    else:
        assert store.stats()["frame_failures"] == 1
    await store.close()
