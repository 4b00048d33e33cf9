"""The scheduler thread keeps the GIL inside kvtier (docs/design.md §2): in steady state a
request's pass through the cache makes no torch call besides making the tensor it hands
out (`acquire`, `alloc`) or viewing the one it is handed (`cache_finished`). Every other
torch call gives the GIL up, and on a busy server each one may cost a switch interval.
Store keys are made by the storage thread, and a prefetch's page hashes are computed there."""

from __future__ import annotations

import sys

import numpy as np
import torch

from kvtier.hashing import key_maker, page_hashes
from tests.controller.helpers import fill, make_cache

_MAKE_KEY = key_maker(
    "p", "0" * 32
).__code__  # the function that turns a page hash into a store key
# tensor metadata read without giving up the GIL (checked with a spinning thread beside them)
_KEEPS_GIL = {"stride", "data_ptr", "element_size", "is_contiguous", "numel", "dim"}


def _is_torch(fn) -> bool:
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.Tensor):
        return True
    return (getattr(fn, "__module__", None) or "").startswith("torch") or getattr(
        owner, "__name__", ""
    ).startswith("torch")


class Probe:
    """What this thread does inside each kvtier call: its torch calls (per call name, one
    list per invocation), the store keys it makes, the calls in which it hashes pages.
    sys.setprofile sees only the thread that set it: kvtier's own threads are not counted."""

    def __init__(self) -> None:
        self.by_call: dict[str, list[list[str]]] = {}
        self.keys_made = (
            0  # store keys made here (the storage thread makes them: PageKeys)
        )
        self.hashed: list[str] = []  # kvtier calls that hashed pages here

    def __call__(self, fn, *args):
        seen: list[str] = []
        self.by_call.setdefault(fn.__name__, []).append(seen)

        def hook(frame, event, arg):
            if event == "c_call" and _is_torch(arg) and arg.__name__ not in _KEEPS_GIL:
                seen.append(
                    f"{arg.__qualname__} at {frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
                )
            elif event == "call" and frame.f_code is _MAKE_KEY:
                self.keys_made += 1
            elif event == "call" and frame.f_code is page_hashes.__code__:
                self.hashed.append(fn.__name__)

        sys.setprofile(hook)
        try:
            return fn(*args)
        finally:
            sys.setprofile(None)


def _request(cache, calls: Probe, tokens: np.ndarray, rid: str, seed: int) -> None:
    """acquire (waiting while it prefetches) -> alloc -> forward -> finish, as a server runs it."""
    got = calls(cache.acquire, tokens, rid)
    while not got.ready:
        if rid in calls(cache.poll):
            got = calls(cache.acquire, tokens, rid)
        else:
            cache.wait_progress(0.01)
    finished = np.concatenate(
        [tokens, np.arange(4) + 7000 + 4 * seed]
    )  # and one generated page
    new = calls(cache.alloc, len(finished) - got.indices.numel())
    waiter = calls(cache.begin_forward, [rid])
    for layer in range(cache.pool.num_layers):
        calls(waiter.wait_layer, layer)
    fill(
        cache, new, seed
    )  # the forward writes the new KV (the engine's torch, not kvtier's)
    calls(cache.cache_finished, rid, finished, torch.cat([got.indices, new]))
    calls(cache.poll)


def _round(cache, calls: Probe, base: int) -> None:
    """A device miss, a load back from host, and a prefetch from the store."""
    tokens = np.arange(base, base + 48)
    _request(cache, calls, tokens, f"miss-{base}", 1)
    cache.drain()
    calls(cache.evict, 48)  # demoted to host: the next request loads it back
    _request(cache, calls, tokens, f"load-{base}", 2)
    cache.drain()
    cache.flush()  # only the store holds it now
    _request(cache, calls, tokens, f"prefetch-{base}", 3)
    cache.drain()


def test_a_request_makes_no_torch_call_no_key_and_no_page_hash_on_the_scheduler_thread(
    tmp_path,
):
    cache = make_cache(tmp_path, store="file", pool_size=128)
    _round(cache, Probe(), 1000)  # first use makes the copy's cached views
    calls = Probe()
    _round(cache, calls, 2000)
    c = cache.stats()["counters"]
    assert c["loads"] >= 2 and c["l3_read_pages"] >= 12, (
        "the round did not exercise loads and prefetches"
    )
    allowed = {
        "acquire": 1,
        "alloc": 1,
        "cache_finished": 1,
    }  # the tensor handed out, or in
    excess = {
        name: seen
        for name, runs in calls.by_call.items()
        for seen in runs
        if len(seen) > allowed.get(name, 0)
    }
    assert not excess, f"torch calls on the scheduler thread: {excess}"
    assert {"poll", "wait_layer", "evict", "begin_forward"} <= set(calls.by_call)
    assert calls.keys_made == 0, "store keys made on the scheduler thread"
    assert calls.hashed == [], (
        "pages hashed on the scheduler thread (a prefetch's, or a generated one's)"
    )
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()
