"""KV events of kvtier's own cache, from real engine runs (kvtier.engine over TieredCache, a
file store): replayed into a router's prefix index they say exactly which pages each tier
holds, and they predict the store hits of a second server."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtier.cache import TieredCache
from kvtier.config import load_config
from kvtier.engine.engine import Engine
from kvtier.engine.model import ModelConfig, TinyTransformer
from kvtier.engine.workloads import generate
from kvtier.events.subscriber import PrefixIndex, Subscriber
from kvtier.events.wire import wire_hash
from kvtier.hashing import page_hashes
from kvtier.tree import Tier
from tests.events.test_publisher import ipc, wait_for  # noqa: F401  (the fixture)

GEOMETRY = {
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "dtype": "float32",
    "page_size": 16,
}


def make_cache(
    root,
    pool: int,
    events: tuple[str, str] | None = None,
    page_tokens: int | None = None,
) -> TieredCache:
    doc = {
        "pool": {"size": pool, **GEOMETRY},
        "mirror": {"ratio": 1.5},
        "controller": {"prefetch_policy": "wait_complete"},
        "store": {"backend": "file", "root": str(root), "page_tokens": page_tokens},
    }
    if events is not None:
        doc["events"] = {
            "endpoint": events[0],
            "replay_endpoint": events[1],
            "topic": "kv@test",
        }
    return TieredCache(load_config(None, doc, env={}))


def settle(cache: TieredCache) -> None:
    """Every backup landed and applied; the step's events handed to the publisher."""
    cache.drain()
    cache.poll()


def collect(cache: TieredCache, sub: Subscriber) -> PrefixIndex:
    """Every batch published so far, live, in sequence order (a gap would be replayed)."""
    pub = cache.events.publisher
    assert pub.wait_sent(30), "the publisher did not send every batch"
    total = pub.stats()["batches"]
    index, seq = PrefixIndex(), 0
    while seq < total:
        m = sub.recv()
        assert m is not None, f"batch {seq} of {total} never arrived"
        assert m.seq == seq, f"batch {m.seq} after {seq - 1}: a gap"
        index.apply(m.payload)
        seq += 1
    return index


def tree_pages(cache: TieredCache, tier: Tier) -> set[int]:
    out, stack = set(), list(cache.tree.root.children.values())
    while stack:
        node = stack.pop()
        stack += node.children.values()
        if node.values[tier] is not None:
            out.update(wire_hash(h) for h in cache.tree.page_hashes(node))
    return out


def run(cache: TieredCache, turns) -> list:
    pub = cache.events.publisher
    wait_for(lambda: pub.stats()["subscriptions"] >= 1, "the subscription")
    model = TinyTransformer(
        ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn=128)
    )
    results = Engine(cache, model, max_batch=3, chunk_size=64).run(turns)
    assert [r.error for r in results if r.error] == []
    settle(cache)
    return results


def test_events_say_which_pages_each_tier_holds(tmp_path, ipc):  # noqa: F811
    cache = make_cache(
        tmp_path / "l3", pool=1024, events=ipc
    )  # small: evictions from both tiers
    sub = Subscriber(*ipc, topic="kv@test")
    try:
        run(cache, generate("multiturn", 24, 512, seed=3))
        index = collect(cache, sub)
        assert index.blocks["GPU"] == tree_pages(cache, Tier.DEVICE)
        assert index.blocks["CPU"] == tree_pages(cache, Tier.HOST)
        assert index.blocks["STORAGE"], "no page reached the store"
        assert (
            cache.stats_obj.counters.device_evicted_tokens > 0
            and cache.stats_obj.counters.host_evicted_tokens > 0
        )
        cache.tree.sanity_check()
        cache.check_accounting()
    finally:
        cache.close()
        sub.close()


def acquire_ready(cache: TieredCache, tokens: list[int], rid: str):
    for _ in range(1000):
        got = cache.acquire(tokens, rid)
        if got.ready:
            return got
        deadline = time.monotonic() + 30
        while rid not in cache.poll():
            assert time.monotonic() < deadline, f"{rid}: its prefetch never ended"
            cache.wait_progress(0.01)
    raise AssertionError(f"{rid}: never ready")


@pytest.mark.parametrize("page_tokens", [None, 48])
def test_events_of_one_server_predict_the_store_hits_of_the_next(
    tmp_path,
    ipc,  # noqa: F811
    page_tokens,
):
    """With store pages of 3 pages (48 tokens) too: a store page's first pages, stored by
    a longer sequence's backup from its ancestor's host copy, are announced with it (they
    were not: the router's prefix stopped at every store page across two nodes); a prompt
    is served at least up to its last whole store page the events announced, at most all
    they announced."""
    turns = generate("docqa", 12, 512, seed=4)
    first = make_cache(tmp_path / "l3", pool=4096, events=ipc, page_tokens=page_tokens)
    sub = Subscriber(*ipc, topic="kv@test")
    try:
        prompts = [
            r.prompt[:-1] for r in run(first, turns)
        ]  # what the engine asked the cache for
        index = collect(first, sub)
    finally:
        first.close()
        sub.close()
    second = make_cache(
        tmp_path / "l3", pool=16384, page_tokens=page_tokens
    )  # a new server, the same store
    try:
        ps, predicted, served = second.page_size, [], []
        for i, prompt in enumerate(dict.fromkeys(tuple(p) for p in prompts)):
            chain = page_hashes(np.asarray(prompt), ps, second.namespace.id)
            predicted.append(
                index.prefix("STORAGE", [wire_hash(h) for h in chain]) * ps
            )
            got = acquire_ready(second, list(prompt), f"r{i}")
            served.append(len(got.indices))
            assert (
                got.device_hit == 0
            )  # everything it has came from the store (some via its host tier)
            second.abort(f"r{i}", got.indices)
        whole = (
            page_tokens or ps
        )  # the store serves whole store pages (what the host tier already holds, any page)
        assert all(p // whole * whole <= s <= p for s, p in zip(served, predicted)), (
            served,
            predicted,
        )
        assert sum(served) > 0 and second.stats_obj.counters.storage_hit_tokens > 0
        second.tree.sanity_check()
        second.check_accounting()
    finally:
        second.close()
