"""kvtier as SGLang 0.5.23's unified-cache external linker, on SGLang's own classes.

A real `UnifiedRadixCache` over real CPU pools (`MHATokenToKVPool`, `MLATokenToKVPool`,
`TokenToKVPoolAllocator`) built by SGLang's test kit, kvtier's `KvtierLinker` created by
SGLang's `create_unified_cache_linker` (the `dynamic` backend) and attached with
`init_cache_linker`, then driven the way SGLang's scheduler drives it: insert (which
offloads), `check_hicache_events`, evict, `match_prefix` (lookup), `init_load_back`
(load), `ready_to_load_host_cache` (start), the forward's per-layer waits,
`finish_external_linker_loads`. Stores are real: files, redis-server, an S3 endpoint (moto).
SGLang is loaded by tests/integrations/sglang_linker_runtime.py.
"""

from __future__ import annotations

import time
import uuid
from array import array

import pytest
import torch
import yaml

from kvtier.errors import KvtierConfigError
from tests.integrations import sglang_linker_runtime as rt
from kvtier.bench.servers import BlackHole
from tests.servers import IN_CI

STORES = ["file", "redis", "s3"]


@pytest.fixture(scope="module")
def sg():
    try:
        mods = rt.load()
    except rt.Missing as exc:
        if IN_CI:
            pytest.fail(f"{exc}; .ci/run must install it")
        pytest.skip(str(exc))
    yield mods
    rt.unload()


def store_section(kind: str, request, tmp_path) -> dict:
    if kind == "none":
        return {"backend": "none"}
    if kind == "file":
        return {"backend": "file", "root": str(tmp_path / "l3")}
    if kind == "redis":
        return {"backend": "redis", "url": request.getfixturevalue("redis_server").url}
    if kind == "s3":
        return {"backend": "s3", "bucket": f"kvtier-{uuid.uuid4().hex[:12]}", "create_bucket": True,
                "endpoint_url": request.getfixturevalue("s3_server").url,
                "access_key_id": "testing", "secret_access_key": "testing"}
    raise AssertionError(kind)


def write_yaml(tmp_path, store: dict, mirror: dict | None = None, controller: dict | None = None) -> str:
    path = tmp_path / f"linker-{uuid.uuid4().hex[:6]}.yaml"
    doc = {"store": {"timeout_s": 5.0, **store}, "mirror": {"ratio": 2.0, "layout": "page_first", **(mirror or {})}}
    if store.get("backend") == "none":
        doc["store"] = {"backend": "none"}
    if controller:
        doc["controller"] = controller
    path.write_text(yaml.safe_dump(doc))
    return str(path)


class Server:
    """One SGLang cache-owning worker: a real UnifiedRadixCache with kvtier's linker."""

    def __init__(self, sg, yaml_path: str, *, page_size: int = 4, kv_size: int = 256, layers: int = 2,
                 mla: bool = False, tp_group=None) -> None:
        self.sg = sg
        cfg = sg.cfg.CacheConfig(page_size=page_size, kv_size=kv_size, num_layers=layers, head_num=2, head_dim=8,
                                 max_context_len=512)
        self.cache, self.allocator, self.r2t = sg.fx.build_fixture(cfg)
        if mla:
            self._use_mla_pool(cfg)
        params = self.cache.cache_init_params
        params.tp_cache_group = tp_group
        self.kv = self.allocator.get_kvcache()
        self.server_args = sg.server_args.ServerArgs(model_path="kvtier-test/tiny", page_size=page_size)
        linker = sg.factory.create_unified_cache_linker(
            self.server_args, params, backend="dynamic", components=set(self.cache.components),
            config={"linker": "KvtierLinker", "linker_module_path": "kvtier.integrations.sglang_linker",
                    "linker_extra_config": {"kvtier_config": yaml_path}})
        self.cache.init_cache_linker(linker)
        self.kv.register_layer_transfer_counter(linker.layer_done_counter)
        self.linker = linker
        self.page_size = page_size
        self.n = 0

    def _use_mla_pool(self, cfg) -> None:
        """The fixture builds MHA; an MLA model's cache is the same tree over MLATokenToKVPool."""
        sg = self.sg
        kv = sg.memory_pool.MLATokenToKVPool(size=cfg.kv_size, page_size=cfg.page_size, dtype=cfg.dtype,
                                             kv_lora_rank=16, qk_rope_head_dim=4, layer_num=cfg.num_layers,
                                             device="cpu", enable_memory_saver=False)
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        self.allocator = TokenToKVPoolAllocator(size=cfg.kv_size, dtype=cfg.dtype, device="cpu", kvcache=kv,
                                                need_sort=False)
        params = self.cache.cache_init_params
        params.token_to_kv_pool_allocator = self.allocator
        from sglang.srt.environ import envs
        with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override("python"):  # as build_fixture
            self.cache = sg.urc.UnifiedRadixCache(params=params)
        self.cache.cache_init_params = params

    # -- the bytes -------------------------------------------------------------------------

    def buffers(self) -> list[torch.Tensor]:
        if hasattr(self.kv, "kv_buffer") and not hasattr(self.kv, "k_buffer"):
            return list(self.kv.kv_buffer)
        return list(self.kv.k_buffer) + list(self.kv.v_buffer)

    def fill(self, slots: torch.Tensor, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for buf in self.buffers():
            vals = torch.randn((len(slots), *buf.shape[1:]), generator=g).to(buf.dtype)
            buf[slots] = vals
            out.append(vals)
        return out

    def read(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return [buf[slots].clone() for buf in self.buffers()]

    # -- what SGLang's scheduler does ------------------------------------------------------

    def compute(self, tokens: list[int], seed: int) -> list[torch.Tensor]:
        """A finished prefill: its KV written to fresh slots, inserted (offloads), settled."""
        slots = self.allocator.alloc(len(tokens))
        kv = self.fill(slots, seed)
        self.cache.insert(self.sg.bpc.InsertParams(key=self.sg.rc.RadixKey(array("q", tokens)), value=slots))
        self.settle_offloads()
        return kv

    def settle_offloads(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.cache.linker.pending_offloads:
            self.cache.check_hicache_events()
            assert time.monotonic() < deadline, "offloads did not complete"
            time.sleep(0.001)

    def evict_all(self) -> None:
        self.cache.evict(self.sg.bpc.EvictParams(num_tokens=self.allocator.size))

    def request(self, tokens: list[int]):
        self.n += 1
        return self.sg.sb.Req(rid=f"r{self.n}", origin_input_text="", origin_input_ids=array("q", tokens),
                              sampling_params=self.sg.sp.SamplingParams(temperature=0, max_new_tokens=1))

    def match(self, req, tokens: list[int]):
        return self.cache.match_prefix(self.sg.bpc.MatchPrefixParams(key=self.sg.rc.RadixKey(array("q", tokens)),
                                                                     req=req))

    def load(self, req, result):
        """init_load_back -> start -> the forward's per-layer waits -> finish. Returns
        (tokens loaded, the request's private slots, the failed requests)."""
        self.r2t.alloc([req])
        n, _ = self.cache.init_load_back(self.sg.bpc.InitLoadBackParams(
            best_match_node=result.best_match_node, host_hit_length=result.host_hit_length, req=req))
        slots = self.cache.linker.private_load_indices.get(req.rid)
        index = self.cache.ready_to_load_host_cache()
        counter = self.linker.layer_done_counter
        counter.set_consumer(index)
        for layer in range(self.kv.layer_num):
            counter.wait_until(layer)
        failed = self.cache.finish_external_linker_loads([req])
        return n, slots, failed

    def check(self) -> None:
        self.cache.sanity_check()
        assert self.linker.core.check_accounting() == []

    def close(self) -> None:
        self.linker.close()


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8) if g.dtype == torch.bfloat16 else g,
                           w.view(torch.uint8) if w.dtype == torch.bfloat16 else w)


TOKENS = list(range(100, 132))  # 8 pages of 4


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
    server = Server(sg, write_yaml(tmp_path, {"backend": "none"}), page_size=page_size, mla=mla)
    tokens = list(range(100, 100 + 4 * max(page_size, 4)))
    want = server.compute(tokens, seed=1)
    server.evict_all()
    round_trip(server, tokens, want)
    stats = server.linker.stats()["counters"]
    assert stats["host_hit_pages"] == len(tokens) // page_size and stats["load_failures"] == 0
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
    assert c["store_hit_pages"] == len(TOKENS) // 4 and c["l3_read_pages"] == len(TOKENS) // 4
    # the pages read are host pages now: a second load needs no store
    second.evict_all()
    round_trip(second, TOKENS, want)
    assert second.linker.stats()["counters"]["l3_read_pages"] == len(TOKENS) // 4
    second.check()
    second.close()


# -- a store page that does not verify, a dead store --------------------------------------


def page_files(sg, server: Server, root, tokens: list[int]) -> list:
    """The file store's file of each page of `tokens` (SGLang's page keys, kvtier's keys)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    keys = get_storage_hash_str(sg.rc.RadixKey(array("q", tokens)), None, page_size=server.page_size)
    out = []
    for key in server.linker.core.store_keys(keys):
        prefix, ns, h = key.rsplit("/", 2)
        out.append(root / prefix / ns / h[0:2] / h[2:4] / h)
    return out


def loads_prefix(server: Server, tokens: list[int], pages: int, want: list[torch.Tensor]) -> None:
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
    assert result.host_hit_length == len(TOKENS)  # the store holds all 8 pages by their keys
    n, slots, failed = second.load(req, result)
    assert failed == [req] and req.skip_radix_cache_insert and req.discard_output_reason is not None
    for b, was in zip(second.buffers(), before):
        assert torch.equal(b.view(torch.uint8), was.view(torch.uint8))  # not one byte written
    second.allocator.free(slots)
    assert second.linker.stats()["counters"]["l3_read_failures"] == 1
    second.check()
    loads_prefix(second, TOKENS, 5, want)  # the next request on it: a shorter lookup, right bytes
    second.close()


def test_missing_store_page_gives_a_shorter_lookup(sg, tmp_path, request):
    path = write_yaml(tmp_path, store_section("file", request, tmp_path))
    first = Server(sg, path)
    want = first.compute(TOKENS, seed=4)
    first.close()
    page_files(sg, first, tmp_path / "l3", TOKENS)[3].unlink()  # before the store indexes its files
    second = Server(sg, path)
    loads_prefix(second, TOKENS, 3, want)
    second.close()


def test_dead_store_gives_host_only_lookups(sg, tmp_path):
    """A store that never answers: each lookup makes at most one store call, which ends by
    its timeout; after `store_down_after_failures` of them the breaker skips the store and
    lookups answer from the host tier alone, without a store call."""
    hole = BlackHole()  # accepts connections, never answers
    try:
        path = write_yaml(tmp_path, {"backend": "redis", "url": f"redis://127.0.0.1:{hole.port}/0",
                                     "timeout_s": 0.3, "connect_timeout_s": 5.0, "socket_timeout_s": 5.0},
                          controller={"store_down_after_failures": 2, "store_probe_backoff_s": 3600})
        server = Server(sg, path)
        on_host = list(range(500, 516))
        want = server.compute(on_host, seed=5)  # offloaded to host; its store write times out
        server.evict_all()
        store = server.linker.core.store
        for i in range(4):
            tokens = on_host + list(range(600 + 16 * i, 616 + 16 * i))  # 4 host pages, 4 nowhere
            req = server.request(tokens)
            result = server.match(req, tokens)
            assert result.host_hit_length == len(on_host)
        stats = server.linker.stats()
        assert stats["store"]["store_down"] is True
        assert stats["counters"]["lookup_store_skipped"] >= 2  # the last lookups did not call it
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
    shell = sg.shell
    with pytest.raises(KvtierConfigError, match="unknown keys \\['kvtier_conifg'\\]"):
        shell.parse_extra({"kvtier_conifg": "x.yaml"})
    with pytest.raises(KvtierConfigError, match="kvtier_config=None"):
        shell.parse_extra({})
