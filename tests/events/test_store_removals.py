"""STORAGE removals: the pages a store drops (the file store's capacity eviction, Redis's
eviction and expiry through keyspace notifications) are `BlockRemoved` `STORAGE`, so a
router's index of the store, built from the events of a real engine run that floods it,
equals what the store holds (with a tenant key too, where events name pages by their
event subkey)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvtier.cache import TieredCache
from kvtier.config import load_config
from kvtier.engine.workloads import generate
from kvtier.events.cache_events import EventHashes
from kvtier.events.subscriber import PrefixIndex, Subscriber
from kvtier.events.wire import wire_hash
from kvtier.hashing import page_hashes, split_key
from kvtier.tenant_keys import parse_keys
from tests.events.test_cache_events import GEOMETRY, run, settle
from tests.events.test_publisher import ipc, wait_for  # noqa: F401  (the fixture)

TENANT_KEY = "7a" * 32
PAGE_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x tokens x heads x dim x float32


def flooded_cache(store: dict, ipc, tenant: bool) -> TieredCache:  # noqa: F811
    doc = {
        "pool": {"size": 1024, **GEOMETRY},
        "mirror": {"ratio": 1.5},
        "controller": {"prefetch_policy": "wait_complete"},
        "store": store,
        "events": {"endpoint": ipc[0], "replay_endpoint": ipc[1], "topic": "kv@test"},
    }
    if tenant:
        doc["namespace"] = {"tenant_key": TENANT_KEY}
    return TieredCache(load_config(None, doc, env={}))


class Index:
    """A router's index of the events, read batch by batch as they come."""

    def __init__(self, sub: Subscriber) -> None:
        self.sub, self.index, self.seq = sub, PrefixIndex(), 0

    def catch_up(self, cache: TieredCache) -> set[int]:
        pub = cache.events.publisher
        assert pub.wait_sent(30), "the publisher did not send every batch"
        while self.seq < pub.stats()["batches"]:
            m = self.sub.recv()
            assert m is not None and m.seq == self.seq, f"batch {self.seq}: lost"
            self.index.apply(m.payload)
            self.seq += 1
        return self.index.blocks["STORAGE"]


def store_blocks(cache: TieredCache, tenant: bool, groups=None) -> set[int]:
    """The wire hashes of this cache's pages in its store, as a router must name them;
    `groups`: a store page's key hash -> the hashes of its device pages."""
    store = cache.controller.storage.store
    names = (
        EventHashes(parse_keys(TENANT_KEY, "k").current.event_key) if tenant else None
    )

    async def keys():
        return [p.key async for batch in store.scan() for p in batch]

    storage = cache.controller.storage
    listed = asyncio.run_coroutine_threadsafe(keys(), storage.loop).result(30)
    hashes = [split_key(k)[2] for k in listed if split_key(k)[1] == cache.namespace.id]
    if groups is not None:
        hashes = [h for last in hashes for h in groups[last]]
    return {wire_hash(h) for h in (names(hashes) if names else hashes)}


def store_page_groups(cache: TieredCache, results, g: int) -> dict:
    """Each store page's key hash -> its `g` device pages' hashes, from the sequences
    the engine ran (prompt and output: what the tree held)."""
    out, ps = {}, cache.page_size
    for r in results:
        chain = page_hashes(np.asarray(r.prompt + r.output), ps, cache.namespace.id)
        for end in range(g - 1, len(chain), g):
            out[chain[end]] = chain[end - g + 1 : end + 1]
    return out


def converge(cache: TieredCache, index: Index, tenant: bool, groups=None) -> set[int]:
    """Poll until the events caught up with the store (a server's drops come on their
    own connection); the index's STORAGE blocks."""
    deadline = time.monotonic() + 30
    while True:
        settle(cache)
        held = index.catch_up(cache)
        if held == store_blocks(cache, tenant, groups) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


@pytest.mark.parametrize(
    "tenant, page_tokens", [(False, None), (True, None), (False, 48)]
)
def test_the_file_stores_evictions_leave_the_routers_index(
    tmp_path,
    ipc,  # noqa: F811
    tenant,
    page_tokens,
):
    """With store pages of 3 device pages (48 tokens) too: a removal names all three."""
    store = {
        "backend": "file",
        "root": str(tmp_path / "l3"),
        "capacity_bytes": 48 * (PAGE_BYTES + 256),
        "page_tokens": page_tokens,
    }
    cache = flooded_cache(store, ipc, tenant)
    sub = Subscriber(*ipc, topic="kv@test")
    try:
        results = run(cache, generate("multiturn", 24, 512, seed=3))
        groups = store_page_groups(cache, results, 3) if page_tokens else None
        index = Index(sub)
        held = converge(cache, index, tenant, groups)
        stats = cache.controller.storage.store.stats()
        assert stats["evictions"] > 100, "the store was not flooded"
        assert held and held == store_blocks(cache, tenant, groups)
        assert len(held) == stats["pages"] * ((page_tokens or 16) // 16)
        cache.tree.sanity_check()
        cache.check_accounting()
    finally:
        cache.close()
        sub.close()


@pytest.fixture
def notifying_redis(tmp_path):
    import redis

    from tests.servers import RedisServer

    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    raw = redis.Redis.from_url(server.url)
    raw.config_set("maxmemory", 2 << 20)
    raw.config_set("maxmemory-policy", "allkeys-lru")
    raw.config_set("notify-keyspace-events", "Exe")
    yield server, raw
    raw.close()
    server.stop()


def test_redis_evictions_leave_the_routers_index(notifying_redis, ipc):  # noqa: F811
    server, raw = notifying_redis
    store = {"backend": "redis", "url": server.url}
    cache = flooded_cache(store, ipc, tenant=False)
    sub = Subscriber(*ipc, topic="kv@test")
    try:
        run(cache, generate("multiturn", 24, 512, seed=3))
        raw.config_set("maxmemory", 0)  # the flood is over: what is there stays
        index = Index(sub)
        evicted = raw.info("stats")["evicted_keys"]
        held = converge(cache, index, False)
        stats = cache.controller.storage.store.stats()
        assert evicted > 100 and stats["removal_events"] == "on (expired, evicted)"
        assert held and held == store_blocks(cache, False)
        cache.tree.sanity_check()
        cache.check_accounting()
    finally:
        cache.close()
        sub.close()
