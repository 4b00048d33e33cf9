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


@pytest.mark.parametrize(
    "in_memory, whole", [(False, 0), (True, 64 << 20), (True, 4096)]
)
def test_file_reads_check_each_page_on_its_own(in_memory, whole, tmp_path, monkeypatch):
    """Pages are read in chunks through the I/O thread's buffer, hashed there and copied
    into the caller's, or (a file in memory, up to `_WHOLE_READ` bytes) whole, straight
    into the caller's buffer and checked there: either way pages of one chunk, of
    exactly one chunk, over it, cut short by a byte, with a byte too many, with a
    flipped last byte or gone each get their own verdict, and only the good ones their
    bytes."""
    from kvtier.backends import file_io
    from kvtier.backends.frame import FrameError

    monkeypatch.setattr(file_io, "_in_memory", lambda fd, device: in_memory)
    monkeypatch.setattr(file_io, "_WHOLE_READ", whole)

    chunk = file_io._READ_CHUNK
    sizes = [chunk + 3 * 4096, chunk + 3 * 4096, chunk, 2 * chunk + 1, chunk + 3 * 4096]
    files = _framed_files(tmp_path, sizes + [4096, 2 * chunk, 4096])
    with open(files[1][0], "r+b") as f:  # cut short by a byte
        f.truncate(len(open(files[1][0], "rb").read()) - 1)
    flipped = bytearray(open(files[4][0], "rb").read())
    flipped[-1] ^= 1
    open(files[4][0], "wb").write(flipped)
    with open(files[7][0], "ab") as f:  # a byte too many
        f.write(b"x")
    (tmp_path / "page-5").unlink()
    bufs = [bytearray(len(p)) for *_, p in files]
    got = file_io.read_pages_into(
        [(path, ns, h, memoryview(b)) for (path, ns, h, _), b in zip(files, bufs)]
    )
    assert [got[i] for i in (0, 2, 3, 6)] == [True] * 4
    assert [type(got[i]) for i in (1, 4, 7)] == [FrameError] * 3
    assert isinstance(got[5], FileNotFoundError)
    assert [bytes(b) for i, b in enumerate(bufs) if got[i] is True] == [
        p for i, (*_, p) in enumerate(files) if got[i] is True
    ]


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_file_read_given_up_on_writes_no_byte_of_the_callers_buffer(
    in_memory, tmp_path, monkeypatch
):
    """Once the call gave up on a read job (its StopFlag set), the job writes nothing more
    into the caller's buffers: the owner reuses them at once (a vLLM row). Both ways a
    page lands there: in chunks copied from the I/O thread's buffer (given up on after
    the first chunk's read: no byte of the page lands), and, for a file in memory
    (tmpfs), read whole straight in by one read under the stop flag (given up on during
    it: that page is whole, and the next page's buffer is never written)."""
    import os
    import threading

    from kvtier.backends import file_io
    from kvtier.backends.io_threads import StopFlag

    chunk = file_io._READ_CHUNK
    files = _framed_files(tmp_path, [3 * chunk, chunk])
    stop, bufs = StopFlag(), [bytearray(3 * chunk), bytearray(chunk)]
    real = os.preadv

    def read_then_give_up(fd, bufs, offset, *flags):
        n = real(fd, bufs, offset, *flags)
        # the call gives up meanwhile: its set() waits for a write into the caller's
        # buffer in progress (this one, when read straight in), so the flag is up once
        # it ended
        threading.Event.set(stop)
        return n

    monkeypatch.setattr(file_io, "_in_memory", lambda fd, device: in_memory)
    monkeypatch.setattr(os, "preadv", read_then_give_up)
    got = file_io.read_pages_into(
        [(path, ns, h, memoryview(b)) for (path, ns, h, _), b in zip(files, bufs)],
        stop,
    )
    if in_memory:
        assert got == [True] and bytes(bufs[0]) == files[0][3]
    else:
        assert len(got) == 1 and isinstance(got[0], OSError)
        assert "given up on" in str(got[0]) and bufs[0] == bytes(3 * chunk)
    assert bufs[1] == bytes(chunk)


@pytest.mark.parametrize("whole", [True, False])
def test_a_page_in_memory_lands_in_the_callers_buffer_only_under_the_stop_flag(
    whole, tmp_path, monkeypatch
):
    """A page file in memory read whole, straight into the caller's buffer, is read
    holding the call's stop flag (`StopFlag.writing`, which `set` takes: a give-up waits
    for that read, and no byte lands after it); one over `_WHOLE_READ` is read in chunks
    through the I/O thread's buffer, not holding it (a give-up never waits on a read).
    Given up on after the job's check between pages, as the page is opened, the page's
    read lands nowhere."""
    import os

    from kvtier.backends import file_io
    from kvtier.backends.io_threads import StopFlag

    chunk = file_io._READ_CHUNK
    files = _framed_files(tmp_path, [2 * chunk, chunk])
    stop, bufs = StopFlag(), [bytearray(2 * chunk), bytearray(chunk)]
    items = [(p, ns, h, memoryview(b)) for (p, ns, h, _), b in zip(files, bufs)]
    real, held = os.preadv, []

    def reading(fd, targets, offset, *flags):
        held.append(stop.writing.locked())
        return real(fd, targets, offset, *flags)

    monkeypatch.setattr(os, "preadv", reading)
    monkeypatch.setattr(file_io, "_WHOLE_READ", 2 * chunk if whole else chunk)
    monkeypatch.setattr(file_io, "_in_memory", lambda fd, device: True)
    assert file_io.read_pages_into(items[:1], stop) == [True]
    assert bytes(bufs[0]) == files[0][3]
    assert held and held == [whole] * len(held)

    def give_up_as_it_opens(fd, device):
        stop.set()  # the call gives up: the job passed its check between pages
        return True

    monkeypatch.setattr(file_io, "_in_memory", give_up_as_it_opens)
    [got] = file_io.read_pages_into(items[1:], stop)
    assert isinstance(got, OSError) and "given up on" in str(got)
    assert bufs[1] == bytes(chunk)


def test_pages_in_memory_are_read_straight_in(tmp_path):
    """A page file on tmpfs is read into the caller's buffer, not copied through the I/O
    thread's: its filesystem is memory, so the read cannot block."""
    import os
    import tempfile

    from kvtier.backends import file_io

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        fd, device = file_io._open_page(f.name)
        try:
            assert file_io._in_memory(fd, device)
        finally:
            os.close(fd)


def test_whether_a_page_is_in_memory_is_asked_of_its_own_file(tmp_path, monkeypatch):
    """A device number names a filesystem only while it is mounted: an NFS mount made
    after a tmpfs was unmounted may get the tmpfs's anonymous number. A page there taken
    for memory would be read under the call's stop flag, so a server that hangs would
    hang the call's give-up (StopFlag.set waits for that read), and the loop with it."""
    import os

    from kvtier.backends import file_io

    page = tmp_path / "page"
    page.write_bytes(b"x")
    types = iter([0x01021994, 0x6969])  # tmpfs, then NFS on the same device number
    monkeypatch.setattr(file_io, "_fs_type", lambda fd: next(types))
    monkeypatch.setattr(file_io, "_NOT_IN_MEMORY", set())
    for want in (True, False):
        fd, device = file_io._open_page(str(page))
        try:
            assert file_io._in_memory(fd, device) is want
        finally:
            os.close(fd)


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_sealed_file_read_given_up_on_writes_no_byte_of_the_callers_buffer(
    encrypt, tmp_path, monkeypatch
):
    """With a tenant key a page is read and authenticated in the I/O thread's buffer and
    copied in only if the call still wants it: given up on during the read, the caller's
    buffer stays untouched."""
    import os
    import threading

    from kvtier.backends import file_io
    from kvtier.backends.io_threads import StopFlag
    from kvtier.backends.seal import SealedCodec
    from kvtier.tenant_keys import parse_keys

    codec = SealedCodec(parse_keys("a1" * 32, "test").current_only(), encrypt)
    ns, h, payload = "ab" * 16, bytes([3]) * 32, os.urandom(3 * file_io._READ_CHUNK)
    header, body = codec.seal(ns, h, payload)
    path = tmp_path / "page"
    path.write_bytes(bytes(header) + bytes(body))
    stop, buf = StopFlag(), bytearray(len(payload))
    real = os.preadv

    def read_then_give_up(fd, bufs, offset, *flags):
        n = real(fd, bufs, offset, *flags)
        threading.Event.set(stop)  # the call gave up while the page was read
        return n

    monkeypatch.setattr(file_io, "_in_memory", lambda fd, device: False)
    assert file_io.read_sealed_into(codec, [(str(path), ns, h, memoryview(buf))]) == [
        True
    ]
    assert buf == payload
    buf[:] = bytes(len(buf))
    monkeypatch.setattr(os, "preadv", read_then_give_up)
    [got] = file_io.read_sealed_into(codec, [(str(path), ns, h, memoryview(buf))], stop)
    assert isinstance(got, OSError) and "given up on" in str(got)
    assert buf == bytes(len(buf))


async def test_file_calls_begun_together_take_one_thread_job_each(tmp_path):
    """The file store's threads are shared by its calls in flight. Calls begun together
    (vLLM's tier hands its jobs to the loop at once) each take one thread job: the first
    to reach the threads does not split itself over all of them (4 + 2 + 1 + 1 jobs for
    4 calls, a wake-up of the loop for each). A call alone still uses every thread."""
    from kvtier.backends.file import FileStore, FileStoreConfig
    from kvtier.hashing import make_key

    store = FileStore(FileStoreConfig(root=str(tmp_path / "l3"), max_concurrency=4))
    submitted = []
    real_submit = store._pool.submit

    def counted(fn, *args, **kwargs):
        submitted.append(fn)
        return real_submit(fn, *args, **kwargs)

    store._pool.submit = counted
    try:
        batches = [
            [make_key("t", "ab" * 16, bytes([b, i]) * 16) for i in range(8)]
            for b in range(4)
        ]
        pages = [bytes([i]) * 4096 for i in range(8)]
        oks = await asyncio.gather(*(store.batch_set(keys, pages) for keys in batches))
        assert oks == [[True] * 8] * 4
        assert len(submitted) == 4, "writes begun together: one thread job each"
        submitted.clear()
        bufs = [[bytearray(4096) for _ in range(8)] for _ in batches]
        got = await asyncio.gather(
            *(store.batch_get_into(keys, b) for keys, b in zip(batches, bufs))
        )
        assert got == [[True] * 8] * 4
        assert [bytes(b) for b in bufs[3]] == pages
        assert len(submitted) == 4, "reads begun together: one thread job each"
        submitted.clear()
        assert await store.batch_get_into(batches[0], bufs[0]) == [True] * 8
        assert len(submitted) == 4, "a call alone splits over every thread"
    finally:
        await store.close()


def test_a_read_job_asks_each_device_once_whether_it_is_memory(monkeypatch):
    """A job's pages on one tmpfs are read straight in after one `fstatfs` for them all:
    the job holds a file of that filesystem open until it ends (its device number then
    cannot name another filesystem), and closes it then."""
    import os
    import tempfile
    from pathlib import Path

    from kvtier.backends import file_io

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    asked = []
    real = file_io._fs_type
    monkeypatch.setattr(file_io, "_fs_type", lambda fd: asked.append(fd) or real(fd))
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        files = _framed_files(Path(d), [4096] * 5)
        bufs = [bytearray(4096) for _ in files]
        open_before = len(os.listdir("/proc/self/fd"))
        got = file_io.read_pages_into(
            [(path, ns, h, memoryview(b)) for (path, ns, h, _), b in zip(files, bufs)]
        )
        assert got == [True] * 5
        assert [bytes(b) for b in bufs] == [p for *_, p in files]
        assert len(asked) == 1, "asked once for the job's device"
        assert len(os.listdir("/proc/self/fd")) == open_before, "the held file closed"
        file_io.read_pages_into(
            [(files[0][0], files[0][1], files[0][2], memoryview(bufs[0]))]
        )
        assert len(asked) == 2, "asked again by the next job"


@pytest.mark.parametrize("encrypt", [False, True])
def test_sealed_pages_in_memory_are_read_straight_in_and_checked_every_time(
    encrypt, tmp_path, monkeypatch
):
    """A sealed page in memory is read straight into the caller's buffer and checked there
    (an authenticated one as written: its header compared whole, in few Python steps), on
    its first read and on every read after (its key object kept): any byte of the header,
    the tag or the body changed, the file cut or grown, a key the ring no longer holds, each
    is that page's miss alone, and the others still read. Under the call's stop flag: a
    call given up on before the read writes no byte."""
    import os
    import threading

    from kvtier.backends import file_io
    from kvtier.backends.frame import FrameError
    from kvtier.backends.io_threads import StopFlag
    from kvtier.backends.seal import ForeignKey, SealedCodec
    from kvtier.tenant_keys import parse_keys

    monkeypatch.setattr(file_io, "_in_memory", lambda fd, device: True)
    old, new = parse_keys("a1" * 32, "t").current, parse_keys("b2" * 32, "t").current
    codec = SealedCodec(parse_keys(f"{'b2' * 32},{'a1' * 32}", "t"), encrypt)
    writers = [SealedCodec(parse_keys(k * 32, "t"), encrypt) for k in ("b2", "a1")]
    assert [w.keys.current.key_id for w in writers] == [new.key_id, old.key_id]
    ns, pages = "ab" * 16, []
    for i in range(4):
        h, payload = bytes([i]) * 32, os.urandom(4096)
        header, body = writers[i % 2].seal(ns, h, payload)  # pages 1 and 3: old key
        path = tmp_path / f"page-{i}"
        path.write_bytes(bytes(header) + bytes(body))
        pages.append((str(path), h, payload, bytes(header) + bytes(body)))

    def read_all(stop=None) -> tuple[list, list[bytearray]]:
        bufs = [bytearray(4096) for _ in pages]
        items = [(p, ns, h, memoryview(b)) for (p, h, _, _), b in zip(pages, bufs)]
        return file_io.read_sealed_into(codec, items, stop), bufs

    for _ in range(2):  # the first read derives each page's key, the second reuses it
        got, bufs = read_all()
        assert got == [True] * 4 and [bytes(b) for b in bufs] == [p[2] for p in pages]
    frame = pages[0][3]
    changes = [frame[:-1], frame + b"\0"]
    for at in (8, 30, 60, 70, 80, 90, 110, 127, 128, len(frame) - 1):
        bad = bytearray(frame)
        bad[at] ^= 0x40
        changes.append(bytes(bad))
    for bad in changes:
        with open(pages[0][0], "wb") as f:
            f.write(bad)
        got, bufs = read_all()
        assert isinstance(got[0], FrameError), got[0]
        assert got[1:] == [True] * 3
        assert [bytes(b) for b in bufs[1:]] == [p[2] for p in pages[1:]]
    with open(pages[0][0], "wb") as f:
        f.write(frame)
    assert read_all()[0] == [True] * 4
    del codec.keys.by_id[old.key_id]  # the ring drops the old key
    got, _ = read_all()
    assert got[0] is True and got[2] is True
    assert isinstance(got[1], ForeignKey) and isinstance(got[3], ForeignKey)
    codec.keys.by_id[old.key_id] = old

    stop, real_fstat = StopFlag(), os.fstat

    def give_up_before_the_read(fd):
        threading.Event.set(stop)  # the call gives up once the file is open
        return real_fstat(fd)

    monkeypatch.setattr(os, "fstat", give_up_before_the_read)
    got, bufs = read_all(stop)
    assert isinstance(got[0], OSError) and "given up on" in str(got[0])
    assert bufs[0] == bytes(4096)
