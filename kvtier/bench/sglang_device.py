"""SGLang 0.5.23's own device prefix cache on CPU, driven as its scheduler drives it: the
baseline `benchmarks/cache.py` measures kvtier against (docs/sglang.md).

Real objects, real code paths: `RadixCache` over a `ReqToTokenPool` and a
`TokenToKVPoolAllocator` (`PagedTokenToKVPoolAllocator` above page 1) and an
`MHATokenToKVPool`, with the scheduler's helpers per request: `match_kv_cache` (match_prefix)
and `lock` (inc_lock_ref) when a request is scheduled, `alloc_req_slots` +
`alloc_token_slots` / `alloc_paged_token_slots_extend` (which evict when the allocator is
short) and the row write of `write_cache_indices` when its batch is allocated, and
`release_kv_cache` (checkpoint = insert + re-match + row rewrite, free of duplicate and
partial-page slots, unlock = dec_lock_ref, row free) when it finishes.

SGLang's modules come from kvtier's one SGLang loader (`kvtier.testing.sglang_loader`),
which says why when they cannot be loaded here (`Unavailable`).
"""

from __future__ import annotations

from array import array

import numpy as np
import torch

from kvtier.testing.sglang_loader import load


class DeviceCache:
    """SGLang's RadixCache with its request and token pools, `size` usable token slots of
    `page_size` tokens (plus SGLang's own padding page), requests of at most
    `max_context` tokens, `max_running` at once."""

    def __init__(
        self, size: int, page_size: int, max_running: int, max_context: int
    ) -> None:
        sg = self.sg = load()
        sa = sg.server_args
        sa.set_global_server_args_for_scheduler(
            sa.ServerArgs(model_path="dummy", page_size=page_size)
        )
        dtype = torch.float16
        self.page_size = page_size
        self.r2t = sg.memory_pool.ReqToTokenPool(
            size=max_running,
            max_context_len=max_context,
            device="cpu",
            enable_memory_saver=False,
        )
        self.kv = sg.memory_pool.MHATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=dtype,
            head_num=1,
            head_dim=16,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        if page_size == 1:
            self.allocator = sg.allocator.TokenToKVPoolAllocator(
                size, dtype, "cpu", self.kv, False
            )
        else:
            self.allocator = sg.allocator.PagedTokenToKVPoolAllocator(
                size, page_size, dtype, "cpu", self.kv, False
            )
        params = sg.cache_init_params.CacheInitParams(
            disable=False,
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page_size,
        )
        self.cache = sg.radix_cache.RadixCache(params)

    def new_request(self, rid: str, prompt: np.ndarray, max_new_tokens: int):
        """An SGLang `Req` for `prompt` (built before the scheduler's cache calls)."""
        sb, sp = self.sg.schedule_batch, self.sg.sampling_params
        return sb.Req(
            rid=rid,
            origin_input_text="",
            origin_input_ids=_tokens(prompt),
            sampling_params=sp.SamplingParams(
                temperature=0, max_new_tokens=max_new_tokens
            ),
        )

    def schedule(self, req, total: int, reserved: int) -> int:
        """Match and lock the request's prefix, as `PrefillAdder` does: the slots its `total`
        tokens need beyond the prefix (a page more for a partial one), or 0 (lock dropped)
        when those and the batch's `reserved` do not fit the free and evictable slots."""
        self.sg.common.match_kv_cache(req, self.cache)
        req.lock = self.cache.lock(req.last_node)
        need = total - req.prefix_len + self.page_size
        if (
            self.allocator.available_size() + self.cache.evictable_size()
            < reserved + need
        ):
            self.cache.unlock(req.lock)
            req.lock = None
            return 0
        return need

    def allocate(self, reqs: list, totals: list[int]) -> None:
        """`alloc_for_extend` for one batch: request rows, the batch's token slots in one
        allocation (evicting when short), each row written with prefix + new slots."""
        alloc = self.sg.allocation
        alloc.alloc_req_slots(self.r2t, reqs, self.cache)
        prefixes = [
            self.cache.prefix_device_indices(r)
            if r.prefix_len
            else torch.empty(0, dtype=torch.int64)
            for r in reqs
        ]
        prefix_lens = [r.prefix_len for r in reqs]
        extend = sum(totals) - sum(prefix_lens)
        if self.page_size == 1:
            out = alloc.alloc_token_slots(self.cache, extend)
        else:
            plens = torch.tensor(prefix_lens, dtype=torch.int64)
            slens = torch.tensor(totals, dtype=torch.int64)
            last = torch.cat(
                [
                    p[-1:] if len(p) else torch.full((1,), -1, dtype=torch.int64)
                    for p in prefixes
                ]
            )
            out = alloc.alloc_paged_token_slots_extend(
                self.cache, plens, plens, slens, slens, last, extend
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
            r.kv.cache_protected_len = r.prefix_len

    def finish(self, req, output: np.ndarray) -> None:
        """The request decoded `output`: mark it finished (no cache call)."""
        req.output_ids = _tokens(output)
        req.finished_reason = self.sg.schedule_batch.FINISH_LENGTH(length=len(output))

    def release(self, req) -> None:
        """`release_kv_cache(checkpoint=True)`, as `cache_finished_req` was."""
        self.sg.common.release_kv_cache(req, self.cache, checkpoint=True)

    def check(self) -> None:
        """Every slot free or in the tree once no request runs, every row free."""
        held = self.allocator.available_size() + self.cache.total_size()
        size = self.allocator.size
        if (
            held != size
            or self.cache.protected_size() != 0
            or self.r2t.available_size() != self.r2t.size
        ):
            raise AssertionError(
                f"SGLang pools: free {self.allocator.available_size()} + tree "
                f"{self.cache.total_size()} != {size}, protected {self.cache.protected_size()}, "
                f"rows free {self.r2t.available_size()} of {self.r2t.size}"
            )


def _tokens(a: np.ndarray) -> array:
    out = array("q")
    out.frombytes(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return out
