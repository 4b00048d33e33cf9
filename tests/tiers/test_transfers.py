import logging
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from kvtier.tiers.indices import page_slots
from kvtier.tiers.mirror import HostMirror, MirrorConfig
from kvtier.tiers.pool import DeviceKVPool, PoolConfig
from kvtier.tiers.req_to_token import ReqToTokenPool

from tests.gil import gil_watch


def filled_pool(attention, page_size, seed=0):
    cfg = PoolConfig(
        size=4 * page_size * 2,
        num_layers=2,
        page_size=page_size,
        attention=attention,
        num_kv_heads=2,
        head_dim=8,
        v_head_dim=4,
        kv_lora_rank=8,
        rope_dim=4,
        dtype="float16",
    )
    pool = DeviceKVPool(cfg)
    g = torch.Generator().manual_seed(seed)
    for layer in pool.buffers:
        for b in layer:
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    return pool


def layer_bytes(pool, layer, idx):
    return [b[idx] for b in pool.buffers[layer]]


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("io", ["direct", "kernel"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_round_trip_is_bitwise(attention, layout, io, page_size):
    pool = filled_pool(attention, page_size)
    mirror = HostMirror(pool, MirrorConfig(ratio=2.0, layout=layout, io=io))
    assert mirror.io == io  # the interpreter runs the kernel path on CPU
    ps = page_size
    # two device pages in reverse order, to two host pages in another order
    dev = torch.cat([torch.arange(3 * ps, 4 * ps), torch.arange(1 * ps, 2 * ps)])
    host = mirror.allocator.alloc(2 * ps)
    host = torch.cat([host[ps:], host[:ps]])
    before = [
        layer_bytes(pool, layer, dev) for layer in range(pool.num_layers)
    ]  # copies (index lists)
    mirror.backup(pool, dev, host)
    target = DeviceKVPool(pool.config)
    dst = torch.arange(5 * ps, 7 * ps)
    for layer in range(pool.num_layers):
        mirror.load_layer(target, host, dst, layer)
        assert all(
            torch.equal(a, b)
            for a, b in zip(before[layer], layer_bytes(pool, layer, dev))
        )
        for a, b in zip(before[layer], layer_bytes(target, layer, dst)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # nothing else on the target was written
    untouched = torch.ones(target.buffers[0][0].shape[0], dtype=torch.bool)
    untouched[dst] = False
    assert not target.buffers[1][0][untouched].any()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("n", [9, 140])
def test_scattered_small_pages_round_trip_bitwise_in_every_dtype(dtype, layout, n):
    """Small whole pages in no order are copied as bytes (a gather-scatter of whole pages
    per part, on a CPU pool): bitwise in every dtype,
    bfloat16 included (numpy has none), NaN payloads kept."""
    ps = 4
    cfg = PoolConfig(
        size=160 * ps,
        num_layers=3,
        page_size=ps,
        num_kv_heads=2,
        head_dim=8,
        v_head_dim=4,
        dtype=dtype,
    )
    pool = DeviceKVPool(cfg)
    g = torch.Generator().manual_seed(1)
    for part in pool.parts:
        part.view(torch.uint8).copy_(
            torch.randint(
                0, 256, part.view(torch.uint8).shape, generator=g, dtype=torch.uint8
            )
        )
    mirror = HostMirror(pool, MirrorConfig(ratio=2.0, layout=layout))
    pages = torch.randperm(159, generator=g)[:n] + 1
    dev = (pages[:, None] * ps + torch.arange(ps)).flatten()
    host = (
        mirror.allocator.alloc(dev.numel()).view(-1, ps).flip(0).flatten()
    )  # pages in reverse
    assert mirror.plan(dev, host).device_pages is not None  # the whole-page path
    before = [[b.clone() for b in layer] for layer in pool.buffers]
    mirror.backup(pool, dev, host)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for la, lb in zip(before, pool.buffers)
        for a, b in zip(la, lb)
    )  # a backup only reads the pool
    target = DeviceKVPool(cfg)
    dst_pages = torch.randperm(159, generator=g)[:n] + 1
    dst = (dst_pages[:, None] * ps + torch.arange(ps)).flatten()
    mirror.load(target, host, dst)
    for layer in range(cfg.num_layers):
        for a, b in zip(before[layer], target.buffers[layer]):
            assert torch.equal(a[dev].view(torch.uint8), b[dst].view(torch.uint8))
            rest = torch.ones(b.shape[0], dtype=torch.bool)
            rest[dst] = False
            assert not b[rest].view(torch.uint8).any()


@pytest.mark.parametrize("ps", [1, 4])
def test_page_first_copies_whole_pages_by_number_even_when_they_continue_each_other(ps):
    """In page_first a page's slots of one layer are never next to the next page's, so
    merging runs gains nothing there: the plan stays by page, at page size 1 too (as runs
    it was one run per slot: a torch view or a memmove each, holding the GIL). layer_first
    merges them."""
    pool = filled_pool("mha", ps)
    dev = torch.arange(ps, 4 * ps)  # pages 1-3, in order
    for layout, by_page in (("page_first", True), ("layer_first", False)):
        mirror = HostMirror(pool, MirrorConfig(ratio=2.0, layout=layout))
        host = mirror.allocator.alloc(3 * ps)
        assert torch.equal(host, torch.arange(ps, 4 * ps))  # pages 1-3 there too
        plan = mirror.plan(dev, host)
        assert (plan.device_pages is not None) == by_page, layout
        if not by_page:
            assert plan.runs == [(ps, ps, 3 * ps)]
        mirror.backup(pool, dev, host)
        target = DeviceKVPool(pool.config)
        mirror.load(target, host, dev)
        for layer in range(pool.num_layers):
            for a, b in zip(pool.buffers[layer], target.buffers[layer]):
                assert torch.equal(
                    a[dev].view(torch.uint8), b[dev].view(torch.uint8)
                ), (layout, layer)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_page_view_round_trip(layout):
    pool = filled_pool("mha", 4)
    mirror = HostMirror(pool, MirrorConfig(layout=layout))
    host = mirror.allocator.alloc(8)
    mirror.backup(pool, torch.arange(4, 12), host)
    pages = [int(host[0]) // 4, int(host[4]) // 4]
    blobs = [bytes(mirror.page_view(p).numpy()) for p in pages]
    assert len(blobs[0]) == mirror.page_bytes
    other = HostMirror(pool, MirrorConfig(layout=layout))
    dst = other.allocator.alloc(8)
    for p, blob in zip([int(dst[0]) // 4, int(dst[4]) // 4], blobs):
        other.write_page(p, blob)
    target = DeviceKVPool(pool.config)
    other.load(target, dst, torch.arange(4, 12))
    for layer in range(2):
        for a, b in zip(pool.buffers[layer], target.buffers[layer]):
            assert torch.equal(a[4:12], b[4:12])


def test_page_first_view_is_zero_copy():
    pool = filled_pool("mha", 4)
    mirror = HostMirror(pool, MirrorConfig(layout="page_first"))
    view = mirror.page_view(1)
    view.zero_()
    assert not mirror.view(0, 0)[1].any() and not mirror.view(1, 1)[1].any()


def test_page_views_are_the_pages_zero_copy():
    """The store's batch views: the same bytes as `page_view`, sharing the mirror's memory
    (a read written into one lands in the mirror); out-of-range pages and layer_first refused."""
    pool = filled_pool("mha", 4)
    mirror = HostMirror(pool, MirrorConfig(layout="page_first"))
    mirror.backup(pool, torch.arange(4, 12), torch.arange(4, 12))
    views = mirror.page_views(torch.tensor([2, 1, 2]))
    assert [bytes(v) for v in views] == [
        bytes(mirror.page_view(p).numpy()) for p in (2, 1, 2)
    ]
    views[1][:] = 7
    assert (mirror.page_view(1).numpy() == 7).all() and not (
        mirror.page_view(2).numpy() == 7
    ).all()
    last = mirror.size // mirror.page_size
    assert len(mirror.page_views([last])[0]) == mirror.page_bytes
    for bad in ([0], [last + 1], [-1]):
        with pytest.raises(ValueError, match=r"page_views: pages must be in \[1, "):
            mirror.page_views(bad)
    with pytest.raises(ValueError, match="page_first"):
        HostMirror(pool, MirrorConfig(layout="layer_first")).page_views([1])


def test_kernel_falls_back_to_direct_on_cpu_without_interpreter(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with caplog.at_level(logging.INFO):
        mirror = HostMirror(filled_pool("mha", 1), MirrorConfig(io="kernel"))
    assert mirror.io == "direct"
    assert "direct path" in caplog.text


def test_triton_kernel_copies_rows_between_paged_and_flat():
    from kvtier.tiers.kernels import copy_rows

    src = torch.arange(40, dtype=torch.float32).view(10, 4)
    dst = torch.zeros(3, 2, 4)  # 3 pages of 2 rows
    copy_rows(src, dst, torch.tensor([7, 2, 9]), torch.tensor([5, 0, 2]))
    assert torch.equal(dst.view(6, 4)[[5, 0, 2]], src[[7, 2, 9]])
    assert not dst.view(6, 4)[[1, 3, 4]].any()


def test_mirror_sized_by_bytes_and_refuses_too_much():
    pool = filled_pool("mha", 4)
    mirror = HostMirror(pool, MirrorConfig(size_bytes=3 * 4 * pool.bytes_per_token))
    assert mirror.size == 12 and mirror.allocator.available_size() == 12
    with pytest.raises(
        MemoryError, match="needs .* bytes but only .* bytes are available"
    ):
        HostMirror(pool, MirrorConfig(size_bytes=1 << 60))


@pytest.mark.parametrize(
    "field,value", [("layout", "rows"), ("io", "dma"), ("ratio", -1), ("size_bytes", 0)]
)
def test_bad_mirror_config(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        MirrorConfig(**{field: value})


@pytest.mark.parametrize(
    "field,value", [("page_size", 0), ("size", -4), ("num_layers", 1.5)]
)
def test_bad_pool_config(field, value):
    kwargs = dict(size=16, num_layers=1, page_size=1)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        PoolConfig(**kwargs)


def test_wrong_index_dtype_or_length():
    pool = filled_pool("mha", 1)
    mirror = HostMirror(pool)
    with pytest.raises(ValueError, match="device_indices.*int64"):
        mirror.backup(pool, torch.tensor([1], dtype=torch.int32), torch.tensor([1]))
    with pytest.raises(ValueError, match="host_indices: expected 1 indices, got 2"):
        mirror.backup(pool, torch.tensor([1]), torch.tensor([1, 2]))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("where", ["device", "host"])
def test_out_of_range_slots_raise_and_write_nothing(page_size, where):
    """The CPU path copies raw memory blocks: its bounds check is all that stands between a
    bad index and a write past the buffer."""
    pool = filled_pool("mha", page_size)
    mirror = HostMirror(pool, MirrorConfig(ratio=1.0, layout="page_first"))
    ps = page_size
    host = mirror.allocator.alloc(ps)
    dev = torch.arange(ps, 2 * ps)
    mirror.backup(pool, dev, host)
    before = [b.clone() for layer in pool.buffers for b in layer]
    beyond = torch.arange(10_000 * ps, 10_001 * ps)
    src, dst = (beyond, dev) if where == "host" else (host, beyond)
    with pytest.raises(IndexError, match="out of range"):
        mirror.load_layer(pool, src, dst, 0)
    assert all(
        torch.equal(a, b)
        for a, b in zip(before, [b for layer in pool.buffers for b in layer])
    )


def test_set_kv_and_req_to_token():
    pool = filled_pool("mha", 1)
    loc = torch.tensor([3, 5])
    pool.set_kv(0, loc, torch.ones(2, 2, 8), torch.full((2, 2, 4), 2.0))
    assert (pool.k_buffer(0)[loc] == 1).all() and (pool.v_buffer(0)[loc] == 2).all()
    assert pool.bytes_per_token == 2 * (16 + 8) * 2
    rows = ReqToTokenPool(4, 16)
    r = rows.alloc(1)
    assert r.tolist() == [1]
    rows.write(1, 2, loc)
    assert rows.read(1, 4).tolist() == [0, 0, 3, 5]
    with pytest.raises(ValueError, match="max_context_len"):
        rows.write(1, 15, loc)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("ps", [1, 4])
def test_small_page_copies_keep_the_gil(layout, ps):
    """A backup and a load of 1,500 small pages, and a store read's copy of 600 into host
    pages, run without letting the GIL go (`gil_watch`; each numpy call moves up to 256 KiB,
    tens of microseconds: a release would let the spinner in). Over uint8 rows numpy let
    the GIL go at any size, and winning it back behind the storage thread's Python held a
    page-1 load 2 ms (docs/design.md §2). The copies run in pieces (fewer than GIL_CHUNK
    pages each) and stay bitwise."""
    n = 1500  # pages of 4 KiB a part and layer
    cfg = PoolConfig(
        size=(2 * n + 4) * ps,
        num_layers=2,
        page_size=ps,
        num_kv_heads=8 // ps,
        head_dim=256,
        dtype="float16",
    )
    pool = DeviceKVPool(cfg)
    for part in pool.parts:
        bytes_ = part.view(torch.uint8)
        bytes_.copy_(
            torch.randint(
                0,
                256,
                bytes_.shape,
                generator=torch.Generator().manual_seed(3),
                dtype=torch.uint8,
            )
        )
    mirror = HostMirror(pool, MirrorConfig(ratio=0.5, layout=layout))
    rng = np.random.default_rng(0)
    offsets = np.arange(ps, dtype=np.int64)

    def slots(pages):
        return (pages[:, None] * ps + offsets).reshape(-1)

    dev = slots(rng.permutation(np.arange(1, n + 1)))
    dst = slots(rng.permutation(np.arange(n + 1, 2 * n + 1)))  # slots no backup reads
    host = slots(mirror.allocator.alloc(n * ps).numpy()[::ps][::-1] // ps)
    mirror.load(
        pool, host[:ps], dst[:ps]
    )  # the pool's page views are made on a first copy: torch calls
    host_pages = host[::ps] // ps
    rows = (
        mirror._page_bytes_np[host_pages[:600]].copy()
        if layout == "page_first"
        else None
    )
    with gil_watch() as progress:
        moved = [
            progress(lambda: mirror.backup(pool, dev, host)),
            progress(lambda: mirror.load(pool, host, dst)),
        ]
        if layout == "page_first":
            moved.append(
                progress(lambda: mirror.write_pages(host_pages[600:1200], rows))
            )
    assert moved == [0] * len(moved)
    for layer in range(cfg.num_layers):
        for rows_ in pool.rows(layer):
            assert torch.equal(
                rows_[torch.from_numpy(dev)].view(torch.int16),
                rows_[torch.from_numpy(dst)].view(torch.int16),
            )
    if layout == "page_first":
        assert np.array_equal(mirror._page_bytes_np[host_pages[600:1200]], rows)


def test_a_copy_plan_over_many_pages_keeps_the_gil():
    """A plan finds whole pages of 60,000 pages (a long prompt's load at page size 4) and
    counts their continuations in pieces, without letting the GIL go: one numpy pass over
    them did (`first % ps`, `first // ps`, the pages times the page size)."""
    from kvtier.tiers.mirror import _continuing, _whole_pages

    pages = np.arange(1, 60_001, dtype=np.int64)
    slots = page_slots(pages, 4)
    with gil_watch() as progress:
        moved = [
            progress(lambda: _whole_pages(slots, 4)),
            progress(lambda: _continuing(pages, pages[::-1])),
        ]
    assert moved == [0, 0]
    assert (
        np.array_equal(_whole_pages(slots, 4), pages)
        and _whole_pages(slots[1:-3], 4) is None
    )


def _runs_reference(s, d, split):
    """What `runs` computed in one numpy pass (the old code): the oracle of its pieces."""
    if s.shape[0] == 0:
        return []
    breaks = (np.diff(s) != 1) | (np.diff(d) != 1)
    if split > 0:
        breaks |= d[1:] % split == 0
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    return list(
        zip(
            s[starts].tolist(),
            d[starts].tolist(),
            np.diff(starts, append=s.shape[0]).tolist(),
        )
    )


@given(
    st.lists(st.tuples(st.integers(-3, 3), st.integers(-3, 3)), max_size=1300),
    st.sampled_from([0, 1, 4, 16]),
)
@settings(max_examples=200, deadline=None)
def test_merged_runs_match_one_pass(steps, split):
    """Runs merged in pieces of GIL_CHUNK pairs are the runs one pass finds, whatever the
    breaks and wherever a piece ends (a run across a piece's edge stays one run)."""
    s = np.cumsum([5] + [1 + a for a, _ in steps]).astype(np.int64)
    d = np.cumsum([9] + [1 + b for _, b in steps]).astype(np.int64)
    from kvtier.tiers.indices import runs

    assert runs(s, d, split) == _runs_reference(s, d, split)
    assert sum(n for _, _, n in runs(s, d, split)) == s.shape[0]
    with pytest.raises(
        ValueError, match="runs: .* source slots but .* destination slots"
    ):
        runs(s, d[1:], split)  # one pass raised on the lengths too


def test_merging_runs_and_the_stores_page_views_keep_the_gil():
    """A layer_first load's runs over 60,000 slots (20,000 runs) and the storage thread's
    views of 200,000 host pages are worked out without letting the GIL go (`gil_watch`): one
    numpy pass over them did (`np.diff`, `min`, `max`), and the copy thread then waited
    behind the storage thread's Python to win it back (docs/design.md §2). (A release of
    a microsecond or two, `min` over 1,500 pages, ends before the spinner wakes: 200,000
    pages make it long enough to catch.)"""
    from kvtier.tiers.indices import runs

    s = np.arange(1, 60_001, dtype=np.int64)
    d = (s.reshape(-1, 3)[::-1] + 100).reshape(-1)  # runs of 3, in reverse order
    pool = DeviceKVPool(
        PoolConfig(
            size=200_004,
            num_layers=1,
            page_size=1,
            num_kv_heads=1,
            head_dim=4,
            dtype="float16",
        )
    )
    mirror = HostMirror(pool, MirrorConfig(ratio=1.0, layout="page_first"))
    pages = np.arange(1, 200_001, dtype=np.int64)
    with gil_watch() as progress:
        moved = [
            progress(lambda: runs(s, d)),
            progress(lambda: mirror.page_views(pages)),
        ]
    assert moved == [0, 0]
    assert runs(s, d) == _runs_reference(s, d, 0) and len(runs(s, d)) == 20_000
    assert len(mirror.page_views(pages)) == 200_000


def test_gil_watch_counts_hand_offs_not_time():
    """`gil_watch` counts the times the GIL was let go, whatever the block's length: a
    block that holds the GIL longer than the old watch's half-second interval (what a
    process descheduled on a loaded machine looks like to it) counted as a release there,
    and made the tests above fail at load 6-9. A block that sleeps lets it go, and is
    counted."""

    def busy():
        end = time.monotonic() + 0.4  # three of them: past the old interval
        while time.monotonic() < end:
            pass

    def sleeps():
        for _ in range(10):
            time.sleep(0.01)

    with gil_watch() as progress:
        assert progress(busy) == 0
        assert progress(sleeps) > 0


@pytest.mark.parametrize("cores, helper", [({5}, False), ({2, 9}, True)])
def test_a_big_copy_takes_a_helper_thread_only_where_this_process_has_two_cores(
    monkeypatch, cores, helper
):
    """A big CPU copy is split with a helper thread when there is a second core for it:
    the cores this process may run on (its affinity mask: a container's cpuset,
    `taskset`), not the machine's. Confined to one core of 64, it made a helper that could
    only take turns with the copying thread. The round trip is bitwise either way."""
    import os

    from kvtier.tiers import mirror as mirror_module

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores, raising=False)
    monkeypatch.setattr(mirror_module, "_SPLIT_BYTES", 1)  # every copy is "big"
    monkeypatch.setattr(mirror_module, "_helper", None)
    pool = filled_pool("mha", 16)
    mirror = HostMirror(pool, MirrorConfig(ratio=2.0, layout="layer_first"))
    dev = torch.arange(16, 48)
    host = mirror.allocator.alloc(32)
    before = [layer_bytes(pool, layer, dev) for layer in range(pool.num_layers)]
    mirror.backup(pool, dev, host)
    target = DeviceKVPool(pool.config)
    for layer in range(pool.num_layers):
        mirror.load_layer(target, host, dev, layer)
        for a, b in zip(before[layer], layer_bytes(target, layer, dev)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert (mirror_module._helper is not None) is helper
    if mirror_module._helper is not None:
        mirror_module._helper.shutdown()
