"""Triton gather/scatter of KV rows between a pool and a mirror.

One kernel serves both directions: row `i` of `src_idx` is copied to row `i` of `dst_idx`,
where a row index `s` lives at element offset `(s // ps) * page_stride + (s % ps) * row_stride`.
A device pool is the case ps=1; a page-first mirror has page_stride > ps * row_stride.

Imported lazily: only the `kernel` I/O path on a CUDA device (or tests under
TRITON_INTERPRET=1, which must be set before this module is imported) reach it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_rows_kernel(
    src,
    dst,
    src_idx,
    dst_idx,
    n_cols,
    src_ps,
    src_page_stride,
    src_row_stride,
    dst_ps,
    dst_page_stride,
    dst_row_stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    block = tl.program_id(1)
    s = tl.load(src_idx + row)
    d = tl.load(dst_idx + row)
    s_off = (s // src_ps) * src_page_stride + (s % src_ps) * src_row_stride
    d_off = (d // dst_ps) * dst_page_stride + (d % dst_ps) * dst_row_stride
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    values = tl.load(src + s_off + cols, mask=mask)
    tl.store(dst + d_off + cols, values, mask=mask)


def _geometry(t: torch.Tensor) -> tuple[int, int, int]:
    """(rows per page, page stride, row stride) of a 2-D `[rows, w]` or 3-D `[pages, ps, w]` view."""
    if t.dim() == 2:
        return 1, t.stride(0), t.stride(0)
    return t.shape[1], t.stride(0), t.stride(1)


def copy_rows(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """dst[row dst_idx[i]] = src[row src_idx[i]] for every i; rows are the last dim, unit stride."""
    n_cols = src.shape[-1]
    assert dst.shape[-1] == n_cols and src.stride(-1) == 1 and dst.stride(-1) == 1, (
        "rows must match, unit stride"
    )
    if src_idx.numel() == 0:
        return
    block = min(1024, triton.next_power_of_2(n_cols))
    grid = (src_idx.numel(), triton.cdiv(n_cols, block))
    _copy_rows_kernel[grid](
        src,
        dst,
        src_idx,
        dst_idx,
        n_cols,
        *_geometry(src),
        *_geometry(dst),
        BLOCK=block,
    )
