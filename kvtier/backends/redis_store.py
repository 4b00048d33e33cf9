"""`redis`: pages as Redis strings (redis.asyncio), standalone or cluster.

URLs: `redis://[user:password@]host:port/db`, `rediss://` for TLS; a cluster is named by
`cluster: true` (any one node's URL). Small pages go out pipelined (one round trip per batch); pages of
`concurrent_min_bytes` or more go out as concurrent commands over the connection pool,
which measured 2-4x faster than one pipeline for 1-8 MiB values with redis.asyncio.
`SET` is atomic: a failed write is never visible.

Leases (`Store.hint`): a leased page's TTL is made at least `ttl_s` plus the lease's
remaining time (PEXPIRE GT: an existing longer TTL, or none, is never shortened), so under
`maxmemory-policy volatile-ttl` it outlives every page written during the lease; when the
lease ends on kvtier's clock (or is released) it goes back to `ttl_s` (an EXPIRE, as a
touch). Pages the server drops (expired, evicted) are announced to the store's watcher (`Store.watch`) through
keyspace notifications where the server has them on (`notify-keyspace-events` with `Ex`
/ `Ee`); `stats()["removal_events"]` says whether they are (docs/stores.md).

Standalone writes go out on a blocking client, as pipelined `SET`s whose frame header and
payload are sent as separate buffers (no copy of the page): that measured 1.6-2.3x the
redis.asyncio path (`tierctl bench stores`). Each sending thread has a hashing thread that
makes the frame headers (one checksum pass over each page) ahead of it, so the pass
overlaps the sending. A write ends only once its threads have returned, so the caller's
pages are never read after it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_jobs
from dataclasses import dataclass, field

from kvtier.backends.base import FRAME_SLACK, MANIFEST_LIMIT, Store, StoredPage
from kvtier.backends.leases import Leases
from kvtier.errors import KvtierError, StoreError, StoreTimeout, StoreUnavailable
from kvtier.secrets import redact_url
from kvtier.validate import check_positive, io_threads


@dataclass(slots=True, frozen=True)
class RedisStoreConfig:
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    password: str | None = None  # overrides the URL's; never logged
    ttl_s: int | None = None
    pool_size: int = 16
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    overwrite: bool = True  # False: SET NX (skip pages already stored)
    concurrent_min_bytes: int = 256 << 10
    # standalone: connections sending pipelined SETs, each with a thread hashing ahead of it
    write_threads: int = field(default_factory=lambda: io_threads(2))
    max_page_bytes: int = 1 << 30  # a longer value is no page: never read whole

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            shown = (
                repr(redact_url(self.url))
                if ":" in self.url
                else "(not shown: with no scheme it may be a secret)"
            )
            raise ValueError(
                f"url={shown}: must start with redis://, rediss:// or unix://"
            )
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"ttl_s={self.ttl_s}: must be > 0 or null")
        check_positive(
            self,
            "pool_size",
            "concurrent_min_bytes",
            "write_threads",
            "max_page_bytes",
            integer=True,
        )
        check_positive(self, "socket_timeout_s", "connect_timeout_s")


_TOUCH_BATCH = 1000  # keys per pipelined TOUCH round trip
_TOUCH_BACKLOG = 100_000  # keys waiting to be touched, at most
_SEND_BYTES = 1 << 20  # small pages go out together, up to this many bytes per send
_SEND_PARTS = 256
_WATCH_RETRY_S = 5.0  # a lost notification listener is restarted no sooner than this

log = logging.getLogger(__name__)


class RedisStore(Store):
    config_class = RedisStoreConfig
    name = "redis"
    # told in the server's order: through the notification connection (`_told_stored`)
    announces_sets = True

    def __init__(
        self,
        config: RedisStoreConfig = RedisStoreConfig(),
        timeout_s: float = 5.0,
        clock=None,
    ) -> None:
        super().__init__(timeout_s, time.monotonic if clock is None else clock)
        import redis.asyncio as aioredis
        from redis.asyncio.cluster import RedisCluster

        self.config = config
        kwargs = dict(
            socket_timeout=config.socket_timeout_s,
            socket_connect_timeout=config.connect_timeout_s,
            max_connections=config.pool_size,
        )
        if config.password is not None:
            kwargs["password"] = config.password
        self._writer = None
        if config.cluster:
            self.client = RedisCluster.from_url(config.url, **kwargs)
        else:
            import redis

            self.client = aioredis.from_url(config.url, **kwargs)
            # a write the store gave up on (timeout_s) must not hold its thread, and so the
            # caller's pages, much longer: the blocking socket times out no later than that
            self._writer = redis.ConnectionPool.from_url(
                config.url,
                **{**kwargs, "socket_timeout": min(config.socket_timeout_s, timeout_s)},
            )
            self._threads = ThreadPoolExecutor(
                config.write_threads, thread_name_prefix="kvtier-redis"
            )
            self._hashers = ThreadPoolExecutor(
                config.write_threads, thread_name_prefix="kvtier-redis-hash"
            )
        self._slots = asyncio.Semaphore(config.pool_size)
        self._page_bytes = 0  # last page size seen: picks pipelined vs concurrent
        self._to_touch: list[str] = []  # keys `touch` was given, not sent yet
        self._toucher: asyncio.Task | None = None  # sends them, one batch at a time
        self.touched = 0  # keys sent in TOUCH (or EXPIRE) commands
        self._leases = Leases(self.clock)
        self._expire_gt = True  # PEXPIRE ... GT (Redis 7); False: PTTL, then PEXPIRE
        self.removal_events = "off: nobody watches (Store.watch)"
        self._listener: asyncio.Task | None = None  # the keyspace notification listener
        self._watch_wanted = False
        self._watch_tried = float("-inf")  # time.monotonic() of the last start
        # pages stored, told to the watcher when their mark comes back (`_told_stored`)
        self._marks: dict[str, tuple[list[str], asyncio.Future]] = {}
        self._mark_ids = itertools.count()
        self._mark_channel = f"kvtier-store-mark-{os.urandom(8).hex()}"

    async def _prefix_of(self, key: str, limit: int):
        try:
            return await self.client.getrange(key, 0, limit)
        except Exception as exc:
            if _wrong_type(exc):  # another application's list or hash: no page
                return None
            raise

    def _concurrent(self) -> bool:
        return self._page_bytes >= self.config.concurrent_min_bytes

    async def _each(self, method, keys, *args, **kwargs):
        async def one(key, *a):
            async with self._slots:
                return await method(key, *a, **kwargs)

        return await asyncio.gather(
            *(one(k, *a) for k, *a in zip(keys, *args)), return_exceptions=True
        )

    async def _exists(self, keys):
        await self._upkeep()
        async with self.client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.exists(k)
            return [bool(n) for n in await pipe.execute()]

    async def _get(self, keys):
        return await self._get_upto(
            keys, [self.config.max_page_bytes + FRAME_SLACK] * len(keys)
        )

    async def _get_upto(self, keys, limits):
        """GETRANGE, not GET: at most `limit + 1` bytes of each value come back, so a
        planted huge value is never read whole (it fails to decode: a counted miss). A
        missing key (an empty string) or one of another type is None."""
        if self._concurrent():
            blobs = await self._each(self._prefix_of, keys, limits)
            for b in blobs:
                if isinstance(b, BaseException):
                    raise b
        else:
            async with self.client.pipeline(transaction=False) as pipe:
                for k, n in zip(keys, limits):
                    pipe.getrange(k, 0, n)
                blobs = await pipe.execute(raise_on_error=False)
            for b in blobs:
                if isinstance(b, BaseException) and not _wrong_type(b):
                    raise b
        blobs = [None if isinstance(b, BaseException) or not b else b for b in blobs]
        sizes = [len(b) for b in blobs if b is not None]
        if sizes:
            self._page_bytes = max(sizes)
        return blobs

    async def _set(self, keys, frames):
        await self._upkeep()
        ok = await self._set_pages(keys, frames)
        await self._told_stored([k for k, good in zip(keys, ok) if good])
        return ok

    async def _set_pages(self, keys, frames):
        if self._writer is not None:
            return await self._set_threads(keys, frames)
        blobs = [header + payload for header, payload in frames]
        self._page_bytes = max(len(b) for b in blobs)
        opts = dict(ex=self.config.ttl_s, nx=not self.config.overwrite)
        if self._concurrent():
            results = await self._each(self.client.set, keys, blobs, **opts)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors and len(errors) == len(results):
                raise errors[0]  # nothing got through: the store is down, say so
        else:
            async with self.client.pipeline(transaction=False) as pipe:
                for k, blob in zip(keys, blobs):
                    pipe.set(k, blob, **opts)
                results = await pipe.execute(raise_on_error=False)
        # an error is a page not stored; SET NX answers None when the page is already there
        return [not isinstance(r, BaseException) for r in results]

    async def _set_threads(self, keys, frames) -> list[bool]:
        """Split the batch over the write threads by bytes; each pipelines its share."""
        groups = min(self.config.write_threads, len(keys))
        shares: list[list[int]] = [[] for _ in range(groups)]
        loads = [0] * groups
        for i in sorted(range(len(keys)), key=lambda i: -frames[i].size):
            g = loads.index(min(loads))
            shares[g].append(i)
            loads[g] += frames[i].size
        loop = asyncio.get_running_loop()
        jobs = [
            loop.run_in_executor(
                self._threads,
                self._send_sets,
                [keys[i] for i in share],
                [frames[i] for i in share],
            )
            for share in shares
        ]
        results = await self._in_threads(jobs)
        out = [False] * len(keys)
        for share, got in zip(shares, results):
            for i, ok in zip(share, got):
                out[i] = ok
        return out

    def _send_sets(self, keys: list[str], frames: list) -> list[bool]:
        """One thread job: pipelined SETs on one connection. A hashing thread makes the frame
        headers in order, ahead of the sending; small pages go out together (up to 1 MiB,
        one buffer list per send), a big one as soon as its header is ready. Against raw
        pipelined SETs of the same pages, in `tierctl bench stores` rounds (2 cores, 1
        connection): 0.58-0.82x for 1 MiB pages, 0.86-1.03x for 8 MiB, 0.87-0.95x for 64 KiB,
        1.13-1.28x for 16 KiB; a SET per send from 4 connections, each hashing its own pages,
        measured 0.51-0.58x, 0.94-1.01x, 0.61-0.63x and 0.63-0.78x. An error reply is a page
        not stored; a broken connection raises, once the hashing thread has let go of the
        caller's pages."""
        import redis.exceptions as rex

        extra = []
        if self.config.ttl_s is not None:
            extra += [b"EX", str(self.config.ttl_s).encode()]
        if not self.config.overwrite:
            extra.append(b"NX")
        argc = b"*%d\r\n$3\r\nSET\r\n" % (3 + len(extra))
        end = b"\r\n" + b"".join(
            b"$%d\r\n%s\r\n" % (len(a), a) for a in extra
        )  # after each payload
        headers: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()  # the sending ended early: hash no further

        def hash_ahead() -> None:
            try:
                for f in frames:
                    if stop.is_set():
                        return
                    headers.put(f.header)
            except (
                BaseException
            ) as exc:  # the sender must not wait for a header that never comes
                headers.put(exc)

        conn = self._writer.get_connection()
        hashing = None
        try:
            hashing = self._hashers.submit(hash_ahead)
            parts, batched, lead = [], 0, b""
            for key, frame in zip(keys, frames):
                header = headers.get()
                if isinstance(header, BaseException):
                    raise header
                k = key.encode()
                parts += [
                    b"%s%s$%d\r\n%s\r\n$%d\r\n%s"
                    % (lead, argc, len(k), k, frame.size, header),
                    frame.body,
                ]
                lead, batched = end, batched + frame.size
                if batched >= _SEND_BYTES or len(parts) >= _SEND_PARTS:
                    conn.send_packed_command(parts, check_health=False)
                    parts, batched = [], 0
            conn.send_packed_command(parts + [lead], check_health=False)
            out = []
            for _ in keys:
                try:
                    conn.read_response()  # OK, or None when NX found the page already there
                    out.append(True)
                except rex.ResponseError:
                    out.append(False)
            return out
        except BaseException:
            conn.disconnect()  # a half-read pipeline must not be reused
            raise
        finally:
            stop.set()
            if hashing is not None:
                wait_for_jobs(
                    [hashing]
                )  # it reads the caller's pages: done before the job ends
            self._writer.release(conn)

    async def _delete(self, keys):
        async with self.client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.delete(k)
            return sum(await pipe.execute())

    async def _scan(self, batch):
        """SCAN in batches, one pipelined STRLEN per batch. Redis keeps no write time."""
        keys: list[str] = []
        async for raw in self.client.scan_iter(match="*", count=batch):
            keys.append(raw.decode() if isinstance(raw, bytes) else raw)
            if len(keys) >= batch:
                yield await self._sized(keys)
                keys = []
        if keys:
            yield await self._sized(keys)

    async def _sized(self, keys: list[str]) -> list[StoredPage]:
        """The string keys among `keys`, with their sizes: another application's list or
        hash in the same database answers STRLEN with an error, and is skipped."""
        async with self.client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.strlen(k)
            sizes = await pipe.execute(raise_on_error=False)
        return [
            StoredPage(k, n, None)
            for k, n in zip(keys, sizes)
            if isinstance(n, int) and n
        ]

    async def _put_meta(self, name, data):
        await self.client.set(name, bytes(data), ex=self.config.ttl_s)

    async def _get_meta(self, name):
        """A manifest of at most MANIFEST_LIMIT bytes (a longer one is none), or None where
        missing or of another type (a list anyone could put there): never an error that
        stops `store ls` or a purge."""
        return await self._prefix_of(name, MANIFEST_LIMIT) or None

    def touch(self, keys) -> None:
        """Pages that just left host: their copies here are now the ones that count, yet
        Redis saw them only when they were written. With `maxmemory-policy allkeys-lru` (or
        -lfu), as docs/stores.md advises, Redis would evict first the pages served from
        host all day. So they are sent a TOUCH (with `ttl_s`: an EXPIRE, which also renews
        their time to live), which counts as an access. In the background on the store's
        loop, one pipelined batch at a time; keys given meanwhile wait for it (up to
        `_TOUCH_BACKLOG`, the rest dropped: it is an order hint). A failure is counted and
        logged once by the store call, never raised."""
        self._to_touch.extend(
            list(keys)[: max(0, _TOUCH_BACKLOG - len(self._to_touch))]
        )
        if self._to_touch and (self._toucher is None or self._toucher.done()):
            self._toucher = asyncio.get_running_loop().create_task(self._touch_all())

    async def _touch_all(self) -> None:
        while self._to_touch:
            keys, self._to_touch = (
                self._to_touch[:_TOUCH_BATCH],
                self._to_touch[_TOUCH_BATCH:],
            )
            try:
                await self._call("touch", self._touch(keys))
            except KvtierError:  # counted and logged by _call; the rest are only hints
                self._to_touch.clear()
                return
            self.touched += len(keys)

    async def _touch(self, keys: list[str]) -> None:
        ttl = self.config.ttl_s
        async with self.client.pipeline(transaction=False) as pipe:
            for k in keys:
                if ttl is None:
                    pipe.touch(k)
                else:
                    pipe.expire(k, ttl)
            await pipe.execute(
                raise_on_error=False
            )  # a key gone meanwhile answers 0: fine

    async def _close(self):
        if self._listener is not None and not self._listener.done():
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
        if self._toucher is not None and not self._toucher.done():
            self._toucher.cancel()
            await asyncio.gather(self._toucher, return_exceptions=True)
        await self.client.aclose()
        if self._writer is not None:
            self._threads.shutdown(wait=True)
            self._hashers.shutdown(wait=True)
            self._writer.disconnect()

    def _map_error(self, op, exc):
        import redis.exceptions as rex

        if isinstance(exc, rex.TimeoutError):
            return StoreTimeout(f"redis.{op}: {exc}")
        if isinstance(
            exc,
            (
                rex.ConnectionError,
                ConnectionError,
                OSError,
                asyncio.IncompleteReadError,
            ),
        ):
            return StoreUnavailable(f"redis.{op}: {type(exc).__name__}: {exc}")
        if isinstance(exc, rex.RedisError):
            return StoreError(f"redis.{op}: {type(exc).__name__}: {exc}")
        return super()._map_error(op, exc)

    def _extra_stats(self):
        return {
            "url": redact_url(self.config.url),
            "cluster": self.config.cluster,
            "touched": self.touched,
            "leases": len(self._leases),
            "removal_events": self.removal_events,
        }

    # -- leases ----------------------------------------------------------------------------

    async def _hint(self, keys, lease_s, priority):
        """Lease: each present key's TTL made at least `ttl_s` + the lease (never
        shortened); release: back to `ttl_s`. Redis has no eviction priority: a hint
        without a lease applies to none. How many keys it applied to (present ones)."""
        await self._upkeep()
        if lease_s is None:  # only this store's own leases are released
            held = [k for k in keys if k in self._leases]
            self._leases.forget(held)
            return await self._back_to_policy(held) if held else 0
        for key in keys:
            self._leases.apply(key, lease_s, 0)
        ms = int((lease_s + (self.config.ttl_s or 0)) * 1000)
        present = await self._lengthen(keys, ms)
        self._leases.forget(k for k, here in zip(keys, present) if not here)
        return sum(present)

    async def _lengthen(self, keys: list[str], ms: int) -> list[bool]:
        """Each key's TTL at least `ms` (a key with none keeps none: no TTL outlives any
        lease); whether each key is there."""
        if self.config.ttl_s is None:
            async with self.client.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.touch(k)
                return [bool(n) for n in await pipe.execute()]
        if self._expire_gt:
            async with self.client.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.exists(k)
                    pipe.pexpire(k, ms, gt=True)
                got = await pipe.execute(raise_on_error=False)
            if not any(isinstance(r, Exception) for r in got):
                return [bool(n) for n in got[::2]]
            self._expire_gt = False  # a server before 7.0: no GT
        async with self.client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.pttl(k)
            ttls = await pipe.execute()
        async with self.client.pipeline(transaction=False) as pipe:
            for k, ttl in zip(keys, ttls):
                if 0 <= ttl < ms:  # -1: no TTL (longer than any); -2: absent
                    pipe.pexpire(k, ms)
            await pipe.execute(raise_on_error=False)
        return [ttl != -2 for ttl in ttls]

    async def _back_to_policy(self, keys: list[str]) -> int:
        """Keys whose lease ended: their TTL is `ttl_s` again (as a touch sets it)."""
        if self.config.ttl_s is None:
            return await self._exists_count(keys)
        async with self.client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.expire(k, self.config.ttl_s)
            return sum(bool(n) for n in await pipe.execute(raise_on_error=False))

    async def _exists_count(self, keys: list[str]) -> int:
        async with self.client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.exists(k)
            return sum(bool(n) for n in await pipe.execute())

    async def _upkeep(self) -> None:
        """On each write, lookup and hint: leases that ended on kvtier's clock go back to
        the store's TTL policy, and the notification listener runs if one is wanted. A
        failure here is counted and logged, never the call's: the call itself says
        whether the server answers (a TTL left longer ends by itself)."""
        ended = self._leases.expire()
        wanted = self._watch_wanted and (
            self._listener is None or self._listener.done()
        )
        if wanted and time.monotonic() - self._watch_tried < _WATCH_RETRY_S:
            wanted = False
        if not ended and not wanted:
            return
        try:
            if ended:
                await self._back_to_policy(ended)
            if wanted:
                self._watch_tried = time.monotonic()
                await self._start_watch()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.counters.errors += 1
            self.complain("error", f"leases and notifications: {exc}")
            if wanted:
                self.removal_events = f"lost: {type(exc).__name__} (retried on a call)"

    # -- removals --------------------------------------------------------------------------

    def watch(self, callback) -> None:
        """`Store.watch`; the listener of keyspace notifications starts with the next store
        call on the loop (its subscription made before that call goes on)."""
        super().watch(callback)
        self._watch_wanted = callback is not None
        if callback is None and self._listener is not None:
            self._listener.cancel()

    async def _start_watch(self) -> None:
        if self.config.cluster:
            self.removal_events = "off: a cluster (keyspace notifications are per node)"
            self._watch_wanted = False
            return
        try:
            flags = (await self.client.config_get("notify-keyspace-events")).get(
                "notify-keyspace-events", ""
            )
        except Exception as exc:  # CONFIG may be disabled (managed servers)
            self._watch_wanted = False
            self._removals_off(f"off: CONFIG GET refused ({type(exc).__name__})")
            return
        flags = flags.decode() if isinstance(flags, bytes) else flags
        wanted = [
            name
            for name, flag in (("expired", "x"), ("evicted", "e"))
            if "E" in flags and (flag in flags or "A" in flags)
        ]
        if not wanted:  # looked at again on a later call: it may be turned on
            self._removals_off(
                f"off: notify-keyspace-events={flags!r} lacks Ex and Ee "
                "(CONFIG SET notify-keyspace-events Exe)"
            )
            return
        db = self.client.connection_pool.connection_kwargs.get("db", 0)
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(
                self._mark_channel, *(f"__keyevent@{db}__:{name}" for name in wanted)
            )
        except BaseException:
            await pubsub.aclose()
            raise
        self.removal_events = f"on ({', '.join(wanted)})"
        self._listener = asyncio.get_running_loop().create_task(self._listen(pubsub))

    def _removals_off(self, why: str) -> None:
        """Say why removals are not announced: in the stats, and logged once a reason."""
        if why != self.removal_events:
            log.warning("redis store: %s; removals are not announced", why)
        self.removal_events = why

    async def _told_stored(self, keys: list[str]) -> None:
        """Tell the watcher of pages just stored in the server's order. Their SETs'
        replies and the notifications race on two connections (a page evicted just after
        its SET would be taken for stored; one whose older copy's eviction came late, for
        dropped), so a transaction PUBLISHes a mark and asks which of them exist, at one
        point of the server's order: the listener tells those as it takes the mark, after
        every notification before it and before every one after. The call waits for
        that, up to `socket_timeout_s` or half the call's `timeout_s`, whichever is
        less; then it tells them itself, and the listener, deaf to its marks, is
        restarted on a later call. A listener that ends (its connection dropped) hands
        every mark it was owed back to its call at once. Without a listener: told at
        once."""
        if not keys or self._watcher is None:
            return
        if self._listener is None or self._listener.done():
            self._changed(True, keys)
            return
        loop = asyncio.get_running_loop()
        token = str(next(self._mark_ids))
        present, taken = loop.create_future(), loop.create_future()
        self._marks[token] = (present, taken)
        wait_s = min(self.config.socket_timeout_s, self.timeout_s / 2)
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.publish(self._mark_channel, token)
                for k in keys:
                    pipe.exists(k)
                got = await pipe.execute()
            present.set_result([k for k, n in zip(keys, got[1:]) if n])
            try:
                await asyncio.wait_for(asyncio.shield(taken), wait_s)
            except asyncio.TimeoutError:  # the listener missed the mark
                self._drop_listener(f"a mark did not come back within {wait_s:g}s")
        except Exception:
            pass  # the listener is gone or slow: told below, out of order at worst
        finally:
            if not present.done():
                present.set_result(keys)
            if self._marks.pop(token, None) is not None:
                self._changed(True, keys)

    def _drop_listener(self, why: str) -> None:
        """The listener missed what the server sent it (a lost connection it came back
        from, or a half-open one): cancelled, so the calls after this one do not wait on
        it; `_upkeep` starts another on a later call."""
        if self._listener is not None and not self._listener.done():
            self._listener.cancel()
        self.removal_events = f"lost: {why} (restarted on a call)"
        self.complain("error", f"keyspace notifications: {why}")

    async def _take_mark(self, token: str) -> None:
        """The listener reached a mark (`_told_stored`): tell the pages that existed then,
        before any notification after it. The mark stays its call's until then: a call
        that gave up waiting (or a listener cancelled meanwhile) tells them itself."""
        mark = self._marks.get(token)
        if mark is None:
            return
        present, taken = mark
        try:
            keys = await asyncio.wait_for(
                asyncio.shield(present), self.config.socket_timeout_s
            )
        except asyncio.TimeoutError:
            return  # its call tells them
        if self._marks.pop(token, None) is None:
            return  # its call told them meanwhile
        self._changed(True, keys)
        if not taken.done():
            taken.set_result(None)

    async def _listen(self, pubsub) -> None:
        """Keys the server expired or evicted, to the watcher, as they come."""
        try:
            async for msg in pubsub.listen():
                if msg.get("type") != "message":
                    continue
                data, channel = msg["data"], msg["channel"]
                data = data.decode() if isinstance(data, bytes) else data
                channel = channel.decode() if isinstance(channel, bytes) else channel
                if channel != self._mark_channel:
                    self._removed([data])
                else:
                    await self._take_mark(data)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.removal_events = f"lost: {type(exc).__name__} (restarted on a call)"
            self.complain("error", f"keyspace notifications: {exc}")
        finally:
            for _, taken in self._marks.values():  # their calls tell their pages now
                if not taken.done():
                    taken.set_result(None)
            try:
                await pubsub.aclose()
            except Exception:
                pass


def _wrong_type(exc: BaseException) -> bool:
    """A WRONGTYPE reply: the key holds another application's list, hash or set."""
    return str(exc).startswith("WRONGTYPE")
