"""Deterministic synthetic multi-turn traces (shared system prompts, growing conversations,
shared first messages that force mid-edge splits)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class Turn:
    session: int
    turn: int
    prompt: (
        np.ndarray
    )  # int64 token ids: the whole conversation so far plus the new message
    output: np.ndarray  # tokens the model "generates" for this turn


def multiturn(
    sessions: int = 200,
    turns: int = 6,
    system_prompts: int = 8,
    system_len: int = 1024,
    shared_first: int = 16,
    msg_len: tuple[int, int] = (40, 300),
    vocab: int = 32000,
    seed: int = 0,
) -> list[Turn]:
    """Requests in arrival order: sessions interleave, each turn extends its session's history."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, system_len) for _ in range(system_prompts)]
    firsts = [
        rng.integers(0, vocab, int(rng.integers(*msg_len))) for _ in range(shared_first)
    ]
    histories, out = [], []
    for _ in range(sessions):
        first = (
            firsts[int(rng.integers(shared_first))]
            if rng.random() < 0.5
            else rng.integers(0, vocab, int(rng.integers(*msg_len)))
        )
        # a shared first message sometimes diverges half-way: a split inside an edge
        if rng.random() < 0.3:
            first = np.concatenate(
                [
                    first[: len(first) // 2],
                    rng.integers(0, vocab, len(first) - len(first) // 2),
                ]
            )
        histories.append([systems[int(rng.integers(system_prompts))], first])
    order = [(s, t) for t in range(turns) for s in range(sessions)]
    for s, t in order:
        if t > 0:
            histories[s].append(rng.integers(0, vocab, int(rng.integers(*msg_len))))
        prompt = np.concatenate(histories[s]).astype(np.int64)
        output = rng.integers(0, vocab, int(rng.integers(*msg_len))).astype(np.int64)
        histories[s].append(output)
        out.append(Turn(s, t, prompt, output))
    return out
