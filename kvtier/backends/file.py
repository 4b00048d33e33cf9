"""`file`: pages as files under a root directory.

Layout: `<root>/<prefix>/<namespace id>/<hash[0:2]>/<hash[2:4]>/<hash>`. A page is written
to a temp file in its final directory, optionally fsynced, then renamed: a crash or a
concurrent reader never sees half a page, and a failed write is never visible.
Capacity is enforced in bytes (LRU by access order; on reopen, by modification time),
leased pages last and by priority (`Store.hint`, file_leases.py).
Reopening rebuilds the index from the directory without reading payloads.

A batch is split into `max_concurrency` groups; each group is one job on a bounded thread
pool that does open/read/verify (or open/write/rename) for its pages in one go. An
async-file library hops to a thread once per call (open, read, read, close...), which
measured 5x slower than raw `readinto` for 1 MiB pages; one hop per page was still 0.6x.
What those thread jobs do to one page is in `file_io.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from kvtier.backends import seal
from kvtier.backends.base import Store, StoredPage
from kvtier.backends.frame import HEADER_SIZE, FrameError
from kvtier.backends.file_dirs import InsideRoot
from kvtier.backends.file_direct import DirectCalls, PageLocations
from kvtier.backends.file_leases import SharedLeases, eviction_order
from kvtier.backends.leases import Leases
from kvtier.backends.file_io import (
    DISK_FULL,
    TMP,
    mtime,
    read_file,
    read_pages_into,
    read_sealed_into,
    run_all,
    sizes_of,
    unlink_quietly,
    write_pages,
    write_small,
)
from kvtier.backends.io_threads import IoThreads, StopFlag, settle_jobs
from kvtier.errors import StoreError, StoreUnavailable
from kvtier.hashing import split_key, validate_key
from kvtier.validate import check_positive, io_threads


def default_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(base, "kvtier")


@dataclass(slots=True, frozen=True)
class FileStoreConfig:
    root: str = ""  # empty: $XDG_CACHE_HOME/kvtier or ~/.cache/kvtier
    capacity_bytes: int = 16 << 30
    fsync: bool = False
    max_concurrency: int = field(
        default_factory=io_threads
    )  # up to 4, half the cores at most
    max_page_bytes: int = (
        1 << 30
    )  # a larger page file is not a page: the first to evict

    def __post_init__(self) -> None:
        check_positive(
            self, "capacity_bytes", "max_concurrency", "max_page_bytes", integer=True
        )


class FileStore(DirectCalls, Store):
    config_class = FileStoreConfig
    name = "file"
    reads_end_with_call = True  # file_io.copy_out: an abandoned read writes no buffer
    direct_io = True  # begin_get_into / begin_set from any thread (file_direct.py)
    announces_sets = True  # as they are indexed, before an eviction may take them

    def __init__(
        self,
        config: FileStoreConfig = FileStoreConfig(),
        timeout_s: float = 30.0,
        clock=None,
    ) -> None:
        super().__init__(timeout_s, clock)
        self.config = config
        self.root = Path(os.path.expanduser(config.root or default_root())).resolve()
        self._root_str = str(self.root)
        self._sizes: OrderedDict[str, int] = (
            OrderedDict()
        )  # key -> file bytes, LRU first
        self.used_bytes = (
            0  # this process's index; the root's total is shared (see _shared)
        )
        self.disk_full_evictions = (
            0  # pages evicted because the disk filled before the capacity
        )
        self._hung: set[str] = set()  # keys of calls abandoned stuck: never asked again
        self._calls_in_flight = (
            0  # calls whose thread jobs run (`_jobs` shares the pool)
        )
        self._pages_calls = 0  # page reads and writes begun and not ended (`_jobs`)
        self._inside = InsideRoot(
            self._root_str, self.complain
        )  # page directories checked to stay under it
        self._marker = str(self.root / MARKER)
        self._leases = Leases(self.clock)  # the root's, shared through its file
        self._shared_leases = SharedLeases(self.root, self._leases, self._lease_failed)
        self.leases_broken = 0  # leased pages evicted: leased ones alone over capacity
        self.writes_refused = 0  # pages a write evicted in its own call (no room)
        try:
            _claim_root(self.root)
            with self._shared() as usage:
                self._rebuild_index()
                usage[0] = self.used_bytes
                usage.append("write")
        except OSError as exc:
            raise StoreUnavailable(
                f"file store root={str(self.root)!r}: {exc.strerror or exc}"
                f"{'' if exc.strerror is None else f' ({exc.filename})'}"
            ) from None
        # daemon threads: a call stuck in the kernel (a hung mount) is abandoned, not waited on
        self._pool = IoThreads(config.max_concurrency, "kvtier-file")
        # direct calls (file_direct.py): their effects on the index, for the loop thread
        self._handoff: deque = deque()
        self._direct_calls = 0  # direct calls begun and not ended (the caller's thread)
        self._locations = PageLocations(self._root_str)  # the direct calls' keys
        self._direct_added = (
            0  # bytes direct writes added since the last capacity check
        )
        self._direct_need = 0  # bytes direct writes found no room for (the disk full)
        self.direct_unsettled = (
            0  # bytes written since the caller last posted settle_direct
        )

    @contextlib.contextmanager
    def _shared(self):
        """The bytes under the root, shared by every process using it: read and written
        under an exclusive lock of `.kvtier-lock`. Yields `[bytes]` to update; a lost usage
        file is recounted from the directory (then the caller's new pages are in it)."""
        self._keep_marker()
        with open(self.root / LOCK, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                path = self.root / USAGE
                fd, count = _read_usage(path)
                try:
                    usage = (
                        [count]
                        if count is not None
                        else [_bytes_under(self.root), "recounted"]
                    )
                    before = usage[0]
                    yield usage
                    if usage[0] != before or len(usage) > 1:
                        _store_usage(path, fd, max(0, usage[0]))
                finally:
                    if fd is not None:
                        os.close(fd)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _file(self, key: str) -> str:
        """`path(key)` as a string (the hot paths: no Path objects per page)."""
        split_key(key)  # validates it
        head, _, hx = key.rpartition("/")
        return f"{self._root_str}/{head}/{hx[:2]}/{hx[2:4]}/{hx}"

    def path(self, key: str) -> Path:
        """Where `key`'s page lives: `<root>/<prefix>/<namespace>/<h[:2]>/<h[2:4]>/<h>`."""
        return Path(self._file(key))

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
                if name.startswith(TMP):
                    if _stale_temp(full, name):
                        unlink_quietly(Path(full))
                    continue
                key = _page_key(self.root, full)
                if key is None:
                    continue  # not ours
                try:
                    st = os.stat(full)
                except OSError:  # gone since the walk (another process evicted it), or a dangling link
                    continue
                oversized = (
                    st.st_size > self.config.max_page_bytes + HEADER_SIZE
                )  # evicted first
                found.append((not oversized, st.st_mtime_ns, key, st.st_size))
        for _, _, key, size in sorted(found):
            self._sizes[key] = size
            self.used_bytes += size

    async def _exists(self, keys):
        await self._adopt(keys, leading=True)
        return [k in self._sizes for k in keys]

    async def _exists_each(self, keys):
        await self._adopt(keys)  # every key answered, not a leading run
        return [k in self._sizes for k in keys]

    async def _adopt(self, keys, leading: bool = False) -> None:
        """Index pages another process wrote under the root after this one indexed it (TP
        ranks sharing MLA pages, replicas on one volume): stat the keys this index lacks
        (with `leading`, only up to the first one absent: callers want the leading run)."""
        unknown = [k for k in keys if k not in self._sizes and k not in self._hung]
        if not unknown:
            return
        paths = [
            self._file(k) for k in unknown
        ]  # directories checked on the way, as far as it goes
        sizes = (
            await self._run_jobs(
                [(partial(sizes_of, paths, leading, inside=self._inside), unknown)]
            )
        )[0]
        for key, size in zip(unknown, sizes):
            if size is not None and key not in self._sizes:
                self._sizes[key] = size
                self.used_bytes += size

    async def batch_get_into(self, keys, buffers, errors=None):
        with self._pages_call():
            return await super().batch_get_into(keys, buffers, errors)

    async def batch_set(self, keys, pages):
        with self._pages_call():
            return await super().batch_set(keys, pages)

    @contextlib.contextmanager
    def _pages_call(self):
        """Counts a page read or write from its start (`_jobs` shares the threads)."""
        self._pages_calls += 1
        try:
            yield
        finally:
            self._pages_calls -= 1

    async def _batch(self, fn, items: list[tuple]) -> list:
        """`fn(*item)` for every item, in `max_concurrency` thread jobs; results in order,
        an OSError in place of its item's result (`run_all`)."""
        return await self._jobs(partial(run_all, fn), items)

    async def _jobs(self, job, items: list[tuple]) -> list:
        """`job(share)` over `items` split into thread jobs; the results, one per item, in
        order. The threads are shared by the calls in flight: each call takes its share
        (`max_concurrency` over the calls running), at least one, so one call alone uses
        them all and many at once cost no more thread jobs than there are threads. Calls
        begun together (an engine's jobs, handed to the loop at once) count from their start
        (`_pages_call`): the first to reach the threads does not take them all, to wait
        then for the others' jobs queued behind its own."""
        calls = max(self._calls_in_flight + 1, self._pages_calls)
        share = max(1, self.config.max_concurrency // calls)
        groups = min(share, len(items))
        done = await self._run_jobs(
            [(partial(job, items[g::groups]), items[g::groups]) for g in range(groups)]
        )
        out: list = [None] * len(items)
        for g, results in enumerate(done):
            out[g::groups] = results
        return out

    async def _run_jobs(self, jobs: list[tuple]) -> list:
        """Each `(fn, items)` as one thread job, `fn(stop)` (a StopFlag of its own); their results. A job still stuck
        `timeout_s` after the call's own timeout is abandoned (io_threads.py): the keys of its
        items (their first element, a key or a path) are never asked again by this process."""
        stops = [
            StopFlag() for _ in jobs
        ]  # one each: a job's copies never wait on another's
        cfs = [self._pool.submit(fn, stop) for (fn, _), stop in zip(jobs, stops)]
        self._calls_in_flight += 1

        def give_up() -> int:
            for stop in stops:
                stop.set()
            for _, items in jobs:
                for item in items:
                    self._hang(item[0] if isinstance(item, tuple) else item)
            return self._pool.abandon(cfs)

        try:
            return await settle_jobs(
                [asyncio.wrap_future(cf) for cf in cfs], self.timeout_s, give_up
            )
        finally:
            self._calls_in_flight -= 1

    def _hang(self, key_or_path: str) -> None:
        key = (
            key_or_path
            if not key_or_path.startswith(self._root_str + "/")
            else _page_key(self.root, key_or_path)
        )
        if key is not None:
            self._forget(key)
            self._hung.add(key)

    async def _get(self, keys):
        await self._adopt(keys)
        known = [k for k in keys if k in self._sizes]
        limit = (
            self.config.max_page_bytes + seal.HEADER_SIZE
        )  # a sealed frame's longest part past the plain header
        blobs = dict(
            zip(
                known,
                await self._batch(
                    read_file, [(self._file(k), True, limit) for k in known]
                ),
            )
        )
        return [self._after_read(k, blobs.get(k)) for k in keys]

    async def _get_into(self, keys, parsed, views):
        await self._adopt(keys)
        items = [
            (k, ns, h, v)
            for k, (_, ns, h), v in zip(keys, parsed, views)
            if k in self._sizes
        ]
        job = (
            partial(read_sealed_into, self.codec)
            if self.codec.keyed
            else read_pages_into
        )
        got = await self._jobs(
            job, [(self._file(k), ns, h, v) for k, ns, h, v in items]
        )
        results = dict(zip([it[0] for it in items], got))
        touch = self._sizes.move_to_end  # a page read whole is the newest (`_touch`)
        out = []
        for k in keys:
            r = results.get(k)
            if r is True and k in self._sizes:
                touch(k)
                out.append(r)
            else:
                out.append(self._read_into_result(k, r))
        return out

    def _read_into_result(self, key: str, result):
        """`_after_read`, except that an error other than the file missing stays itself:
        `batch_get_into` tells its caller the page may be good (`errors`)."""
        after = self._after_read(key, result)
        if isinstance(result, OSError) and not isinstance(result, FileNotFoundError):
            return result
        return after

    def _after_read(self, key: str, result):
        """A page that cannot be read is a miss and leaves the index (it would fail again)."""
        if isinstance(result, FileNotFoundError):  # deleted behind our back: forget it
            self._forget(key)
            return None
        if isinstance(result, OSError):
            self._forget(key)
            self.counters.errors += 1
            self.complain(
                "error", f"reading {key}: {result}; dropped from the index, a miss"
            )
            return None
        if result is not None and not isinstance(result, FrameError):
            self._touch(key)
        return result

    async def _set(self, keys, frames):
        """Pages that were written are indexed; one that failed is reported not stored (and
        counted); when none could be written the batch fails as a store error."""
        fits = [f.size <= self.config.capacity_bytes for f in frames]
        items = [
            (self._file(k), f, self.config.fsync, self._inside)
            for k, f, ok in zip(keys, frames, fits)
            if ok
        ]
        written = [k for k, ok in zip(keys, fits) if ok]
        outcomes = await self._jobs(write_pages, items)
        await self._retry_if_disk_full(written, items, outcomes)
        results = dict(zip(written, outcomes))
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
        self._changed(True, [k for k, good in zip(keys, ok) if good])
        evicted = await self._enforce_capacity(added)
        if evicted:  # pages that found no room beside the kept ones: not stored
            refused = [i for i, k in enumerate(keys) if ok[i] and k in evicted]
            for i in refused:
                ok[i] = False
            self.writes_refused += len(refused)
        return ok

    async def _retry_if_disk_full(
        self, keys: list[str], items: list[tuple], outcomes: list
    ) -> None:
        """The disk filled up before `capacity_bytes` did (other files share it, or the
        capacity was set above its size): evict pages worth the bytes the batch could not
        write, in eviction order (pages of `keys`, the batch's own, last; leased pages
        never: those writes fail instead), then write those
        pages once more (their `outcomes` replaced). The store keeps working as an LRU cache
        as big as the disk lets it be, instead of refusing every write from then on (and
        being marked down, its stored pages unread)."""
        full = [
            i
            for i, r in enumerate(outcomes)
            if isinstance(r, OSError) and r.errno in DISK_FULL
        ]
        if not full:
            return
        need = sum(items[i][1].size for i in full)
        for (
            key
        ) in keys:  # a page this batch rewrote must not be what makes room for the rest
            self._touch(key)
        if not await self._evict_for_disk_full(need, f"to write {len(full)}"):
            return
        for i, r in zip(full, await self._jobs(write_pages, [items[i] for i in full])):
            outcomes[i] = r

    async def _enforce_capacity(self, added: int = 0) -> set[str]:
        """Hold `capacity_bytes` for the whole root, whichever processes wrote it: evict
        this process's pages in eviction order (file_leases.py: unleased first, by
        priority, least recently used first); if only leased ones are left, re-read the
        root and evict anyone's in that order. Returns the keys evicted.

        The root's lock is never held across an await: another coroutine of this loop
        taking it would block the loop thread for good (flock is per open file, so this
        process would wait on itself). Victims leave the index and the count under the
        lock; their files are unlinked after it, and a file that held other bytes than
        the index said (gone already, or rewritten) is corrected under the lock again."""
        with self._shared() as usage:
            if len(usage) == 1:
                if (
                    usage[0] > self.config.capacity_bytes
                ):  # over before this batch: a count gone
                    usage[0] = _bytes_under(
                        self.root
                    )  # wrong (a flipped digit) is recounted first
                    usage.append("recounted")
                else:
                    usage[0] += added
            victims = self._choose_victims(usage, self.config.capacity_bytes)
        if victims:
            await self._unlink_victims(victims)
        return {k for k, _ in victims}

    async def _unlink_victims(self, victims: list[tuple[str, int]]) -> None:
        """Remove the files of pages `_choose_victims` took off the index and the count."""
        removed = await self._batch(
            unlink_quietly, [(self._file(k),) for k, _ in victims]
        )
        error = sum(
            size - (r if isinstance(r, int) else 0)
            for (_, size), r in zip(victims, removed)
        )
        if error:
            with self._shared() as usage:
                usage[0] += error

    def _choose_victims(
        self, usage: list, limit: int, break_leases: bool = True
    ) -> list[tuple[str, int]]:
        """(key, bytes) of the pages to evict so that `usage[0]` fits `limit`, in eviction
        order (file_leases.py); taken off the index, the count and the lease table now
        (the caller holds the root's lock). Before a leased page goes, the root is
        re-read once: other processes' unleased pages go first. Leased pages go only
        with `break_leases` (the capacity, which must hold), never to make room on a
        full disk (the write fails there instead)."""
        self._shared_leases.sync()
        victims, rescanned, hinted = [], False, False
        order = eviction_order(self._sizes, self._leases)
        while usage[0] > limit:
            victim = next(order, None)
            if victim is None or self._leases.leased(victim):
                if rescanned:
                    if victim is None or not break_leases:
                        break
                    self.leases_broken += 1
                else:
                    self._rebuild_index()
                    for (
                        key,
                        _,
                    ) in victims:  # chosen already: their files are not gone yet
                        self._forget(key)
                    usage[0] = self.used_bytes
                    rescanned = True
                    order = eviction_order(self._sizes, self._leases)
                    continue
            size = self._sizes[victim]
            self._forget(victim)
            hinted = hinted or victim in self._leases
            self.counters.evictions += 1
            victims.append((victim, size))
            usage[0] -= size
        if hinted:
            self._leases.forget(k for k, _ in victims)
            self._shared_leases.save()
        self._removed(
            [k for k, _ in victims]
        )  # now: a write after this may store them anew
        return victims

    def _lease_failed(self, message: str) -> None:
        self.counters.errors += 1
        self.complain("error", message)

    async def _hint(self, keys, lease_s, priority):
        """Lease (or release) and prioritise the pages of `keys` the root holds, in the
        root's shared table (file_leases.py); how many it holds."""
        await self._adopt(keys)
        present = [k for k in keys if k in self._sizes]
        if not present:
            return 0
        with self._shared():
            self._shared_leases.sync()
            for key in present:
                self._leases.apply(key, lease_s, priority)
            self._shared_leases.save()
        return len(present)

    async def _delete(self, keys):
        present = [k for k in keys if k in self._sizes]
        for k in present:
            self._forget(k)
        removed = await self._batch(unlink_quietly, [(self._file(k),) for k in present])
        with self._shared() as usage:
            usage[0] -= sum(r for r in removed if isinstance(r, int))
            self._shared_leases.sync()
            if any(k in self._leases for k in present):
                self._leases.forget(present)
                self._shared_leases.save()
        return len(present)

    async def _evict_for_disk_full(self, need: int, what: str) -> bool:
        """Evict unleased LRU pages worth `need` bytes from a full disk; whether any went."""
        with self._shared() as usage:
            victims = self._choose_victims(
                usage, max(0, usage[0] - need), break_leases=False
            )
        if not victims:
            return False
        await self._unlink_victims(victims)
        self.disk_full_evictions += len(victims)
        self.complain(
            "disk_full",
            f"disk full under {self._root_str}: evicted {len(victims)} pages "
            f"({sum(n for _, n in victims)} bytes) {what}",
        )
        return True

    # handed off: run by _take_handoff on the loop thread

    def _touch_all(self, keys: list[str]) -> None:
        for key in keys:
            self._touch(key)

    def _forget_all(self, keys: list[str]) -> None:
        for key in keys:
            self._forget(key)

    def _index_written(self, written: tuple[list[str], list[int], list[int]]) -> None:
        """(keys, frame sizes, bytes each replaced) of the pages a direct write wrote."""
        keys, sizes, replaced = written
        added = 0
        for key, size, old in zip(keys, sizes, replaced):  # `_set`'s, in batch order
            self._forget(key)
            self._sizes[key] = size
            self.used_bytes += size
            added += size - old
        self._direct_added += added
        self._changed(True, list(keys))

    def _dropped(self, removed: list[tuple[str, int]]) -> None:
        """Pages a direct read deleted (they did not verify): `_delete`'s bookkeeping."""
        keys = [k for k, _ in removed]
        for key in keys:
            self._forget(key)
        with self._shared() as usage:
            usage[0] -= sum(n for _, n in removed)
            self._shared_leases.sync()
            if any(k in self._leases for k in keys):
                self._leases.forget(keys)
                self._shared_leases.save()
        self.counters.deletes += len(keys)
        self._removed(keys)

    def _note_disk_full(self, need: int) -> None:
        self._direct_need += need

    async def _close(self) -> None:
        """Threads not stuck are joined (within `timeout_s` in all); stuck ones are left."""
        self._pool.shutdown(wait=True, timeout=self.timeout_s)

    def touch(self, keys) -> None:
        self._take_handoff()
        for key in keys:
            self._touch(key)

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
            chunk = keys[start : start + batch]
            mtimes = await self._batch(mtime, [(self._file(k),) for k in chunk])
            yield [
                StoredPage(
                    k, self._sizes.get(k, 0), None if isinstance(m, OSError) else m
                )
                for k, m in zip(chunk, mtimes)
            ]

    def _meta_path(self, name: str) -> Path:
        return self.root.joinpath(*name.split("/"))

    def _keep_marker(self) -> None:
        """A root removed while the store runs (a cache cleaner, `rm -rf`) is made again by
        the next write, its marker first: the next start opens it as the store it is, not
        as somebody else's directory (docs/stores.md)."""
        if os.path.exists(self._marker):  # one stat per write batch
            return
        self.complain(
            "root_removed",
            f"store root {self._root_str} lost its {MARKER} marker while in use "
            "(removed?): made again, with the pages written since",
        )
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        write_small(Path(self._marker), b'{"format": 1}\n')

    async def _put_meta(self, name, data):
        self._keep_marker()
        [err] = await self._jobs(
            write_pages, [(self._meta_path(name), bytes(data), self.config.fsync)]
        )
        if isinstance(err, OSError):
            raise StoreError(f"file: writing {name}: {err}") from err

    async def _get_meta(self, name):
        [got] = await self._batch(read_file, [(self._meta_path(name),)])
        return None if isinstance(got, OSError) else got

    def _extra_stats(self):
        return {
            "pages": len(self._sizes),
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.config.capacity_bytes,
            "root": str(self.root),
            "disk_full_evictions": self.disk_full_evictions,
            "hinted_pages": len(self._leases),
            "leases_broken": self.leases_broken,
            "writes_refused": self.writes_refused,
            "io_threads_abandoned": self._pool.abandoned,
            "pages_abandoned": len(self._hung),
        }


MARKER, LOCK, USAGE = ".kvtier-store", ".kvtier-lock", ".kvtier-usage"
STALE_TEMP_S = 3600.0


def _read_usage(path: Path) -> tuple[int | None, int | None]:
    """(open descriptor or None, the count or None where it is missing or unreadable)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None, None
    try:
        return fd, int(os.pread(fd, 64, 0) or 0)
    except (OSError, ValueError):
        return fd, None


def _store_usage(path: Path, fd: int | None, used: int) -> None:
    """The root's byte count, rewritten in place: one pwrite of 20 digits (a temp file and
    a rename per batch cost ~200 us of the store's loop). A new file is written whole,
    then renamed in; a damaged one is cut to the 20 digits."""
    data = b"%020d" % used
    if fd is None:
        write_small(path, data)
    else:
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(f"short write to {path}")
        os.ftruncate(fd, len(data))  # whatever a damaged file held past it goes


def _bytes_under(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            if not name.startswith((TMP, ".kvtier")):
                with contextlib.suppress(
                    OSError
                ):  # gone since the walk, or a dangling link
                    total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def _claim_root(root: Path) -> None:
    """Use `root` only if it is a kvtier store (its marker) or new/empty: never clean up a
    directory that is somebody else's."""
    if root.exists() and not root.is_dir():
        raise OSError(
            f"{root} is a file, not a directory: name a directory (it is created if missing)"
        )
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    marker = root / MARKER
    if marker.exists():
        return
    for dirpath, _, files in os.walk(root):  # a store from before markers is adopted
        for name in files:
            if not (
                name.startswith((TMP, ".kvtier"))
                or _page_key(root, os.path.join(dirpath, name))
            ):
                raise OSError(
                    f"not a kvtier store: it holds other files ({name}) and no {MARKER} marker; "
                    f"name an empty directory (or create {marker} if it is one)"
                )
    write_small(marker, b'{"format": 1}\n')


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
    owner = name[len(TMP) :]
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
