"""CUDA paths: pinned mirror, side-stream transfers with per-layer events, the Triton kernel
compiled for the GPU. They need a GPU; here they skip, saying so."""

import threading

import pytest
import torch

cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (this machine has none)"
)


@cuda
def test_pinned_mirror_and_kernel_round_trip_on_gpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from kvtier.tiers.mirror import HostMirror, MirrorConfig
    from kvtier.tiers.pool import DeviceKVPool, PoolConfig

    pool = DeviceKVPool(
        PoolConfig(
            size=256,
            num_layers=2,
            page_size=16,
            num_kv_heads=2,
            head_dim=64,
            device="cuda",
        )
    )
    for part in pool.parts:
        part.normal_()
    for io in ("direct", "kernel"):
        mirror = HostMirror(pool, MirrorConfig(io=io))
        assert mirror.pinned and mirror.io == io
        dev = torch.arange(16, 48, device="cuda")
        host = mirror.allocator.alloc(32)
        mirror.backup(pool, dev, host)
        torch.cuda.synchronize()
        target = DeviceKVPool(pool.config)
        mirror.load(target, host, torch.arange(64, 96, device="cuda"))
        torch.cuda.synchronize()
        assert torch.equal(target.parts[0][:, 64:96], pool.parts[0][:, 16:48])


@cuda
def test_cuda_stream_signals_each_layer():
    from kvtier.tiers.streams import CudaTransferStream, Handle

    stream = CudaTransferStream("test", torch.device("cuda"))
    src = torch.randn(4, 1 << 20, device="cuda")
    dst = torch.empty_like(src)

    launched_on = []

    def job(h: Handle) -> None:
        launched_on.append(threading.get_ident())
        assert (
            torch.cuda.current_stream() == stream.stream
        )  # the side stream, not the forward's
        for layer in range(4):
            dst[layer].copy_(src[layer], non_blocking=True)
            h.layer_done(layer)

    handle = stream.submit(job, Handle(4))
    for layer in range(4):
        handle.wait_layer(layer)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(dst, src)
    assert handle.wait(10)
    assert (
        launched_on and launched_on[0] != threading.get_ident()
    )  # a worker launched the copies
    stream.close()


@cuda
def test_state_slots_round_trip_through_a_pinned_mirror_on_gpu(monkeypatch):
    """A hybrid model's recurrent states (one slot a page) go device -> pinned host ->
    device byte for byte on both I/O paths, and are copied slot to slot on the GPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from kvtier.tiers.mirror import HostMirror, MirrorConfig
    from kvtier.tiers.pool import DeviceKVPool, StatePoolConfig

    pool = DeviceKVPool(
        StatePoolConfig(size=32, num_layers=2, state_shape=(4, 16), device="cuda")
    )
    for part in pool.parts:
        part.normal_()
    dev = torch.tensor([5, 2, 9], device="cuda")
    into = torch.tensor([1, 7, 3], device="cuda")
    for io in ("direct", "kernel"):
        mirror = HostMirror(pool, MirrorConfig(io=io))
        assert mirror.pinned and mirror.io == io
        host = mirror.allocator.alloc(3)
        mirror.backup(pool, dev, host)
        torch.cuda.synchronize()
        target = DeviceKVPool(pool.config)
        mirror.load(target, host, into)
        torch.cuda.synchronize()
        assert torch.equal(target.parts[0][:, into], pool.parts[0][:, dev])
    pool.copy_states(dev, torch.tensor([10, 11, 12], device="cuda"))
    assert torch.equal(pool.parts[0][:, 10:13], pool.parts[0][:, dev])
