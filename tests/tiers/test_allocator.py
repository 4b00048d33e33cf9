import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.tiers.allocator import (
    PagedAllocator,
    TokenAllocator,
    _distinct,
    _pages_touched,
)
from kvtier.tiers.indices import concat, page_slots, pages_of


def test_token_allocator_exact_ids_and_lazy_merge():
    a = TokenAllocator(8)
    assert a.alloc(3).tolist() == [1, 2, 3]
    x = a.alloc(5)
    assert x.tolist() == [4, 5, 6, 7, 8] and a.available_size() == 0
    assert a.alloc(1) is None
    a.free(torch.tensor([7, 2]))
    assert a.available_size() == 2
    assert a.alloc(2).tolist() == [2, 7]


def test_free_group_batches_into_one_release():
    a = TokenAllocator(8)
    x = a.alloc(8)
    with a.free_group():
        a.free(x[:2])
        a.free(x[5:])
        assert a.available_size() == 0  # nothing released until the group closes
    assert a.available_size() == 5
    assert len(a._free.released) == 1


def test_shortage_has_no_side_effect():
    a = PagedAllocator(16, 4)
    a.alloc(8)
    assert a.alloc(12) is None
    assert a.available_size() == 8
    assert a.alloc_extend([0, 0], [5, 4], [0, 0]) is None
    assert a.available_size() == 8


@pytest.mark.parametrize("debug_env", [False, True])
def test_debug_mode_catches_double_free_slot0_and_range(monkeypatch, debug_env):
    if debug_env:
        monkeypatch.setenv("KVTIER_DEBUG_POOL", "1")
        a = TokenAllocator(4)
    else:
        a = TokenAllocator(4, debug=True)
    x = a.alloc(2)
    a.free(x)
    with pytest.raises(ValueError, match="double free"):
        a.free(x)
    with pytest.raises(ValueError, match="out of range"):
        a.free(torch.tensor([0]))
    with pytest.raises(ValueError, match="out of range"):
        a.free(torch.tensor([5]))
    assert a.available_size() == 4


def test_paged_alloc_extend_continues_last_page():
    a = PagedAllocator(32, 4)
    first = a.alloc_extend([0], [6], [0])
    assert first.tolist() == [4, 5, 6, 7, 8, 9]
    # request continues from slot 9 (page 2 has slots 8..11): 2 fit, then a new page
    more = a.alloc_extend([6], [11], [9])
    assert more.tolist() == [10, 11, 12, 13, 14]
    dec = a.alloc_extend([11], [12], [14])  # one decode token, last in its page
    assert dec.tolist() == [15]
    dec = a.alloc_extend([12], [13], [15])  # the next one opens a page
    assert dec.tolist() == [16]
    assert a.available_size() == 32 - 16


def test_paged_alloc_extend_several_requests():
    a = PagedAllocator(64, 4)
    out = a.alloc_extend([0, 4, 2], [3, 9, 4], [0, 7, 21])
    # req0: new page 1 (4..6); req1: prefix ends on boundary, 5 tokens -> pages 2,3; req2: 2 in page of slot 21
    assert out.tolist() == [4, 5, 6, 8, 9, 10, 11, 12, 22, 23]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_sizes_name_the_argument(bad):
    with pytest.raises(ValueError, match="size"):
        TokenAllocator(bad)
    with pytest.raises(ValueError, match="page_size"):
        PagedAllocator(16, bad)


def test_bad_index_dtype():
    a = TokenAllocator(4)
    with pytest.raises(ValueError, match="indices.*int64"):
        a.free(torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of page_size"):
        PagedAllocator(16, 4).alloc(3)


class AllocatorMachine(RuleBasedStateMachine):
    """Both allocators against a set-based reference."""

    def __init__(self):
        super().__init__()
        self.page_size = 4
        self.token = TokenAllocator(40, debug=True)
        self.paged = PagedAllocator(40, self.page_size, debug=True)
        self.held_tok: list[list[int]] = []
        self.held_pages: list[list[int]] = []

    @rule(n=st.integers(0, 15))
    def alloc_token(self, n):
        before = self.token.available_size()
        out = self.token.alloc(n)
        if n > before:
            assert out is None and self.token.available_size() == before
            return
        got = out.tolist()
        held = {s for g in self.held_tok for s in g}
        assert 0 not in got and not held & set(got) and len(set(got)) == n
        assert all(1 <= s <= 40 for s in got)
        self.held_tok.append(got)

    @precondition(lambda self: self.held_tok)
    @rule(i=st.integers(0, 100), grouped=st.booleans())
    def free_token(self, i, grouped):
        got = self.held_tok.pop(i % len(self.held_tok))
        if grouped:
            with self.token.free_group():
                self.token.free(torch.tensor(got, dtype=torch.int64))
        else:
            self.token.free(torch.tensor(got, dtype=torch.int64))

    @rule(pages=st.integers(0, 4))
    def alloc_paged(self, pages):
        before = self.paged.available_size()
        out = self.paged.alloc(pages * self.page_size)
        if pages * self.page_size > before:
            assert out is None and self.paged.available_size() == before
            return
        got = out.tolist()
        held = {s for g in self.held_pages for s in g}
        assert all(s >= self.page_size for s in got) and not held & set(got)
        for k in range(0, len(got), self.page_size):
            page = got[k : k + self.page_size]
            assert (
                page == list(range(page[0], page[0] + self.page_size))
                and page[0] % self.page_size == 0
            )
        self.held_pages.append(got)

    @precondition(lambda self: self.held_pages)
    @rule(i=st.integers(0, 100))
    def free_paged(self, i):
        got = self.held_pages.pop(i % len(self.held_pages))
        self.paged.free(torch.tensor(got, dtype=torch.int64))

    @precondition(lambda self: self.held_tok)
    @rule()
    def double_free_is_caught(self):
        got = self.held_tok[0]
        if not got:
            return
        self.token.free(torch.tensor(got, dtype=torch.int64))
        with pytest.raises(ValueError, match="double free"):
            self.token.free(torch.tensor(got, dtype=torch.int64))
        self.held_tok.pop(0)

    @invariant()
    def available_is_exact(self):
        assert self.token.available_size() == 40 - sum(len(g) for g in self.held_tok)
        assert self.paged.available_size() == 40 - sum(len(g) for g in self.held_pages)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)


def test_paged_free_counts_each_page_once_in_any_order():
    """Slots of one page side by side (the usual row) or scattered: each page freed once."""
    a = PagedAllocator(64, 4, debug=True)
    x = a.alloc(16)  # pages 1..4
    scattered = torch.cat(
        [x[4:8], x[12:14], x[4:6], x[0:1], x[13:16], x[0:4]]
    )  # pages 2, 4, 2, 1, 4, 1
    a.free(scattered)
    assert (
        a.available_size() == 64 - 16 + 3 * 4
    )  # pages 1, 2, 4 back; page 3 still held
    with pytest.raises(ValueError, match="not allocated"):
        a.free(x[0:4])  # page 1 went back once already
    assert sorted(set((a.alloc(60) // 4).tolist())) == [
        p for p in range(1, 17) if p != 3
    ]


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(0, 40), max_size=1300),
    page_size=st.sampled_from([1, 3, 16, 600]),
)
def test_gil_keeping_helpers_equal_numpy_across_chunk_boundaries(values, page_size):
    """page_slots, pages_of, concat and _distinct work in pieces of GIL_CHUNK elements (numpy
    gives up the GIL past 500); at any length they equal the one-call numpy versions."""
    units = np.array(values, dtype=np.int64)
    slots = (units[:, None] * page_size + np.arange(page_size)).ravel()
    assert np.array_equal(page_slots(units, page_size), slots)
    assert np.array_equal(pages_of(slots, page_size), slots // page_size)
    joined = concat([units, units[::2], units[:0]])
    assert (
        np.array_equal(joined, np.concatenate([units, units[::2]]))
        and joined.flags.writeable
    )
    runs = np.repeat(units, 3)  # runs of equal values straddle every chunk boundary
    for case in (units, runs, np.sort(runs)):
        out = _distinct(case)
        assert sorted(out.tolist()) == sorted(set(case.tolist())) and out.size == len(
            set(case.tolist())
        )


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(0, 60), max_size=120),
    page_size=st.sampled_from([1, 4, 16]),
    swap=st.integers(0, 10_000),
    cut=st.integers(0, 3),
)
def test_pages_touched_equals_the_distinct_pages_of_the_slots(
    values, page_size, swap, cut
):
    """Whole pages each once take the short path; a page listed twice, a slot of another
    page inside a run, or a ragged end must not: every case frees each page it touches,
    exactly once."""
    units = np.array(values, dtype=np.int64)
    whole = (units[:, None] * page_size + np.arange(page_size)).ravel()
    mixed = whole.copy()
    if mixed.size:  # one slot is of a page no run starts with
        mixed[swap % mixed.size] = 1000 * page_size + swap % page_size
    distinct = (np.unique(units)[:, None] * page_size + np.arange(page_size)).ravel()
    tails = (
        whole[cut : cut + page_size - 1],
        whole[: max(page_size - 1 - cut, 1)],
    )  # under a page: one or two
    for slots in (
        whole,
        mixed,
        distinct,
        distinct[cut:],
        np.random.default_rng(swap).permutation(distinct),
        *tails,
    ):
        got = _pages_touched(pages_of(slots, page_size), page_size)
        want = set((slots // page_size).tolist())
        assert sorted(got.tolist()) == sorted(want) and got.size == len(want)


@pytest.mark.parametrize(
    "pages", [40, 1200]
)  # sorted back by Python (<= 500 pages), or taken in line
def test_released_pages_come_back_each_once_sorted_when_few_in_release_order_when_many(
    pages,
):
    a = PagedAllocator(pages * 4, 4, debug=True)
    held = a.alloc(pages * 4).reshape(-1, 4)
    order = np.random.default_rng(pages).permutation(pages)
    for chunk in np.array_split(order, 7):  # released out of order, in several frees
        a.free(held[torch.from_numpy(chunk)].reshape(-1))
    assert a.available_size() == pages * 4
    again = (a.alloc(pages * 4 - 8) // 4).tolist()[::4] + (a.alloc(8) // 4).tolist()[
        ::4
    ]  # one taken in half
    if pages <= 500:
        assert again == list(range(1, pages + 1)), (
            "a few pages come back as one ascending run"
        )
    else:  # no numpy sort on the scheduler thread: they come back in the order they were freed,
        freed = (
            order + 1
        ).tolist()  # but for the last two, few enough to be sorted back in
        assert again == freed[:-2] + sorted(freed[-2:])
    assert a.available_size() == 0 and a.alloc(4) is None


@pytest.mark.parametrize("debug", [False, True])
def test_a_double_free_is_refused_outside_debug_mode_too(debug):
    """A page freed twice would be handed to two owners, each writing KV the other reads.
    The allocator refuses it (and padding, and pages out of range) in production too,
    with nothing changed: the page is still free once, not twice."""
    a = PagedAllocator(64, 4, debug=debug)
    x = a.alloc(8)
    a.free(x)
    for bad, message in [
        (x, r"pages \[1, 2\] are not allocated \(double free\?\)"),
        (
            torch.tensor([0, 1, 2, 3]),
            r"pages \[0\] out of range 1..16 \(0 is padding\)",
        ),
        (torch.tensor([68, 69]), r"pages \[17\] out of range"),
    ]:
        with pytest.raises(ValueError, match=message):
            a.free(bad)
    assert a.available_size() == 64
    assert (
        len(set((a.alloc(64) // 4).tolist())) == 16
    )  # every page once: none was queued twice
    t = TokenAllocator(8, debug=debug)
    got = t.alloc(3)
    t.free(got)
    with pytest.raises(ValueError, match="are not allocated"):
        t.free(got)
    assert t.available_size() == 8


def test_a_tail_of_a_page_frees_that_page_once_and_a_second_free_is_refused():
    """A finished request's tail (fewer slots than a page) takes its own short path: it
    frees the page it is on, and freeing it again is still a double free, changing nothing."""
    a = PagedAllocator(64, 16)
    x = a.alloc_slots(32)
    a.free_slots(x[16:23])  # 7 slots of the second page
    assert a.available_size() == 48
    with pytest.raises(
        ValueError, match=r"pages \[2\] are not allocated \(double free\?\)"
    ):
        a.free_slots(x[20:25])
    with pytest.raises(ValueError, match="not allocated"):
        a.free_slots(
            x[14:18]
        )  # under a page, across two: page 2 is free already, so neither goes
    assert a.available_size() == 48
    a.free_slots(x[3:9])
    assert a.available_size() == 64


def test_sizes_may_be_numpy_integers_and_bad_ones_are_named():
    """An engine computes sizes from arrays: numpy integers are sizes; bools, floats and
    strings are refused naming the value, before anything is taken."""
    a = PagedAllocator(64, 4, debug=True)
    assert a.alloc(np.int64(8)).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for bad in (True, 8.0, "8", -4):
        with pytest.raises(ValueError, match=f"n={bad!r}: must be an integer >= 0"):
            a.alloc(bad)
    assert a.available_size() == 64 - 8


def test_alloc_pages_and_free_pages_by_number():
    a = PagedAllocator(32, 4, debug=True)
    pages = a.alloc_pages(3)
    assert pages.tolist() == [1, 2, 3] and a.available_size() == 32 - 12
    assert (
        a.alloc_pages(6) is None and a.available_size() == 32 - 12
    )  # short: no side effect
    a.free_pages(pages[1:])
    with pytest.raises(ValueError, match="not allocated"):
        a.free_pages(pages[2:])  # page 3 went back already
    assert a.available_size() == 32 - 4 and a.alloc_slots(4).tolist() == [
        16,
        17,
        18,
        19,
    ]  # page 4: never used


def test_a_page_1_free_listing_a_slot_twice_frees_it_once():
    """At page size 1 a slot is a page: one listed twice in a free is one page touched,
    taken back once (found without a set: `Repeats`)."""
    a = PagedAllocator(16, 1)
    got = a.alloc(4)
    a.free(torch.tensor([got[1], got[1], got[2]]))
    assert a.available_size() == 14
    rest = a.alloc(14)
    assert len(set(rest.tolist())) == 14 and a.alloc(1) is None
    a.free(torch.tensor([got[0], got[0]]))
    with pytest.raises(ValueError, match="not allocated"):
        a.free(torch.tensor([got[0]]))  # freed once above, however often it was listed
