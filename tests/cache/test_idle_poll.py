"""A poll after which nothing moved returns at once (`Completions.poll`), and never at the
price of a completion, a stop or a retry: each test drives a request through the sequence a
server runs and checks the poll that must not be skipped is not."""

import asyncio
import random
import threading
import time

import numpy as np
import pytest
import torch

from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.cache.completions import LAZY_POLLS
from kvtier.testing.parts import SimStreams
from tests.controller.helpers import (
    compute,
    fill,
    forward,
    make_cache,
    read_back,
    same_kv,
    settle,
)


class GatedStore(MemoryStore):
    """`batch_exists` answers only once the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(MemoryStoreConfig())
        self.gate = threading.Event()
        self.asked = threading.Event()

    async def _exists(self, keys):
        self.asked.set()
        while not self.gate.is_set():
            await asyncio.sleep(0.001)
        return await super()._exists(keys)


class SetGatedStore(MemoryStore):
    """`batch_set` stores only once the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(MemoryStoreConfig())
        self.gate = threading.Event()
        self.asked = threading.Event()

    async def _set(self, keys, frames):
        self.asked.set()
        while not self.gate.is_set():
            await asyncio.sleep(0.001)
        return await super()._set(keys, frames)


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.001)


def _counters(cache):
    c = cache.stats_obj.counters
    return c.polls, c.polls_idle


def test_polls_with_nothing_moved_are_idle_and_the_next_move_is_applied():
    cache = make_cache()
    kv = compute(cache, np.arange(100, 116), seed=1)
    settle(cache)
    polls, idle = _counters(cache)
    for _ in range(5):
        assert cache.poll() == []
    assert _counters(cache) == (polls + 5, idle + 5)  # nothing ran in the background
    cache.flush()  # from the store again: a prefetch, polls that apply it, a load
    got, back = read_back(cache, np.arange(100, 116), "r")
    assert got.storage_hit == 16 and same_kv(back, kv)
    assert (
        _counters(cache)[1] - idle < _counters(cache)[0] - polls
    )  # the moves were read
    settle(cache)
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()


def test_an_abort_while_nothing_moves_stops_the_prefetch_at_the_next_poll():
    """The scheduler's own change (a stop wish) is what the next poll must read: no
    background thread moves while the store has not answered."""
    store = GatedStore()
    cache = make_cache(store_obj=store)
    compute(cache, np.arange(100, 116), seed=1)
    settle(cache)
    cache.flush()
    assert not cache.acquire(
        np.arange(100, 116), "r"
    ).ready  # its prefetch waits on the store
    assert store.asked.wait(5)
    cache.poll()
    polls, idle = _counters(cache)
    cache.poll()
    assert _counters(cache) == (polls + 1, idle + 1)
    op = cache.prefetcher.prefetches["r"].op
    cache.abort("r")
    cache.poll()
    assert op.stop, "the abort's stop was not applied: the poll was skipped"
    store.gate.set()
    settle(cache)
    assert "r" not in cache.prefetcher.prefetches
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()


def test_a_new_prefetch_alone_leaves_the_next_poll_idle_until_its_store_answers():
    """Starting a prefetch changes nothing a poll could apply before its store answers (a
    full poll would agree on the same numbers and apply nothing); the answer is a move, and
    the poll after it grants the pages."""
    store = GatedStore()
    cache = make_cache(store_obj=store)
    kv = compute(cache, np.arange(100, 116), seed=1)
    settle(cache)
    cache.flush()
    polls, idle = _counters(cache)
    assert not cache.acquire(np.arange(100, 116), "r").ready
    assert store.asked.wait(
        5
    )  # the storage thread is inside batch_exists: nothing moved
    assert cache.poll() == []
    assert _counters(cache) == (polls + 1, idle + 1)
    op = cache.prefetcher.prefetches["r"].op
    store.gate.set()
    while not op.granted:
        assert cache.poll() in ([], ["r"])
        cache.wait_progress(0.01)
    got, back = read_back(cache, np.arange(100, 116), "r")
    assert got.storage_hit == 16 and same_kv(back, kv)
    settle(cache)
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()


def test_a_completion_whose_apply_raised_is_read_again_though_nothing_moves(
    monkeypatch,
):
    """Applying a landed prefetch raises once (a bug): it is released, and ends at a later
    poll although its store op had already ended (no background move follows)."""
    cache = make_cache()
    kv = compute(cache, np.arange(100, 116), seed=1)
    settle(cache)
    cache.flush()
    calls = []
    real = cache.prefetcher._insert_landed

    def flaky(p, landed):
        calls.append(landed)
        if len(calls) == 1:
            raise RuntimeError("a bug while applying")
        return real(p, landed)

    monkeypatch.setattr(cache.prefetcher, "_insert_landed", flaky)
    got = cache.acquire(np.arange(100, 116), "r")
    assert not got.ready
    op = cache.prefetcher.prefetches["r"].op
    ready = []
    while not op.granted:  # the store answered: a poll grants host pages
        ready += cache.poll()
        cache.wait_progress(0.01)
    while not op.settled:  # the pages land, the op ends, with no poll in between
        cache.wait_progress(0.01)
    assert not calls
    ready += cache.poll()  # applies the whole op at once: the insert raises
    assert calls and cache.stats()["counters"]["apply_errors"] == 1
    for _ in range(
        3
    ):  # nothing moves any more: only a poll that reads it again ends it
        ready += cache.poll()
    assert ready == ["r"]
    got = cache.acquire(np.arange(100, 116), "r")
    assert got.ready and got.storage_hit == 0  # the broken prefetch inserted nothing
    new = cache.alloc(16 - got.indices.numel())
    forward(cache, "r")
    fill(cache, new, seed=2)
    cache.cache_finished("r", np.arange(100, 116), torch.cat([got.indices, new]))
    settle(cache)
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()
    assert (
        kv
    )  # computed once, read back never: the test is about the poll, not the bytes


def _landed_write(cache, streams, tokens):
    """A request computed and finished; the poll after it submits its write, which lands."""
    compute(cache, tokens, seed=3)
    cache.poll()
    (job,) = streams.pending
    streams.resolve(job, "ok", random.Random(0))
    return cache.stats_obj.counters


def test_a_landed_write_waits_at_most_lazy_polls_polls_to_be_applied():
    """No request waits for a write: polls leave it for later (one full poll applies what
    landed meanwhile together), `LAZY_POLLS` in a row at most; the next one applies it."""
    streams = SimStreams(random.Random(0))
    cache = make_cache(store="none", stream_factory=streams.factory)
    c = _landed_write(cache, streams, np.arange(100, 116))
    writes, deferred = c.writes, c.polls_deferred
    for _ in range(LAZY_POLLS):
        assert cache.poll() == []
    assert (c.writes, c.polls_deferred) == (writes, deferred + LAZY_POLLS)
    assert cache.tree.protected_size() == 16  # still locked by its write
    cache.poll()
    assert c.writes == writes + 1 and cache.tree.protected_size() == 0
    assert cache.match_prefix(
        np.arange(100, 116), count=False
    ).last_device_node.backed_up
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()


@pytest.mark.parametrize("short", ["alloc", "evict"])
def test_an_allocation_short_of_room_makes_the_next_poll_apply_landed_writes(short):
    """Writes in flight lock device pages: a scheduler whose allocation failed (or an
    engine whose own allocator asked kvtier to evict, and got less) polls for them, and
    that poll applies what landed."""
    streams = SimStreams(random.Random(0))
    cache = make_cache(store="none", stream_factory=streams.factory)
    c = _landed_write(cache, streams, np.arange(100, 116))
    writes = c.writes
    cache.poll()
    assert c.writes == writes  # left for later
    size = cache.config.pool.size
    if short == "alloc":
        assert cache.alloc(size) is None  # the locked pages cannot be evicted
    else:
        assert cache.evict(16) == 0
    cache.poll()
    assert c.writes == writes + 1 and cache.tree.protected_size() == 0
    mine = cache.alloc(
        size - cache.page_size
    )  # every page but the padding one: evicted now
    assert mine is not None
    cache.free(mine)
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()


def test_a_load_short_of_device_room_makes_the_next_poll_apply_landed_writes():
    """A request's host prefix is loaded into slots allocated for it; when writes in flight
    lock every device page, the load finds no room and the request recomputes that prefix.
    The poll after it applies the writes that landed (it used to leave them for up to
    `LAZY_POLLS` polls, and every request meanwhile missed its host prefix the same way)."""
    streams = SimStreams(random.Random(0))
    cache = make_cache(store="none", stream_factory=streams.factory)
    c = cache.stats_obj.counters
    a = np.arange(100, 116)
    _landed_write(cache, streams, a)
    for _ in range(LAZY_POLLS + 1):
        cache.poll()
    assert c.writes == 1  # A is on device and host
    cache.evict(16)  # now on host only
    for i in range(
        cache.config.pool.size // 16
    ):  # the device fills with writes that land, unapplied
        _landed_write(cache, streams, np.arange(1000 * (i + 2), 1000 * (i + 2) + 16))
    writes = c.writes
    assert (
        cache.slots.device_free() == 0 and cache.room() == 0
    )  # every device page is a write's
    got = cache.acquire(np.concatenate([a, [7, 7, 7, 7]]), "r")
    assert got.ready and got.host_hit == 0  # no room to load A: recomputed, a miss
    cache.abort("r")
    cache.poll()
    assert (
        c.writes > writes and cache.room() > 0
    )  # applied: their pages may be evicted again
    got = cache.acquire(a, "again")
    assert got.ready and got.host_hit == 16  # room now: its load starts
    for job in list(streams.pending):
        streams.resolve(job, "ok", random.Random(0))
    forward(cache, "again")
    cache.cache_finished("again", a, got.indices)
    cache.drain()
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()


def test_a_backups_end_wakes_no_napping_scheduler_and_a_prefetchs_move_does():
    """No request waits for a backup: its end leaves `wait_progress` asleep, and a later
    poll still applies it. A prefetch's move (the store answered) wakes the nap."""
    store = SetGatedStore()
    cache = make_cache(store_obj=store)
    storage, c = cache.controller.storage, cache.stats_obj.counters
    tokens = np.arange(100, 116)
    kv = compute(cache, tokens, seed=1)
    cache.controller.wait_writes()
    for _ in range(
        LAZY_POLLS + 1
    ):  # the landed write is applied: its backup goes to the store
        cache.poll()
    assert store.asked.wait(30)
    moved = storage.backups_moved
    storage.progress.clear()
    store.gate.set()
    _until(lambda: storage.backups_moved > moved, "the backup's end")
    assert not storage.progress.is_set()  # a nap would sleep on
    settle(cache)
    assert c.l3_write_pages == 4  # applied: stored
    cache.flush()
    storage.progress.clear()
    got = cache.acquire(tokens, "r")
    assert not got.ready
    _until(storage.progress.is_set, "the prefetch's wake-up")
    got, back = read_back(cache, tokens, "r")
    assert got.storage_hit == 16 and same_kv(back, kv)
    settle(cache)
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()


def test_the_grants_of_one_poll_make_host_room_in_one_eviction():
    """Two prefetches whose store answered before the same poll: that poll evicts host room
    for both at once (one pass over the host leaves), then grants each; both are served."""
    store = GatedStore()
    store.gate.set()
    cache = make_cache(store_obj=store)
    xs = [np.arange(1000 * i, 1000 * i + 16) for i in (1, 2)]
    kvs = [compute(cache, x, seed=i) for i, x in enumerate(xs)]
    settle(cache)
    cache.flush()  # in the store only
    for i in range(8):  # the host fills with others
        compute(cache, np.arange(50000 + 100 * i, 50000 + 100 * i + 16), seed=10 + i)
    settle(cache)
    assert cache.controller.host_available() < 32  # room for the two must be evicted
    store.gate.clear()
    for i, x in enumerate(xs):
        assert not cache.acquire(x, f"x{i}").ready
    ops = [cache.prefetcher.prefetches[f"x{i}"].op for i in range(2)]
    store.gate.set()
    _until(lambda: all(op.present is not None for op in ops), "both stores' answers")
    passes = []
    evict = cache.slots.evict_host
    cache.slots.evict_host = lambda n: (passes.append(n), evict(n))[1]
    cache.poll()
    assert all(op.granted for op in ops) and len(passes) == 1
    for i, (x, kv) in enumerate(zip(xs, kvs)):
        got, back = read_back(cache, x, f"x{i}")
        assert got.storage_hit == 16 and same_kv(back, kv)
    settle(cache)
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()
