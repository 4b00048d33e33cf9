"""kvtier as SGLang 0.5.23's HiCache L3 backend for hybrid models (SWA, Mamba): the v2 calls
(`batch_exists_v2 / batch_get_v2 / batch_set_v2`), driven by SGLang's own HiCache.

A real `UnifiedRadixCache` with (FULL, SWA) or (FULL, MAMBA) components, built by SGLang's
test kit on CPU, gets HiCache (`init_hicache`: host pools per component, SGLang's hybrid
cache controller, write-through to L3) with `KvtierStorage` as its `dynamic` backend. A
producer computes P+X and P+Y and backs them up (host, then L3 through the controller's
own `batch_set_v1` / `batch_set_v2` calls); a second cache (an empty host tier) prefetches
P+X+Z and P+Z from the same store (`batch_exists_v2`, `batch_get_v1`, `batch_get_v2`).

HiCache's device <-> host kernels have no CPU build: they are no-ops here
(kvtier/bench/hicache_cpu.py), so the bytes that travel are the host pools' own, which
each test fills with random bytes first. The oracle is the producer's host page of each
(pool, key) when it was written; every page the consumer's backend answers True for must
be byte-equal to it in the consumer's host pool, and every page it answers False for
must have left the consumer's host slots as they were. SGLang is loaded by
kvtier.testing.sglang_loader.
"""

from __future__ import annotations

import atexit
import importlib
import json
import time
import types
import uuid
from array import array

import pytest
import torch
import yaml

from kvtier.bench.hicache_cpu import Shims
from kvtier.integrations.sglang.storage import page_hash_of
from kvtier.testing import sglang_loader
from tests.integrations.tenant_store import KEY_A, KEY_B, list_store
from tests.servers import IN_CI, free_port

PS = 4  # tokens per page; the window is 8 tokens = 2 pages
P = list(range(100, 100 + 3 * PS))
X = list(range(200, 200 + 2 * PS))
Y = list(range(300, 300 + 2 * PS))
Z = list(range(400, 400 + PS))


@pytest.fixture(scope="module")
def sg():
    try:
        mods = sglang_loader.load()
    except sglang_loader.Unavailable as exc:
        if IN_CI:
            pytest.fail(f"{exc}; .ci/run must install it")
        pytest.skip(str(exc))
    shims = Shims()
    shims.install()
    mamba_host = importlib.import_module("sglang.srt.mem_cache.pool_host.mamba")
    for name in ("transfer_kv_mamba_lf_pf", "transfer_kv_mamba_pf_lf"):
        if getattr(mamba_host, name, None) is None:  # CUDA/ROCm-only imports
            setattr(mamba_host, name, shims._noop(name))
    # CPU torch has no pinned allocator, and host pools allocate with their pin_memory
    # flag from the moment they exist (the backend is registered inside init_hicache):
    # every host pool of this SGLang load is unpinned (kvtier/bench/hicache_cpu.py, 4)
    base = importlib.import_module("sglang.srt.mem_cache.pool_host.base")
    base.HostKVCache.pin_memory = property(lambda self: False, lambda self, v: None)
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    yield mods


def ct():
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType


def swa_cfg(sg, window=8):
    return sg.cfg.CacheConfig(
        page_size=PS,
        components=(ct().FULL, ct().SWA),
        sliding_window_size=window,
        num_layers=4,
        full_attention_layer_ids=(1, 3),
        head_num=2,
        head_dim=8,
    )


def mamba_cfg(sg, state_size=16):
    return sg.cfg.CacheConfig(
        page_size=PS,
        components=(ct().FULL, ct().MAMBA),
        enable_mamba_extra_buffer=True,  # page_size > 1 needs it
        mamba_cache_size=60,
        mamba_state_size=state_size,
        num_layers=4,
        full_attention_layer_ids=(1, 3),
        head_num=2,
        head_dim=8,
    )


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


def write_yaml(tmp_path, store: dict, **namespace) -> str:
    path = tmp_path / f"kvtier-{uuid.uuid4().hex[:6]}.yaml"
    doc = {"store": {"timeout_s": 5.0, **store}}
    if namespace:
        doc["namespace"] = namespace
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def host_tensors(pool) -> list[torch.Tensor]:
    """Every buffer of a host pool (MHA: kv_buffer; Mamba: a list of them)."""
    bufs = pool.kv_buffer
    return [t for t in (bufs if isinstance(bufs, list) else [bufs]) if t.numel()]


def fill_random(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in host_tensors(pool):
        assert t.is_contiguous()
        raw = t.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page_at(pool, start: int) -> bytes:
    page = pool.get_data_page(start, flat=True).contiguous()
    return bytes(page.view(-1).view(torch.uint8).numpy())


class HiCache:
    """One SGLang worker: the kit's cache, HiCache with host pools and KvtierStorage."""

    def __init__(self, sg, cfg, yaml_path: str, seed: int, **extra) -> None:
        from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE

        self.sg, self.cfg = sg, cfg
        self.cache, self.alloc, self.r2t = sg.fx.build_fixture(cfg)
        sa = sg.server_args.ServerArgs(
            model_path="dummy",
            page_size=PS,
            hicache_io_backend="kernel",
            hicache_write_policy="write_through",
            # SGLang's default ("timeout") cuts a prefetch by wall clock: on a slow
            # machine a hit would come back short; this waits for every read
            hicache_storage_prefetch_policy="wait_complete",
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(
                {
                    "backend_name": "kvtier",
                    "module_path": "kvtier.integrations.sglang",
                    "class_name": "KvtierStorage",
                    "kvtier_config": yaml_path,
                    "interface_v1": 1,
                    "prefetch_threshold": 1,
                    **extra,
                }
            ),
        )
        sa._mamba_cache_chunk_size = max(CHUNK_SIZE, PS)
        sg.server_args.set_global_server_args_for_scheduler(sa)
        self.cache.init_hicache(sa, self.cache.cache_init_params)
        atexit.unregister(self.cache.shutdown)
        cc = self.cc = self.cache.cache_controller
        # backups driven below, as SGLang's kit does
        self.cache.write_through_threshold, self.cache.load_back_threshold = 1 << 30, 0
        cc.prefetch_capacity_limit = max(
            cc.prefetch_capacity_limit, cc.mem_pool_host.size
        )
        self.backend = cc.storage_backend
        self.pools = {str(e.name): e.host_pool for e in cc.mem_pool_host.entries}
        for i, name in enumerate(sorted(self.pools)):
            fill_random(self.pools[name], seed * 100 + i)
        self.calls: list[tuple] = []
        self.wrong: list[str] = []

    def pool(self, name) -> object:
        return self.pools[str(name)]

    def written(self) -> dict[tuple[str, str], bytes]:
        """Spy on the backend's writes: the host page of every (pool, key) it was given."""
        pages: dict[tuple[str, str], bytes] = {}
        b = self.backend
        set_v1, set_v2 = b.batch_set_v1, b.batch_set_v2

        def batch_set_v1(keys, host_indices, extra_info=None):
            for k, s in zip(keys, host_indices[::PS].tolist()):
                pages.setdefault(("kv", k), page_at(self.pool("kv"), s))
            ok = set_v1(keys, host_indices, extra_info)
            self.calls.append(("set_v1", len(keys), ok))
            return ok

        def batch_set_v2(transfers, extra_info=None):
            for t in transfers:
                pool = self.pool(t.name)
                for k, s in zip(t.keys, t.host_indices[:: pool.page_size].tolist()):
                    pages.setdefault((str(t.name), k), page_at(pool, s))
            ok = set_v2(transfers, extra_info)
            self.calls.append(("set_v2", {str(n): v for n, v in ok.items()}))
            return ok

        b.batch_set_v1, b.batch_set_v2 = batch_set_v1, batch_set_v2
        return pages

    def check_reads(self, oracle: dict[tuple[str, str], bytes]) -> dict[str, list]:
        """Spy on the backend's reads: per pool, (key, answer) of every page; a True page
        must now be the oracle's bytes in this host pool, a False one left as it was
        (`wrong` lists each page that is not: SGLang's threads swallow an assertion)."""
        seen: dict[str, list] = {}
        b = self.backend
        get_v1, get_v2, exists_v2 = b.batch_get_v1, b.batch_get_v2, b.batch_exists_v2

        def checked(name, pool, keys, starts, before, ok):
            assert len(ok) == len(keys)
            for k, s, old, good in zip(keys, starts, before, ok):
                now = page_at(pool, s)
                if good and now != oracle[(name, k)]:
                    self.wrong.append(f"{name} page {k[:6]}: wrong bytes")
                if not good and now != old:
                    self.wrong.append(f"{name} page {k[:6]}: a miss wrote the host")
                seen.setdefault(name, []).append((k, bool(good)))

        def batch_get_v1(keys, host_indices, extra_info=None):
            pool, starts = self.pool("kv"), host_indices[::PS].tolist()
            before = [page_at(pool, s) for s in starts]
            ok = get_v1(keys, host_indices, extra_info)
            checked("kv", pool, keys, starts, before, ok)
            return ok

        def batch_get_v2(transfers, extra_info=None):
            plans = []
            for t in transfers:
                pool = self.pool(t.name)
                starts = t.host_indices[:: pool.page_size].tolist()
                plans.append((t, pool, starts, [page_at(pool, s) for s in starts]))
            ok = get_v2(transfers, extra_info)
            for t, pool, starts, before in plans:
                checked(str(t.name), pool, t.keys, starts, before, ok[t.name])
            return ok

        def batch_exists_v2(keys, pool_transfers=None, extra_info=None):
            r = exists_v2(keys, pool_transfers, extra_info)
            self.calls.append(("exists_v2", r.kv_hit_pages, r.restorable_prefix_pages))
            return r

        b.batch_get_v1, b.batch_get_v2 = batch_get_v1, batch_get_v2
        b.batch_exists_v2 = batch_exists_v2
        return seen

    def compute_and_back_up(self, *seqs) -> None:
        """Each sequence inserted (a finished prefill), backed up to host; the host
        backup's ack queues the L3 write (write_through); waits for the writes."""
        from sglang.test.kits.unified_radix_cache import fixtures as F
        from sglang.test.kits.unified_radix_cache.mixins import (
            UnifiedRadixCacheFixtures,
        )

        kit = type(
            "Kit",
            (UnifiedRadixCacheFixtures,),
            {
                "cfg": self.cfg,
                "assertGreater": lambda s, a, b: None,
                "assertTrue": lambda s, a: None,
            },
        )()
        for seq in seqs:
            kit._insert(self.cache, self.alloc, self.r2t, seq)
            leaf = F.match_prefix(self.cache, seq).last_device_node
            kit._backup_node(self.cache, leaf)
            deadline = time.monotonic() + 60  # a bound on a hang, not a timing check
            while self.cache.ongoing_backup:
                assert time.monotonic() < deadline, "the L3 backup never finished"
                self.cache.drain_storage_control_queues()
                time.sleep(0.01)
            self.cache.drain_storage_control_queues()

    def prefetch(self, *seqs) -> list[tuple[int, int, int]]:
        """SGLang's L3 prefetch of each sequence, then its match: (host hit tokens, SWA
        host hit, Mamba host hit) per sequence."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.test.kits.unified_radix_cache import fixtures as F

        out = []
        for i, seq in enumerate(seqs):
            handle = CacheRequestHandle(f"q{i}-{uuid.uuid4().hex[:6]}", 0)
            self.cache.prefetch_from_storage(
                handle, self.cache.root_node_handle(), array("q", seq), None, None
            )
            deadline = time.monotonic() + 60
            while True:
                self.cache.check_hicache_events()
                if self.cache.check_prefetch_progress(handle):
                    break
                assert time.monotonic() < deadline, "the prefetch never finished"
                time.sleep(0.01)
            m = F.match_prefix(self.cache, seq)
            out.append(
                (m.host_hit_length, m.swa_host_hit_length, m.mamba_host_hit_length)
            )
        return out

    def close(self) -> None:
        self.cc._stop_storage_threads()
        self.backend.close()


def keys_of(tokens: list[int]) -> list[str]:
    """SGLang's page keys of `tokens` (its sha256 chain)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(array("q", tokens), None, page_size=PS)


def by_pool(seen: dict[str, list]) -> dict[str, list[tuple[str, bool]]]:
    return {n: [(k[:6], ok) for k, ok in v] for n, v in seen.items()}


# -- a round trip per pool, through each store ---------------------------------------------


@pytest.mark.parametrize("store", ["file", "redis", "s3"])
def test_swa_pools_round_trip_byte_equal_through_the_store(
    sg, store, request, tmp_path
):
    """P+X and P+Y written by one HiCache, read by another (empty host tier): every KV page
    and every SWA page of the windows ending at P+X (5 pages) and P (3 pages) lands
    byte-equal in the consumer's host pools. Before, the backend refused SWA host pools
    (NotImplementedError at attach)."""
    path = write_yaml(tmp_path, store_section(store, request, tmp_path))
    prod = HiCache(sg, swa_cfg(sg), path, seed=1, sliding_window_size=8)
    oracle = prod.written()
    prod.compute_and_back_up(P + X, P + Y)
    assert ("swa", keys_of(P + X)[-1]) in oracle and ("kv", keys_of(P)[0]) in oracle
    cons = HiCache(sg, swa_cfg(sg), path, seed=2, sliding_window_size=8)
    seen = cons.check_reads(oracle)
    hits = cons.prefetch(P + X + Z, P + Z)
    pxz, pz = keys_of(P + X + Z), keys_of(P + Z)
    assert [h for h, _, _ in hits] == [20, 12]
    assert [c[1:] for c in cons.calls if c[0] == "exists_v2"] == [
        (5, [1, 2, 3, 4, 5]),
        (3, [1, 2, 3]),
    ]
    assert by_pool(seen) == {
        "kv": [(k[:6], True) for k in pxz[:5] + pz[:3]],
        "swa": [(k[:6], True) for k in pxz[3:5] + pz[1:3]],
    }
    assert cons.wrong == []
    for c in (prod, cons):
        c.close()


@pytest.mark.parametrize("store", ["file", "redis", "s3"])
def test_mamba_pools_round_trip_byte_equal_through_the_store(
    sg, store, request, tmp_path
):
    """The Mamba state of P+X (stored at its node's end, page 5) comes back byte-equal in
    the consumer's MambaPoolHost with the 5 KV pages; P+Z restores nothing: no state was
    ever stored at page 3, so no length is restorable (restorable_prefix_pages [])."""
    path = write_yaml(tmp_path, store_section(store, request, tmp_path))
    prod = HiCache(sg, mamba_cfg(sg), path, seed=3)
    oracle = prod.written()
    prod.compute_and_back_up(P + X, P + Y)
    cons = HiCache(sg, mamba_cfg(sg), path, seed=4)
    seen = cons.check_reads(oracle)
    hits = cons.prefetch(P + X + Z, P + Z)
    pxz = keys_of(P + X + Z)
    assert hits == [(20, 0, 1), (0, 0, 0)]
    assert [c[1:] for c in cons.calls if c[0] == "exists_v2"] == [(5, [5]), (0, [])]
    assert by_pool(seen) == {
        "kv": [(k[:6], True) for k in pxz[:5]],
        "mamba": [(pxz[4][:6], True)],
    }
    assert cons.wrong == []
    for c in (prod, cons):
        c.close()


# -- fail closed per pool ------------------------------------------------------------------


def stored_file(root, backend, pool: str, key: str):
    """The file store's file of one page of one pool (kvtier's key of SGLang's key)."""
    ns = backend.namespace.id if pool == "kv" else backend._v2_pool(pool).namespace.id
    h = page_hash_of(key).hex()
    return root / backend.key_prefix / ns / h[0:2] / h[2:4] / h


def corrupt(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # a payload byte: the frame's checksum no longer matches
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("pool", ["swa", "mamba"])
def test_a_corrupted_side_page_is_a_miss_for_its_pool_only(sg, pool, tmp_path):
    """The last page of P+X's SWA window (or P+X's Mamba state) is corrupted in the store:
    the trailing transfer that needs it reads as a miss as a whole (both window pages
    False, no host slot written, though the other page verified), while the KV pages of
    the same keys still land byte-equal; P+Z's window, which does not need that page,
    still restores."""
    path = write_yaml(tmp_path, store_section("file", None, tmp_path))
    cfg = swa_cfg(sg) if pool == "swa" else mamba_cfg(sg)
    extra = {"sliding_window_size": 8} if pool == "swa" else {}
    prod = HiCache(sg, cfg, path, seed=5, **extra)
    oracle = prod.written()
    prod.compute_and_back_up(P + X, P + Y)
    pxz, pz = keys_of(P + X + Z), keys_of(P + Z)
    corrupt(stored_file(tmp_path / "l3", prod.backend, pool, pxz[4]))
    cons = HiCache(sg, cfg, path, seed=6, **extra)
    seen = cons.check_reads(oracle)
    hits = cons.prefetch(P + X + Z, P + Z)
    got = by_pool(seen)
    assert got["kv"][:5] == [(k[:6], True) for k in pxz[:5]]
    if pool == "swa":
        assert got["swa"] == [(k[:6], False) for k in pxz[3:5]] + [
            (k[:6], True) for k in pz[1:3]
        ]
        assert hits[1][0] == 12 and hits[1][1] == 8  # P+Z: 3 pages, its window restored
        assert hits[0][1] == 0  # P+X+Z: no SWA window came back for page 5
    else:
        assert got["mamba"] == [(pxz[4][:6], False)]
        assert hits[0][2] == 0  # no Mamba state restored
    assert cons.wrong == []
    for c in (prod, cons):
        c.close()


# -- geometry: two models that differ in it never share a page -----------------------------


@pytest.mark.parametrize("what", ["window", "state shape"])
def test_a_different_window_or_state_shape_misses_every_page(sg, what, tmp_path):
    """A model with another sliding window (16 tokens, not 8) or another Mamba state shape
    (state size 32, not 16), everything else equal, finds none of the producer's pages
    (KV included: its bytes depend on the whole model); the same model finds them."""
    path = write_yaml(tmp_path, store_section("file", None, tmp_path))
    if what == "window":
        same, other = (
            (swa_cfg(sg, 8), {"sliding_window_size": 8}),
            (
                swa_cfg(sg, 16),
                {"sliding_window_size": 16},
            ),
        )
    else:
        same, other = (mamba_cfg(sg, 16), {}), (mamba_cfg(sg, 32), {})
    prod = HiCache(sg, same[0], path, seed=7, **same[1])
    oracle = prod.written()
    prod.compute_and_back_up(P + X)
    diff = HiCache(sg, other[0], path, seed=8, **other[1])
    seen = diff.check_reads(oracle)
    assert diff.prefetch(P + X + Z) == [(0, 0, 0)]
    assert [c[1:] for c in diff.calls if c[0] == "exists_v2"] == [(0, [])]
    assert seen == {}
    assert diff.backend.namespace.id != prod.backend.namespace.id
    for name in prod.pools:
        if name != "kv":
            assert (
                diff.backend._v2_pool(name).namespace.id
                != prod.backend._v2_pool(name).namespace.id
            )
    twin = HiCache(sg, same[0], path, seed=9, **same[1])
    twin.check_reads(oracle)
    assert twin.prefetch(P + X + Z)[0][0] == 20
    assert diff.wrong == twin.wrong == []
    for c in (prod, diff, twin):
        c.close()


# -- tenant keys, the breaker, bad input ---------------------------------------------------


def test_a_tenant_key_seals_every_pool_and_another_tenant_finds_nothing(sg, tmp_path):
    """With a tenant key (docs/security.md) the SWA pages are sealed under keyed hashes, as
    the KV pages are: the store's listing of the SWA namespace holds none of SGLang's
    page hashes and no frame a keyless reader takes for valid; the round trip is still
    byte-equal; another tenant's key, or none, restores nothing."""
    section = store_section("file", None, tmp_path)
    a_path = write_yaml(tmp_path, section, tenant_key=KEY_A)
    prod = HiCache(sg, swa_cfg(sg), a_path, seed=10, sliding_window_size=8)
    oracle = prod.written()
    prod.compute_and_back_up(P + X)
    swa_ns = prod.backend._v2_pool("swa").namespace.id
    listing = list_store(section, swa_ns)
    assert len(listing.keys) == 5 and listing.plain == 0
    assert not any(h in k for h in keys_of(P + X) for k in listing.keys)
    cons = HiCache(sg, swa_cfg(sg), a_path, seed=11, sliding_window_size=8)
    seen = cons.check_reads(oracle)
    assert cons.prefetch(P + X + Z)[0][:2] == (20, 8)
    assert [ok for _, ok in seen["swa"]] == [True, True] and cons.wrong == []
    for other in ({"tenant_key": KEY_B}, {}):
        b = HiCache(
            sg,
            swa_cfg(sg),
            write_yaml(tmp_path, section, **other),
            seed=12,
            sliding_window_size=8,
        )
        assert b.prefetch(P + X + Z) == [(0, 0, 0)]
        b.close()
    for c in (prod, cons):
        c.close()


def test_an_unreachable_store_is_a_miss_for_every_pool_then_skipped(sg, tmp_path):
    """Nothing listens on the store's port: the producer's v2 writes answer False for
    every page, the consumer's lookups are misses (no hit, no read), and the breaker
    then answers at once instead of waiting a timeout per call."""
    section = {
        "backend": "redis",
        "url": f"redis://127.0.0.1:{free_port()}/0",
        "connect_timeout_s": 0.5,
        "socket_timeout_s": 0.5,
    }
    path = write_yaml(tmp_path, section)
    doc = yaml.safe_load(open(path).read())
    # no probe while the test runs, however slow the machine: the 4th lookup is skipped
    doc["controller"] = {"store_probe_backoff_s": 3600.0}
    open(path, "w").write(yaml.safe_dump(doc))
    prod = HiCache(sg, mamba_cfg(sg), path, seed=13)
    prod.written()
    prod.compute_and_back_up(P + X)
    assert [c[1] for c in prod.calls if c[0] == "set_v2"] == [{"mamba": [False]}]
    cons = HiCache(sg, mamba_cfg(sg), path, seed=14)
    seen = cons.check_reads({})
    seqs = [P + X + Z, P + X, P + Y, P + X + Z]  # 3 failed calls trip it, the 4th skips
    assert cons.prefetch(*seqs) == [(0, 0, 0)] * 4
    assert seen == {}
    stats = cons.backend.kvtier_stats()
    assert stats["store_down"] is True and stats["breaker_trips"] == 1
    assert stats["calls_skipped_store_down"] >= 1
    for c in (prod, cons):
        c.close()


def test_bad_v2_input_is_refused_naming_the_pool_and_what_is_allowed(sg, tmp_path):
    """A hit policy kvtier does not serve (BLOCK_GROUPS: SGLang 0.5.23's HiCache never
    sends it, and its own file and Mooncake backends refuse it too), a pool never
    registered, and host slots that do not match the keys, each a clear error; nothing is
    written or read."""
    from sglang.srt.mem_cache.hicache_storage import (
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )

    path = write_yaml(tmp_path, store_section("file", None, tmp_path))
    w = HiCache(sg, swa_cfg(sg), path, seed=15, sliding_window_size=8)
    b, keys = w.backend, keys_of(P)
    block = PoolTransfer(
        name=PoolName.SWA,
        keys=["__placeholder__"] * 2,
        hit_policy=PoolHitPolicy.BLOCK_GROUPS,
    )
    with pytest.raises(
        ValueError, match="pool 'swa': hit_policy='block_groups': kvtier"
    ):
        b.batch_exists_v2(keys, [block])
    block_io = PoolTransfer(
        name=PoolName.SWA,
        keys=keys[:1],
        host_indices=torch.arange(PS),
        hit_policy=PoolHitPolicy.BLOCK_GROUPS,
    )
    for call in (b.batch_set_v2, b.batch_get_v2):
        with pytest.raises(ValueError, match="hit_policy='block_groups'"):
            call([block_io])
    mamba = PoolTransfer(
        name=PoolName.MAMBA, keys=keys[:1], host_indices=torch.tensor([1])
    )
    with pytest.raises(
        ValueError, match=r"pool 'mamba': not registered .*\['kv', 'swa'\]"
    ):
        b.batch_set_v2([mamba])
    short = PoolTransfer(
        name=PoolName.SWA,
        keys=keys[:2],
        host_indices=torch.arange(PS, 2 * PS),
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )
    with pytest.raises(
        ValueError, match=r"pool 'swa': host_indices has 4 slots for 2 keys; expected 8"
    ):
        b.batch_get_v2([short])
    with pytest.raises(ValueError, match="host_indices has 4 slots"):
        b.batch_set_v2([short])
    assert b.kvtier_stats()["set_pages"] == 0 and b.kvtier_stats()["get_pages"] == 0
    w.close()


def test_under_mla_rank_split_pools_get_a_namespace_per_rank(sg, tmp_path):
    """MLA KV is the same on every TP rank (one namespace, one writer); a Mamba state or
    an MHA-shaped pool (heads split over ranks) is not: each rank gets a namespace of its
    own, so a rank that did not write such a page misses it instead of reading another
    rank's heads. An MLA-shaped sidecar (an indexer) stays replicated like the KV."""
    from kvtier.integrations.sglang import KvtierStorage
    from tests.integrations import sglang_runtime as bare

    host = types.SimpleNamespace(
        base=importlib.import_module("sglang.srt.mem_cache.pool_host.base"),
        mha=importlib.import_module("sglang.srt.mem_cache.pool_host.mha"),
        mla=importlib.import_module("sglang.srt.mem_cache.pool_host.mla"),
        hicache_storage=importlib.import_module("sglang.srt.mem_cache.hicache_storage"),
    )
    path = write_yaml(tmp_path, store_section("file", None, tmp_path))
    ids = []
    for rank in (0, 1):
        cfg = bare.storage_config(
            host,
            mla=True,
            tp_rank=rank,
            tp_size=2,
            extra={"kvtier_config": path, "sliding_window_size": 8},
        )
        b = KvtierStorage(cfg)
        kv = bare.make_mla_pool(host)
        b.register_mem_pool_host(kv)
        for name, pool in (
            ("kv", kv),
            ("swa", bare.make_mha_pool(host)),
            ("mamba", bare.make_mha_pool(host)),
            ("indexer", bare.make_mla_pool(host, lora=8)),
        ):
            b.register_mem_host_pool_v2(pool, host.hicache_storage.PoolName(name))
        b.on_host_pools_registered()
        ids.append(
            {"kv": b.namespace.id}
            | {n: b._v2_pool(n).namespace.id for n in ("swa", "mamba", "indexer")}
        )
        b.close()
    assert ids[0]["kv"] == ids[1]["kv"] and ids[0]["indexer"] == ids[1]["indexer"]
    assert ids[0]["swa"] != ids[1]["swa"] and ids[0]["mamba"] != ids[1]["mamba"]
    assert len(set(ids[0].values())) == 4


def test_an_all_pages_sidecar_restores_only_its_leading_run(sg, tmp_path):
    """A sidecar registered later (as SGLang registers one: register_mem_host_pool_v2
    alone) under ALL_PAGES, with its page of P's middle key never written: the KV holds 3
    pages, but only the first length is restorable; a read answers per page, the missing
    one False with its host slots untouched, the others byte-equal. The same pages under
    TRAILING_PAGES with a window of 1 restore at 1 and 3, not 2."""
    from sglang.srt.mem_cache.hicache_storage import (
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )

    path = write_yaml(tmp_path, store_section("file", None, tmp_path))
    w = HiCache(sg, swa_cfg(sg), path, seed=16, sliding_window_size=8)
    b, keys = w.backend, keys_of(P)
    side = w.pool("swa")  # a real MHA host pool, under a pool name of its own
    b.register_mem_host_pool_v2(side, PoolName.DRAFT)
    kv_slots = w.pool("kv").alloc(3 * PS)
    assert b.batch_set_v1(keys, kv_slots) == [True] * 3
    src = side.alloc(3 * PS)
    written = [keys[0], keys[2]]
    put = PoolTransfer(
        name=PoolName.DRAFT,
        keys=written,
        host_indices=torch.cat([src[:PS], src[2 * PS :]]),
    )
    assert b.batch_set_v2([put]) == {PoolName.DRAFT: [True, True]}
    r = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DRAFT)])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (1, [1])
    assert r.extra_pool_hit_pages == {PoolName.KV: 3, PoolName.DRAFT: 1}
    trailing = PoolTransfer(
        name=PoolName.DRAFT, keys=["_"], hit_policy=PoolHitPolicy.TRAILING_PAGES
    )
    assert b.batch_exists_v2(keys, [trailing]).restorable_prefix_pages == [1, 3]
    dst = side.alloc(3 * PS)
    before = [page_at(side, s) for s in dst[::PS].tolist()]
    got = b.batch_get_v2(
        [PoolTransfer(name=PoolName.DRAFT, keys=keys, host_indices=dst)]
    )
    assert got == {PoolName.DRAFT: [True, False, True]}
    after = [page_at(side, s) for s in dst[::PS].tolist()]
    assert after[0] == page_at(side, int(src[0])) and after[1] == before[1]
    assert after[2] == page_at(side, int(src[2 * PS]))
    assert b._v2_pool("draft").namespace.id != b._v2_pool("swa").namespace.id
    w.close()


def test_swa_and_mamba_pools_together_round_trip_byte_equal(sg, tmp_path):
    """(FULL, SWA, MAMBA): three host pools. P+X restores at 5 pages with its SWA window
    and its Mamba state, every page byte-equal; P+Z restores nothing (no state at 3)."""
    cfg = sg.cfg.CacheConfig(
        page_size=PS,
        components=(ct().FULL, ct().SWA, ct().MAMBA),
        sliding_window_size=8,
        enable_mamba_extra_buffer=True,
        mamba_cache_size=60,
        num_layers=4,
        full_attention_layer_ids=(1, 3),
        head_num=2,
        head_dim=8,
    )
    path = write_yaml(tmp_path, store_section("file", None, tmp_path))
    prod = HiCache(sg, cfg, path, seed=17, sliding_window_size=8)
    oracle = prod.written()
    prod.compute_and_back_up(P + X, P + Y)
    cons = HiCache(sg, cfg, path, seed=18, sliding_window_size=8)
    seen = cons.check_reads(oracle)
    hits = cons.prefetch(P + X + Z, P + Z)
    pxz = keys_of(P + X + Z)
    assert [c[1:] for c in cons.calls if c[0] == "exists_v2"] == [(5, [5]), (0, [])]
    assert hits == [(20, 8, 1), (0, 0, 0)]
    assert by_pool(seen) == {
        "kv": [(k[:6], True) for k in pxz[:5]],
        "swa": [(k[:6], True) for k in pxz[3:5]],
        "mamba": [(pxz[4][:6], True)],
    }
    assert cons.wrong == []
    for c in (prod, cons):
        c.close()


def test_an_fp8_kv_cache_dtype_names_every_pools_namespace(sg, tmp_path):
    """fp8 KV lives in uint8 host pools, so the pools alone cannot tell fp8_e4m3 from
    fp8_e5m2 (docs/sglang.md: give `kv_cache_dtype`). Every pool's bytes depend on it
    (an SWA or Mamba layer reads what the fp8 full layers below it computed), so two runs
    that differ only in `kv_cache_dtype` share no page of any pool, not only of the KV."""
    from kvtier.integrations.sglang import KvtierStorage
    from tests.integrations import sglang_runtime as bare

    host = types.SimpleNamespace(
        base=importlib.import_module("sglang.srt.mem_cache.pool_host.base"),
        mha=importlib.import_module("sglang.srt.mem_cache.pool_host.mha"),
        mla=importlib.import_module("sglang.srt.mem_cache.pool_host.mla"),
        hicache_storage=importlib.import_module("sglang.srt.mem_cache.hicache_storage"),
    )
    path = write_yaml(tmp_path, store_section("file", None, tmp_path))
    ids = []
    for fp8 in ("fp8_e4m3", "fp8_e5m2"):
        extra = {"kvtier_config": path, "sliding_window_size": 8, "kv_cache_dtype": fp8}
        b = KvtierStorage(bare.storage_config(host, extra=extra))
        kv = bare.make_mha_pool(host, dtype=torch.uint8)
        b.register_mem_pool_host(kv)
        for name, pool in (
            ("kv", kv),
            ("swa", bare.make_mha_pool(host, dtype=torch.uint8)),
            ("indexer", bare.make_mla_pool(host, lora=8, dtype=torch.uint8)),
        ):
            b.register_mem_host_pool_v2(pool, host.hicache_storage.PoolName(name))
        b.on_host_pools_registered()
        ids.append(
            {"kv": b.namespace.id}
            | {n: b._v2_pool(n).namespace.id for n in ("swa", "indexer")}
        )
        b.close()
    for name in ("kv", "swa", "indexer"):
        assert ids[0][name] != ids[1][name], name


def test_clear_deletes_every_pools_pages(sg, tmp_path):
    """SGLang's `clear` (a cache flush) deletes the pages of every pool of this model, the
    SWA pool's as well as the KV's; another model's pages stay."""
    section = store_section("file", None, tmp_path)
    path = write_yaml(tmp_path, section)
    prod = HiCache(sg, swa_cfg(sg), path, seed=19, sliding_window_size=8)
    prod.compute_and_back_up(P + X)
    other = HiCache(sg, swa_cfg(sg, 16), path, seed=20, sliding_window_size=16)
    other.compute_and_back_up(P + X)
    spaces = {
        n: (
            prod.backend._v2_pool(n).namespace.id,
            other.backend._v2_pool(n).namespace.id,
        )
        for n in ("kv", "swa")
    }
    assert all(len(list_store(section, o).keys) == 5 for _, o in spaces.values())
    assert prod.backend.clear() is True
    for mine, theirs in spaces.values():
        assert list_store(section, mine).keys == []
        assert len(list_store(section, theirs).keys) == 5
    for c in (prod, other):
        c.close()


def test_under_dcp_every_pool_gets_a_namespace_per_dcp_shard(sg, tmp_path):
    """Under decode context parallelism (MLA only) each DCP rank holds and writes its
    own shard of the pages, and the KV namespace names the shard; so must every other
    pool's, an MLA-shaped sidecar (an indexer, replicated over TP like the KV) included:
    otherwise the DCP ranks write one key with different bytes and read each other's."""
    from kvtier.integrations.sglang import KvtierStorage
    from tests.integrations import sglang_runtime as bare

    host = types.SimpleNamespace(
        base=importlib.import_module("sglang.srt.mem_cache.pool_host.base"),
        mha=importlib.import_module("sglang.srt.mem_cache.pool_host.mha"),
        mla=importlib.import_module("sglang.srt.mem_cache.pool_host.mla"),
        hicache_storage=importlib.import_module("sglang.srt.mem_cache.hicache_storage"),
    )
    path = write_yaml(tmp_path, store_section("file", None, tmp_path))
    ids = []
    for rank in (0, 1):
        cfg = host.hicache_storage.HiCacheStorageConfig(
            tp_rank=rank,
            tp_size=2,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=True,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name="deepseek-ai/DeepSeek-V3.2",
            extra_config={"kvtier_config": path},
            dcp_size=2,
            dcp_rank=rank,
            logical_page_size=2 * PS,
        )
        assert cfg.is_storage_writer  # each DCP rank writes its shard
        b = KvtierStorage(cfg)
        kv = bare.make_mla_pool(host)
        b.register_mem_pool_host(kv)
        for name, pool in (("kv", kv), ("indexer", bare.make_mla_pool(host, lora=8))):
            b.register_mem_host_pool_v2(pool, host.hicache_storage.PoolName(name))
        b.on_host_pools_registered()
        ids.append(
            {"kv": b.namespace.id, "indexer": b._v2_pool("indexer").namespace.id}
        )
        b.close()
    assert ids[0]["kv"] != ids[1]["kv"]
    assert ids[0]["indexer"] != ids[1]["indexer"]
