"""A file store on a hung mount (tests/hung.py: an open of a page path never returns until
the mount is back) cannot hang the process: the stuck read is abandoned after its timeout
and a grace as long, its buffers stay out of use, the store is marked down, and close()
returns within its timeout. On main the call timed out but never settled, its host pages
were never freed, every later call timed out, and close() never returned (tierctl replay
and serve never exited). A FIFO in the store, by contrast, is hostile contents: a miss."""

import asyncio
import json
import os
import time

import pytest

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.cache import TieredCache
from kvtier.cli.main import main
from kvtier.errors import StoreAbandoned, StoreTimeout
from kvtier.hashing import make_key
from tests.hung import HungMount

NS = "ab" * 16


def _key(i: int) -> str:
    return make_key("kvtier", NS, bytes([i]) * 32)


def _page_files(root) -> list[str]:
    return [
        os.path.join(d, n)
        for d, _, files in os.walk(root)
        for n in files
        if not n.startswith(".") and len(n) == 64
    ]


async def test_a_stuck_read_is_abandoned_and_close_returns(tmp_path, monkeypatch):
    cfg = FileStoreConfig(root=str(tmp_path / "l3"), max_concurrency=1)
    store = FileStore(cfg, timeout_s=0.3)
    page = bytes(range(256)) * 4
    assert await store.batch_set([_key(1), _key(2)], [page, page]) == [True, True]
    await store.close()
    mount = HungMount(monkeypatch)
    mount.hang(store.path(_key(1)))
    store = FileStore(cfg, timeout_s=0.3)
    try:
        buf = bytearray(len(page))
        with pytest.raises(StoreTimeout) as err:
            await store.batch_get_into([_key(1)], [memoryview(buf)])
        outcome = await asyncio.wait_for(
            err.value.settled, 10
        )  # bounded: on main, never
        assert isinstance(outcome, StoreAbandoned)
        assert (
            store.stats()["io_threads_abandoned"] == 1
            and store.stats()["pages_abandoned"] == 1
        )
        # the pool has a fresh thread; the hung page is never asked for again
        good = bytearray(len(page))
        assert (
            await store.batch_get_into([_key(2)], [memoryview(good)]) == [True]
            and bytes(good) == page
        )
        assert await store.batch_exists([_key(1), _key(2)]) == 0
        started = time.monotonic()
        await asyncio.wait_for(store.close(), 10)
        assert time.monotonic() - started <= 2 * store.timeout_s + 1
    finally:
        mount.release()


async def test_fifos_in_the_store_are_misses_and_leave_the_io_threads_alone(tmp_path):
    """A FIFO put where a page was (hostile contents: anyone who can write the store) was
    opened blocking: each read of one was stuck until given up on, its thread abandoned,
    and after a handful the pool had no thread left: every later call timed out, good
    pages included, for the life of the process. Page files are opened without blocking,
    and anything but a regular file is a miss."""
    cfg = FileStoreConfig(root=str(tmp_path / "l3"), max_concurrency=1)
    store = FileStore(cfg, timeout_s=0.3)
    page = bytes(range(256)) * 4
    keys = [_key(i) for i in range(1, 9)]
    assert await store.batch_set(keys, [page] * 8) == [True] * 8
    await store.close()
    for key in keys[:6]:
        path = str(store.path(key))
        os.unlink(path)
        os.mkfifo(path)
    store = FileStore(cfg, timeout_s=0.3)
    try:
        for key in keys[:6]:
            assert await store.batch_get_into([key], [bytearray(len(page))]) == [False]
        assert await store.batch_get([keys[6]]) == [page]
        good = bytearray(len(page))
        assert (
            await store.batch_get_into([keys[7]], [good]) == [True]
            and bytes(good) == page
        )
        assert (
            store.stats()["io_threads_abandoned"] == 0
            and store.stats()["timeouts"] == 0
        )
    finally:
        await store.close()


async def test_a_write_abandoned_stuck_never_publishes_the_page_it_resumes(
    tmp_path, monkeypatch
):
    """A page write stuck opening its temp file (a hung mount) is abandoned;
    its caller then reuses the buffer. When the mount comes back the thread went on: it
    framed the buffer as it was now, with a valid checksum, and renamed it over the key, so
    every later reader (another rank, a restart) was served other KV under that key. An
    abandoned write now stops before it reads the buffer or renames anything."""
    import copy

    from kvtier.backends import file_io

    store = FileStore(
        FileStoreConfig(root=str(tmp_path / "l3"), max_concurrency=1), timeout_s=0.3
    )
    assert await store.batch_set([_key(9)], [bytes(64)]) == [
        True
    ]  # the fan-out directories exist
    final = str(store.path(_key(1)))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    nxt = next(
        copy.copy(file_io._TEMP_IDS)
    )  # the name the next write's temp file takes
    temp = f"{os.path.dirname(final)}/{file_io.TMP}{file_io._OWNER}{file_io._RUN}{nxt}"
    mount = HungMount(monkeypatch)
    mount.hang(temp)
    page = bytearray(b"\x11" * 1024)
    try:
        with pytest.raises(StoreTimeout) as err:
            await store.batch_set([_key(1)], [page])
        await asyncio.wait_for(
            err.value.settled, 10
        )  # abandoned: the buffer is the caller's again
        page[:] = b"\x77" * 1024  # reused for other KV
        mount.come_back()  # the stuck open returns, and its thread ends
        assert not os.path.lexists(temp) and not os.path.lexists(final)
    finally:
        mount.release()
        await store.close()
    reader = FileStore(FileStoreConfig(root=str(tmp_path / "l3")), timeout_s=5)
    try:
        assert await reader.batch_get([_key(1)]) == [
            None
        ]  # a miss, never the reused buffer's bytes
    finally:
        await reader.close()


def test_replay_verify_on_a_hung_store_completes_reports_it_down_and_closes(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("KVTIER_STORE_TIMEOUT_S", "1")
    assert main(["replay", "--requests", "12", "--json"]) == 0  # fills the store
    capsys.readouterr()
    pages = _page_files(tmp_path / "xdg" / "kvtier")
    assert pages
    mount = HungMount(monkeypatch)
    mount.hang(*pages)
    closes = []
    close = TieredCache.close

    def timed_close(cache):
        began = time.monotonic()
        cache.drain()  # what close() does first: the abandoned read settles, its pages are kept out
        cache.check_accounting()
        closes.append((cache.stats()["queues"]["host_pages_quarantined"], began))
        close(cache)
        closes[-1] = (*closes[-1], time.monotonic())

    monkeypatch.setattr(TieredCache, "close", timed_close)
    try:
        code = main(["replay", "--requests", "12", "--verify", "--json"])
        out = json.loads(capsys.readouterr().out)
    finally:
        mount.release()
    assert code == 0 and out["verified_requests"] == 12 and out["verify_failures"] == []
    assert out["store"]["breaker_trips"] >= 1 and out["store"]["timeouts"] >= 1
    [(quarantined, began, ended)] = closes
    assert quarantined > 0  # the pages the stuck read was filling are never reused
    assert (
        ended - began <= 2 * 1.0 + 1
    )  # close() within twice the store timeout (plus slack)
