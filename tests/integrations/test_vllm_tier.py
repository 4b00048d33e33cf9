"""KvtierTier under vLLM 0.33.0's real TieringOffloadingManager (vllm_runtime.Rig): a real
shared primary region in /dev/shm, the tier loaded by module path, real stores (files,
redis-server, moto's S3 server)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from kvtier.backends.frame import HEADER_SIZE
from kvtier.errors import KvtierConfigError, StoreUnavailable
from tests.integrations import vllm_runtime as rt
from tests.integrations.tenant_store import (
    KEY_A,
    KEY_A_ID,
    KEY_B,
    leaks_key,
    list_store,
    reframe_plain,
)

STORES = ["file", "redis", "s3"]


@pytest.fixture(scope="module", autouse=True)
def vllm():
    rt.need_vllm()


def store_section(kind: str, request, tmp_path) -> dict:
    if kind == "file":
        return {"backend": "file", "root": str(tmp_path / "l3")}
    if kind == "redis":
        return {"backend": "redis", "url": request.getfixturevalue("redis_server").url}
    if kind == "s3":
        return {
            "backend": "s3",
            "bucket": f"kvtier-{uuid.uuid4().hex[:12]}",
            "create_bucket": True,
            "endpoint_url": request.getfixturevalue("s3_server").url,
            "access_key_id": "testing",
            "secret_access_key": "testing",
        }
    raise AssertionError(kind)


def conf(store: dict, **controller) -> dict:
    return {
        "store": {"timeout_s": 5.0, **store},
        "controller": controller,
        "namespace": {"tenant_salt": uuid.uuid4().hex},
    }  # each test its own pages, whatever the store holds


def new_keys(n: int) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(os.urandom(32), 0) for _ in range(n)]


@pytest.fixture
def rigs():
    made = []

    def make(*args, **kw) -> rt.Rig:
        made.append(rt.Rig(*args, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()
        assert rt.shm_segments(r.engine_id) == [], (
            "the shared primary region outlived the manager"
        )


def names(seen: dict) -> list[list[str]]:
    return [[a.name for a in answers] for answers in seen.values()]


@pytest.mark.parametrize("kind", STORES)
def test_cascade_then_promotion_gives_back_the_same_bytes(
    kind, request, tmp_path, rigs
):
    from vllm.v1.kv_offload.base import Medium

    cfg = conf(store_section(kind, request, tmp_path))
    keys = new_keys(4)
    writer = rigs(cfg)
    written = writer.store(keys)
    assert writer.tier.counters["store_ok"] == 4
    stored = [e for e in writer.events if e.medium is Medium.STORAGE and not e.removed]
    assert [
        k for e in stored for k in e.keys
    ] == keys  # take_events: what reached the store, in order

    # the same engine after a reset: the primary is empty, the tier knows its keys
    writer.mgr.reset_cache()
    writer.mgr.on_reset_flushed()
    writer.rows[:] = 0
    seen, got = writer.load(keys, "again")
    assert names(seen) == [["HIT_PENDING", "HIT"]] * 4
    assert got == written

    # a new engine over the same store: lookups probe it (RETRY), then promote
    reader = rigs(cfg)
    seen, got = reader.load(keys)
    assert names(seen) == [["RETRY", "HIT_PENDING", "HIT"]] * 4
    assert got == written
    assert reader.tier.kvtier_stats()["store_down"] is False


def test_a_steps_jobs_and_probes_reach_the_store_loop_keeping_the_gil(
    tmp_path, rigs, monkeypatch
):
    """vLLM's scheduler thread hands the tier's store loop its jobs and probes through
    the GIL-keeping wake-up (StoreLoop.post), never asyncio's call_soon_threadsafe: that
    one sends on a socket with the GIL let go, the store loop's thread takes it, and the
    scheduler waits to get it back, once per job."""
    import threading

    cfg = conf({"backend": "file", "root": str(tmp_path / "l3")})
    writer, reader = rigs(cfg), rigs(cfg)
    woken_by = []
    for rig in (writer, reader):
        loop = rig.tier._loop.loop
        real = loop.call_soon_threadsafe

        def counted(*args, real=real, **kw):
            woken_by.append(threading.current_thread())
            return real(*args, **kw)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
    keys = new_keys(4)
    written = writer.store(keys)
    seen, got = reader.load(keys)  # probes, then a promotion
    assert names(seen) == [["RETRY", "HIT_PENDING", "HIT"]] * 4
    assert got == written
    assert threading.main_thread() not in woken_by


def test_the_file_stores_jobs_go_from_vllms_thread_to_its_io_threads_in_one_hop(
    tmp_path, rigs, monkeypatch
):
    """The file store's jobs skipped the store loop: vLLM's thread submitted each job's
    pages to the store's I/O threads as one thread job, and collected the result in
    `get_finished_jobs`; the loop ran none of it (no post, no store call on the loop).
    Once, the path was vLLM thread -> loop -> I/O thread -> loop -> vLLM thread. The
    first write goes on the loop (the namespace's manifest first)."""
    cfg = conf({"backend": "file", "root": str(tmp_path / "l3")})
    rig = rigs(cfg)
    tier = rig.tier
    keys = new_keys(4)
    rig.store(keys[:2], "first")  # the manifest, on the loop
    posts, loop_calls = [], []
    real_post = tier._loop.post

    def post(fn):
        posts.append(fn)
        real_post(fn)

    monkeypatch.setattr(tier._loop, "post", post)
    for name in ("batch_set", "batch_get_into", "delete"):
        real = getattr(tier.store, name)

        def on_loop(*a, real=real, name=name, **kw):
            loop_calls.append(name)
            return real(*a, **kw)

        monkeypatch.setattr(tier.store, name, on_loop)
    written = rig.store(keys[2:], "second")
    rig.mgr.reset_cache()
    rig.mgr.on_reset_flushed()
    seen, got = rig.load(keys, "again")
    assert names(seen) == [["HIT_PENDING", "HIT"]] * 4
    assert {k: got[k] for k in keys[2:]} == written
    monkeypatch.undo()
    assert posts == [] and loop_calls == []
    c = tier.counters
    assert (
        c["loop_jobs"] == 1 and c["direct_jobs"] == c["store_jobs"] + c["load_jobs"] - 1
    )
    assert c["thread_jobs"] == c["direct_jobs"]  # one hop each
    assert tier._loop.run(tier.store.batch_exists(tier.store_keys(keys))) == 4


def test_other_stores_jobs_run_on_the_store_loop(rigs):
    """A store without the file store's direct calls (here the memory store; Redis, S3
    and plugins alike) keeps the loop path."""
    rig = rigs({"store": {"backend": "memory"}})
    keys = new_keys(3)
    written = rig.store(keys)
    rig.mgr.reset_cache()
    rig.mgr.on_reset_flushed()
    seen, got = rig.load(keys, "again")
    assert got == written
    c = rig.tier.counters
    assert c["direct_jobs"] == 0 and c["loop_jobs"] == c["store_jobs"] + c["load_jobs"]


def test_the_file_stores_direct_writes_are_indexed_and_hold_its_capacity(
    tmp_path, rigs
):
    """The direct writes' effects on the file store's index are handed to its loop: a
    loop call sees them, and the capacity holds once the loop settled them (here after
    every job: the capacity is small)."""
    section = {"backend": "file", "root": str(tmp_path / "l3")}
    row = rigs(conf(section), chunks=8).rows.shape[1]
    section["capacity_bytes"] = 4 * (row + 200)  # four frames and some
    rig = rigs(conf(section), chunks=8)
    tier = rig.tier
    for i in range(4):
        rig.store(new_keys(2), f"w{i}")
    tier._settle_now()
    store = tier.store
    assert tier.counters["direct_jobs"] == 3
    assert store.used_bytes <= section["capacity_bytes"]
    files = [
        f
        for _, _, fs in os.walk(store.root)
        for f in fs
        if not f.startswith(".") and not f.endswith(".json")
    ]
    assert 0 < len(files) <= 4
    assert store.stats()["pages"] == len(files)


def test_reads_alone_keep_the_direct_calls_hand_off_bounded(tmp_path, rigs):
    """Only writes posted the loop its settle_direct: a server promoting cached blocks,
    storing nothing new, queued each load's effects (and each touch) for the loop
    without end, memory that grew with every request. Past a bound the tier posts it."""
    import time

    from kvtier.integrations.vllm.tier import HANDOFF_BOUND

    rig = rigs(conf({"backend": "file", "root": str(tmp_path / "l3")}))
    tier = rig.tier
    keys = new_keys(2)
    written = rig.store(keys)
    tier._settle_now()
    for i in range(HANDOFF_BOUND + 20):
        rig.mgr.reset_cache()
        rig.mgr.on_reset_flushed()
        _, got = rig.load(keys, f"r{i}")
        assert got == written
    deadline = time.monotonic() + 30  # the settle posted: ended (not a timing check)
    while tier._settling and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tier._settling
    assert len(tier.store._handoff) < HANDOFF_BOUND
    assert tier.store.stats()["pages"] == 2


def test_a_direct_calls_effect_that_fails_on_the_loop_fails_no_store_call(
    tmp_path, rigs, monkeypatch
):
    """A corrupt page a direct read deleted leaves the shared byte count on the loop
    thread (handed off). Where that failed on an I/O error (the lock file on a failing
    disk), the raw OSError came out of the loop's next store call, whatever it was, in
    front of its own work and past the store's error mapping. It is said and counted;
    the call goes on."""
    import errno

    from kvtier.backends import file as file_mod

    rig = rigs(conf({"backend": "file", "root": str(tmp_path / "l3")}))
    tier = rig.tier
    bad, good = new_keys(2)
    rig.store([bad, good])
    full = tier.store_keys([bad, good])
    corrupt("file", None, tier, full[0], {})
    rig.mgr.reset_cache()
    rig.mgr.on_reset_flushed()
    _, got = rig.load([bad, good], "r1")
    assert bad not in got and good in got
    assert tier.store.handoff_backlog > 0  # the deleted page's bookkeeping: not applied
    real = file_mod.fcntl.flock
    failing = [True]

    def flock(fd, op):
        if failing:
            failing.clear()
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, op)

    monkeypatch.setattr(file_mod.fcntl, "flock", flock)
    errors = tier.store.counters.errors
    assert tier._loop.run(tier.store.batch_exists(full)) == 0  # the bad page: gone
    assert not failing and tier.store.counters.errors == errors + 1
    monkeypatch.setattr(file_mod.fcntl, "flock", real)
    assert tier._loop.run(tier.store.batch_exists(full[1:])) == 1
    assert tier.store.handoff_backlog == 0


def test_a_hung_direct_read_trips_the_breaker_which_recovers(
    tmp_path, rigs, monkeypatch
):
    """The direct path keeps the loop's breaker: a read stuck on a hung mount is given
    up on and puts the store down (loads skipped: MISS, nothing announced gone); once
    the probe interval passed and the mount is back, the next job is the probe, it
    succeeds and the store is used again."""
    from tests.hung import HungMount

    rig = rigs(
        conf(
            {"backend": "file", "root": str(tmp_path / "l3"), "timeout_s": 0.3},
            store_probe_backoff_s=60.0,
        ),
        chunks=4,
    )
    tier = rig.tier
    hung, k2 = new_keys(2)
    written = rig.store([hung, k2])
    mount = HungMount(monkeypatch)
    mount.hang(tier.store.path(tier.store_keys([hung])[0]))
    try:
        rig.mgr.reset_cache()
        rig.mgr.on_reset_flushed()
        rig.load([hung], "r1")
        assert tier.breaker.down and tier.store.stats()["io_threads_abandoned"] == 1
        skipped = tier.breaker.skipped
        seen, _ = rig.load([k2], "r2")
        assert names(seen)[0][0] == "HIT_PENDING" and names(seen)[0][-1] == "MISS"
        assert tier.breaker.skipped > skipped
        mount.come_back()
        monkeypatch.setattr(tier.breaker, "clock", lambda: tier.breaker.next_probe)
        seen, got = rig.load([k2], "r3")  # k2 unknown since: probed, then promoted
        assert names(seen)[0][-1] == "HIT" and got == {k2: written[k2]}
        assert not tier.breaker.down
    finally:
        mount.release()


def test_drain_jobs_on_reset_ends_every_job_first(tmp_path, rigs):
    """reset_cache drains the tier and asserts no job is left (vLLM's own check)."""
    rig = rigs(conf({"backend": "file", "root": str(tmp_path / "l3")}))
    from vllm.v1.kv_offload.base import ReqContext

    keys = new_keys(6)
    ctx = ReqContext(req_id="r")
    rig.mgr.on_new_request(ctx)
    out = rig.mgr.prepare_store(keys, ctx)
    rig.rows[list(out.store_spec.chunk_ids)] = 7
    rig.mgr.complete_store(keys, ctx)  # the cascade is in flight now
    rig.mgr.on_request_finished(ctx)
    rig.mgr.reset_cache()  # drain_jobs, then `assert not self._jobs` inside vLLM
    rig.mgr.on_reset_flushed()
    assert not rig.tier.has_pending_work()
    assert rig.tier.counters["store_ok"] == 6


def test_a_block_the_store_evicted_is_stored_again_when_vllm_cascades_it(rigs):
    """The tier skipped writing a row it once stored (its `present` index), counted it
    stored and announced it; the store had evicted it meanwhile, which the index never
    hears, and vLLM cascades a block only when it newly enters its primary tier: the block
    was gone from the store for good. Every cascaded row is written."""
    from vllm.v1.kv_offload.base import Medium

    rig = rigs(
        {"store": {"backend": "memory", "capacity_bytes": 2 * (HEADER_SIZE + 4096)}},
        chunks=8,
    )
    tier = rig.tier
    k1, k2, k3 = new_keys(3)
    for i, key in enumerate((k1, k2, k3)):
        rig.store([key], f"w{i}")  # the store holds two rows: k1 goes

    def held(key) -> bool:
        return tier._loop.run(tier.store.batch_exists(tier.store_keys([key]))) == 1

    assert not held(k1)
    rig.mgr.reset_cache()
    rig.mgr.on_reset_flushed()
    written = rig.store(
        [k1], "recompute"
    )  # vLLM computed k1 again: primary, then the cascade
    assert held(k1)
    assert k1 in [
        k
        for e in rig.events
        if e.medium is Medium.STORAGE and not e.removed
        for k in e.keys
    ]
    rig.mgr.reset_cache()
    rig.mgr.on_reset_flushed()
    seen, got = rig.load([k1], "reader")
    assert got == written


def test_while_the_store_is_skipped_promotions_announce_no_row_removed(
    tmp_path, rigs, monkeypatch
):
    """Once a hung read opened the breaker, promotions of rows the store holds intact were
    skipped, and the tier took the skip for rows gone: it sent `BlockRemoved` (STORAGE) to
    routers. A call that failed as a whole (breaker, timeout, error) fails the job (vLLM
    recomputes those blocks) but announces nothing of its keys."""
    from vllm.v1.kv_offload.base import Medium

    from tests.hung import HungMount

    rig = rigs(
        conf(
            {"backend": "file", "root": str(tmp_path / "l3"), "timeout_s": 0.3},
            store_probe_backoff_s=60.0,
        ),
        chunks=4,
    )
    tier = rig.tier
    hung, k2, k3 = new_keys(3)
    rig.store([hung, k2, k3])
    mount = HungMount(monkeypatch)
    mount.hang(tier.store.path(tier.store_keys([hung])[0]))  # one page on a hung mount
    try:
        rig.mgr.reset_cache()
        rig.mgr.on_reset_flushed()
        rig.load([hung], "r1")  # times out, its thread is abandoned: the store is down
        assert tier.breaker.down
        rig.events.clear()
        seen, _ = rig.load([k2, k3], "r2")
        assert [s[-1].name for s in seen.values()] == [
            "MISS",
            "MISS",
        ]  # not promoted: recomputed
        assert not [e for e in rig.events if e.medium is Medium.STORAGE and e.removed]
    finally:
        mount.release()


def test_a_promotion_read_given_up_on_stuck_writes_no_row_vllm_reuses(
    tmp_path, rigs, monkeypatch
):
    """A hung mount (tests/hung.py). The promotion's read is given up on and reported
    failed; vLLM frees its primary row and stores other KV there. When the mount came back,
    the abandoned thread went on reading into that row: vLLM then served the other key's
    block with these bytes. Reads land in kvtier's own buffers and are copied into a row
    only once they verified."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from tests.hung import HungMount

    rig = rigs(
        conf({"backend": "file", "root": str(tmp_path / "l3"), "timeout_s": 0.3}),
        chunks=2,
    )
    tier = rig.tier
    [key] = new_keys(1)
    rig.store([key])
    path = str(tier.store.path(tier.store_keys([key])[0]))
    mount = HungMount(monkeypatch)
    mount.hang(path)
    try:
        rig.mgr.reset_cache()
        rig.mgr.on_reset_flushed()  # the primary tier is empty: the block lives in the store only
        ctx = ReqContext(req_id="reader")
        rig.mgr.on_new_request(ctx)
        assert (
            rig.mgr.lookup(key, ctx) is LookupResult.HIT_PENDING
        )  # a promotion into a primary row
        rig.step()
        tier.drain_jobs()  # the read times out and is abandoned: the job failed
        rig.step()
        assert rig.mgr.lookup(key, ctx) is not LookupResult.HIT
        rig.mgr.on_request_finished(ctx)
        rig.settle()
        others = new_keys(2)
        written = rig.store(others, "writer2")  # every primary row holds other KV now
        with open(
            path, "r+b"
        ) as f:  # the page's bytes when the mount comes back: anything
            f.seek(200)
            f.write(b"\xab" * 256)
        mount.come_back()  # the stuck read goes on, and its thread ends
        _, got = rig.load(others, "reader2")
        assert got == written
    finally:
        mount.release()


def corrupt(kind: str, request, tier, key_full: str, section: dict) -> None:
    """Flip one payload byte of the stored frame, with the store's own raw client."""
    if kind == "file":
        path = tier.store.path(key_full)
        blob = bytearray(path.read_bytes())
        blob[-1] ^= 0xFF
        path.write_bytes(bytes(blob))
    elif kind == "redis":
        import redis

        raw = redis.Redis.from_url(section["url"])
        blob = bytearray(raw.get(key_full))
        blob[-1] ^= 0xFF
        raw.set(key_full, bytes(blob))
    else:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=section["endpoint_url"],
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        blob = bytearray(
            client.get_object(Bucket=section["bucket"], Key=key_full)["Body"].read()
        )
        blob[-1] ^= 0xFF
        client.put_object(Bucket=section["bucket"], Key=key_full, Body=bytes(blob))


def test_no_view_of_a_row_outlives_the_tier(tmp_path):
    """vLLM unmaps its primary region at shutdown only if nothing holds a view of it
    (else it logs "Keeping ... mapped" and the mapping lives on). The tier keeps each
    row's view for its jobs, and a page that fails verification is an exception whose
    traceback held the frame that read into the row, in a cycle only the GC frees: after
    stores, a load with a corrupt page and shutdown, the region is unmapped."""
    import gc

    rig = rt.Rig(conf({"backend": "file", "root": str(tmp_path / "l3")}))
    region = rig.mgr.primary_tier._mmap_region
    gc.disable()  # a collection between the load and the check would hide a cycle
    try:
        keys = new_keys(3)
        rig.store(keys)
        tier = rig.tier
        corrupt("file", None, tier, tier.store_keys(keys[1:2])[0], {})
        rig.mgr.reset_cache()
        rig.mgr.on_reset_flushed()
        _, got = rig.load(keys, "r1")
        assert keys[1] not in got and len(got) == 2
        rig.close()
        assert region.mmap_obj is None, "the primary region is still mapped"
    finally:
        gc.enable()
        rig.close()


@pytest.mark.parametrize("kind", STORES)
def test_a_corrupted_stored_block_is_a_miss(kind, request, tmp_path, rigs):
    from kvtier.integrations.vllm.keys import page_hash_of
    from kvtier.hashing import make_key

    section = store_section(kind, request, tmp_path)
    cfg = conf(section)
    keys = new_keys(3)
    written = rigs(cfg).store(keys)
    reader = rigs(cfg)
    t = reader.tier
    corrupt(
        kind,
        request,
        t,
        make_key(t.key_prefix, t.namespace.id, page_hash_of(keys[1])),
        section,
    )
    seen, got = reader.load(keys)
    # the probe finds all three; the promotion verifies two: the bad one ends a MISS
    assert names(seen)[0][-1] == "HIT" and names(seen)[2][-1] == "HIT"
    assert names(seen)[1] == ["RETRY", "HIT_PENDING", "MISS"]
    assert got == {keys[0]: written[keys[0]], keys[2]: written[keys[2]]}
    assert t.kvtier_stats()["frame_failures"] == 1


@pytest.mark.parametrize("kind", STORES)
def test_a_block_that_fails_verification_is_forgotten(kind, request, tmp_path, rigs):
    """A corrupted row failed its promotion, left the index, and the next request's probe
    found the file again: HIT, promoted, failed, recomputed, on every request. The row
    is deleted from the store and remembered unreadable: the next lookup of that key is
    a MISS with no probe and no promotion (the other keys still HIT), a new engine's
    probe misses it, and once vLLM recomputed and cascaded it, it is a HIT again."""
    from vllm.v1.kv_offload.base import Medium

    from kvtier.hashing import make_key
    from kvtier.integrations.vllm.keys import page_hash_of

    section = store_section(kind, request, tmp_path)
    cfg = conf(section)
    keys = new_keys(3)
    written = rigs(cfg).store(keys)
    reader = rigs(cfg)
    t = reader.tier
    bad = make_key(t.key_prefix, t.namespace.id, page_hash_of(keys[1]))
    corrupt(kind, request, t, bad, section)
    seen, got = reader.load(keys)
    assert names(seen)[1] == ["RETRY", "HIT_PENDING", "MISS"]
    assert got == {keys[0]: written[keys[0]], keys[2]: written[keys[2]]}
    reader.events.clear()
    reader.mgr.reset_cache()
    reader.mgr.on_reset_flushed()
    promoted = t.counters["load_keys"]
    seen, got = reader.load(keys, "next")
    assert names(seen) == [["HIT_PENDING", "HIT"], ["MISS"], ["HIT_PENDING", "HIT"]]
    assert t.counters["load_keys"] == promoted + 2  # keys[1] was not promoted again
    assert got == {keys[0]: written[keys[0]], keys[2]: written[keys[2]]}
    assert t._loop.run(t.store.batch_exists([bad])) == 0
    seen, _ = rigs(cfg).load([keys[1]])
    assert names(seen) == [["RETRY", "MISS"]]
    again = reader.store([keys[1]], "recomputed")
    assert [k for e in reader.events if e.medium is Medium.STORAGE for k in e.keys] == [
        keys[1]
    ]
    reader.mgr.reset_cache()
    reader.mgr.on_reset_flushed()
    seen, got = reader.load([keys[1]], "after")
    assert names(seen) == [["HIT_PENDING", "HIT"]] and got == again


def test_a_row_a_transient_error_kept_from_being_read_is_not_deleted(
    request, tmp_path, rigs, monkeypatch
):
    """A row the file store could not read for a passing reason (too many open files) was
    taken for a bad one: deleted from the store and remembered unreadable, a good block
    lost. Nothing is learnt of such a row: its promotion fails, the file stays, and the
    next request's probe finds it and promotes it."""
    import errno

    from kvtier.backends import file_io
    from kvtier.hashing import make_key
    from kvtier.integrations.vllm.keys import page_hash_of

    cfg = conf(store_section("file", request, tmp_path))
    keys = new_keys(3)
    written = rigs(cfg).store(keys)
    reader = rigs(cfg)
    t = reader.tier
    busy = make_key(t.key_prefix, t.namespace.id, page_hash_of(keys[1]))
    failing = {t.store._file(busy)}
    real = file_io._open_page

    def open_page(path):
        if path in failing:
            failing.discard(path)
            raise OSError(errno.EMFILE, "Too many open files", path)
        return real(path)

    monkeypatch.setattr(file_io, "_open_page", open_page)
    seen, got = reader.load(keys)
    assert not failing  # the error was met
    assert got == {keys[0]: written[keys[0]], keys[2]: written[keys[2]]}
    assert t._loop.run(t.store.batch_exists([busy])) == 1
    assert t.index.stats()["index_unreadable"] == 0
    reader.mgr.reset_cache()
    reader.mgr.on_reset_flushed()
    seen, got = reader.load(keys, "next")
    assert got == written


def test_a_direct_store_job_that_cannot_write_one_row_stores_the_rest(tmp_path, rigs):
    """One row of a direct store job cannot be published (a directory stands at its
    page's path): that key alone fails. The job's other rows are stored and announced,
    the failed key is neither announced nor stored, no temp file is left behind, and the
    tier has nothing in flight. A later job writes it once the path is free."""
    from vllm.v1.kv_offload.base import Medium

    from kvtier.hashing import make_key
    from kvtier.integrations.vllm.keys import page_hash_of

    cfg = conf({"backend": "file", "root": str(tmp_path / "l3")})
    writer = rigs(cfg)
    t = writer.tier
    writer.store(new_keys(1), "manifest")  # the namespace's first write, on the loop
    keys = new_keys(3)
    blocked = t.store.path(
        make_key(t.key_prefix, t.namespace.id, page_hash_of(keys[1]))
    )
    (blocked / "in-the-way").mkdir(parents=True)
    direct = t.counters["direct_jobs"]
    written = writer.store(keys, "partly")
    assert t.counters["direct_jobs"] == direct + 1  # the direct path, not the loop's
    announced = [
        k
        for e in writer.events
        if e.medium is Medium.STORAGE and not e.removed
        for k in e.keys
    ]
    assert announced == [keys[0], keys[2]]
    assert not writer.mgr.has_pending_work()
    temps = [f for _, _, fs in os.walk(t.store.root) for f in fs if ".tmp" in f]
    assert temps == []
    exists = [t._loop.run(t.store.batch_exists(t.store_keys([k]))) for k in keys]
    assert exists == [1, 0, 1]
    seen, got = rigs(cfg).load([keys[0], keys[2]])  # a leading run stops at a MISS
    assert names(seen) == [["RETRY", "HIT_PENDING", "HIT"]] * 2
    assert got == {keys[0]: written[keys[0]], keys[2]: written[keys[2]]}

    shutil.rmtree(blocked)
    again = rigs(cfg).store([keys[1]], "freed")  # another engine computed it again
    seen, got = rigs(cfg).load([keys[1]])
    assert names(seen)[0][-1] == "HIT" and got == again


def test_a_black_hole_store_does_not_stall_lookup(rigs):
    """A redis endpoint that accepts and never answers: lookup answers RETRY at once while
    the probe waits out its timeout, then MISS; once the breaker is open, stores fail fast
    and lookups cost no call at all."""
    from kvtier.bench.servers import BlackHole
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    hole = BlackHole()
    try:
        rig = rigs(
            conf(
                {
                    "backend": "redis",
                    "url": f"redis://127.0.0.1:{hole.port}/0",
                    "timeout_s": 0.3,
                },
                store_down_after_failures=2,
                store_probe_backoff_s=60.0,
            )
        )
        keys = new_keys(2)
        ctx = ReqContext(req_id="r")
        rig.mgr.on_new_request(ctx)
        assert [rig.mgr.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 2
        rig.step()  # the probe goes out
        assert rig.tier.index.in_flight == 1  # unanswered: the hole holds it
        assert [rig.mgr.lookup(k, ctx) for k in keys] == [
            LookupResult.RETRY
        ] * 2  # returned without it
        rig.tier.drain_jobs()  # the probe times out (0.3 s)
        assert [rig.mgr.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 2
        rig.mgr.on_request_finished(ctx)
        # a cascade: the second failure opens the breaker
        written = rig.store(new_keys(2), "w1")
        assert rig.tier.counters["store_ok"] == 0 and len(written) == 2
        assert rig.tier.breaker.down
        before = rig.tier.store.stats()["timeouts"]
        rig.store(new_keys(2), "w2")  # skipped by the breaker: no call, no timeout
        seen, _ = rig.load(new_keys(2), "r2")
        assert names(seen) == [["RETRY", "MISS"]] * 2
        assert rig.tier.store.stats()["timeouts"] == before
        assert rig.tier.breaker.skipped >= 2
    finally:
        hole.stop()


def test_bad_tier_config_names_the_key(tmp_path):
    with pytest.raises(KvtierConfigError, match=r"unknown key\(s\) kvtier_conf;"):
        rt.Rig({"store": {"backend": "file"}}, kvtier_conf="x")
    with pytest.raises(KvtierConfigError, match=r"kvtier_config=None"):
        rt.Rig(None)
    with pytest.raises(KvtierConfigError, match=r"store.backend='none'"):
        rt.Rig({"namespace": {"model_id": "m"}})
    with pytest.raises(
        KvtierConfigError,
        match=r"store.page_tokens=64: secondary tier .* stores one engine page",
    ):
        rt.Rig(
            {
                "store": {
                    "backend": "file",
                    "root": str(tmp_path / "l3"),
                    "page_tokens": 64,
                }
            }
        )


def test_namespace_separates_tenants_and_models(tmp_path, rigs):
    section = {"backend": "file", "root": str(tmp_path / "l3")}
    a = rigs({"store": section}, tenant="a")
    b = rigs({"store": section}, tenant="b")
    assert a.tier.namespace.id != b.tier.namespace.id
    assert (
        a.tier.namespace.model_id == "tiny-llama"
        and a.tier.namespace.dtype == "float16"
    )
    keys = new_keys(2)
    a.store(keys)
    seen, got = b.load(keys)
    assert names(seen) == [["RETRY", "MISS"]] * 2 and got == {}


def test_module_imports_without_vllm(tmp_path):
    """`import kvtier.integrations.vllm` works without vLLM; KvtierTier names the install."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\nclass B:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'vllm'\")\n"
        "sys.meta_path.insert(0, B())\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}"}
    code = (
        "import kvtier.integrations.vllm as v\n"
        "try:\n    v.KvtierTier\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "pip install --no-deps vllm==0.33.0" in out.stdout


from kvtier.backends.memory import MemoryStore  # noqa: E402


class BuggyStore(MemoryStore):
    """A store plugin with a bug: its writes raise what kvtier treats as a bug, not a store
    failure (AssertionError passes through the store's error mapping)."""

    async def _set(self, keys, frames):
        raise AssertionError("plugin bug")


def test_a_job_whose_store_call_raises_a_bug_fails_its_keys_and_never_hangs(rigs):
    rig = rigs({"store": {"backend": "tests.integrations.test_vllm_tier:BuggyStore"}})
    keys = new_keys(3)
    rig.store(
        keys
    )  # settles: the job ended (vLLM's manager would wait forever on a lost one)
    assert rig.tier.counters["store_ok"] == 0 and not rig.tier.has_pending_work()
    rig.mgr.reset_cache()  # vLLM asserts no job is left
    rig.mgr.on_reset_flushed()
    seen, got = rig.load(keys)
    assert names(seen) == [["RETRY", "MISS"]] * 3 and got == {}


class UnbuildableStore(MemoryStore):
    def __init__(self, config=None, timeout_s: float = 5.0) -> None:
        raise StoreUnavailable("unbuildable: the endpoint refused")


def test_a_store_that_cannot_be_built_leaves_no_thread_and_no_region():
    import glob
    import threading

    def leftovers():
        return (
            {t.name for t in threading.enumerate() if t.name == "kvtier-vllm-store"},
            set(glob.glob("/dev/shm/vllm_offload_kvtiertest*")),
        )

    before = leftovers()
    with pytest.raises(StoreUnavailable, match="unbuildable"):
        rt.Rig(
            {"store": {"backend": "tests.integrations.test_vllm_tier:UnbuildableStore"}}
        )
    assert leftovers() == before


# -- a tenant key (docs/security.md) --------------------------------------------------------


def keyed(cfg: dict, **namespace) -> dict:
    return {**cfg, "namespace": {**cfg["namespace"], **namespace}}


@pytest.mark.parametrize(
    "kind,encrypt", [("file", False), ("redis", True), ("s3", False)]
)
def test_tenant_key_round_trips_and_its_store_keys_tell_nothing(
    kind, encrypt, request, tmp_path, rigs, caplog
):
    """With a tenant key the namespace carries its id, a new engine promotes the sealed
    rows byte for byte, the store's keys are keyed hashes (none holds a vLLM block hash,
    which anyone can compute from the tokens), the KV events keep vLLM's own keys, another
    key or none finds nothing, and no repr, stat or log line shows the key."""
    from vllm.v1.kv_offload.base import Medium

    from kvtier.hashing import make_key
    from kvtier.integrations.vllm.keys import page_hash_of

    caplog.set_level(logging.DEBUG)
    section = store_section(kind, request, tmp_path)
    base = conf(section)
    cfg = keyed(base, tenant_key=KEY_A, encrypt=encrypt)
    keys = new_keys(4)
    writer = rigs(cfg)
    written = writer.store(keys)
    assert [
        k
        for e in writer.events
        if e.medium is Medium.STORAGE and not e.removed
        for k in e.keys
    ] == keys
    t = writer.tier
    assert t.namespace.tenant_key_id == KEY_A_ID
    reader = rigs(cfg)
    seen, got = reader.load(keys)
    assert names(seen) == [["RETRY", "HIT_PENDING", "HIT"]] * 4 and got == written
    seen = list_store(section, t.namespace.id)
    unkeyed = {make_key(t.key_prefix, t.namespace.id, page_hash_of(k)) for k in keys}
    assert len(seen.keys) == len(keys) and not unkeyed & set(seen.keys)
    assert not any(k[:-4].hex() in key for k in keys for key in seen.keys)
    assert (
        seen.plain == 0 and seen.manifest["tenant_key_id"] == KEY_A_ID
    )  # every frame sealed
    for other in (keyed(base, tenant_key=KEY_B), base):
        seen, got = rigs(other).load(keys)
        assert names(seen) == [["RETRY", "MISS"]] * 4 and got == {}
    shown = " ".join(
        [repr(t.tenant), repr(t.store.codec), str(t.kvtier_stats()), caplog.text]
    )
    assert KEY_A_ID in repr(t.tenant) and not leaks_key(shown)


@pytest.mark.parametrize("encrypt", [False, True])
def test_tenant_key_a_reframed_block_is_a_miss(encrypt, tmp_path, rigs):
    """Who can write the store re-frames row 1 with row 2's payload under a fresh plain
    xxh3 checksum (which a store without a key serves): with a key its promotion is a MISS,
    and the other rows come back byte for byte."""
    cfg = keyed(
        conf({"backend": "file", "root": str(tmp_path / "l3")}),
        tenant_key=KEY_A,
        encrypt=encrypt,
    )
    keys = new_keys(3)
    written = rigs(cfg).store(keys)
    reader = rigs(cfg)
    t = reader.tier
    files = [t.store.path(k) for k in t.store_keys(keys)]
    reframe_plain(files[1], files[2])
    seen, got = reader.load(keys)
    assert names(seen)[1] == ["RETRY", "HIT_PENDING", "MISS"]
    assert got == {keys[0]: written[keys[0]], keys[2]: written[keys[2]]}
    assert t.kvtier_stats()["frame_failures"] == 1


def test_a_malformed_tenant_key_is_refused_without_showing_it():
    bad = KEY_A[:-2] + "zz"
    with pytest.raises(ValueError, match="tenant_key") as err:
        rt.Rig({"store": {"backend": "file"}, "namespace": {"tenant_key": bad}})
    assert bad not in str(err.value) and not leaks_key(str(err.value))


def test_the_file_store_gets_a_thread_for_each_job_in_flight(tmp_path, rigs):
    """The file store's default keeps half the cores for an engine's scheduler: one I/O
    thread on two cores for every job vLLM keeps in flight, where vLLM's own fs tier gives
    each job a thread. The tier raises it to JOB_THREADS, or to the cores where there are
    fewer (threads past them only take turns); a larger setting is kept."""
    from kvtier.integrations.vllm.tier import JOB_THREADS, job_threads

    assert job_threads(range(64)) == JOB_THREADS == 4
    assert job_threads({0, 1}) == 2 and job_threads({5}) == 1
    cores = len(os.sched_getaffinity(0))
    assert job_threads(None) == min(JOB_THREADS, cores)

    section = {"backend": "file", "root": str(tmp_path / "l3")}
    assert rigs(conf(section)).tier.store.config.max_concurrency == min(
        JOB_THREADS, cores
    )
    one = min(os.sched_getaffinity(0))  # confined to one core: one thread
    confined = conf(section, cpus=str(one))
    assert rigs(confined).tier.store.config.max_concurrency == 1
    more = {**section, "max_concurrency": JOB_THREADS + 4}
    assert rigs(conf(more)).tier.store.config.max_concurrency == JOB_THREADS + 4


def test_lookup_probes_go_through_vllms_lookup_phases():
    """A probe is PENDING (queued: RETRY), IN_FLIGHT once sent at the end of the step,
    RESOLVED by its answer, as in vLLM's AsyncLookupManager; a failed load forces only a
    RESOLVED verdict to MISS (vLLM's mark_miss), a probe still out answers for itself."""
    from vllm.v1.kv_offload.tiering.async_lookup import LookupPhase

    from kvtier.integrations.vllm.index import Answer, LookupIndex

    index = LookupIndex(8)
    a, b = b"a" * 20, b"b" * 20
    assert [index.lookup(k, "r1") for k in (a, b)] == [Answer.RETRY] * 2
    assert index.verdicts[a].phase is LookupPhase.PENDING
    [probe] = index.take_probes()
    assert probe.keys == (a, b) and index.verdicts[b].phase is LookupPhase.IN_FLIGHT
    index.forget(b)  # a load failed while the probe was out: its answer still counts
    index.apply(probe, 2)
    assert [index.verdicts[k].phase for k in (a, b)] == [LookupPhase.RESOLVED] * 2
    assert [index.lookup(k, "r1") for k in (a, b)] == [Answer.HIT, Answer.HIT]
    index.forget(b)  # now resolved: a MISS for the requests that hold it
    assert index.lookup(b, "r1") is Answer.MISS
    index.release("r1")
    assert index.verdicts == {} and index.take_probes() == []


def test_every_override_of_vllms_tier_manager_says_so():
    """Each method KvtierTier (and its metrics mixin) defines over vLLM's
    SecondaryTierManager is marked @override, so a rename on vLLM's side is caught by a
    type checker rather than leaving a method vLLM never calls."""
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

    from kvtier.integrations.vllm.metrics import TierMetrics
    from kvtier.integrations.vllm.tier import KvtierTier

    unmarked = [
        f"{cls.__name__}.{name}"
        for cls in (KvtierTier, TierMetrics)
        for name, fn in vars(cls).items()
        if callable(fn)
        and not name.startswith("__")
        and hasattr(SecondaryTierManager, name)
        and not getattr(fn, "__override__", False)
    ]
    assert unmarked == []
