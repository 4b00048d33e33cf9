"""A pool over tensors the engine allocated (DeviceKVPool.from_tensors): the mirror copies
them layer by layer, bit-exact, and a bad set of tensors is refused naming the layer."""

import pytest
import torch

from kvtier.tiers.mirror import HostMirror, MirrorConfig
from kvtier.tiers.pool import DeviceKVPool


def engine_tensors(attention, page_size, layers=3, pages=6, seed=0, dim=8):
    """Per-layer tensors laid out as SGLang's MHATokenToKVPool / MLATokenToKVPool do,
    filled with random bytes (NaN payloads included)."""
    rows = pages * page_size + page_size
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        t = torch.empty(*shape, dtype=torch.bfloat16)
        t.view(torch.uint8).copy_(
            torch.randint(
                0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8
            )
        )
        return t

    if attention == "mla":
        return [rand(rows, 1, dim + 4) for _ in range(layers)], None
    return [rand(rows, 2, dim) for _ in range(layers)], [
        rand(rows, 2, dim // 2) for _ in range(layers)
    ]


def all_bytes(bufs, idx):
    return [b[idx].view(torch.uint8).clone() for b in bufs]


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("pages", [[3, 1], [1, 2, 3, 4]])  # scattered / one run
@pytest.mark.parametrize(
    "dim", [8, 2048]
)  # small pages (copied under the GIL) / big ones
def test_device_host_device_bytes_equal(attention, page_size, layout, pages, dim):
    k, v = engine_tensors(attention, page_size, dim=dim)
    pool = DeviceKVPool.from_tensors(
        k, v, page_size=page_size, kv_lora_rank=8 if attention == "mla" else None
    )
    assert (
        not pool.stacked and pool.buffers[1][0] is k[1]
    )  # the engine's tensors, not copies
    assert (
        pool.config.size == 6 * page_size
        and pool.config.num_layers == 3
        and pool.config.dtype == "bfloat16"
    )
    mirror = HostMirror(pool, MirrorConfig(ratio=2.0, layout=layout))
    ps = page_size
    dev = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])
    host = mirror.allocator.alloc(dev.numel())
    parts = k + (v or [])
    before = all_bytes(parts, dev)
    mirror.backup(pool, dev, host)
    k2, v2 = engine_tensors(attention, page_size, seed=1, dim=dim)
    target = DeviceKVPool.from_tensors(k2, v2, page_size=page_size)
    dst = torch.arange(dev.numel()).flip(0) + ps  # other slots, in reverse
    untouched = all_bytes(k2 + (v2 or []), torch.arange(ps))
    mirror.load(target, host, dst)
    for a, b in zip(before, all_bytes(k2 + (v2 or []), dst)):
        assert torch.equal(a, b)
    for a, b in zip(untouched, all_bytes(k2 + (v2 or []), torch.arange(ps))):
        assert torch.equal(a, b)  # padding rows not written


def test_mla_views_and_mha_v_head_dim():
    k, _ = engine_tensors("mla", 4)
    pool = DeviceKVPool.from_tensors(k, page_size=4, kv_lora_rank=8)
    assert pool.config.attention == "mla" and (
        pool.config.kv_lora_rank,
        pool.config.rope_dim,
    ) == (8, 4)
    assert (
        pool.v_buffer(2).shape == (28, 1, 8)
        and pool.v_buffer(2).data_ptr() == k[2].data_ptr()
    )
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DeviceKVPool.from_tensors(k, page_size=4).v_buffer(0)
    k, v = engine_tensors("mha", 4)
    cfg = DeviceKVPool.from_tensors(k, v, page_size=4).config
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.v_head_dim) == (2, 8, 4)


def test_bad_tensors_are_refused_naming_the_layer():
    k, v = engine_tensors("mha", 4)
    with pytest.raises(ValueError, match=r"v_buffers\[2\].*every layer must match"):
        DeviceKVPool.from_tensors(k, v[:2] + [v[2].float()], page_size=4)
    with pytest.raises(ValueError, match=r"k_buffers\[1\].*every layer must match"):
        DeviceKVPool.from_tensors([k[0], k[1][:-4], k[2]], v, page_size=4)
    with pytest.raises(ValueError, match="3 k_buffers but 2 v_buffers"):
        DeviceKVPool.from_tensors(k, v[:2], page_size=4)
    with pytest.raises(ValueError, match=r"k_buffers\[0\] is not contiguous"):
        DeviceKVPool.from_tensors(
            [t.transpose(0, 1).contiguous().transpose(0, 1) for t in k], v, page_size=4
        )
    with pytest.raises(ValueError, match="multiple of page_size=16"):
        DeviceKVPool.from_tensors(k, v, page_size=16)
    with pytest.raises(ValueError, match="allowed dtypes"):
        DeviceKVPool.from_tensors(
            [t.view(torch.int16) for t in k],
            [t.view(torch.int16) for t in v],
            page_size=4,
        )
    with pytest.raises(ValueError, match="MLA latent"):
        DeviceKVPool.from_tensors(k, page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        DeviceKVPool.from_tensors(k, v, page_size=0)
