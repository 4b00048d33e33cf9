"""The central promise: the KV we hand back is the KV that was computed. Every request's
greedy tokens and logits equal an uncached run, whichever tier its prefix came from."""

import json

import pytest

from kvtier.cache import TieredCache
from kvtier.config import load_config
from kvtier.engine.engine import Engine, verify
from kvtier.engine.model import TinyTransformer
from kvtier.engine.workloads import generate, load_trace

GEOMETRY = {
    "num_layers": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "dtype": "float32",
    "page_size": 16,
}


def small_cache(store: dict, pool: int = 1536) -> TieredCache:
    # A mirror the size of the pool holds little besides copies of device pages: whether any
    # prefix is served from it then depends on when the store's writes finish (a slow store
    # once left none). 1.5x keeps host-only prefixes around at any store speed.
    return TieredCache(
        load_config(
            None,
            {
                "pool": {"size": pool, **GEOMETRY},
                "mirror": {"ratio": 1.5},
                "controller": {"prefetch_policy": "wait_complete"},
                "store": store,
            },
            env={},
        )
    )


def store_section(name, tmp_path, request):
    if name == "memory":
        return {"backend": "memory"}
    if name == "file":
        return {"backend": "file", "root": str(tmp_path / "l3")}
    if name == "redis":
        return {"backend": "redis", "url": request.getfixturevalue("redis_server").url}
    s3 = request.getfixturevalue("s3_server")
    return {
        "backend": "s3",
        "endpoint_url": s3.url,
        "bucket": f"oracle-{tmp_path.name[-12:].lower()}",
        "create_bucket": True,
        "access_key_id": "t",
        "secret_access_key": "t",
    }


@pytest.mark.parametrize("store", ["memory", "file", "redis", "s3"])
def test_outputs_equal_uncached_run_from_every_tier(store, tmp_path, request):
    model = TinyTransformer()
    cache = small_cache(store_section(store, tmp_path, request))
    engine = Engine(cache, model, max_batch=3, chunk_size=128)
    turns = generate("multiturn", 24, model.config.vocab, seed=1)
    results = engine.run(turns, keep_logits=True)
    for r in results:
        assert verify(model, r) <= 1e-5
    assert sum(r.device_hit for r in results) > 0
    assert sum(r.host_hit for r in results) > 0, "no prefix came from the mirror"
    assert sum(r.storage_hit for r in results) > 0, "no prefix came from the store"
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()
    cache.check_accounting()


def test_verify_catches_wrong_kv():
    """The oracle is not vacuous: corrupt one cached page and verification fails."""
    model = TinyTransformer()
    cache = small_cache({"backend": "memory"}, pool=4096)
    engine = Engine(cache, model)
    turns = generate(
        "docqa", 4, model.config.vocab, seed=2
    )  # turns 0 and 3 share a document
    engine.run(turns[:1])
    m = cache.match_prefix(list(turns[3].prompt))
    cache.pool.k_buffer(0)[m.device_indices[:16]] += 1.0  # wrong bytes in a cached page
    [r] = engine.run(turns[3:], keep_logits=True)
    assert r.device_hit > 0
    with pytest.raises(AssertionError, match="differ"):
        verify(model, r)
    cache.close()


def test_trace_round_trip_and_bad_traces(tmp_path):
    turns = generate("agent", 5, 512, seed=3)
    path = tmp_path / "t.jsonl"
    lines = [
        {
            "session": t.session,
            "turn": t.turn,
            "prompt": list(t.prompt),
            "output_len": t.output_len,
        }
        for t in turns
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert load_trace(path, 512) == turns
    bad = tmp_path / "bad.jsonl"
    for line, message in [
        ('{"prompt": [1, 999]}', "token ids in \\[0, 512\\)"),
        ('{"prompt": [1], "output_len": 0}', "output_len=0"),
        ('{"prompt": [1], "extra": 1}', "unknown field 'extra'"),
        ("not json", "not JSON"),
    ]:
        bad.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            load_trace(bad, 512)


def test_pool_geometry_mismatch_is_refused():
    cache = TieredCache(
        load_config(
            None,
            {"pool": {"size": 256, "num_layers": 2}, "store": {"backend": "none"}},
            env={},
        )
    )
    with pytest.raises(ValueError, match="does not fit the reference model"):
        Engine(cache, TinyTransformer())
    cache.close()
