"""`tierctl replay --model hybrid --verify`: the hybrid reference model over the hybrid
cache gives the tokens and logits of an uncached run, from a fresh cache and again from
the store a first run left; the summary counts hits per tier and per component against
the hybrid bound."""

from __future__ import annotations

import json

import pytest
import torch

from kvtier.cli.main import main


def trace(tmp_path) -> str:
    """Three sessions over a shared 24-token prefix (page 4, window 6). States are taken
    where requests finish: c0 at 40, a0 at 32 (its prompt: one output, nothing more fed),
    b0 at 36, a1 at 44, b1 at 44. One request a forward: the bound's order is the run's."""
    shared = list(range(1, 25))
    a0 = shared + list(range(100, 108))  # 32 tokens
    turns = [
        ("c", 0, a0 + list(range(500, 508)), 3),  # first: a miss
        ("a", 0, a0, 1),  # c's state (40) is past its key: a miss
        ("b", 0, shared + list(range(200, 210)), 3),  # diverges at 24: a miss
        ("a", 1, list(range(300, 308)), 4),  # history (33) + 8: a0's state, 32
        ("b", 1, list(range(400, 405)), 3),  # history (37) + 5: b0's state, 36
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps({"session": s, "turn": t, "prompt": p, "output_len": n}) + "\n"
            for s, t, p, n in turns
        )
    )
    return str(path)


def config(tmp_path, pool: int = 256) -> str:
    path = tmp_path / "hybrid.yaml"
    path.write_text(
        "model:\n  kind: hybrid\n  window: 6\n"
        f"pool:\n  size: {pool}\n  page_size: 4\n"
        f"store:\n  backend: file\n  root: {tmp_path / 'store'}\n"
    )
    return str(path)


def replay(tmp_path, capsys, *extra: str, pool: int = 256) -> tuple[int, dict]:
    rc = main(
        ["replay", "--config", config(tmp_path, pool), "--trace", trace(tmp_path)]
        + ["--verify", "--json", "--batch", "1", *extra]
    )
    return rc, json.loads(capsys.readouterr().out)


def test_replay_hybrid_verifies_from_a_fresh_cache_and_from_the_warm_store(
    tmp_path, capsys
):
    rc, s = replay(tmp_path, capsys)
    assert rc == 0, s
    assert s["verify_failures"] == [] and s["verified_requests"] == 5
    assert s["failed_requests"] == 0 and s["counts_add_up"]
    hy = s["hybrid"]
    assert s["hit_tokens"]["device"] + s["hit_tokens"]["host"] == 68
    assert hy["mamba_states"] == 2 and hy["requests_with_hit"] == 2
    assert hy["swa_window_tokens"]["device"] + hy["swa_window_tokens"]["loaded"] == 16
    assert hy["restorable_bound"] == pytest.approx(68 / s["prompt_tokens"])
    assert hy["hit_rate_over_bound"] >= 0.95
    # the same trace on a new cache over the store the first run left
    rc, warm = replay(tmp_path, capsys)
    assert rc == 0, warm
    assert warm["verify_failures"] == [] and warm["verified_requests"] == 5
    assert warm["failed_requests"] == 0 and warm["counts_add_up"]


def test_replay_hybrid_verifies_what_it_loads_back_from_host(tmp_path, capsys):
    """A device pool of 64 tokens: each request evicts the one before it to host, and b1
    restores b0's prefix (its FULL KV, window and state) from there."""
    rc, s = replay(tmp_path, capsys, pool=64)
    assert rc == 0, s
    assert s["verify_failures"] == [] and s["verified_requests"] == 5
    assert s["hit_tokens"]["host"] >= 32
    assert s["hybrid"]["swa_window_tokens"]["loaded"] >= 8
    # the cache's own count: the window (in part: the rest may still be on device) and
    # the state came back from host
    assert s["hybrid"]["side_hits"]["swa"]["host"] > 0
    assert s["hybrid"]["hit_rate_over_bound"] >= 0.95
    assert s["hybrid"]["side_hits"]["mamba"]["host"] >= 1


def test_the_table_shows_each_component_and_the_hybrid_bound(tmp_path, capsys):
    rc = main(
        ["replay", "--config", config(tmp_path), "--trace", trace(tmp_path)]
        + ["--model", "hybrid", "--verify", "--batch", "1"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    for line in ("components   full", "swa ", "mamba ", "hybrid bound", "verified"):
        assert line in out, out
    assert "VERIFY FAILED" not in out


def test_hints_with_the_hybrid_model_are_refused_by_name(tmp_path, capsys):
    rc = main(["replay", "--config", config(tmp_path), "--hints", "--requests", "2"])
    assert rc == 2
    assert "--hints with the hybrid model" in capsys.readouterr().err


def test_a_turn_whose_prefix_is_on_host_waits_for_device_room_to_load_it():
    """The batch holds the device: a turn whose restorable prefix (its FULL KV, window and
    state) is on host waits until a request ends, then loads it; started at once, its load
    found no room and it recomputed everything (the replay at 0.60x of its bound)."""
    from kvtier.cli.replay import with_weights
    from kvtier.config import load_config
    from kvtier.engine.hybrid import HybridConfig, HybridModel
    from kvtier.engine.hybrid_engine import HybridEngine, hybrid_cache
    from kvtier.engine.sessions import Histories
    from kvtier.engine.workloads import Turn

    model = HybridModel(HybridConfig(seed=3, window=6))
    overrides = {
        "pool": {"size": 64, "page_size": 4, "num_layers": 1},
        "store": {"backend": "none"},
    }
    config = with_weights(load_config(None, overrides, env={}), model)
    cache = hybrid_cache(config, model)
    histories = Histories()
    (a0,) = HybridEngine(cache, model, max_batch=2, histories=histories).run(
        [Turn("a", 0, tuple(range(1, 25)), 1)]  # its state at 24, written to host
    )
    assert a0.error is None
    cache.drain()
    cache.evict(1000)
    assert cache.match_prefix(list(range(1, 25)), count=False).host_hit_length == 24
    results = HybridEngine(cache, model, max_batch=2, histories=histories).run(
        [
            Turn("x", 0, tuple(range(100, 144)), 8),  # 44 of the 64 slots, then more
            Turn("y", 0, tuple(range(300, 304)), 1),  # ends first: a1 is admitted
            Turn("a", 1, tuple(range(200, 204)), 1),
        ]
    )
    assert [r.error for r in results] == [None] * 3
    (a1,) = [r for r in results if r.session == "a"]
    assert (a1.cached, a1.host_hit, a1.state_hit) == (24, 24, 1)
    # what it computed over the loaded prefix is the uncached run's token
    dense = model.forward_dense(torch.tensor(a1.prompt))
    assert a1.output == [int(dense[-1].argmax())]
    cache.drain()
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()


def test_a_turn_whose_store_prefetch_lands_while_the_batch_holds_the_device_waits_to_load_it(
    tmp_path,
):
    """A store prefetch brings a turn's restorable prefix (FULL pages, window, state) to
    host while the batch holds the device: the turn waits for room (the request that holds
    it ends), then loads it. Started as soon as its prefetch landed, its load found no
    room and it recomputed everything (the default replay at 0.77-0.86x of its bound,
    every miss one of these)."""
    from kvtier.cli.replay import with_weights
    from kvtier.config import load_config
    from kvtier.engine.hybrid import HybridConfig, HybridModel
    from kvtier.engine.hybrid_engine import HybridEngine, hybrid_cache
    from kvtier.engine.sessions import Histories
    from kvtier.engine.workloads import Turn

    model = HybridModel(HybridConfig(seed=3, window=6))
    overrides = {
        "pool": {"size": 64, "page_size": 4, "num_layers": 1},
        "store": {"backend": "file", "root": str(tmp_path / "store")},
        # x's 32 matchable tokens start no prefetch, a1's 40 do
        "controller": {"prefetch_min_tokens": 36},
    }
    config = with_weights(load_config(None, overrides, env={}), model)
    cache = hybrid_cache(config, model)
    histories = Histories()
    (a0,) = HybridEngine(cache, model, max_batch=2, histories=histories).run(
        [
            Turn("a", 0, tuple(range(1, 41)), 1)
        ]  # its state at 40, backed up to the store
    )
    assert a0.error is None
    cache.drain()
    cache.flush()  # the store alone holds it now
    a1_prompt = a0.prompt + a0.output + [200, 201, 202]
    assert cache.match_prefix(a1_prompt[:-1], count=False).host_hit_length == 0
    engine = HybridEngine(cache, model, max_batch=2, histories=histories)
    engine.submit(
        Turn("x", 0, tuple(range(100, 136)), 20)
    )  # 36 of the 64 slots, then more
    engine.submit(Turn("a", 1, (200, 201, 202), 1))
    done = engine.step()  # x runs; a1 waits aside for its store prefetch
    cache.controller.storage.drain(
        30.0
    )  # which lands while x still has 19 tokens to go
    while engine.pending():
        done += engine.step()
    assert [r.error for r in done] == [None, None]
    (a1,) = [r for r in done if r.session == "a"]
    assert a1.prompt == a1_prompt
    assert (a1.cached, a1.storage_hit, a1.state_hit) == (40, 40, 1)
    # what it computed over the loaded prefix is the uncached run's token
    dense = model.forward_dense(torch.tensor(a1.prompt))
    assert a1.output == [int(dense[-1].argmax())]
    cache.drain()
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()


def test_what_a_store_prefetch_brought_stays_on_host_while_its_turn_waits_for_device_room(
    tmp_path,
):
    """A host mirror of 64 tokens: a1's store prefetch lands 40 tokens on host (FULL pages,
    window, state) while x holds the device; x ends and its write needs host room. What the
    prefetch brought stays protected until a1 acquires it: x's write evicted it before,
    and a1 recomputed everything (the default replay with mirror ratio 1.0 at 0.80x of its
    bound, 8 such misses)."""
    from kvtier.cli.replay import with_weights
    from kvtier.config import load_config
    from kvtier.engine.hybrid import HybridConfig, HybridModel
    from kvtier.engine.hybrid_engine import HybridEngine, hybrid_cache
    from kvtier.engine.sessions import Histories
    from kvtier.engine.workloads import Turn

    model = HybridModel(HybridConfig(seed=3, window=6))
    overrides = {
        "pool": {"size": 64, "page_size": 4, "num_layers": 1},
        "mirror": {"ratio": 1.0},
        "store": {"backend": "file", "root": str(tmp_path / "store")},
        "controller": {"prefetch_min_tokens": 36},
    }
    config = with_weights(load_config(None, overrides, env={}), model)
    cache = hybrid_cache(config, model)
    histories = Histories()
    (a0,) = HybridEngine(cache, model, max_batch=2, histories=histories).run(
        [Turn("a", 0, tuple(range(1, 41)), 1)]
    )
    assert a0.error is None
    cache.drain()
    cache.flush()
    engine = HybridEngine(cache, model, max_batch=2, histories=histories)
    engine.submit(Turn("x", 0, tuple(range(100, 136)), 20))
    engine.submit(Turn("a", 1, (200, 201, 202), 1))
    done = engine.step()
    cache.controller.storage.drain(30.0)  # a1's prefix lands on host; x has 19 to go
    while engine.pending():
        done += engine.step()
    assert [r.error for r in done] == [None, None]
    (a1,) = [r for r in done if r.session == "a"]
    assert (a1.cached, a1.storage_hit, a1.state_hit) == (40, 40, 1)
    dense = model.forward_dense(torch.tensor(a1.prompt))
    assert a1.output == [int(dense[-1].argmax())]
    cache.drain()
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()
