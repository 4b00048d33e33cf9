"""A file store on a hung mount (a FIFO at a page path: its open never returns) cannot hang
the process: the stuck read is abandoned after its timeout and a grace as long, its buffers
stay out of use, the store is marked down, and close() returns within its timeout.
On main the call timed out but never settled, its host pages were never freed, every later
call timed out, and close() never returned (tierctl replay and serve never exited)."""

import asyncio
import errno
import json
import os
import time

import pytest

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.cache import TieredCache
from kvtier.cli.main import main
from kvtier.errors import StoreAbandoned, StoreTimeout
from kvtier.hashing import make_key

NS = "ab" * 16


def _key(i: int) -> str:
    return make_key("kvtier", NS, bytes([i]) * 32)


def _page_files(root) -> list[str]:
    return [os.path.join(d, n) for d, _, files in os.walk(root) for n in files
            if not n.startswith(".") and len(n) == 64]


def _fifo_for(path: str) -> None:
    os.unlink(path)
    os.mkfifo(path)


def _release(paths) -> None:
    """Let the stuck threads go (their open of the FIFO returns): nothing outlives the test."""
    for p in paths:
        try:
            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            assert exc.errno in (errno.ENXIO, errno.ENOENT)


async def test_a_stuck_read_is_abandoned_and_close_returns(tmp_path):
    cfg = FileStoreConfig(root=str(tmp_path / "l3"), max_concurrency=1)
    store = FileStore(cfg, timeout_s=0.3)
    page = bytes(range(256)) * 4
    assert await store.batch_set([_key(1), _key(2)], [page, page]) == [True, True]
    await store.close()
    stuck = store.path(_key(1))
    _fifo_for(str(stuck))
    store = FileStore(cfg, timeout_s=0.3)  # the FIFO is indexed: it stats
    try:
        buf = bytearray(len(page))
        with pytest.raises(StoreTimeout) as err:
            await store.batch_get_into([_key(1)], [memoryview(buf)])
        outcome = await asyncio.wait_for(err.value.settled, 10)  # bounded: on main, never
        assert isinstance(outcome, StoreAbandoned)
        assert store.stats()["io_threads_abandoned"] == 1 and store.stats()["pages_abandoned"] == 1
        # the pool has a fresh thread; the hung page is never asked for again
        good = bytearray(len(page))
        assert await store.batch_get_into([_key(2)], [memoryview(good)]) == [True] and bytes(good) == page
        assert await store.batch_exists([_key(1), _key(2)]) == 0
        started = time.monotonic()
        await asyncio.wait_for(store.close(), 10)
        assert time.monotonic() - started <= 2 * store.timeout_s + 1
    finally:
        _release([str(stuck)])


async def test_a_write_abandoned_stuck_never_publishes_the_page_it_resumes(tmp_path):
    """A page write stuck opening its temp file (a hung mount: a FIFO there) is abandoned;
    its caller then reuses the buffer. When the mount comes back the thread went on: it
    framed the buffer as it was now, with a valid checksum, and renamed it over the key, so
    every later reader (another rank, a restart) was served other KV under that key. An
    abandoned write now stops before it reads the buffer or renames anything."""
    import copy

    from kvtier.backends import file_io

    store = FileStore(FileStoreConfig(root=str(tmp_path / "l3"), max_concurrency=1), timeout_s=0.3)
    assert await store.batch_set([_key(9)], [bytes(64)]) == [True]  # the fan-out directories exist
    final = str(store.path(_key(1)))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    nxt = next(copy.copy(file_io._TEMP_IDS))  # the name the next write's temp file takes
    temp = f"{os.path.dirname(final)}/{file_io.TMP}{file_io._OWNER}{file_io._RUN}{nxt}"
    os.mkfifo(temp)
    page = bytearray(b"\x11" * 1024)
    try:
        with pytest.raises(StoreTimeout) as err:
            await store.batch_set([_key(1)], [page])
        await asyncio.wait_for(err.value.settled, 10)  # abandoned: the buffer is the caller's again
        page[:] = b"\x77" * 1024  # reused for other KV
        fd = os.open(temp, os.O_RDONLY)  # the mount comes back: the stuck open returns
        captured = bytearray()
        while chunk := os.read(fd, 1 << 16):
            captured += chunk
        os.close(fd)
        for _ in range(200):  # the thread ends: it unlinks its temp file
            if not os.path.lexists(temp):
                break
            time.sleep(0.01)
        assert captured == b"" and not os.path.lexists(final)
    finally:
        _release([temp])
        await store.close()
    reader = FileStore(FileStoreConfig(root=str(tmp_path / "l3")), timeout_s=5)
    try:
        assert await reader.batch_get([_key(1)]) == [None]  # a miss, never the reused buffer's bytes
    finally:
        await reader.close()


def test_replay_verify_on_a_hung_store_completes_reports_it_down_and_closes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("KVTIER_STORE_TIMEOUT_S", "1")
    assert main(["replay", "--requests", "12", "--json"]) == 0  # fills the store
    capsys.readouterr()
    fifos = _page_files(tmp_path / "xdg" / "kvtier")
    assert fifos
    for p in fifos:
        _fifo_for(p)
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
        _release(fifos)
    assert code == 0 and out["verified_requests"] == 12 and out["verify_failures"] == []
    assert out["store"]["breaker_trips"] >= 1 and out["store"]["timeouts"] >= 1
    [(quarantined, began, ended)] = closes
    assert quarantined > 0  # the pages the stuck read was filling are never reused
    assert ended - began <= 2 * 1.0 + 1  # close() within twice the store timeout (plus slack)
