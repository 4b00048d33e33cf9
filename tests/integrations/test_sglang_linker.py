"""kvtier as SGLang 0.5.23's unified-cache external linker, on SGLang's own classes.

A real `UnifiedRadixCache` over real CPU pools (`MHATokenToKVPool`, `MLATokenToKVPool`,
`TokenToKVPoolAllocator`) built by SGLang's test kit, kvtier's `KvtierLinker` created by
SGLang's `create_unified_cache_linker` (the `dynamic` backend) and attached with
`init_cache_linker`, then driven the way SGLang's scheduler drives it: insert (which
offloads), `check_hicache_events`, evict, `match_prefix` (lookup), `init_load_back`
(load), `ready_to_load_host_cache` (start), the forward's per-layer waits,
`finish_external_linker_loads`. Stores are real: files, redis-server, an S3 endpoint (moto).
SGLang is loaded by kvtier.testing.sglang_loader.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import pytest
import torch

from kvtier.bench.servers import BlackHole
from kvtier.errors import KvtierConfigError
from kvtier.hashing import make_key
from kvtier.integrations.sglang.keys import page_hash_of
from kvtier.testing import sglang_loader
from tests.integrations.sglang_linker_server import (
    TOKENS,
    Server,
    assert_same,
    engine_keys,
    page_files,
    write_yaml,
)
from tests.integrations.tenant_store import (
    KEY_A,
    KEY_A_ID,
    KEY_B,
    leaks_key,
    list_store,
    reframe_plain,
)
from tests.servers import IN_CI

STORES = ["file", "redis", "s3"]


@pytest.fixture(scope="module")
def sg():
    try:
        return sglang_loader.load()
    except sglang_loader.Unavailable as exc:
        if IN_CI:
            pytest.fail(f"{exc}; .ci/run must install it")
        pytest.skip(str(exc))


def store_section(kind: str, request, tmp_path) -> dict:
    if kind == "none":
        return {"backend": "none"}
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


def scraped(linker) -> dict[str, float]:
    """What Prometheus scrapes from the linker's collector."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.integrations.sglang.linker import LinkerCollector

    registry = CollectorRegistry()
    registry.register(LinkerCollector(linker))
    text = generate_latest(registry).decode()
    return {
        s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def round_trip(server: Server, tokens: list[int], want: list[torch.Tensor]):
    req = server.request(tokens + [7, 8, 9])
    result = server.match(req, tokens + [7, 8, 9])
    assert result.device_prefix_len == 0
    assert result.host_hit_length == len(tokens)
    n, slots, failed = server.load(req, result)
    assert n == len(tokens) and failed == []
    assert_same(server.read(slots), want)
    server.allocator.free(slots)
    return req


# -- byte equality through the host tier and every store ----------------------------------


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_host_round_trip(sg, tmp_path, request, page_size, mla):
    server = Server(
        sg, write_yaml(tmp_path, {"backend": "none"}), page_size=page_size, mla=mla
    )
    tokens = list(range(100, 100 + 4 * max(page_size, 4)))
    want = server.compute(tokens, seed=1)
    server.evict_all()
    round_trip(server, tokens, want)
    stats = server.linker.stats()["counters"]
    assert (
        stats["host_hit_pages"] == len(tokens) // page_size
        and stats["load_failures"] == 0
    )
    assert (
        scraped(server.linker)["kvtier_linker_host_hit_pages_total"]
        == len(tokens) // page_size
    )
    server.check()
    server.close()


@pytest.mark.parametrize("kind", STORES)
def test_store_round_trip(sg, tmp_path, request, kind):
    """Offloaded pages reach the store; a fresh worker (empty host tier) loads them back."""
    path = write_yaml(tmp_path, store_section(kind, request, tmp_path))
    first = Server(sg, path)
    want = first.compute(TOKENS, seed=2)
    first.evict_all()
    round_trip(first, TOKENS, want)  # from host
    first.check()
    first.close()  # drains the store writes
    assert first.linker.stats()["counters"]["l3_write_pages"] == len(TOKENS) // 4
    second = Server(sg, path)
    round_trip(second, TOKENS, want)  # host tier empty: from the store
    c = second.linker.stats()["counters"]
    assert (
        c["store_hit_pages"] == len(TOKENS) // 4
        and c["l3_read_pages"] == len(TOKENS) // 4
    )
    # the pages read are host pages now: a second load needs no store
    second.evict_all()
    round_trip(second, TOKENS, want)
    assert second.linker.stats()["counters"]["l3_read_pages"] == len(TOKENS) // 4
    second.check()
    second.close()


# -- a store page that does not verify, a dead store --------------------------------------


def loads_prefix(
    server: Server, tokens: list[int], pages: int, want: list[torch.Tensor]
) -> None:
    """A request on `tokens`: lookup finds `pages` pages, and they load byte for byte."""
    req = server.request(tokens + [7])
    result = server.match(req, tokens + [7])
    n = pages * server.page_size
    assert result.host_hit_length == n
    got, slots, failed = server.load(req, result)
    assert failed == [] and got == n
    assert_same(server.read(slots), [w[:n] for w in want])
    server.allocator.free(slots)
    server.check()


@pytest.mark.parametrize("damage", ["flip", "swap"])
def test_bad_store_page_fails_the_load_closed(sg, tmp_path, request, damage):
    """Page 5 of 8 is damaged in the store (a flipped payload byte, or page 2's frame in its
    place): the load fails before any byte reaches the device pool, SGLang aborts the
    request (its output discarded, its KV never inserted); the next lookup stops before
    that page, and a load of that prefix gives exactly the offloaded bytes."""
    path = write_yaml(tmp_path, store_section("file", request, tmp_path))
    first = Server(sg, path)
    want = first.compute(TOKENS, seed=3)
    first.close()
    second = Server(sg, path)
    files = page_files(sg, second, tmp_path / "l3", TOKENS)
    if damage == "flip":
        blob = bytearray(files[5].read_bytes())
        blob[-3] ^= 0x40
        files[5].write_bytes(bytes(blob))
    else:
        files[5].write_bytes(files[2].read_bytes())
    before = [b.clone() for b in second.buffers()]
    req = second.request(TOKENS + [7])
    result = second.match(req, TOKENS + [7])
    assert result.host_hit_length == len(
        TOKENS
    )  # the store holds all 8 pages by their keys
    n, slots, failed = second.load(req, result)
    assert (
        failed == [req]
        and req.skip_radix_cache_insert
        and req.discard_output_reason is not None
    )
    for b, was in zip(second.buffers(), before):
        assert torch.equal(
            b.view(torch.uint8), was.view(torch.uint8)
        )  # not one byte written
    second.allocator.free(slots)
    assert second.linker.stats()["counters"]["l3_read_failures"] == 1
    second.check()
    loads_prefix(
        second, TOKENS, 5, want
    )  # the next request on it: a shorter lookup, right bytes
    second.close()


def test_missing_store_page_gives_a_shorter_lookup(sg, tmp_path, request):
    path = write_yaml(tmp_path, store_section("file", request, tmp_path))
    first = Server(sg, path)
    want = first.compute(TOKENS, seed=4)
    first.close()
    page_files(sg, first, tmp_path / "l3", TOKENS)[
        3
    ].unlink()  # before the store indexes its files
    second = Server(sg, path)
    loads_prefix(second, TOKENS, 3, want)
    second.close()


# -- what a lookup promises, a load lands ------------------------------------------------


def test_a_store_hit_longer_than_the_host_tier_restores_what_fits(
    sg, tmp_path, request
):
    """A 32-page prompt in the store, a worker whose host tier has 16 pages (mirror.ratio
    0.25 of 64 device pages): the lookup promises the 16 pages a load can land, and they
    load byte for byte. It promised all 32, and the load failed ("no host room to read 32
    pages from the store"): SGLang aborted the request, and every retry the same way."""
    section = store_section("file", request, tmp_path)
    first = Server(sg, write_yaml(tmp_path, section))
    tokens = list(range(1000, 1128))  # 32 pages of 4
    want = first.compute(tokens, seed=21)
    first.close()  # drains the store writes
    small = Server(sg, write_yaml(tmp_path, section, mirror={"ratio": 0.25}))
    assert small.linker.stats()["host"]["pages_total"] == 16
    loads_prefix(small, tokens, 16, want)
    loads_prefix(small, tokens, 16, want)  # again: from host now, the same bytes
    small.close()


def test_aborted_matches_do_not_starve_a_store_hit_of_host_room(sg, tmp_path, request):
    """Four prompts fill the 64-page host tier; each is matched (a lookup finding all 16
    of its pages on host) and then aborted before its load, which SGLang tells the linker
    nothing about. A prompt whose 8 pages are in the store only is then matched: its
    lookup promises the 8 pages, and its load lands them, evicting the aborted prompts'
    coldest pages. The aborted lookups pinned all 64 pages (until 64 newer lookups), the
    8-page store hit was promised anyway, and its load failed for want of host room."""
    section = store_section("file", request, tmp_path)
    first = Server(sg, write_yaml(tmp_path, section))
    stored = list(range(2000, 2032))  # 8 pages of 4
    want = first.compute(stored, seed=22)
    first.close()
    server = Server(sg, write_yaml(tmp_path, section, mirror={"ratio": 1.0}))
    prompts = [list(range(3000 + 100 * i, 3064 + 100 * i)) for i in range(4)]
    for i, tokens in enumerate(prompts):
        server.compute(tokens, seed=30 + i)
        server.evict_all()
    server.settle_offloads()
    server.linker.core.l3.drain()
    host = server.linker.stats()["host"]
    assert host["pages_total"] == host["pages_published"] == 64
    for tokens in prompts:
        req = server.request(tokens + [7])
        assert server.match(req, tokens + [7]).host_hit_length == len(tokens)
        server.cache.linker.release_request(req.rid)  # what SGLang's abort does
    loads_prefix(server, stored, 8, want)
    assert server.linker.stats()["host"]["pages_evicted"] == 8
    server.close()


def test_dead_store_gives_host_only_lookups(sg, tmp_path):
    """A store that never answers: each lookup makes at most one store call, which ends by
    its timeout; after `store_down_after_failures` of them the breaker skips the store and
    lookups answer from the host tier alone, without a store call."""
    hole = BlackHole()  # accepts connections, never answers
    try:
        path = write_yaml(
            tmp_path,
            {
                "backend": "redis",
                "url": f"redis://127.0.0.1:{hole.port}/0",
                "timeout_s": 0.3,
                "connect_timeout_s": 5.0,
                "socket_timeout_s": 5.0,
            },
            controller={"store_down_after_failures": 2, "store_probe_backoff_s": 3600},
        )
        server = Server(sg, path)
        on_host = list(range(500, 516))
        want = server.compute(
            on_host, seed=5
        )  # offloaded to host; its store write times out
        server.evict_all()
        store = server.linker.core.store
        for i in range(4):
            tokens = on_host + list(
                range(600 + 16 * i, 616 + 16 * i)
            )  # 4 host pages, 4 nowhere
            req = server.request(tokens)
            result = server.match(req, tokens)
            assert result.host_hit_length == len(on_host)
        stats = server.linker.stats()
        assert stats["store"]["store_down"] is True
        assert (
            stats["counters"]["lookup_store_skipped"] >= 2
        )  # the last lookups did not call it
        assert store.stats()["exists_calls"] <= 2 and store.stats()["timeouts"] >= 1
        n, slots, failed = server.load(req, result)
        assert failed == [] and n == len(on_host)
        assert_same(server.read(slots), want)
        server.allocator.free(slots)
        server.check()
        server.close()
    finally:
        hole.stop()


def test_bad_extra_config_is_refused_naming_it(sg, tmp_path):
    from kvtier.integrations.sglang.linker import shell

    with pytest.raises(KvtierConfigError, match="unknown keys \\['kvtier_conifg'\\]"):
        shell.parse_extra({"kvtier_conifg": "x.yaml"})
    with pytest.raises(KvtierConfigError, match="kvtier_config=None"):
        shell.parse_extra({})


# -- tensor parallelism: two gloo ranks ---------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_ranks(tmp_path, scenario: str, timeout: float = 300) -> list[dict]:
    from tests.servers import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integrations.sglang_linker_tp_worker",
                str(rank),
                "2",
                str(port),
                str(tmp_path),
                scenario,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(
                p.communicate(timeout=timeout)[0].decode(errors="replace")[-3000:]
            )
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a TP rank hung") from None
    assert [p.returncode for p in procs] == [0, 0], logs
    return [json.loads((tmp_path / f"out{rank}.json").read_text()) for rank in range(2)]


def test_two_ranks_whose_stores_differ_restore_the_same_length(sg, tmp_path):
    """Rank 0's store holds 8 pages of the prompt, rank 1's 5: each linker answers for its
    own store, SGLang intersects over the gloo group, and both ranks load 5 pages, each
    byte-equal to what that rank offloaded."""
    r0, r1 = run_ranks(tmp_path, "short")
    assert (r0["local_lookup_pages"], r1["local_lookup_pages"]) == (8, 5)
    assert r0["host_hit_length"] == r1["host_hit_length"] == 20
    assert (
        r0["loaded"] == r1["loaded"] == 20 and r0["bytes_equal"] and r1["bytes_equal"]
    )


def test_a_load_failing_on_one_rank_fails_on_both(sg, tmp_path):
    """Rank 1's page 2 does not verify when read: its load fails, rank 0's lands, and both
    ranks abort the request (SGLang agrees the verdict), so their trees stay the same."""
    r0, r1 = run_ranks(tmp_path, "bad")
    assert r0["host_hit_length"] == r1["host_hit_length"] == 32
    assert (r0["load_failures"], r1["load_failures"]) == (0, 1)
    assert r0["failed"] == r1["failed"] == ["r1"]


def test_the_module_imports_without_sglang():
    """`import kvtier.integrations.sglang.linker` needs no SGLang; `KvtierLinker` then
    fails naming the install."""
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import kvtier.integrations.sglang.linker as m\n"
        "try:\n    m.KvtierLinker\nexcept ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "pip install --no-deps sglang==0.5.23" in out.stdout


def test_cancel_and_reset_free_what_they_hold(sg, tmp_path, request):
    """A request aborted while its load is queued (SGLang's release_request ->
    cancel_queued_load) gives back its pins and its store read's host pages; SGLang's
    reset (cache.reset) quiesces the linker and empties its host tier; the store keeps
    the pages, so the next request still restores the prefix."""
    path = write_yaml(tmp_path, store_section("file", request, tmp_path))
    first = Server(sg, path)
    want = first.compute(TOKENS, seed=8)
    first.close()
    server = Server(sg, path)
    server.compute(list(range(300, 316)), seed=9)  # 4 pages on host
    server.evict_all()
    req = server.request(TOKENS + [7])
    result = server.match(req, TOKENS + [7])
    server.r2t.alloc([req])
    n, _ = server.cache.init_load_back(
        sg.bpc.InitLoadBackParams(
            best_match_node=result.best_match_node,
            host_hit_length=result.host_hit_length,
            req=req,
        )
    )
    assert n == len(TOKENS) and server.linker.stats()["queues"]["loads_queued"] == 1
    slots = server.cache.linker.private_load_indices[req.rid]
    server.cache.linker.release_request(req.rid)  # what SGLang's abort does
    server.allocator.free(slots)
    stats = server.linker.stats()
    assert (
        stats["queues"]["loads_queued"] == 0
        and stats["counters"]["loads_cancelled"] == 1
    )
    server.linker.core.quiesce()  # the cancelled read settles; its pages go back
    host = server.linker.stats()["host"]
    assert (
        host["pages_pinned"] == 0
        and host["pages_free"] + host["pages_published"] == host["pages_total"]
    )
    server.check()
    server.cache.reset()
    host = server.linker.stats()["host"]
    assert host["pages_free"] == host["pages_total"]
    loads_prefix(server, TOKENS, 8, want)
    server.close()


# -- a tenant key (docs/security.md) --------------------------------------------------------


@pytest.mark.parametrize(
    "kind,encrypt", [("file", False), ("redis", True), ("s3", False)]
)
def test_tenant_key_round_trips_and_its_store_keys_tell_nothing(
    sg, tmp_path, request, caplog, kind, encrypt
):
    """With a tenant key the namespace carries its id, pages come back from the sealed
    store byte for byte, the store's keys are keyed hashes (none holds SGLang's page hash,
    which anyone can compute from the tokens), another key or none finds nothing, and no
    repr, stat or log line shows the key."""
    caplog.set_level(logging.DEBUG)
    section = store_section(kind, request, tmp_path)
    salt = uuid.uuid4().hex  # this test's pages only, whatever a shared store holds
    path = write_yaml(
        tmp_path,
        section,
        namespace={"tenant_salt": salt, "tenant_key": KEY_A, "encrypt": encrypt},
    )
    first = Server(sg, path)
    ns = first.linker.core.settings.namespace
    assert ns.tenant_key_id == KEY_A_ID
    want = first.compute(TOKENS, seed=11)
    first.close()
    second = Server(sg, path)
    round_trip(
        second, TOKENS, want
    )  # host tier empty: every page from the store, authenticated
    assert second.linker.stats()["counters"]["store_hit_pages"] == len(TOKENS) // 4
    engine = engine_keys(sg, second, TOKENS)
    seen = list_store(section, ns.id)
    unkeyed = {make_key("kvtier", ns.id, page_hash_of(k)) for k in engine}
    assert len(seen.keys) == len(engine) and not unkeyed & set(seen.keys)
    assert not any(k in key for k in engine for key in seen.keys)
    assert (
        seen.plain == 0 and seen.manifest["tenant_key_id"] == KEY_A_ID
    )  # every frame sealed
    for other in ({"tenant_salt": salt, "tenant_key": KEY_B}, {"tenant_salt": salt}):
        stranger = Server(sg, write_yaml(tmp_path, section, namespace=other))
        assert (
            stranger.match(stranger.request(TOKENS + [7]), TOKENS + [7]).host_hit_length
            == 0
        )
        stranger.close()
    shown = " ".join(
        [
            repr(second.linker.core.settings),
            repr(second.linker.core.store.codec),
            str(second.linker.stats()),
            caplog.text,
        ]
    )
    assert KEY_A_ID in repr(second.linker.core.settings) and not leaks_key(shown)
    second.check()
    second.close()


@pytest.mark.parametrize("encrypt", [False, True])
def test_tenant_key_a_reframed_store_page_fails_the_load_closed(
    sg, tmp_path, request, encrypt
):
    """Who can write the store re-frames page 5 of 8 with page 2's payload under a fresh
    plain xxh3 checksum (which a store without a key serves): with a key the load fails
    before any byte reaches the device pool, and the next request loads the 5 pages before
    it byte for byte."""
    path = write_yaml(
        tmp_path,
        store_section("file", request, tmp_path),
        namespace={"tenant_key": KEY_A, "encrypt": encrypt},
    )
    first = Server(sg, path)
    want = first.compute(TOKENS, seed=12)
    first.close()
    second = Server(sg, path)
    files = page_files(sg, second, tmp_path / "l3", TOKENS)
    reframe_plain(files[5], files[2])
    before = [b.clone() for b in second.buffers()]
    req = second.request(TOKENS + [7])
    result = second.match(req, TOKENS + [7])
    assert result.host_hit_length == len(TOKENS)
    n, slots, failed = second.load(req, result)
    assert failed == [req] and req.skip_radix_cache_insert
    for b, was in zip(second.buffers(), before):
        assert torch.equal(b.view(torch.uint8), was.view(torch.uint8))
    second.allocator.free(slots)
    assert second.linker.stats()["counters"]["l3_read_failures"] == 1
    assert second.linker.stats()["store"]["frame_failures"] == 1
    second.check()
    loads_prefix(second, TOKENS, 5, want)
    second.close()


def test_a_lookup_names_few_lengths_and_ranks_still_agree_close_to_the_shorter(sg):
    """A lookup at page 1 asks about hundreds of pages; SGLang writes one mask element per
    length it names. It names its longest and the multiples of a stride set by the pages
    asked about: at most 17, and two ranks that found 500 and 800 of 800 pages still share
    a length within one stride of 500 (SGLang restores the longest common one)."""
    from kvtier.integrations.sglang.linker.shell import restorable

    assert restorable(0, 8) == [] and restorable(5, 8) == [1, 2, 3, 4, 5]
    long, short = restorable(800, 800), restorable(500, 800)
    assert len(long) <= 17 and long[-1] == 800 and short[-1] == 500
    assert 500 - 50 <= max(set(long) & set(short)) <= 500


def test_every_override_of_sglangs_linker_says_so(sg):
    """Each method KvtierLinker defines over SGLang's UnifiedCacheLinker is marked
    @override, so a rename on SGLang's side is caught by a type checker."""
    from kvtier.integrations.sglang.linker.shell import KvtierLinker

    base = sg.ucl.UnifiedCacheLinker
    unmarked = [
        name
        for name, fn in vars(KvtierLinker).items()
        if callable(fn)
        and not name.startswith("__")
        and hasattr(base, name)
        and not getattr(fn, "__override__", False)
    ]
    assert unmarked == []
