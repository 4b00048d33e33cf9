"""A deterministic fault simulator for the whole cache (the fail-closed proof).

A seeded scheduler drives a real `TieredCache` (tree, controller, storage thread) whose
transfer streams and store are `SimStreams` / `SimStore`: every copy and every store call
waits until the simulator resolves it, in any order, with any outcome (see parts.py). The
requests follow the embedding sequence a server runs: acquire (waiting while a prefetch
runs) -> forward over chunks (cache_unfinished) -> cache_finished, or abort at any point;
with polls, evictions, flushes, a logical clock for deadlines, and close at the end of
every episode.

Checked after every step: `sanity_check()`, `check_accounting()`, and that every byte a
forward reads for a token equals the reference KV of that token's prefix (unless that
forward's waiter named its load failed). Before `close()`, once every copy and store call is
answered, every waiting request is named ready (none waits forever); after it, every slot
is free.

    python benchmarks/fault_sim.py --steps 20000 --seed 7
    ...
    fault sim: 20000 steps, 0 violations
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.cache import TieredCache
from kvtier.config import load_config
from kvtier.errors import TransferError
from kvtier.testing.episodes import Failure, Player, play, run_episodes, schedule
from kvtier.testing.misuse import Violation, misuse
from kvtier.testing.parts import SimStore, SimStreams, watch_copies

LAYERS = 2
SIM_TENANT_KEY = "5a" * 32  # the sealed runs' tenant key (a test key, never a real one)
HASH_MODULUS = (1 << 61) - 1  # the reference KV's prefix hashes (a Mersenne prime)


def reference_kv(tokens: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) `[len, 1, 2]`: token j's KV is a function of tokens[0..j] only."""
    h, hashes = 0, []
    for t in tokens.tolist():
        h = (h * 1_000_003 + t + 1) % HASH_MODULUS
        hashes.append(h)
    hs = np.array(hashes, dtype=np.uint64)
    out = []
    for layer in range(LAYERS):
        parts = [
            (
                (hs * np.uint64(2 * layer + c + 3) + np.uint64(c * 977))
                >> np.uint64(c * 7)
            )
            % np.uint64(1 << 23)
            for c in range(4)
        ]
        vals = torch.tensor(np.stack(parts, 1).astype(np.float32))
        out.append((vals[:, None, 0:2].contiguous(), vals[:, None, 2:4].contiguous()))
    return out


def settle(cache: TieredCache) -> None:
    """Let the cache's storage loop run until it waits on its SimStore again."""

    async def spin():
        for _ in range(40):
            await asyncio.sleep(0)

    asyncio.run_coroutine_threadsafe(spin(), cache.controller.storage.loop).result(30)


class HeldPosts:
    """The work a step posts to the storage loop (ops started, grants, touches), held until
    the simulator settles and then handed over as one batch: the loop starts the step's ops
    in the order they were posted, whatever the machine's load. Run free, the loop could
    wake between two posts of one step and run the first op up to its store call before
    the second op was made, or take both in one wake-up and interleave them: the order of
    the store's pending calls, which the seeded simulator picks from, then varied from run
    to run. `free`: posts go straight through (while the simulator blocks on the loop)."""

    def __init__(self, store_loop) -> None:
        self.post, self.held, self.free = store_loop.post, [], False
        store_loop.post = self._post

    def _post(self, fn) -> None:
        if self.free:
            self.post(fn)
        else:
            self.held.append(fn)

    def release(self) -> None:
        batch, self.held = self.held, []
        if batch:
            self.post(lambda: [fn() for fn in batch])


@dataclass
class Setup:
    page_size: int
    layout: str
    io: str
    write_policy: str
    prefetch_policy: str
    evict_headroom: float = (
        0.0  # the sim's pools are a few pages: 3% would round to none
    )
    hash_algo: str = "sha256"  # xxh3_128: 16-byte page hashes, zero padded in the frame
    sealing: str = (
        "plain"  # mac, aes-gcm: pages sealed under a tenant key (docs/security.md)
    )
    store_pages: int = (
        1  # device pages in one store page (store.page_tokens, docs/stores.md)
    )

    @classmethod
    def draw(cls, rng: random.Random, allow_kernel: bool) -> Setup:
        return cls(
            rng.choice([1, 4, 16]),
            rng.choice(["page_first", "layer_first"]),
            "kernel" if allow_kernel and rng.random() < 0.1 else "direct",
            rng.choice(
                [
                    "write_through",
                    "write_through",
                    "write_through_selective",
                    "write_back",
                ]
            ),
            rng.choice(["best_effort", "wait_complete", "timeout"]),
            rng.choice(
                [0.0, 0.25]
            ),  # drawn after the others: they stay what each seed drew
            rng.choice(["sha256", "xxh3_128"]),
            rng.choice(["plain", "mac", "aes-gcm"]),
            rng.choice([1, 1, 2, 4]),
        )


@dataclass(eq=False)
class Req:
    rid: str
    tokens: np.ndarray
    ref: list
    row: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    pos: int = 0  # tokens whose KV the row holds (from the cache or computed)


class FaultSim:
    def __init__(
        self,
        seed: int,
        setup: Setup,
        faults: random.Random | None = None,
        agreement=None,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(
            seed
        )  # the engine's choices (the same on every rank: tp_sim.py)
        self.faults = (
            faults or self.rng
        )  # how copies and store calls end (a rank's own)
        self.setup = setup
        self.clock = 0.0
        self.streams = SimStreams(self.faults)
        self.store = SimStore()
        ps = setup.page_size
        pages = 16 if ps == 16 else 24
        self.max_len = min(ps * pages // 2, 96)
        overrides = {
            "pool": {
                "size": ps * pages,
                "num_layers": LAYERS,
                "page_size": ps,
                "num_kv_heads": 1,
                "head_dim": 2,
                "dtype": "float32",
            },
            "mirror": {
                "ratio": 1.0,
                "layout": setup.layout,
                "io": setup.io,
            },  # small: pages go to the store
            "controller": {
                "write_policy": setup.write_policy,
                "prefetch_policy": setup.prefetch_policy,
                "write_threshold": 2,
                "prefetch_timeout_base_s": 1.0,
                "evict_headroom": setup.evict_headroom,
                "prefetch_timeout_per_1k_tokens_s": 0.0,
            },
            "store": {"backend": "none", "page_tokens": ps * setup.store_pages},
            "tree": {"hash_algo": setup.hash_algo},
        }
        if setup.sealing != "plain":
            overrides["namespace"] = {
                "tenant_key": SIM_TENANT_KEY,
                "encrypt": setup.sealing == "aes-gcm",
            }
        cfg = load_config(None, overrides, env={})
        self.cache = self.make_cache(
            cfg,
            store=self.store,
            stream_factory=self.streams.factory,
            clock=lambda: self.clock,
            agreement=agreement,
        )
        self.loop = self.cache.controller.storage.loop
        self.posts = HeldPosts(self.cache.controller.storage.store_loop)
        self.skew = (
            0.0  # under TP: this rank's scheduler reads its clock later (tp_sim.py)
        )
        self.tp = self.cache.agreement.world_size > 1
        self.skews = random.Random(f"{seed}/{self.cache.agreement.rank}")
        if self.tp:
            self.cache.prefetcher.clock = lambda: self.clock + self.skew
        vocab = 6 if ps == 1 else 50
        self.bases = [
            np.array([self.rng.randrange(vocab) for _ in range(self.max_len)])
            for _ in range(4)
        ]
        self.vocab = vocab
        self.waiting: dict[str, Req] = {}
        self.running: dict[str, Req] = {}
        self.next_id = 0
        self.log: list[str] = []
        self.stray: list[
            str
        ] = []  # store-page copies into host pages no prefetch owned (parts.py)
        if setup.store_pages > 1:
            watch_copies(self.cache, self.stray)

    def make_cache(self, config, **parts) -> TieredCache:
        """The cache under test, on the simulator's streams, store and clock."""
        return TieredCache(config, **parts)

    # -- plumbing -----------------------------------------------------------------------------

    def settle(self) -> None:
        self.posts.release()
        settle(self.cache)

    def note(self, what: str) -> None:
        self.log.append(what)

    def check(self) -> None:
        if self.stray:
            raise Violation(self.stray[0])
        self.cache.tree.sanity_check()
        self.cache.check_accounting()

    # -- actions ------------------------------------------------------------------------------

    def step(self) -> None:
        if self.tp:
            self.skew = self.skews.choice([0.0, 0.5, 1.0])
        r = self.rng.random()
        if r < 0.14:
            self.arrive()
        elif r < 0.34:
            self.forward()
        elif r < 0.46:
            self.poll()
        elif r < 0.62:
            self.resolve_transfer()
        elif r < 0.80:
            self.resolve_store()
        elif r < 0.86:
            self.abort()
        elif r < 0.90:
            self.clock += self.rng.choice([0.1, 0.5, 2.0])
            self.note(f"tick -> {self.clock}")
        elif r < 0.94:
            n = self.rng.randrange(1, 3 * self.setup.page_size + 2)
            self.note(f"evict {n}")
            self.cache.evict(n)
        elif r < 0.96:
            self.flush()
        elif r < 0.98:
            what = self.misuse()
            if what:
                self.note(f"misuse refused: {what}")
        else:
            self.poll()
        self.settle()
        self.check()

    def misuse(self) -> str | None:
        """One call a buggy engine makes, refused with nothing changed (misuse.py)."""
        return misuse(self)

    def arrive(self) -> None:
        if len(self.waiting) + len(self.running) >= 3:
            return
        ps = self.setup.page_size
        base, keep = self._base()
        extra = [
            self.rng.randrange(self.vocab)
            for _ in range(self.rng.randrange(1, 2 * ps + 2))
        ]
        tokens = np.concatenate([base[:keep], np.array(extra, dtype=np.int64)])[
            : self.max_len
        ]
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = self._request(rid, tokens)
        self.note(f"arrive {rid} len={len(tokens)} shared={keep}")
        self._acquire(req)

    def _base(self) -> tuple[np.ndarray, int]:
        """The tokens a new request starts from, and how many of them it keeps."""
        ps = self.setup.page_size
        base = self.rng.choice(self.bases)
        return base, self.rng.randrange(0, self.max_len // ps + 1) * ps

    def _request(self, rid: str, tokens: np.ndarray) -> Req:
        """A request of `tokens`, with their reference KV."""
        return Req(rid, tokens, reference_kv(tokens))

    def _acquire(self, req: Req) -> None:
        got = self.cache.acquire(req.tokens, req.rid)
        if not got.ready:
            self.waiting[req.rid] = req
            self.note(f"  {req.rid} waits for its prefetch")
            return
        self.waiting.pop(req.rid, None)
        req.row, req.pos = got.indices, got.indices.numel()
        if got.device_hit + got.host_hit + got.storage_hit != req.pos:
            raise Violation(
                f"{req.rid}: hits {got.device_hit}+{got.host_hit}+{got.storage_hit} != {req.pos}"
            )
        more = self._take(req, got)
        self.running[req.rid] = req
        self.note(
            f"  {req.rid} acquired {req.pos} (device {got.device_hit}, host {got.host_hit}, "
            f"store {got.storage_hit}{more})"
        )

    def _take(self, req: Req, got) -> str:
        """What `req` takes from `got` besides its row, checked; the acquire note's tail."""
        return ""

    def poll(self) -> None:
        ready = self.cache.poll()
        self.note(f"poll -> ready {ready}")
        for rid in ready:
            if rid in self.waiting:
                req = self.waiting[rid]
                if self.rng.random() < 0.1:  # its prompt changed while it waited
                    req = self.waiting[rid] = self._changed(req)
                    self.note(f"  {rid} changed: len={len(req.tokens)}")
                self._acquire(req)

    def forward(self) -> None:
        """One forward over one to three running requests, a chunk of each, as an engine's
        batch: one `begin_forward`, every layer waited for, read and written for each."""
        batch = self._batch("pool")  # (request, tokens this forward, its new slots)
        if not batch:
            return
        waiter = self._begin(batch)
        for layer in range(
            LAYERS
        ):  # a failed load never stops the forward: failed() names it after
            self._land_or_not(list(waiter.loads.values()))
            waiter.wait_layer(layer)
            for req, n, own in batch:
                if (
                    req.rid not in waiter.bad
                ):  # a noted failure: the bytes are garbage, never used
                    self._read_check(req, layer)
                k, v = req.ref[layer]
                self.cache.pool.set_kv(
                    layer, own, k[req.pos : req.pos + n], v[req.pos : req.pos + n]
                )
            self._overlap(layer)
        failed = waiter.failed()
        for req, n, own in batch:
            row = torch.cat([req.row, own])
            if req.rid in failed:
                self.note(
                    f"  {req.rid}: its load failed ({waiter.bad.get(req.rid, 'after its last layer')}); abort"
                )
                req.row = row
                self._abort(req)
                continue
            req.row, req.pos = row, req.pos + n
            if req.pos < len(req.tokens) and self.rng.random() < 0.8:
                canon = self.cache.cache_unfinished(
                    req.rid, req.tokens[: req.pos], req.row
                )
                req.row = torch.cat([canon, req.row[canon.numel() :]])
                self.note(f"  {req.rid} keeps {canon.numel()}")
            elif req.pos == len(req.tokens):
                del self.running[req.rid]
                try:
                    self.cache.cache_finished(req.rid, req.tokens, req.row)
                    self.note(f"  {req.rid} finished")
                except TransferError as exc:
                    self.note(f"  {req.rid} finish refused: {exc}")

    def _batch(self, pools: str) -> list[tuple]:
        """A forward's batch: one to three running requests, each with a chunk, as
        (request, tokens, `_slots`' new slots); a request its `pools` have no room for is
        aborted instead. Empty when none runs."""
        if not self.running:
            return []
        batch = []
        for rid in self.rng.sample(
            sorted(self.running), self.rng.randint(1, min(3, len(self.running)))
        ):
            req = self.running[rid]
            n = min(
                len(req.tokens) - req.pos,
                self.rng.randrange(1, 3 * self.setup.page_size + 1),
            )
            got = self._slots(req, n)
            if got is None:
                self.note(f"forward {req.rid}: {pools} exhausted, abort")
                self._abort(req)
            else:
                batch.append((req, n, got))
        return batch

    def _begin(self, batch: list[tuple]):
        """The batch's forward begun: its waiter, whose loads the simulator lands."""
        waiter = self.cache.begin_forward([b[0].rid for b in batch])
        waiter.timeout_s = 0.0  # the simulator decides whether a copy lands in time
        self.note(
            "forward "
            + ", ".join(f"{r.rid} [{r.pos}, {r.pos + n})" for r, n, *_ in batch)
            + f" loads={len(waiter.loads)}"
        )
        return waiter

    def _overlap(self, layer: int) -> None:
        """An overlap scheduler: the next step may run during this forward."""
        if self.rng.random() < 0.15:
            self.note(f"  mid-forward after layer {layer}:")
            self.poll() if self.rng.random() < 0.6 else self.arrive()

    def _slots(self, req: Req, n: int) -> torch.Tensor | None:
        """New slots for tokens [pos, pos + n) of `req`, or None when the pool is short."""
        grown = self._grow(req.pos, req.row, n, self.cache.alloc)
        return None if grown is None else grown[:n]

    def _grow(self, pos: int, row: torch.Tensor, n: int, alloc) -> torch.Tensor | None:
        """Slots for `n` tokens after the `pos` of `row`: the rest of its last page, then
        `alloc`'s pages (with their tail), or None when `alloc` is short."""
        ps = self.setup.page_size
        room = (ps - pos % ps) % ps if row.numel() else 0
        last = int(row[-1]) if row.numel() else 0
        first = torch.arange(last + 1, last + 1 + min(room, n), dtype=torch.int64)
        rest = n - first.numel()
        more = alloc(rest) if rest else torch.empty(0, dtype=torch.int64)
        return None if more is None else torch.cat([first, more])

    def _land_or_not(self, handles) -> None:
        """Before a layer is read, each of its loads still pending lands, fails, or not."""
        f = self.faults
        for job in [j for j in self.streams.pending if j.handle in handles]:
            if f.random() < 0.75:
                outcome = (
                    "ok"
                    if f.random() < 0.8
                    else f.choice(["fail_before", "fail_after"])
                )
                self.note(f"  load lands: {outcome}")
                self.streams.resolve(job, outcome, f)
            else:
                self.note("  load left pending (the forward gives up on it)")

    def _read_check(self, req: Req, layer: int) -> None:
        if req.pos == 0:
            return
        k_ref, v_ref = req.ref[layer]
        slots = req.row[: req.pos]
        k = self.cache.pool.k_buffer(layer)[slots]
        v = self.cache.pool.v_buffer(layer)[slots]
        bad = ~(
            (k == k_ref[: req.pos]).all(-1).all(-1)
            & (v == v_ref[: req.pos]).all(-1).all(-1)
        )
        if bad.any():
            first = int(torch.nonzero(bad)[0])
            raise Violation(
                f"WRONG KV: {req.rid} layer {layer} read {int(bad.sum())} wrong tokens of {req.pos}, "
                f"first at token {first} (slot {int(slots[first])})"
            )

    def abort(self) -> None:
        pool = sorted(self.running) + sorted(self.waiting)
        if not pool:
            return
        rid = self.rng.choice(pool)
        req = self.running.get(rid) or self.waiting.get(rid)
        self.note(f"abort {rid}")
        self._abort(req)
        if self.rng.random() < 0.3:  # a server retrying the request, under the same id
            again = (
                self._changed(req)
                if self.rng.random() < 0.3
                else self._request(rid, req.tokens)
            )
            self.note(f"retry {rid} len={len(again.tokens)}")
            self._acquire(again)

    def _changed(self, req: Req) -> Req:
        """The request under the same id with its prompt changed: a page on, one off, or its
        last page's tokens other ones."""
        ps, tokens = self.setup.page_size, req.tokens
        page = np.array(
            [self.rng.randrange(self.vocab) for _ in range(ps)], dtype=np.int64
        )
        how = self.rng.randrange(3) if len(tokens) > ps else 0
        tokens = [
            np.concatenate([tokens, page]),
            tokens[:-ps],
            np.concatenate([tokens[:-ps], page]),
        ][how]
        return self._request(req.rid, tokens)

    def _abort(self, req: Req) -> None:
        self.running.pop(req.rid, None)
        self.waiting.pop(req.rid, None)
        self.cache.abort(req.rid, req.row if req.row.numel() else None)

    def resolve_transfer(self) -> None:
        if not self.streams.pending:
            return
        job = self.faults.choice(self.streams.pending)
        outcome = self.faults.choice(
            ["ok", "ok", "ok", "ok", "fail_before", "fail_after"]
        )
        self.note(f"transfer {job.stream}: {outcome}")
        self.streams.resolve(job, outcome, self.faults)

    def resolve_store(self) -> None:
        self.settle()
        if not self.store.pending:
            return
        f = self.faults
        call = f.choice(self.store.pending)
        if call.timed_out and f.random() < 0.7:
            return  # a call that ran out of time lingers: its buffers may be reused meanwhile
        if not call.timed_out and f.random() < 0.2 and self.store.fire_deadline(call):
            self.note(f"store {call.op} x{len(call.keys)}: times out (still running)")
            return
        outcome = f.choice(
            [
                "ok",
                "ok",
                "ok",
                "ok",
                "error",
                "corrupt",
                "truncate",
                "swap",
                "false_failure",
                "miss",
            ]
        )
        self.note(
            f"store {call.op} x{len(call.keys)}: {outcome}{' (late)' if call.timed_out else ''}"
        )
        if call.op == "get_into" and outcome != "error":
            self._check_owned(call)
        self.store.resolve(call, outcome, f)

    def _check_owned(self, call) -> None:
        """A read may write only into host pages still reserved by a prefetch that has not
        settled (page_first reads of single pages go straight into mirror pages; store pages
        of several pages land in buffers of their own, outside the mirror)."""
        mirror = self.cache.mirror
        if mirror.config.layout != "page_first":
            return
        base, end = (
            mirror.data.data_ptr(),
            mirror.data.data_ptr() + mirror.data.numel() * mirror.data.element_size(),
        )
        addresses = [np.frombuffer(v, dtype=np.uint8).ctypes.data for v in call.args[1]]
        pages = {(a - base) // mirror.page_bytes for a in addresses if base <= a < end}
        ctl = self.cache.controller
        owned = set()
        for op in ctl.prefetch_ops():
            if op.host_pages is not None:
                owned |= set(op.host_pages[op.inserted :].tolist())
        if not pages <= owned:
            raise Violation(
                f"a store read {'that timed out ' if call.timed_out else ''}is about to write host "
                f"pages {sorted(pages - owned)} that no prefetch owns any more"
            )

    def flush(self) -> None:
        self.note("flush")
        self._auto(lambda: self._flush_if_free())

    def _flush_if_free(self) -> None:
        try:
            self.cache.flush()
        except ValueError as exc:
            if "locked" not in str(exc):
                raise

    def _auto(self, fn) -> None:
        """Run `fn` (which drains) with every copy and store call answered as it comes."""
        self.settle()
        self.streams.auto = random.Random(self.faults.random())
        self.store.auto = random.Random(self.faults.random())
        self.posts.free = True
        try:
            self.streams.resolve_all(self.streams.auto)
            self.store.resolve_all(self.store.auto)
            self.settle()
            fn()
        finally:
            self.streams.auto = self.store.auto = None
            self.posts.free = False

    def _check_live(self) -> None:
        """Once every copy and store call is answered, every waiting request is named ready
        within a few polls: none waits forever."""

        def named() -> None:
            for _ in range(20):
                for rid in self.cache.poll():
                    if rid in self.waiting:
                        self._acquire(
                            self.waiting[rid]
                        )  # may wait again, on a new prefetch
                if not self.waiting:
                    return
                self.settle()
                self.streams.resolve_all(self.streams.auto)
                self.store.resolve_all(self.store.auto)
                self.settle()
            raise Violation(
                f"waiting requests {sorted(self.waiting)} are never named ready"
            )

        self._auto(named)

    def stop(self) -> None:
        """After a violation: the cache's threads stopped, every copy and store call
        answered, whatever state the cache is in (nothing is checked)."""
        try:
            self._auto(self.cache.controller.close)
        except Exception:
            pass

    def close(self) -> None:
        self.note("close")
        self._check_live()
        for req in list(self.running.values()) + list(self.waiting.values()):
            self._abort(req)
        self._auto(self.cache.close)
        self.check()
        ctl = self.cache.controller
        if (
            self.cache.slots.device_free() != self.cache.config.pool.size
            or ctl.host_available() != self.cache.mirror.size
        ):
            raise Violation(
                f"after close: device free {self.cache.slots.device_free()}/"
                f"{self.cache.config.pool.size}, host free {ctl.host_available()}/{self.cache.mirror.size}"
            )


def player(
    allow_kernel: bool = False, setups: list[Setup] | None = None, actions=None
) -> Player:
    """The own cache's episodes: episode k takes the k-th of `setups` (round robin), or
    draws its setup from its seed."""

    def one(k: int, ep_seed: int, n: int) -> tuple[Setup, Failure | None]:
        if setups:
            setup = setups[k % len(setups)]
        else:
            setup = Setup.draw(random.Random(ep_seed), allow_kernel)
        return setup, play(FaultSim(ep_seed, setup), n, actions)

    return Player(one)


def run(
    steps: int,
    seed: int,
    episode: int = 400,
    allow_kernel: bool = False,
    out=None,
    setups: list[Setup] | None = None,
    actions=None,
) -> int:
    """Run `steps` steps in episodes of `episode` steps; returns the number of violations.
    Each episode draws its setup from its seed, or takes the next of `setups`. `actions`,
    a text file or None, receives every episode's action log (`write_actions`)."""
    own = player(allow_kernel, setups, actions)
    return run_episodes(schedule(steps, seed, episode), own, out)
