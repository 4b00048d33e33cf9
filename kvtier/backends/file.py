"""`file`: pages as files under a root directory.

Layout: `<root>/<prefix>/<namespace id>/<hash[0:2]>/<hash[2:4]>/<hash>`. A page is written
to a temp file in its final directory, optionally fsynced, then renamed: a crash or a
concurrent reader never sees half a page, and a failed write is never visible.
Capacity is enforced in bytes (LRU by access order; on reopen, by modification time).
Reopening rebuilds the index from the directory without reading payloads.

A batch is split into `max_concurrency` groups; each group is one job on a bounded thread
pool that does open/read/verify (or open/write/rename) for its pages in one go. An
async-file library hops to a thread once per call (open, read, read, close...), which
measured 5x slower than raw `readinto` for 1 MiB pages; one hop per page was still 0.6x.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import stat
import itertools
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvtier.backends import frame
from kvtier.backends.base import IntoResult, Store, StoredPage
from kvtier.backends.frame import FrameError
from kvtier.errors import StoreError, StoreUnavailable
from kvtier.hashing import split_key, validate_key
from kvtier.tiers.indices import check_positive, io_threads

_TMP = ".tmp-"


def default_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvtier")


@dataclass(slots=True, frozen=True)
class FileStoreConfig:
    root: str = ""  # empty: $XDG_CACHE_HOME/kvtier or ~/.cache/kvtier
    capacity_bytes: int = 16 << 30
    fsync: bool = False
    max_concurrency: int = field(default_factory=io_threads)  # up to 4, half the cores at most

    def __post_init__(self) -> None:
        check_positive(self, "capacity_bytes", "max_concurrency", integer=True)


class FileStore(Store):
    config_class = FileStoreConfig
    name = "file"

    def __init__(self, config: FileStoreConfig = FileStoreConfig(), timeout_s: float = 30.0) -> None:
        super().__init__(timeout_s)
        self.config = config
        self.root = Path(os.path.expanduser(config.root or default_root())).resolve()
        self._root_str = str(self.root)
        try:
            _claim_root(self.root)
        except OSError as exc:
            raise StoreUnavailable(f"file store root={str(self.root)!r}: {exc}") from exc
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, LRU first
        self.used_bytes = 0  # this process's index; the root's total is shared (see _shared)
        self._pool = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix="kvtier-file")
        with self._shared() as usage:
            self._rebuild_index()
            usage[0] = self.used_bytes
            usage.append("write")

    @contextlib.contextmanager
    def _shared(self):
        """The bytes under the root, shared by every process using it: read and written
        under an exclusive lock of `.kvtier-lock`. Yields `[bytes]` to update; a lost usage
        file is recounted from the directory (then the caller's new pages are in it)."""
        with open(self.root / LOCK, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                path = self.root / USAGE
                try:
                    usage = [int(path.read_text() or 0)]
                except (OSError, ValueError):
                    usage = [_bytes_under(self.root), "recounted"]
                before = usage[0]
                yield usage
                if usage[0] != before or len(usage) > 1:
                    _write_small(path, str(max(0, usage[0])).encode())
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _file(self, key: str) -> str:
        """`path(key)` as a string (the hot paths: no Path objects per page)."""
        prefix, ns, h = split_key(key)
        hx = h.hex()
        return os.path.join(self._root_str, prefix, ns, hx[:2], hx[2:4], hx)

    def path(self, key: str) -> Path:
        prefix, ns, h = split_key(key)
        hx = h.hex()
        return self.root.joinpath(*prefix.split("/"), ns, hx[:2], hx[2:4], hx)

    def _rebuild_index(self) -> None:
        """Index every page under the root by age (a page of another process too: this
        one may evict it to hold the shared capacity). A temp file whose writer is gone is
        removed; another live process's write in flight is left alone."""
        found = []
        self._sizes.clear()
        self.used_bytes = 0
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                full = os.path.join(dirpath, name)
                if name.startswith(_TMP):
                    if _stale_temp(full, name):
                        _unlink_quietly(Path(full))
                    continue
                key = _page_key(self.root, full)
                if key is None:
                    continue  # not ours
                st = os.stat(full)
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self.used_bytes += size

    async def _exists(self, keys):
        await self._adopt(keys, leading=True)
        return [k in self._sizes for k in keys]

    async def _adopt(self, keys, leading: bool = False) -> None:
        """Index pages another process wrote under the root after this one indexed it (TP
        ranks sharing MLA pages, replicas on one volume): stat the keys this index lacks
        (with `leading`, only up to the first one absent: callers want the leading run)."""
        unknown = [k for k in keys if k not in self._sizes]
        if not unknown:
            return
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self._pool, _sizes_of, [self._file(k) for k in unknown], leading)
        sizes = (await self._in_threads([job]))[0]
        for key, size in zip(unknown, sizes):
            if size is not None and key not in self._sizes:
                self._sizes[key] = size
                self.used_bytes += size

    async def _batch(self, fn, items: list[tuple]) -> list:
        """`fn(*item)` for every item, in `max_concurrency` thread jobs; results in order."""
        groups = min(self.config.max_concurrency, len(items))
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(self._pool, _run_all, fn, items[g::groups]) for g in range(groups)]
        done = await self._in_threads(jobs)
        out: list = [None] * len(items)
        for g, results in enumerate(done):
            out[g::groups] = results
        return out

    async def _get(self, keys):
        await self._adopt(keys)
        known = [k for k in keys if k in self._sizes]
        blobs = dict(zip(known, await self._batch(_read_file, [(self._file(k),) for k in known])))
        return [self._after_read(k, blobs.get(k)) for k in keys]

    async def _get_into(self, keys, parsed, views):
        await self._adopt(keys)
        items = [(k, ns, h, v) for k, (_, ns, h), v in zip(keys, parsed, views) if k in self._sizes]
        got = await self._batch(_read_page_into, [(self._file(k), ns, h, v) for k, ns, h, v in items])
        results = dict(zip([it[0] for it in items], got))
        return [self._after_read(k, results.get(k)) for k in keys]

    def _after_read(self, key: str, result):
        """A page that cannot be read is a miss and leaves the index (it would fail again)."""
        if isinstance(result, FileNotFoundError):  # deleted behind our back: forget it
            self._forget(key)
            return None
        if isinstance(result, OSError):
            self._forget(key)
            self.counters.errors += 1
            self.complain("error", f"reading {key}: {result}; dropped from the index, a miss")
            return None
        if result is not None and not isinstance(result, FrameError):
            self._touch(key)
        return result

    async def _set(self, keys, frames):
        """Pages that were written are indexed; one that failed is reported not stored (and
        counted); when none could be written the batch fails as a store error."""
        fits = [f.size <= self.config.capacity_bytes for f in frames]
        items = [(self._file(k), f, self.config.fsync) for k, f, ok in zip(keys, frames, fits) if ok]
        results = dict(zip([k for k, ok in zip(keys, fits) if ok], await self._batch(_write_atomically, items)))
        failed = {k: e for k, e in results.items() if isinstance(e, OSError)}
        if failed and len(failed) == len(keys):
            k, err = next(iter(failed.items()))
            raise StoreError(f"file.batch_set: writing {k}: {err}") from err
        for k, err in failed.items():
            self.counters.errors += 1
            self.complain("error", f"writing {k}: {err}")
        ok, added = [], 0
        for key, f, fit in zip(keys, frames, fits):  # index in batch order
            stored = fit and key not in failed
            if stored:
                self._forget(key)
                self._sizes[key] = f.size
                self.used_bytes += f.size
                added += f.size - results[key]  # a replaced page's bytes go
            ok.append(stored)
        await self._enforce_capacity(added)
        return ok

    async def _enforce_capacity(self, added: int = 0) -> None:
        """Hold `capacity_bytes` for the whole root, whichever processes wrote it: evict
        this process's least recently used pages; if none are left, re-read the root and
        evict the oldest of anyone's."""
        with self._shared() as usage:
            if len(usage) == 1:
                usage[0] += added
            rescanned = False
            while usage[0] > self.config.capacity_bytes:
                if not self._sizes:
                    if rescanned:
                        break
                    self._rebuild_index()
                    usage[0], rescanned = self.used_bytes, True
                    continue
                victim = next(iter(self._sizes))
                self._forget(victim)
                self.counters.evictions += 1
                [removed] = await self._batch(_unlink_quietly, [(self.path(victim),)])
                usage[0] -= removed if isinstance(removed, int) else 0

    async def _delete(self, keys):
        present = [k for k in keys if k in self._sizes]
        for k in present:
            self._forget(k)
        removed = await self._batch(_unlink_quietly, [(self.path(k),) for k in present])
        with self._shared() as usage:
            usage[0] -= sum(r for r in removed if isinstance(r, int))
        return len(present)

    async def _close(self) -> None:
        self._pool.shutdown(wait=True)

    def _touch(self, key: str) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def _forget(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size

    async def _scan(self, batch):
        keys = list(self._sizes)
        for start in range(0, len(keys), batch):
            chunk = keys[start:start + batch]
            mtimes = await self._batch(_mtime, [(self.path(k),) for k in chunk])
            yield [StoredPage(k, self._sizes.get(k, 0), None if isinstance(m, OSError) else m)
                   for k, m in zip(chunk, mtimes)]

    def _meta_path(self, name: str) -> Path:
        return self.root.joinpath(*name.split("/"))

    async def _put_meta(self, name, data):
        [err] = await self._batch(_write_atomically, [(self._meta_path(name), bytes(data), self.config.fsync)])
        if isinstance(err, OSError):
            raise StoreError(f"file: writing {name}: {err}") from err

    async def _get_meta(self, name):
        [got] = await self._batch(_read_file, [(self._meta_path(name),)])
        return None if isinstance(got, OSError) else got

    def _extra_stats(self):
        return {"pages": len(self._sizes), "used_bytes": self.used_bytes,
                "capacity_bytes": self.config.capacity_bytes, "root": str(self.root)}


def _unlink_quietly(path: Path) -> int:
    """Bytes this call removed (0 if the file was gone already)."""
    try:
        size = os.stat(path).st_size
        os.unlink(path)
        return size
    except FileNotFoundError:
        return 0


MARKER, LOCK, USAGE = ".kvtier-store", ".kvtier-lock", ".kvtier-usage"
_OWNER = f"{socket.gethostname()}.{os.getpid()}."
_RUN = uuid.uuid4().hex[:12] + "-"
_TEMP_IDS = itertools.count()  # with a per-process random part: temp names never collide
STALE_TEMP_S = 3600.0


def _bytes_under(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            if not name.startswith((_TMP, ".kvtier")):
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def _claim_root(root: Path) -> None:
    """Use `root` only if it is a kvtier store (its marker) or new/empty: never clean up a
    directory that is somebody else's."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    marker = root / MARKER
    if marker.exists():
        return
    for dirpath, _, files in os.walk(root):  # a store from before markers is adopted
        for name in files:
            if not (name.startswith((_TMP, ".kvtier")) or _page_key(root, os.path.join(dirpath, name))):
                raise OSError(f"not a kvtier store: it holds other files ({name}) and no {MARKER} marker; "
                              f"name an empty directory (or create {marker} if it is one)")
    _write_small(marker, b'{"format": 1}\n')


def _page_key(root: Path, full: str) -> str | None:
    """The key of a page file under `root`, or None if the path is not one of ours."""
    parts = os.path.relpath(full, root).replace(os.sep, "/").split("/")
    if len(parts) < 5:
        return None
    key = "/".join(parts[:-3] + [parts[-1]])  # drop the fan-out directories
    try:
        return validate_key(key)
    except ValueError:
        return None


def _stale_temp(full: str, name: str) -> bool:
    """A temp file of a dead writer on this host, or one untouched for an hour."""
    owner = name[len(_TMP):]
    host, _, rest = owner.partition(".")
    pid = rest.partition(".")[0]
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            return True
    try:
        return time.time() - os.stat(full).st_mtime > STALE_TEMP_S
    except FileNotFoundError:
        return False


def _write_small(path: Path, data: bytes) -> None:
    tmp = _temp_name(str(path))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _run_all(fn, items: list[tuple]) -> list:
    """One thread job: `fn` over items; an OSError is returned in its place, not raised."""
    out = []
    for item in items:
        try:
            out.append(fn(*item))
        except OSError as exc:
            out.append(exc)
    return out


def _sizes_of(paths: list[Path], leading: bool) -> list[int | None]:
    """Each page file's size, None where there is none (with `leading`: None from the first
    absent on)."""
    out: list[int | None] = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
        except OSError:
            out.append(None)
        if out[-1] is None and leading:
            return out + [None] * (len(paths) - len(out))
    return out


def _mtime(path: Path) -> float:
    return os.stat(path).st_mtime


def _read_file(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


_HASH_CHUNK = 1 << 20  # pages bigger than this are read and written in chunks hashed in cache


def _read_page_into(path: str, ns: str, h: bytes, view: memoryview) -> IntoResult:
    """Header, payload (straight into the caller's buffer) and one byte more, then the
    checks: header, length (no byte more), checksum. On a FrameError the buffer may hold
    garbage, which the caller must not use (`batch_get_into`)."""
    header, extra = bytearray(frame.HEADER_SIZE), bytearray(1)
    fd = os.open(path, os.O_RDONLY)
    try:
        if len(view) <= _HASH_CHUNK:
            n, digest = _read_whole(fd, header, view, extra), None
        else:
            n, digest = _read_hashing(fd, header, view, extra)
    finally:
        os.close(fd)
    try:
        length, checksum = frame.check_header(header[:n], ns, h)
        if length != len(view):
            raise FrameError(f"page is {length} bytes, the buffer {len(view)}")
        if n != frame.HEADER_SIZE + length:
            raise FrameError("trailing bytes after the payload" if n > frame.HEADER_SIZE + length
                             else f"payload is {max(0, n - frame.HEADER_SIZE)} bytes, the frame says {length}")
        if (xxhash.xxh3_64_intdigest(view) if digest is None else digest) != checksum:
            raise FrameError("checksum mismatch")
    except FrameError as exc:
        return exc
    return True


def _read_whole(fd: int, header: bytearray, view: memoryview, extra: bytearray) -> int:
    """One readv of header, payload and a byte more (short reads go on); bytes read."""
    n = os.readv(fd, [header, view, extra])
    while frame.HEADER_SIZE <= n < frame.HEADER_SIZE + len(view):
        got = os.preadv(fd, [view[n - frame.HEADER_SIZE:], extra], n)
        if got == 0:
            break
        n += got
    return n


def _read_hashing(fd: int, header: bytearray, view: memoryview, extra: bytearray) -> tuple[int, int | None]:
    """A big page: the payload in chunks, each hashed while it is still in cache (hashing
    it after the read would fetch it all from memory again: 0.77x raw `readinto` for
    8 MiB pages, 0.95x this way); then a byte more. (bytes read, payload digest)."""
    n = os.readv(fd, [header, view[:_HASH_CHUNK]])
    if n < frame.HEADER_SIZE:
        return n, None
    hasher, got = xxhash.xxh3_64(), n - frame.HEADER_SIZE
    hasher.update(view[:got])
    while got < len(view):
        k = os.preadv(fd, [view[got:got + _HASH_CHUNK]], frame.HEADER_SIZE + got)
        if k == 0:
            break
        hasher.update(view[got:got + k])
        got += k
    if got == len(view):
        got += os.preadv(fd, [extra], frame.HEADER_SIZE + got)
    return frame.HEADER_SIZE + got, hasher.intdigest()


def _temp_name(final: str) -> str:
    return os.path.join(os.path.dirname(final), f"{_TMP}{_OWNER}{_RUN}{next(_TEMP_IDS)}")


def _write_atomically(final: str, data, fsync: bool) -> int:
    """Write `data` (a page's Frame, or plain bytes) to an owner-named temp file (mode
    0600), then rename it over `final`: readers see the whole file or none. Returns the
    bytes of the file it replaced (0 if new); raises OSError (collected by `_run_all`)."""
    tmp = _temp_name(str(final))
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:  # the page's fan-out directories do not exist yet
            os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if isinstance(data, frame.Frame):
                _write_page(fd, data)
            else:
                _write_all(fd, memoryview(data), 0)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            replaced = os.stat(final).st_size
        except FileNotFoundError:
            replaced = 0
        os.replace(tmp, final)
        return replaced
    except OSError:
        _unlink_quietly(tmp)
        raise


def _write_page(fd: int, page: frame.Frame) -> None:
    """Header (its checksum computed here, in the I/O thread) and payload in one writev; a
    big page in chunks, each hashed just before it is written (still in cache), then the
    header in front."""
    payload = page.payload
    if len(payload) > _HASH_CHUNK:
        hasher = xxhash.xxh3_64()
        for off in range(0, len(payload), _HASH_CHUNK):
            chunk = payload[off:off + _HASH_CHUNK]
            hasher.update(chunk)
            _write_all(fd, chunk, frame.HEADER_SIZE + off)
        _write_all(fd, memoryview(page.header_with(hasher.intdigest())), 0)
        return
    header = page.header
    n = os.writev(fd, [header, payload])
    if n < len(header) + len(payload):  # a short write: finish the rest
        rest = memoryview(header + payload)[n:] if n < len(header) else payload[n - len(header):]
        _write_all(fd, rest, n)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
