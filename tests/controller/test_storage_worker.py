"""The storage thread's hand-offs (docs/design.md §8: the scheduler never waits)."""

from kvtier.backends.memory import MemoryStore, MemoryStoreConfig


def test_ops_submitted_together_wake_the_storage_loop_once():
    """One wake-up of the storage thread per scheduler step, not one per op or grant."""
    import asyncio
    import threading

    import torch

    from kvtier.controller.storage import BackupOp, PrefetchOp, StorageWorker
    from kvtier.hashing import key_maker
    from kvtier.tiers.mirror import HostMirror, MirrorConfig
    from kvtier.tiers.pool import DeviceKVPool, PoolConfig

    pool = DeviceKVPool(PoolConfig(size=256, num_layers=2, page_size=16, num_kv_heads=1, head_dim=8))
    mirror = HostMirror(pool, MirrorConfig(ratio=1.0))
    store = MemoryStore(MemoryStoreConfig(capacity_bytes=1 << 24))
    worker = StorageWorker(store, mirror, 1 << 20)
    wakeups = []
    hold = threading.Event()
    worker.loop.call_soon_threadsafe(hold.wait)  # the loop is busy while the step submits
    write_to_self = worker.loop._write_to_self  # what call_soon_threadsafe does to wake the loop
    worker.loop._write_to_self = lambda: (wakeups.append(1), write_to_self())[1]
    key = key_maker("t", "0" * 32)
    ops = [BackupOp([key(bytes([i]) * 32)], torch.tensor([i + 1]), tag=None) for i in range(10)]
    for op in ops:
        worker.submit_backup(op)
    waiting = [PrefetchOp(f"r{i}", [], tag=None, tokens=0, wake=asyncio.Event()) for i in range(5)]
    for op in waiting:  # grants made in the same poll ride along
        worker.wake(op)
    hold.set()
    worker.drain(10)
    assert len(wakeups) == 1
    assert all(op.wake.is_set() for op in waiting)
    assert all(op.finished and op.ok == [True] for op in ops)
    worker.close()
