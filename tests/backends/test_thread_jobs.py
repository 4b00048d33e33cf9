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
        assert not call.done(), "the call ended while a job still held the caller's buffer"
    finally:
        release.set()
    with pytest.raises(ConnectionResetError):
        await call
    assert returned == [True]


async def test_a_cancelled_call_waits_for_its_jobs_and_leaves_no_error_unretrieved(pool, caplog):
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
