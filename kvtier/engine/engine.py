"""A scheduler loop that embeds TieredCache exactly as DESIGN §8 describes.

Per request: match -> lock -> prefetch from the store -> load back from host -> allocate
(evicting on demand) -> forward (waiting per layer) in prefill chunks and decode steps ->
insert -> unlock; `poll()` after every step. Several requests share each forward.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.cache import TieredCache
from kvtier.engine.model import Chunk, TinyTransformer
from kvtier.engine.workloads import Turn
from kvtier.tiers.req_to_token import ReqToTokenPool
from kvtier.tree import RadixKey, RadixTree


@dataclass
class Result:
    session: str
    turn: int
    prompt: list[int]
    output: list[int]
    device_hit: int
    host_hit: int
    storage_hit: int
    cached: int  # prompt tokens whose KV came from the cache
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def computed(self) -> int:
        return len(self.prompt) - self.cached


@dataclass
class _Active:
    rid: str
    turn: Turn
    prompt: list[int]
    row: int
    node: object
    cached: int
    pos: int  # tokens whose K/V are in the pool
    result: Result
    last_slot: int = -1
    fed: list[int] = field(default_factory=list)  # tokens fed so far (prompt, then outputs)


class Engine:
    def __init__(self, cache: TieredCache, model: TinyTransformer, max_batch: int = 4, chunk_size: int = 256,
                 max_context: int = 16384) -> None:
        model.check_pool(cache.pool)
        self.cache = cache
        self.model = model
        self.max_batch = max_batch
        self.chunk_size = chunk_size
        self.rows = ReqToTokenPool(max_batch, max_context)
        self.histories: dict[str, list[int]] = {}
        self.page_size = cache.page_size
        self._next_id = 0

    def run(self, turns: list[Turn], keep_logits: bool = False, progress=None) -> list[Result]:
        """Serve `turns` in order (a session's next turn waits for its previous one)."""
        waiting, active, done = deque(turns), [], []
        while waiting or active:
            while waiting and len(active) < self.max_batch and self._can_admit(waiting[0], active):
                active.append(self._admit(waiting.popleft()))
            self._step(active, keep_logits)
            for a in [a for a in active if len(a.result.output) == a.turn.output_len]:
                active.remove(a)
                done.append(self._finish(a))
                if progress:
                    progress(len(done), len(turns))
            self.cache.poll()
        return done

    # -- admission ----------------------------------------------------------------------------

    def _can_admit(self, turn: Turn, active: list[_Active]) -> bool:
        """Same session waits for its previous turn; a new request must fit what the pool can
        free (a lone request is always tried: it fails loudly if the pool is too small)."""
        if turn.session in {a.turn.session for a in active}:
            return False
        if not active:
            return True
        need = len(self.histories.get(turn.session, [])) + len(turn.prompt) + turn.output_len
        reserved = sum(len(a.prompt) + a.turn.output_len - a.pos for a in active)  # still to allocate
        room = self.cache.controller.device_alloc.available_size() + self.cache.tree.evictable_size()
        return need + reserved + self.page_size * (len(active) + 1) <= room

    def _admit(self, turn: Turn) -> _Active:
        prompt = self.histories.get(turn.session, []) + list(turn.prompt)
        rid = f"req-{self._next_id}"
        self._next_id += 1
        # all but the last prompt token: its logits start the output, so it is computed
        got = self.cache.acquire(np.asarray(prompt[:-1], dtype=np.int64), rid)
        cached = got.indices.numel()
        row = int(self.rows.alloc(1)[0])
        self.rows.write(row, 0, got.indices)
        result = Result(turn.session, turn.turn, prompt, [], got.device_hit, got.host_hit, got.storage_hit, cached)
        last = int(got.indices[-1]) if cached else -1
        return _Active(rid, turn, prompt, row, got.node, cached, cached, result, last, list(prompt[:cached]))

    # -- forward steps ------------------------------------------------------------------------

    def _step(self, active: list[_Active], keep_logits: bool) -> None:
        chunks = []
        for a in active:
            if a.pos < len(a.prompt):
                tokens = a.prompt[a.pos:a.pos + self.chunk_size]
            else:
                tokens = [a.result.output[-1]]
            slots = self._slots(a, len(tokens))
            self.rows.write(a.row, a.pos, slots)
            chunks.append(Chunk(a.row, a.pos, torch.tensor(tokens, dtype=torch.int64), slots))
            a.fed += tokens
        waiter = self.cache.begin_forward()
        logits = self.model.forward_cached(chunks, self.cache.pool, self.rows.req_to_token, waiter.wait_layer)
        for a, ch, lg in zip(active, chunks, logits):
            a.pos += len(ch.tokens)
            if a.pos < len(a.prompt):
                self._keep_chunk(a)
                continue
            a.result.output.append(int(lg[-1].argmax()))
            if keep_logits:
                a.result.logits.append(lg[-1].clone())

    def _slots(self, a: _Active, n: int) -> torch.Tensor:
        """Slots for the next `n` tokens: the rest of the request's last page, then new pages."""
        ps = self.page_size
        room = (ps - a.pos % ps) % ps if a.last_slot >= 0 else 0
        first = torch.arange(a.last_slot + 1, a.last_slot + 1 + min(room, n), dtype=torch.int64)
        rest = n - first.numel()
        more = self.cache.alloc(rest) if rest else torch.empty(0, dtype=torch.int64)
        if more is None:
            raise RuntimeError(
                f"device pool too small: {rest} slots needed for one request, "
                f"{self.cache.controller.device_alloc.available_size()} free after eviction; raise pool.size")
        slots = torch.cat([first, more])
        a.last_slot = int(slots[-1])
        return slots

    def _keep_chunk(self, a: _Active) -> None:
        """Chunked prefill: hand the page-aligned KV so far to the cache and repoint the row."""
        kv = self.rows.read(a.row, a.pos)
        canon, a.node, a.cached = self.cache.cache_unfinished(np.asarray(a.fed, dtype=np.int64), kv, a.node, a.cached)
        self.rows.write(a.row, 0, canon)

    def _finish(self, a: _Active) -> Result:
        fed = np.asarray(a.fed, dtype=np.int64)  # prompt + outputs but the last: those have K/V
        self.cache.cache_finished(fed, self.rows.read(a.row, len(fed)), a.node, a.cached)
        self.rows.free(torch.tensor([a.row], dtype=torch.int64))
        self.histories[a.turn.session] = a.prompt + a.result.output
        return a.result


def verify(model: TinyTransformer, result: Result, atol: float = 1e-5) -> float:
    """Run the request without any cache; raise if tokens or logits differ. Returns max |diff|."""
    seq = torch.tensor(result.prompt + result.output[:-1], dtype=torch.int64)
    dense = model.forward_dense(seq)[len(result.prompt) - 1:]
    want = dense.argmax(-1).tolist()
    if want != result.output:
        raise AssertionError(f"{result.session}/{result.turn}: tokens differ from the uncached run: "
                             f"{result.output} vs {want}")
    diff = max((float((a - b).abs().max()) for a, b in zip(result.logits, dense)), default=0.0)
    if diff > atol:
        raise AssertionError(f"{result.session}/{result.turn}: logits differ by {diff:.2e} > {atol}")
    return diff


def infinite_hit_rate(results: list[Result], page_size: int) -> float:
    """Hit rate of a cache that never evicts, on the same prompts (the bound)."""
    tree = RadixTree(page_size=page_size)
    hit = total = 0
    slot = page_size
    for r in results:
        key = np.asarray(r.prompt[:-1], dtype=np.int64)
        hit += tree.match_prefix(RadixKey(key)).device_indices.numel()
        total += len(r.prompt)
        fed = np.asarray(r.prompt + r.output[:-1], dtype=np.int64)
        fed = fed[: len(fed) - len(fed) % page_size]
        tree.insert(RadixKey(fed), torch.arange(slot, slot + len(fed)))
        slot += len(fed)
    return hit / max(total, 1)


def timed_run(engine: Engine, turns: list[Turn], keep_logits: bool = False, progress=None):
    start = time.perf_counter()
    results = engine.run(turns, keep_logits, progress)
    return results, time.perf_counter() - start
