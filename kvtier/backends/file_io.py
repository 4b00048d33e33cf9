"""The file store's work in its I/O threads: whole pages per call, one file each.

Every function here runs on a store thread, never on the event loop or the scheduler. A
page is written to an owner-named temp file in its final directory, then renamed over the
final name (readers see all of it or none); it is read back header, payload and one byte
more, then checked (header, length, checksum) before the caller may use the buffer.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import sys
from functools import partial
import socket
import stat
import threading
import uuid
from pathlib import Path

import numpy as np
import xxhash

from kvtier.backends import frame, seal
from kvtier.backends.file_calls import rename_new
from kvtier.backends.file_dirs import Dir
from kvtier.backends.frame import FrameError

TMP = ".tmp-"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a write that found no room
_OWNER = f"{socket.gethostname()}.{os.getpid()}."
_RUN = uuid.uuid4().hex[:12] + "-"
_TEMP_IDS = (
    itertools.count()
)  # with a per-process random part: temp names never collide


def unlink_quietly(path: str | Path) -> int:
    """Bytes this call removed (0 if the file was gone already)."""
    try:
        size = os.stat(path).st_size
        os.unlink(path)
        return size
    except FileNotFoundError:
        return 0


def write_small(path: Path, data: bytes) -> None:
    tmp = _temp_name(str(path))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def run_all(fn, items: list[tuple], stop=None) -> list:
    """One thread job: `fn` over items; an OSError is returned in its place, not raised.
    Once `stop` is set (the job was abandoned) it touches no further item."""
    out = []
    for item in items:
        if stop is not None and stop.is_set():
            break
        try:
            out.append(fn(*item))
        except OSError as exc:
            out.append(exc.with_traceback(None))  # no frame (nor a row view) kept
    return out


def sizes_of(
    paths: list[str], leading: bool, stop=None, inside=None
) -> list[int | None]:
    """Each page file's size, None where there is none (with `leading`: None from the first
    absent on). `inside(dir)`: False where the directory leads out of the store (a symlink):
    its page counts as absent. Asked only of the paths looked at: past the first absent page
    of a leading run (a prompt's new pages) no directory is checked."""
    out: list[int | None] = []
    for path in paths:
        try:
            if inside is not None and not inside(_parent(path)):
                out.append(None)
            else:
                st = os.stat(path)
                out.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
        except OSError:
            out.append(None)
        if out[-1] is None and leading:
            return out + [None] * (len(paths) - len(out))
    return out


def mtime(path: str | Path) -> float:
    return os.stat(path).st_mtime


def read_file(path: Path, page: bool = False, limit: int = 1 << 20) -> bytes:
    """A small file (a manifest: at most `limit` bytes), or with `page` a page file: its
    header, then at most the body its header declares (plain or sealed) and a byte more (an
    oversized or sparse file, or a device, is never read whole), and only the header where
    it declares more than `limit` bytes after it (anyone who can write the store writes
    headers: the read is bounded by the store's own page limit, and the frame fails to
    decode). Not a regular file, or a symlink: an OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        if not page:
            return _read_upto(fd, limit + 1)
        header = _read_upto(fd, frame.HEADER_SIZE)
        rest = seal.frame_bound(header)
        if rest is None or rest > limit:
            return header  # decoding it fails with the reason
        return header + _read_upto(fd, rest + 1)
    finally:
        os.close(fd)


def _read_upto(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = os.read(fd, min(n - got, _READ_CHUNK))
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_sealed_into(codec, items: list[tuple], stop=None) -> list:
    """One thread job of `batch_get_into` for a store with a tenant key: each page of
    `items` (path, ns, h, view) read and authenticated (and decrypted) by `codec` in this
    thread's own buffer, then copied into its view (`_read_sealed_page`); True, or the
    FrameError or OSError in its place. Once `stop` is set (the job was given up on) it
    writes no further buffer of the caller's (`copy_out`)."""
    out: list = []
    # the job's own header and spare bytes: a job given up on keeps them (a read it
    # resumes lands there, never in another job's)
    spare = (bytearray(seal.HEADER_SIZE), bytearray(seal.TAG_SIZE + 1))
    with _MemoryDevices() as memory:
        for path, ns, h, view in items:
            if stop is not None and stop.is_set():
                break
            try:
                _read_sealed_page(codec, path, ns, h, view, stop, memory, spare)
                out.append(True)
            except (FrameError, OSError) as exc:
                out.append(exc.with_traceback(None))  # no frame (nor a row view) kept
    return out


# A page file is opened as no symlink (ELOOP: a miss), and without blocking on a FIFO or a
# device put where a page was: anything but a regular file is a miss (`_open_page`), as for
# `read_file` and `tierctl store verify`. A FIFO's open blocked until the call was given up
# on, and each one abandoned an I/O thread: a handful killed the store's pool for good.
_READ_PAGE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


def _open_page(path: str) -> tuple[int, int]:
    """The page file's descriptor and device (`_in_memory`)."""
    fd = os.open(path, _READ_PAGE)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file: not a page", path)
    return fd, st.st_dev


def _read_sealed_page(
    codec, path: str, ns: str, h: bytes, view: memoryview, stop, memory, spare
) -> None:
    """Header, body and a byte more in one readv into this thread's buffers, the page
    authenticated (an encrypted one decrypted) there (`SealedCodec.read_into`), then
    copied into the caller's `view` (`copy_out`); a file in memory (`_in_memory`) is
    read and checked in `view` itself, under the call's stop flag (`_writing`): neither
    the read nor the check can block. There an authenticated page is read into `view`
    and the job's `spare` (header, bytes more) and checked as written
    (`SealedCodec.check_as_written`) in few Python steps; a page that this does not
    settle is read again the long way, which names what is wrong."""
    fd, device = _open_page(path)
    try:
        if memory(fd, device):
            with _writing(stop):
                if not codec.encrypt:
                    header, more = spare
                    n = os.preadv(fd, (header, view, more), 0)
                    if n == seal.HEADER_SIZE + len(view) and codec.check_as_written(
                        header, ns, h, view
                    ):
                        return
                codec.read_into(partial(_read_frame, fd), ns, h, view, _scratch, spare)
            return
        staged = _staging(len(view))
        codec.read_into(partial(_read_frame, fd), ns, h, staged, _scratch, spare)
    finally:
        os.close(fd)
    copy_out(stop, view, staged)


def _read_frame(fd: int, bufs: list, want: int) -> int:
    """Fill `bufs` from the file's start, at least `want` bytes unless it ends first; bytes
    read. One preadv reads a whole frame (a page file in memory always, any other nearly
    always): the buffers are gone over again only when it came back short of `want`."""
    n = os.preadv(fd, bufs, 0)
    return n if n >= want else _preadv_all(fd, bufs, 0)


def _preadv_all(fd: int, bufs: list, offset: int) -> int:
    """Fill `bufs` from `offset` on until they are full or the file ends; bytes read."""
    views = [memoryview(b).cast("B") for b in bufs]
    total = 0
    while views:
        k = os.preadv(fd, views, offset + total)
        if k == 0:
            break
        total += k
        while views and k >= len(views[0]):
            k -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][k:]
    return total


_SCRATCH = threading.local()


def _scratch(n: int) -> memoryview:
    """A buffer of at least `n` bytes that this I/O thread keeps (its biggest page's),
    so an encrypted read does not fault in fresh memory every time."""
    return _kept("buf", n)


def _staging(n: int) -> memoryview:
    """This I/O thread's buffer of exactly `n` bytes where a page is read and checked
    before it is copied into the caller's (another than `_scratch`'s)."""
    return _kept("staging", n)[:n]


def _kept(name: str, n: int) -> memoryview:
    """A buffer of at least `n` bytes this thread keeps under `name`. A thread given up
    on (stuck) keeps its own: a read it resumes lands there, never in a buffer reused."""
    buf = getattr(_SCRATCH, name, None)
    if buf is None or len(buf) < n:
        buf = bytearray(n)
        setattr(_SCRATCH, name, buf)
    return memoryview(buf)


def copy_out(stop, dst: memoryview, src: memoryview) -> None:
    """Copy a checked page (or part) into the caller's buffer, unless its job was given
    up on (`_writing`). The copy never blocks (both are memory), and numpy lets the GIL
    go for a big one."""
    with _writing(stop):
        np.copyto(
            np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
        )


class _writing:
    """Around a write into the caller's buffer that cannot block: under `stop.writing`
    (io_threads.StopFlag), which `stop.set()` takes, and only while `stop` is not set, so
    once the call gave up no byte lands in the buffer, which its owner may reuse at once.
    OSError (ECANCELED) once it is set. (A class: a generator context costs microseconds
    a chunk.)"""

    __slots__ = ("lock",)

    def __init__(self, stop) -> None:
        self.lock = None if stop is None else stop.writing
        if self.lock is not None:
            self.lock.acquire()
            if stop.is_set():
                self.lock.release()
                raise OSError(
                    errno.ECANCELED,
                    "the read was given up on: the caller's buffer is not written",
                )

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.release()


_HASH_CHUNK = (
    1 << 20
)  # big pages are written in chunks of this many bytes, hashed in cache
_READ_CHUNK = 256 << 10  # pages are read in chunks of this many bytes, hashed in cache
# the largest page read whole under the stop flag (`_read_in_memory`): a call giving up
# (`StopFlag.set`, on the store's loop) waits for at most one such copy from memory
_WHOLE_READ = 64 << 20


def read_pages_into(items: list[tuple], stop=None) -> list:
    """One thread job of `batch_get_into`: every page of `items` (path, ns, h, view) read
    and checked into its view (`_read_page`); True, or the FrameError or OSError in its
    place. Once `stop` is set (the job was given up on) it writes no further buffer of
    the caller's (`copy_out`)."""
    out: list = []
    # the job's own header and spare byte: a job given up on keeps them (a read it
    # resumes lands there, never in another job's)
    spare = (bytearray(frame.HEADER_SIZE), bytearray(1))
    with _MemoryDevices() as memory:
        for path, ns, h, view in items:
            if stop is not None and stop.is_set():
                break
            try:
                out.append(_read_page(path, ns, h, view, stop, memory, spare))
            except (FrameError, OSError) as exc:
                out.append(exc.with_traceback(None))  # no frame (nor a row view) kept
    return out


def _read_page(
    path: str, ns: str, h: bytes, view: memoryview, stop, memory, spare
) -> bool:
    """A file in memory (`memory`: the job's `_MemoryDevices`) of up to `_WHOLE_READ`
    bytes is read whole, straight into `view` (`_read_in_memory`); any other in chunks
    through this thread's buffer, each hashed while it is in cache and copied in
    (`copy_out`), so a read that blocks (a hung mount) blocks into that buffer (the
    header read with the first chunk, a byte more with the last: none may follow), both
    into the job's `spare` (header, byte). FrameError where it is not the page asked for
    (`view` may then hold part of it, which the caller must not use)."""
    fd, device = _open_page(path)
    try:
        if len(view) <= _WHOLE_READ and memory(fd, device):
            return _read_in_memory(fd, ns, h, view, stop, spare)
        return _read_chunks(fd, ns, h, view, stop, spare)
    finally:
        os.close(fd)


def _read_in_memory(fd: int, ns: str, h: bytes, view: memoryview, stop, spare) -> bool:
    """Header, payload and a byte more in one preadv into `view` (the header and byte into
    the job's `spare`) under the call's stop flag (`_writing`: a read from memory cannot
    block), then checked there. Per page, not per chunk: what a page costs in Python is
    what 256 KiB rows are slow by."""
    header, extra = spare
    size, whole = len(view), frame.HEADER_SIZE + len(view)
    bufs = (header, view, extra)
    with _writing(stop):
        n = os.preadv(fd, bufs, 0)
        if n < whole:  # a short read before the end, or a short file
            n = _preadv_all(fd, bufs, 0)
    length, checksum = frame.check_header(
        header if n >= frame.HEADER_SIZE else header[:n], ns, h
    )
    if length != size:
        raise FrameError(f"page is {length} bytes, the buffer {size}")
    if n > whole:
        raise FrameError("trailing bytes after the payload")
    if n < whole:
        raise FrameError(
            f"payload is {max(0, n - frame.HEADER_SIZE)} bytes, the frame says {length}"
        )
    hasher = (
        xxhash.xxh3_64()
    )  # the streaming hasher lets the GIL go, the one-shot does not
    hasher.update(view)
    if hasher.intdigest() != checksum:
        raise FrameError("checksum mismatch")
    return True


def _read_chunks(fd: int, ns: str, h: bytes, view: memoryview, stop, spare) -> bool:
    """`_read_page` of a file not in memory: chunks through this thread's buffer."""
    size, (header, extra) = len(view), spare
    buf = _staging(min(_READ_CHUNK, size))
    hasher, done, at = xxhash.xxh3_64(), 0, 0
    while True:
        k = min(_READ_CHUNK, size - done)
        into = buf[:k]
        last = done + k == size
        bufs = ([header] if done == 0 else []) + [into] + ([extra] if last else [])
        n = _preadv_all(fd, bufs, at)
        at += n
        if done == 0:
            length, checksum = frame.check_header(
                header if n >= frame.HEADER_SIZE else header[:n], ns, h
            )
            if length != size:
                raise FrameError(f"page is {length} bytes, the buffer {size}")
            n -= frame.HEADER_SIZE
        got = min(n, k)
        if n > k:
            raise FrameError("trailing bytes after the payload")
        hasher.update(into[:got])
        copy_out(stop, view[done : done + got], into[:got])
        done += got
        if got < k or last:
            break
    if done != size:
        raise FrameError(f"payload is {done} bytes, the frame says {length}")
    if hasher.intdigest() != checksum:
        raise FrameError("checksum mismatch")
    return True


# Filesystems whose files are memory (tmpfs, ramfs): a read of one cannot block on a
# device or a server, so it may go straight into the caller's buffer.
_MEMORY_FILESYSTEMS = frozenset({0x01021994, 0x858458F6})


_NOT_IN_MEMORY: set[int] = set()  # devices whose filesystem was found not memory


class _MemoryDevices:
    """`_in_memory` for the pages of one thread job, asked once per device: a device
    found memory keeps a file of its own open (a duplicate descriptor) until the job
    ends. A filesystem's device number is freed only once nothing holds it, mounted or
    open (an unmounted tmpfs with a file still open lives on), so while the job holds
    that file the number names that filesystem, and the job's later pages on it need no
    `fstatfs` each (a few microseconds a page)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: dict[int, int] = {}  # device -> a descriptor of a file on it

    def __call__(self, fd: int, device: int) -> bool:
        if device in self.held:
            return True
        if not _in_memory(fd, device):
            return False
        self.held[device] = os.dup(fd)
        return True

    def __enter__(self) -> _MemoryDevices:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.held.values():
            os.close(fd)
        self.held.clear()


def _in_memory(fd: int, device: int) -> bool:
    """Whether the open file `fd` (on `device`) is on such a filesystem. Only a "no" is
    remembered by device number, which names a filesystem only while it is mounted: an
    NFS mount made after a tmpfs was unmounted may get its anonymous number, and a page
    there taken for memory would be read under the stop flag (a hung server would hang
    `StopFlag.set`). A "no" remembered wrongly costs a copy; a "yes" is asked of each
    file (fstatfs of a file in memory is cheap; on NFS it is a round trip, so not asked
    again)."""
    if device in _NOT_IN_MEMORY:
        return False
    if _fs_type(fd) in _MEMORY_FILESYSTEMS:
        return True
    if len(_NOT_IN_MEMORY) < 1024:
        _NOT_IN_MEMORY.add(device)
    return False


_LIBC: list = []  # the C library, once loaded


def _fs_type(fd: int) -> int | None:
    """`fstatfs(fd).f_type` (Linux), or None where it cannot be asked."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not _LIBC:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        libc = _LIBC[0]
        out = ctypes.create_string_buffer(256)  # struct statfs; f_type (a long) first
        if libc.fstatfs(fd, out) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return ctypes.c_long.from_buffer(out).value


def _parent(path: str) -> str:
    """`os.path.dirname` of a path without its Python-level normalising (a few us a page
    on the I/O thread): "/" for "/x", "" for "x"."""
    head, sep, _ = path.rpartition("/")
    return head or sep


def _temp_name(final: str) -> str:
    parent, name = _parent(final), f"{TMP}{_OWNER}{_RUN}{next(_TEMP_IDS)}"
    return f"{parent}/{name}" if parent not in ("", "/") else os.path.join(parent, name)


def write_pages(items: list[tuple], stop=None) -> list:
    """`write_atomically` over `items` as one thread job (`run_all`), each write told the
    job's `stop`."""
    return run_all(partial(write_atomically, stop=stop), items, stop)


def write_atomically(final: str, data, fsync: bool, inside=None, stop=None) -> int:
    """Write `data` (a page's Frame, or plain bytes) to an owner-named temp file (mode
    0600), then rename it over `final`: readers see the whole file or none. Returns the
    bytes of the file it replaced (0 if new); raises OSError (collected by `run_all`).
    `inside`: the store's `InsideRoot`; a directory it refuses (one leading out of the
    store: a symlink) is refused here.
    `stop` set (the job was abandoned, stuck, and its caller owns `data` again): nothing is
    read from `data` or renamed from then on. A write stuck in `open` on a hung mount would
    otherwise frame what the reused buffer holds when the mount returns, with a valid
    checksum, and publish it under this key."""
    final = str(final)  # a Path for the store's own metadata files
    parent = _parent(final)
    found = Dir.WHOLE if inside is None else inside.state(parent)
    if found is Dir.REFUSED:
        raise OSError(
            errno.EPERM,
            "a directory on the way is no real directory under the store root; refused",
            final,
        )
    tmp = _temp_name(final)
    try:
        if found is Dir.ABSENT:  # the page's fan-out directories, made before its file
            _make_dir(parent)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:  # not there yet (no `inside` asked), or removed since
            _make_dir(parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _check_not_abandoned(stop, final)
            if isinstance(data, frame.Frame):
                _write_page(fd, data)
            else:
                _write_all(fd, memoryview(data), 0)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        _check_not_abandoned(stop, final)  # its buffer may have changed while it wrote
        return _publish(tmp, final)
    except OSError:
        unlink_quietly(tmp)
        raise


def _publish(tmp: str, final: str) -> int:
    """Rename `tmp` over `final`; the bytes of the file it replaced. A new page's rename
    is one that fails where `final` exists (`rename_new`): it replaced nothing, with no
    stat asked first. Where a file is there (or that rename cannot be asked), its size is
    read just before it is replaced (another process writing the same key may replace
    it in between: a race the stat-then-rename had on every page, and a new page's
    rename no longer has)."""
    if rename_new(tmp, final):
        return 0
    try:
        replaced = os.stat(final).st_size
    except FileNotFoundError:
        replaced = 0
    os.replace(tmp, final)
    return replaced


def _make_dir(directory: str) -> None:
    """A page's directory (0700), and its parents where they are missing too."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:  # another thread or process made it first
        pass
    except FileNotFoundError:
        os.makedirs(directory, mode=0o700, exist_ok=True)


def _check_not_abandoned(stop, final: str) -> None:
    if stop is not None and stop.is_set():
        raise OSError(
            errno.ECANCELED,
            "the write was abandoned (stuck past its call's timeout): not published",
            final,
        )


def _write_page(fd: int, page: frame.Frame) -> None:
    """Header (its checksum computed here, in the I/O thread) and payload in one writev; a
    big page in chunks, each hashed just before it is written (still in cache), then the
    header in front."""
    payload = page.payload
    if len(payload) > _HASH_CHUNK and not page.codec.keyed:
        hasher = xxhash.xxh3_64()
        for off in range(0, len(payload), _HASH_CHUNK):
            chunk = payload[off : off + _HASH_CHUNK]
            hasher.update(chunk)
            _write_all(fd, chunk, frame.HEADER_SIZE + off)
        _write_all(fd, memoryview(page.header_with(hasher.intdigest())), 0)
        return
    if (
        not page.codec.keyed
    ):  # the streaming hasher lets the GIL go, the one-shot does not
        hasher = xxhash.xxh3_64()
        hasher.update(payload)
        header = page.header_with(hasher.intdigest())
    else:
        header, payload = page  # a sealed page's body is its ciphertext
    n = os.writev(fd, [header, payload])
    if n < len(header) + len(payload):  # a short write: finish the rest
        rest = (
            memoryview(header + payload)[n:]
            if n < len(header)
            else payload[n - len(header) :]
        )
        _write_all(fd, rest, n)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
