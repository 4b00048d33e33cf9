"""A scheduler loop that embeds TieredCache exactly as docs/design.md §8 describes.

Per request: acquire (match, lock; a store prefetch makes the request wait aside while
others run) -> allocate (evicting on demand) -> forward (waiting per layer for the host
load) in prefill chunks and decode steps -> cache_finished; on any error, abort.
`poll()` after every step. Several requests share each forward.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.cache import TieredCache
from kvtier.errors import TransferError
from kvtier.engine.model import Chunk, TinyTransformer
from kvtier.engine.sessions import Histories
from kvtier.engine.workloads import Turn
from kvtier.tiers.req_to_token import ReqToTokenPool
from kvtier.tree import RadixKey, RadixTree


@dataclass
class Result:
    session: str
    turn: int
    prompt: list[int]
    output: list[int]
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    cached: int = 0  # prompt tokens whose KV came from the cache
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    error: str | None = (
        None  # why the request failed (its KV was released, nothing cached)
    )
    rejected: bool = (
        False  # failed because of the request itself (too large): a client error
    )
    ticket: str = ""  # what `Engine.submit` returned

    @property
    def computed(self) -> int:
        return len(self.prompt) - self.cached


@dataclass
class _Active:
    rid: str
    ticket: str
    turn: Turn
    prompt: list[int]
    row: int
    pos: int  # tokens whose K/V are in the pool
    result: Result
    last_slot: int = -1
    filled: int = 0  # row entries that hold the request's slots
    fed: list[int] = field(
        default_factory=list
    )  # tokens fed so far (prompt, then outputs)
    in_tree: int = (
        0  # prompt tokens whose KV the tree holds (cached at acquire, or by a chunk)
    )
    remember: bool = True  # grow the session's history when it finishes
    decoded: int = 0  # decode steps since it (re)started: its time slice so far


@dataclass(slots=True)
class _Queued:
    ticket: (
        str  # what `submit` returned; a request preempted and started again keeps it
    )
    turn: Turn
    remember: bool = True
    passed_over: int = 0  # requests started ahead of it while it did not fit
    # a request preempted at the end of its time slice: what it has output so far, which
    # it keeps (its prompt and outputs are cached; it goes on where it stopped)
    resume: Result | None = None


class Engine:
    """Requests wait in a queue; a request whose prefix is being fetched from the store
    waits aside (`parked`) while others run, and joins once `cache.poll()` names it.

    `submit` queues a request, `step` runs one scheduler step (admit, one forward, finish,
    poll) and returns the requests that ended in it; `run` does both for a list of turns.
    A request whose prompt shares an uncached prefix of at least a page with a request in
    the batch waits until that one has cached it (SGLang's in-batch prefix check), so a
    shared document is computed once, not once per request of the batch.

    A request that does not fit the pool beside the running ones is passed over by later
    ones that do (a short request never waits behind long decodes that leave it room), at
    most `max_passed` times: then nothing starts ahead of it until it fits.

    `time_slice` (decode steps; None: off): with requests waiting and the batch full, a
    request that has decoded that many steps since it started is preempted, the longest
    running first. Its prompt and outputs so far are cached (`cache_finished`) and it
    queues again, ahead of its session's later turns, keeping its outputs: resumed, its
    prompt is the old one and those outputs, mostly a cache hit, and it goes on where it
    stopped. So a short request never waits for long decodes to end, and the outputs are
    the ones an uninterrupted run gives (greedy decoding over the same KV)."""

    def __init__(
        self,
        cache: TieredCache,
        model: TinyTransformer,
        max_batch: int = 4,
        chunk_size: int = 256,
        max_context: int = 16384,
        report_prefill: bool = False,
        histories: Histories | None = None,
        share_prefixes: bool = True,
        max_passed: int | None = None,
        time_slice: int | None = None,
    ) -> None:
        """`report_prefill`: tell the cache how fast this model prefills (each forward's
        prefill tokens and seconds), so that it skips store loads slower than that.
        `histories`: where session histories live (default: an LRU of 4,096 sessions)."""
        model.check_pool(cache.pool)
        set_torch_threads()
        self.report_prefill = report_prefill
        self.cache = cache
        self.model = model
        self.max_batch = max_batch
        self.chunk_size = chunk_size
        self.max_context = max_context
        self.share_prefixes = share_prefixes
        # requests that may start ahead of one that does not fit (None: 4 batches' worth)
        self.max_passed = 4 * max_batch if max_passed is None else max_passed
        self.passed_over = 0  # starts ahead of a request that did not fit
        if time_slice is not None and time_slice < 1:
            raise ValueError(f"time_slice={time_slice!r}: must be >= 1 or None (off)")
        self.time_slice = time_slice
        self.sliced = 0  # requests preempted at the end of their time slice
        self.rows = ReqToTokenPool(max_batch, max_context)
        self.histories = histories if histories is not None else Histories()
        self.page_size = cache.page_size
        self._next_id = 0
        self._next_ticket = 0
        self.preempted = 0  # requests sent back to the queue when the pool ran out
        self.held_back = (
            0  # admissions deferred because a batch member was computing the prefix
        )
        self._waiting: deque[_Queued] = deque()
        self._active: list[_Active] = []
        self._parked: dict[str, tuple[_Queued, list[int]]] = {}
        self._ready: deque[str] = deque()  # parked requests poll() named, in that order

    def submit(self, turn: Turn, remember: bool = True) -> str:
        """Queue `turn`; returns its ticket (`Result.ticket`). With `remember`, the
        session's history grows by this turn once it finishes."""
        ticket = f"t-{self._next_ticket}"
        self._next_ticket += 1
        self._waiting.append(_Queued(ticket, turn, remember))
        return ticket

    def pending(self) -> bool:
        return bool(self._waiting or self._active or self._parked)

    def run(
        self, turns: list[Turn], keep_logits: bool = False, progress=None
    ) -> list[Result]:
        """Serve `turns` in order (a session's next turn waits for its previous one). A
        request that fails is released and returned with `error` set; the rest go on."""
        for t in turns:
            self.submit(t)
        done: list[Result] = []
        while self.pending():
            done += self.step(keep_logits)
            if progress:
                progress(len(done), len(turns))
        return done

    def step(self, keep_logits: bool = False) -> list[Result]:
        """One scheduler step; the requests that ended in it."""
        waiting, active, parked, ready, done = (
            self._waiting,
            self._active,
            self._parked,
            self._ready,
            [],
        )
        while (
            ready
            and self._fits(self._need(*parked[ready[0]]), active)
            and not self._load_must_wait(parked[ready[0]][1])
        ):
            rid = ready.popleft()
            q, prompt = parked.pop(rid)
            self._acquire(rid, q, prompt, active, done, parked)
        self._end_slices(done)
        self._admit(done)
        if active:
            self._step(active, keep_logits, done, waiting)
        for a in [a for a in active if len(a.result.output) == a.turn.output_len]:
            active.remove(a)
            done.append(self._finish(a))
        ready += [rid for rid in self.cache.poll() if rid in parked]
        if (
            parked or waiting
        ) and not active:  # nothing could run: nap until a store op or copy moves
            self.cache.wait_progress()
        return done

    # -- admission ----------------------------------------------------------------------------

    def _admit(self, done: list) -> None:
        """Start queued requests while the batch has room, in order. A request held back by
        the prefix check is passed over (and the later turns of its session with it)."""
        waiting, active, parked = self._waiting, self._active, self._parked
        passed: set[str] = set()
        too_big: list[_Queued] = []  # passed over for room, ahead of what starts
        i = 0
        while (
            i < len(waiting)
            and i < 8 * self.max_batch
            and not self._ready
            and len(active) + len(parked) < self.max_batch
        ):
            q = waiting[i]
            if q.turn.session in passed or self._session_running(q.turn, parked):
                passed.add(q.turn.session)  # its turns run in order
                i += 1
                continue
            prompt = self._prompt_of(q)
            if not self._fits(self._need(q, prompt), active):
                if q.passed_over >= self.max_passed:
                    break  # passed over enough: it starts next, when room frees
                too_big.append(q)
                passed.add(q.turn.session)
                i += 1
                continue
            if self.share_prefixes and self._computing_prefix_of(prompt, active):
                passed.add(q.turn.session)
                self.held_back += 1
                i += 1
                continue
            if self._load_must_wait(prompt):
                self.held_back += 1
                break
            del waiting[i]
            for big in too_big:
                big.passed_over += 1
            self.passed_over += len(too_big)
            self._start(q, prompt, active, parked, done)

    def _end_slices(self, done: list) -> None:
        """With the batch full and a request waiting, preempt the one that has decoded
        longest past its time slice (at most one a step: the slot it frees is taken by
        the first waiting request that fits)."""
        active, waiting = self._active, self._waiting
        if (
            self.time_slice is None
            or not waiting
            or len(active) + len(self._parked) < self.max_batch
        ):
            return
        over = [a for a in active if a.decoded >= self.time_slice]
        if not over:
            return
        a = max(over, key=lambda a: a.decoded)  # the first such on a tie
        active.remove(a)
        fed = np.asarray(a.fed, dtype=np.int64)  # all but the last output have K/V
        try:
            self.cache.cache_finished(a.rid, fed, self.rows.read(a.row, len(fed)))
        except TransferError as exc:  # the cache released it already
            a.result.error = str(exc)
        self.rows.free(torch.tensor([a.row], dtype=torch.int64))
        if a.result.error is not None:
            done.append(a.result)
            return
        q = _Queued(a.ticket, a.turn, a.remember, resume=a.result)
        later = next(
            (i for i, w in enumerate(waiting) if w.turn.session == a.turn.session),
            len(waiting),
        )
        waiting.insert(later, q)  # before its session's later turns
        self.sliced += 1

    def _prompt_of(self, q: _Queued) -> list[int]:
        """What the request feeds: a resumed one its prompt and its outputs so far."""
        if q.resume is not None:
            return q.resume.prompt + q.resume.output
        return self._prompt(q.turn)

    @staticmethod
    def _need(q: _Queued, prompt: list[int]) -> int:
        """Tokens of KV the request holds when it ends."""
        done = len(q.resume.output) if q.resume is not None else 0
        return len(prompt) + q.turn.output_len - done

    def _prompt(self, turn: Turn) -> list[int]:
        """The session's history, then the turn's tokens; a turn that already starts with
        its history (a client resending the whole conversation) is taken as it is."""
        history = self.histories.get(turn.session)
        if (
            history
            and len(turn.prompt) >= len(history)
            and list(turn.prompt[: len(history)]) == history
        ):
            return list(turn.prompt)
        return history + list(turn.prompt)

    def _computing_prefix_of(self, prompt: list[int], active: list[_Active]) -> bool:
        """Does a request of the batch (running, or waiting for its prefetch) compute a page
        or more of `prompt`'s prefix that the tree does not hold yet?"""
        key = np.asarray(prompt[:-1], dtype=np.int64)
        started = [(a.prompt, a.in_tree) for a in active] + [
            (p, 0) for _, p in self._parked.values()
        ]
        for other, in_tree in started:
            n = min(len(key), len(other))
            if n - in_tree < self.page_size:
                continue
            differ = np.flatnonzero(key[:n] != np.asarray(other[:n], dtype=np.int64))
            common = int(differ[0]) if differ.size else n
            if common - in_tree >= self.page_size:
                return True
        return False

    def _load_must_wait(self, prompt: list[int]) -> bool:
        """Is the prompt's prefix on host, with no device room to load it into until a
        request of the batch ends or the copies in flight land (they make the device pages
        they copy evictable)? The request then waits: started now, its load would find no
        room and it would recompute the whole prefix."""
        if not self.share_prefixes or not (self._active or self.cache.writes.writing):
            return False  # nothing that ends soon would make room: start it (and recompute)
        m = self.cache.match_prefix(
            np.asarray(prompt[:-1], dtype=np.int64), count=False
        )
        return m.host_hit_length > self.cache.room()

    def _session_running(self, turn: Turn, parked: dict) -> bool:
        """Is a turn of the same session running or waiting for its prefetch? It waits."""
        return any(a.turn.session == turn.session for a in self._active) or any(
            q.turn.session == turn.session for q, _ in parked.values()
        )

    def _fits(self, need: int, active: list[_Active]) -> bool:
        """A new request must fit what the pool can free (a lone request is always tried)."""
        if not active:
            return True
        reserved = sum(
            len(a.result.prompt) + a.turn.output_len - a.pos for a in active
        )  # still to allocate
        room = self.cache.room()
        return need + reserved + self.page_size * (len(active) + 1) <= room

    def _start(
        self, q: _Queued, prompt: list[int], active: list, parked: dict, done: list
    ) -> None:
        turn = q.turn
        need = self._need(q, prompt)
        limit = min(self.cache.config.pool.size - self.page_size, self.max_context)
        if not turn.output_len or need > limit:
            why = (
                (
                    f"request needs {need} tokens of KV (prompt {len(prompt)} + output {turn.output_len}); "
                    f"this server holds at most {limit}"
                )
                if turn.output_len
                else "output_len must be >= 1"
            )
            done.append(
                Result(
                    turn.session,
                    turn.turn,
                    prompt,
                    [],
                    error=why,
                    rejected=True,
                    ticket=q.ticket,
                )
            )
            return
        self._acquire(f"req-{self._next_id}", q, prompt, active, done, parked)
        self._next_id += 1

    def _acquire(
        self,
        rid: str,
        q: _Queued,
        prompt: list[int],
        active: list,
        done: list,
        parked=None,
    ) -> None:
        # all but the last prompt token: its logits start the output, so it is computed
        got = self.cache.acquire(np.asarray(prompt[:-1], dtype=np.int64), rid)
        if not got.ready:
            parked[rid] = (q, prompt)
            return
        cached = got.indices.numel()
        row = int(self.rows.alloc(1)[0])
        self.rows.write(row, 0, got.indices)
        turn = q.turn
        result = q.resume or Result(
            turn.session,
            turn.turn,
            prompt,
            [],
            got.device_hit,
            got.host_hit,
            got.storage_hit,
            cached,
            ticket=q.ticket,
        )
        last = int(got.indices[-1]) if cached else -1
        active.append(
            _Active(
                rid,
                q.ticket,
                turn,
                prompt,
                row,
                cached,
                result,
                last,
                cached,
                list(prompt[:cached]),
                in_tree=cached,
                remember=q.remember,
            )
        )

    # -- forward steps ------------------------------------------------------------------------

    def _step(
        self, active: list[_Active], keep_logits: bool, done: list, waiting: deque
    ) -> None:
        chunks, batch, stalled = [], [], []
        for a in list(active):
            tokens = (
                a.prompt[a.pos : a.pos + self.chunk_size]
                if a.pos < len(a.prompt)
                else [a.result.output[-1]]
            )
            slots = self._slots(a, len(tokens))
            if slots is None:  # sits this step out: the others finish and free room
                stalled.append((a, len(tokens)))
                continue
            self.rows.write(a.row, a.pos, slots)
            a.filled = a.pos + len(tokens)
            chunks.append(
                Chunk(a.row, a.pos, torch.tensor(tokens, dtype=torch.int64), slots)
            )
            batch.append((a, tokens))
        if not chunks:
            if (
                self.cache.busy()
            ):  # writes in flight hold locks: once polled, room frees
                time.sleep(0.001)
                return
            # nobody can move: preempt the youngest (what it computed stays cached)
            a, n = stalled[-1]
            active.remove(a)
            if active:
                self.cache.abort(a.rid, self.rows.read(a.row, a.filled))
                self.rows.free(torch.tensor([a.row], dtype=torch.int64))
                waiting.appendleft(_Queued(a.ticket, a.turn, a.remember))
                self.preempted += 1
            else:
                done.append(
                    self._fail(a, f"device pool exhausted: no room for {n} more tokens")
                )
            return
        waiter = self.cache.begin_forward([a.rid for a, _ in batch])
        started = time.perf_counter()
        try:
            logits = self.model.forward_cached(
                chunks, self.cache.pool, self.rows.req_to_token, waiter.wait_layer
            )
        except (
            TransferError
        ) as exc:  # a load this forward reads failed: no request of it may go on
            for a, _ in batch:
                active.remove(a)
                done.append(self._fail(a, str(exc)))
            return
        failed = set(
            waiter.failed()
        )  # tensor parallel: the forward ran on; agreed on every rank
        if failed:
            kept = []
            for a, tokens in batch:
                if a.rid in failed:
                    active.remove(a)
                    done.append(
                        self._fail(
                            a,
                            f"request {a.rid!r}: its host->device load failed on some rank",
                        )
                    )
                else:
                    kept.append((a, tokens))
            logits = [lg for (a, _), lg in zip(batch, logits) if a.rid not in failed]
            batch = kept
        if self.report_prefill:
            prefill = sum(len(tokens) for a, tokens in batch if a.pos < len(a.prompt))
            self.cache.report_prefill(prefill, time.perf_counter() - started)
        for (a, tokens), lg in zip(batch, logits):
            a.fed += tokens
            a.pos += len(tokens)
            if a.pos < len(a.prompt):
                self._keep_chunk(a)
                continue
            a.result.output.append(int(lg[-1].argmax()))
            a.decoded += 1
            if keep_logits:
                a.result.logits.append(lg[-1].clone())

    def _slots(self, a: _Active, n: int) -> torch.Tensor | None:
        """Slots for the next `n` tokens: the rest of the request's last page, then new pages."""
        ps = self.page_size
        room = (ps - a.pos % ps) % ps if a.last_slot >= 0 else 0
        first = torch.arange(
            a.last_slot + 1, a.last_slot + 1 + min(room, n), dtype=torch.int64
        )
        rest = n - first.numel()
        more = self.cache.alloc(rest) if rest else torch.empty(0, dtype=torch.int64)
        if more is None:
            return None
        slots = torch.cat(
            [first, more[:rest]]
        )  # the rest of the last page: `first` of the next step
        a.last_slot = int(slots[-1])
        return slots

    def _keep_chunk(self, a: _Active) -> None:
        """Chunked prefill: hand the page-aligned KV so far to the cache and repoint the row."""
        kv = self.rows.read(a.row, a.pos)
        canon = self.cache.cache_unfinished(
            a.rid, np.asarray(a.fed, dtype=np.int64), kv
        )
        self.rows.write(a.row, 0, canon)
        a.in_tree = a.pos - a.pos % self.page_size

    def _finish(self, a: _Active) -> Result:
        fed = np.asarray(
            a.fed, dtype=np.int64
        )  # prompt + outputs but the last: those have K/V
        try:
            self.cache.cache_finished(a.rid, fed, self.rows.read(a.row, len(fed)))
        except TransferError as exc:  # the cache released it already
            a.result.error = str(exc)
        self.rows.free(torch.tensor([a.row], dtype=torch.int64))
        if a.result.error is None and a.remember:
            self.histories.put(a.turn.session, a.result.prompt + a.result.output)
        return a.result

    def _fail(self, a: _Active, why: str) -> Result:
        """Release everything the request holds; it reports `why`."""
        self.cache.abort(a.rid, self.rows.read(a.row, a.filled))
        self.rows.free(torch.tensor([a.row], dtype=torch.int64))
        a.result.error = why
        return a.result


def torch_threads() -> tuple[int, str]:
    """(torch intra-op threads the engine runs with, where that number comes from). The
    reference model's matmuls are small: one thread is fastest, and on a machine whose
    cores other processes share, torch's default (a thread per core) thrashes (0.4 req/s
    against 5-6 with one thread measured on 2 shared cores). OMP_NUM_THREADS overrides."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    if raw.strip().isdigit() and int(raw) >= 1:
        return int(raw), "OMP_NUM_THREADS"
    return 1, "default (the reference model's matmuls are small)"


def set_torch_threads() -> int:
    n, _ = torch_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def verify(model: TinyTransformer, result: Result, atol: float = 1e-5) -> float:
    """Run the request without any cache; raise if tokens or logits differ. Returns max |diff|."""
    seq = torch.tensor(result.prompt + result.output[:-1], dtype=torch.int64)
    dense = model.forward_dense(seq)[len(result.prompt) - 1 :]
    want = dense.argmax(-1).tolist()
    if want != result.output:
        raise AssertionError(
            f"{result.session}/{result.turn}: tokens differ from the uncached run: "
            f"{result.output} vs {want}"
        )
    diff = max(
        (float((a - b).abs().max()) for a, b in zip(result.logits, dense)), default=0.0
    )
    if diff > atol:
        raise AssertionError(
            f"{result.session}/{result.turn}: logits differ by {diff:.2e} > {atol}"
        )
    return diff


def infinite_hit_rate(results: list[Result], page_size: int) -> float:
    """Hit rate of a cache that never evicts, on the same prompts (the bound)."""
    tree = RadixTree(page_size=page_size)
    hit = total = 0
    slot = page_size
    for r in results:
        key = np.asarray(r.prompt[:-1], dtype=np.int64)
        hit += tree.match_prefix(RadixKey(key)).device_slots.size
        total += len(r.prompt)
        fed = np.asarray(r.prompt + r.output[:-1], dtype=np.int64)
        fed = fed[: len(fed) - len(fed) % page_size]
        tree.insert(RadixKey(fed), torch.arange(slot, slot + len(fed)))
        slot += len(fed)
    return hit / max(total, 1)


def timed_run(
    engine: Engine, turns: list[Turn], keep_logits: bool = False, progress=None
):
    start = time.perf_counter()
    results = engine.run(turns, keep_logits, progress)
    return results, time.perf_counter() - start
