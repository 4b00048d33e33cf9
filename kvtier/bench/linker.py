"""kvtier's SGLang linker against SGLang's own HiCache, like for like: SGLang 0.5.23's
`UnifiedRadixCache` (its Rust tree core) driven through the calls its scheduler makes per
request, on CPU, with

1. no tiers (the device pool alone),
2. HiCache's host tier,
3. HiCache's host tier + SGLang's `file` L3 backend,
4. kvtier's linker, host tier only,
5. kvtier's linker, host tier + kvtier's file store,
6. kvtier's own `TieredCache` (its own tree), host tier + file store (`kvtier/bench/cache.py`'s
   scheduler loop),
7. the linker floor: SGLang's linker seam with the smallest correct linker (`FloorLinker`:
   every offload accepted and complete at once, nothing copied or kept, every lookup a
   miss), so its figure is what SGLang's own side of the seam costs with kvtier free,

on the same trace (the first `--requests` of `benchmarks/cache.py`'s, seed 3), the same device
pool (10% of the working set), host tier 2x the device pool, write-through, store directories
of the same kind (tmpfs when /dev/shm exists). The arms take turns, round after round; each
figure is the median of its rounds of the scheduler thread's CPU time per request
(`time.thread_time` around every cache call), with the process's CPU time beside it (which
adds the store and copy threads).

Per batch of up to `--in-flight` requests: each request is matched (`match_kv_cache`: the
linker's lookup), pinned, given its row, loaded back when it hit below the device
(`init_load_back`: the linker's load; HiCache's host -> device), and locked; HiCache with
the file backend first prefetches from L3 (`prefetch_from_storage`, then
`check_prefetch_progress` until done: the wait_complete policy; naps between polls are not
counted). Then the batch starts its loads (`ready_to_load_host_cache`), allocates its slots
(`alloc_token_slots` / `alloc_paged_token_slots_extend`), runs the forward's per-layer
waits (the KV pool's layer counter), checks its loads (`finish_external_linker_loads`), and
each request is released into the tree (`release_kv_cache`, which offloads: write-through);
`check_hicache_events` runs once per step.

HiCache needs four CPU stand-ins (`kvtier/bench/hicache_cpu.py`), which this benchmark
applies to its own process: its copy kernels become free no-ops, which flatters HiCache.
Without SGLang the benchmark says so and exits 0.

`--hybrid swa` / `--hybrid mamba` run SGLang's hybrid cache instead (FULL+SWA: `SWAKVPool`, a
128-token window; FULL+MAMBA: `HybridLinearKVPool` beside `HybridReqToTokenPool`'s Mamba2
states), its pools built as SGLang's test kit builds them and its tree as the server does,
with every arm but TieredCache (it has no hybrid pools) and the same trace, pools, host ratio
and write policy. A Mamba state is cached where a finished request's forward last tracked it
(the chunk grid: 64 tokens or the page), so a length restores only there; the loop, like the
Full one, inserts a request only when it finishes, so the state a server's prefill tracks at
a branching point (a shared system prompt's end) is not modelled, and a trace of first turns
(the first 150 requests) restores no Mamba prefix in any arm.

Run: python benchmarks/linker.py --page-size 1 --page-size 16   (--requests 60 for a quick run)
     python benchmarks/linker.py --hybrid swa --hybrid mamba --page-size 16
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from array import array
from dataclasses import dataclass

import numpy as np
import torch
import yaml

from kvtier.bench.cache import kvtier_arm, infinite_bound, store_page_tokens
from kvtier.bench.hicache_cpu import Shims
from kvtier.bench.trace import multiturn
from kvtier.testing import sglang_loader

ARMS = (
    "sglang",
    "hicache",
    "hicache_file",
    "linker",
    "linker_file",
    "tieredcache",
    "linker_floor",
)
LABELS = {
    "sglang": "SGLang, no tiers",
    "hicache": "SGLang HiCache, host",
    "hicache_file": "SGLang HiCache, host + its file L3",
    "linker": "kvtier linker, host",
    "linker_file": "kvtier linker, host + kvtier file store",
    "tieredcache": "kvtier TieredCache (own tree), host + file store",
    "linker_floor": "linker floor: SGLang's seam, kvtier free",
}


def floor_linker(sg):
    """The smallest correct `UnifiedCacheLinker`: every offload accepted and complete at
    once (nothing copied or kept), every lookup a miss, so no load is ever queued. Under
    SGLang's tree its cost is SGLang's own side of the linker seam (the offload
    transfers it builds, the nodes it locks and publishes), the floor under any linker."""
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        UnifiedCacheLinker,
    )

    class FloorLinker(UnifiedCacheLinker):
        def __init__(self, kv) -> None:
            self.pools = {sg.hicache_storage.PoolName.KV: kv}
            self.layer_done_counter = _NoLoads()
            self.forward_stream = None
            self.done = 0  # offloads accepted, not yet popped

        def record_offload_ready(self) -> list:
            return []

        def lookup(self, rid, transfers) -> list[int]:
            return []

        def load(self, rid, transfers) -> bool:
            raise AssertionError("the floor linker restores nothing: no load")

        def start_layer_wise_loading(self) -> int:
            return -1

        def finish_layer_wise_loading(self, counter_index: int) -> bool:
            return True

        def cancel_queued_load(self, rid: str) -> bool:
            return False

        def offload(self, transfers, session_id=None) -> bool:
            self.done += 1
            return True

        def num_completed_offloads(self) -> int:
            return self.done

        def pop_completed_offload(self) -> bool:
            assert self.done > 0, "pop_completed_offload with none completed"
            self.done -= 1
            return True

        def reset(self) -> None:
            self.done = 0

        def close(self) -> None:
            self.done = 0

    return FloorLinker


class _NoLoads:
    """The floor linker's layer counter: no load ever runs, so no layer waits."""

    def set_consumer(self, index: int) -> None:
        pass

    def wait_until(self, layer: int) -> None:
        pass


@dataclass(slots=True)
class ArmRun:
    cpu: float  # scheduler-thread CPU seconds inside the cache, whole trace
    process: float  # process CPU seconds over the same loop (every thread)
    restored: int  # prompt tokens restored from below the device (host or store)
    device_hit: int
    failed_loads: int
    by_call: dict


class UrcArm:
    """SGLang's UnifiedRadixCache over `size` device slots with one of the tiers."""

    def __init__(
        self,
        sg,
        kind: str,
        size: int,
        page: int,
        longest: int,
        in_flight: int,
        root: str,
        hybrid: str | None = None,
    ) -> None:
        self.sg, self.kind, self.page, self.in_flight = sg, kind, page, in_flight
        self.hybrid = hybrid
        if hybrid is not None:
            self._hybrid_cache(hybrid, size, longest)
        else:
            self._full_cache(size, longest)
        TREE_CORES.add(type(self.cache.tree_core).__name__)
        self.kv = self.allocator.get_kvcache()
        self.linker = None
        self.exits: list = []
        if kind.startswith("hicache"):
            self._hicache(root if kind == "hicache_file" else None)
        elif kind == "linker_floor":
            linker = floor_linker(sg)(self.kv)
            self.cache.init_cache_linker(linker)
            self.kv.register_layer_transfer_counter(linker.layer_done_counter)
            self.linker = linker
        elif kind.startswith("linker"):
            self._linker(root if kind == "linker_file" else None)
        sa = sg.server_args
        sa.set_global_server_args_for_scheduler(self._server_args())
        self.by_call: dict[str, list[float]] = {}
        self.cpu = 0.0

    def _server_args(self, **kw):
        args = self.sg.server_args.ServerArgs(
            model_path="dummy", page_size=self.page, **kw
        )
        if self.hybrid is not None:  # what the kit presets for a Mamba model
            args._mamba_cache_chunk_size = self._mamba_chunk()
        return args

    def _mamba_chunk(self) -> int:
        """The Mamba state grid, in tokens: FLA's chunk (64) or the page, as the kit sets."""
        return max(64, self.page)

    # -- building ------------------------------------------------------------------------

    def _full_cache(self, size: int, longest: int) -> None:
        sg, page, in_flight = self.sg, self.page, self.in_flight
        sa = sg.server_args
        sa.set_global_server_args_for_scheduler(
            sa.ServerArgs(model_path="dummy", page_size=page)
        )
        self.r2t = sg.memory_pool.ReqToTokenPool(
            size=in_flight + 1,
            max_context_len=longest + 2 * page,
            device="cpu",
            enable_memory_saver=False,
        )
        kv = sg.memory_pool.MHATokenToKVPool(
            size=size,
            page_size=page,
            dtype=torch.float16,
            head_num=1,
            head_dim=16,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )
        if page == 1:
            self.allocator = sg.allocator.TokenToKVPoolAllocator(
                size, torch.float16, "cpu", kv, False
            )
        else:
            self.allocator = sg.allocator.PagedTokenToKVPoolAllocator(
                size, page, torch.float16, "cpu", kv, False
            )
        params = sg.cache_init_params.CacheInitParams(
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page,
            disable=False,
            tree_components=(sg.component_type.ComponentType.FULL,),
        )
        self.cache = sg.urc.UnifiedRadixCache(params=params)
        self.cache.cache_init_params = params

    def _hybrid_cache(self, hybrid: str, size: int, longest: int) -> None:
        """SGLang's hybrid cache as its test kit builds it (`build_fixture`): 4 layers, the
        full-attention ones 1 and 3, the others sliding-window (`SWAKVPool`, a window of
        `WINDOW` tokens) or Mamba (`HybridReqToTokenPool`'s state pool, one state slot per
        request row and `MAMBA_STATES_PER_ROW` per row for the tree)."""
        sg, page = self.sg, self.page
        CT = sg.component_type.ComponentType
        extra: dict = {}
        if hybrid == "swa":
            extra["sliding_window_size"] = WINDOW
        else:  # a page > 1 needs the extra buffer (the kit's own Mamba configs)
            extra["enable_mamba_extra_buffer"] = page > 1
            extra["mamba_cache_size"] = MAMBA_STATES_PER_ROW * (self.in_flight + 1)
        cfg = sg.cfg.CacheConfig(
            page_size=page,
            components=(CT.FULL, CT.SWA if hybrid == "swa" else CT.MAMBA),
            num_layers=4,
            full_attention_layer_ids=(1, 3),
            kv_size=size,
            max_num_reqs=self.in_flight + 1,
            max_context_len=longest + 2 * page,
            head_num=1,
            head_dim=16,
            dtype=torch.float16,
            **extra,
        )
        kit_cache, self.allocator, self.r2t = sg.fx.build_fixture(cfg)
        # the pools as the kit builds them; the tree as the server builds it (the kit
        # wraps its tree core in a checking inspector and turns the paged allocators'
        # debug checks on)
        params = kit_cache.cache_init_params
        for alloc in (
            self.allocator,
            getattr(self.allocator, "full_attn_allocator", None),
            getattr(self.allocator, "swa_attn_allocator", None),
        ):
            if getattr(alloc, "debug_mode", False):
                alloc.debug_mode = False
        self.cache = sg.urc.UnifiedRadixCache(params=params)
        self.cache.cache_init_params = params

    def _hicache(self, root: str | None) -> None:
        sg = self.sg
        if root is not None:
            for cm in (
                sg.runtime_context.get_parallel().override(
                    tp_rank=0, tp_size=1, pp_rank=0, pp_size=1
                ),
                sg.environ.envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(root),
            ):
                cm.__enter__()
                self.exits.append(cm)
        args = self._server_args(
            hicache_ratio=2.0,
            hicache_io_backend="kernel",
            hicache_write_policy="write_through",
            hicache_storage_backend="file" if root is not None else None,
            hicache_storage_prefetch_policy="wait_complete",
        )
        sg.server_args.set_global_server_args_for_scheduler(args)
        SHIMS.install()
        self.cache.init_hicache(args, self.cache.cache_init_params)
        SHIMS.unpin(self.cache.cache_controller)
        with contextlib.suppress(Exception):
            sg.fx.drop_hicache_atexit_pin(self.cache)

    def _linker(self, root: str | None) -> None:
        from kvtier.bench.cache import kvtier_cpus

        sg = self.sg
        store = (
            {"backend": "none"}
            if root is None
            else {
                "backend": "file",
                "root": root,
                "capacity_bytes": 1 << 34,
                # the store page TieredCache's arm gets (store_pages.py in the linker)
                "page_tokens": store_page_tokens(self.page, None),
            }
        )
        doc = {
            "mirror": {"ratio": 2.0, "layout": "page_first"},
            "controller": {"cpus": kvtier_cpus("auto")},
            "store": store,
        }
        path = os.path.join(
            tempfile.gettempdir(), f"kvtier-linker-{uuid.uuid4().hex[:8]}.yaml"
        )
        with open(path, "w") as f:
            yaml.safe_dump(doc, f)
        try:
            linker = sg.factory.create_unified_cache_linker(
                sg.server_args.ServerArgs(
                    model_path="kvtier-bench", page_size=self.page
                ),
                self.cache.cache_init_params,
                backend="dynamic",
                components=set(self.cache.components),
                config={
                    "linker": "KvtierLinker",
                    "linker_module_path": "kvtier.integrations.sglang.linker",
                    "linker_extra_config": {"kvtier_config": path},
                },
            )
        finally:
            os.unlink(path)
        self.cache.init_cache_linker(linker)
        self.kv.register_layer_transfer_counter(linker.layer_done_counter)
        self.linker = linker

    # -- the scheduler's calls ---------------------------------------------------------------

    def _call(self, name: str, fn, *args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - start
            self.cpu += spent
            row = self.by_call.setdefault(name, [0.0, 0])
            row[0] += spent
            row[1] += 1

    def new_request(self, rid: str, prompt: np.ndarray, max_new: int):
        sg = self.sg
        return sg.schedule_batch.Req(
            rid=rid,
            origin_input_text="",
            origin_input_ids=_tokens(prompt),
            sampling_params=sg.sampling_params.SamplingParams(
                temperature=0, max_new_tokens=max_new
            ),
        )

    def prefetch(self, req) -> None:
        """HiCache with L3: the arrival's prefetch from storage, waited for (wait_complete)."""
        cache, common = self.cache, self.sg.common
        self._call("match", common.match_kv_cache, req, cache)
        node = req.last_host_node
        if not (cache.is_backuped(node) or cache.is_root(node)):
            return
        matched = req.prefix_len + req.host_hit_length
        ids = req.origin_input_ids
        end = req._compute_max_prefix_len(len(ids))
        handle = req.cache_request_handle
        self._call(
            "prefetch",
            cache.prefetch_from_storage,
            handle,
            node,
            ids[matched:end],
            cache.get_last_hash_value(node),
            None,
            matched_prefix_tokens=ids[:matched],
            extra_key=None,
            cache_salt=None,
            storage_hit_end=None,
        )
        deadline = time.monotonic() + 60
        while not self._call("prefetch", cache.check_prefetch_progress, handle):
            if time.monotonic() > deadline:
                raise RuntimeError(f"HiCache prefetch of {req.rid} never finished")
            time.sleep(0.001)
            self._call("events", cache.check_hicache_events)
        self._call("prefetch", cache.pop_prefetch_loaded_span, handle)

    def schedule(self, req, total: int, reserved: int) -> int:
        """Match, pin, check the budget, take a row, load back what hit below the device,
        lock: the slots its `total` tokens still need, or 0 (nothing held) when they and
        the batch's `reserved` do not fit."""
        cache, sg = self.cache, self.sg
        if self.kind == "hicache_file":
            self.prefetch(req)
        self._call("match", sg.common.match_kv_cache, req, cache)
        pin = self._call("lock", cache.lock, req.last_node)
        need = total - req.prefix_len + self.page  # a load back takes device slots too
        room = self._call(
            "lock", lambda: self.allocator.available_size() + cache.evictable_size()
        )
        if room < reserved + need:
            self._call("lock", cache.unlock, pin)
            cache.linker is not None and cache.linker.release_request(req.rid)
            return 0
        self.r2t.alloc([req])
        req.host_loaded_length = 0
        if req.host_hit_length > 0:
            loaded = self._call(
                "load",
                cache.init_load_back,
                sg.bpc.InitLoadBackParams(
                    best_match_node=req.best_match_node,
                    host_hit_length=req.host_hit_length,
                    req=req,
                ),
            )
            req.host_loaded_length, req.last_node = loaded
            req.prefix_len += req.host_loaded_length
        self._call("lock", cache.unlock, pin)
        req.lock = self._call("lock", cache.lock, req.last_node)
        return total - req.prefix_len + self.page

    def allocate(self, reqs: list, totals: list[int]) -> None:
        """`alloc_for_extend`: the batch's token slots in one allocation (evicting when
        short), each row written with prefix + new slots."""
        alloc, cache, page = self.sg.allocation, self.cache, self.page
        owned = cache.load_back_is_cache_owned()
        prefixes = [
            self._call("alloc", cache.prefix_device_indices, r)
            if r.prefix_len
            else torch.empty(0, dtype=torch.int64)
            for r in reqs
        ]
        lens = [r.prefix_len for r in reqs]
        extend = sum(totals) - sum(lens)
        if page == 1 or self.allocator.page_size == 1:  # the kit's Mamba allocator
            out = self._call("alloc", alloc.alloc_token_slots, cache, extend)
        else:
            plens = torch.tensor(lens, dtype=torch.int64)
            slens = torch.tensor(totals, dtype=torch.int64)
            last = torch.cat(
                [
                    p[-1:] if len(p) else torch.full((1,), -1, dtype=torch.int64)
                    for p in prefixes
                ]
            )
            out = self._call(
                "alloc",
                alloc.alloc_paged_token_slots_extend,
                cache,
                plens,
                plens,
                slens,
                slens,
                last,
                extend,
            )
        at = 0
        for r, p, total in zip(reqs, prefixes, totals):
            row = r.kv.req_pool_idx
            self.r2t.write((row, slice(0, r.prefix_len)), p)
            self.r2t.write(
                (row, slice(r.prefix_len, total)), out[at : at + total - r.prefix_len]
            )
            at += total - r.prefix_len
            r.kv.kv_committed_len = r.kv.kv_allocated_len = total
            r.kv.cache_protected_len = r.prefix_len - (
                0 if owned else r.host_loaded_length
            )

    def forward(self, reqs: list) -> list:
        """The batch's loads start, the forward waits per layer, then its loads are checked."""
        cache = self.cache
        index = self._call("start", cache.ready_to_load_host_cache)
        counter = getattr(self.kv, "layer_transfer_counter", None)
        if counter is not None and index is not None and index >= 0:
            counter.set_consumer(index)
        if self.hybrid is None:
            for layer in range(self.kv.layer_num):
                self._call("forward", self.kv.get_key_buffer, layer)
            return self._call("finish_loads", cache.finish_external_linker_loads, reqs)
        for layer in range(4):  # full 1, 3; sliding-window or Mamba 0, 2
            if self.hybrid == "mamba" and layer in (0, 2):  # waits on the request pool
                self._call("forward", self.r2t.mamba2_layer_cache, layer)
            else:
                self._call("forward", self.kv.get_key_buffer, layer)
        return self._call("finish_loads", cache.finish_external_linker_loads, reqs)

    def release(self, req, output: np.ndarray) -> None:
        if self.hybrid == "mamba" and self.cache.enable_mamba_extra_buffer:
            # the forward tracks the state on the chunk grid (schedule_batch's
            # mamba_track_seqlen_aligned): the last grid point the request reached is
            # where its finished state is cached
            total = len(req.origin_input_ids) + len(output)
            chunk = self._mamba_chunk()
            req.kv.mamba_last_track_seqlen = (total - 1) // chunk * chunk
        req.output_ids = _tokens(output)
        req.finished_reason = self.sg.schedule_batch.FINISH_LENGTH(length=len(output))
        self._call(
            "finish", self.sg.common.release_kv_cache, req, self.cache, checkpoint=True
        )

    def step(self) -> None:
        self._call("events", self.cache.check_hicache_events)

    def close(self) -> None:
        if self.linker is not None:
            self.linker.close()
        elif self.kind.startswith("hicache"):
            cache = self.cache
            deadline = time.monotonic() + 60
            while cache.ongoing_backup and time.monotonic() < deadline:
                cache.drain_storage_control_queues()
                time.sleep(0.01)
            cache.shutdown()
            cache.release_host_resources()
        for cm in reversed(self.exits):
            cm.__exit__(None, None, None)


def urc_arm(
    sg,
    kind: str,
    trace,
    size: int,
    page: int,
    in_flight: int,
    root: str,
    hybrid: str | None = None,
) -> ArmRun:
    longest = max(len(t.prompt) + len(t.output) for t in trace)
    arm = UrcArm(sg, kind, size, page, longest, in_flight, root, hybrid)
    pending = list(range(len(trace)))
    restored = device = failed_loads = 0
    cpu0 = time.process_time()
    try:
        while pending:
            batch, sessions, reserved = [], set(), 0
            while (
                pending
                and len(batch) < in_flight
                and trace[pending[0]].session not in sessions
            ):
                t = trace[pending[0]]
                req = arm.new_request(f"r{pending[0]}", t.prompt, len(t.output))
                total = len(t.prompt) + len(t.output)
                need = arm.schedule(req, total, reserved)
                if not need:
                    if not batch:
                        arm.step()  # offloads in flight pin device pages: let them land
                        time.sleep(0.001)
                        continue
                    break
                pending.pop(0)
                reserved += need
                sessions.add(t.session)
                batch.append((req, t))
            reqs = [r for r, _ in batch]
            arm.allocate(reqs, [len(t.prompt) + len(t.output) for _, t in batch])
            failed = {r.rid for r in arm.forward(reqs)}
            failed_loads += len(failed)
            for req, t in batch:
                device += req.prefix_len - req.host_loaded_length
                restored += 0 if req.rid in failed else req.host_loaded_length
                arm.release(req, t.output)
            arm.step()
    finally:
        process = time.process_time() - cpu0
        arm.close()
    return ArmRun(arm.cpu, process, restored, device, failed_loads, arm.by_call)


def tiered_arm(trace, size: int, page: int, in_flight: int) -> ArmRun:
    cpu0 = time.process_time()
    sched, _ = kvtier_arm(
        trace,
        size,
        page,
        in_flight,
        "auto",
        tiers=True,
        page_tokens=store_page_tokens(page, None),
    )
    process = time.process_time() - cpu0
    by_call = {k: [v[1], v[2]] for k, v in sched.by_call.items()}
    return ArmRun(
        sched.cpu, process, sched.hits[1] + sched.hits[2], sched.hits[0], 0, by_call
    )


# a hybrid run: the arms on SGLang's tree (TieredCache has no hybrid pools)
HYBRID_ARMS = tuple(a for a in ARMS if a not in ("tieredcache", "linker_floor"))
HYBRID = {
    "swa": "full-attention layers 1, 3; sliding-window layers 0, 2",
    "mamba": "full-attention layers 1, 3; Mamba2 layers 0, 2",
}
WINDOW = 128  # SWA window, tokens (gpt-oss's)
MAMBA_STATES_PER_ROW = 8  # Mamba state slots the pool holds per request row

SHIMS = Shims()
TREE_CORES: set[str] = (
    set()
)  # SGLang's tree core the arms ran on (Rust's, or its fallback)


def _tokens(a: np.ndarray) -> array:
    out = array("q")
    out.frombytes(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return out


def run(
    page: int,
    requests: int = 300,
    rounds: int = 3,
    in_flight: int = 8,
    device_fraction: float = 0.10,
    sg=None,
    hybrid: str | None = None,
) -> dict:
    trace = multiturn(
        sessions=150,
        turns=6,
        system_prompts=6,
        system_len=512,
        msg_len=(32, 200),
        seed=3,
    )[:requests]
    _, working_set = infinite_bound(trace, page)
    longest = max(len(t.prompt) + len(t.output) for t in trace)
    size = max(
        page * 64,
        -(-2 * longest // page) * page,
        int(working_set * device_fraction) // page * page,
    )
    arms = ARMS if hybrid is None else HYBRID_ARMS
    runs: dict[str, list[ArmRun]] = {k: [] for k in arms}
    for _ in range(rounds):
        for kind in arms:
            gc.collect()
            with tempfile.TemporaryDirectory() as root:
                if kind == "tieredcache":
                    out = tiered_arm(trace, size, page, in_flight)
                else:
                    out = urc_arm(sg, kind, trace, size, page, in_flight, root, hybrid)
            runs[kind].append(out)
    n = len(trace)
    med = {k: statistics.median(r.cpu for r in v) / n * 1e6 for k, v in runs.items()}
    proc = {
        k: statistics.median(r.process for r in v) / n * 1e6 for k, v in runs.items()
    }
    head = "" if hybrid is None else f"hybrid {hybrid} ({HYBRID[hybrid]}), "
    print(
        f"{head}page {page}: {n} requests ({in_flight} in flight), working set {working_set} tokens, "
        f"device pool {size} tokens ({size / working_set:.0%}), host 2x, write-through, "
        f"stores on {tempfile.gettempdir()}; {rounds} alternating rounds, medians"
    )
    for k in arms:
        last = runs[k][-1]
        print(
            f"  {LABELS[k]:<48} scheduler {med[k]:8.0f} µs/request  process {proc[k]:8.0f} "
            f"µs/request  restored {last.restored} tokens  device hits {last.device_hit}  "
            f"failed loads {last.failed_loads}"
        )
    for k in arms:
        last = runs[k][-1]
        print(
            f"  {k} by call (µs/request, last round): "
            + ", ".join(
                f"{c} {v[0] / n * 1e6:.0f}" for c, v in sorted(last.by_call.items())
            )
        )

    def same(a: str, b: str) -> str:
        return " / ".join(f"{x.cpu / y.cpu:.2f}x" for x, y in zip(runs[a], runs[b]))

    print(
        f"  same-round ratios, linker+file / HiCache host+file: {same('linker_file', 'hicache_file')}"
    )
    print(f"  same-round ratios, linker / HiCache host: {same('linker', 'hicache')}")
    if hybrid is not None:
        return {
            "page": page,
            "hybrid": hybrid,
            "us": med,
            "process_us": proc,
            "X": med["linker_file"] / med["hicache_file"],
            "Y": med["linker"] / med["hicache"],
            "Z": runs["linker"][-1].restored / max(1, runs["hicache"][-1].restored),
            "restored": runs["linker"][-1].restored,
            "hicache_restored": runs["hicache"][-1].restored,
        }
    print(
        f"  same-round ratios, TieredCache / HiCache host+file: {same('tieredcache', 'hicache_file')}"
    )
    ratios = {
        "X": med["linker_file"] / med["hicache_file"],
        "Y": med["linker"] / med["hicache"],
        "Z": runs["linker_file"][-1].restored
        / max(1, runs["hicache_file"][-1].restored),
        "W": med["tieredcache"] / med["hicache_file"],
        "F": med["linker_floor"] / med["hicache_file"],
        "G": med["linker_floor"] / med["hicache"],
    }
    print(
        f"  kvtier's own share above the floor: linker host "
        f"{med['linker'] - med['linker_floor']:.0f} µs/request, linker host + file store "
        f"{med['linker_file'] - med['linker_floor']:.0f} µs/request"
    )
    return {"page": page, "us": med, "process_us": proc, **ratios}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--page-size", type=int, action="append", help="1 and 16 by default")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument(
        "--hybrid",
        choices=sorted(HYBRID),
        action="append",
        help="run SGLang's hybrid cache (FULL+SWA, FULL+MAMBA) instead of the Full one, "
        "with every arm but TieredCache; repeatable",
    )
    args = p.parse_args(argv)
    pages = args.page_size or [1, 16]
    try:
        sg = sglang_loader.load()
    except sglang_loader.Unavailable as exc:
        print(
            f"linker benchmark: SGLang cannot be loaded here ({exc}); nothing measured"
        )
        return 0
    if os.path.isdir("/dev/shm") and "TMPDIR" not in os.environ:
        tempfile.tempdir = "/dev/shm"  # every arm's store on tmpfs
    logging.getLogger("sglang").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print(
        "HiCache runs on CPU with stand-ins for its CUDA-only calls (kvtier/bench/hicache_cpu.py): "
        "its copy kernels are free no-ops, which flatters HiCache"
    )
    if args.hybrid:
        results = [
            run(page, args.requests, args.rounds, args.in_flight, sg=sg, hybrid=h)
            for h in args.hybrid
            for page in pages
        ]
    else:
        results = [
            run(page, args.requests, args.rounds, args.in_flight, sg=sg)
            for page in pages
        ]
    print(
        f"SGLang tree core: {', '.join(sorted(TREE_CORES))}; copy kernels HiCache launched "
        f"(free here): {sum(SHIMS.calls.values())}"
    )
    for r in results:
        if "hybrid" in r:
            restored = (
                f"restored {r['Z']:.2f}x HiCache's tokens"
                if r["hicache_restored"]
                else f"restored {r['restored']} tokens, HiCache none"
            )
            print(
                f"linker hybrid {r['hybrid']}: page {r['page']} scheduler {r['Y']:.2f}x "
                f"HiCache (host), {restored}"
            )
            continue
        print(
            f"linker: page {r['page']} scheduler {r['X']:.2f}x HiCache (host+file), "
            f"{r['Y']:.2f}x HiCache (host), restored {r['Z']:.2f}x HiCache's tokens"
        )
        print(
            f"tieredcache: page {r['page']} scheduler {r['W']:.2f}x HiCache (host+file)"
        )
        print(
            f"linker floor: page {r['page']} scheduler {r['F']:.2f}x HiCache (host+file), "
            f"{r['G']:.2f}x HiCache (host)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
