"""The storage thread's hand-offs (docs/design.md §8: the scheduler never waits)."""

from kvtier.backends.memory import MemoryStore, MemoryStoreConfig


def test_ops_submitted_together_wake_the_storage_loop_once():
    """One wake-up of the storage thread per scheduler step, not one per op or grant."""
    import asyncio
    import threading

    import torch

    from kvtier.controller.storage import PrefetchOp, StorageWorker
    from kvtier.storeio.ops import BackupOp
    from kvtier.hashing import key_maker
    from kvtier.tiers.mirror import HostMirror, MirrorConfig
    from kvtier.tiers.pool import DeviceKVPool, PoolConfig

    pool = DeviceKVPool(
        PoolConfig(size=256, num_layers=2, page_size=16, num_kv_heads=1, head_dim=8)
    )
    mirror = HostMirror(pool, MirrorConfig(ratio=1.0))
    store = MemoryStore(MemoryStoreConfig(capacity_bytes=1 << 24))
    worker = StorageWorker(store, mirror, 1 << 20)
    wakeups = []
    hold = threading.Event()
    worker.loop.call_soon_threadsafe(
        hold.wait
    )  # the loop is busy while the step submits
    wake = worker.store_loop._waker.wake
    worker.store_loop._waker.wake = lambda: (wakeups.append(1), wake())[1]
    key = key_maker("t", "0" * 32)
    ops = [
        BackupOp([key(bytes([i]) * 32)], torch.tensor([i + 1]), tag=None)
        for i in range(10)
    ]
    for op in ops:
        worker.submit_backup(op)
    waiting = [
        PrefetchOp(f"r{i}", [], tokens=0, wake=asyncio.Event()) for i in range(5)
    ]
    for op in waiting:  # grants made in the same poll ride along
        worker.wake(op)
    hold.set()
    worker.drain(10)
    assert len(wakeups) == 1
    assert all(op.wake.is_set() for op in waiting)
    assert all(op.finished and op.ok == [True] for op in ops)
    worker.close()


def test_a_store_failing_every_backup_logs_the_first_and_every_100th(
    tmp_path, monkeypatch, caplog
):
    """A full disk fails every backup: the storage thread logs the first failure and then
    every 100th with the running count (the counters keep them all), not a line each."""
    import errno
    import logging

    import torch

    from kvtier.backends import file_io
    from kvtier.backends.file import FileStore, FileStoreConfig
    from kvtier.storeio.breaker import BreakerConfig
    from kvtier.controller.storage import StorageWorker
    from kvtier.storeio.ops import BackupOp
    from kvtier.hashing import key_maker
    from kvtier.tiers.mirror import HostMirror, MirrorConfig
    from kvtier.tiers.pool import DeviceKVPool, PoolConfig

    def no_room(fd, frame):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(
        file_io, "_write_page", no_room
    )  # a disk with no room and nothing to evict
    pool = DeviceKVPool(
        PoolConfig(size=256, num_layers=2, page_size=16, num_kv_heads=1, head_dim=8)
    )
    mirror = HostMirror(pool, MirrorConfig(ratio=1.0))
    store = FileStore(FileStoreConfig(root=str(tmp_path)))
    worker = StorageWorker(
        store, mirror, 1 << 20, breaker=BreakerConfig(failures=10_000)
    )  # never down
    key = key_maker("t", "0" * 32)
    ops = [
        BackupOp([key(i.to_bytes(32, "little"))], torch.tensor([1]), tag=None)
        for i in range(150)
    ]
    with caplog.at_level(logging.WARNING, logger="kvtier.controller.storage"):
        for op in ops:
            worker.submit_backup(op)
        worker.drain(60)
    worker.close()
    assert all(op.finished and op.ok == [False] for op in ops)
    lines = [r.getMessage() for r in caplog.records if "backup of" in r.getMessage()]
    assert len(lines) == 2 and "100 backup failures so far" in lines[1], lines


def test_drain_waits_for_a_running_op_and_gives_up_at_its_timeout():
    """`drain` returns once every submitted op ended, or at its timeout (a store call that
    hangs is the breaker's to abandon, not drain's to wait for forever)."""
    import asyncio
    import threading

    import torch

    from kvtier.controller.storage import StorageWorker
    from kvtier.storeio.ops import BackupOp
    from kvtier.hashing import key_maker
    from kvtier.tiers.mirror import HostMirror, MirrorConfig
    from kvtier.tiers.pool import DeviceKVPool, PoolConfig

    gate = threading.Event()

    class Gated(MemoryStore):
        async def _set(self, keys, frames):
            while not gate.is_set():
                await asyncio.sleep(0.001)
            return await super()._set(keys, frames)

    pool = DeviceKVPool(
        PoolConfig(size=256, num_layers=2, page_size=16, num_kv_heads=1, head_dim=8)
    )
    worker = StorageWorker(
        Gated(MemoryStoreConfig()), HostMirror(pool, MirrorConfig(ratio=1.0)), 1 << 20
    )
    op = BackupOp([key_maker("t", "0" * 32)(b"\x01" * 32)], torch.tensor([1]), tag=None)
    worker.submit_backup(op)
    worker.drain(0.05)
    assert not op.finished  # still waiting at the gate: drain gave up
    gate.set()
    worker.drain(10)
    assert op.finished and op.ok == [True]
    worker.close()
