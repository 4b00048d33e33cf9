"""Page hash chains are made on the storage thread, never on the scheduler's: the pages a
request finishes with past its prompt (its output) are hashed when they are backed up to
the store; its prompt's were hashed by its prefetch."""

import threading

import numpy as np
import torch

from kvtier.tree import chain_memo
from tests.controller.helpers import (
    acquire,
    fill,
    forward,
    make_cache,
    read_back,
    same_kv,
    settle,
)


def test_no_page_is_hashed_on_the_scheduler_thread(monkeypatch):
    where = []
    real = chain_memo.page_hashes_of_bytes  # every chain the tree makes is hashed there

    def recording(*args, **kwargs):
        where.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(chain_memo, "page_hashes_of_bytes", recording)
    cache = make_cache()
    prompt, output = np.arange(100, 108), np.arange(500, 508)
    got = acquire(cache, prompt, "r1")
    new = cache.alloc(16 - got.indices.numel())
    forward(cache, "r1")
    kv = fill(cache, new, seed=1)
    cache.cache_finished(
        "r1", np.concatenate([prompt, output]), torch.cat([got.indices, new])
    )
    settle(cache)
    assert cache.stats()["counters"]["l3_write_pages"] == 4
    assert where and threading.main_thread() not in where, [t.name for t in where]
    cache.flush()  # device and host emptied: what comes back comes from the store
    again, again_kv = read_back(cache, np.concatenate([prompt, output]), "r2")
    assert again.storage_hit == 16 and same_kv(again_kv, kv)
    settle(cache)
    assert threading.main_thread() not in where
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()
