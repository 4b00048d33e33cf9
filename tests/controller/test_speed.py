"""A store slower than recomputing is skipped: the cache never makes a request slower than
no cache (docs/design.md §8)."""

import asyncio
import re

import pytest

from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.controller.speed import LoadSpeed
from kvtier.engine.engine import Engine, verify
from kvtier.engine.model import ModelConfig, TinyTransformer
from kvtier.engine.workloads import generate


def test_estimate_skip_and_probe():
    now = [0.0]
    s = LoadSpeed(clock=lambda: now[0], probe_s=5.0, alpha=1.0)
    assert s.worth_loading(10, 1, 160)  # nothing measured, no rate: load
    s.observe_call(0.010)
    s.observe_read(10, 0.010 + 10 * 0.002)  # 10 ms round trip, 2 ms a page
    assert s.expected_s(10, 1) == pytest.approx(0.030)
    assert s.worth_loading(10, 1, 160)  # no prefill rate reported: never skip
    s.set_prefill_rate(
        160 / 0.020
    )  # the 160 tokens take 20 ms to compute: loading (30 ms) is slower
    assert s.worth_loading(
        10, 1, 160
    )  # ... but the first such prefetch probes the store
    assert (
        not s.worth_loading(10, 1, 160) and s.skipped == 1 and s.skipped_tokens == 160
    )
    assert s.worth_loading(1, 1, 160)  # one page: 12 ms < 20 ms
    now[0] = 5.0
    assert s.worth_loading(10, 1, 160) and s.probes == 2  # one probe per interval
    s.report_prefill(160, 0.100)  # measured: the model is slower than that
    assert s.prefill_tokens_per_s == pytest.approx(1600)
    assert s.worth_loading(10, 1, 160)
    assert s.stats()["prefetch_skipped_slow"] == 1
    with pytest.raises(ValueError, match="tokens_per_s=0"):
        s.set_prefill_rate(0)


@pytest.mark.parametrize(
    "tokens, seconds, field",
    [
        (-160, 0.1, "tokens=-160"),
        (160.0, 0.1, "tokens=160.0"),
        (True, 0.1, "tokens=True"),
        (160, -0.1, "seconds=-0.1"),
        (160, float("inf"), "seconds=inf"),
        (160, float("nan"), "seconds=nan"),
        (160, "0.1", "seconds='0.1'"),
        (160, 5e-324, "seconds=5e-324"),
    ],
)
def test_bad_prefill_report_refused_and_rate_kept(tokens, seconds, field):
    """A report the engine got wrong is refused, naming it, and the rate stays what it was:
    `seconds=inf` averaged in a rate of 0, and the storage thread's next estimate divided
    by it; NaN or a negative count was dropped without a word."""
    s = LoadSpeed(alpha=0.5)
    s.report_prefill(160, 0.1)
    with pytest.raises(ValueError, match=f"report_prefill: .*{re.escape(field)}"):
        s.report_prefill(tokens, seconds)
    assert s.prefill_tokens_per_s == pytest.approx(1600)
    s.report_prefill(0, 0.1)  # computed nothing: nothing to learn, not an error
    s.report_prefill(160, 0)  # too short for the clock: the same
    assert s.prefill_tokens_per_s == pytest.approx(1600)


def test_bad_prefill_report_refused_without_a_store():
    from kvtier.cache import TieredCache
    from kvtier.config import load_config

    cache = TieredCache(
        load_config(
            None,
            {
                "store": {"backend": "none"},
                "pool": {
                    "size": 256,
                    "num_layers": 1,
                    "page_size": 16,
                    "num_kv_heads": 1,
                    "head_dim": 8,
                },
            },
            env={},
        )
    )
    try:
        with pytest.raises(ValueError, match="seconds=inf"):
            cache.report_prefill(160, float("inf"))
        cache.report_prefill(160, 0.1)
    finally:
        cache.close()


class SlowStore(MemoryStore):
    """A memory store that answers after `delay` seconds (a loaded or distant store)."""

    delay = 0.0

    async def _exists(self, keys):
        await asyncio.sleep(self.delay)
        return await super()._exists(keys)

    async def _get(self, keys):
        await asyncio.sleep(self.delay)
        return await super()._get(keys)


def _replay(store, model, prefill_rate):
    from kvtier.cache import TieredCache
    from kvtier.cli.replay import with_weights
    from kvtier.config import load_config

    cfg = load_config(
        None,
        {
            "pool": {
                "size": 1024,
                "num_layers": 4,
                "page_size": 16,
                "num_kv_heads": 2,
                "head_dim": 32,
                "dtype": "float32",
            },
            "mirror": {"ratio": 1.0},
            "controller": {
                "prefetch_policy": "wait_complete",
                "store_probe_backoff_s": 3600.0,
            },
        },
        env={},
    )
    cache = TieredCache(with_weights(cfg, model), store=store)
    cache.set_prefill_rate(prefill_rate)
    results = Engine(cache, model).run(
        generate("multiturn", 16, model.config.vocab, 0), keep_logits=True
    )
    stats = cache.stats()
    cache.drain()
    cache.check_accounting()
    cache.tree.sanity_check()
    cache.close()
    return results, stats


def test_a_store_slower_than_prefill_is_skipped_and_results_stay_exact():
    model = TinyTransformer(ModelConfig())
    store = SlowStore(MemoryStoreConfig(capacity_bytes=1 << 30))
    _, warm = _replay(store, model, None)  # a first server fills the store
    assert warm["counters"]["l3_write_pages"] > 0

    # a second server: the store now answers in 50 ms, and the model prefills 10^9 tokens/s
    store.delay = 0.05
    results, stats = _replay(store, model, 1e9)
    assert [r.error for r in results if r.error] == []
    for r in results:
        verify(model, r)
    c, st = stats["counters"], stats["store"]
    assert (
        c["prefetch_skipped_slow"] > 0
        and st["prefetch_skipped_slow"] == c["prefetch_skipped_slow"]
    )
    assert (
        st["prefetch_skipped_slow_tokens"] > 0
    )  # tokens the store held, recomputed instead
    assert st["store_call_ms"] >= 40 and st["prefill_tokens_per_s"] == 1e9

    # the same, with no prefill rate: nothing is skipped, the store is read
    results, stats = _replay(store, model, None)
    assert [r.error for r in results if r.error] == []
    assert (
        stats["counters"]["prefetch_skipped_slow"] == 0
        and stats["counters"]["l3_read_pages"] > 0
    )
