"""read_staged (storeio/call.py): where an adapter's reads land."""

from __future__ import annotations

import os

import numpy as np

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.backends.memory import MemoryStore
from kvtier.storeio.breaker import Breaker, BreakerConfig
from kvtier.hashing import make_key
from kvtier.storeio.call import StagingPool, read_staged

NS = "ab" * 16


def _keys(n: int) -> list[str]:
    return [make_key("kvtier", NS, bytes([i + 1]) * 32) for i in range(n)]


async def test_a_store_that_may_write_after_the_call_reads_through_a_reused_pool():
    """A store that cannot promise its reads end with the call (the memory store here
    stands for any such) reads into the pool's buffers, copied into the engine's rows
    only for pages that verified; the next call reuses the same buffers (no memory
    faulted in per job), and a call that failed as a whole returns none of them."""
    store, breaker, pool = (
        MemoryStore(),
        Breaker("memory", BreakerConfig()),
        StagingPool(),
    )
    keys, pages = _keys(3), [os.urandom(4096) for _ in range(3)]
    assert await store.batch_set(keys[:2], pages[:2]) == [True, True]
    rows = np.zeros((3, 4096), dtype=np.uint8)
    views = [memoryview(r) for r in rows]
    assert await read_staged(breaker, store, keys, views, pool) == [True, True, False]
    assert [rows[0].tobytes(), rows[1].tobytes()] == pages[:2] and not rows[2].any()
    assert pool.kept == 3 * 4096
    taken = [pool.take(4096) for _ in range(3)]
    pool.give(taken)
    assert await read_staged(breaker, store, keys, views, pool) == [True, True, False]
    assert {id(pool.take(4096)) for _ in range(3)} == {id(b) for b in taken}
    pool.give(taken)
    down = Breaker("memory", BreakerConfig(failures=1, backoff_s=60.0))
    down.failed("down")  # the breaker skips the store: the call fails as a whole
    assert await read_staged(down, store, keys, views, pool) is None
    assert pool.kept == 0  # its buffers are not given back


async def test_a_file_store_reads_straight_into_the_engines_rows(tmp_path, monkeypatch):
    """The file store's reads end with the call (file_io.copy_out): read_staged hands it
    the engine's rows, no staging buffer."""
    store = FileStore(FileStoreConfig(root=str(tmp_path / "l3")))
    breaker, pool = Breaker("file", BreakerConfig()), StagingPool()
    keys, pages = _keys(2), [os.urandom(8192) for _ in range(2)]
    assert await store.batch_set(keys, pages) == [True, True]
    monkeypatch.setattr(
        pool, "take", lambda n: (_ for _ in ()).throw(AssertionError("staged"))
    )
    rows = np.zeros((2, 8192), dtype=np.uint8)
    got = await read_staged(breaker, store, keys, [memoryview(r) for r in rows], pool)
    assert got == [True, True] and [r.tobytes() for r in rows] == pages
    await store.close()
