"""Regression tests named after bugs other KV caches shipped (LMCache, SGLang, vLLM, Dynamo;
by their public trackers' issue numbers).
Other rows are covered where they live: capacity and restart (tests/backends), TP hangs and
divergence (tests/controller/test_tp.py), failed loads and leaks under random aborts
(test_review_regressions.py and the fault simulator, test_fault_sim.py)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.controller.helpers import compute, make_cache

A = np.arange(500, 516)


def check(cache):
    cache.tree.sanity_check()
    cache.check_accounting()


async def test_lmcache_4991_a_failed_store_is_never_visible(tmp_path):
    from kvtier.backends.file import FileStore, FileStoreConfig
    from kvtier.errors import StoreError
    from tests.backends.stores import new_key

    store = FileStore(FileStoreConfig(root=str(tmp_path)))
    k = new_key()
    store.path(k).parent.mkdir(parents=True)
    os.chmod(store.path(k).parent, 0o500)  # the write cannot land
    try:
        if os.geteuid() == 0:
            store.path(k).mkdir()  # root ignores permissions: block the rename instead
        with pytest.raises(StoreError):
            await store.batch_set([k], [b"x" * 64])
    finally:
        os.chmod(store.path(k).parent, 0o700)
    assert await store.batch_exists([k]) == 0 and await store.batch_get([k]) == [None]


def test_lmcache_1139_hashes_do_not_depend_on_the_process():
    code = ("import numpy as np; from kvtier.hashing import page_hashes; "
            "print(page_hashes(np.arange(64), 16, 'a' * 32, 'lora')[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("0", "1", "random")}
    assert len(outs) == 1 and len(outs.pop().strip()) == 64


def test_sglang_24638_salted_and_lora_requests_never_share_pages():
    cache = make_cache()
    compute(cache, A, seed=2)
    assert cache.match_prefix(A, extra_key="lora-7").device_indices.numel() == 0
    m = cache.match_prefix(A)
    keys = cache.tree.page_hashes(m.last_device_node)
    from kvtier.hashing import page_hashes

    assert page_hashes(A, 4, cache.namespace.id, "lora-7") != keys
    check(cache)
    cache.close()


def test_token_ids_that_would_alias_in_the_page_hash_are_refused():
    """Like the LoRA case above, from the other side: page hashes encode token ids as uint32
    (docs/formats.md), so -1 hashes as 4294967295 and 2**32 as 0. The tree keeps int64 ids
    and would tell such prompts apart while the store served one's pages for the other.
    They are refused where tokens come in, and the refused request holds nothing."""
    from kvtier.hashing import page_hashes

    alias = np.array([2**32 - 1, 2**32, 7, 8]), np.array([-1, 0, 7, 8])
    assert page_hashes(alias[0], 4, "a" * 32) == page_hashes(alias[1], 4, "a" * 32)  # what must not reach it
    cache = make_cache()
    compute(cache, A, seed=1)
    for bad in alias:
        with pytest.raises(ValueError, match=r"tokens: ids must be in \[0, 2\*\*32\)"):
            cache.acquire(np.concatenate([A, bad]), "bad")
    assert "bad" not in cache.requests and cache.acquire(A, "good").ready
    cache.abort("good")
    check(cache)
    cache.close()
