"""Redis specifics: the threaded, zero-copy write path (NX, TTL, an error reply), and touch."""

import asyncio

import pytest
import redis

from kvtier.backends.redis_store import RedisStore, RedisStoreConfig
from tests.backends.stores import exact_lfu, new_key, write_lets_go_in_time


async def test_nx_keeps_the_first_page_and_ttl_is_set(redis_server):
    store = RedisStore(
        RedisStoreConfig(
            url=redis_server.url, overwrite=False, ttl_s=600, write_threads=2
        )
    )
    raw = redis.Redis.from_url(redis_server.url)
    try:
        keys = [new_key() for _ in range(5)]
        first = [bytes([i]) * 4096 for i in range(5)]
        assert await store.batch_set(keys, first) == [True] * 5
        # NX: a page already stored stays as it was, and the write still counts as stored
        assert await store.batch_set(keys, [b"\xff" * 4096] * 5) == [True] * 5
        assert await store.batch_get(keys) == first
        assert all(0 < raw.ttl(k) <= 600 for k in keys)
    finally:
        raw.close()
        await store.close()


async def test_an_error_reply_is_a_page_not_stored(redis_server):
    store = RedisStore(RedisStoreConfig(url=redis_server.url, write_threads=1))
    raw = redis.Redis.from_url(redis_server.url)
    try:
        keys = [new_key() for _ in range(3)]
        raw.config_set(
            "maxmemory", 1
        )  # every write is refused: an OOM error reply per SET
        try:
            assert await store.batch_set(keys, [b"a" * 4096] * 3) == [False] * 3
        finally:
            raw.config_set("maxmemory", 0)
        # the connection stays usable after error replies
        assert await store.batch_set(keys, [b"b" * 4096] * 3) == [True] * 3
        assert await store.batch_get(keys) == [b"b" * 4096] * 3
        assert store.counters.set_failures == 3
    finally:
        raw.close()
        await store.close()


async def test_a_write_to_a_hung_server_lets_go_of_the_pages_after_the_store_timeout():
    """The blocking writer's socket times out with the store call, not after socket_timeout_s:
    a caller's pages are not held (nor a close stalled) for a minute by a hung server."""
    from kvtier.bench.servers import BlackHole

    hole = BlackHole()
    store = RedisStore(
        RedisStoreConfig(
            url=f"redis://127.0.0.1:{hole.port}/0",
            socket_timeout_s=120.0,
            connect_timeout_s=120.0,
        ),
        timeout_s=0.3,
    )
    try:
        assert await write_lets_go_in_time(
            store
        )  # without the fix: held for the 120 s socket timeout
    finally:
        hole.stop()  # the server hangs up: any writer still blocked ends now
        await store.close()


async def test_small_pages_go_out_together_and_a_big_one_between_them_stays_whole(
    redis_server,
):
    """The write thread batches small SETs into one send and sends a big page alone; TTL and
    NX options follow every payload, whatever the batch boundaries."""
    store = RedisStore(
        RedisStoreConfig(
            url=redis_server.url, overwrite=False, ttl_s=600, write_threads=1
        )
    )
    raw = redis.Redis.from_url(redis_server.url)
    try:
        pages = [
            i.to_bytes(2, "little") * 2048 for i in range(300)
        ]  # 300 small SETs: over one send's parts
        pages[150] = b"\x07" * (3 << 20)  # bigger than one send's bytes
        keys = [new_key() for _ in pages]
        assert await store.batch_set(keys, pages) == [True] * len(pages)
        assert await store.batch_get(keys) == pages
        assert all(0 < raw.ttl(k) <= 600 for k in keys[::37])
        assert store.counters.set_failures == 0
    finally:
        raw.close()
        await store.close()


def test_a_page_that_cannot_be_hashed_fails_its_write_without_hanging_it(redis_server):
    """The hashing thread's error reaches the sending thread (which would otherwise wait for
    that header forever), and the connection goes back to the pool."""
    from kvtier.backends.frame import Frame

    store = RedisStore(RedisStoreConfig(url=redis_server.url, write_threads=1))
    try:
        gone = memoryview(bytearray(4096))
        gone.release()
        frames = [
            Frame("0" * 32, b"\x01" * 32, memoryview(b"a" * 4096)),
            Frame("0" * 32, b"\x02" * 32, gone),
        ]
        with pytest.raises(ValueError):
            store._send_sets([new_key(), new_key()], frames)
        assert store._send_sets([new_key()], frames[:1]) == [True]
    finally:
        import asyncio

        asyncio.run(store.close())


def _server(request, kind: str):
    """(raw client, url, cluster?) of a standalone server or a cluster (whose pipelined
    touches go to the node holding each key)."""
    if kind == "cluster":
        from redis.cluster import RedisCluster

        url = request.getfixturevalue("redis_cluster")[0].url
        return RedisCluster.from_url(url), url, True
    url = request.getfixturevalue("redis_server").url
    return redis.Redis.from_url(url), url, False


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
async def test_touch_counts_as_an_access_for_redis_eviction(request, kind):
    """Pages that left host are touched, so Redis's maxmemory policy (LFU here: its counter
    is exact with lfu-log-factor 0) sees them used; pages not touched are not. Without the
    touch, Redis only ever saw the pages when they were written, and under allkeys-lru it
    would evict first the ones served from host all along."""
    raw, url, cluster = _server(request, kind)
    store = RedisStore(RedisStoreConfig(url=url, cluster=cluster))
    try:
        with exact_lfu(raw):
            touched, left = [new_key() for _ in range(3)], [new_key() for _ in range(3)]
            assert (
                await store.batch_set(touched + left, [b"p" * 4096] * 6) == [True] * 6
            )
            before = {k: raw.object("freq", k) for k in touched + left}
            store.touch(touched[:2])
            store.touch(
                touched[2:]
            )  # given while the first batch is in flight: sent after it
            await store._toucher
            assert all(raw.object("freq", k) > before[k] for k in touched)
            assert all(raw.object("freq", k) == before[k] for k in left)
            assert store.stats()["touched"] == 3
    finally:
        raw.close()
        await store.close()


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
async def test_touch_renews_the_time_to_live(request, kind):
    raw, url, cluster = _server(request, kind)
    store = RedisStore(RedisStoreConfig(url=url, cluster=cluster, ttl_s=600))
    try:
        keys = [new_key() for _ in range(6)]  # spread over the cluster's nodes
        assert await store.batch_set(keys, [b"p" * 4096] * 6) == [True] * 6
        for k in keys:
            raw.expire(k, 5)  # as if written long ago
        store.touch(keys)
        await store._toucher
        assert all(5 < raw.ttl(k) <= 600 for k in keys)
    finally:
        raw.close()
        await store.close()


async def test_a_touch_the_server_never_answers_is_counted_not_raised_and_close_does_not_wait():
    from kvtier.bench.servers import BlackHole

    hole = BlackHole()
    store = RedisStore(
        RedisStoreConfig(url=f"redis://127.0.0.1:{hole.port}/0"), timeout_s=0.3
    )
    try:
        store.touch([new_key()])
        await store._toucher  # times out inside: nothing raised
        assert store.counters.timeouts == 1 and store.stats()["touched"] == 0
        store.timeout_s = 120.0  # a touch in flight when the store closes is cancelled, not awaited out
        store.touch([new_key()])
        await asyncio.sleep(0.05)  # let it reach the server
        await asyncio.wait_for(store.close(), timeout=30)
        assert store._toucher.cancelled()
    finally:
        hole.stop()


async def test_a_scan_skips_another_applications_keys_of_other_types(redis_server):
    """docs/stores.md: keys that are not kvtier's are skipped. A list or hash of another
    application in the same database answered the scan's STRLEN with WRONGTYPE, which
    escaped unmapped and failed every scan: tierctl store ls, du, purge and SGLang's
    clear(). It is skipped; the pages are listed."""
    other = redis.Redis.from_url(redis_server.url)
    other.rpush("someone-elses-list", b"x")
    other.hset("someone-elses-hash", "f", b"y")
    store = RedisStore(RedisStoreConfig(url=redis_server.url))
    key = new_key()
    try:
        assert await store.batch_set([key], [b"p" * 64]) == [True]
        listed = [p.key async for batch in store.scan() for p in batch]
        assert key in listed
    finally:
        await store.close()
        other.delete("someone-elses-list", "someone-elses-hash")
        other.close()
