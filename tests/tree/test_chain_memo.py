"""The chain memo gives the chain hashing gives, page for page, or hashes: a kept chain is
taken only as far as the tokens, the hash it starts from and the extra key are the same
(tree/chain_memo.py). And a returning conversation hashes only its new pages."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.hashing import page_hashes
from kvtier.tree.chain_memo import ChainMemo
from tests.controller.helpers import (
    acquire,
    fill,
    forward,
    make_cache,
    read_back,
    same_kv,
    settle,
)

NS = "5a" * 16

asks = st.lists(
    st.tuples(
        st.integers(0, 3),  # which conversation
        st.integers(0, 40),  # tokens it grows by
        st.integers(0, 60),  # tokens cut from its front, chained below them
        st.booleans(),  # change one token (a prompt that diverges)
        st.sampled_from([None, "lora-a"]),
        st.sampled_from([None, b"\x07" * 32]),
    ),
    min_size=1,
    max_size=40,
)


@given(asks, st.sampled_from([1, 2, 16]), st.integers(500, 40_000))
@settings(max_examples=150, deadline=None)
def test_the_memo_gives_the_chain_hashing_gives(steps, ps, capacity):
    """Conversations that grow, diverge, start below a prefix or from another hash, with
    and without an extra key, through a memo small enough to drop chains: every chain is
    `page_hashes`'s."""
    memo, convs = ChainMemo(max_bytes=capacity), {}
    for conv, grow, cut, diverge, extra_key, prev in steps:
        tokens = convs.get(conv, [conv * 7919 + i for i in range(5)]) + [
            (conv * 31 + grow * 17 + i) % 1000 for i in range(grow)
        ]
        if diverge and tokens:
            tokens = tokens[:]
            tokens[len(tokens) // 2] += 1
        convs[conv] = tokens
        arr = np.array(tokens, dtype=np.int64)
        cut = min(cut, len(arr)) // ps * ps
        start = prev
        if cut:
            start = page_hashes(arr[:cut], ps, NS, extra_key, prev)[-1]
        assert memo.page_hashes(
            arr[cut:], ps, NS, extra_key, start, "sha256"
        ) == page_hashes(arr[cut:], ps, NS, extra_key, start)
        assert memo._bytes <= capacity


def test_a_kept_chain_is_taken_only_where_everything_is_the_same():
    """Taken: the same tokens from the same hash. Hashed: another start hash, another extra
    key, another namespace, a token changed (only the pages before it are taken)."""
    memo = ChainMemo()
    tokens = np.arange(100, 164, dtype=np.int64)  # 16 pages of 4
    memo.page_hashes(tokens, 4, NS, None, None, "sha256")
    assert (memo.taken, memo.hashed) == (0, 16)
    assert memo.page_hashes(tokens, 4, NS, None, None, "sha256") == page_hashes(
        tokens, 4, NS
    )
    assert (memo.taken, memo.hashed) == (16, 16)
    longer = np.concatenate([tokens, np.arange(8)])
    assert memo.page_hashes(longer, 4, NS, None, None, "sha256") == page_hashes(
        longer, 4, NS
    )
    assert (memo.taken, memo.hashed) == (
        32,
        18,
    )  # its 16 pages taken, the 2 new ones hashed
    changed = tokens.copy()
    changed[41] += 1  # page 10
    before = memo.taken
    assert memo.page_hashes(changed, 4, NS, None, None, "sha256") == page_hashes(
        changed, 4, NS
    )
    assert memo.taken - before == 10
    for args in [
        (None, b"\x01" * 32, NS),
        ("lora", None, NS),
        (None, None, "6b" * 16),
    ]:  # the last empties it
        extra_key, prev, ns = args
        before = memo.taken
        assert memo.page_hashes(
            tokens, 4, ns, extra_key, prev, "sha256"
        ) == page_hashes(tokens, 4, ns, extra_key, prev)
        assert memo.taken == before, args


def test_a_returning_conversation_hashes_only_its_new_pages():
    """A server's sequence: turn 1 is computed and backed up; device and host are emptied
    (its pages live in the store only, the tree forgot their hashes); turn 2's prompt is turn
    1 and a new message. Its prefetch takes turn 1's pages' hashes from the chains the backup
    made and hashes the message's only, and the KV read back is the KV computed."""
    cache = make_cache(pool_size=64, page_size=4)
    memo = cache.tree.chains
    prompt, output = np.arange(100, 124), np.arange(500, 508)  # 6 pages, 2 pages
    got = acquire(cache, prompt, "turn1")
    new = cache.alloc(len(prompt) + len(output) - got.indices.numel())
    forward(cache, "turn1")
    kv = fill(cache, new, seed=4)
    turn1 = np.concatenate([prompt, output])
    cache.cache_finished("turn1", turn1, torch.cat([got.indices, new]))
    settle(cache)
    assert cache.stats()["counters"]["l3_write_pages"] == 8
    cache.flush()
    hashed = memo.hashed
    turn2 = np.concatenate([turn1, np.arange(900, 908)])  # 2 new pages
    again, again_kv = read_back(cache, turn2, "turn2")
    assert (
        got.indices.numel() == 0 and again.storage_hit == 32 and same_kv(again_kv, kv)
    )
    assert memo.hashed - hashed == 2, (memo.hashed - hashed, memo.taken)
    settle(cache)
    cache.tree.sanity_check()
    cache.check_accounting()
    cache.close()


def test_the_memo_holds_what_its_bytes_allow_whatever_the_page_size():
    """The bound counts a chain's token bytes too: a page of 256 tokens is 1 KiB of them
    besides its hash (a bound by hashes alone let the memo grow to ~275 MiB at page 256)."""
    for ps in (1, 64, 256):
        memo, budget, one = (
            ChainMemo(max_bytes=256 << 10),
            256 << 10,
            16 * (4 * ps + 80),
        )
        for i in range(200):  # chains of 16 pages, more of them than fit
            memo.page_hashes(
                np.arange(i * 10_000, i * 10_000 + 16 * ps),
                ps,
                NS,
                None,
                None,
                "sha256",
            )
            assert memo._bytes <= budget
        kept = sum(
            len(tokens) + 80 * len(chain)
            for entries in memo._chains.values()
            for _, tokens, chain in entries
        )
        assert kept == memo._bytes and kept > budget - one, ps
