"""The file store's direct calls: a page read or write that the caller's own thread hands
straight to the store's I/O threads, with no store loop in between (`FileStore.begin_get_into`,
`FileStore.begin_set`), for a caller that must not wait on a loop round trip (the vLLM tier,
docs/vllm.md).

One hop: the caller submits the call's thread jobs (`DirectCall.thread_jobs`, one for each
group of pages), each job reads (or writes) its pages, verifying every one, and the last to
end tells the caller (`on_done`, on that I/O thread: it must only queue). The caller then
collects the results (`FileStore.end_get_into` / `end_set`) on its own thread.

What a loop call gets from the store loop, the caller keeps itself: the breaker's admission
and outcome, the timeout (`deadline`: past it the call failed as a whole; past it by the
store's `timeout_s` again, it is given up on: `FileStore.give_up`, whose stop flags keep
every buffer of the caller's unwritten from then on, as for a loop call), and a row never
handed back while a thread may still write it.

The store's index (`_sizes`, the byte counts, the shared usage file) stays the store loop's:
a direct call's effects on it (pages read, written, found missing or bad) are queued
(`FileStore._handoff`, a deque: appends from any thread) and applied on the loop thread
before its next call, or by `FileStore.settle_direct`, which the caller posts to the loop
when the bytes written since the last one pass a bound (the capacity is then enforced).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from functools import partial

from kvtier.backends import frame
from kvtier.backends.file_io import (
    DISK_FULL,
    read_pages_into,
    read_sealed_into,
    write_pages,
)
from kvtier.backends.frame import FrameError
from kvtier.backends.io_threads import StopFlag
from kvtier.errors import StoreAbandoned, StoreError
from kvtier.hashing import Recent, split_key


class DirectCall:
    """One direct read or write: its thread jobs' futures and stop flags, its deadline."""

    __slots__ = (
        "write",
        "keys",
        "sizes",
        "frames",
        "groups",
        "index",
        "futures",
        "stops",
        "deadline",
        "timed_out",
        "given_up",
        "ended",
        "on_done",
        "tag",
        "_ends",
    )

    def __init__(self, write: bool, keys: list[str], deadline: float) -> None:
        self.write = write
        self.keys = keys
        self.sizes: list[int] = []  # each page's bytes (its buffer's), by key
        self.frames: list[int] = []  # a write's frame sizes, by key
        self.groups: list[list[int]] = []  # the key indices of each thread job
        self.index: list[int] = []  # key index of each item submitted
        self.futures: list = []
        self.stops: list = []
        self.deadline = deadline
        self.timed_out = False  # past `deadline`: failed as a whole (the breaker told)
        self.given_up = False  # its threads abandoned: nothing of it is used
        self.ended = False  # collected by its caller
        self.on_done: Callable[[DirectCall], None] | None = None
        self.tag = None  # the caller's (the job it runs)
        self._ends = (
            itertools.count()
        )  # next() is atomic: the last job to end calls on_done

    @property
    def thread_jobs(self) -> int:
        """How many thread jobs it took: its hops from the caller's thread."""
        return len(self.futures)

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def _job_ended(self, _future) -> None:
        if next(self._ends) == len(self.futures) - 1 and self.on_done is not None:
            self.on_done(self)


class PageLocations:
    """Store keys -> (page file path, namespace id, page hash), each key checked: what a
    direct call needs of every key. An engine moves the same keys again and again, and
    each check and path made afresh is a parse and a string build (`FileStore._file`); the
    recent ones are remembered (`Recent`: bounded, any thread may call it). The root is
    fixed for the store's lifetime."""

    __slots__ = ("_root", "_known")

    def __init__(self, root: str, bound: int = 1 << 15) -> None:
        self._root, self._known = root, Recent(bound)

    def __call__(self, keys) -> list[tuple[str, str, bytes]]:
        if isinstance(keys, str):
            raise ValueError("keys: expected a sequence of keys, got one string")
        return self._known.each(keys, self._new, "store keys")

    def _new(self, key: str) -> tuple[str, str, bytes]:
        _, ns, h = split_key(key)  # raises StoreKeyError, naming it
        head, _, hx = key.rpartition("/")
        return self._known.keep(
            key, (f"{self._root}/{head}/{hx[:2]}/{hx[2:4]}/{hx}", ns, h)
        )


class DirectCalls:
    """`FileStore`'s direct calls (this module's docstring): a mixin of the store, whose
    `__init__` makes the state they share with its loop side (`_pool`, `_handoff`,
    `_locations`, `_hung`, the byte counts), and whose index methods the handed-off
    effects name (`_touch_all`, `_forget_all`, `_index_written`, `_dropped`,
    `_note_disk_full`)."""

    async def _call(self, op, coro):
        self._take_handoff()  # what direct calls did, before this call reads the index
        return await super()._call(op, coro)

    def _take_handoff(self) -> None:
        """Apply the direct calls' effects on the index (the loop thread, which owns it)."""
        while self._handoff:
            fn, arg = self._handoff.popleft()
            try:
                fn(arg)
            except OSError as exc:  # the shared byte count's file: this call goes on
                self.counters.errors += 1
                self.complain("error", f"applying a direct call's effects: {exc}")

    def begin_get_into(self, keys, views, on_done=None, drop_bad=False) -> DirectCall:
        """Start reading each page of `keys` into its view of `views`, verified, in the I/O
        threads, from the caller's thread (`batch_get_into`'s work, no loop). With
        `drop_bad` a page that does not verify is deleted in the same thread job. A key
        abandoned stuck before is not read (a miss). `on_done(call)` runs on an I/O
        thread once every job ended; then `end_get_into`, or `give_up` past the deadline."""
        where = self._locations(keys)
        if len(views) != len(keys):
            raise ValueError(
                f"begin_get_into: {len(keys)} keys but {len(views)} buffers"
            )
        call = DirectCall(False, list(keys), time.monotonic() + self.timeout_s)
        read = (
            partial(read_sealed_into, self.codec)
            if self.codec.keyed
            else read_pages_into
        )
        job = partial(read_dropping_bad, read) if drop_bad else read
        items, index, sizes, hung = [], [], call.sizes, self._hung
        for i, ((path, ns, h), v) in enumerate(zip(where, views)):
            view = (
                v
                if type(v) is memoryview and v.ndim == 1 and v.format == "B"
                else memoryview(v).cast("B")
            )
            sizes.append(len(view))
            if not hung or call.keys[i] not in hung:
                items.append((path, ns, h, view))
                index.append(i)
        self._begin(call, job, items, index, on_done)
        return call

    def begin_set(self, keys, pages, on_done=None) -> DirectCall:
        """Start writing each page of `keys` (framed, atomically: `write_pages`) in the I/O
        threads, from the caller's thread; then `end_set`, or `give_up` (`begin_get_into`)."""
        where = self._locations(keys)
        if len(pages) != len(keys):
            raise ValueError(f"begin_set: {len(keys)} keys but {len(pages)} pages")
        call = DirectCall(True, list(keys), time.monotonic() + self.timeout_s)
        items, index = [], []
        fsync, inside, room = (
            self.config.fsync,
            self._inside,
            self.config.capacity_bytes,
        )
        codec, sizes, frames = self.codec, call.sizes, call.frames
        for i, ((path, ns, h), p) in enumerate(zip(where, pages)):
            view = (
                p
                if type(p) is memoryview and p.ndim == 1 and p.format == "B"
                else memoryview(p).cast("B")
            )
            f = frame.Frame(ns, h, view, codec)
            size = f.size
            sizes.append(len(view))
            frames.append(size)
            if size <= room:
                items.append((path, f, fsync, inside))
                index.append(i)
        self._begin(call, write_pages, items, index, on_done)
        return call

    def _begin(self, call: DirectCall, job, items, index, on_done) -> None:
        """`items` as one thread job: a thread for each call, as vLLM's own fs tier gives
        each job one, bounded by the pool (calls past it queue). A call split over the
        threads when it came first in a step's burst took them all, and the calls behind
        it waited for their share: on 4 jobs of 64 pages the last thread read 80 pages
        where each could have read 64; and every thread job is one more wake-up."""
        self._direct_calls += 1
        call.on_done = on_done
        if items:
            stop = StopFlag()
            call.groups.append(index)
            call.stops.append(stop)
            call.futures.append(self._pool.submit(partial(job, items), stop))
            call.futures[0].add_done_callback(call._job_ended)
        elif on_done is not None:
            on_done(call)

    def _results(self, call: DirectCall) -> list:
        """Each key's thread job result, by key index (None: not read or written, as a job
        stopped before it)."""
        self._direct_calls -= 1
        call.ended = True
        n = len(call.keys)
        if len(call.futures) == 1 and len(call.groups[0]) == n:  # every key went
            got = call.futures[0].result()
            if len(got) == n:
                return got
        out: list = [None] * n
        for idx, fut in zip(call.groups, call.futures):
            for i, r in zip(idx, fut.result()):
                out[i] = r
        return out

    def end_get_into(self, call: DirectCall, errors: set | None = None) -> list[bool]:
        """A direct read's outcome (the caller's thread, once every job ended): True where
        the view holds the verified page (`batch_get_into`); `errors` gets the keys whose
        read failed on an I/O error (the page may be good). Index effects are handed off."""
        results = self._results(call)
        out, touched, forgotten, dropped = [], [], [], []
        hits = hit_bytes = 0
        for k, n, r in zip(call.keys, call.sizes, results):
            if r is True:  # the common case, counted once for all below
                touched.append(k)
                hits += 1
                hit_bytes += n
                out.append(True)
                continue
            if isinstance(r, tuple):  # did not verify, and was deleted (`drop_bad`)
                r, size = r
                dropped.append((k, size))
            elif isinstance(r, OSError):
                forgotten.append(k)
                if isinstance(r, FileNotFoundError):
                    r = None
                else:
                    self.counters.errors += 1
                    self.complain(
                        "error", f"reading {k}: {r}; dropped from the index, a miss"
                    )
                    if errors is not None:
                        errors.add(k)
            out.append(self._count_read(k, r, n) is not None)
        if hits:  # `_count_read`'s for each page read whole
            self.counters.gets += hits
            self.counters.hits += hits
            self.counters.get_bytes += hit_bytes
            self._handoff.append((self._touch_all, touched))
        if forgotten:
            self._handoff.append((self._forget_all, forgotten))
        if dropped:
            self._handoff.append((self._dropped, dropped))
        return out

    def end_set(self, call: DirectCall) -> list[bool]:
        """A direct write's outcome (`batch_set`'s); StoreError where no page could be
        written. The pages written are indexed on the loop thread (handed off), their
        bytes counted in `direct_unsettled` until the caller posts `settle_direct`."""
        outcomes = self._results(call)
        n = len(call.keys)
        failed = {i: e for i, e in enumerate(outcomes) if isinstance(e, OSError)}
        ok = [e is not None and not isinstance(e, OSError) for e in outcomes]
        self.counters.sets += n
        if failed or None in outcomes:
            self.counters.set_failures += n - sum(ok)
            self.counters.set_bytes += sum(s for s, good in zip(call.sizes, ok) if good)
        else:  # every page written
            self.counters.set_bytes += sum(call.sizes)
        full = sum(call.frames[i] for i, e in failed.items() if e.errno in DISK_FULL)
        if full:  # room is made by the next settle_direct; these pages are not stored
            self._handoff.append((self._note_disk_full, full))
            self.direct_unsettled += self.config.capacity_bytes
        if failed and len(failed) == n:
            i, err = next(iter(failed.items()))
            self.counters.errors += 1
            message = f"file.batch_set: writing {call.keys[i]}: {err}"
            self.complain("error", message)
            raise StoreError(message) from err
        for i, err in failed.items():
            self.counters.errors += 1
            self.complain("error", f"writing {call.keys[i]}: {err}")
        if all(ok):
            written = (call.keys, call.frames, outcomes)
        else:
            kept = [i for i in range(n) if ok[i]]
            written = tuple(
                [column[i] for i in kept]
                for column in (call.keys, call.frames, outcomes)
            )
        if written[0]:
            self._handoff.append((self._index_written, written))
            self.direct_unsettled += sum(written[1])
        return ok

    def timed_out(self, call: DirectCall) -> str:
        """`call` ran past its deadline: counted and said, as a loop call's timeout."""
        call.timed_out = True
        self.counters.timeouts += 1
        message = f"{self.name}.{'batch_set' if call.write else 'batch_get_into'}: no answer within timeout_s={self.timeout_s}"
        self.complain("timeout", message)
        return message

    def give_up(self, call: DirectCall) -> StoreAbandoned:
        """Abandon a direct call still running `timeout_s` past its deadline (a hung mount):
        its stop flags set (once this returned no job writes a buffer of the caller's),
        the keys of its pages never asked again by this process, the stuck threads
        replaced. The StoreAbandoned to tell the breaker."""
        for stop in call.stops:
            stop.set()
        keys = [call.keys[i] for idx in call.groups for i in idx]
        self._hung.update(keys)  # read by the next begin_get_into, on this thread
        self._handoff.append((self._forget_all, keys))
        call.given_up = call.ended = True
        self._direct_calls -= 1
        n = self._pool.abandon(call.futures)
        return StoreAbandoned(
            f"{n} I/O thread(s) stuck for {self.timeout_s:.1f}s after the call's timeout: "
            "abandoned (their buffers stay out of use)"
        )

    def start_threads(self) -> None:
        """Start the I/O threads from this thread (the store loop's: they keep to its
        CPUs), before direct calls submit to them from another."""
        self._pool.start_all()

    @property
    def handoff_backlog(self) -> int:
        """How many direct calls' effects wait for the loop thread (`_take_handoff`)."""
        return len(self._handoff)

    def touch_later(self, keys) -> None:
        """`touch` from any thread: applied on the loop thread before its next call."""
        self._handoff.append((self._touch_all, list(keys)))

    async def settle_direct(self) -> None:
        """The loop thread: apply what direct calls did, then hold the capacity for the
        bytes their writes added (and make room where the disk was full for them)."""
        await self._call("settle", self._settle_direct())

    async def _settle_direct(self) -> None:
        added, self._direct_added = self._direct_added, 0
        need, self._direct_need = self._direct_need, 0
        if need:
            await self._evict_for_disk_full(need, "for the next writes")
        await self._enforce_capacity(added)


def read_dropping_bad(read, items: list[tuple], stop=None) -> list:
    """A direct read's thread job: `read(items, stop)` (file_io.read_pages_into or
    read_sealed_into), then each page that did not verify (a FrameError) unlinked here,
    where the call is already off the loop: its result becomes `(FrameError, bytes
    removed)`, so no later probe, here or in another process, finds it again."""
    out = read(items, stop)
    for i, result in enumerate(out):
        if isinstance(result, FrameError):
            path = items[i][0]
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except OSError:
                size = 0
            out[i] = (result, size)
    return out
