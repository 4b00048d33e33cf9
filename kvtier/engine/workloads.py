"""Deterministic workloads and the JSONL trace format.

A turn is `{"session": str, "turn": int, "prompt": [token ids], "output_len": int}`, one JSON
object per line. `prompt` holds the *new* tokens of the turn: the engine prepends the
session's history (its earlier prompts and the outputs it generated for them), as a chat
server does. Turns are replayed in file order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WORKLOADS = ("multiturn", "docqa", "agent")


@dataclass(slots=True, frozen=True)
class Turn:
    session: str
    turn: int
    prompt: tuple[int, ...]
    output_len: int


def generate(name: str, requests: int, vocab: int = 512, seed: int = 0) -> list[Turn]:
    """`requests` turns of a built-in workload."""
    makers = {"multiturn": _multiturn, "docqa": _docqa, "agent": _agent}
    if name not in makers:
        raise ValueError(
            f"workload={name!r}: allowed values are {', '.join(WORKLOADS)}"
        )
    if requests < 1:
        raise ValueError(f"requests={requests}: must be >= 1")
    return makers[name](requests, np.random.default_rng(seed), vocab)


def _tokens(rng, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, vocab, n))


def _multiturn(n: int, rng, vocab: int) -> list[Turn]:
    """Chat: sessions share a few system prompts and grow turn by turn (sessions interleave)."""
    systems = [_tokens(rng, vocab, 256) for _ in range(3)]
    sessions = max(2, n // 3)
    out: list[Turn] = []
    turn = 0
    while len(out) < n:
        for s in range(sessions):
            if len(out) == n:
                break
            msg = _tokens(rng, vocab, int(rng.integers(48, 200)))
            prompt = (systems[s % len(systems)] + msg) if turn == 0 else msg
            out.append(Turn(f"chat-{s}", turn, prompt, int(rng.integers(8, 24))))
        turn += 1
    return out


def _docqa(n: int, rng, vocab: int) -> list[Turn]:
    """Long-document QA: a few long documents, many independent questions about each."""
    docs = [_tokens(rng, vocab, 1024) for _ in range(3)]
    return [
        Turn(
            f"qa-{i}",
            0,
            docs[i % len(docs)] + _tokens(rng, vocab, int(rng.integers(16, 64))),
            int(rng.integers(4, 16)),
        )
        for i in range(n)
    ]


def _agent(n: int, rng, vocab: int) -> list[Turn]:
    """Agent loops with tool calls: a shared tool-description prefix, then observation and
    action steps. After every `AGENT_STEPS` steps each agent calls a tool and idles (a
    pause: `pauses`) while one-shot requests of 640-896 new tokens churn device and host
    (`AGENT_CHURN` of them, more than the default config's mirror holds), then resumes
    with the tool's result."""
    tools = _tokens(rng, vocab, 384)
    out: list[Turn] = []
    step = churn = 0
    while len(out) < n:
        for _ in range(AGENT_STEPS):
            for a in range(AGENTS):
                obs = _tokens(rng, vocab, int(rng.integers(32, 96)))
                prompt = tools + obs if step == 0 else obs
                out.append(Turn(f"agent-{a}", step, prompt, int(rng.integers(8, 24))))
            step += 1
        for _ in range(AGENT_CHURN):
            prompt = _tokens(rng, vocab, int(rng.integers(640, 896)))
            out.append(Turn(f"churn-{churn}", 0, prompt, int(rng.integers(4, 8))))
            churn += 1
    return out[:n]


AGENTS, AGENT_STEPS, AGENT_CHURN = 2, 2, 8
PAUSE_TURNS = 4  # other sessions' turns between two of a session's: a tool-call pause


def pauses(turns: list[Turn]) -> dict[int, int]:
    """Tool-call pauses of a trace: {index of the turn a session pauses after: index of
    the turn it resumes with}, where at least `PAUSE_TURNS` turns of other sessions come
    between the two (any trace: sessions idle while others run)."""
    last: dict[str, int] = {}
    out: dict[int, int] = {}
    for i, t in enumerate(turns):
        j = last.get(t.session)
        if j is not None and i - j - 1 >= PAUSE_TURNS:
            out[j] = i
        last[t.session] = i
    return out


def load_trace(path: str | Path, vocab: int) -> list[Turn]:
    """Read a JSONL trace; every line is checked (field, value, what is allowed)."""
    turns = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 text: a trace is JSONL, one turn per line "
                    "(a gzipped trace: gunzip it first)"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from None
            turns.append(_turn(obj, f"{path}:{lineno}", vocab))
    if not turns:
        raise ValueError(f"{path}: no turns")
    return turns


def _turn(obj: object, where: str, vocab: int) -> Turn:
    if not isinstance(obj, dict):
        raise ValueError(
            f"{where}: expected an object with session, turn, prompt, output_len"
        )
    unknown = set(obj) - {"session", "turn", "prompt", "output_len"}
    if unknown:
        raise ValueError(
            f"{where}: unknown field {sorted(unknown)[0]!r}; allowed: session, turn, prompt, output_len"
        )
    prompt = obj.get("prompt")
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(_is_int(t) and 0 <= t < vocab for t in prompt)
    ):
        raise ValueError(
            f"{where}: prompt must be a non-empty list of token ids in [0, {vocab}) "
            "(JSON true/false are not token ids)"
        )
    out_len = obj.get("output_len", 16)
    if not _is_int(out_len) or out_len < 1:
        raise ValueError(f"{where}: output_len={out_len!r}: must be an integer >= 1")
    turn = obj.get("turn", 0)
    if not _is_int(turn) or turn < 0:
        raise ValueError(f"{where}: turn={turn!r}: must be an integer >= 0")
    return Turn(str(obj.get("session", where)), turn, tuple(prompt), out_len)


def _is_int(value) -> bool:
    """A JSON integer: `true` is a bool, which Python counts as an int."""
    return isinstance(value, int) and not isinstance(value, bool)
