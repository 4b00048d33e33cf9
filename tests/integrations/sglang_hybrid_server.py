"""One SGLang cache-owning worker of a hybrid model for the linker tests: SGLang's real
UnifiedRadixCache with (FULL, SWA) or (FULL, MAMBA) components over real CPU pools,
built by its test kit, with kvtier's linker created by SGLang's factory and attached as
SGLang attaches it. The bytes every pool computed are remembered per page (per state for
Mamba), the first computed winning (a page key names its whole prefix), so every load is
checked against what was computed: the KV prefix, the SWA window, the Mamba state."""

from __future__ import annotations

import time
from array import array

import torch

PS = 4  # tokens a page
WINDOW = 8  # SWA window in tokens (2 pages)


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want)
    )


class HybridServer:
    def __init__(
        self, sg, yaml_path: str, kind: str, window: int = WINDOW, **cfg
    ) -> None:
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        CT = sg.component_type.ComponentType
        self.sg, self.kind, self.PoolName = sg, kind, PoolName
        self.has_swa, self.has_mamba = "swa" in kind, "mamba" in kind
        extra = {}
        comps = [CT.FULL]
        if self.has_swa:
            extra["sliding_window_size"] = window
            comps.append(CT.SWA)
        if self.has_mamba:
            extra.update(enable_mamba_extra_buffer=True, mamba_cache_size=60)
            comps.append(CT.MAMBA)
        self.cfg = sg.cfg.CacheConfig(
            page_size=PS,
            components=tuple(comps),
            num_layers=4,
            full_attention_layer_ids=(1, 3),
            head_num=2,
            head_dim=8,
            **extra,
            **cfg,  # any other field of the kit's CacheConfig
        )
        self.cache, self.alloc, self.r2t = sg.fx.build_fixture(self.cfg)
        params = self.cache.cache_init_params
        self.kv = self.alloc.get_kvcache()
        server_args = sg.server_args.ServerArgs(
            model_path="kvtier-test/hybrid", page_size=PS
        )
        self.linker = sg.factory.create_unified_cache_linker(
            server_args,
            params,
            backend="dynamic",
            components=set(self.cache.components),
            config={
                "linker": "KvtierLinker",
                "linker_module_path": "kvtier.integrations.sglang.linker",
                "linker_extra_config": {"kvtier_config": yaml_path},
            },
        )
        self.cache.init_cache_linker(self.linker)
        self.kv.register_layer_transfer_counter(self.linker.layer_done_counter)
        self.n = 0
        self.page_size = PS
        self.pages: dict = {}  # (pool, token prefix ending at a page) -> its bytes
        self.states: dict = {}  # token sequence -> the Mamba state at its end

    # -- the bytes -------------------------------------------------------------------------

    def buffers(self, name: str) -> list[torch.Tensor]:
        if name == "kv":
            full = self.kv.full_kv_pool
            return list(full.k_buffer) + list(full.v_buffer)
        if name == "swa":
            swa = self.kv.swa_kv_pool
            return list(swa.k_buffer) + list(swa.v_buffer)
        cache = self.r2t.mamba_pool.mamba_cache
        return [cache.temporal, *cache.conv]

    def _rows(self, name: str, buf: torch.Tensor, idx) -> torch.Tensor:
        return buf[:, idx] if name == "mamba" else buf[idx]

    def fill(self, name: str, idx, g) -> list[torch.Tensor]:
        out = []
        for buf in self.buffers(name):
            shape = self._rows(name, buf, idx).shape
            vals = torch.randn(shape, generator=g).to(buf.dtype)
            if name == "mamba":
                buf[:, idx] = vals
            else:
                buf[idx] = vals
            out.append(vals.clone())
        return out

    def read(self, name: str, idx) -> list[torch.Tensor]:
        return [self._rows(name, b, idx).clone() for b in self.buffers(name)]

    def alloc_tokens(self, k: int) -> torch.Tensor:
        if not self.has_swa:
            return self.alloc.alloc(k)
        # SWATokenToKVPoolAllocator.alloc asserts page_size 1: full and SWA pages, then
        # the mapping, as the kit's mixins do
        a = -(-k // PS) * PS
        full = self.alloc.full_attn_allocator.alloc(a)
        swa = self.alloc.swa_attn_allocator.alloc(a)
        self.alloc.full_to_swa_index_mapping[full] = swa
        return full[:k]

    # -- what SGLang's scheduler does ------------------------------------------------------

    def request(self, tokens: list[int]):
        self.n += 1
        return self.sg.schedule_batch.Req(
            rid=f"r{self.n}",
            origin_input_text="",
            origin_input_ids=array("q", tokens),
            sampling_params=self.sg.sampling_params.SamplingParams(
                temperature=0, max_new_tokens=1
            ),
        )

    def compute(self, tokens: list[int], seed: int) -> None:
        """A finished prefill: random KV, SWA and Mamba state written, inserted, settled."""
        sg = self.sg
        g = torch.Generator().manual_seed(seed)
        slots = self.alloc_tokens(len(tokens))
        ip = sg.bpc.InsertParams(
            key=sg.radix_cache.RadixKey(array("q", tokens)), value=slots
        )
        written = [("kv", slots)]
        if self.has_swa:
            written.append(("swa", self.alloc.full_to_swa_index_mapping[slots]))
        for name, idx in written:
            rows = self.fill(name, idx, g)
            for i in range(len(tokens) // PS):
                page = [r[i * PS : (i + 1) * PS] for r in rows]
                self.pages.setdefault((name, tuple(tokens[: (i + 1) * PS])), page)
        if self.has_mamba:
            req = self.request(tokens)
            self.r2t.alloc([req])
            slot = req.kv.mamba_pool_idx.unsqueeze(0)
            self.states[tuple(tokens)] = self.fill("mamba", slot, g)
            ip.mamba_value = slot
        self.cache.insert(ip)
        if self.has_mamba:
            self.end(req)
        self.settle_offloads()

    def end(self, req) -> None:
        """A computed request's row and its ping-pong track slots go back (its state slot
        is the tree's now), so a test can compute many prompts."""
        held = [
            slot
            for slot, empty in zip(
                req.kv.mamba_ping_pong_track_buffer.tolist(),
                req.kv.mamba_ping_pong_empty,
            )
            if not empty
        ]
        if held:
            self.r2t.mamba_allocator.free(torch.tensor(held, dtype=torch.int64))
        req.kv.mamba_ping_pong_track_buffer = req.kv.mamba_ping_pong_empty = None
        self.r2t.free(req)

    def settle_offloads(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.cache.linker.pending_offloads:
            self.cache.check_hicache_events()
            assert time.monotonic() < deadline, "offloads did not complete"
            time.sleep(0.001)

    def evict_all(self) -> None:
        size = self.alloc.size
        self.cache.evict(
            self.sg.bpc.EvictParams(num_tokens=size, swa_num_tokens=size, mamba_num=100)
        )

    def match(self, req, tokens: list[int]):
        return self.cache.match_prefix(
            self.sg.bpc.MatchPrefixParams(
                key=self.sg.radix_cache.RadixKey(array("q", tokens)), req=req
            )
        )

    def want(
        self, name: str, tokens: list[int], lo: int, hi: int
    ) -> list[torch.Tensor]:
        pages = [
            self.pages[(name, tuple(tokens[: (i + 1) * PS]))]
            for i in range(lo // PS, hi // PS)
        ]
        return [torch.cat([p[b] for p in pages]) for b in range(len(pages[0]))]

    def match_load(self, tokens: list[int]) -> int:
        """match_prefix -> lookup; init_load_back -> load; start; the forward's per-layer
        waits; finish. Asserts that the load succeeded and that the KV prefix, the SWA
        window and the Mamba state are the bytes computed; returns the tokens loaded."""
        req = self.request(tokens)
        mr = self.match(req, tokens)
        h = mr.host_hit_length
        if h == 0:
            return 0
        self.r2t.alloc([req])
        n, _ = self.cache.init_load_back(
            self.sg.bpc.InitLoadBackParams(
                best_match_node=mr.best_match_node, host_hit_length=h, req=req
            )
        )
        slots = self.cache.linker.private_load_indices[req.rid]
        index = self.cache.ready_to_load_host_cache()
        counter = self.linker.layer_done_counter
        counter.set_consumer(index)
        for layer in range(self.cfg.num_layers):
            counter.wait_until(layer)
        failed = self.cache.finish_external_linker_loads([req])
        assert n == h and failed == []
        assert same(self.read("kv", slots), self.want("kv", tokens, 0, h))
        if self.has_swa:
            w = mr.swa_host_hit_length
            assert w > 0
            swa_slots = self.alloc.full_to_swa_index_mapping[slots[-w:]]
            assert same(self.read("swa", swa_slots), self.want("swa", tokens, h - w, h))
        if self.has_mamba:
            slot = req.kv.mamba_pool_idx.unsqueeze(0)
            assert same(self.read("mamba", slot), self.states[tuple(tokens[:h])])
        self.release(req, slots)
        return h

    def release(self, req, slots) -> None:
        """The request ends: its private slots go back (it was never inserted)."""
        if slots is not None:
            self.alloc.free(slots)
        if self.has_mamba and req.kv is not None and req.kv.holds_mamba:
            self.r2t.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(0))
            req.kv.mamba_pool_idx = None

    def check(self) -> None:
        self.cache.sanity_check()
        assert self.linker.core.check_accounting() == []

    def close(self) -> None:
        self.linker.close()
