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
from collections.abc import Callable

from kvtier.backends.frame import FrameError
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
