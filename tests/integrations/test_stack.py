"""`build_stack` (kvtier/integrations/stack.py): the one place every engine adapter gets
its namespace, sealed store, keyed hash, store thread and breaker.

The namespace ids and store keys below were computed by each adapter's own construction
before the adapters shared this builder: a store written by an earlier kvtier keeps its
keys. The engines' config records are plain attribute bags (SimpleNamespace) carrying the
fields SGLang's and vLLM's objects carry; the pool of the linker is kvtier's real one.
"""

from __future__ import annotations

import ast
import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace as S

import pytest
import torch

from kvtier.backends.registry import build_store
from kvtier.config import KvtierConfig, load_config
from kvtier.errors import KvtierConfigError
from kvtier.hashing import make_key
from kvtier.integrations.sglang.keys import page_hash_of as sglang_hash
from kvtier.integrations.sglang.linker.geometry import geometry_of as linker_geometry
from kvtier.integrations.sglang.storage import geometry_of as storage_geometry
from kvtier.integrations.stack import Geometry, build_stack
from kvtier.integrations.vllm.keys import TierSettings, vllm_geometry
from kvtier.integrations.vllm.keys import page_hash_of as vllm_hash
from kvtier.tiers.pool import DeviceKVPool, PoolConfig

KEY = "ab" * 32
INTEGRATIONS = Path(__file__).resolve().parents[2] / "kvtier" / "integrations"


def config(tenant_key: bool, store: dict | None = None) -> KvtierConfig:
    ns = {"model_id": "yaml-model", "tenant_salt": "acme", "revision": "r1"}
    if tenant_key:
        ns["tenant_key"] = KEY
    return load_config(
        None,
        overrides={
            "namespace": ns,
            "store": store or {"backend": "memory"},
            "mirror": {"ratio": 2.0},
        },
    )


def stack_of(cfg: KvtierConfig, geometry: Geometry, **kw):
    return build_stack(config=cfg, geometry=geometry, who="the test adapter", **kw)


# -- the namespace each adapter builds: unchanged ----------------------------------------

STORAGE_IDS = {  # (mla, tenant key): (namespace id, store key of SGLang's key "0" * 64)
    (False, False): ("8d5a601a2e764061cf23def763da2cd4", "0" * 64),
    (True, False): ("3d5c144cf614aba5f32a7ed74ec55764", "0" * 64),
    (False, True): (
        "321a1b993ffb569a859ff2b8d1fac4e5",
        "b1f65aefd4155477181cd41d05c989865e8c823c3c613437b1a0447744afdb98",
    ),
    (True, True): (
        "242491341fcf170e9c69a397fd01c601",
        "b1f65aefd4155477181cd41d05c989865e8c823c3c613437b1a0447744afdb98",
    ),
}


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("tenant_key", [False, True])
def test_sglang_storage_namespace_and_keys_are_those_it_built_before(mla, tenant_key):
    sc = S(
        tp_rank=1,
        tp_size=2,
        dp_rank=0,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        model_name="meta/llama",
        dcp_size=1,
    )
    pool = S(
        dtype=torch.bfloat16,
        layer_num=2,
        head_num=2,
        head_dim=8,
        v_head_dim=8,
        layout="page_first",
        page_size=4,
        kv_cache_dim=20,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
    )
    stack = stack_of(config(tenant_key), storage_geometry(sc, pool, "fp8_e4m3"))
    ns_id, hash_hex = STORAGE_IDS[(mla, tenant_key)]
    assert stack.namespace.id == ns_id
    assert stack.key(sglang_hash("0" * 64, stack.keyed)) == f"kvtier/{ns_id}/{hash_hex}"
    assert (stack.namespace.tp_rank, stack.namespace.tp_size) == (
        (0, 1) if mla else (1, 2)
    )


LINKER_IDS = {
    (False, False): "7299956971440bd346a16e2ee2100d29",
    (True, False): "f7786cb5a5ccc5eee71667d26b6a5c0e",
    (False, True): "4b34855f4da0dd838a2792d96622c708",
    (True, True): "d8ee1611c31c1929b3998eb465bc72e0",
}


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("tenant_key", [False, True])
def test_sglang_linker_namespace_is_the_one_it_built_before(mla, tenant_key):
    cfg = config(tenant_key)
    pool = DeviceKVPool(
        PoolConfig(
            size=64,
            num_layers=2,
            page_size=4,
            attention="mla" if mla else "mha",
            num_kv_heads=2,
            head_dim=8,
            kv_lora_rank=16,
            rope_dim=4,
            dtype="bfloat16",
        )
    )
    geometry = linker_geometry(
        cfg,
        S(model_path="meta/llama", kv_cache_dtype="auto"),
        S(pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1),
        pool,
        mla,
        "fp8_e4m3",
        1,
        2,
    )
    stack = stack_of(cfg, geometry, store_required=False)
    assert stack.namespace.id == LINKER_IDS[(mla, tenant_key)]
    assert stack.namespace.tenant_key_id == ("7db72a9ce90c78fd" if tenant_key else None)


@pytest.mark.parametrize(
    "tenant_key, ns_id, hash_hex",
    [
        (False, "1d9e7a0e12e43d10002244755fb309de", "11" * 16),
        (
            True,
            "38dd5437cf78f6a52f2c12fec0410141",
            "f8f6787f29f8162dfa47119a2827c8ec7750c14a2f1fb0b3f136d70304f3d041",
        ),
    ],
)
def test_vllm_tier_namespace_and_keys_are_those_it_built_before(
    tenant_key, ns_id, hash_hex
):
    parallel = S(
        is_parallelism_agnostic=False,
        world_size=2,
        tp_size=2,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        rank=1,
    )
    spec = S(
        config=S(
            groups=[S(tokens_per_block=16)],
            cache=S(blocks_per_chunk=4, tokens_per_hash=16),
            kv_cache_layout="NHD",
            canonical_layout=False,
            replicated_layout=False,
            model=S(name="meta/llama", dtype="bfloat16"),
            parallel=parallel,
        )
    )
    cfg = config(tenant_key)
    stack = stack_of(cfg, vllm_geometry(spec, 65536, TierSettings(cfg, tenant="vt")))
    assert stack.namespace.id == ns_id
    assert (
        stack.namespace.tenant_salt == "vt"
    )  # the tier's own salt wins over the YAML's
    key = stack.key(vllm_hash(b"\x11" * 16 + b"\0\0\0\0", stack.keyed))
    assert key == f"kvtier/{ns_id}/{hash_hex}"


def test_the_yaml_fills_what_the_engine_leaves_out():
    stack = stack_of(config(False), Geometry("float16", "l", 4))
    ns = stack.namespace
    assert (ns.model_id, ns.tenant_salt, ns.revision) == ("yaml-model", "acme", "r1")
    assert ns.id == make_key("kvtier", ns.id, bytes(16)).split("/")[1]


# -- bad input: the field, the value, what is allowed -------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"page_size": 0}, r"geometry.page_size=0: expected an integer >= 1"),
        ({"page_size": True}, r"geometry.page_size=True: expected an integer >= 1"),
        (
            {"tp_rank": 2, "tp_size": 2},
            r"geometry.tp_rank=2: must be in \[0, tp_size=2\)",
        ),
        ({"tp_rank": -1}, r"geometry.tp_rank=-1: expected an integer >= 0"),
        ({"tp_size": 0}, r"geometry.tp_size=0: expected an integer >= 1"),
        ({"dtype": ""}, r"geometry.dtype='': expected a non-empty string"),
        ({"layout": None}, r"geometry.layout=None: expected a non-empty string"),
        (
            {"model_id": ""},
            r"geometry.model_id='': expected a non-empty string, or None",
        ),
    ],
)
def test_bad_geometry_names_the_field_the_value_and_what_is_allowed(kw, match):
    args = {"dtype": "bfloat16", "layout": "l", "page_size": 4, **kw}
    with pytest.raises(KvtierConfigError, match=match):
        Geometry(**args)


def test_bad_config_names_the_field_the_value_and_what_is_allowed():
    g = Geometry("bfloat16", "l", 4)
    with pytest.raises(
        KvtierConfigError, match=r"config=dict: the test adapter needs a KvtierConfig"
    ):
        stack_of({"store": {"backend": "memory"}}, g)
    with pytest.raises(
        KvtierConfigError, match=r"geometry=tuple: the test adapter needs a Geometry"
    ):
        stack_of(config(False), ("bfloat16", "l", 4))
    none = config(False, {"backend": "none"})
    with pytest.raises(
        KvtierConfigError,
        match=r"store.backend='none': the test adapter needs a store \(file, redis, s3",
    ):
        stack_of(none, g)
    assert (
        stack_of(none, g, store_required=False).store is None
    )  # the linker's host-only tier
    paged = load_config(
        None,
        overrides={
            "store": {"backend": "memory", "page_tokens": 8},
            "pool": {"size": 64, "num_layers": 2, "page_size": 4},
        },
    )
    with pytest.raises(
        KvtierConfigError, match=r"store.page_tokens=8: the test adapter"
    ):
        stack_of(paged, g)


# -- the store: sealed with the tenant's key, built on the adapter's thread -----------------


def test_the_store_is_sealed_with_the_tenant_key_on_its_own_thread(tmp_path):
    section = {"backend": "file", "root": str(tmp_path / "l3")}
    stack = stack_of(
        config(True, section), Geometry("bfloat16", "l", 4), thread="kvtier-test-store"
    )
    try:
        assert (
            stack.loop.thread.name == "kvtier-test-store"
            and stack.loop.thread.is_alive()
        )
        assert stack.breaker is not None and stack.breaker.admit()
        key = stack.key(sglang_hash("0" * 64, stack.keyed))
        page = bytes(range(256)) * 4
        assert stack.loop.run(stack.store.batch_set([key], [page])) == [True]
        assert stack.loop.run(stack.store.batch_get([key])) == [page]
        stack.loop.run(stack.store.close())
    finally:
        stack.close()
    assert not stack.loop.thread.is_alive()
    cfg = config(
        False, section
    ).store  # anyone without the key: its frame does not verify
    plain = build_store(cfg.backend, cfg.options, cfg.timeout_s)
    assert asyncio.run(plain.batch_get([key])) == [None]


def test_a_store_that_cannot_be_built_leaves_no_thread_running(tmp_path):
    (tmp_path / "taken").write_text("a file, not a directory")
    cfg = config(False, {"backend": "file", "root": str(tmp_path / "taken")})
    with pytest.raises(Exception, match="not a directory"):
        stack_of(cfg, Geometry("bfloat16", "l", 4), thread="kvtier-doomed-store")
    assert not [t for t in threading.enumerate() if t.name == "kvtier-doomed-store"]


# -- every adapter uses it ----------------------------------------------------------------

BUILDERS = {
    "Namespace",
    "build_store",
    "tenant_of",
    "seal_with",
    "StoreLoop",
    "Breaker",
}
# The linker's engine-free core is also driven by the fault simulator on a logical clock:
# its store I/O starts the runtime's loop and breaker itself, over the stack's store.
ALLOWED = {"sglang/linker/store_io.py": {"Breaker", "StoreLoop"}}


def _calls(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def test_no_adapter_assembles_a_stack_of_its_own():
    """Only stack.py (and tenant.py, which seals a store with the tenant's key) makes a
    namespace, builds or seals a store, starts a store loop or a breaker (the linker's
    store I/O: its loop and breaker, over the store the stack built)."""
    offenders = {}
    for path in INTEGRATIONS.rglob("*.py"):
        if path.name in ("stack.py", "tenant.py"):
            continue
        where = str(path.relative_to(INTEGRATIONS))
        made = _calls(ast.parse(path.read_text())) & BUILDERS - ALLOWED.get(
            where, set()
        )
        if made:
            offenders[str(path.relative_to(INTEGRATIONS))] = sorted(made)
    assert offenders == {}


ADAPTERS = {
    "sglang/storage.py": "kvtier.integrations.sglang.storage",
    "sglang/linker": "kvtier.integrations.sglang.linker",
    "vllm": "kvtier.integrations.vllm",
}


def test_no_adapter_imports_another():
    seen = {}
    for name, module in ADAPTERS.items():
        root = INTEGRATIONS / name
        for path in [root] if root.is_file() else root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    others = [
                        m
                        for m in ADAPTERS.values()
                        if m != module and node.module.startswith(m)
                    ]
                    if others:
                        seen[str(path.relative_to(INTEGRATIONS))] = node.module
    assert seen == {}
