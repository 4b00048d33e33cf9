"""A dead or stalled server ends in a mapped kvtier error within the timeout, never a hang."""

import asyncio
import os
import time

import pytest

from kvtier.backends import frame
from kvtier.backends.file import FileStore, FileStoreConfig, _bytes_under
from kvtier.backends.memory import MemoryStore
from kvtier.backends.redis_store import RedisStore, RedisStoreConfig
from kvtier.backends.s3 import S3Store, S3StoreConfig
from kvtier.errors import StoreError, StoreTimeout, StoreUnavailable
from tests.backends.stores import new_key, write_lets_go_in_time
from tests.servers import RedisServer, free_port


async def test_redis_killed_mid_batch_then_restarted(tmp_path):
    server = RedisServer(tmp_path).start()
    store = RedisStore(
        RedisStoreConfig(url=server.url, socket_timeout_s=2.0, connect_timeout_s=1.0),
        timeout_s=3.0,
    )
    try:
        keys = [new_key() for _ in range(48)]
        pages = [os.urandom(1 << 20) for _ in keys]

        async def kill_soon():
            await asyncio.sleep(0.02)
            server.stop()

        start = time.monotonic()
        killer = asyncio.create_task(kill_soon())
        with pytest.raises(StoreError) as err:
            for _ in range(50):  # keep batches in flight until the kill lands
                await store.batch_set(keys, pages)
        await killer
        assert time.monotonic() - start < 3.0 + 2.0
        assert isinstance(err.value, (StoreUnavailable, StoreTimeout))
        assert not isinstance(
            err.value.__cause__, StoreError
        )  # the client's error is chained

        server.start()  # same port: the store reconnects by itself
        assert await store.batch_set(keys[:2], pages[:2]) == [True, True]
        assert await store.batch_get(keys[:2]) == pages[:2]
    finally:
        await store.close()
        server.stop()


async def test_s3_endpoint_down_is_mapped_within_timeout():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    store = S3Store(
        S3StoreConfig(
            endpoint_url=url,
            max_attempts=1,
            connect_timeout_s=0.5,
            access_key_id="x",
            secret_access_key="y",
        ),
        timeout_s=2.0,
    )
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        await store.batch_get([new_key()])
    with pytest.raises(StoreUnavailable):
        await store.batch_set([new_key()], [b"x" * 64])
    assert time.monotonic() - start < 4.0
    assert store.stats()["errors"] == 2
    await store.close()


async def test_a_put_to_a_hung_s3_endpoint_lets_go_of_the_page_after_the_store_timeout():
    """Each attempt's socket times out with the store call, not after read_timeout_s: a
    backup's host pages are not held (nor a close, nor the process's exit, which joins the
    pool's threads) for minutes by an endpoint that accepts and never answers."""
    from kvtier.bench.servers import BlackHole

    hole = BlackHole()
    store = S3Store(
        S3StoreConfig(
            endpoint_url=f"http://127.0.0.1:{hole.port}",
            max_attempts=1,
            connect_timeout_s=120.0,
            read_timeout_s=120.0,
            access_key_id="x",
            secret_access_key="y",
        ),
        timeout_s=0.3,
    )
    try:
        assert await write_lets_go_in_time(
            store
        )  # without the fix: held for the 120 s read timeout
    finally:
        hole.stop()  # the endpoint hangs up: any put still blocked ends now
        await store.close()


async def test_stalled_store_times_out(redis_server):
    """A server that accepts but never answers: StoreTimeout at timeout_s."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    port = sock.getsockname()[1]
    store = RedisStore(
        RedisStoreConfig(
            url=f"redis://127.0.0.1:{port}/0", socket_timeout_s=30, connect_timeout_s=30
        ),
        timeout_s=0.5,
    )
    try:
        start = time.monotonic()
        with pytest.raises(StoreTimeout, match="timeout_s=0.5"):
            await store.batch_exists([new_key()])
        assert time.monotonic() - start < 2.0
        assert store.stats()["timeouts"] == 1
    finally:
        sock.close()
        await store.close()


async def test_no_client_error_escapes_unmapped(tmp_path):
    """Every client failure surfaces as a StoreError subclass with the original chained."""
    store = FileStore(FileStoreConfig(root=str(tmp_path / "l3")))
    k = new_key()
    store.path(k).parent.mkdir(parents=True)
    store.path(k).mkdir()  # a directory where the page file should go: rename fails
    with pytest.raises(StoreError) as err:
        await store.batch_set([k], [b"x" * 16])
    assert isinstance(err.value.__cause__, OSError)
    assert not any(
        p.name.startswith(".tmp-") for p in tmp_path.rglob("*")
    )  # no half page left
    assert await store.batch_exists([k]) == 0  # a failed write is never visible


def _small_disk(root, monkeypatch, size: int) -> int:
    """Page writes under `root` fail with ENOSPC, as a full filesystem's do, once the pages
    there and the one being written would pass `size` bytes."""
    import errno

    from kvtier.backends import file_io

    real_write = file_io._write_page

    def write_page(fd, page):
        if _bytes_under(root) + page.size > size:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, page)

    monkeypatch.setattr(file_io, "_write_page", write_page)
    return size


async def test_a_disk_that_fills_before_the_capacity_evicts_lru_pages_and_keeps_storing(
    tmp_path, monkeypatch
):
    """A file store whose disk fills up first (other files share it, or capacity_bytes is
    above the disk's size) goes on as an LRU cache as big as the disk, instead of refusing
    every write from then on. The disk (`_small_disk`) holds 20 pages."""
    page = 8192
    disk = _small_disk(tmp_path, monkeypatch, 20 * (page + frame.HEADER_SIZE))
    store = FileStore(
        FileStoreConfig(root=str(tmp_path), capacity_bytes=1 << 30, max_concurrency=1)
    )
    try:
        keys = [new_key() for _ in range(60)]
        pages = [os.urandom(page) for _ in keys]
        for i in range(0, len(keys), 6):
            assert (
                await store.batch_set(keys[i : i + 6], pages[i : i + 6]) == [True] * 6
            )
        assert (
            await store.batch_get(keys[-12:]) == pages[-12:]
        )  # the newest are all kept
        assert await store.batch_get(keys[:6]) == [None] * 6  # the oldest made room
        stats = store.stats()
        assert stats["disk_full_evictions"] >= 40 and stats["set_failures"] == 0
        assert _bytes_under(tmp_path) <= disk
    finally:
        await store.close()


async def test_a_page_rewritten_by_the_batch_that_fills_the_disk_is_not_its_victim(
    tmp_path, monkeypatch
):
    """The oldest page is written again in a batch whose last page finds the disk full:
    room is made from other pages, so the rewritten one (the newest now) stays readable."""
    page = 8192
    _small_disk(tmp_path, monkeypatch, 20 * (page + frame.HEADER_SIZE))
    store = FileStore(
        FileStoreConfig(root=str(tmp_path), capacity_bytes=1 << 30, max_concurrency=1)
    )
    try:
        keys = [new_key() for _ in range(19)]
        pages = [os.urandom(page) for _ in keys]
        for k, p in zip(
            keys, pages
        ):  # one at a time: keys[0] is the least recently used
            assert await store.batch_set([k], [p]) == [True]
        fresh = [new_key(), new_key()]
        batch = [
            keys[0],
            *fresh,
        ]  # keys[0] and fresh[0] fit; fresh[1] finds the disk full
        data = [pages[0], os.urandom(page), os.urandom(page)]
        assert await store.batch_set(batch, data) == [True] * 3
        assert store.stats()["disk_full_evictions"] >= 1
        assert await store.batch_get(batch) == data
    finally:
        await store.close()


class _AnswersOnlyHeld(MemoryStore):
    """A plugin whose raw calls answer only for the keys they found or wrote (as a client's
    MGET-like call over its hits may): shorter lists than the keys."""

    async def _get_into(self, keys, parsed, views):
        return [
            r for r in await super()._get_into(keys, parsed, views) if r is not None
        ]

    async def _get(self, keys):
        return [b for b in await super()._get(keys) if b is not None]

    async def _set(self, keys, frames):
        return await super()._set(keys[:1], frames[:1])


async def test_a_store_that_answers_fewer_keys_than_asked_is_a_store_error():
    """Answers were zipped onto the keys: a plugin that answered only for the pages it held
    shifted them, so a later key was reported read into a buffer holding another's bytes (or
    its stale ones), and pages never written were reported stored. Such a call fails."""
    store = _AnswersOnlyHeld()
    keys = [new_key() for _ in range(3)]
    with pytest.raises(StoreError, match=r"batch_set: 1 answers for 3 keys"):
        await store.batch_set(keys, [bytes([i]) * 64 for i in range(3)])
    assert store.stats()["set_failures"] == 3
    assert await MemoryStore.batch_set(store, keys[1:2], [bytes(64)]) == [
        True
    ]  # one held, not the first
    with pytest.raises(StoreError, match=r"batch_get_into: 2 answers for 3 keys"):
        await store.batch_get_into(keys, [bytearray(64) for _ in keys])
    with pytest.raises(StoreError, match=r"batch_get: 2 answers for 3 keys"):
        await store.batch_get(keys)
    with pytest.raises(
        StoreError, match=r"check: 2 answers for 3 keys"
    ):  # verify would prune an intact page
        await store.check(keys)

    class _HeldOnly(MemoryStore):
        async def _exists(self, keys):
            return [True] * (
                len(keys) + 2
            )  # more answers than keys: a longer run than there are keys

    with pytest.raises(StoreError, match=r"batch_exists: 5 answers for 3 keys"):
        await _HeldOnly().batch_exists(keys)


async def test_a_scan_maps_its_errors_like_any_store_call(s3_server):
    """scan() iterated the store's own generator outside the store's call wrapper: an
    error escaped unmapped (botocore's NoSuchBucket here, where every other call raises a
    StoreError) and no timeout applied to it. It is one store call per batch."""
    store = S3Store(
        S3StoreConfig(bucket="no-such-bucket", endpoint_url=s3_server.url), timeout_s=5
    )
    try:
        with pytest.raises(StoreError):
            async for _ in store.scan():
                pass
    finally:
        await store.close()


async def test_an_s3_endpoint_url_with_a_password_is_never_shown():
    """An endpoint_url may carry credentials (`http://user:password@host`, as MinIO's
    examples write it): its errors, its repr and its stats show `user:***@`, never the
    password (the old code quoted the URL whole in "cannot reach ...", repr and stats)."""
    pw = "Sekr1tPW"
    url = f"http://ak:x@{pw}@127.0.0.1:{free_port()}"  # a password holding an '@'
    store = S3Store(
        S3StoreConfig(
            endpoint_url=url,
            max_attempts=1,
            connect_timeout_s=0.5,
            access_key_id="x",
            secret_access_key="y",
        ),
        timeout_s=2.0,
    )
    try:
        with pytest.raises(StoreUnavailable, match="cannot reach") as err:
            await store.batch_get([new_key()])
        shown = [str(err.value), repr(store.config), repr(store.stats())]
        assert all(pw not in s for s in shown), shown
        assert "http://ak:***@127.0.0.1:" in str(err.value)
    finally:
        await store.close()
