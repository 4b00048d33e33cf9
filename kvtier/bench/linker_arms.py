"""The benchmark's arms (`kvtier/bench/linker.py`): SGLang's `UnifiedRadixCache` driven
through the calls its scheduler makes per request, with no tiers, HiCache's, kvtier's
linker or the linker floor under it (`UrcArm`, `urc_arm`), and kvtier's own `TieredCache`
(`tiered_arm`); each returns its `ArmRun`."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import uuid
from array import array
from dataclasses import dataclass

import numpy as np
import torch
import yaml

from kvtier.bench.cache import kvtier_arm, store_page_tokens
from kvtier.bench.hicache_cpu import Shims

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
