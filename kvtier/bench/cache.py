"""Replay a synthetic multi-turn trace through TieredCache as a server's scheduler does
(several requests in flight, parked while their prefetch runs): hit rate per tier against
the infinite-cache bound measured in the same run, and the scheduler thread's CPU time
inside kvtier per request against SGLang 0.5.23's own device prefix cache (RadixCache,
ReqToTokenPool, its token allocator: `kvtier/bench/cache_arms.py`) on the same trace and
pool size. kvtier runs twice: with all tiers (a 2x host mirror, the file store; `--store
memory` for an in-process one, which separates the file store's threads from the
tiering's own price) and device only. The arms take turns, `--rounds` times; each figure
is the median of its rounds. The ratio is also printed round by round, each round's kvtier
against that round's baseline: on a noisy machine the spread says how far to trust the
median. Where SGLang cannot be loaded the last line says so and measures against a bare
RadixTree's match+insert of the same requests.

Device pool ~10% of the working set. Wall time inside kvtier (printed for the last round)
is its CPU time plus time runnable but waiting for a core (Linux schedstat, printed): on a
small machine kvtier's own storage and copy threads take cores from the scheduler.
The file store creates a file per page and the run deletes them all at its end. On ext4,
creating a file skips inodes freed in the last few minutes (the kernel reads each one's
deletion time), so back-to-back runs slow each other's store down, and with it, on a
small machine, the scheduler. To time kvtier alone, put the store on tmpfs: TMPDIR=/dev/shm.

kvtier's own threads run on every CPU but the first (`controller.cpus`), as a server that
gives its scheduler a core would set it: where they share the scheduler's core, each of its
calls runs on caches they left cold (about 1.3x the scheduler's time on 2 cores). `--kvtier-cpus all`
lets them run anywhere, to compare.
Run: python benchmarks/cache.py --page-size 1   (or: tierctl bench cache --page-size 16)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import threading
import time
from collections import deque

import numpy as np
import torch

from kvtier.bench.cache_arms import bare_tree, sglang_device, sglang_unavailable
from kvtier.bench.trace import multiturn
from kvtier.cache import TieredCache
from kvtier.config import load_config
from kvtier.storeio.cpus import allowed_cpus, format_cpu_list
from kvtier.errors import KvtierConfigError
from kvtier.tree import RadixKey, RadixTree


def infinite_bound(trace, page: int) -> tuple[float, int]:
    """(hit rate of a cache that never evicts, tokens it ends up holding)."""
    tree = RadixTree(page_size=page)
    hit = total = 0
    slot = page
    for t in trace:
        hit += tree.match_prefix(RadixKey(t.prompt)).device_slots.size
        total += len(t.prompt)
        full = np.concatenate([t.prompt, t.output])
        full = full[: len(full) - len(full) % page]
        tree.insert(RadixKey(full), torch.arange(slot, slot + len(full)))
        slot += len(full)
    return hit / total, tree.total_size()


class Scheduler:
    """A server's scheduler loop over the trace, `in_flight` requests at a time: one `poll()`
    per step; requests whose prefetch runs stay parked while the others run; the ready ones
    share one forward (alloc, per-layer waits); each finishes with its prompt and output
    (`cache_finished`, as after decoding). `inside` sums the wall time of every kvtier call
    except naps: `wait_progress` when nothing can run (a server would sleep or run decode)."""

    def __init__(self, cache: TieredCache, trace, in_flight: int) -> None:
        self.cache, self.trace, self.in_flight = cache, trace, in_flight
        self.inside = self.naps = self.cpu = 0.0
        self.by_call: dict[str, list[float]] = {}  # API call -> [wall, cpu, calls]
        self.hits = [0, 0, 0]
        self.requests = 0
        self.runqueue: float | None = (
            None  # seconds runnable but off-CPU over the loop (Linux)
        )
        self.polls = self.polls_idle = self.polls_deferred = (
            0  # the cache's own counts (completions.py)
        )
        self.threads: dict[
            str, float
        ] = {}  # kvtier's own threads: CPU seconds by name (`_threads_cpu`)

    def _call(self, fn, *args):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            self.inside += wall
            self.cpu += cpu
            row = self.by_call.setdefault(fn.__name__, [0.0, 0.0, 0])
            row[0] += wall
            row[1] += cpu
            row[2] += 1

    def run(self) -> None:
        start_wait = _runqueue_seconds()
        try:
            self._loop()
        finally:
            end_wait = _runqueue_seconds()
            self.runqueue = (
                None
                if start_wait is None or end_wait is None
                else end_wait - start_wait
            )

    def _loop(self) -> None:
        cache = self.cache
        queue = deque(enumerate(self.trace))
        parked: dict[str, tuple[int, object]] = {}
        busy: set[int] = (
            set()
        )  # sessions with a turn in flight: the next turn waits for it
        while queue or parked:
            runnable = []
            for rid in self._call(cache.poll):
                if rid in parked:
                    i, t = parked.pop(rid)
                    runnable.append((rid, t, self._call(cache.acquire, t.prompt, rid)))
            while (
                queue
                and len(parked) + len(runnable) < self.in_flight
                and queue[0][1].session not in busy
            ):
                i, t = queue.popleft()
                rid = f"r{i}"
                busy.add(t.session)
                got = self._call(cache.acquire, t.prompt, rid)
                if got.ready:
                    runnable.append((rid, t, got))
                else:
                    parked[rid] = (i, t)
            if not runnable:
                start = time.perf_counter()
                cache.wait_progress()
                self.naps += time.perf_counter() - start
                continue
            batch = []
            for rid, t, got in runnable:
                mine = self._call(
                    cache.alloc, len(t.prompt) + len(t.output) - got.indices.numel()
                )
                if (
                    mine is None
                ):  # no room while the others hold theirs: this one goes back
                    self._call(cache.abort, rid)
                    queue.appendleft((int(rid[1:]), t))
                    busy.discard(t.session)
                    continue
                batch.append((rid, t, got, torch.cat([got.indices, mine])))
            if (
                not batch
            ):  # writes in flight lock device pages until polled: wait for them
                if not cache.busy() and len(runnable) == 1:
                    raise RuntimeError("device pool too small for one request")
                start = time.perf_counter()
                cache.wait_progress()
                self.naps += time.perf_counter() - start
                continue
            waiter = self._call(cache.begin_forward, [rid for rid, *_ in batch])
            for layer in range(cache.pool.num_layers):
                self._call(waiter.wait_layer, layer)
            for rid, t, got, kv in batch:
                self._call(
                    cache.cache_finished, rid, np.concatenate([t.prompt, t.output]), kv
                )
                busy.discard(t.session)
                self.hits = [
                    self.hits[0] + got.device_hit,
                    self.hits[1] + got.host_hit,
                    self.hits[2] + got.storage_hit,
                ]
                self.requests += 1


def _threads_cpu(before: set[threading.Thread]) -> dict[str, float]:
    """CPU seconds of the cache's own threads alive now (storage loop, store I/O, copy
    workers), summed by name without its number; threads alive `before` the cache was
    made belong to another (an earlier cache's I/O thread abandoned stuck, in a test). The
    process's shared helper for copies of 4 MiB and more (`kvtier-copy`, none in this
    trace) outlives a cache: not counted."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if (
            not t.name.startswith("kvtier-")
            or t.name.startswith("kvtier-copy")
            or t.ident is None
            or t in before
        ):
            continue
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (
            OSError,
            AttributeError,
        ):  # gone meanwhile, or no per-thread clocks here
            continue
        name = t.name.rstrip("0123456789").rstrip("_")
        out[name] = out.get(name, 0.0) + cpu
    return out


def _runqueue_seconds() -> float | None:
    """Time this thread has spent runnable but waiting for a CPU core (Linux schedstat), or
    None where the kernel does not say."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


STORES = ("file", "memory")


def kvtier_cpus(choice: str) -> str | None:
    """`controller.cpus` for the run: "auto" = every CPU this process may use but the
    first (none kept on a single CPU), "all" = no confinement, else a CPU list."""
    if choice == "all":
        return None
    if choice != "auto":
        return choice
    allowed = sorted(allowed_cpus() or ())
    return format_cpu_list(allowed[1:]) if len(allowed) >= 2 else None


STORE_PAGE_TOKENS = (
    16  # the store page the bench gives a smaller device page (`store.page_tokens`)
)


def store_page_tokens(page: int, tokens: int | None) -> int:
    """`store.page_tokens` for a run: `tokens`, or STORE_PAGE_TOKENS rounded up to whole pages."""
    if tokens is None:
        return -(-STORE_PAGE_TOKENS // page) * page
    if (
        isinstance(tokens, bool)
        or not isinstance(tokens, int)
        or tokens < 1
        or tokens % page
    ):
        raise KvtierConfigError(
            f"--store-page-tokens {tokens!r}: must be a positive multiple of --page-size {page}"
        )
    return tokens


def _config(
    size: int,
    page: int,
    store_root: str | None,
    cpus: str,
    store: str = "file",
    page_tokens: int | None = None,
):
    """All tiers (a 2x host mirror, then the file store at `store_root` or, with `store`
    "memory", an in-process dict; store pages of `page_tokens`) or, with no root, the
    device pool alone."""
    tiers = store_root is not None
    backend = (
        {"backend": "file", "root": store_root, "capacity_bytes": 1 << 34}
        if store == "file"
        else {"backend": "memory", "capacity_bytes": 1 << 34}
    )
    backend["page_tokens"] = page_tokens
    return load_config(
        None,
        {
            "pool": {
                "size": size,
                "num_layers": 2,
                "page_size": page,
                "num_kv_heads": 1,
                "head_dim": 16,
                "dtype": "float16",
            },
            "mirror": {"ratio": 2.0, "layout": "page_first"} if tiers else None,
            "controller": {
                "write_policy": "write_through",
                "prefetch_policy": "wait_complete",
                "cpus": kvtier_cpus(cpus),
            },
            "store": backend if tiers else {"backend": "none"},
        },
        env={},
    )


def kvtier_arm(
    trace,
    size: int,
    page: int,
    in_flight: int,
    cpus: str,
    tiers: bool,
    store: str = "file",
    page_tokens: int | None = None,
) -> tuple[Scheduler, object]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(size, page, tmp if tiers else None, cpus, store, page_tokens)
        before = set(threading.enumerate())
        cache = TieredCache(cfg)
        sched = Scheduler(cache, trace, in_flight)
        try:
            sched.run()
            cache.check_accounting()
            c = cache.stats_obj.counters
            sched.polls, sched.polls_idle, sched.polls_deferred = (
                c.polls,
                c.polls_idle,
                c.polls_deferred,
            )
            sched.threads = _threads_cpu(before)
        finally:
            cache.close()
    return sched, cfg


def run(
    sessions: int = 150,
    turns: int = 6,
    page: int = 16,
    rounds: int = 3,
    device_fraction: float = 0.10,
    in_flight: int = 8,
    cpus: str = "auto",
    sglang: bool = True,
    store: str = "file",
    page_tokens: int | None = None,
) -> dict:
    page_tokens = store_page_tokens(page, page_tokens)
    trace = multiturn(
        sessions=sessions,
        turns=turns,
        system_prompts=6,
        system_len=512,
        msg_len=(32, 200),
        seed=3,
    )
    bound, working_set = infinite_bound(trace, page)
    longest = max(len(t.prompt) + len(t.output) for t in trace)
    # room for two of the longest requests: one that cannot fit alone would be aborted and
    # retried forever (a small --sessions gives a pool of ~1k tokens, below one long turn)
    size = max(
        page * 64,
        -(-2 * longest // page) * page,
        int(working_set * device_fraction) // page * page,
    )
    why_not = sglang_unavailable() if sglang else "not asked for (--baseline bare)"
    if store not in STORES:
        raise ValueError(f"store={store!r}: allowed are {', '.join(STORES)}")
    arms = {
        "kvtier": lambda: kvtier_arm(
            trace,
            size,
            page,
            in_flight,
            cpus,
            tiers=True,
            store=store,
            page_tokens=page_tokens,
        ),
        "device": lambda: kvtier_arm(trace, size, page, in_flight, cpus, tiers=False),
        "bare": lambda: bare_tree(trace, page),
    }
    if why_not is None:
        arms["sglang"] = lambda: sglang_device(trace, size, page, in_flight)
    cpu: dict[str, list[float]] = {k: [] for k in arms}
    last: dict[str, object] = {}
    for _ in range(
        rounds
    ):  # the arms take turns, round after round, on the same minutes
        for name, arm in arms.items():
            gc.collect()  # the previous arm's garbage is not collected on this arm's clock
            last[name] = out = arm()
            spent = out[0].cpu if isinstance(out, tuple) else out.cpu
            cpu[name].append(spent)
    sched, cfg = last["kvtier"]
    n = len(trace)
    per = {k: statistics.median(v) / n for k, v in cpu.items()}
    prompt_tokens = sum(len(t.prompt) for t in trace)
    rates = [x / prompt_tokens for x in sched.hits]
    total = sum(rates)
    print(
        f"{n} requests ({in_flight} in flight), page {page}, {prompt_tokens} prompt tokens, working set "
        f"{working_set} tokens, device pool {size} tokens ({size / working_set:.0%}), mirror 2x, {store} store "
        f"(store pages of {page_tokens} tokens); "
        f"{rounds} alternating rounds, medians; kvtier's threads on CPUs {cfg.controller.cpus or 'any'}"
    )
    print(
        f"hit rate: device {rates[0]:.3f} + host {rates[1]:.3f} + storage {rates[2]:.3f} = {total:.3f} "
        f"(infinite cache {bound:.3f})"
    )
    print(
        f"scheduler time inside kvtier, all tiers (last round): {sched.inside / n * 1e3:.3f} ms per request wall, "
        f"CPU {sched.cpu / n * 1e3:.3f} ms (naps while only parked requests remained, excluded: "
        f"{sched.naps / n * 1e3:.2f} ms)"
    )
    if sched.runqueue is not None:
        print(
            f"scheduler thread waiting for a CPU core (runqueue, whole loop): {sched.runqueue / n * 1e3:.3f} ms "
            f"per request"
        )
    if sched.threads:
        print(
            "kvtier's own threads, CPU per request (last round, on CPUs "
            f"{cfg.controller.cpus or 'any'}): "
            + ", ".join(
                f"{name} {cpu / n * 1e3:.3f} ms"
                for name, cpu in sorted(sched.threads.items())
            )
        )
    print(
        f"polls per request: {sched.polls / n:.1f} ({sched.polls_idle / n:.1f} found nothing moved, "
        f"{sched.polls_deferred / n:.1f} only finished copies or backups, left for a later poll)"
    )
    print(
        "per request, wall (CPU) ms: "
        + ", ".join(
            f"{name} {w / n * 1e3:.3f} ({c / n * 1e3:.3f})"
            for name, (w, c, _) in sched.by_call.items()
        )
    )
    sg = (
        f"SGLang RadixCache + pools {per['sglang'] * 1e3:.3f} ms"
        if "sglang" in per
        else f"SGLang: {why_not}"
    )
    print(
        f"scheduler CPU per request: kvtier all tiers {per['kvtier'] * 1e3:.3f} ms, kvtier device only "
        f"{per['device'] * 1e3:.3f} ms, {sg}, bare RadixTree match+insert {per['bare'] * 1e3:.3f} ms"
    )
    base, label = (
        (per["sglang"], "SGLang device-only")
        if "sglang" in per
        else (per["bare"], "bare tree")
    )
    rounds_ratio = [
        k / b
        for k, b in zip(cpu["kvtier"], cpu["sglang" if "sglang" in per else "bare"])
    ]
    print(
        "scheduler ratio round by round (each against the baseline of its own round): "
        + " / ".join(f"{r:.2f}x" for r in rounds_ratio)
    )
    print(f"device only: kvtier {per['device'] / base:.2f}x {label}")
    print(
        f"cache: hit rate {total / bound:.3f}x bound, scheduler {per['kvtier'] / base:.2f}x {label}"
    )
    return {
        "rates": rates,
        "bound": bound,
        "cpu_ms_per_request": {k: v * 1e3 for k, v in per.items()},
        "scheduler_ratio": per["kvtier"] / base,
        "device_ratio": per["device"] / base,
        "baseline": label,
        "hit_ratio": total / bound,
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--sessions", type=int, default=150)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument(
        "--in-flight",
        type=int,
        default=8,
        help="requests the scheduler keeps in flight",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=16,
        help="tokens per page (1 and 16 are the targets)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds of every arm"
    )
    p.add_argument(
        "--baseline",
        choices=("sglang", "bare"),
        default="sglang",
        help="sglang: SGLang's own RadixCache where it loads (else the bare tree); bare: the bare tree",
    )
    p.add_argument(
        "--store",
        choices=STORES,
        default="file",
        help="the all-tiers arm's store: file (the default, one file per page) or memory (in-process: "
        "what the tiering costs without the file store's I/O thread)",
    )
    p.add_argument(
        "--store-page-tokens",
        type=int,
        default=None,
        help=f"store.page_tokens of the all-tiers arm: a multiple of the page size (default "
        f"{STORE_PAGE_TOKENS} tokens rounded up to whole pages)",
    )
    p.add_argument(
        "--kvtier-cpus",
        default="auto",
        help="controller.cpus: auto (all but the first CPU), all (anywhere), or a list such as 1-3",
    )
    args = p.parse_args(argv)
    run(
        args.sessions,
        args.turns,
        page=args.page_size,
        rounds=args.rounds,
        in_flight=args.in_flight,
        cpus=args.kvtier_cpus,
        sglang=args.baseline == "sglang",
        store=args.store,
        page_tokens=args.store_page_tokens,
    )


if __name__ == "__main__":
    main()
