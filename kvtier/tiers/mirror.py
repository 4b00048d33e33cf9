"""The host mirror: a copy of device KV in host memory, page-granular.

Layouts (each `(layer, part)` is exposed as a `[pages, page_size, width]` view):
- `layer_first`: per part one `[layers, slots, width]` tensor — cheap per-layer loads.
- `page_first`: one `[pages, layers * page_size * sum(widths)]` tensor — a page's bytes for
  all layers are contiguous, so L3 reads and writes a page without copying.
Page 0 (slots 0..page_size-1) is padding, as in the pool.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kvtier.numpy_gil import GIL_CHUNK
from kvtier.tiers.allocator import PagedAllocator
from kvtier.tiers.indices import as_numpy, check_slots, page_slots, pages_of, runs
from kvtier.tiers.pool import DeviceKVPool
from kvtier.validate import usable_cores

log = logging.getLogger(__name__)

Layout = Literal["layer_first", "page_first"]
_memmove = ctypes.memmove  # releases the GIL while it copies
_SMALL_BYTES = 64 << 10  # blocks below this are copied keeping the GIL (see _move)
_PIECE_BYTES = (
    256 << 10
)  # a small-page copy moves at most this much per numpy call (_copy_small_pages)


def _gil_memmove():
    """libc's memmove called keeping the GIL (ctypes.PyDLL), or None where it cannot be loaded."""
    try:
        fn = ctypes.PyDLL(None).memmove
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = (
        ctypes.c_void_p,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t],
    )
    return fn


_memmove_small = _gil_memmove() or _memmove
_SPLIT_BYTES = (
    4 << 20
)  # a layer copy this big is split with a helper thread (when there is a second core)
_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _copy_helper() -> ThreadPoolExecutor | None:
    """One shared helper thread for big CPU copies; None where this process may run on a
    single core (`usable_cores`: a container's cpuset, `taskset`)."""
    global _helper
    if usable_cores() < 2:
        return None
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(1, thread_name_prefix="kvtier-copy")
        return _helper


def _move(blocks) -> None:
    """Small blocks keep the GIL: letting it go for a copy of a microsecond invites another
    thread in, and winning it back can cost milliseconds (docs/design.md §2)."""
    for d, s, n in blocks:
        (_memmove_small if n < _SMALL_BYTES else _memmove)(d, s, n)


def _items(rows: np.ndarray) -> np.ndarray:
    """`[pages, bytes]` uint8 rows (each contiguous) as a 1-D view of one void item a page:
    numpy indexes fewer than GIL_CHUNK such items keeping the GIL, uint8 rows at no size."""
    return rows.view(np.dtype((np.void, rows.shape[1])))[:, 0]


def _pieces(
    pages: np.ndarray, step: int, first: int, last: int
) -> list[np.ndarray] | None:
    """`pages` in pieces of `step` pages, or None if one is outside [first, last] (numpy
    would wrap a negative one): checked before anything is copied, `min` and `max` per
    piece (over more than 500 they would give the GIL up)."""
    pieces = [pages[i : i + step] for i in range(0, pages.shape[0], step)]
    return None if any(p.min() < first or p.max() > last for p in pieces) else pieces


IoPath = Literal["direct", "kernel"]


@dataclass(slots=True, frozen=True)
class CopyPlan:
    """Either page numbers on both sides (whole pages, int64 arrays) or merged slot runs."""

    device_pages: np.ndarray | None
    host_pages: np.ndarray | None
    runs: list[tuple[int, int, int]] | None


def _whole_pages(indices: np.ndarray, ps: int) -> np.ndarray | None:
    """Page numbers if `indices` are whole pages in slot order, else None."""
    if indices.shape[0] == 0 or indices.shape[0] % ps:
        return None
    if ps == 1:  # every slot is a page
        return indices
    pages = pages_of(indices[::ps], ps)
    # every slot of those pages, in order, is `indices` (so each first slot is aligned): in
    # pieces and compared as bytes, as numpy over more than 500 would give up the GIL (indices.py)
    return pages if page_slots(pages, ps).tobytes() == indices.tobytes() else None


def _continuing(dev: np.ndarray, host: np.ndarray) -> int:
    """Pages that continue the page before them on both sides, counted in pieces of at
    most GIL_CHUNK pages (one numpy pass over more would give the GIL up)."""
    total = 0
    for i in range(0, dev.shape[0] - 1, GIL_CHUNK - 1):  # pieces overlap by a page
        d, h = dev[i : i + GIL_CHUNK], host[i : i + GIL_CHUNK]
        total += int(np.count_nonzero((d[1:] - d[:-1] == 1) & (h[1:] - h[:-1] == 1)))
    return total


@dataclass(slots=True, frozen=True)
class MirrorConfig:
    ratio: float = 2.0
    size_bytes: int | None = None
    layout: Layout = "page_first"
    io: IoPath = "direct"

    def __post_init__(self) -> None:
        if self.layout not in ("layer_first", "page_first"):
            raise ValueError(
                f"layout={self.layout!r}: allowed values are layer_first, page_first"
            )
        if self.io not in ("direct", "kernel"):
            raise ValueError(f"io={self.io!r}: allowed values are direct, kernel")
        if self.size_bytes is None and not (
            isinstance(self.ratio, (int, float)) and self.ratio > 0
        ):
            raise ValueError(f"ratio={self.ratio!r}: must be a number > 0")
        if self.size_bytes is not None and (
            not isinstance(self.size_bytes, int) or self.size_bytes <= 0
        ):
            raise ValueError(f"size_bytes={self.size_bytes!r}: must be an integer > 0")


def available_memory() -> int:
    """Bytes the OS says a new allocation can take (MemAvailable), or physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class HostMirror:
    """Host copy of the pool's KV. Owns its page allocator; transfers take slot-index pairs."""

    def __init__(
        self, pool: DeviceKVPool, config: MirrorConfig = MirrorConfig()
    ) -> None:
        self.config = config
        self.pool_config = pc = pool.config
        self.page_size = ps = pc.page_size
        self.widths = pc.part_widths
        self.num_layers = pc.num_layers
        self.dtype = pool.dtype
        self.page_bytes = ps * sum(self.widths) * self.num_layers * self.dtype.itemsize
        if config.size_bytes is not None:
            pages = config.size_bytes // self.page_bytes
        else:
            pages = int(pc.size * config.ratio) // ps
        if pages < 1:
            raise ValueError(
                f"mirror size: {config.size_bytes or config.ratio} gives 0 pages of {self.page_bytes} bytes"
            )
        self.size = pages * ps
        asked, avail = (pages + 1) * self.page_bytes, available_memory()
        if asked > avail:
            raise MemoryError(
                f"host mirror needs {asked} bytes but only {avail} bytes are available"
            )
        self.allocator = PagedAllocator(self.size, ps)
        self.pinned = torch.cuda.is_available()
        if not self.pinned:
            log.info(
                "host mirror in plain memory: CUDA is not available, so it is not pinned"
            )
        self._views = self._allocate(pages + 1)
        self._arrays_of: DeviceKVPool | None = (
            None  # the pool `_arrays` views (CPU copies)
        )
        self._arrays: dict[
            int, tuple[list[np.ndarray], list[np.ndarray]]
        ] = {}  # _page_arrays
        self.io = config.io
        # GPU pool: copies are asynchronous DMA from/to pinned memory on the transfer
        # stream; whoever needs the bytes waits on that stream's events (tiers/streams.py)
        self._async = pool.device.type == "cuda" and self.pinned
        if (
            self.io == "kernel"
            and pool.device.type == "cpu"
            and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            # Triton has no CPU backend; its interpreter (tests) is the one way to run it here.
            log.info("io=kernel needs a GPU device; the CPU pool uses the direct path")
            self.io = "direct"
        if (
            self.io == "kernel" and importlib.util.find_spec("triton") is None
        ):  # an optional dependency
            raise ValueError(
                "mirror.io='kernel' needs triton: pip install triton (kvtier's cuda extra; "
                "or mirror.io: direct)"
            )

    def _allocate(self, pages: int) -> list[list[torch.Tensor]]:
        """views[layer][part] -> `[pages, page_size, width]`; also sets `_all_layers[part]`:
        `[layers, slots, width]` (layer_first) or `[pages, layers, page_size, width]`
        (page_first), the views an all-layer backup copies through."""
        ps, widths, layers = self.page_size, self.widths, self.num_layers

        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=self.dtype, pin_memory=self.pinned)

        if self.config.layout == "layer_first":
            self._all_layers = [empty(layers, pages * ps, w) for w in widths]
            return [
                [p[layer].view(pages, ps, w) for p, w in zip(self._all_layers, widths)]
                for layer in range(layers)
            ]
        per_layer = ps * sum(widths)
        self.data = empty(pages, layers * per_layer)
        self._page_bytes_np = self.data.view(
            torch.uint8
        ).numpy()  # [pages, page_bytes], shares memory
        self._pages_np = _items(self._page_bytes_np)  # [pages], one item a page
        by_layer = self.data.view(pages, layers, per_layer)
        self._all_layers, offset = [], 0
        for w in widths:
            self._all_layers.append(
                by_layer[:, :, offset : offset + ps * w].view(pages, layers, ps, w)
            )
            offset += ps * w
        return [
            [part[:, layer] for part in self._all_layers] for layer in range(layers)
        ]

    def view(self, layer: int, part: int) -> torch.Tensor:
        return self._views[layer][part]

    # -- transfers ---------------------------------------------------------------------------

    def backup(
        self,
        pool: DeviceKVPool,
        device_indices: torch.Tensor | np.ndarray,
        host_indices: torch.Tensor | np.ndarray,
    ) -> None:
        """Copy all layers of `device_indices` (pool) to `host_indices` (mirror)."""
        dev = check_slots("device_indices", device_indices)
        check_slots("host_indices", host_indices, dev.shape[0])
        if self.io == "kernel":
            for layer in range(self.num_layers):
                self._copy_kernel(
                    pool, layer, device_indices, host_indices, to_host=True
                )
            return
        if pool.device.type == "cpu" and self._small_pages():
            plan = self.plan(dev, host_indices)
            if (
                plan.device_pages is not None
            ):  # small whole pages: as a load copies them
                for layer in range(self.num_layers):
                    self._copy_small_pages(
                        pool, layer, plan.device_pages, plan.host_pages, to_host=True
                    )
                return
        if not pool.stacked:  # per-layer tensors: every layer's copies in one batch
            self._copy_layers(
                pool, range(self.num_layers), self.plan(dev, host_indices), to_host=True
            )
            return
        # direct: one copy per slot run and part covers every layer (strided over layers)
        split = self.page_size if self.config.layout == "page_first" else 0
        pieces = runs(device_indices, host_indices, split)
        dsts, srcs = [], []
        for d_all, h_all in zip(pool.all_layer_rows(), self._all_layers):
            for d0, h0, n in pieces:
                if split:
                    page, off = divmod(h0, self.page_size)
                    dsts.append(h_all[page, :, off : off + n])
                else:
                    dsts.append(h_all[:, h0 : h0 + n])
                srcs.append(d_all[:, d0 : d0 + n])
        torch._foreach_copy_(dsts, srcs, non_blocking=self._async)

    def plan(
        self,
        device_indices: torch.Tensor | np.ndarray,
        host_indices: torch.Tensor | np.ndarray,
    ) -> CopyPlan:
        """How to copy this pairing, computed once for all the layers of a load.

        Whole pages are copied by page number (integer indexing is the cheapest view torch
        makes; a CPU pool copies small ones by page number too, `_copy_small_pages`) when merging
        gains nothing: in `page_first` a page's slots of one layer are never next to the next
        page's, and in `layer_first` when pages rarely continue each other. Anything else
        as merged runs."""
        dev = check_slots("device_indices", device_indices)
        host = check_slots("host_indices", host_indices, dev.shape[0])
        ps = self.page_size
        pages = _whole_pages(dev, ps), _whole_pages(host, ps)
        if pages[0] is not None and pages[1] is not None:
            d, h = pages
            if self.config.layout == "page_first":
                return CopyPlan(d, h, None)
            if 4 * _continuing(d, h) < d.shape[0]:
                return CopyPlan(d, h, None)
        split = ps if self.config.layout == "page_first" else 0
        return CopyPlan(None, None, runs(dev, host, split))

    def load_layer(
        self,
        pool: DeviceKVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer: int,
        plan: CopyPlan | None = None,
    ) -> None:
        """Copy one layer of `host_indices` (mirror) to `device_indices` (pool); pass the
        `plan` of the pairing when loading several layers."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer}: must be in [0, {self.num_layers})")
        if self.io == "kernel":
            host = check_slots("host_indices", host_indices)
            check_slots("device_indices", device_indices, host.shape[0])
            self._copy_kernel(pool, layer, device_indices, host_indices, to_host=False)
            return
        self._copy(
            pool, layer, plan or self.plan(device_indices, host_indices), to_host=False
        )

    def load(
        self,
        pool: DeviceKVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
    ) -> None:
        plan = None if self.io == "kernel" else self.plan(device_indices, host_indices)
        for layer in range(self.num_layers):
            self.load_layer(pool, host_indices, device_indices, layer, plan)

    def _copy_kernel(
        self,
        pool: DeviceKVPool,
        layer: int,
        dev: torch.Tensor,
        host: torch.Tensor,
        to_host: bool,
    ) -> None:
        from kvtier.tiers.kernels import copy_rows

        dev, host = (
            t if isinstance(t, torch.Tensor) else torch.from_numpy(t)
            for t in (dev, host)
        )
        for d_rows, h_rows in zip(pool.rows(layer), self._views[layer]):
            if to_host:
                copy_rows(d_rows, h_rows, dev.to(d_rows.device), host.to(d_rows.device))
            else:
                copy_rows(h_rows, d_rows, host.to(d_rows.device), dev.to(d_rows.device))

    def _copy(
        self, pool: DeviceKVPool, layer: int, plan: CopyPlan, to_host: bool
    ) -> None:
        self._copy_layers(pool, (layer,), plan, to_host)

    def _copy_layers(
        self, pool: DeviceKVPool, layers, plan: CopyPlan, to_host: bool
    ) -> None:
        """Copy `layers` by `plan`: memmoves per layer on a CPU pool, else one batched
        `_foreach_copy_` over every layer's pieces."""
        if pool.device.type == "cpu":
            for layer in layers:
                self._copy_blocks(pool, layer, plan, to_host)
            return
        ps, split = self.page_size, self.config.layout == "page_first"
        dsts, srcs = [], []
        for layer in layers:
            for d_rows, h_view in zip(pool.rows(layer), self._views[layer]):
                if plan.device_pages is not None:
                    d_pages = d_rows.view(-1, ps, d_rows.shape[-1])
                    ds = [d_pages[p] for p in plan.device_pages.tolist()]
                    hs = [h_view[p] for p in plan.host_pages.tolist()]
                else:
                    h_rows = None if split else h_view.view(-1, h_view.shape[-1])
                    ds, hs = [], []
                    for d0, h0, n in plan.runs:
                        ds.append(d_rows[d0 : d0 + n])
                        if h_rows is not None:
                            hs.append(h_rows[h0 : h0 + n])
                        else:
                            page, off = divmod(h0, ps)
                            hs.append(h_view[page, off : off + n])
                dsts += hs if to_host else ds
                srcs += ds if to_host else hs
        torch._foreach_copy_(dsts, srcs, non_blocking=self._async)

    def _copy_blocks(
        self, pool: DeviceKVPool, layer: int, plan: CopyPlan, to_host: bool
    ) -> None:
        """CPU pool: each page (or run) is one contiguous block on both sides, so a layer is
        a list of plain memmoves: about a microsecond of overhead each (a torch copy_ costs
        several), and the GIL is released while the bytes move. Addresses come from the
        views' strides; every index is bounds-checked first, as torch indexing would."""
        ps = self.page_size
        if plan.device_pages is not None:
            if self._small_pages():
                self._copy_small_pages(
                    pool, layer, plan.device_pages, plan.host_pages, to_host
                )
                return
            dev, host = plan.device_pages * ps, plan.host_pages * ps
            sizes = np.full(dev.shape, ps, dtype=np.int64)
        else:
            dev, host, sizes = (
                (np.asarray(c, dtype=np.int64) for c in zip(*plan.runs))
                if plan.runs
                else (np.zeros(0, np.int64),) * 3
            )
        if dev.size == 0:
            return
        rows, views = pool.rows(layer), self._views[layer]
        dev_slots, host_slots = rows[0].shape[0], views[0].shape[0] * ps
        if (
            dev.min() < 0
            or host.min() < 0
            or (dev + sizes).max() > dev_slots
            or (host + sizes).max() > host_slots
        ):
            raise IndexError(
                f"copy plan slots out of range (pool {dev_slots}, mirror {host_slots} slots)"
            )
        jobs = []
        for d_rows, h_view in zip(rows, views):
            item, width = d_rows.element_size(), d_rows.shape[-1]
            page_stride = h_view.stride(0)
            assert (
                d_rows.is_contiguous()
                and h_view.stride(1) == width
                and h_view.stride(2) == 1
            )
            d_addr = d_rows.data_ptr() + dev * (width * item)
            h_addr = (
                h_view.data_ptr()
                + ((host // ps) * page_stride + (host % ps) * width) * item
            )
            nbytes = sizes * (width * item)
            src, dst = (d_addr, h_addr) if to_host else (h_addr, d_addr)
            jobs.append((dst.tolist(), src.tolist(), nbytes.tolist()))
        blocks = [b for dst, src, nbytes in jobs for b in zip(dst, src, nbytes)]
        helper = _copy_helper() if sum(n for *_, n in blocks) >= _SPLIT_BYTES else None
        if helper is None:
            _move(blocks)
            return
        half = helper.submit(
            _move, blocks[len(blocks) // 2 :]
        )  # a second core takes half
        try:
            _move(blocks[: len(blocks) // 2])
        finally:
            half.result()  # the helper never outlives the copy it was given

    def _small_pages(self) -> bool:
        """Is a page of one part of one layer small enough to copy keeping the GIL?"""
        return self.page_size * max(self.widths) * self.dtype.itemsize < _SMALL_BYTES

    def _copy_small_pages(
        self,
        pool: DeviceKVPool,
        layer: int,
        dev: np.ndarray,
        host: np.ndarray,
        to_host: bool,
    ) -> None:
        """Small whole pages (CPU pool): per part, a gather-scatter of whole pages, each page one
        numpy element (a void item of the page's bytes), in pieces of fewer than GIL_CHUNK
        pages and at most `_PIECE_BYTES`. numpy keeps the GIL for such a piece, so the copy
        never hands the GIL to another thread and waits to win it back (docs/design.md §2):
        over uint8 rows it let the GIL go at any size, and a page-1 load of 600 tokens took
        2 ms behind the storage thread's Python. Every page number is checked first, as
        torch indexing would (numpy would wrap a negative one)."""
        if dev.size == 0:
            return
        dev_views, host_views = self._page_arrays(pool, layer)
        dev_pages, host_pages = dev_views[0].shape[0], host_views[0].shape[0]
        step = max(
            1, min(GIL_CHUNK - 1, _PIECE_BYTES // max(v.itemsize for v in dev_views))
        )
        d_pieces, h_pieces = (
            _pieces(dev, step, 0, dev_pages - 1),
            _pieces(host, step, 0, host_pages - 1),
        )
        if d_pieces is None or h_pieces is None:
            raise IndexError(
                f"copy plan pages out of range (pool {dev_pages}, mirror {host_pages} pages)"
            )
        pieces = list(zip(d_pieces, h_pieces))
        for dv, hv in zip(dev_views, host_views):
            for d, h in pieces:
                if to_host:
                    hv[h] = dv[d]
                else:
                    dv[d] = hv[h]

    def _page_arrays(
        self, pool: DeviceKVPool, layer: int
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per part of `layer`, pool side and mirror side, a 1-D numpy view with one void item
        of a page's bytes per page; made once per pool and layer."""
        if self._arrays_of is not pool:
            self._arrays_of, self._arrays = pool, {}
        got = self._arrays.get(layer)
        if got is None:

            def pages_of(
                t: torch.Tensor,
            ) -> np.ndarray:  # [slots or pages, ..., width] -> [pages] of page bytes
                a = t.view(torch.uint8).numpy()
                return _items(
                    a.reshape(-1, self.page_size * a.shape[-1], copy=False)
                )  # raises rather than copy

            got = (
                [pages_of(r) for r in pool.rows(layer)],
                [pages_of(v) for v in self._views[layer]],
            )
            self._arrays[layer] = got
        return got

    # -- pages for L3 ------------------------------------------------------------------------

    def page_view(self, host_page: int) -> torch.Tensor:
        """The bytes of one page, all layers, as uint8: a view (zero copy) in page_first."""
        self._check_page(host_page)
        if self.config.layout == "page_first":
            return self.data[host_page].view(torch.uint8)
        blocks = [
            self._views[l][p][host_page].reshape(-1)
            for l in range(self.num_layers)
            for p in range(len(self.widths))
        ]
        return torch.cat(blocks).view(torch.uint8)

    def page_views(self, host_pages) -> list[np.ndarray]:
        """`page_view` of each page as a numpy uint8 array (page_first only): numpy views of
        one array made once, for the store's batches (no torch call per page, so the storage
        thread keeps the GIL instead of handing it to the scheduler and back)."""
        if self.config.layout != "page_first":
            raise ValueError(
                "page_views: layout='page_first' only (a layer_first page is not contiguous)"
            )
        pages = (
            as_numpy(host_pages)
            if isinstance(host_pages, torch.Tensor)
            else np.asarray(host_pages, np.int64)
        )
        if (
            _pieces(pages, GIL_CHUNK - 1, 1, self.size // self.page_size) is None
        ):  # min and max per piece
            raise ValueError(
                f"page_views: pages must be in [1, {self.size // self.page_size}] (0 is padding)"
            )
        whole = self._page_bytes_np
        return [whole[p] for p in pages.tolist()]

    def write_page(
        self, host_page: int, data: bytes | bytearray | memoryview | torch.Tensor
    ) -> None:
        """Overwrite one page with `page_bytes` bytes (as laid out by `page_view`)."""
        self._check_page(host_page)
        src = (
            data
            if isinstance(data, torch.Tensor)
            else torch.frombuffer(bytearray(data), dtype=torch.uint8)
        )
        if src.numel() != self.page_bytes:
            raise ValueError(
                f"write_page: got {src.numel()} bytes, a page is {self.page_bytes}"
            )
        if self.config.layout == "page_first":
            self.data[host_page].view(torch.uint8).copy_(src)
            return
        offset = 0
        for layer in range(self.num_layers):
            for view in self._views[layer]:
                dst = view[host_page]
                nbytes = dst.numel() * self.dtype.itemsize
                dst.copy_(
                    src[offset : offset + nbytes].view(self.dtype).view(dst.shape)
                )
                offset += nbytes

    def write_pages(self, host_pages: np.ndarray, data: np.ndarray) -> None:
        """Overwrite `host_pages` with the rows of `data` (uint8, one row of `page_bytes` per
        page). Pages of at most `_PIECE_BYTES` are copied keeping the GIL, as
        `_copy_small_pages` does; bigger ones by one numpy copy that lets it go."""
        if data.dtype != np.uint8 or data.shape != (len(host_pages), self.page_bytes):
            raise ValueError(
                f"write_pages: got rows of {data.dtype} and shape {data.shape}, want uint8 "
                f"({len(host_pages)}, {self.page_bytes})"
            )
        if self.config.layout != "page_first":
            for p, row in zip(host_pages.tolist(), data):
                self.write_page(p, row.tobytes())
            return
        pages = np.asarray(host_pages, np.int64)
        if pages.size == 0:
            return
        big = (
            self.page_bytes > _PIECE_BYTES
        )  # one copy, which lets the GIL go: it is long anyway
        step = (
            pages.shape[0]
            if big
            else min(GIL_CHUNK - 1, _PIECE_BYTES // self.page_bytes)
        )
        last = self.size // self.page_size
        pieces = _pieces(pages, step, 1, last)
        if pieces is None:
            raise ValueError(
                f"write_pages: pages must be in [1, {last}] (0 is padding)"
            )
        if big:
            self._page_bytes_np[pages] = data
            return
        rows = _items(np.ascontiguousarray(data))
        for i, piece in zip(range(0, pages.shape[0], step), pieces):
            self._pages_np[piece] = rows[i : i + step]

    def _check_page(self, host_page: int) -> None:
        if not 1 <= host_page <= self.size // self.page_size:
            raise ValueError(
                f"host_page={host_page}: must be in [1, {self.size // self.page_size}] (0 is padding)"
            )
