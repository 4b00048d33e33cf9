"""A hybrid model's components in the tiers: recurrent state slots and sliding-window KV
beside full-attention KV, byte-exact through the pool, the mirror and the store (through the
controller's own two-phase ops), and stored under namespaces that name their geometry."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import shutil
import time

import numpy as np
import pytest
import torch

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.backends.frame import FrameError, decode, encode
from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.controller.config import ControllerConfig
from kvtier.controller.controller import CacheController, OpKind
from kvtier.controller.storage import PrefetchOp
from kvtier.errors import KvtierConfigError, TransferError
from kvtier.hashing import Namespace, key_maker, page_hashes
from kvtier.testing.parts import SimStreams
from kvtier.tiers.components import Component, ComponentSpec
from kvtier.tiers.indices import page_slots
from kvtier.tiers.mirror import HostMirror, MirrorConfig
from kvtier.tiers.pool import DeviceKVPool, PoolConfig, StatePoolConfig

BASE = Namespace("hybrid-test", "float32", "unused", 4, revision="abc")


def kv_config(layers: int, page_size: int = 4, dtype: str = "float32") -> PoolConfig:
    return PoolConfig(
        size=64,
        num_layers=layers,
        page_size=page_size,
        num_kv_heads=2,
        head_dim=4,
        dtype=dtype,
    )


def state_config(shape=(4, 6), dtype: str = "float32", layers: int = 2):
    return StatePoolConfig(size=16, num_layers=layers, state_shape=shape, dtype=dtype)


SPECS = {
    "full": ComponentSpec(Component.FULL, kv_config(3)),
    "swa": ComponentSpec(Component.SWA, kv_config(2), window=8),
    "mamba": ComponentSpec(Component.MAMBA, state_config()),
}


def filled(config: PoolConfig, seed: int) -> DeviceKVPool:
    pool = DeviceKVPool(config)
    g = torch.Generator().manual_seed(seed)
    for part in pool.parts:
        part.copy_(torch.randn(part.shape, generator=g).to(part.dtype))
    return pool


def slot_bytes(pool: DeviceKVPool, slots: np.ndarray) -> list[bytes]:
    """Every layer's bytes of `slots`, part by part."""
    idx = torch.from_numpy(np.asarray(slots, dtype=np.int64))
    return [
        rows[idx].contiguous().view(torch.uint8).numpy().tobytes()
        for layer in range(pool.num_layers)
        for rows in pool.rows(layer)
    ]


def device_pages(config: PoolConfig) -> np.ndarray:
    """Two pages, out of order: the slots of device pages 5 and 2."""
    return page_slots(np.array([5, 2], dtype=np.int64), config.page_size)


# -- the state pool ---------------------------------------------------------------------


def test_a_state_pool_holds_one_fixed_size_slot_per_sequence():
    pool = DeviceKVPool(state_config(shape=(4, 6)))
    assert pool.config.page_layout == "state:layers=2:shape=4x6"
    assert pool.config.part_widths == (24,)
    assert pool.state_buffer(1).shape == (17, 4, 6)  # slot 0 is padding
    states = torch.arange(48, dtype=torch.float32).view(2, 4, 6)
    pool.set_states(1, torch.tensor([3, 7]), states)
    pool.copy_states(torch.tensor([3, 7]), torch.tensor([9, 2]))
    assert torch.equal(pool.state_buffer(1)[torch.tensor([9, 2])], states)
    assert torch.equal(pool.state_buffer(0)[9], torch.zeros(4, 6))  # layer 0 was zero
    assert not pool.state_buffer(1)[0].any()  # padding untouched


def test_state_pool_config_and_misuse_are_refused_by_name():
    with pytest.raises(ValueError, match=r"state_shape=\(2, 0\): a tuple of integers"):
        StatePoolConfig(size=8, num_layers=1, state_shape=(2, 0))
    with pytest.raises(ValueError, match="state_shape=5: a tuple"):
        StatePoolConfig(size=8, num_layers=1, state_shape=5)
    with pytest.raises(ValueError, match="dtype='int8'"):
        StatePoolConfig(size=8, num_layers=1, state_shape=(2,), dtype="int8")
    from_yaml = StatePoolConfig(size=8, num_layers=1, state_shape=[2, 3])
    assert from_yaml.state_shape == (2, 3) and from_yaml.page_size == 1  # hashable
    pool, kv = DeviceKVPool(state_config()), DeviceKVPool(kv_config(1))
    with pytest.raises(ValueError, match="set_kv: a state pool holds states"):
        pool.set_kv(0, torch.tensor([1]), torch.zeros(1, 24))
    with pytest.raises(ValueError, match="state_buffer: for a state pool"):
        kv.state_buffer(0)
    with pytest.raises(ValueError, match=r"set_states: \(1, 4, 5\) for 1 slots"):
        pool.set_states(0, torch.tensor([1]), torch.zeros(1, 4, 5))


# -- pool <-> mirror, per component -------------------------------------------------------


@pytest.mark.parametrize("io", ["direct", "kernel"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("name", list(SPECS))
def test_pool_mirror_round_trip_is_byte_exact_per_component(name, layout, io):
    """Both I/O paths (the Triton kernel under its interpreter here, as in test_transfers)."""
    spec = SPECS[name]
    pool = filled(spec.pool, seed=1)
    mirror = HostMirror(pool, MirrorConfig(ratio=2.0, layout=layout, io=io))
    assert mirror.io == io
    dev = device_pages(spec.pool)
    host = mirror.allocator.alloc_slots(dev.size)
    mirror.backup(pool, dev, host)
    target, into = DeviceKVPool(spec.pool), device_pages(spec.pool)[::-1].copy()
    # the reversed pairing: page 2's bytes land in page 5 and the other way round
    mirror.load(target, torch.from_numpy(host[::-1].copy()), torch.from_numpy(into))
    assert slot_bytes(target, into) == slot_bytes(pool, dev[::-1].copy())
    # a page's bytes as the store frames them, written back into another host page
    ps = spec.pool.page_size
    first = int(host[0]) // ps
    payload = mirror.page_view(first).numpy().tobytes()
    assert len(payload) == mirror.page_bytes
    other = int(mirror.allocator.alloc_slots(ps)[0]) // ps
    mirror.write_page(other, payload)
    assert mirror.page_view(other).numpy().tobytes() == payload


# -- through the controller and a store ------------------------------------------------


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s")
        time.sleep(0.005)


def hashes_for(spec: ComponentSpec, pages: int, seed: int) -> list[bytes]:
    """Page hashes of the model's token chain (the FULL namespace's): a component's page,
    a state among them, is keyed by the hash of the prefix's page it belongs to."""
    tokens = np.random.default_rng(seed).integers(0, 1000, size=4 * pages)
    return page_hashes(tokens, 4, BASE.id)


def make_store(kind: str, tmp_path):
    if kind == "memory":
        return MemoryStore(MemoryStoreConfig(capacity_bytes=1 << 24))
    return FileStore(FileStoreConfig(root=str(tmp_path / "l3")))


def keys_of(spec: ComponentSpec, seed: int = 7) -> list[str]:
    key = key_maker("kvtier", spec.namespace(BASE).id)
    return [key(h) for h in hashes_for(spec, 2, seed)]


def controller(spec: ComponentSpec, store, seed: int | None = None):
    pool = filled(spec.pool, seed) if seed is not None else DeviceKVPool(spec.pool)
    return pool, CacheController(pool, HostMirror(pool), store, ControllerConfig())


def send(ctl: CacheController, spec: ComponentSpec, keys: list[str]) -> list[bytes]:
    """Write two device pages to host, back them up under `keys`; their bytes."""
    dev = device_pages(spec.pool)
    host = ctl.write(dev, tag="node")
    ctl.wait_writes()
    assert ctl.writes_landed() == [1]
    ctl.take(OpKind.WRITE, 1)
    ps = spec.pool.page_size
    backup = ctl.backup(keys, host[::ps] // ps, "node")
    ctl.wait_idle()
    assert ctl.take(OpKind.BACKUP, 1) == [backup] and backup.ok == [True, True]
    return slot_bytes(ctl.pool, dev)


def receive(ctl: CacheController, spec: ComponentSpec, keys: list[str]) -> list[bytes]:
    """Prefetch `keys` into host pages and load them into two device pages; their bytes."""
    ps = spec.pool.page_size
    op = PrefetchOp("r1", keys, tokens=2 * ps)
    ctl.prefetch(op)
    wait_for(lambda: op.present is not None, "the store's answer")
    assert op.present == 2
    assert ctl.grant(op, op.present) == 2
    wait_for(lambda: op.finished, "the prefetch")
    assert op.landed == 2
    into = page_slots(np.array([3, 1], dtype=np.int64), ps)
    load = ctl.load(ctl.page_slots(op.host_pages), into, tag="req")
    load.handle.wait(30)
    assert load.ok
    wait_for(lambda: op.settled, "the prefetch settling")
    ctl.end_prefetch(op, settled=True)
    ctl.take(OpKind.LOAD, 1)
    return slot_bytes(ctl.pool, into)


@pytest.mark.parametrize("store_kind", ["memory", "file"])
@pytest.mark.parametrize("name", list(SPECS))
def test_device_host_store_and_back_is_byte_exact_per_component(
    name, store_kind, tmp_path
):
    """Write (device -> host), backup (host -> store) on one controller; prefetch (store ->
    host) and load (host -> device, layer by layer) on another over the same store: the
    bytes that come back are the bytes that went out."""
    spec, store = SPECS[name], make_store(store_kind, tmp_path)
    keys = keys_of(spec)
    _, ctl = controller(spec, store, seed=2)
    try:
        sent = send(ctl, spec, keys)
    finally:
        ctl.close()
    store = make_store(store_kind, tmp_path) if store_kind == "file" else store
    _, ctl = controller(spec, store)
    try:
        assert receive(ctl, spec, keys) == sent
    finally:
        ctl.close()


def test_the_three_components_of_one_prefix_share_a_store_root_side_by_side(tmp_path):
    """A hybrid cache: a controller per component, each with its own store client over one
    file root, the same page hashes (one prefix) under three namespaces. Each component
    reads back its own bytes, never another's."""
    sent, keys = {}, {name: keys_of(spec) for name, spec in SPECS.items()}
    assert len({k for ks in keys.values() for k in ks}) == 2 * len(SPECS)
    ctls = {
        n: controller(s, make_store("file", tmp_path), seed=4)[1]
        for n, s in SPECS.items()
    }
    try:
        for name, ctl in ctls.items():
            sent[name] = send(ctl, SPECS[name], keys[name])
    finally:
        for ctl in ctls.values():
            ctl.close()
    ctls = {n: controller(s, make_store("file", tmp_path))[1] for n, s in SPECS.items()}
    try:
        for name, ctl in reversed(ctls.items()):
            assert receive(ctl, SPECS[name], keys[name]) == sent[name]
    finally:
        for ctl in ctls.values():
            ctl.close()


@pytest.mark.parametrize("outcome", ["fail_before", "fail_after"])
def test_a_failed_state_load_is_never_read_and_a_failed_state_write_never_lands(
    outcome,
):
    """The state slots ride the controller's two-phase ops: a load that failed raises in
    the forward's wait for the layer, and a write that failed is reported not landed."""
    spec = SPECS["mamba"]
    pool = filled(spec.pool, seed=3)
    streams = SimStreams(random.Random(0))
    ctl = CacheController(
        pool, HostMirror(pool), None, ControllerConfig(), streams.factory
    )
    try:
        host = ctl.write(np.array([4, 5], dtype=np.int64), tag="node")
        ctl.flush_writes()
        streams.resolve(streams.pending[0], "fail_before", random.Random(0))
        assert ctl.writes_landed() == [0]
        ctl.take(OpKind.WRITE, 1)
        load = ctl.load(host, np.array([8, 9], dtype=np.int64), tag="req")
        streams.resolve(streams.pending[0], outcome, random.Random(1))
        assert load.handle.is_done() and not load.ok
        with pytest.raises(TransferError):
            for layer in range(spec.pool.num_layers):
                load.handle.wait_layer(layer, timeout=1)
        ctl.take(OpKind.LOAD, 1)
    finally:
        ctl.close()


# -- namespaces: the geometry is in the key ------------------------------------------------


def test_full_attention_namespace_ids_are_unchanged():
    """Ids pinned from before components existed: the FULL component's pages keep their keys."""
    plain = Namespace("m", "float32", "mha:layers=4:heads=2:head_dim=32:v=32", 16)
    assert plain.id == "206de50d769e49693df2902945075031"
    full = ComponentSpec(
        Component.FULL,
        PoolConfig(
            size=64,
            num_layers=4,
            page_size=16,
            num_kv_heads=2,
            head_dim=32,
            dtype="float32",
        ),
    )
    assert full.namespace(Namespace("m", "float32", "x", 16)).id == plain.id
    assert "component" not in plain.manifest(4096)


def test_components_that_differ_in_any_geometry_never_share_a_namespace():
    variants = {
        "full": SPECS["full"],
        "swa": SPECS["swa"],
        "swa other window": ComponentSpec(Component.SWA, kv_config(2), window=16),
        "swa as full": ComponentSpec(Component.FULL, kv_config(2)),
        "swa other dtype": ComponentSpec(
            Component.SWA, kv_config(2, dtype="bfloat16"), window=8
        ),
        "mamba": SPECS["mamba"],
        # the same bytes per slot (24 floats a layer), another shape
        "mamba other shape": ComponentSpec(Component.MAMBA, state_config(shape=(6, 4))),
        "mamba other dtype": ComponentSpec(
            Component.MAMBA, state_config(dtype="bfloat16")
        ),
        "mamba other layers": ComponentSpec(Component.MAMBA, state_config(layers=3)),
    }
    ids = {name: spec.namespace(BASE).id for name, spec in variants.items()}
    assert len(set(ids.values())) == len(ids), ids
    assert SPECS["mamba"].namespace(BASE).manifest(10)["component"] == "mamba"
    assert SPECS["swa"].namespace(BASE).component == "swa:window=8"


def test_a_state_is_a_store_page_of_its_own_whatever_the_token_grouping():
    """Store pages of 4 token pages (store.page_tokens) group the token components' pages;
    a state, one slot keyed by the prefix it ends, is never grouped: its namespace (and
    manifest) says store_pages 1, the same as under a base without grouping."""
    grouped = dataclasses.replace(BASE, store_pages=4)
    mamba = SPECS["mamba"].namespace(grouped)
    assert mamba.store_pages == 1 and "store_pages" not in mamba.manifest(10)
    assert mamba.id == SPECS["mamba"].namespace(BASE).id
    for name in ("full", "swa"):
        assert SPECS[name].namespace(grouped).store_pages == 4


@pytest.mark.parametrize(
    "other",
    [
        ComponentSpec(Component.SWA, kv_config(2), window=16),
        ComponentSpec(Component.MAMBA, state_config(shape=(6, 4))),
    ],
    ids=["window", "state shape"],
)
def test_a_page_of_another_geometry_is_a_miss_even_under_this_key(other, tmp_path):
    """Looked up under its own key, another geometry's page is absent; copied by hand to
    this geometry's key (a store shared by two deployments, a bug), its frame names the
    other namespace: a miss, never data."""
    mine = SPECS["swa"] if other.component == Component.SWA else SPECS["mamba"]
    ns_mine, ns_other = mine.namespace(BASE), other.namespace(BASE)
    h = hashes_for(mine, 1, seed=9)[0]
    k_mine, k_other = (
        key_maker("kvtier", ns_mine.id)(h),
        key_maker("kvtier", ns_other.id)(h),
    )
    payload = bytes(range(256)) * 3
    store = FileStore(FileStoreConfig(root=str(tmp_path / "l3")))

    async def scenario():
        assert await store.batch_set([k_other], [memoryview(payload)]) == [True]
        assert await store.batch_exists([k_mine]) == 0
        await store.close()

    asyncio.run(scenario())
    with pytest.raises(FrameError, match="namespace"):
        decode(encode(ns_other.id, h, payload), ns_mine.id, h)
    src, dst = store.path(k_other), store.path(k_mine)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    reopened = FileStore(FileStoreConfig(root=str(tmp_path / "l3")))

    async def read():
        got = await reopened.batch_get([k_mine])
        await reopened.close()
        return got

    assert asyncio.run(read()) == [None]


def test_component_specs_are_checked_by_name():
    with pytest.raises(ValueError, match="component='ssm': allowed: full, swa, mamba"):
        ComponentSpec("ssm", kv_config(1))
    with pytest.raises(ValueError, match="the mamba component, and only it"):
        ComponentSpec(Component.MAMBA, kv_config(1))
    with pytest.raises(ValueError, match="the mamba component, and only it"):
        ComponentSpec(Component.FULL, state_config())
    with pytest.raises(ValueError, match="window=None: the swa component needs"):
        ComponentSpec(Component.SWA, kv_config(1))
    with pytest.raises(ValueError, match="window=8: for the swa component only"):
        ComponentSpec(Component.FULL, kv_config(1), window=8)
    with pytest.raises(KvtierConfigError, match="namespace.component='swa window'"):
        Namespace("m", "float32", "x", 1, component="swa window")
