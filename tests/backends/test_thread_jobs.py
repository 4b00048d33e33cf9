"""A store call whose thread jobs touch the caller's buffers (file reads and writes, Redis
SETs from the write threads, S3 puts) ends only once every job has returned: when one job
fails, when the call is cancelled (its timeout), and when all succeed. Every store routes
those jobs through `Store._in_threads`; these tests drive it with real pool threads.

The hazard: a batch whose first job failed returned at once while its other jobs went on
reading the caller's host pages; the caller, told the backup had failed, reused those
pages, and a job still to hash one stored the new bytes, under a good checksum, as the
old page: wrong KV served later as a hit."""

import asyncio
import gc
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.backends.base import Store


async def _spin(task: asyncio.Task, rounds: int = 200) -> None:
    """Let the loop run a while (no clock: the other job is parked on an Event)."""
    for _ in range(rounds):
        if task.done():
            return
        await asyncio.sleep(0)


@pytest.fixture
def pool():
    with ThreadPoolExecutor(2) as p:
        yield p


async def test_a_failed_job_ends_the_call_only_after_the_other_jobs_return(pool):
    loop = asyncio.get_running_loop()
    release, returned = threading.Event(), []

    def fails():
        raise ConnectionResetError("connection reset")

    def still_reading():
        release.wait(30)
        returned.append(True)  # the last touch of the caller's buffer
        return "read"

    failed = loop.run_in_executor(pool, fails)
    reading = loop.run_in_executor(pool, still_reading)
    call = asyncio.ensure_future(Store._in_threads([failed, reading]))
    try:
        await asyncio.wait([failed])
        await _spin(call)
        assert not call.done(), (
            "the call ended while a job still held the caller's buffer"
        )
    finally:
        release.set()
    with pytest.raises(ConnectionResetError):
        await call
    assert returned == [True]


async def test_a_cancelled_call_waits_for_its_jobs_and_leaves_no_error_unretrieved(
    pool, caplog
):
    loop = asyncio.get_running_loop()
    release, returned = threading.Event(), []

    def times_out_late():
        release.wait(30)
        returned.append(True)
        raise TimeoutError("Timeout reading from socket")

    job = loop.run_in_executor(pool, times_out_late)
    call = asyncio.ensure_future(Store._in_threads([job]))
    await asyncio.sleep(0)
    call.cancel()  # the store's timeout gave up on the call
    try:
        await _spin(call)
        assert not call.done(), "the cancellation went through while the job still ran"
    finally:
        release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert returned == [True]
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        del job, call
        gc.collect()
        await asyncio.sleep(0)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_jobs_that_succeed_give_their_results_in_order(pool):
    loop = asyncio.get_running_loop()
    jobs = [loop.run_in_executor(pool, lambda i=i: i * i) for i in range(5)]
    assert await Store._in_threads(jobs) == [0, 1, 4, 9, 16]
    assert await Store._in_threads([]) == []


def _framed_files(tmp_path, sizes: list[int]):
    """Page files framed as the file store writes them: (path, ns, h, payload) each."""
    import os

    from kvtier.backends import frame

    out = []
    for i, size in enumerate(sizes):
        ns, h, payload = "ab" * 16, bytes([i]) * 32, os.urandom(size)
        path = tmp_path / f"page-{i}"
        path.write_bytes(frame.encode(ns, h, payload))
        out.append((str(path), ns, h, payload))
    return out


def test_file_reads_hashed_on_a_hashing_thread_keep_each_page_its_own_checksum(
    tmp_path,
):
    """Big pages are hashed on a hashing thread, one digest per page in read order: a page
    that failed in between (cut short after its chunks went to the hasher, damaged, gone)
    must not shift the digests of those after it."""
    from kvtier.backends import file_io
    from kvtier.backends.frame import FrameError

    big, small = file_io._READ_CHUNK + 3 * 4096, 4096  # a big page spans two chunks
    files = _framed_files(tmp_path, [big, big, big, big, big, small, big])
    with open(
        files[1][0], "r+b"
    ) as f:  # cut short: its chunks were hashed, then it failed
        f.truncate(len(open(files[1][0], "rb").read()) - 1)
    flipped = bytearray(open(files[3][0], "rb").read())
    flipped[-1] ^= 1
    open(files[3][0], "wb").write(flipped)
    (tmp_path / "page-4").unlink()
    bufs = [bytearray(len(p)) for *_, p in files]
    with ThreadPoolExecutor(1) as hashers:
        got = file_io.read_pages_into(
            hashers,
            [(path, ns, h, memoryview(b)) for (path, ns, h, _), b in zip(files, bufs)],
        )
    assert [got[0], got[2], got[5], got[6]] == [True] * 4
    assert isinstance(got[1], FrameError) and isinstance(got[3], FrameError)
    assert isinstance(got[4], FileNotFoundError)
    assert [bytes(b) for i, b in enumerate(bufs) if got[i] is True] == [
        p for i, (*_, p) in enumerate(files) if got[i] is True
    ]


def test_a_file_read_job_that_raises_leaves_no_hashing_task_waiting(
    tmp_path, monkeypatch
):
    """A read that raises past the per-page OSError handling (here a buffer that cannot be
    written) still ends the job's hashing: the hashing thread is free again, not parked
    for ever on chunks that will never come (it would hold a pool thread, and the
    caller's buffers, after the call)."""
    from kvtier.backends import file_io

    started = []

    class Recorded(file_io._Hashing):
        def __init__(self, hashers):
            super().__init__(hashers)
            started.append(self)

    monkeypatch.setattr(file_io, "_Hashing", Recorded)
    files = _framed_files(tmp_path, [file_io._HASH_AWAY, file_io._HASH_AWAY])
    items = [
        (
            files[0][0],
            files[0][1],
            files[0][2],
            memoryview(bytearray(file_io._HASH_AWAY)),
        ),
        (files[1][0], files[1][1], files[1][2], memoryview(bytes(file_io._HASH_AWAY))),
    ]  # read-only
    hashers = ThreadPoolExecutor(1)
    try:
        with pytest.raises(BufferError):
            file_io.read_pages_into(hashers, items)
        assert len(started) == 1 and started[0]._digests.done()
    finally:
        for (
            hashing
        ) in started:  # a failed run must not leave the thread parked past the test
            hashing.close()
        hashers.shutdown(wait=True)
