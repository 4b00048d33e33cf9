"""Leases and priorities carried to the store (`Store.hint`), on a logical clock: the file
store's capacity eviction takes unleased pages first, by priority, then least recently
used; Redis keeps a leased page's TTL at least the lease's remaining time; S3 tags it; and
every page a store drops is told to its watcher (the KV events' STORAGE removals)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.backends.frame import HEADER_SIZE
from kvtier.backends.memory import MemoryStore
from tests.backends.stores import new_key

PAGE = 4000  # payload bytes; a page file is this and its frame header


class Clock:
    """kvtier's clock in a test: it moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Watched:
    """A store watcher: what it was told, in order, and what it says is held."""

    def __init__(self) -> None:
        self.changes: list[tuple[bool, list[str]]] = []

    def __call__(self, present: bool, keys: list[str]) -> None:
        self.changes.append((present, list(keys)))

    def held(self) -> set[str]:
        out: set[str] = set()
        for present, keys in self.changes:
            (out.update if present else out.difference_update)(keys)
        return out

    def dropped(self) -> set[str]:
        return {k for present, keys in self.changes if not present for k in keys}


def file_store(root, pages: int, clock) -> FileStore:
    size = PAGE + HEADER_SIZE  # the plain frame's header
    return FileStore(
        FileStoreConfig(root=str(root), capacity_bytes=pages * size), clock=clock
    )


async def fill(store, n: int) -> list[str]:
    keys = [new_key() for _ in range(n)]
    for k in keys:  # one at a time: each write evicts what no longer fits
        await store.batch_set([k], [os.urandom(PAGE)])
    return keys


async def held(store, keys) -> list[str]:
    return [k for k in keys if await store.batch_exists([k]) == 1]


async def test_a_leased_page_survives_a_flood_and_goes_after_its_lease(tmp_path):
    clock = Clock()
    store = file_store(tmp_path, 8, clock)
    watched = Watched()
    store.watch(watched)
    pinned, *others = await fill(store, 8)
    assert await store.hint([pinned], lease_s=60, priority=0) == 1
    flood = await fill(store, 40)  # five times the capacity
    assert await held(store, [pinned]) == [pinned]
    assert await held(store, others) == []  # everything else went, LRU first
    assert store.stats()["evictions"] == 40 and store.stats()["leases_broken"] == 0
    clock.now += 61  # the lease ends on kvtier's clock: a plain page, the oldest
    await fill(store, 1)
    assert await held(store, [pinned]) == []
    # the watcher was told of every page stored and dropped: it holds what the store does
    scanned = {p.key async for batch in store.scan() for p in batch}
    assert watched.held() == scanned and pinned in watched.dropped()
    assert len(scanned) == 8 and set(flood[-7:]) <= scanned
    await store.close()


async def test_eviction_takes_low_priority_first_then_least_recently_used(tmp_path):
    store = file_store(tmp_path, 6, Clock())
    keys = await fill(store, 6)
    low, plain1, plain2, high, higher, leased = keys
    assert await store.hint([low], lease_s=None, priority=-1) == 1
    assert await store.hint([high], lease_s=None, priority=1) == 1
    assert await store.hint([higher], lease_s=None, priority=5) == 1
    assert await store.hint([leased], lease_s=100, priority=-3) == 1
    order = []
    for _ in range(6):
        before = set(await held(store, keys))
        await fill(store, 1)
        order += sorted(before - set(await held(store, keys)))
    # negative priority, plain pages (LRU), the new pages themselves, then positive ones
    assert order[:3] == [low, plain1, plain2]
    assert set(await held(store, keys)) == {high, higher, leased}
    await store.close()


async def test_a_write_with_no_room_beside_leased_pages_is_refused(tmp_path):
    """Fail-safe: leased pages stay; the write that does not fit evicts its own pages,
    which are reported not stored (and so never announced stored)."""
    clock = Clock()
    store = file_store(tmp_path, 4, clock)
    keys = await fill(store, 4)
    assert await store.hint(keys, lease_s=30) == 4
    new = [new_key(), new_key()]
    assert await store.batch_set(new, [os.urandom(PAGE)] * 2) == [False, False]
    assert await held(store, keys) == keys and await held(store, new) == []
    stats = store.stats()
    assert stats["writes_refused"] == 2 and stats["leases_broken"] == 0
    assert stats["used_bytes"] <= stats["capacity_bytes"]
    await store.close()


async def test_leases_break_only_where_leased_pages_alone_exceed_the_capacity(
    tmp_path,
):
    clock = Clock()
    store = file_store(tmp_path, 4, clock)
    keys = await fill(store, 4)
    assert await store.hint(keys[:2], lease_s=30, priority=1) == 2
    assert await store.hint(keys[2:], lease_s=60) == 2
    await store.close()
    smaller = file_store(tmp_path, 2, clock)  # reopened with half the capacity
    await fill(smaller, 1)  # the new page, then two leased ones (the soonest to end)
    stats = smaller.stats()
    assert stats["used_bytes"] <= stats["capacity_bytes"]
    assert stats["leases_broken"] == 2 and stats["writes_refused"] == 1
    assert await held(smaller, keys) == keys[:2]  # priority 1 outranks 0
    await smaller.close()


async def test_a_hint_counts_the_pages_held_and_checks_its_arguments(tmp_path):
    store = file_store(tmp_path, 4, Clock())
    [key] = await fill(store, 1)
    assert await store.hint([key, new_key()], lease_s=5) == 1  # an absent key: no error
    assert await store.hint([key.encode()], lease_s=None) == 1  # bytes of a key too
    assert store.stats()["hinted_pages"] == 0  # released, priority 0: a plain page
    for bad in (0, -1.0, float("inf"), float("nan"), "5", True):
        with pytest.raises(ValueError, match="lease_s="):
            await store.hint([key], lease_s=bad)
    for bad in (1.5, "1", True):
        with pytest.raises(ValueError, match="priority="):
            await store.hint([key], lease_s=None, priority=bad)
    with pytest.raises(ValueError):
        await store.hint(["not/a/key"], lease_s=1)
    assert await MemoryStore().hint([key], lease_s=5) == 0  # no means: none applied
    await store.close()


async def test_a_hint_without_a_priority_keeps_the_pages_own(tmp_path):
    """priority=None (a pin, a release, an expiry: no retain) keeps the priority a page
    has: after a lease and its release, a page of priority 5 is still evicted after the
    plain ones. A lease or release at priority 0 made it a plain page (the oldest)."""
    clock = Clock()
    store = file_store(tmp_path, 4, clock)
    kept, *plain = await fill(store, 4)
    assert await store.hint([kept], lease_s=None, priority=5) == 1
    assert await store.hint([kept], lease_s=30, priority=None) == 1
    assert store._leases.get(kept).priority == 5
    assert await store.hint([kept], lease_s=None, priority=None) == 1  # released
    assert store.stats()["hinted_pages"] == 1
    await fill(store, 3)  # the three plain pages go, least recently used first
    assert await held(store, [kept, *plain]) == [kept]
    clock.now += 31  # a lease's end on the clock keeps its priority too
    assert await store.hint([kept], lease_s=10, priority=None) == 1
    clock.now += 11
    await fill(store, 3)
    assert await held(store, [kept]) == [kept]
    assert await store.hint([new_key()], lease_s=None, priority=None) == 0
    await store.close()


FLOOD = """
import asyncio, os, sys
from kvtier.backends.file import FileStore, FileStoreConfig
from tests.backends.stores import new_key
async def main():
    store = FileStore(FileStoreConfig(root=sys.argv[1], capacity_bytes=int(sys.argv[2])))
    for _ in range(40):
        await store.batch_set([new_key()], [os.urandom(4000)])
    await store.close()
asyncio.run(main())
"""


async def test_another_process_sharing_the_root_keeps_the_lease(tmp_path):
    """The lease table is the root's (its `.kvtier-leases`, under the root's lock): a
    process that never heard of the lease floods the root and evicts every other page."""
    store = file_store(tmp_path, 6, time.time)  # wall time, as every process reads it
    pinned, *others = await fill(store, 6)
    assert await store.hint([pinned], lease_s=3600) == 1
    cap = store.config.capacity_bytes
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    subprocess.run(
        [sys.executable, "-c", FLOOD, str(tmp_path), str(cap)],
        check=True,
        env=env,
        timeout=300,
    )
    await store.close()
    reopened = file_store(tmp_path, 6, time.time)
    assert await held(reopened, [pinned, *others]) == [pinned]
    await reopened.close()


async def test_memory_store_tells_its_watcher_of_its_evictions():
    from kvtier.backends.memory import MemoryStoreConfig

    store = MemoryStore(MemoryStoreConfig(capacity_bytes=3 * (PAGE + HEADER_SIZE)))
    watched = Watched()
    store.watch(watched)
    keys = await fill(store, 10)
    scanned = {p.key async for batch in store.scan() for p in batch}
    assert watched.held() == scanned == set(keys[-3:])
    assert watched.dropped() == set(keys[:7])


# -- Redis ---------------------------------------------------------------------------------


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of the test's own: its memory policy and notifications are set
    here, not on the session's shared one."""
    from tests.servers import RedisServer

    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def redis_store(url: str, clock, ttl_s: int | None = 3600):
    from kvtier.backends.redis_store import RedisStore, RedisStoreConfig

    return RedisStore(
        RedisStoreConfig(url=url, ttl_s=ttl_s, write_threads=1), clock=clock
    )


@pytest.mark.parametrize("gt", [True, False])
async def test_redis_ttl_of_a_leased_page_is_at_least_the_lease_remaining(
    redis_server, gt
):
    """With `PEXPIRE ... GT` (Redis 7) and without (PTTL, then PEXPIRE where shorter)."""
    import redis

    clock = Clock()
    store = redis_store(redis_server.url, clock, ttl_s=60)
    store._expire_gt = gt
    raw = redis.Redis.from_url(redis_server.url)
    try:
        keys = [new_key() for _ in range(3)]
        assert await store.batch_set(keys, [os.urandom(PAGE)] * 3) == [True] * 3
        raw.pexpire(keys[2], 10_000_000)  # a longer TTL than any lease here: kept
        assert await store.hint(keys + [new_key()], lease_s=600) == 3
        clock.now += 100  # 500 s of the lease left
        assert all(raw.pttl(k) >= 500_000 for k in keys)
        assert raw.pttl(keys[0]) > 600_000  # the lease beyond the store's ttl_s
        assert raw.pttl(keys[2]) > 9_000_000  # never shortened
        assert await store.hint(keys[:1], lease_s=None) == 1  # released: ttl_s again
        assert 0 < raw.ttl(keys[0]) <= 60
        clock.now += 600  # the leases ended on kvtier's clock: ttl_s from the next call
        assert (
            raw.pttl(keys[1]) > 400_000
        )  # the server's TTL is no lease: kvtier decides
        await store.batch_exists(keys[:1])
        assert all(0 < raw.ttl(k) <= 60 for k in keys)
        assert store.stats()["leases"] == 0
    finally:
        raw.close()
        await store.close()


async def test_redis_without_ttl_keeps_a_leased_page_without_one(redis_server):
    import redis

    store = redis_store(redis_server.url, Clock(), ttl_s=None)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        [key] = [new_key()]
        assert await store.batch_set([key], [os.urandom(PAGE)]) == [True]
        assert await store.hint([key], lease_s=5) == 1
        assert raw.ttl(key) == -1  # no TTL outlives any lease: none is added
        assert await store.hint([key], lease_s=None, priority=3) == 1
        assert raw.ttl(key) == -1
    finally:
        raw.close()
        await store.close()


async def redis_flood(store, n: int) -> list[str]:
    keys = [new_key() for _ in range(n)]
    for start in range(0, n, 4):
        await store.batch_set(keys[start : start + 4], [os.urandom(PAGE)] * 4)
    return keys


async def test_a_leased_redis_page_survives_a_volatile_ttl_flood_and_goes_after(
    own_redis,
):
    """maxmemory with `volatile-ttl`: Redis evicts the page nearest its expiry; a leased
    page's expiry is the lease's end plus `ttl_s`, later than any page written during
    the lease. Once the lease ended on kvtier's clock its TTL is `ttl_s` from then, and
    the pages written after it outlive it."""
    import redis

    raw = redis.Redis.from_url(own_redis.url)
    raw.config_set("maxmemory", 4 << 20)
    raw.config_set("maxmemory-policy", "volatile-ttl")
    raw.config_set("maxmemory-samples", 10)
    clock = Clock()
    store = redis_store(own_redis.url, clock)
    try:
        pinned, *others = await redis_flood(store, 40)
        assert await store.hint([pinned], lease_s=600) == 1
        flood = await redis_flood(store, 2000)  # ~8 MiB through 4 MiB
        assert raw.info("stats")["evicted_keys"] > 1000
        assert raw.exists(pinned) == 1
        assert sum(raw.exists(k) for k in others) == 0
        clock.now += 601
        await store.batch_exists([pinned])  # the lease ended: its TTL is ttl_s again
        time.sleep(0.01)  # later pages' expiries are later (Redis counts ms)
        await redis_flood(store, 2000)
        assert raw.exists(pinned) == 0
        assert sum(raw.exists(k) for k in flood[:1000]) == 0
    finally:
        raw.close()
        await store.close()


async def test_redis_tells_its_watcher_of_evictions_and_expiries(own_redis):
    import redis

    raw = redis.Redis.from_url(own_redis.url)
    raw.config_set("maxmemory", 2 << 20)
    raw.config_set("maxmemory-policy", "allkeys-lru")
    raw.config_set("notify-keyspace-events", "Exe")
    store = redis_store(own_redis.url, Clock(), ttl_s=None)
    watched = Watched()
    store.watch(watched)
    try:
        await store.batch_exists([new_key()])  # the listener subscribes on this call
        assert store.stats()["removal_events"] == "on (expired, evicted)"
        keys = await redis_flood(store, 1200)
        short = new_key()
        await store.batch_set([short], [os.urandom(PAGE)])
        raw.pexpire(short, 1)
        raw.config_set("maxmemory", 0)  # no more evictions: the count is final
        deadline = time.monotonic() + 30
        evicted = raw.info("stats")["evicted_keys"]
        while (
            len(watched.dropped()) < evicted + 1 and time.monotonic() < deadline
        ):  # notifications come on their own connection
            await asyncio_sleep(0.05)
        assert evicted > 500 and short in watched.dropped()
        scanned = {p.key async for batch in store.scan() for p in batch}
        assert watched.held() == scanned
        assert scanned < set(keys) | {short} and short not in scanned
    finally:
        raw.close()
        await store.close()


async def test_redis_says_when_its_notifications_are_off(own_redis):
    store = redis_store(own_redis.url, Clock())
    store.watch(Watched())
    try:
        await store.batch_exists([new_key()])
        said = store.stats()["removal_events"]
        assert said.startswith("off: notify-keyspace-events=''") and "Exe" in said
    finally:
        await store.close()


async def asyncio_sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


# -- S3 ------------------------------------------------------------------------------------


async def test_s3_tags_carry_the_lease_and_the_priority(s3_server):
    from tests.backends.stores import s3_harness

    h = s3_harness(s3_server.url)
    clock = Clock()
    store = h.make()
    store.clock = clock
    store._leases.clock = clock
    client = store.client
    bucket = store.config.bucket

    def tags(key: str) -> dict[str, str]:
        got = client.get_object_tagging(Bucket=bucket, Key=key)["TagSet"]
        return {t["Key"]: t["Value"] for t in got}

    try:
        keys = [new_key() for _ in range(3)]
        assert await store.batch_set(keys, [os.urandom(PAGE)] * 3) == [True] * 3
        plain = {"kvtier-lease-until": "0", "kvtier-priority": "0"}
        assert (
            tags(keys[0]) == plain
        )  # written unleased: what the lifecycle rule expires
        before = time.time()
        assert await store.hint(keys[:2] + [new_key()], lease_s=600, priority=2) == 2
        leased = tags(keys[0])
        assert int(leased["kvtier-lease-until"]) >= before + 600
        assert leased["kvtier-priority"] == "2"
        assert await store.hint(keys[1:2], lease_s=None) == 1  # released
        assert tags(keys[1]) == plain
        clock.now += 601  # keys[0]'s lease ended on kvtier's clock: untagged on a write
        await store.batch_set([new_key()], [os.urandom(PAGE)])
        assert tags(keys[0]) == {"kvtier-lease-until": "0", "kvtier-priority": "2"}
        assert tags(keys[2]) == plain
    finally:
        await store.close()


def test_the_documented_lifecycle_rules_select_unleased_pages(s3_server):
    """docs/stores.md's lifecycle rules are valid S3 (moto checks them) and select, by
    tag, exactly the pages kvtier writes unleased."""
    import json
    import re
    from pathlib import Path

    import boto3

    from kvtier.backends.s3 import LEASE_TAG, PRIORITY_TAG

    text = (Path(__file__).resolve().parents[2] / "docs" / "stores.md").read_text()
    section = text[text.index("## Leases and priorities") :]
    rules = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_server.url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket="kvtier-lifecycle-doc")
    s3.put_bucket_lifecycle_configuration(
        Bucket="kvtier-lifecycle-doc", LifecycleConfiguration=rules
    )
    got = s3.get_bucket_lifecycle_configuration(Bucket="kvtier-lifecycle-doc")["Rules"]
    filters = [{t["Key"]: t["Value"] for t in r["Filter"]["And"]["Tags"]} for r in got]
    assert filters == [
        {LEASE_TAG: "0", PRIORITY_TAG: "0"},
        {LEASE_TAG: "0", PRIORITY_TAG: "1"},
    ]


async def test_many_hinted_pages_in_front_of_the_lru_order_are_walked_past(tmp_path):
    """More hinted pages than one look at the index (64) sit oldest: the plain pages
    behind them go first, then the positive ones by priority, lowest first."""
    clock = Clock()
    store = file_store(tmp_path, 200, clock)
    keys = await fill(store, 200)
    kept, plain = keys[:150], keys[150:]
    assert await store.hint(kept[:100], lease_s=None, priority=2) == 100
    assert await store.hint(kept[100:], lease_s=None, priority=1) == 50
    new = await fill(store, 120)  # the 50 plain pages go, then 70 of the new ones
    assert await held(store, plain) == []
    assert await held(store, kept) == kept
    assert await held(store, new) == new[70:]
    await store.close()
    smaller = file_store(tmp_path, 100, clock)  # reopened with half the capacity
    await fill(smaller, 1)  # that page, the 50 new ones, then priority 1 before 2
    assert await held(smaller, kept) == kept[:100]
    assert await held(smaller, new) == []
    assert smaller.stats()["leases_broken"] == 0
    await smaller.close()


async def test_a_failed_lease_upkeep_is_counted_never_the_writes_error(redis_server):
    """Putting an ended lease back to the TTL policy fails (a broken connection): the
    write it rode along with still stores its page; the failure is counted."""
    from kvtier.backends.redis_store import RedisStore, RedisStoreConfig

    class BrokenUpkeep(RedisStore):
        async def _back_to_policy(self, keys):
            raise ConnectionError("the connection broke")

    clock = Clock()
    store = BrokenUpkeep(
        RedisStoreConfig(url=redis_server.url, ttl_s=60, write_threads=1), clock=clock
    )
    try:
        key = new_key()
        assert await store.batch_set([key], [os.urandom(PAGE)]) == [True]
        assert await store.hint([key], lease_s=5) == 1
        clock.now += 6
        page = new_key()
        assert await store.batch_set([page], [os.urandom(PAGE)]) == [True]
        assert store.stats()["errors"] == 1 and store.stats()["leases"] == 0
    finally:
        await store.close()


async def test_a_dropped_notification_connection_never_fails_a_write(own_redis):
    """The server drops the listener's connection (as its pubsub output buffer limit, a
    proxy or `CLIENT KILL` does) just before a write: the write's mark is published to
    nobody. The write still stores its page and tells the watcher at once, instead of
    waiting for a mark that never comes until the call timed out (StoreTimeout)."""
    import redis

    raw = redis.Redis.from_url(own_redis.url)
    raw.config_set("notify-keyspace-events", "Exe")
    store = redis_store(own_redis.url, Clock(), ttl_s=None)
    watched = Watched()
    store.watch(watched)
    try:
        for _ in range(3):
            store._watch_tried = float("-inf")  # the listener restarts on this call
            await store.batch_exists([new_key()])
            assert store.stats()["removal_events"] == "on (expired, evicted)"
            raw.client_kill_filter(_type="pubsub")
            key = new_key()
            assert await store.batch_set([key], [os.urandom(PAGE)]) == [True]
            assert key in watched.held()
        assert store.stats()["timeouts"] == 0
    finally:
        raw.close()
        await store.close()


async def test_a_lease_table_that_cannot_be_read_or_written_never_fails_a_write(
    tmp_path,
):
    """Something that is no file sits at the root's `.kvtier-leases` (anyone who can write
    the root can put it there; a full disk fails its rewrite alike): writes go on, the
    capacity holds, and a lease still holds in this process. It failed every write at
    capacity (StoreError) and left the pages it had written counted nowhere shared, so
    the root grew past its capacity."""
    clock = Clock()
    store = file_store(tmp_path, 4, clock)
    pinned, *_ = await fill(store, 4)
    (tmp_path / ".kvtier-leases").mkdir()
    assert await store.hint([pinned], lease_s=60) == 1
    flood = [new_key() for _ in range(8)]
    for key in flood:
        assert await store.batch_set([key], [os.urandom(PAGE)]) == [True]
    stats = store.stats()
    assert stats["used_bytes"] <= stats["capacity_bytes"] and stats["pages"] == 4
    assert await held(store, [pinned]) == [pinned]
    assert await held(store, flood) == flood[-3:]
    assert stats["errors"] > 0  # counted (and logged once), never raised
    await store.close()


async def test_s3_remembers_only_the_leases_it_must_end(s3_server):
    """S3 keeps a page's hint in memory only while its lease runs (to tag it unleased at
    the end on kvtier's clock): a priority alone lives in the object's tag. It kept every
    page ever given a priority, for good (nothing removes an S3 page from the table): a
    server's memory grew with each `retain` hint."""
    from tests.backends.stores import s3_harness

    clock = Clock()
    store = s3_harness(s3_server.url).make()
    store.clock = store._leases.clock = clock
    try:
        keys = [new_key() for _ in range(4)]
        assert await store.batch_set(keys, [os.urandom(PAGE)] * 4) == [True] * 4
        assert await store.hint(keys[:2], lease_s=None, priority=3) == 2
        assert store.stats()["leases"] == 0
        assert await store.hint(keys[2:], lease_s=60, priority=2) == 2
        assert store.stats()["leases"] == 2
        clock.now += 61  # ended: tagged unleased (priority kept) on the next write
        await store.batch_set([new_key()], [os.urandom(PAGE)])
        assert store.stats()["leases"] == 0
        got = store.client.get_object_tagging(Bucket=store.config.bucket, Key=keys[2])
        tags = {t["Key"]: t["Value"] for t in got["TagSet"]}
        assert tags == {"kvtier-lease-until": "0", "kvtier-priority": "2"}
    finally:
        await store.close()


def s3_store(url: str, **options):
    """An S3 store on moto's server with `options`, on a test clock."""
    import dataclasses

    from kvtier.backends.s3 import S3Store
    from tests.backends.stores import s3_harness

    base = s3_harness(url).make()  # creates the bucket
    base.client.close()
    store = S3Store(
        dataclasses.replace(base.config, create_bucket=False, **options),
        clock=Clock(),
    )
    store._leases.clock = store.clock
    return store


def s3_tags(store, key: str) -> dict[str, str]:
    got = store.client.get_object_tagging(Bucket=store.config.bucket, Key=key)
    return {t["Key"]: t["Value"] for t in got["TagSet"]}


async def test_s3_a_hint_without_a_priority_keeps_the_tags(s3_server):
    """A lease, its release and its end on kvtier's clock with priority None keep the
    priority the object's tag has (read, as S3 replaces tags whole); they tagged it 0."""
    store = s3_store(s3_server.url)
    try:
        keys = [new_key() for _ in range(2)]
        assert await store.batch_set(keys, [os.urandom(PAGE)] * 2) == [True] * 2
        assert await store.hint(keys, lease_s=None, priority=5) == 2
        assert await store.hint(keys, lease_s=60, priority=None) == 2
        assert s3_tags(store, keys[0])["kvtier-priority"] == "5"
        assert await store.hint(keys[:1], lease_s=None, priority=None) == 1
        assert s3_tags(store, keys[0]) == {
            "kvtier-lease-until": "0",
            "kvtier-priority": "5",
        }
        store.clock.now += 61  # keys[1]'s lease ended: untagged on the next write
        await store.batch_set([new_key()], [os.urandom(PAGE)])
        assert s3_tags(store, keys[1]) == {
            "kvtier-lease-until": "0",
            "kvtier-priority": "5",
        }
        assert await store.hint([new_key()], lease_s=30, priority=None) == 0
    finally:
        await store.close()


async def test_s3_with_tags_off_writes_untagged_pages_and_hints_none(s3_server):
    store = s3_store(s3_server.url, tags=False)
    try:
        keys = [new_key() for _ in range(2)]
        assert await store.batch_set(keys, [os.urandom(PAGE)] * 2) == [True] * 2
        assert s3_tags(store, keys[0]) == {}  # no tags: no s3:PutObjectTagging needed
        assert await store.hint(keys, lease_s=60, priority=3) == 0
        assert s3_tags(store, keys[1]) == {} and store.stats()["leases"] == 0
        assert store.stats()["tags"] is False
        assert await store.batch_get(keys) is not None
    finally:
        await store.close()


def test_s3_tags_option_is_checked():
    from kvtier.backends.s3 import S3StoreConfig
    from kvtier.config import KvtierConfigError, load_config

    with pytest.raises(ValueError, match="tags='no': true .* or false"):
        S3StoreConfig(tags="no")
    store = {"backend": "s3", "bucket": "b"}
    cfg = load_config(None, {"store": {**store, "tags": False}}, env={})
    assert cfg.store.options.tags is False
    with pytest.raises(KvtierConfigError, match="store.tags"):
        load_config(None, {"store": {**store, "tags": "maybe"}}, env={})
    env = {"KVTIER_STORE_BACKEND": "s3", "KVTIER_STORE_TAGS": "false"}
    assert load_config(None, {}, env=env).store.options.tags is False


def refuse_put_object(store, tagged_only: bool) -> list[str]:
    """Make moto's server refuse (AccessDenied, before it is sent) the store's PutObject
    calls that carry tags (`tagged_only`) or all of them; the keys refused, in order."""
    from botocore.awsrequest import AWSResponse

    refused: list[str] = []

    def refuse(params, model, **kwargs):
        headers = {k.lower() for k in params.get("headers", {})}
        if tagged_only and "x-amz-tagging" not in headers:
            return None  # sent as usual
        refused.append(params["url_path"])
        error = {"Code": "AccessDenied", "Message": "Access Denied"}
        meta = {"HTTPStatusCode": 403, "HTTPHeaders": {}}
        return AWSResponse(params["url"], 403, {}, None), {
            "Error": error,
            "ResponseMetadata": meta,
        }

    store.client.meta.events.register("before-call.s3.PutObject", refuse)
    return refused


async def test_s3_a_refused_tagged_put_is_stored_untagged_and_tags_go_off(
    s3_server, caplog
):
    """Credentials without s3:PutObjectTagging (or a server without tagging): a tagged
    PUT is refused, the page is written again untagged, and tags are off from then on
    (logged once, counted), so writes never fail because of tags."""
    store = s3_store(s3_server.url)
    refused = refuse_put_object(store, tagged_only=True)
    try:
        keys = [new_key() for _ in range(4)]
        with caplog.at_level("WARNING", logger="kvtier.backends.s3"):
            assert await store.batch_set(keys, [os.urandom(PAGE)] * 4) == [True] * 4
            more = [new_key() for _ in range(2)]
            assert await store.batch_set(more, [os.urandom(PAGE)] * 2) == [True] * 2
        assert 1 <= len(refused) <= 4  # the batch's PUTs run at once: up to one each
        stats = store.stats()
        assert stats["tags"] is False and stats["tags_refused"] == len(refused)
        assert stats["errors"] == 0
        assert all(s3_tags(store, k) == {} for k in keys + more)
        logged = [r for r in caplog.records if "tagged PUT was refused" in r.message]
        assert len(logged) == 1 and "AccessDenied" in logged[0].getMessage()
        assert await store.hint(keys, lease_s=60, priority=1) == 0
        got = await store.batch_get(keys + more)
        assert all(page is not None for page in got)
    finally:
        await store.close()


async def test_s3_a_put_refused_untagged_too_is_an_error_and_tags_stay_on(s3_server):
    """A refusal that is not about tags (no s3:PutObject at all) fails the write as
    before, and does not turn tags off."""
    store = s3_store(s3_server.url)
    refused = refuse_put_object(store, tagged_only=False)
    try:
        from kvtier.errors import StoreError

        with pytest.raises(StoreError, match="AccessDenied"):
            await store.batch_set([new_key()], [os.urandom(PAGE)])
        assert len(refused) == 2  # tagged, then untagged
        stats = store.stats()
        assert stats["tags"] is True and stats["tags_refused"] == 0
        assert stats["errors"] >= 1
    finally:
        await store.close()


async def test_redis_says_once_that_its_notifications_are_off(own_redis, caplog):
    """The store looks again (every few seconds, on a call) whether notifications were
    turned on, but says that they are off once, not at each look."""
    import logging

    store = redis_store(own_redis.url, Clock())
    store.watch(Watched())
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            for _ in range(3):
                store._watch_tried = float("-inf")  # as after the retry interval
                await store.batch_exists([new_key()])
        said = [r for r in caplog.records if "removals are not announced" in r.message]
        assert len(said) == 1
    finally:
        await store.close()


def test_renewing_a_lease_keeps_its_bookkeeping_bounded():
    """An agent renews its pin at every pause: each renewal left an entry in the table
    of lease ends until that renewal's end came (a lease of an hour renewed every
    second: 3,600 entries a page). They are compacted: a few per lease held."""
    from kvtier.backends.leases import Leases

    clock = Clock()
    leases = Leases(clock)
    for _ in range(10_000):
        leases.apply("k/ns/aa", 3600, 0)
        clock.now += 1
    assert leases.leased("k/ns/aa") and len(leases._ends) <= 2 * len(leases) + 64
    clock.now += 3601
    assert leases.expire() == ["k/ns/aa"] and not leases.leased("k/ns/aa")
