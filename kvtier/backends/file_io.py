"""The file store's work in its I/O threads: whole pages per call, one file each.

Every function here runs on a store thread, never on the event loop or the scheduler. A
page is written to an owner-named temp file in its final directory, then renamed over the
final name (readers see all of it or none); it is read back header, payload and one byte
more, then checked (header, length, checksum) before the caller may use the buffer.
"""

from __future__ import annotations

import errno
import itertools
import os
from functools import partial
import queue
import socket
import stat
import threading
import uuid
from pathlib import Path

import xxhash

from kvtier.backends import frame, seal
from kvtier.backends.frame import FrameError

TMP = ".tmp-"
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
            out.append(exc)
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
    `items` (path, ns, h, view) read and authenticated (and decrypted) by `codec` into its
    view (`_read_sealed_page`); True, or the FrameError or OSError in its place. Once
    `stop` is set (the job was abandoned) it reads into no further buffer."""
    out: list = []
    for path, ns, h, view in items:
        if stop is not None and stop.is_set():
            break
        try:
            _read_sealed_page(codec, path, ns, h, view)
            out.append(True)
        except (FrameError, OSError) as exc:
            out.append(exc)
    return out


# A page file is opened as no symlink (ELOOP: a miss), and without blocking on a FIFO or a
# device put where a page was: anything but a regular file is a miss (`_open_page`), as for
# `read_file` and `tierctl store verify`. A FIFO's open blocked until the call was given up
# on, and each one abandoned an I/O thread: a handful killed the store's pool for good.
_READ_PAGE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


def _open_page(path: str) -> int:
    fd = os.open(path, _READ_PAGE)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file: not a page", path)
    return fd


def _read_sealed_page(codec, path: str, ns: str, h: bytes, view: memoryview) -> None:
    """Header, body and a byte more in one readv: an authenticated page straight into the
    caller's buffer, an encrypted one into this thread's scratch buffer, decrypted from
    there (`SealedCodec.read_into`)."""
    fd = _open_page(path)
    try:
        codec.read_into(lambda bufs: _preadv_all(fd, bufs, 0), ns, h, view, _scratch)
    finally:
        os.close(fd)


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
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < n:
        buf = _SCRATCH.buf = bytearray(n)
    return memoryview(buf)


_HASH_CHUNK = (
    1 << 20
)  # big pages are written in chunks of this many bytes, hashed in cache
_READ_CHUNK = 2 << 20  # and read in chunks of this many, hashed on a hashing thread
_HASH_AWAY = 1 << 20  # pages this big are checked on a hashing thread as they are read


def read_pages_into(hashers, items: list[tuple], stop=None) -> list:
    """One thread job of `batch_get_into`: every page of `items` (path, ns, h, view) read
    into its view and checked (`_read_page`); True, or the FrameError or OSError in its
    place. Pages of `_HASH_AWAY` bytes or more are read in chunks that a thread of
    `hashers` hashes as they arrive (`_Hashing`), while this one reads on: the checksum
    pass costs a fifth of the read done here, next to nothing that way. The job returns
    only after its hashing ended: no hashing thread reads the caller's buffers after the
    call. Once `stop` is set (the job was abandoned) it reads into no further buffer."""
    out: list = []
    hashing = None
    try:
        for path, ns, h, view in items:
            if stop is not None and stop.is_set():
                break
            streamed = hashers is not None and len(view) >= _HASH_AWAY
            if streamed and hashing is None:
                hashing = _Hashing(hashers)
            try:
                checksum = _read_page(path, ns, h, view, hashing if streamed else None)
            except OSError as exc:
                checksum = exc
            finally:
                if streamed:
                    hashing.end_page()
            if isinstance(checksum, (FrameError, OSError)):
                out.append(checksum)
            elif streamed:
                out.append((checksum, hashing.pages - 1))
            else:
                out.append(_checked(checksum, xxhash.xxh3_64_intdigest(view)))
    finally:
        digests = hashing.close() if hashing is not None else []
    return [_checked(r[0], digests[r[1]]) if isinstance(r, tuple) else r for r in out]


_END_PAGE = object()


class _Hashing:
    """The xxh3-64 of each page of one reading job, made on a thread of `hashers` from the
    chunks `update` is given, in order; `end_page()` ends a page, `close()` waits for
    the digests (one per page). One hashing task per job, never more: it waits only on
    its own job, so a pool of hashers as big as the I/O pool cannot deadlock. The
    streaming hasher lets go of the GIL while it hashes (the one-shot
    `xxh3_64_intdigest` does not)."""

    def __init__(self, hashers) -> None:
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self.pages = 0
        self._digests = hashers.submit(self._run)

    def update(self, chunk: memoryview) -> None:
        self._chunks.put(chunk)

    def end_page(self) -> None:
        self._chunks.put(_END_PAGE)
        self.pages += 1

    def close(self) -> list[int]:
        self._chunks.put(None)
        return self._digests.result()

    def _run(self) -> list[int]:
        digests, hasher = [], xxhash.xxh3_64()
        while (chunk := self._chunks.get()) is not None:
            if chunk is _END_PAGE:
                digests.append(hasher.intdigest())
                hasher.reset()
            else:
                hasher.update(chunk)
        return digests


def _checked(want: int, got: int):
    return True if got == want else FrameError("checksum mismatch")


def _read_page(
    path: str, ns: str, h: bytes, view: memoryview, hasher=None
) -> int | FrameError:
    """Header, payload (straight into the caller's buffer) and one byte more; then the
    header and the length (no byte more) are checked. With a `hasher`, the payload is read
    in chunks, each given to it as soon as it is in the buffer. The checksum the payload
    must have, or why it is not the page asked for (the buffer may then hold garbage,
    which the caller must not use: `batch_get_into`)."""
    header, extra = bytearray(frame.HEADER_SIZE), bytearray(1)
    fd = _open_page(path)
    try:
        n = (
            _read_whole(fd, header, view, extra)
            if hasher is None
            else _read_chunks(fd, header, view, extra, hasher)
        )
    finally:
        os.close(fd)
    try:
        length, checksum = frame.check_header(header[:n], ns, h)
        if length != len(view):
            raise FrameError(f"page is {length} bytes, the buffer {len(view)}")
        if n != frame.HEADER_SIZE + length:
            raise FrameError(
                "trailing bytes after the payload"
                if n > frame.HEADER_SIZE + length
                else f"payload is {max(0, n - frame.HEADER_SIZE)} bytes, the frame says {length}"
            )
    except FrameError as exc:
        return exc
    return checksum


def _read_whole(fd: int, header: bytearray, view: memoryview, extra: bytearray) -> int:
    """One readv of header, payload and a byte more (short reads go on); bytes read."""
    n = os.readv(fd, [header, view, extra])
    while frame.HEADER_SIZE <= n < frame.HEADER_SIZE + len(view):
        got = os.preadv(fd, [view[n - frame.HEADER_SIZE :], extra], n)
        if got == 0:
            break
        n += got
    return n


def _read_chunks(
    fd: int, header: bytearray, view: memoryview, extra: bytearray, hasher
) -> int:
    """The header, then the payload in chunks (each given to `hasher`), then a byte more;
    bytes read. A page of one chunk is read whole (one readv, as `_read_whole`)."""
    if len(view) <= _READ_CHUNK:
        n = _read_whole(fd, header, view, extra)
        hasher.update(
            view
        )  # a short read fails the length check: its digest goes unused
        return n
    n = os.readv(fd, [header, view[:_READ_CHUNK]])
    if n < frame.HEADER_SIZE:
        return n
    got = n - frame.HEADER_SIZE
    hasher.update(view[:got])
    while got < len(view):
        k = os.preadv(fd, [view[got : got + _READ_CHUNK]], frame.HEADER_SIZE + got)
        if k == 0:
            break
        hasher.update(view[got : got + k])
        got += k
    if got == len(view):
        got += os.preadv(fd, [extra], frame.HEADER_SIZE + got)
    return frame.HEADER_SIZE + got


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
    `inside(dir)`: False where the directory leads out of the store (a symlink): refused.
    `stop` set (the job was abandoned, stuck, and its caller owns `data` again): nothing is
    read from `data` or renamed from then on. A write stuck in `open` on a hung mount would
    otherwise frame what the reused buffer holds when the mount returns, with a valid
    checksum, and publish it under this key."""
    final = str(final)  # a Path for the store's own metadata files
    if inside is not None and not inside(_parent(final)):
        raise OSError(
            errno.EPERM,
            "a directory on the way is no real directory under the store root; refused",
            final,
        )
    tmp = _temp_name(final)
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:  # the page's fan-out directories do not exist yet
            os.makedirs(_parent(final), mode=0o700, exist_ok=True)
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
        try:
            replaced = os.stat(final).st_size
        except FileNotFoundError:
            replaced = 0
        os.replace(tmp, final)
        return replaced
    except OSError:
        unlink_quietly(tmp)
        raise


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
