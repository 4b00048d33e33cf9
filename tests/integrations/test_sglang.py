"""kvtier as SGLang 0.5.23's L3 backend, against SGLang's real classes.

The backend is created the way SGLang creates it (its real `StorageBackendFactory`, the
`dynamic` backend, then `register_mem_pool_host`) over real host pools (`MHATokenToKVPoolHost`,
`MLATokenToKVPoolHost`), and talks to real stores: files, redis-server, a redis cluster and
an S3 endpoint. SGLang is loaded by kvtier.testing.sglang_loader.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import uuid

import pytest
import torch
import yaml

import kvtier
from kvtier.errors import KvtierConfigError
from kvtier.testing import sglang_loader
from tests.integrations import sglang_runtime as rt
from tests.integrations.prom_multiproc import multiproc, scrape  # noqa: F401
from tests.servers import IN_CI, free_port

STORES = ["file", "redis", "redis_cluster", "s3"]


@pytest.fixture(scope="module")
def sg():
    try:
        return sglang_loader.load()
    except sglang_loader.Unavailable as exc:
        if IN_CI:
            pytest.fail(f"{exc}; .ci/run must install it")
        pytest.skip(str(exc))


def _store_section(kind: str, request, tmp_path) -> dict:
    if kind == "file":
        return {"backend": "file", "root": str(tmp_path / "l3")}
    if kind == "redis":
        return {"backend": "redis", "url": request.getfixturevalue("redis_server").url}
    if kind == "redis_cluster":
        return {
            "backend": "redis",
            "url": request.getfixturevalue("redis_cluster")[0].url,
            "cluster": True,
        }
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


def write_yaml(
    tmp_path, store: dict, controller: dict | None = None, **namespace
) -> str:
    path = tmp_path / f"kvtier-{uuid.uuid4().hex[:6]}.yaml"
    doc = {"store": {"timeout_s": 5.0, **store}}
    if namespace:
        doc["namespace"] = namespace
    if controller:
        doc["controller"] = controller
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def attach(
    sg,
    pool,
    yaml_path,
    *,
    mla=False,
    tp_rank=0,
    tp_size=1,
    model="meta-llama/Llama-3.1-8B",
    dp_rank=0,
    **extra,
):
    """What SGLang's cache controller does: the factory's `dynamic` backend, then the pool."""
    cfg = rt.storage_config(
        sg,
        model=model,
        mla=mla,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dp_rank=dp_rank,
        extra={
            "backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang",
            "class_name": "KvtierStorage",
            "kvtier_config": yaml_path,
            "interface_v1": 1,
            **extra,
        },
    )
    backend = sg.backend_factory.StorageBackendFactory.create_backend(
        "dynamic", cfg, pool
    )
    backend.register_mem_pool_host(pool)
    return backend


def make_pool(sg, kind: str, layout: str, **kw):
    return (rt.make_mla_pool if kind == "mla" else rt.make_mha_pool)(sg, layout, **kw)


def page_keys(n: int) -> list[str]:
    return [
        os.urandom(32).hex() for _ in range(n)
    ]  # SGLang's page hashes are sha256 hex


def fill(pool, n: int, seed: int) -> torch.Tensor:
    """Host slots for n pages, each page random bytes (as a forward would have left them)."""
    idx = pool.alloc(n * pool.page_size)
    g = torch.Generator().manual_seed(seed)
    for start in idx[:: pool.page_size].tolist():
        page = pool.get_dummy_flat_data_page()
        page.view(torch.uint8 if page.element_size() == 1 else torch.int16).copy_(
            torch.randint(0, 255, page.shape, generator=g).to(page.dtype)
            if page.element_size() == 1
            else torch.randint(
                -30000, 30000, page.shape, dtype=torch.int16, generator=g
            )
        )
        pool.set_from_flat_data_page(start, page)
    return idx


def page_bytes(pool, idx: torch.Tensor) -> list[bytes]:
    return [
        pool.get_data_page(s, flat=True)
        .contiguous()
        .view(torch.uint8)
        .numpy()
        .tobytes()
        for s in idx[:: pool.page_size].tolist()
    ]


def corrupt(kind: str, backend, key: str, request) -> None:
    """Flip one payload byte of the page stored for SGLang's `key`, behind kvtier's back."""
    full = backend._keys([key])[0]
    store = backend.store
    if kind == "file":
        path = store.path(full)
        blob = bytearray(path.read_bytes())
        blob[-1] ^= 0xFF
        path.write_bytes(bytes(blob))
        return
    if kind in ("redis", "redis_cluster"):
        import redis
        from redis.cluster import RedisCluster

        url = store.config.url
        client = (
            RedisCluster.from_url(url)
            if kind == "redis_cluster"
            else redis.Redis.from_url(url)
        )
        blob = bytearray(client.get(full))
        blob[-1] ^= 0xFF
        client.set(full, bytes(blob))
        client.close()
        return
    import boto3

    cfg = store.config
    client = boto3.client(
        "s3",
        endpoint_url=cfg.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    obj_key = cfg.prefix + full
    blob = bytearray(client.get_object(Bucket=cfg.bucket, Key=obj_key)["Body"].read())
    blob[-1] ^= 0xFF
    client.put_object(Bucket=cfg.bucket, Key=obj_key, Body=bytes(blob))


# -- the round trip SGLang runs: backup on one server, prefetch on another ------------------


@pytest.mark.parametrize("store_kind", STORES)
@pytest.mark.parametrize(
    "attn,layout",
    [
        ("mha", "page_first"),
        ("mha", "layer_first"),
        ("mla", "page_first"),
        ("mla", "layer_first"),
    ],
)
def test_v1_round_trip_is_bitwise_and_a_corrupt_page_is_false(
    sg, store_kind, attn, layout, request, tmp_path
):
    path = write_yaml(tmp_path, _store_section(store_kind, request, tmp_path))
    mla = attn == "mla"
    writer_pool = make_pool(sg, attn, layout)
    writer = attach(sg, writer_pool, path, mla=mla)
    keys = page_keys(5)
    src = fill(writer_pool, len(keys), seed=1)
    assert writer.batch_set_v1(keys, src) == [True] * 5
    writer.close()

    # another server (same model, same geometry) prefetches them
    reader_pool = make_pool(sg, attn, layout)
    reader = attach(sg, reader_pool, path, mla=mla)
    assert reader.batch_exists(keys) == 5
    dst = reader_pool.alloc(5 * reader_pool.page_size)
    assert reader.batch_get_v1(keys, dst) == [True] * 5
    assert page_bytes(reader_pool, dst) == page_bytes(writer_pool, src)

    # one stored page goes bad: False for that key, the others still load
    corrupt(store_kind, reader, keys[2], request)
    again = reader_pool.alloc(5 * reader_pool.page_size)
    ok = reader.batch_get_v1(keys, again)
    assert ok == [True, True, False, True, True]
    good = [b for b, o in zip(page_bytes(reader_pool, again), ok) if o]
    assert good == [b for b, o in zip(page_bytes(writer_pool, src), ok) if o]
    stats = reader.kvtier_stats()
    assert stats["frame_failures"] == 1 and stats["get_ok"] == 9
    reader.close()


@pytest.mark.parametrize("store_kind", ["file", "redis"])
@pytest.mark.parametrize("attn,layout", [("mha", "layer_first"), ("mla", "page_first")])
def test_legacy_get_set_round_trip(sg, store_kind, attn, layout, request, tmp_path):
    path = write_yaml(tmp_path, _store_section(store_kind, request, tmp_path))
    pool = make_pool(sg, attn, layout)
    backend = attach(sg, pool, path, mla=attn == "mla")
    keys = page_keys(3)
    src = fill(pool, 3, seed=2)
    # SGLang's _generic_page_set: flat pages from get_data_page, then batch_set
    pages = [pool.get_data_page(s) for s in src[:: pool.page_size].tolist()]
    assert backend.batch_set(keys, pages) is True
    assert backend.set(keys[0], pages[0]) is True  # a page stored twice is still True
    assert backend.exists(keys[1]) and backend.batch_exists(keys + page_keys(1)) == 3
    # SGLang's _generic_page_get: dummy flat pages, then set_from_flat_data_page
    targets = [pool.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys, targets)
    assert all(g is t for g, t in zip(got, targets))
    assert [t.view(torch.uint8).numpy().tobytes() for t in targets] == page_bytes(
        pool, src
    )
    single = backend.get(keys[2], pool.get_dummy_flat_data_page())
    assert torch.equal(single.view(torch.uint8), targets[2].view(torch.uint8))
    assert backend.get(page_keys(1)[0], pool.get_dummy_flat_data_page()) is None
    assert not backend.exists(page_keys(1)[0])
    backend.close()
    backend.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="kvtier SGLang backend: closed"):
        backend.exists(keys[0])  # its loop is gone: it would have waited on it forever


# -- namespaces: what SGLang's keys leave out ----------------------------------------------


def test_kv_dtype_layout_and_tp_rank_separate_pages(sg, tmp_path):
    path = write_yaml(tmp_path, {"backend": "file", "root": str(tmp_path / "l3")})
    keys = page_keys(2)

    def written(pool, **kw):
        b = attach(sg, pool, path, **kw)
        assert b.batch_set_v1(keys, fill(pool, 2, seed=3)) == [True, True]
        b.close()

    def visible(pool, **kw) -> int:
        b = attach(sg, pool, path, **kw)
        n = b.batch_exists(keys)
        idx = pool.alloc(2 * pool.page_size)
        assert b.batch_get_v1(keys, idx) == [n > 0, n > 1]
        b.close()
        return n

    written(rt.make_mha_pool(sg, dtype=torch.bfloat16))
    assert visible(rt.make_mha_pool(sg, dtype=torch.bfloat16)) == 2
    # SGLang #33268: a bf16 and an fp16 run of the same model must not share pages
    assert visible(rt.make_mha_pool(sg, dtype=torch.float16)) == 0
    # the flat page's byte order depends on the host layout: another layout is a miss
    assert visible(rt.make_mha_pool(sg, "layer_first", dtype=torch.bfloat16)) == 0
    # MHA KV is sharded by TP rank
    assert visible(rt.make_mha_pool(sg), tp_rank=1, tp_size=2) == 0
    assert visible(rt.make_mha_pool(sg), model="Qwen/Qwen3-8B") == 0

    # fp8 KV lives in uint8 host pools: SGLang's --kv-cache-dtype tells e4m3 from e5m2
    written(rt.make_mha_pool(sg, dtype=torch.uint8), kv_cache_dtype="fp8_e4m3")
    assert (
        visible(rt.make_mha_pool(sg, dtype=torch.uint8), kv_cache_dtype="fp8_e4m3") == 2
    )
    assert (
        visible(rt.make_mha_pool(sg, dtype=torch.uint8), kv_cache_dtype="fp8_e5m2") == 0
    )

    # MLA KV is the same on every TP rank: rank 1 reads what rank 0 wrote
    written(rt.make_mla_pool(sg), mla=True, tp_rank=0, tp_size=2)
    assert visible(rt.make_mla_pool(sg), mla=True, tp_rank=1, tp_size=2) == 2


def test_tenant_salt_separates_and_clear_removes_only_its_namespace(sg, tmp_path):
    store = {"backend": "file", "root": str(tmp_path / "l3")}
    a_path = write_yaml(tmp_path, store, tenant_salt="tenant-a")
    b_path = write_yaml(tmp_path, store, tenant_salt="tenant-b")
    keys = page_keys(3)
    a_pool, b_pool = rt.make_mha_pool(sg), rt.make_mha_pool(sg)
    a, b = attach(sg, a_pool, a_path), attach(sg, b_pool, b_path)
    assert a.batch_set_v1(keys, fill(a_pool, 3, seed=4)) == [True] * 3
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, fill(b_pool, 3, seed=5)) == [True] * 3
    assert b.clear() is True
    assert b.batch_exists(keys) == 0 and a.batch_exists(keys) == 3
    a.close()
    b.close()


@pytest.mark.parametrize(
    "store_kind,encrypt",
    [("file", False), ("redis", True), ("redis_cluster", False), ("s3", True)],
)
def test_tenant_key_seals_pages_and_keeps_sglangs_hashes_out_of_the_keys(
    sg, store_kind, encrypt, request, tmp_path
):
    """docs/security.md: with a tenant key the store keys are keyed hashes of SGLang's (which
    anyone can compute from the tokens), pages are sealed (a flipped byte is False), and
    another tenant's key, or none, finds nothing."""
    section = _store_section(store_kind, request, tmp_path)
    a_path = write_yaml(tmp_path, section, tenant_key="a1" * 32, encrypt=encrypt)
    keys = page_keys(4)
    pool = rt.make_mha_pool(sg)
    a = attach(sg, pool, a_path)
    src = fill(pool, 4, seed=7)
    assert a.batch_set_v1(keys, src) == [True] * 4
    assert not any(k in full for k, full in zip(keys, a._keys(keys)))
    dst = pool.alloc(4 * pool.page_size)
    assert a.batch_get_v1(keys, dst) == [True] * 4 and page_bytes(
        pool, dst
    ) == page_bytes(pool, src)
    for other in ({"tenant_key": "b2" * 32}, {}):
        b = attach(sg, rt.make_mha_pool(sg), write_yaml(tmp_path, section, **other))
        assert b.batch_exists(keys) == 0
        b.close()
    corrupt(store_kind, a, keys[1], request)
    assert a.batch_get_v1(keys, pool.alloc(4 * pool.page_size)) == [
        True,
        False,
        True,
        True,
    ]
    assert a.kvtier_stats()["frame_failures"] == 1
    a.close()


# -- fail closed --------------------------------------------------------------------------


def test_unreachable_store_is_a_miss_then_skipped_by_the_breaker(sg, tmp_path):
    port = free_port()  # nothing listens: every call is refused
    path = write_yaml(
        tmp_path,
        {
            "backend": "redis",
            "url": f"redis://127.0.0.1:{port}/0",
            "connect_timeout_s": 0.5,
            "socket_timeout_s": 0.5,
        },
    )
    pool = rt.make_mha_pool(sg)
    backend = attach(sg, pool, path)
    keys = page_keys(2)
    idx = fill(pool, 2, seed=6)
    before = page_bytes(pool, idx)
    for _ in range(3):
        assert backend.batch_exists(keys) == 0
    assert backend.kvtier_stats()["store_down"] is True
    # down: calls are answered at once, as misses, without touching the host pool
    assert backend.batch_get_v1(keys, idx) == [False, False]
    assert backend.batch_set_v1(keys, idx) == [False, False]
    assert page_bytes(pool, idx) == before
    stats = backend.kvtier_stats()
    assert stats["calls_skipped_store_down"] == 2 and stats["breaker_trips"] == 1
    backend.close()


def test_a_read_given_up_on_stuck_writes_no_host_page_sglang_reuses(
    sg, tmp_path, monkeypatch
):
    """A hung mount (tests/hung.py). `batch_get_v1` gives up on the read and answers False;
    SGLang frees that page's host slots and puts other KV there. When the mount came back
    the abandoned thread went on reading, into SGLang's page (MLA `page_first` pages were
    read in place): that KV was overwritten. Reads land in kvtier's own buffers and are
    copied in only once they verified."""
    from tests.hung import HungMount

    path = write_yaml(
        tmp_path,
        {
            "backend": "file",
            "root": str(tmp_path / "l3"),
            "timeout_s": 0.3,
            "max_concurrency": 1,
        },
    )
    pool = make_pool(sg, "mla", "page_first")
    backend = attach(sg, pool, path, mla=True)
    key = page_keys(1)
    written = fill(pool, 1, seed=1)
    assert backend.batch_set_v1(key, written) == [True]
    mount = HungMount(monkeypatch)
    mount.hang(backend.store.path(backend._keys(key)[0]))
    target = pool.alloc(pool.page_size)
    try:
        assert backend.batch_get_v1(key, target) == [
            False
        ]  # given up on: the store is down
        pool.free(target)  # SGLang frees a False page's slots and hands them out again
        while int((again := pool.alloc(pool.page_size))[0]) != int(target[0]):
            pass
        page = pool.get_dummy_flat_data_page()
        page.view(torch.uint8).fill_(
            0x77
        )  # other KV, written there by a backup of another node
        pool.set_from_flat_data_page(int(again[0]), page)
        expected = page_bytes(pool, again)
        mount.come_back()  # the stuck read goes on, and its thread ends
        assert page_bytes(pool, again) == expected
    finally:
        mount.release()
        backend.close()


def test_prefetch_and_backup_threads_at_once(sg, tmp_path):
    """SGLang calls from its prefetch and backup threads concurrently."""
    path = write_yaml(tmp_path, {"backend": "file", "root": str(tmp_path / "l3")})
    pool = rt.make_mha_pool(sg, pages=64)
    backend = attach(sg, pool, path)
    batches = [(page_keys(4), fill(pool, 4, seed=10 + i)) for i in range(6)]
    errors: list[BaseException] = []

    def backup(items):
        try:
            for keys, idx in items:
                assert backend.batch_set_v1(keys, idx) == [True] * 4
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=backup, args=(batches[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for keys, idx in batches:
        dst = pool.alloc(4 * pool.page_size)
        assert backend.batch_get_v1(keys, dst) == [True] * 4
        assert page_bytes(pool, dst) == page_bytes(pool, idx)
    stats = backend.kvtier_stats()
    assert stats["set_pages"] == stats["set_ok"] == 24
    backend.close()


# -- bad input -------------------------------------------------------------------------------


def test_bad_extra_config_names_the_field(sg, tmp_path):
    pool = rt.make_mha_pool(sg)
    with pytest.raises(KvtierConfigError, match="extra_config.kvtier_config"):
        attach(sg, pool, None)
    none_path = write_yaml(tmp_path, {"backend": "none"})
    with pytest.raises(KvtierConfigError, match="store.backend='none'"):
        attach(sg, pool, none_path)
    paged = write_yaml(
        tmp_path, {"backend": "file", "root": str(tmp_path / "l3"), "page_tokens": 64}
    )
    with pytest.raises(
        KvtierConfigError,
        match="store.page_tokens=64: SGLang's storage backend stores one engine",
    ):
        attach(sg, pool, paged)
    path = write_yaml(tmp_path, {"backend": "file", "root": str(tmp_path / "l3")})
    with pytest.raises(KvtierConfigError, match="kv_cache_dtype"):
        attach(sg, pool, path, kv_cache_dtype=8)
    backend = attach(sg, pool, path)
    with pytest.raises(ValueError, match="host_indices has 3 slots for 1 keys"):
        backend.batch_set_v1(page_keys(1), torch.arange(3))
    with pytest.raises(ValueError, match="bytes; this pool's pages are"):
        backend.set(page_keys(1)[0], torch.zeros(3, dtype=torch.bfloat16))
    backend.close()


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
    reason="needs Linux and two CPUs this process may use (it keeps one for kvtier)",
)
def test_controller_cpus_keeps_the_store_threads_off_the_callers_cores(sg, tmp_path):
    mine = {max(os.sched_getaffinity(0))}
    before = os.sched_getaffinity(0)
    path = write_yaml(
        tmp_path,
        {"backend": "file", "root": str(tmp_path / "l3")},
        controller={"cpus": str(*mine)},
    )
    pool = rt.make_mha_pool(sg)
    backend = attach(sg, pool, path)
    keys, src = page_keys(2), fill(pool, 2, seed=5)
    assert backend.batch_set_v1(keys, src) == [
        True,
        True,
    ]  # the file store's I/O threads start now
    ours = [
        t
        for t in threading.enumerate()
        if t.name.startswith(("kvtier-sglang-store", "kvtier-file"))
    ]
    assert sorted({t.name.split("_")[0] for t in ours}) == [
        "kvtier-file",
        "kvtier-sglang-store",
    ]
    assert {t.name: os.sched_getaffinity(t.native_id) for t in ours} == {
        t.name: mine for t in ours
    }
    assert os.sched_getaffinity(0) == before  # SGLang's calling thread is not moved
    backend.close()
    with pytest.raises(KvtierConfigError, match="controller.cpus='4096'"):
        attach(
            sg,
            pool,
            write_yaml(
                tmp_path,
                {"backend": "file", "root": str(tmp_path / "l3")},
                controller={"cpus": "4096"},
            ),
        )


def test_the_store_is_built_once_by_the_pool_registration_and_never_after_close(
    sg, tmp_path
):
    """The backend builds its store (and its thread) when SGLang registers the host pool:
    a second registration is refused, and a backend closed before its pool registered
    starts no store thread that nothing would ever close."""

    def store_threads() -> int:
        return sum(t.name == "kvtier-sglang-store" for t in threading.enumerate())

    path = write_yaml(tmp_path, {"backend": "file", "root": str(tmp_path / "l3")})
    pool = rt.make_mha_pool(sg)
    before = store_threads()
    backend = attach(sg, pool, path)
    with pytest.raises(RuntimeError, match="called twice"):
        backend.register_mem_pool_host(pool)
    assert store_threads() == before + 1
    backend.close()
    assert store_threads() == before
    cfg = rt.storage_config(
        sg,
        extra={
            "backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang",
            "class_name": "KvtierStorage",
            "kvtier_config": path,
            "interface_v1": 1,
        },
    )
    early = sg.backend_factory.StorageBackendFactory.create_backend(
        "dynamic", cfg, pool
    )
    assert store_threads() == before  # nothing runs before the pool registers
    early.close()
    with pytest.raises(RuntimeError, match="closed"):
        early.register_mem_pool_host(pool)
    assert store_threads() == before


def test_hybrid_pools_attach_and_an_swa_pool_needs_its_window(sg, tmp_path):
    """Hybrid host pools are served through the v2 calls (tests/integrations/
    test_sglang_hybrid.py); an SWA pool needs the window, which SGLang does not hand a
    storage backend, and a hybrid model's KV namespace is not a plain model's."""
    names = sg.hicache_storage.PoolName
    path = write_yaml(tmp_path, {"backend": "file", "root": str(tmp_path / "l3")})
    pool = rt.make_mha_pool(sg)
    backend = attach(sg, pool, path)
    backend.register_mem_host_pool_v2(pool, names.KV)
    backend.on_host_pools_registered()  # plain KV: its namespace as before
    plain = backend.namespace.id
    backend.register_mem_host_pool_v2(rt.make_mha_pool(sg), names.SWA)
    with pytest.raises(
        KvtierConfigError, match=r"extra_config.sliding_window_size=None: .*'swa'"
    ):
        backend.on_host_pools_registered()
    backend.close()
    backend = attach(sg, pool, path, sliding_window_size=8)
    backend.register_mem_host_pool_v2(pool, names.KV)
    backend.register_mem_host_pool_v2(rt.make_mha_pool(sg), names.SWA)
    backend.on_host_pools_registered()
    assert backend.namespace.id != plain
    backend.close()


def test_a_hybrid_models_metrics_carry_its_kv_namespace(
    sg,
    multiproc,  # noqa: F811
    tmp_path,
):
    """A hybrid model's KV namespace is named once every host pool is registered (it
    names them all); SGLang's metrics are labelled with that namespace, where its pages
    are, not with the plain model's, which holds none of them."""
    names = sg.hicache_storage.PoolName
    path = write_yaml(tmp_path, {"backend": "file", "root": str(tmp_path / "l3")})
    pool = rt.make_mha_pool(sg)
    backend = attach(sg, pool, path, sliding_window_size=8)
    plain = backend.namespace.id
    backend.register_mem_host_pool_v2(pool, names.KV)
    backend.register_mem_host_pool_v2(rt.make_mha_pool(sg), names.SWA)
    backend.on_host_pools_registered()
    ns = backend.namespace.id
    assert ns != plain
    assert backend.batch_set_v1(page_keys(2), fill(pool, 2, seed=1)) == [True] * 2
    backend.close()  # its last numbers are exported as it closes
    got = scrape(multiproc)
    labels = (("dp_rank", "0"), ("namespace", ns), ("tp_rank", "0"))
    assert got[("kvtier_storage_set_ok_total", labels)] == 2
    assert not any(("namespace", plain) in lbl for _, lbl in got)


def test_module_imports_without_sglang():
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import kvtier.integrations.sglang.storage as m\n"
        "try:\n    m.KvtierStorage\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "ERR" in out and "pip install --no-deps sglang==0.5.23" in out


# -- kvtier inside a running SGLang: the start-up line and SGLang's own /metrics ----------


def test_the_storage_backend_logs_one_start_line_and_reaches_sglangs_metrics(
    sg,
    multiproc,  # noqa: F811
    tmp_path,
    caplog,
):
    """Its counters never reached SGLang's metrics endpoint and its start-up line named
    neither kvtier's version, the tenant key id nor the tiers."""
    caplog.set_level(logging.INFO, logger="kvtier.integrations.sglang")
    path = write_yaml(tmp_path, {"backend": "file", "root": str(tmp_path / "l3")})
    pool = make_pool(sg, "mha", "page_first")
    backend = attach(sg, pool, path, tp_rank=0)
    ns = backend.namespace.id
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("kvtier ")
    ]
    assert lines == [
        f"kvtier {kvtier.__version__} SGLang storage backend: store file (kvtier), "
        f"namespace {ns}, tenant key none, tiers SGLang device -> SGLang host "
        f"({backend.namespace.dtype}, {pool.page_size} tokens and {backend.page_bytes} "
        "B/page) -> kvtier store file"
    ]
    keys = page_keys(3)
    assert backend.batch_set_v1(keys, fill(pool, 3, seed=1)) == [True] * 3
    assert backend.batch_exists(keys + page_keys(1)) == 3
    backend.close()  # its last numbers are exported as it closes
    got = scrape(multiproc)
    labels = (("dp_rank", "0"), ("namespace", ns), ("tp_rank", "0"))
    assert got[("kvtier_storage_set_ok_total", labels)] == 3
    assert got[("kvtier_storage_set_pages_total", labels)] == 3
    assert got[("kvtier_storage_sets_total", labels)] == 3
    assert got[("kvtier_storage_store_down", labels)] == 0
    assert got[("kvtier_storage_breaker_trips_total", labels)] == 0


def test_data_parallel_ranks_sharing_an_mla_namespace_are_apart_in_sglangs_metrics(
    sg,
    multiproc,  # noqa: F811
    tmp_path,
):
    """With DP attention each DP rank's scheduler has the attention-group-local tp_rank 0,
    and MLA KV is one namespace for every rank: labelled only tp_rank and namespace, the
    ranks' numbers were one series (here 4, both ranks' pages in one sum; across processes
    each gauge showed whichever rank wrote last)."""
    backends = []
    for dp_rank, pages in ((0, 3), (1, 1)):
        path = write_yaml(
            tmp_path, {"backend": "file", "root": str(tmp_path / f"l3-{dp_rank}")}
        )
        pool = make_pool(sg, "mla", "page_first")
        backend = attach(sg, pool, path, mla=True, dp_rank=dp_rank)
        keys = page_keys(pages)
        assert (
            backend.batch_set_v1(keys, fill(pool, pages, seed=dp_rank))
            == [True] * pages
        )
        backends.append(backend)
    ns = {b.namespace.id for b in backends}
    assert len(ns) == 1  # the same namespace: only the rank labels set them apart
    for backend in backends:
        backend.close()
    got = scrape(multiproc)
    sets = {
        labels: value
        for (name, labels), value in got.items()
        if name == "kvtier_storage_set_ok_total"
    }
    (namespace,) = ns
    assert sets == {
        (("dp_rank", "0"), ("namespace", namespace), ("tp_rank", "0")): 3,
        (("dp_rank", "1"), ("namespace", namespace), ("tp_rank", "0")): 1,
    }


def test_every_override_of_sglangs_storage_says_so(sg):
    """Each method the backend defines over SGLang's HiCacheStorage is marked @override,
    so a rename on SGLang's side is caught by a type checker rather than leaving a method
    HiCache never calls."""
    from kvtier.integrations.sglang.storage import KvtierStorageBase

    base = sg.hicache_storage.HiCacheStorage
    unmarked = [
        name
        for cls in KvtierStorageBase.__mro__[:-1]  # its v2 calls are a mixin's
        for name, fn in vars(cls).items()
        if callable(fn)
        and not name.startswith("__")
        and hasattr(base, name)
        and not getattr(fn, "__override__", False)
    ]
    assert unmarked == []
