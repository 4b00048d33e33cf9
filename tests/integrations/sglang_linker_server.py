"""One SGLang cache-owning worker for the linker tests (test_sglang_linker.py and the TP
worker): SGLang's real UnifiedRadixCache over real CPU pools, built by its test kit, with
kvtier's linker created by SGLang's `create_unified_cache_linker` and attached as SGLang
attaches it; and what the scheduler does with it (compute, match, load)."""

from __future__ import annotations

import time
import uuid
from array import array

import torch
import yaml

TOKENS = list(range(100, 132))  # 8 pages of 4


def write_yaml(
    tmp_path,
    store: dict,
    mirror: dict | None = None,
    controller: dict | None = None,
    namespace: dict | None = None,
) -> str:
    path = tmp_path / f"linker-{uuid.uuid4().hex[:6]}.yaml"
    doc = {
        "store": {"timeout_s": 5.0, **store},
        "mirror": {"ratio": 2.0, "layout": "page_first", **(mirror or {})},
    }
    if store.get("backend") == "none":
        doc["store"] = {"backend": "none"}
    if controller:
        doc["controller"] = controller
    if namespace:
        doc["namespace"] = namespace
    path.write_text(yaml.safe_dump(doc))
    return str(path)


class Server:
    """One SGLang cache-owning worker: a real UnifiedRadixCache with kvtier's linker."""

    def __init__(
        self,
        sg,
        yaml_path: str,
        *,
        page_size: int = 4,
        kv_size: int = 256,
        layers: int = 2,
        mla: bool = False,
        tp_group=None,
    ) -> None:
        self.sg = sg
        cfg = sg.cfg.CacheConfig(
            page_size=page_size,
            kv_size=kv_size,
            num_layers=layers,
            head_num=2,
            head_dim=8,
            max_context_len=512,
        )
        self.cache, self.allocator, self.r2t = sg.fx.build_fixture(cfg)
        if mla:
            self._use_mla_pool(cfg)
        if (
            tp_group is not None
        ):  # the kit builds one rank's cache; a TP rank's has its group
            self.cache.cache_init_params.tp_cache_group = tp_group
            self._rebuild()
        params = self.cache.cache_init_params
        self.kv = self.allocator.get_kvcache()
        self.server_args = sg.server_args.ServerArgs(
            model_path="kvtier-test/tiny", page_size=page_size
        )
        linker = sg.factory.create_unified_cache_linker(
            self.server_args,
            params,
            backend="dynamic",
            components=set(self.cache.components),
            config={
                "linker": "KvtierLinker",
                "linker_module_path": "kvtier.integrations.sglang.linker",
                "linker_extra_config": {"kvtier_config": yaml_path},
            },
        )
        self.cache.init_cache_linker(linker)
        self.kv.register_layer_transfer_counter(linker.layer_done_counter)
        self.linker = linker
        self.page_size = page_size
        self.n = 0

    def _use_mla_pool(self, cfg) -> None:
        """The fixture builds MHA; an MLA model's cache is the same tree over MLATokenToKVPool."""
        sg = self.sg
        kv = sg.memory_pool.MLATokenToKVPool(
            size=cfg.kv_size,
            page_size=cfg.page_size,
            dtype=cfg.dtype,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            layer_num=cfg.num_layers,
            device="cpu",
            enable_memory_saver=False,
        )
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

        self.allocator = TokenToKVPoolAllocator(
            size=cfg.kv_size, dtype=cfg.dtype, device="cpu", kvcache=kv, need_sort=False
        )
        self.cache.cache_init_params.token_to_kv_pool_allocator = self.allocator
        self._rebuild()

    def _rebuild(self) -> None:
        """The cache again over the (changed) init params, on the kit's python tree core."""
        from sglang.srt.environ import envs

        params = self.cache.cache_init_params
        with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override("python"):
            self.cache = self.sg.urc.UnifiedRadixCache(params=params)
        self.cache.cache_init_params = params

    # -- the bytes -------------------------------------------------------------------------

    def buffers(self) -> list[torch.Tensor]:
        if hasattr(self.kv, "kv_buffer") and not hasattr(self.kv, "k_buffer"):
            return list(self.kv.kv_buffer)
        return list(self.kv.k_buffer) + list(self.kv.v_buffer)

    def fill(self, slots: torch.Tensor, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for buf in self.buffers():
            vals = torch.randn((len(slots), *buf.shape[1:]), generator=g).to(buf.dtype)
            buf[slots] = vals
            out.append(vals)
        return out

    def read(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return [buf[slots].clone() for buf in self.buffers()]

    # -- what SGLang's scheduler does ------------------------------------------------------

    def compute(self, tokens: list[int], seed: int) -> list[torch.Tensor]:
        """A finished prefill: its KV written to fresh slots, inserted (offloads), settled."""
        slots = self.allocator.alloc(len(tokens))
        kv = self.fill(slots, seed)
        self.cache.insert(
            self.sg.bpc.InsertParams(
                key=self.sg.radix_cache.RadixKey(array("q", tokens)), value=slots
            )
        )
        self.settle_offloads()
        return kv

    def settle_offloads(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.cache.linker.pending_offloads:
            self.cache.check_hicache_events()
            assert time.monotonic() < deadline, "offloads did not complete"
            time.sleep(0.001)

    def evict_all(self) -> None:
        self.cache.evict(self.sg.bpc.EvictParams(num_tokens=self.allocator.size))

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

    def match(self, req, tokens: list[int]):
        return self.cache.match_prefix(
            self.sg.bpc.MatchPrefixParams(
                key=self.sg.radix_cache.RadixKey(array("q", tokens)), req=req
            )
        )

    def load(self, req, result):
        """init_load_back -> start -> the forward's per-layer waits -> finish. Returns
        (tokens loaded, the request's private slots, the failed requests)."""
        self.r2t.alloc([req])
        n, _ = self.cache.init_load_back(
            self.sg.bpc.InitLoadBackParams(
                best_match_node=result.best_match_node,
                host_hit_length=result.host_hit_length,
                req=req,
            )
        )
        slots = self.cache.linker.private_load_indices.get(req.rid)
        index = self.cache.ready_to_load_host_cache()
        counter = self.linker.layer_done_counter
        counter.set_consumer(index)
        for layer in range(self.kv.layer_num):
            counter.wait_until(layer)
        failed = self.cache.finish_external_linker_loads([req])
        return n, slots, failed

    def check(self) -> None:
        self.cache.sanity_check()
        assert self.linker.core.check_accounting() == []

    def close(self) -> None:
        self.linker.close()


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(
            g.view(torch.uint8) if g.dtype == torch.bfloat16 else g,
            w.view(torch.uint8) if w.dtype == torch.bfloat16 else w,
        )


TOKENS = list(range(100, 132))  # 8 pages of 4


def engine_keys(sg, server: Server, tokens: list[int]) -> list[str]:
    """SGLang's page keys of `tokens` (its sha256 chain, which anyone can compute)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(
        sg.radix_cache.RadixKey(array("q", tokens)), None, page_size=server.page_size
    )


def page_files(sg, server: Server, root, tokens: list[int]) -> list:
    """The file store's file of each page of `tokens` (SGLang's page keys, kvtier's keys)."""
    out = []
    for key in server.linker.core.l3.keys(engine_keys(sg, server, tokens)):
        prefix, ns, h = key.rsplit("/", 2)
        out.append(root / prefix / ns / h[0:2] / h[2:4] / h)
    return out
