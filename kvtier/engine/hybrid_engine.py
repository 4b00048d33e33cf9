"""The reference engine's loop for the hybrid model (engine/hybrid.py) over a
`HybridTieredCache`: the embedding sequence of docs/design.md §8 with every component.

Per request: acquire (FULL slots, the SWA window's slots and a state slot holding the state
after exactly the hit) -> allocate FULL and SWA slots for what it feeds -> forward (waiting
per model layer for what the load brings) -> cache_finished with its SWA row and a snapshot
of the state at the page-aligned end of what it fed; on any error, abort. Prefill runs in
one chunk (the cache keeps a hybrid prefix only where a request finishes), so states are
taken exactly where `bounds.finish_state_points` says; `poll()` after every step.

Slot tables, per request row (columns are token positions):

| table       | columns that hold slots          | whose                                         |
|-------------|----------------------------------|-----------------------------------------------|
| `full_rows` | [0, filled)                      | [0, device_hit): the tree's; the rest the request's |
| `swa_rows`  | [swa_start, filled)              | [swa_start, swa_start + swa_tree_len): the tree's; the rest the request's |
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.engine.engine import Result, set_torch_threads
from kvtier.engine.hybrid import HybridChunk, HybridModel, HybridPools
from kvtier.engine.sessions import Histories
from kvtier.engine.workloads import Turn
from kvtier.errors import TransferError
from kvtier.tiers.components import Component
from kvtier.tiers.req_to_token import ReqToTokenPool

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass
class HybridResult(Result):
    """`Result` plus what each side component restored: `swa_hit`, the SWA window's
    tokens handed at acquire (`swa_device` of them the tree's, on device; the rest loaded
    or copied), and `state_hit`, 1 when a recurrent state was restored (a hit > 0)."""

    swa_hit: int = 0
    swa_device: int = 0
    state_hit: int = 0


@dataclass
class _Active:
    rid: str
    turn: Turn
    prompt: list[int]
    row: int
    pos: int  # tokens whose K/V (and state) the request holds
    result: HybridResult
    state_slot: int | None
    swa_start: int
    hit: int  # the prefix the cache handed (L)
    filled: int = 0  # row columns that hold the request's slots
    snap: int | None = None  # the state slot of the finish's snapshot
    full_last: int = -1  # the last FULL slot written (its page's tail comes next)
    swa_last: int = -1
    fed: list[int] = field(default_factory=list)

    @property
    def fed_at_end(self) -> int:
        """Tokens whose K/V the request holds when it finishes (prompt + outputs but the last)."""
        return len(self.prompt) + self.turn.output_len - 1


class HybridEngine:
    """Requests wait in a queue, in order (a session's next turn waits for its previous
    one); one waiting for a store prefetch waits aside while others run, and once it
    landed, until the device has room to load what it brought to host. Up to `max_batch`
    requests share each forward. A request that cannot get slots sits a step out; when
    none can move, the youngest is preempted (aborted, queued again first), or fails alone."""

    def __init__(
        self,
        cache,
        model: HybridModel,
        max_batch: int = 4,
        max_context: int = 4096,
        histories: Histories | None = None,
    ) -> None:
        set_torch_threads()
        self.cache, self.model = cache, model
        self.page_size = cache.page_size
        self.max_batch = max_batch
        self.max_context = max_context
        self.rows = ReqToTokenPool(max_batch, max_context)
        self.swa_rows = torch.zeros(
            self.rows.req_to_token.shape, dtype=torch.int64
        )  # the cache takes int64 rows
        self.pools = HybridPools(
            *hybrid_pools(cache), self.rows.req_to_token, self.swa_rows
        )
        model.check_pools(self.pools)
        self.histories = histories if histories is not None else Histories()
        self.preempted = 0
        self._next_id = 0
        self._waiting: deque[Turn] = deque()
        self._active: list[_Active] = []
        self._parked: dict[str, tuple[Turn, list[int]]] = {}
        self._ready: deque[str] = deque()

    def submit(self, turn: Turn) -> None:
        """Queue `turn` (served in order by `step`; a session's turns one after another)."""
        self._waiting.append(turn)

    def pending(self) -> bool:
        return bool(self._waiting or self._active or self._parked)

    def run(
        self, turns: list[Turn], keep_logits: bool = False, progress=None
    ) -> list[HybridResult]:
        """Serve `turns`; a request that fails is released and returned with `error` set."""
        self._waiting.extend(turns)
        done: list[HybridResult] = []
        while self.pending():
            done += self.step(keep_logits)
            if progress:
                progress(len(done), len(turns))
        return done

    def step(self, keep_logits: bool = False) -> list[HybridResult]:
        done: list[HybridResult] = []
        while self._ready and len(self._active) < self.max_batch:
            turn, prompt = self._parked[self._ready[0]]
            if self._load_must_wait(prompt):
                break  # what its prefetch brought waits on host for device room
            rid = self._ready.popleft()
            del self._parked[rid]
            self._acquire(rid, turn, prompt, done)
        self._admit(done)
        if self._active:
            self._forward(keep_logits, done)
        for a in [a for a in self._active if len(a.result.output) == a.turn.output_len]:
            self._active.remove(a)
            done.append(self._finish(a))
        self._ready += [rid for rid in self.cache.poll() if rid in self._parked]
        if self._parked and not self._active:
            self.cache.wait_progress()
        return done

    # -- admission ----------------------------------------------------------------------------

    def _admit(self, done: list) -> None:
        busy = {a.turn.session for a in self._active}
        busy |= {t.session for t, _ in self._parked.values()}
        i = 0
        while (
            i < len(self._waiting)
            and not self._ready
            and len(self._active) + len(self._parked) < self.max_batch
        ):
            turn = self._waiting[i]
            if turn.session in busy:
                busy.add(turn.session)
                i += 1
                continue
            prompt = self._prompt(turn)
            if self._load_must_wait(prompt):
                break  # it starts when a request of the batch ends (or a copy lands)
            del self._waiting[i]
            busy.add(turn.session)
            need = len(prompt) + turn.output_len
            limit = min(self.cache.config.pool.size - self.page_size, self.max_context)
            if turn.output_len < 1 or need > limit:
                why = (
                    f"request needs {need} tokens of KV; this engine holds at most {limit}"
                    if turn.output_len >= 1
                    else "output_len must be >= 1"
                )
                done.append(self._result(turn, prompt, error=why, rejected=True))
                continue
            self._acquire(f"h-{self._next_id}", turn, prompt, done)
            self._next_id += 1

    def _load_must_wait(self, prompt: list[int]) -> bool:
        """Is the prompt's restorable prefix on host, with no device room to load it into
        until a request of the batch ends or the copies in flight land? The request then
        waits (as the full-attention engine's): started now, its load would find no room
        and it would recompute the whole prefix."""
        if not (self._active or self.cache.writes.writing):
            return False  # nothing that ends soon would make room: start it
        m = self.cache.match_prefix(
            np.asarray(prompt[:-1], dtype=np.int64), count=False
        )
        return m.host_hit_length > self.cache.room()

    def _prompt(self, turn: Turn) -> list[int]:
        history = self.histories.get(turn.session)
        if history and list(turn.prompt[: len(history)]) == history:
            return list(turn.prompt)
        return history + list(turn.prompt)

    @staticmethod
    def _result(turn: Turn, prompt: list[int], **kw) -> HybridResult:
        return HybridResult(turn.session, turn.turn, prompt, [], **kw)

    def _acquire(self, rid: str, turn: Turn, prompt: list[int], done: list) -> None:
        # all but the last prompt token: its logits start the output
        got = self.cache.acquire(np.asarray(prompt[:-1], dtype=np.int64), rid)
        if not got.ready:
            self._parked[rid] = (turn, prompt)
            return
        hit = got.indices.numel()
        row = int(self.rows.alloc(1)[0])
        self.rows.write(row, 0, got.indices)
        swa = got.swa_indices
        self.swa_rows[row, got.swa_start : got.swa_start + swa.numel()] = swa
        result = self._result(
            turn,
            prompt,
            device_hit=got.device_hit,
            host_hit=got.host_hit,
            storage_hit=got.storage_hit,
            cached=hit,
            swa_hit=swa.numel(),
            swa_device=got.swa_tree_len,
            state_hit=int(hit > 0 and got.state_slot is not None),
        )
        a = _Active(
            rid,
            turn,
            prompt,
            row,
            hit,
            result,
            got.state_slot,
            got.swa_start,
            hit,
            full_last=int(got.indices[-1]) if hit else -1,
            swa_last=int(swa[-1]) if swa.numel() else -1,
            filled=hit,
            fed=list(prompt[:hit]),
        )
        self._active.append(a)

    # -- forward ------------------------------------------------------------------------------

    def _forward(self, keep_logits: bool, done: list) -> None:
        chunks, batch = [], []
        for a in list(self._active):
            tokens = (
                a.prompt[a.pos :] if a.pos < len(a.prompt) else [a.result.output[-1]]
            )
            chunk = self._chunk(a, tokens)
            if chunk is not None:
                chunks.append(chunk)
                batch.append((a, tokens))
        if not chunks:
            self._unstick(done)
            return
        waiter = self.cache.begin_forward([a.rid for a, _ in batch])
        try:
            logits = self.model.forward_cached(chunks, self.pools, waiter.wait_layer)
        except TransferError as exc:  # a load this forward reads failed
            for a, _ in batch:
                self._active.remove(a)
                done.append(self._fail(a, str(exc)))
            return
        failed = set(waiter.failed())
        for (a, tokens), lg in zip(batch, logits):
            if a.rid in failed:
                self._active.remove(a)
                done.append(self._fail(a, f"request {a.rid!r}: its load failed"))
                continue
            a.fed += tokens
            a.pos += len(tokens)
            a.result.output.append(int(lg[-1].argmax()))
            if keep_logits:
                a.result.logits.append(lg[-1].clone())

    def _chunk(self, a: _Active, tokens: list[int]) -> HybridChunk | None:
        """The request's next chunk with its slots (written into both tables), or None
        when the cache is short of FULL, SWA or state slots (it sits this step out)."""
        n, end = len(tokens), a.pos + len(tokens)
        snap_at = a.fed_at_end - a.fed_at_end % self.page_size
        want_snap = a.pos < snap_at <= end and snap_at > a.hit
        if want_snap and a.snap is None:
            a.snap = self.cache.alloc_state(
                a.rid
            )  # the request's: its finish or abort frees it
            if a.snap is None:
                return None
        full = self._slots(a.pos, a.full_last, n, self.cache.alloc, self.cache.free)
        if full is None:
            return None
        swa = self._slots(
            a.pos, a.swa_last, n, self.cache.alloc_swa, self.cache.free_swa
        )
        if swa is None:
            self._give_back(a.pos, a.full_last, full, self.cache.free)
            return None
        self.rows.write(a.row, a.pos, full[:n])
        self.swa_rows[a.row, a.pos : end] = swa[:n]
        a.full_last, a.swa_last, a.filled = int(full[n - 1]), int(swa[n - 1]), end
        snapshots = ((snap_at, a.snap),) if want_snap else ()
        return HybridChunk(
            a.row,
            a.pos,
            torch.tensor(tokens, dtype=torch.int64),
            full[:n],
            swa[:n],
            a.state_slot,
            snapshots,
        )

    def _slots(self, pos: int, last: int, n: int, alloc, free) -> torch.Tensor | None:
        """Slots for tokens [pos, pos + n): the rest of the last page, then new whole pages
        (their tail follows the n slots: the next tokens' first)."""
        ps = self.page_size
        room = (ps - pos % ps) % ps if last >= 0 else 0
        first = torch.arange(last + 1, last + 1 + min(room, n), dtype=torch.int64)
        rest = n - first.numel()
        more = alloc(rest) if rest else _EMPTY
        if more is None:
            return None
        return torch.cat([first, more])

    def _give_back(self, pos: int, last: int, slots: torch.Tensor, free) -> None:
        """Return the new pages of `_slots` (not the rest of the last page, still ours)."""
        ps = self.page_size
        room = (ps - pos % ps) % ps if last >= 0 else 0
        if slots.numel() > room:
            free(slots[room:])

    def _unstick(self, done: list) -> None:
        """No request could get slots: writes in flight free room once polled; otherwise
        preempt the youngest (what it holds is released), or fail it when it is alone."""
        if self.cache.busy():
            time.sleep(0.001)
            return
        a = self._active.pop()
        if self._active:
            self._abort(a)
            self._waiting.appendleft(a.turn)
            self.preempted += 1
        else:
            done.append(self._fail(a, "device pools exhausted: no room for its tokens"))

    # -- the end of a request -----------------------------------------------------------------

    def _finish(self, a: _Active) -> HybridResult:
        fed = np.asarray(a.fed, dtype=np.int64)
        n = len(fed)
        try:
            self.cache.cache_finished(
                a.rid,
                fed,
                self.rows.read(a.row, n),
                swa_indices=self.swa_rows[a.row, a.swa_start : n].clone(),
                mamba_slot=a.snap,
            )
        except TransferError as exc:  # the cache released it already
            a.result.error = str(exc)
        self.rows.free(torch.tensor([a.row], dtype=torch.int64))
        if a.result.error is None:
            self.histories.put(a.turn.session, a.result.prompt + a.result.output)
        return a.result

    def _abort(self, a: _Active) -> None:
        n = a.filled
        self.cache.abort(
            a.rid,
            self.rows.read(a.row, n),
            swa_indices=self.swa_rows[a.row, a.swa_start : n].clone(),
        )
        self.rows.free(torch.tensor([a.row], dtype=torch.int64))

    def _fail(self, a: _Active, why: str) -> HybridResult:
        self._abort(a)
        a.result.error = why
        return a.result


def hybrid_cache(config, model: HybridModel, **kwargs):
    """A `HybridTieredCache` for `model` from `config`: FULL and SWA pools of
    `config.pool.size` tokens in pages of `config.pool.page_size`, and a state slot per
    page of them (a node's state and a request's working and snapshot slots)."""
    from kvtier.cache.hybrid import HybridTieredCache

    p = config.pool
    specs = model.component_specs(p.size, p.size // p.page_size, p.page_size)
    return HybridTieredCache(config, specs, model.layer_components(), **kwargs)


def hybrid_pools(cache) -> tuple:
    """(FULL, SWA, state) device pools of a `HybridTieredCache`."""
    return (
        cache.pool,
        cache.component_pool(Component.SWA),
        cache.component_pool(Component.MAMBA),
    )
