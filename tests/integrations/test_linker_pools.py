"""The linker's pool cores for a hybrid model (kvtier/integrations/sglang/linker/pools.py),
engine-free: a KV pool beside an SWA pool or a Mamba state pool, each its own LinkerCore."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.hashing import Namespace
from kvtier.integrations.sglang.linker.core import LinkerCore, LinkerSettings
from kvtier.integrations.sglang.linker.pools import KV, PoolCores, Side, StateRows
from kvtier.testing.linker_sim import page_keys
from kvtier.tiers.indices import page_slots
from kvtier.tiers.mirror import MirrorConfig
from kvtier.tiers.pool import DeviceKVPool, PoolConfig

PS = 4


def kv_pool() -> DeviceKVPool:
    return DeviceKVPool(
        PoolConfig(
            size=PS * 16,
            num_layers=2,
            page_size=PS,
            num_kv_heads=1,
            head_dim=2,
            dtype="float32",
        )
    )


def core(name: str, pool: DeviceKVPool) -> LinkerCore:
    ns = Namespace("t", "float32", f"t-{name}", pool.config.page_size)
    return LinkerCore(pool, LinkerSettings(ns, mirror=MirrorConfig(ratio=1.0)))


def slots(pages: list[int]) -> torch.Tensor:
    return torch.from_numpy(page_slots(torch.tensor(pages).numpy(), PS))


def mamba_cores():
    temporal = torch.zeros(2, 9, 2, 2)
    conv = torch.zeros(2, 9, 3, dtype=torch.bfloat16)
    states = StateRows([[temporal[i], conv[i]] for i in range(2)])
    owner = {0: (KV, 0), 1: ("mamba", 0), 2: (KV, 1), 3: ("mamba", 1)}
    cores = PoolCores({KV: core(KV, kv_pool()), "mamba": core("mamba", states)}, owner)
    return cores, temporal, conv


def settle(cores: PoolCores, n: int) -> None:
    deadline = time.monotonic() + 30
    while cores.num_completed_offloads() < n:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    for _ in range(n):
        assert cores.pop_completed_offload()


def test_a_bad_side_part_is_refused_before_any_pool_queues():
    """A side pool's part with the wrong number of slots is refused naming the pool, and
    no pool queued an op for it (the KV pool's would be left without its partner)."""
    cores, _, _ = mamba_cores()
    keys = page_keys([1, 2, 3])
    bad = {"mamba": Side(keys[-1:], torch.tensor([1, 2]))}
    with pytest.raises(ValueError, match="pool 'mamba': device_indices has 2 slots"):
        cores.offload(Side(keys, slots([1, 2, 3])), bad)
    with pytest.raises(ValueError, match="pool 'mamba'"):
        cores.load("r", Side(keys, slots([1, 2, 3])), bad)
    with pytest.raises(ValueError, match="pool 'swa': this linker serves"):
        cores.offload(Side(keys, slots([1, 2, 3])), {"swa": Side(keys, slots([1]))})
    assert not cores.offloads and not cores.kv.offloads.ops
    assert not cores.kv.loads.queued
    assert cores.check_accounting() == []
    cores.close()


def test_a_mamba_state_restores_only_where_it_was_taken_and_bit_for_bit():
    """States at the ends of [a b c] and [a b]: lengths 2 and 3 restore, 1 does not; a
    state's every bit comes back (a float32 NaN payload and a bf16 conv state), into
    another slot, each model layer's wait waiting for its own pool."""
    cores, temporal, conv = mamba_cores()
    keys = page_keys([1, 2, 3])
    temporal[:, 3] = torch.tensor([[1.5, float("nan")], [-0.0, 7.0]])
    temporal.view(torch.int32)[0, 3, 0, 1] = 0x7FC01234  # a NaN with a payload
    conv[:, 3] = torch.tensor([0.25, -3.0, 9.0])
    cores.offload(
        Side(keys, slots([1, 2, 3])), {"mamba": Side(keys[-1:], torch.tensor([3]))}
    )
    cores.offload(
        Side(keys[:2], slots([1, 2])), {"mamba": Side([keys[1]], torch.tensor([4]))}
    )
    settle(cores, 2)
    assert cores.lookup("r", keys, {"mamba": 1}) == [2, 3]
    assert cores.lookup("r", keys[:1], {"mamba": 1}) == []
    want = (temporal[:, 3].clone(), conv[:, 3].clone())
    assert cores.load(
        "r", Side(keys, slots([5, 6, 7])), {"mamba": Side(keys[-1:], torch.tensor([6]))}
    )
    index = cores.start_layer_wise_loading()
    cores.counter.set_consumer(index)
    for layer in range(4):
        cores.counter.wait_until(layer)
    assert cores.finish_layer_wise_loading(index)
    assert torch.equal(temporal[:, 6].view(torch.int32), want[0].view(torch.int32))
    assert torch.equal(conv[:, 6].view(torch.int16), want[1].view(torch.int16))
    assert cores.check_accounting() == []
    cores.close()


def test_a_conv_only_state_pool_moves_its_conv_states():
    """A conv-only model's temporal state is empty (SGLang sizes it 0): the state pool
    has no part for it, where a zero-width part failed every offload's copy (no length
    ever restored); the conv states come back bit for bit."""
    temporal = torch.zeros(2, 9, 0)
    conv = torch.zeros(2, 9, 4, dtype=torch.bfloat16)
    states = StateRows([[temporal[i], conv[i]] for i in range(2)])
    owner = {0: (KV, 0), 1: ("mamba", 0), 2: (KV, 1), 3: ("mamba", 1)}
    cores = PoolCores({KV: core(KV, kv_pool()), "mamba": core("mamba", states)}, owner)
    keys = page_keys([1, 2, 3])
    conv[:, 3] = torch.tensor([0.25, -3.0, 9.0, 1.5])
    cores.offload(
        Side(keys, slots([1, 2, 3])), {"mamba": Side(keys[-1:], torch.tensor([3]))}
    )
    settle(cores, 1)
    assert cores.lookup("r", keys, {"mamba": 1}) == [3]
    assert cores.load(
        "r", Side(keys, slots([5, 6, 7])), {"mamba": Side(keys[-1:], torch.tensor([6]))}
    )
    index = cores.start_layer_wise_loading()
    cores.counter.set_consumer(index)
    for layer in range(4):
        cores.counter.wait_until(layer)
    assert cores.finish_layer_wise_loading(index)
    assert torch.equal(conv[:, 6].view(torch.int16), conv[:, 3].view(torch.int16))
    assert cores.check_accounting() == []
    cores.close()
