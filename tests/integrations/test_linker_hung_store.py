"""The SGLang linker over a file store on a hung mount (tests/hung.py: an open of each page
path never returns). The load's store read is abandoned after its timeout and a grace as long;
the host pages it was reading into stay out of use for good (a stuck thread may still write
them), counted, and the accounting balances. Without the quarantine they went back to the
host tier's free pages once the read settled. Engine-free: LinkerCore needs no SGLang."""

import asyncio

import torch

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.hashing import Namespace
from kvtier.integrations.sglang.linker.core import LinkerCore, LinkerSettings
from kvtier.testing.linker_sim import page_keys
from kvtier.tiers.mirror import MirrorConfig
from kvtier.tiers.pool import DeviceKVPool, PoolConfig
from tests.hung import HungMount

PS, LAYERS, PAGES = 4, 2, 3


def test_an_abandoned_store_read_quarantines_its_host_pages(tmp_path, monkeypatch):
    pool = DeviceKVPool(
        PoolConfig(
            size=PS * 8,
            num_layers=LAYERS,
            page_size=PS,
            num_kv_heads=1,
            head_dim=2,
            dtype="float32",
        )
    )
    page_bytes = PS * 4 * LAYERS * 4
    settings = LinkerSettings(
        Namespace("m", "float32", "t", PS),
        mirror=MirrorConfig(size_bytes=page_bytes * 8, layout="page_first"),
    )
    cfg = FileStoreConfig(root=str(tmp_path / "l3"), max_concurrency=1)
    keys = page_keys([1, 2, 3])
    writer = FileStore(cfg, timeout_s=0.3)
    core = LinkerCore(pool, settings, writer)
    store_keys = core.l3.keys(keys)
    core.close()
    writer = FileStore(cfg, timeout_s=0.3)

    async def fill():
        assert all(await writer.batch_set(store_keys, [bytes(page_bytes)] * PAGES))
        await writer.close()

    asyncio.run(fill())
    mount = HungMount(monkeypatch)
    mount.hang(*[writer.path(k) for k in store_keys])
    core = LinkerCore(pool, settings, FileStore(cfg, timeout_s=0.3))
    try:
        assert core.load("r1", keys, torch.arange(PS, PS + PAGES * PS))
        assert core.cancel_queued_load(
            "r1"
        )  # SGLang's release_request while the read hangs
        core.quiesce()  # waits for the read to settle: abandoned after timeout + grace
        host = core.stats()["host"]
        assert host["pages_quarantined"] == PAGES
        assert host["pages_free"] == host["pages_total"] - PAGES
        assert core.check_accounting() == []
        assert core.stats()["store"]["store_down"]
    finally:
        mount.release()  # the stuck thread goes on: nothing outlives the test
        core.close()
