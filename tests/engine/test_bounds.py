"""The hybrid hit-rate bound counts only lengths where a state was taken."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.engine.bounds import (
    chunk_state_points,
    finish_state_points,
    restorable_hit_rate,
)
from kvtier.engine.engine import Result, infinite_hit_rate


def seq(*parts: range) -> list[int]:
    return [t for p in parts for t in p]


def test_only_lengths_with_a_state_are_restorable():
    """A feeds 17 tokens (states at 8, a chunk end, and at 16, its end floored to a page);
    B shares A's first 14 tokens: full attention restores 12 of them (3 pages), a hybrid
    model only 8 (no state at 12)."""
    a_prompt, a_out = seq(range(10)), seq(range(100, 108))  # fed: 10 + 7 = 17 tokens
    b_prompt = seq(range(10), range(100, 104), range(200, 206))  # 14 shared, 20 in all
    fed_a = a_prompt + a_out[:-1]
    pairs = [(a_prompt, fed_a), (b_prompt, b_prompt)]
    got = restorable_hit_rate(pairs, 4, chunk_state_points(8))
    assert got == pytest.approx(8 / (10 + 20))
    full = infinite_hit_rate(
        [Result("a", 0, a_prompt, a_out), Result("b", 0, b_prompt, [1])], 4
    )
    assert full == pytest.approx(12 / 30)
    # states at every page boundary: the hybrid bound is the full-attention one
    every_page = restorable_hit_rate(pairs, 4, lambda prompt, fed: range(4, fed + 1, 4))
    assert every_page == pytest.approx(full)


def test_a_state_past_the_prompt_is_never_a_hit():
    """A hit leaves at least the prompt's last token to compute (its logits start the
    output): a state at exactly len(prompt) does not count."""
    prompt = seq(range(8))
    pairs = [(prompt, prompt), (prompt, prompt)]
    assert restorable_hit_rate(pairs, 4, lambda p, f: [8]) == 0.0
    assert restorable_hit_rate(pairs, 4, lambda p, f: [4, 8]) == pytest.approx(4 / 16)


def test_the_bound_never_exceeds_the_full_attention_bound():
    rng = np.random.default_rng(0)
    results, pairs = [], []
    base = rng.integers(0, 50, 40).tolist()
    for i in range(30):
        prompt = base[: rng.integers(5, 40)] + rng.integers(0, 50, 5).tolist()
        out = rng.integers(0, 50, 4).tolist()
        results.append(Result(str(i), 0, prompt, out))
        pairs.append((prompt, prompt + out[:-1]))
    hybrid = restorable_hit_rate(pairs, 4, chunk_state_points(16))
    assert 0 < hybrid <= infinite_hit_rate(results, 4)


def test_states_only_where_requests_finish():
    """Page 4, states only at the end of what each request fed. A feeds 15 tokens: a
    state at 12. B (20 tokens, fed 20: a state at 20) shares A's first 14: it hits 12 (none
    at 16). C shares only 9 tokens with A and B: no state at or below 9, 0. B again: its
    key is 19 tokens, below its own state at 20, so 12 again."""
    a = seq(range(10))
    fed_a = a + seq(range(100, 105))  # 15 tokens: state at 12
    b = fed_a[:14] + seq(range(200, 206))  # 20 tokens, fed 20: state at 20
    c = fed_a[:9] + seq(range(300, 311))
    pairs = [(a, fed_a), (b, b), (c, c), (b, b)]
    got = restorable_hit_rate(pairs, 4, finish_state_points)
    assert got == pytest.approx((0 + 12 + 0 + 12) / (10 + 20 + 20 + 20))
    # an engine that also takes states at chunk ends of 8 restores C's first 8
    chunked = restorable_hit_rate(pairs, 4, chunk_state_points(8))
    assert chunked == pytest.approx((0 + 12 + 8 + 16) / 70)
