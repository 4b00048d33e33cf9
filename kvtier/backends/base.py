"""The L3 store interface (docs/design.md §6): async bytes keyed by page hash, framed and verified.

A store subclass implements the raw operations (`_exists`, `_get`, `_set`, `_delete`,
`_scan`, `_put_meta`, `_get_meta`, `_close`) on whole frames. This base validates keys, frames and verifies
pages, applies the timeout to every call, counts, and maps client errors onto kvtier's
exceptions at the boundary — no redis, botocore or OS error escapes unmapped.

Threading: a store is used from one asyncio event loop (the controller's storage thread).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from collections.abc import AsyncIterator, Callable, Sequence

from kvtier.backends import frame
from kvtier.backends.frame import Buffer, FrameError
from kvtier.errors import (
    Complaints,
    KvtierError,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from kvtier.hashing import split_key, validate_key

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreCounters:
    exists_calls: int = 0
    sets: int = 0
    set_failures: int = 0
    set_bytes: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    get_bytes: int = 0
    frame_failures: int = 0
    errors: int = 0
    timeouts: int = 0
    evictions: int = 0
    deletes: int = 0


# bytes a frame adds to its payload, at most (plain: a 128-byte header; sealed: 128 and a
# 16-byte tag): a read of a page's frame needs no more than its payload and this
FRAME_SLACK = 256
MANIFEST_LIMIT = 1 << 20  # a manifest is a small JSON object: a longer one is none


@dataclass(slots=True, frozen=True)
class StoredPage:
    key: str
    size: int  # bytes the store holds for it (frame included)
    mtime: (
        float | None
    )  # when it was written (seconds since the epoch), if the store knows


async def _next_batch(it: AsyncIterator):
    """The next batch of `it`, or None at its end (StopAsyncIteration is no store error)."""
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


def manifest_key(prefix: str, namespace_id: str) -> str:
    return f"{prefix}/{namespace_id}/manifest.json"


def _is_page_key(key: str) -> bool:
    try:
        validate_key(key)
        return True
    except ValueError:
        return False


# A raw read result for one key: absent, verified into the caller's buffer, or a bad frame.
IntoResult = bool | FrameError | None


def verify_into(
    blob, namespace_id: str, page_hash: bytes, view: memoryview, codec=frame.PLAIN
) -> IntoResult:
    """One stored blob into the caller's buffer: None if absent, the FrameError if it does
    not verify (the buffer must not be used), True once the verified payload is in `view`."""
    if blob is None:
        return None
    try:
        codec.decode_into(blob, namespace_id, page_hash, view)
    except FrameError as exc:
        return exc
    return True


async def _quietly(task: asyncio.Future) -> BaseException | None:
    """Wait for a cancelled call to end; what it ended with (StoreAbandoned: its threads
    were given up on and may still write its buffers)."""
    try:
        await task
    except BaseException as exc:
        return exc
    return None


def _key_strings(keys) -> list[str]:
    if isinstance(keys, (str, bytes)):
        raise ValueError("keys: expected a sequence of keys, got one key")
    return [k.decode("ascii", "replace") if isinstance(k, bytes) else k for k in keys]


def check_hint(lease_s, priority) -> None:
    """A hint's lease (seconds > 0, or None) and priority (an int, or None: the page's
    own), or ValueError."""
    if lease_s is not None and (
        isinstance(lease_s, bool)
        or not isinstance(lease_s, (int, float))
        or not lease_s > 0
        or lease_s == float("inf")
    ):
        raise ValueError(
            f"lease_s={lease_s!r}: a finite number of seconds > 0, or None to release"
        )
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int)
    ):
        raise ValueError(
            f"priority={priority!r}: an integer (higher = kept longer), or None to "
            "keep the page's priority"
        )


class Store(ABC):
    name = "store"
    # True where a call given up on (timed out, its threads abandoned) writes none of the
    # caller's buffers afterwards (`batch_get_into`): an engine may read into its own memory.
    reads_end_with_call = False
    # True where the store tells its watcher of the pages it stored itself, at the moment
    # they became visible (before a concurrent call could evict them); else `batch_set`
    # does, once the call returned
    announces_sets = False

    def __init__(
        self, timeout_s: float = 5.0, clock: Callable[[], float] | None = None
    ) -> None:
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not timeout_s > 0
        ):
            raise ValueError(
                f"timeout_s={timeout_s!r}: must be a number of seconds > 0"
            )
        self.timeout_s = timeout_s
        self.counters = StoreCounters()
        self._complaints = Complaints(log, f"{self.name} store: ")
        self.codec = frame.PLAIN
        # kvtier's clock for leases (seconds); a test passes a logical one
        self.clock: Callable[[], float] = time.time if clock is None else clock
        self._watcher: Callable[[bool, list[str]], None] | None = None

    def seal_with(self, codec) -> None:
        """Frame and read every page with `codec` (a tenant's `SealedCodec`, docs/security.md)
        from now on. One store object serves one tenant: a second, other codec is refused."""
        if self.codec is not frame.PLAIN and codec is not self.codec:
            raise ValueError(
                f"{self.name} store: this store object already seals pages for another tenant key; "
                "give each tenant's cache its own store object"
            )
        self.codec = codec

    # -- public API ------------------------------------------------------------------------

    async def batch_exists(self, keys: Sequence[str]) -> int:
        """Length of the leading run of `keys` that the store holds."""
        self._check(keys)
        self.counters.exists_calls += 1
        if not keys:
            return 0
        present = self._one_each(
            "batch_exists",
            await self._call("batch_exists", self._exists(list(keys))),
            len(keys),
        )
        run = 0
        for p in present:
            if not p:
                break
            run += 1
        return run

    async def exists_each(self, keys: Sequence[str]) -> list[bool]:
        """Whether the store holds each of `keys`, every one answered (`batch_exists`
        stops at the first missing key): for pools held only at some pages."""
        self._check(keys)
        self.counters.exists_calls += 1
        if not keys:
            return []
        present = await self._call("batch_exists", self._exists_each(list(keys)))
        return [bool(p) for p in self._one_each("exists_each", present, len(keys))]

    async def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Verified payloads; None for a missing page or one whose frame does not verify."""
        parsed = self._check(keys)
        if not keys:
            return []
        blobs = self._one_each(
            "batch_get", await self._call("batch_get", self._get(list(keys))), len(keys)
        )
        out: list[bytes | None] = []
        for key, (_, ns, h), blob in zip(keys, parsed, blobs):
            if blob is None:
                out.append(self._count_read(key, None))
                continue
            try:
                payload = self.codec.decode(blob, ns, h)
            except FrameError as exc:
                out.append(self._count_read(key, exc))
                continue
            self._count_read(key, True, len(payload))
            out.append(bytes(payload))
        return out

    async def batch_get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        errors: set[str] | None = None,
    ) -> list[bool]:
        """Read each page's payload into the caller's writable buffer (a host page view).

        True where the buffer now holds the verified page; False for a miss. A False buffer
        may hold garbage: the caller must not use it. `errors`, where given, gets the keys
        whose read failed for a reason that says nothing of the page (an I/O error such as
        too many open files): the store may well hold it, good, so it must not be
        deleted or taken for bad.
        """
        parsed = self._check(keys)
        if len(buffers) != len(keys):
            raise ValueError(
                f"batch_get_into: {len(keys)} keys but {len(buffers)} buffers"
            )
        if not keys:
            return []
        views = [memoryview(b).cast("B") for b in buffers]
        results = await self._call(
            "batch_get_into", self._get_into(list(keys), parsed, views)
        )
        results = self._one_each("batch_get_into", results, len(keys))
        if errors is not None:
            errors.update(k for k, r in zip(keys, results) if isinstance(r, OSError))
        return [
            self._count_read(k, r, len(v)) is not None
            for k, r, v in zip(keys, results, views)
        ]

    async def batch_set(
        self, keys: Sequence[str], pages: Sequence[Buffer]
    ) -> list[bool]:
        """Store each page; True only where the page is durable and visible."""
        parsed = self._check(keys)
        if len(pages) != len(keys):
            raise ValueError(f"batch_set: {len(keys)} keys but {len(pages)} pages")
        if not keys:
            return []
        views = [memoryview(p).cast("B") for p in pages]
        frames = [
            frame.Frame(ns, h, v, self.codec) for (_, ns, h), v in zip(parsed, views)
        ]  # headers made by the store
        try:
            ok = await self._call("batch_set", self._set(list(keys), frames))
            ok = self._one_each("batch_set", ok, len(keys))
        except StoreError:
            self.counters.sets += len(keys)
            self.counters.set_failures += len(keys)
            raise
        if self._watcher is not None and not self.announces_sets:
            self._changed(True, [k for k, good in zip(keys, ok) if good])
        for good, v in zip(ok, views):
            self.counters.sets += 1
            if good:
                self.counters.set_bytes += len(v)
            else:
                self.counters.set_failures += 1
        if not all(ok):
            self.complain(
                "rejected",
                f"{len(ok) - sum(ok)} of {len(ok)} pages not stored (the store refused them)",
            )
        return list(ok)

    def touch(self, keys: Sequence[str]) -> None:  # noqa: B027 (optional hook)
        """Mark stored pages as just used: their copies above the store are gone, so the
        store's copy is now the one that counts. A store that keeps an eviction order
        makes them its newest (file and memory: their LRU order; Redis: a TOUCH, for its
        maxmemory policy); S3 ignores it (its objects expire by lifecycle rules). Called
        on the store's loop thread, and must not block it: a store that needs I/O for it
        sends that in the background."""

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys`; returns how many were present (each announced removed)."""
        self._check(keys)
        if not keys:
            return 0
        n = await self._call("delete", self._delete(list(keys)))
        self.counters.deletes += n
        self._removed(list(keys))
        return n

    async def hint(
        self,
        keys: Sequence[str | bytes],
        *,
        lease_s: float | None,
        priority: int | None = 0,
    ) -> int:
        """Carry a hint for these keys to the store by its own means: a lease of `lease_s`
        seconds from now on kvtier's clock (`self.clock`; None releases the lease), and
        an eviction priority (higher = kept longer; None keeps the priority the page
        has, as a lease or release that is no `retain` does). Returns how many of the keys it
        applied to; a store with no means returns 0 (as here). Never raises for a key
        that is absent. Keys are store keys (`str`, or their ASCII bytes); a malformed
        one, a lease that is not a number of seconds > 0, or a priority that is no int
        is a ValueError (docs/stores.md, "Leases and priorities")."""
        keys = _key_strings(keys)
        self._check(keys)
        check_hint(lease_s, priority)
        if not keys:
            return 0
        return await self._call("hint", self._hint(keys, lease_s, priority))

    def watch(self, callback: Callable[[bool, list[str]], None] | None) -> None:
        """Tell `callback(present, keys)` of every change to what the store holds from now
        on, in the order the store saw them: `present` True for pages this store object
        stored (`batch_set`), False for pages it dropped: evicted for capacity, expired or
        evicted by the server (Redis keyspace notifications, where on), deleted. Called on
        the store's loop thread, so it must not block (the KV events queue them for their
        scheduler-side flush). One callback; None removes it."""
        self._watcher = callback

    def _changed(self, present: bool, keys: list[str]) -> None:
        """Tell the watcher (`watch`); one that fails is logged, never raised into the
        store call that made the change."""
        if self._watcher is None or not keys:
            return
        try:
            self._watcher(present, keys)
        except Exception:
            log.exception("%s store: its watcher failed", self.name)

    def _removed(self, keys: list[str]) -> None:
        self._changed(False, keys)

    async def scan(self, batch: int = 1000) -> AsyncIterator[list[StoredPage]]:
        """Every kvtier page the store holds, in batches (keys that are not kvtier's are
        skipped). Each batch is one bounded call, under the store's timeout and with its
        errors mapped as any call's: a huge store streams, it never loads."""
        it = self._scan(batch).__aiter__()
        try:
            while (pages := await self._call("scan", _next_batch(it))) is not None:
                yield [p for p in pages if _is_page_key(p.key)]
        finally:
            try:
                await it.aclose()
            except (
                RuntimeError,
                KvtierError,
            ):  # a batch given up on mid-way: the generator is done for
                pass

    async def inventory(self) -> dict:
        """What the store holds: {'pages', 'bytes', 'namespaces': {id: pages}}."""
        pages = nbytes = 0
        namespaces: dict[str, int] = {}
        async for batch in self.scan():
            for p in batch:
                pages, nbytes = pages + 1, nbytes + p.size
                ns = split_key(p.key)[1]
                namespaces[ns] = namespaces.get(ns, 0) + 1
        return {"pages": pages, "bytes": nbytes, "namespaces": namespaces}

    async def check(
        self, keys: Sequence[str], codec=None
    ) -> list[str | FrameError | None]:
        """Read and verify each page (with `codec`, else the store's): None if its frame and
        checksum (or seal) verify, else why not ("missing", or the FrameError). Nothing is
        counted as a hit or a miss."""
        codec = self.codec if codec is None else codec
        parsed = self._check(keys)
        if not keys:
            return []
        blobs = self._one_each(
            "check", await self._call("check", self._get(list(keys))), len(keys)
        )
        out: list[str | None] = []
        for (_, ns, h), blob in zip(parsed, blobs):
            if blob is None:
                out.append("missing")
                continue
            try:
                codec.decode(blob, ns, h)
                out.append(None)
            except FrameError as exc:
                # without its traceback: the read's frames would keep the value read
                # (anyone can plant a huge one) alive in a cycle until a collection
                out.append(exc.with_traceback(None))
        return out

    async def put_manifest(
        self, prefix: str, namespace_id: str, manifest: dict
    ) -> None:
        """Describe a namespace (docs/formats.md): written once, when it first stores a page."""
        await self._call(
            "put_manifest",
            self._put_meta(
                manifest_key(prefix, namespace_id),
                json.dumps(manifest, sort_keys=True).encode(),
            ),
        )

    async def get_manifest(self, prefix: str, namespace_id: str) -> dict | None:
        """The namespace's manifest (docs/formats.md), or None where there is none or it is
        no JSON object. Anyone who can write the store can write it: a field that is not a
        string, number, bool or null is dropped, and JSON nested too deep to parse is none."""
        raw = await self._call(
            "get_manifest", self._get_meta(manifest_key(prefix, namespace_id))
        )
        if raw is None or len(raw) > MANIFEST_LIMIT:
            return None
        try:
            manifest = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        if not isinstance(manifest, dict):
            return None
        return {
            k: v
            for k, v in manifest.items()
            if v is None or isinstance(v, (str, int, float))
        }

    def stats(self) -> dict:
        return {"store": self.name, **asdict(self.counters), **self._extra_stats()}

    async def close(self) -> None:
        try:
            await self._close()
        except KvtierError:
            raise
        except (
            Exception
        ) as exc:  # closing a broken connection must not raise a client error
            raise self._map_error("close", exc) from exc

    # -- for subclasses --------------------------------------------------------------------

    @abstractmethod
    async def _exists(self, keys: list[str]) -> list[bool]: ...

    async def _exists_each(self, keys: list[str]) -> list[bool]:
        """`exists_each`'s raw call: `_exists`, unless a store's `_exists` looks only as far
        as a leading run needs (the file store's index of other processes' pages)."""
        return await self._exists(keys)

    @abstractmethod
    async def _get(self, keys: list[str]) -> list[Buffer | None]: ...

    @abstractmethod
    async def _set(self, keys: list[str], frames: list[frame.Frame]) -> list[bool]:
        """Store each frame (`header, payload = frame`: the header's checksum is computed on
        first use, best in the store's I/O threads); True where durable and visible."""

    @abstractmethod
    async def _delete(self, keys: list[str]) -> int: ...

    @abstractmethod
    def _scan(self, batch: int) -> AsyncIterator[list[StoredPage]]: ...

    @abstractmethod
    async def _put_meta(self, name: str, data: bytes) -> None: ...

    @abstractmethod
    async def _get_meta(self, name: str) -> bytes | None: ...

    async def _close(self) -> None:
        return None

    async def _hint(
        self, keys: list[str], lease_s: float | None, priority: int | None
    ) -> int:
        """Apply a checked hint (`hint`); a store with no means applies it to none."""
        return 0

    def _extra_stats(self) -> dict:
        return {}

    async def _get_upto(self, keys: list[str], limits: list[int]) -> list:
        """Each key's frame, or None where missing. A store that can bound a read reads at
        most `limits[i] + 1` bytes of key i, so a longer value (anyone who can write the
        store plants one) fails to decode: a counted miss, never read whole. Default: whole
        frames (`_get`)."""
        return await self._get(keys)

    async def _get_into(
        self, keys: list[str], parsed: list, views: list[memoryview]
    ) -> list[IntoResult]:
        """Default: read frames of at most the page's size, verify, copy. Stores that can
        read in place override."""
        blobs = await self._get_upto(keys, [len(v) + FRAME_SLACK for v in views])
        return [
            verify_into(blob, ns, h, view, self.codec)
            for (_, ns, h), blob, view in zip(parsed, blobs, views)
        ]

    def _one_each(self, op: str, answers, n: int) -> list:
        """A raw call's answers, one per key in order, or StoreError: a list of another
        length (a plugin that answered only for the keys it holds) would shift answers onto
        other keys' pages."""
        answers = list(answers)
        if len(answers) != n:
            self.counters.errors += 1
            raise StoreError(
                f"{self.name}.{op}: {len(answers)} answers for {n} keys (a store answers each key, "
                f"in order)"
            )
        return answers

    def _map_error(self, op: str, exc: BaseException) -> StoreError:
        """Client error -> kvtier error. Subclasses extend for their client's exceptions."""
        if isinstance(exc, (ConnectionError, EOFError)):
            return StoreUnavailable(f"{self.name}.{op}: {type(exc).__name__}: {exc}")
        return StoreError(f"{self.name}.{op}: {type(exc).__name__}: {exc}")

    # -- internals -------------------------------------------------------------------------

    async def _call(self, op: str, coro):
        """Run one raw call under the timeout. A timeout is a logical cancel: the call is
        cancelled and StoreTimeout raised at once, carrying `settled`, an awaitable that
        ends when the call has really stopped touching the caller's buffers (a thread job
        of the file or s3 store finishes its page first). Buffers are the caller's again
        only after `settled`."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(coro)  # a backend may hand back any awaitable
        woken = (
            loop.create_future()
        )  # by the call's end or its deadline, whichever comes first

        def wake(_=None) -> None:
            if not woken.done():
                woken.set_result(None)

        task.add_done_callback(wake)
        disarm = self._arm_deadline(op, task, wake)
        try:
            await woken
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            disarm()
        if not task.done():
            task.cancel()
            self.counters.timeouts += 1
            self.complain(
                "timeout",
                f"{self.name}.{op}: no answer within timeout_s={self.timeout_s}",
            )
            raise StoreTimeout(
                f"{self.name}.{op}: no answer within timeout_s={self.timeout_s}",
                settled=asyncio.ensure_future(_quietly(task)),
            )
        try:
            return task.result()
        except StoreTimeout as exc:
            self.counters.timeouts += 1
            self.complain("timeout", str(exc))
            raise
        except KvtierError as exc:
            self.counters.errors += 1
            self.complain("error", str(exc))
            raise
        except (asyncio.TimeoutError, TimeoutError) as exc:
            self.counters.timeouts += 1
            raise StoreTimeout(f"{self.name}.{op}: {exc or 'timed out'}") from exc
        except (ValueError, TypeError, AssertionError):
            raise  # our caller's mistake or our bug: not a store failure
        except Exception as exc:
            mapped = self._map_error(op, exc)
            if isinstance(mapped, StoreTimeout):
                self.counters.timeouts += 1
                self.complain("timeout", str(mapped))
            else:
                self.counters.errors += 1
                self.complain("error", str(mapped))
            raise mapped from exc

    def _arm_deadline(
        self, op: str, task: asyncio.Future, fire: Callable[[], None]
    ) -> Callable[[], None]:
        """Call `fire` once the call `task` of `op` has run out of time (a test store decides
        when); returns what disarms it. A timer, not a task: a store call costs ~20 us less
        on the storage thread."""
        return asyncio.get_running_loop().call_later(self.timeout_s, fire).cancel

    @staticmethod
    async def _in_threads(futures: list) -> list:
        """Await thread-pool jobs that read or write the caller's buffers: their results, in
        order. The call ends only once every job has returned, whatever happens: where a job
        fails, the first failure (in job order) is raised after the others have returned;
        where the call is cancelled, the cancellation goes through after they have. So a
        buffer is never touched after the call ended (a failed batch whose other jobs went
        on reading pages the caller had already reused could store wrong bytes under a
        good checksum). Every job's error is retrieved, so asyncio logs none at exit."""
        if not futures:
            return []
        cancelled = None
        while True:
            try:  # asyncio.wait never cancels what it waits for
                await asyncio.wait(futures)
                break
            except asyncio.CancelledError as exc:
                cancelled = exc
                if all(f.done() for f in futures):
                    break
        errors = [f.exception() for f in futures if not f.cancelled()]
        if cancelled is not None:
            raise cancelled
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in futures]

    def complain(self, kind: str, message: str) -> None:
        """Log the first failure of each kind (error, timeout, rejected, corrupt), then
        every 100th with the running count; `stats()` counts them all."""
        self._complaints(kind, message)

    def _check(self, keys: Sequence[str]) -> list[tuple[str, str, bytes]]:
        if isinstance(keys, str):
            raise ValueError("keys: expected a sequence of keys, got one string")
        return [split_key(k) for k in keys]

    def _count_read(self, key: str, result: IntoResult, nbytes: int = 0):
        self.counters.gets += 1
        if result is None or isinstance(
            result, OSError
        ):  # an error: counted by the store
            self.counters.misses += 1
            return None
        if isinstance(result, FrameError):
            self.counters.frame_failures += 1
            self.counters.misses += 1
            self.complain(
                "corrupt", f"page {key} does not verify ({result}): counted as a miss"
            )
            return None
        self.counters.hits += 1
        self.counters.get_bytes += nbytes
        return True
