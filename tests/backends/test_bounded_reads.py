"""A value planted under a page key by anyone who can write the store (Redis, S3) is read
no further than the page it stands for: a counted miss, never read whole. main read it
whole (GET, a plain get_object): 24 planted 64 MiB values raised a reader's peak memory
by 578 MiB."""

import tracemalloc

import pytest

from kvtier.backends import seal
from kvtier.backends.redis_store import RedisStore
from kvtier.backends.s3 import S3Store
from tests.backends.stores import new_key, redis_harness, s3_harness

PLANTED = 32 << 20
PAGE = bytes(range(256)) * 16  # 4 KiB


def _harness(name, request):
    if name == "redis":
        return redis_harness(request.getfixturevalue("redis_server").url, False, name)
    return s3_harness(request.getfixturevalue("s3_server").url)


def _with_limit(store, limit: int):
    """The same store with `max_page_bytes=limit`."""
    import dataclasses

    cfg = dataclasses.replace(store.config, max_page_bytes=limit)
    return (RedisStore if isinstance(store, RedisStore) else S3Store)(cfg)


async def _peak(store, coro):
    """What `coro` returns, and how much it read: on Redis the most Python memory held at
    once (redis-server is another process), on S3 the bytes the GETs answered (moto's
    server runs in this process: its own memory would count)."""
    if isinstance(store, S3Store):
        got = []

        def count(parsed, **_):
            got.append(parsed.get("ContentLength", 0))

        store.client.meta.events.register("after-call.s3.GetObject", count)
        try:
            return await coro, sum(got)
        finally:
            store.client.meta.events.unregister("after-call.s3.GetObject", count)
    tracemalloc.start()
    try:
        out = await coro
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_slack_covers_every_frame_header():
    from kvtier.backends.base import FRAME_SLACK

    assert seal.HEADER_SIZE + seal.TAG_SIZE <= FRAME_SLACK


@pytest.mark.parametrize("name", ["redis", "s3"])
async def test_a_planted_huge_value_is_a_counted_miss_never_read_whole(name, request):
    h = _harness(name, request)
    store = h.make()
    planted, good = new_key(), new_key()
    try:
        assert await store.batch_set([good], [PAGE]) == [True]
        h.raw_put(planted, b"\0" * PLANTED)
        views = [memoryview(bytearray(len(PAGE))) for _ in range(2)]
        ok, peak = await _peak(store, store.batch_get_into([planted, good], views))
        assert ok == [False, True] and bytes(views[1]) == PAGE
        assert store.stats()["frame_failures"] == 1
        assert peak < 4 << 20, peak  # main: the whole planted value, 32 MiB
        # batch_get and verify's check: bounded by max_page_bytes
        bounded = _with_limit(store, 1 << 20)
        try:
            got, peak = await _peak(bounded, bounded.batch_get([planted, good]))
            assert got == [None, PAGE] and peak < 8 << 20, peak
            [why], peak = await _peak(bounded, bounded.check([planted]))
            assert why not in (None, "missing") and peak < 8 << 20, peak
        finally:
            await bounded.close()
    finally:
        await store.close()


@pytest.mark.parametrize("name", ["redis", "s3"])
async def test_a_planted_huge_manifest_is_none_never_read_whole(name, request):
    h = _harness(name, request)
    store = h.make()
    ns = "ab" * 16
    try:
        await store.put_manifest("kvtier/test", ns, {"format": 1})
        assert (await store.get_manifest("kvtier/test", ns))["format"] == 1
        h.raw_put(f"kvtier/test/{ns}/manifest.json", b" " * PLANTED)
        got, peak = await _peak(store, store.get_manifest("kvtier/test", ns))
        assert got is None and peak < 8 << 20, peak
    finally:
        await store.close()


def test_verify_reads_a_batch_of_planted_values_a_bounded_amount_at_a_time(
    redis_server, tmp_path, monkeypatch, capsys
):
    """`store verify` and `purge --tenant` (with a key it reads every page of the store)
    check pages in batches; each value is bounded by max_page_bytes, but a batch of 256
    planted values was read at once (256 x 512 MiB on Redis). A call reads at most
    BATCH_BYTES of pages by their listed sizes (one page at least), and a page that does
    not verify is not kept by its error's traceback (a reference cycle through the read's
    frame held every bad value read until a collection). Scaled down here: 12 planted
    4 MiB values, 4 MiB a call: old peak 55 MB, now under 20."""
    import redis

    import kvtier.cli.store as store_cli
    from kvtier.cli.main import main

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    ns = "cd" * 16
    for _ in range(12):
        client.set(new_key(ns).replace("kvtier/test/", "kvtier/"), b"\0" * (4 << 20))
    monkeypatch.setattr(store_cli, "BATCH_BYTES", 4 << 20, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("KVTIER_STORE_URL", redis_server.url)
    assert main(["store", "du", "--config", "redis"]) == 0  # its imports, not counted
    tracemalloc.start()
    try:
        code = main(["store", "verify", "--config", "redis", "--json"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 1 and '"bad": 12' in capsys.readouterr().out
    assert peak < 20 << 20, peak
