"""A store that hangs (accepts connections, never answers) is marked down after a few
timeouts: requests stop paying a timeout each, probes retry it with backoff, results stay
exact (docs/design.md, FAILURES: Dynamo #6032)."""

import pytest

from kvtier.bench.servers import BlackHole
from kvtier.storeio.breaker import Breaker, BreakerConfig
from kvtier.engine.engine import Engine, verify
from kvtier.engine.model import ModelConfig, TinyTransformer
from kvtier.engine.workloads import generate


def test_breaker_opens_probes_with_backoff_and_closes():
    now = [0.0]
    b = Breaker(
        "s",
        BreakerConfig(failures=2, backoff_s=1.0, max_backoff_s=4.0),
        clock=lambda: now[0],
    )
    b.failed("t")
    assert b.admit() and not b.down
    b.failed("t")
    assert b.down and not b.admit() and b.skipped == 1
    now[0] = 1.0
    assert b.admit() and not b.admit()  # one probe at a time
    b.failed("t")  # the probe failed: back off 2 s
    now[0] = 2.5
    assert not b.admit()
    now[0] = 3.0
    assert b.admit()
    b.succeeded()
    assert not b.down and b.admit() and b.stats()["breaker_trips"] == 1


@pytest.fixture
def black_hole():
    hole = BlackHole()
    yield hole
    hole.stop()


def test_a_hung_redis_costs_a_few_timeouts_not_one_per_request(black_hole, tmp_path):
    from kvtier.cache import TieredCache
    from kvtier.cli.replay import with_weights
    from kvtier.config import load_config

    model = TinyTransformer(ModelConfig())
    cfg = load_config(
        None,
        {
            "pool": {
                "size": 2048,
                "num_layers": 4,
                "page_size": 16,
                "num_kv_heads": 2,
                "head_dim": 32,
                "dtype": "float32",
            },
            "controller": {
                "prefetch_policy": "wait_complete",
                "store_probe_backoff_s": 30.0,
            },
            "store": {
                "backend": "redis",
                "url": f"redis://127.0.0.1:{black_hole.port}/0",
                "timeout_s": 0.3,
            },
        },
        env={},
    )
    cache = TieredCache(with_weights(cfg, model))
    results = Engine(cache, model).run(
        generate("multiturn", 24, model.config.vocab, 0), keep_logits=True
    )
    stats = cache.stats()
    cache.close()
    assert [r.error for r in results if r.error] == []
    for r in results:
        verify(model, r)
    st = stats["store"]
    assert (
        st["store_down"]
        and st["breaker_trips"] == 1
        and st["calls_skipped_store_down"] > 10
    )
    assert (
        st["timeouts"] <= 3 + 4
    )  # the trip (3 in a row), plus calls already in flight then
    assert stats["counters"]["prefetch_skipped_store_down"] > 0
