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
    code = (
        "import numpy as np; from kvtier.hashing import page_hashes; "
        "print(page_hashes(np.arange(64), 16, 'a' * 32, 'lora')[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("0", "1", "random")
    }
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
    assert page_hashes(alias[0], 4, "a" * 32) == page_hashes(
        alias[1], 4, "a" * 32
    )  # what must not reach it
    cache = make_cache()
    compute(cache, A, seed=1)
    for bad in alias:
        with pytest.raises(ValueError, match=r"tokens: ids must be in \[0, 2\*\*32\)"):
            cache.acquire(np.concatenate([A, bad]), "bad")
    assert "bad" not in cache.requests and cache.acquire(A, "good").ready
    cache.abort("good")
    check(cache)
    cache.close()


@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "torch"])
def test_a_reused_token_buffer_never_changes_what_the_cache_holds(as_tensor):
    """Engines keep persistent input-id buffers and refill them for the next batch. The tree
    kept a view of the caller's int64 array (or a tensor's memory) as its key: refilling the
    buffer rewrote the cached prompt, so a prompt never computed matched the old one's KV
    (wrong KV served), and the hash chain of its pages, made lazily from the key, would have
    keyed the old KV under the new tokens in the store. kvtier copies the tokens it keeps."""
    import torch

    from kvtier.hashing import page_hashes
    from tests.controller.helpers import acquire, fill, forward, read, same_kv

    cache = make_cache(store="none", pool_size=128)
    buf = np.arange(100, 132, dtype=np.int64)
    tokens = torch.from_numpy(buf) if as_tensor else buf
    got = acquire(cache, tokens, "a")
    new = cache.alloc(32)
    forward(cache, "a")
    kv_a = fill(cache, new, seed=1)
    cache.cache_finished("a", tokens, torch.cat([got.indices, new]))
    buf[16:] = np.arange(
        900, 916
    )  # the next batch in the same buffer: shares A's first 16 tokens
    b = buf.copy()
    got = acquire(cache, b, "b")
    assert got.indices.numel() == 16, "only the 16 tokens B shares with A may hit"
    cache.abort("b")
    a = np.arange(100, 132, dtype=np.int64)
    got = acquire(cache, a, "a2")
    assert got.indices.numel() == 32 and same_kv(read(cache, got.indices), kv_a)
    cache.abort("a2")
    last = cache.tree.page_hashes(cache.match_prefix(a).last_device_node)[
        -1
    ]  # chained: it covers all of A
    assert last == page_hashes(a, 4, cache.namespace.id)[-1]
    check(cache)
    cache.close()


def test_slots_handed_to_a_request_are_its_own_to_change():
    """`acquire` and `cache_unfinished` handed out a tensor over the tree node's own slot
    array when the prefix was one node: an engine that shifted or clamped its index tensor
    in place rewrote where the tree thinks that prefix's KV lives, and the next request
    matching it read other KV. What a request is handed is a copy."""
    import torch

    from tests.controller.helpers import acquire, fill, forward, read, same_kv

    cache = make_cache(store="none", pool_size=128)
    kv_a = compute(cache, A, seed=1)
    got = acquire(cache, A, "r1")
    got.indices.add_(4)  # the engine's own business once handed
    cache.abort("r1")
    got = acquire(cache, np.concatenate([A, A + 100]), "r2")
    assert got.indices.numel() == 16 and same_kv(read(cache, got.indices), kv_a)
    new = cache.alloc(16)
    forward(cache, "r2")
    fill(cache, new, seed=2)
    kept = cache.cache_unfinished(
        "r2", np.concatenate([A, A + 100]), torch.cat([got.indices, new])
    )
    kept.zero_()
    cache.abort("r2")
    got = acquire(cache, A, "r3")
    assert same_kv(read(cache, got.indices), kv_a)
    cache.abort("r3")
    check(cache)
    cache.close()
