"""kvtier's linker under a hybrid model: SGLang 0.5.23's real UnifiedRadixCache with
(FULL, SWA) and (FULL, MAMBA) components over real CPU pools, built by its test kit, and
kvtier's `KvtierLinker` created by SGLang's factory, driven as SGLang's scheduler drives
it. Every load is checked byte for byte against what was computed: the KV prefix, the SWA
window ending at the hit, the Mamba state at the hit (sglang_hybrid_server.py).

The scenario (page 4, window 2 pages): P = 3 pages, X and Y = 2 pages, Z = 1 page;
compute P+X, then P+Y; evict the device; request P+X+Z, P+Y, P+Z. Under SWA every length
whose window is stored restores (P+Z: P); under Mamba only where a node ended when it was
offloaded (P+Z: nothing, P was split off P+X and has no state of its own).
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.testing import sglang_loader
from tests.integrations.sglang_hybrid_server import PS, HybridServer
from tests.integrations.sglang_linker_server import engine_keys, write_yaml
from tests.integrations.test_sglang_linker import store_section
from tests.servers import IN_CI

P = list(range(100, 100 + 3 * PS))
X = list(range(200, 200 + 2 * PS))
Y = list(range(300, 300 + 2 * PS))
Z = list(range(400, 400 + PS))
KINDS = ["swa", "mamba"]
# tokens restored for P+X+Z, P+Y, P+Z
HITS = {"swa": [20, 20, 12], "mamba": [20, 20, 0]}


@pytest.fixture(scope="module")
def sg():
    try:
        return sglang_loader.load()
    except sglang_loader.Unavailable as exc:
        if IN_CI:
            pytest.fail(f"{exc}; .ci/run must install it")
        pytest.skip(str(exc))


def scenario(server: HybridServer) -> None:
    server.compute(P + X, seed=1)
    server.compute(P + Y, seed=2)


def requests(server: HybridServer) -> list[int]:
    return [
        server.match_load(P + X + Z + [7]),
        server.match_load(P + Y + [7]),
        server.match_load(P + Z + [7]),
    ]


def side(server: HybridServer):
    return server.linker.core.cores[server.kind]


@pytest.mark.parametrize("kind", KINDS)
def test_host_round_trip_of_every_pool(sg, tmp_path, kind):
    server = HybridServer(sg, write_yaml(tmp_path, {"backend": "none"}), kind)
    assert set(server.linker.pools) == {server.PoolName.KV, server.PoolName(kind)}
    scenario(server)
    server.evict_all()
    assert requests(server) == HITS[kind]
    c = side(server).stats()["counters"]
    assert c["load_pages"] > 0 and c["load_failures"] == 0
    server.check()
    server.close()


@pytest.mark.parametrize("store", ["file", "redis", "s3"])
@pytest.mark.parametrize("kind", KINDS)
def test_store_round_trip_of_every_pool(sg, tmp_path, request, kind, store):
    """The pages of every pool reach the store; a fresh worker (empty host tiers) loads
    them back byte for byte, each pool from its own namespace."""
    path = write_yaml(tmp_path, store_section(store, request, tmp_path))
    first = HybridServer(sg, path, kind)
    scenario(first)
    first.close()  # drains the store writes
    written = side(first).stats()["counters"]["l3_write_pages"]
    assert written == (7 if kind == "swa" else 2)  # SWA: P, X, Y pages; Mamba: 2 states
    second = HybridServer(sg, path, kind)
    second.pages, second.states = first.pages, first.states
    assert requests(second) == HITS[kind]
    c = side(second).stats()["counters"]
    assert c["l3_read_pages"] > 0 and c["load_failures"] == 0
    second.check()
    second.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_lookup_never_answers_a_length_whose_window_or_state_is_missing(
    sg, tmp_path, request, kind
):
    """The side pool's page at the end of X is gone from the store (the KV pages all
    there): SWA restores every length whose window does not hold it (4 pages of P+X+Z's
    5), Mamba nothing (its one state at P+X was that page); the KV core alone would
    have answered 5."""
    path = write_yaml(tmp_path, store_section("file", request, tmp_path))
    first = HybridServer(sg, path, kind)
    scenario(first)
    first.close()
    keys = engine_keys(sg, first, P + X + Z)
    gone = side(first).l3.keys([keys[4]])[0]
    prefix, ns, h = gone.rsplit("/", 2)
    (tmp_path / "l3" / prefix / ns / h[0:2] / h[2:4] / h).unlink()
    second = HybridServer(sg, path, kind)  # the file store indexes its files on open
    second.pages, second.states = first.pages, first.states
    window = {"swa": 2, "mamba": 1}[kind]
    core = second.linker.core
    assert core.kv.lookup("probe", keys) == 5
    assert core.lookup("probe", keys, {kind: window}) == (
        [1, 2, 3, 4] if kind == "swa" else []
    )
    assert second.match_load(P + X + Z + [7]) == (16 if kind == "swa" else 0)
    second.check()
    second.close()


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_abort_and_reset_free_every_pin(sg, tmp_path, request, kind):
    """A request aborted while its load is queued (SGLang's release_request ->
    cancel_queued_load) gives back every pool's pins and store reads; SGLang's reset
    empties every pool's host tier; the store keeps the pages, so the next request
    still restores."""
    path = write_yaml(tmp_path, store_section("file", request, tmp_path))
    first = HybridServer(sg, path, kind)
    scenario(first)
    first.close()
    server = HybridServer(sg, path, kind)
    server.pages, server.states = first.pages, first.states
    server.compute(list(range(500, 500 + 3 * PS)), seed=9)  # some pages on host
    server.evict_all()
    tokens = P + X + Z + [7]
    req = server.request(tokens)
    result = server.match(req, tokens)
    server.r2t.alloc([req])
    n, _ = server.cache.init_load_back(
        sg.bpc.InitLoadBackParams(
            best_match_node=result.best_match_node,
            host_hit_length=result.host_hit_length,
            req=req,
        )
    )
    assert n == 20
    cores = server.linker.core.cores
    assert all(c.stats()["queues"]["loads_queued"] == 1 for c in cores.values())
    slots = server.cache.linker.private_load_indices[req.rid]
    server.cache.linker.release_request(req.rid)  # what SGLang's abort does
    server.release(req, slots)
    server.linker.core.quiesce()  # the cancelled reads settle; their pages go back
    for core in cores.values():
        s = core.stats()
        assert s["queues"]["loads_queued"] == 0
        assert s["counters"]["loads_cancelled"] == 1
        host = s["host"]
        assert host["pages_pinned"] == 0
        assert host["pages_free"] + host["pages_published"] == host["pages_total"]
    server.check()
    server.cache.reset()
    for core in cores.values():
        host = core.stats()["host"]
        assert host["pages_free"] == host["pages_total"]
    assert server.match_load(tokens) == 20
    server.check()
    server.close()


def test_every_pools_namespace_names_the_models_window(sg, tmp_path):
    """Two SWA models that differ only in their window share no page of any pool, and a
    hybrid model's KV pages are not a Full-only model's."""
    path = write_yaml(tmp_path, {"backend": "none"})
    a = HybridServer(sg, path, "swa", window=8)
    b = HybridServer(sg, path, "swa", window=12)
    ids = [
        {n: c.settings.namespace.id for n, c in s.linker.core.cores.items()}
        for s in (a, b)
    ]
    assert ids[0]["kv"] != ids[1]["kv"] and ids[0]["swa"] != ids[1]["swa"]
    assert ids[0]["kv"] != ids[0]["swa"]
    assert "window=8" in a.linker.core.cores["swa"].settings.namespace.layout
    a.close()
    b.close()


def test_a_mamba_pool_with_int8_checkpoints_is_refused(sg, tmp_path):
    """With SGLang's --enable-int8-mamba-checkpoint a tree node's Mamba value is a slot of
    the int8 checkpoint pool, not of the active pool the linker copies: the offload read
    the active pool's row of that number (another request's state, or a freed one) and a
    later load restored it as this prefix's state. The linker refuses the pool, naming
    the flag."""
    path = write_yaml(tmp_path, {"backend": "none"})
    with pytest.raises(ValueError, match="--enable-int8-mamba-checkpoint"):
        HybridServer(sg, path, "mamba", enable_int8_mamba_checkpoint=True)


def test_a_long_tails_lengths_are_thinned_alike_on_every_rank(sg):
    """A lookup of 64 pages names at most 17 lengths (SGLang marks each in a mask, one
    tensor write at a time): the longest and those below it on a stride of 4, so two
    ranks whose pools hold different lengths still meet on a length both can restore."""
    from kvtier.integrations.sglang.linker.shell import thinned

    a = [p for p in range(1, 41) if p != 12]  # rank a: no window at 12
    b = list(range(1, 35))
    ta, tb = thinned(a, 64), thinned(b, 64)
    assert ta == [4, 8, 16, 20, 24, 28, 32, 36, 40]
    assert tb == [4, 8, 12, 16, 20, 24, 28, 32, 34]
    assert max(set(ta) & set(tb)) == 32 and set(ta) <= set(a) and set(tb) <= set(b)
    assert thinned([], 64) == [] and thinned([3, 5], 5) == [3, 5]


def test_a_short_sparse_set_of_lengths_is_named_whole_so_ranks_still_meet(sg):
    """Mamba restores only at node ends: a rank whose store read of the state at 13
    failed answers [5], its peer [5, 13]. Both can restore 5, and SGLang's intersection
    must find it; thinning each set to the stride of 4 would leave [5] and [13], which
    never meet, and the request would recompute 5 pages both ranks hold."""
    from kvtier.integrations.sglang.linker.shell import LENGTHS, thinned

    a, b = [5, 13], [5]
    assert max(set(thinned(a, 64)) & set(thinned(b, 64))) == 5
    sparse = list(range(3, 3 + 2 * (LENGTHS + 1), 2))  # 17 lengths: named whole
    assert thinned(sparse, 64) == sparse
    longer = list(range(1, LENGTHS + 3))  # 18: thinned as before
    assert thinned(longer, 64) == [4, 8, 12, 16, 18]


@pytest.mark.parametrize("store", ["none", "file"])
def test_full_swa_and_mamba_together(sg, tmp_path, request, store):
    """(FULL, SWA, MAMBA): SGLang's SWAKVPool beside a Mamba request pool; every load
    brings the KV prefix, the SWA window and the state, byte for byte, from host or from
    a fresh worker's store; a length restores only where both side pools can."""
    path = write_yaml(tmp_path, store_section(store, request, tmp_path))
    first = HybridServer(sg, path, "swa+mamba")
    assert set(first.linker.core.cores) == {"kv", "swa", "mamba"}
    scenario(first)
    first.evict_all()
    assert requests(first) == [20, 20, 0]
    first.check()
    first.close()
    if store == "none":
        return
    second = HybridServer(sg, path, "swa+mamba")
    second.pages, second.states = first.pages, first.states
    assert requests(second) == [20, 20, 0]
    for name in ("swa", "mamba"):
        assert second.linker.core.cores[name].stats()["counters"]["l3_read_pages"] > 0
    second.check()
    second.close()


def _kvtier_threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.name.startswith("kvtier-")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["side core", "after the cores"])
def test_a_start_up_failure_closes_every_core_built_so_far(
    sg, tmp_path, monkeypatch, kind, where
):
    """The side pool's core fails to build (its host tier cannot be allocated), or start-up
    fails after every core was built: the error reaches SGLang, and every core built
    before it is closed, its copy threads joined (the KV core's were left running)."""
    from kvtier.integrations.sglang.linker import hybrid, shell

    def fail(*args, **kwargs):
        raise MemoryError("no host memory for the pool's host tier")

    if where == "side core":
        monkeypatch.setattr(hybrid, "LinkerCore", fail)
    else:
        monkeypatch.setattr(shell, "sglang_export", fail)
    before = _kvtier_threads()
    with pytest.raises(MemoryError, match="no host memory"):
        HybridServer(sg, write_yaml(tmp_path, {"backend": "none"}), kind)
    assert not _kvtier_threads() - before  # none left running


def unified_mamba_params(sg):
    """SGLang's --enable-unified-memory pools of a (FULL, MAMBA) model, as its
    `init_unified_mamba_pools` builds them (on CPU), in the cache's init params."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_memory_pool import init_unified_mamba_pools
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1
    )
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1,
            intermediate_size=64,
            n_groups=1,
            num_heads=2,
            head_dim=16,
            state_size=16,
            conv_kernel=4,
        )
    pools = init_unified_mamba_pools(
        device="cpu",
        kv_cache_dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        page_size=PS,
        start_layer=0,
        end_layer=3,
        is_draft_worker=False,
        use_mla_backend=False,
        mamba_layer_ids=[0, 2],
        full_attention_layer_ids=[1, 3],
        mamba2_cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]),
        model_context_len=256,
        extra_max_context_len=0,
        max_total_num_tokens=512,
        max_mamba_cache_size=60,
        max_num_reqs=16,
        enable_memory_saver=False,
        enable_mamba_extra_buffer=True,
        enable_mamba_extra_buffer_lazy=False,
        speculative_num_draft_tokens=None,
        disable_overlap_schedule=True,
        need_sort=False,
    )
    CT = sg.component_type.ComponentType
    return CacheInitParams(
        req_to_token_pool=pools.req_to_token_pool,
        token_to_kv_pool_allocator=pools.token_to_kv_pool_allocator,
        page_size=PS,
        disable=False,
        tree_components=(CT.FULL, CT.MAMBA),
        enable_mamba_extra_buffer=True,
    )


def test_a_unified_memory_mamba_pool_is_refused_naming_the_flag(sg, tmp_path):
    """SGLang's --enable-unified-memory Mamba pool (UnifiedHybridReqToTokenPool: virtual
    state slots, strided views of one shared buffer) is refused at start-up naming the
    flag, its value and what is allowed; it failed on a strided view's shape, naming no
    flag."""
    params = unified_mamba_params(sg)
    CT = sg.component_type.ComponentType
    with pytest.raises(ValueError) as err:
        sg.factory.create_unified_cache_linker(
            sg.server_args.ServerArgs(model_path="kvtier-test/hybrid", page_size=PS),
            params,
            backend="dynamic",
            components={CT.FULL, CT.MAMBA},
            config={
                "linker": "KvtierLinker",
                "linker_module_path": "kvtier.integrations.sglang.linker",
                "linker_extra_config": {
                    "kvtier_config": write_yaml(tmp_path, {"backend": "none"})
                },
            },
        )
    message = str(err.value)
    assert "--enable-unified-memory is on" in message
    assert "run without --enable-unified-memory" in message


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def press(server: HybridServer, first: int) -> None:
    """24 fresh 3-page prompts computed and offloaded: every pool's host tier (16 pages,
    15 Mamba states at a host ratio of 0.25) fills and evicts over and over."""
    for i in range(24):
        if i % 4 == 0:
            server.evict_all()
        base = 1000 * (first + i)
        server.compute(list(range(base, base + 3 * PS)), seed=first + i)
    server.evict_all()


@pytest.mark.parametrize("end", ["release", "expiry"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_hinted_hybrid_prefix_keeps_every_pools_pages_through_host_pressure(
    sg, tmp_path, kind, end
):
    """A host lease on P+X pins, in every pool, what its restore at full length needs: the
    KV pages, the SWA window ending there, the Mamba state at its end. Offloads that fill
    every pool's host tier many times over leave them, and P+X restores all 20 tokens
    (with the KV pool's pins alone the window or the state was evicted: nothing
    restored). When the lease is released or expires, every pool's pins go (none leaked),
    and the same pressure evicts the pages."""
    path = write_yaml(tmp_path, {"backend": "none"}, mirror={"ratio": 0.25})
    server = HybridServer(sg, path, kind)
    cores = server.linker.core.cores
    clock = Clock()
    for core in cores.values():  # the leases' clock
        core.hints.clock = clock
    server.compute(P + X, seed=1)
    keys = engine_keys(sg, server, P + X)
    server.linker.core.hints.pin(keys, ttl_s=60)
    assert {n: c.stats()["host"]["pages_pinned"] for n, c in cores.items()} == {
        "kv": 5,
        kind: 2 if kind == "swa" else 1,
    }
    press(server, 10)
    assert server.match_load(P + X + [7]) == 20
    server.check()
    server.evict_all()
    if end == "release":
        assert server.linker.core.hints.release(keys) == 1
    else:
        clock.now += 61
        server.cache.check_hicache_events()  # each pool's core reaps its leases
    for core in cores.values():
        assert core.stats()["host"]["pages_pinned"] == 0
        assert core.hints.stats()["leases"] == 0
    press(server, 40)
    assert server.match_load(P + X + [7]) == 0
    server.check()
    server.close()
