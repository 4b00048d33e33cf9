"""The per-poll agreement record: every number has a name, and the vector the ranks agree
on is laid out (and read back) in one place."""

from kvtier.cache.completions import UNKNOWN, PollReport
from kvtier.cache.prefetch import Ended, PrefetchState
from kvtier.controller.controller import Finished
from kvtier.controller.storage import PrefetchOp
from kvtier.controller.tp import Agreement
from kvtier.storeio.ops import Phase
from kvtier.tree import RadixKey, RadixTree


def live_prefetches():
    root = RadixTree(page_size=1).root
    ops = [PrefetchOp("a", ["k"], tokens=1), PrefetchOp("b", ["k", "l"], tokens=2)]
    ops[0].present, ops[0].landed, ops[0].phase = 3, 2, Phase.FINISHED
    ops[1].present = None  # the store has not answered yet
    key = RadixKey([1, 2])
    states = [PrefetchState(op, key, key, 0, root, None) for op in ops]
    states[1].want_stop = True
    return states


class Min:
    """Another rank's view, agreed the way the collective does: MIN of counts, MAX of stops."""

    def __init__(self, other_mins, other_stops):
        self.other = other_mins, other_stops

    def agree(self, mins, maxs):
        return [min(a, b) for a, b in zip(mins, self.other[0])], [
            max(a, b) for a, b in zip(maxs, self.other[1])
        ]


def test_a_report_reads_back_by_name_what_it_was_built_from():
    report = PollReport.of(Finished(1, 2, 3), live_prefetches(), [(1, 0), (0, 1)], [1])
    assert report.mins == [
        1,
        2,
        3,
        3,
        2,
        Ended.FINISHED,
        UNKNOWN,
        0,
        Ended.RUNNING,
        1,
        0,
        1,
    ]
    assert report.maxs == [
        0,
        1,
        0,
        0,
        0,
        1,
    ]  # stops of the live ones, abandoned of them and of the unsettled ones
    agreed = report.agree(Agreement())  # one rank: agreed as it stands
    assert agreed.finished == Finished(writes=1, loads=2, backups=3)
    assert agreed.prefetch_reports() == [
        (3, 2, Ended.FINISHED),
        (None, 0, Ended.RUNNING),
    ]
    assert (
        agreed.settled == [1, 0]
        and agreed.writes_landed == [1]
        and agreed.stops == [0, 1]
    )
    assert agreed.abandoned == [0, 1]


def test_agreed_numbers_are_the_min_of_counts_and_the_max_of_stops():
    report = PollReport.of(Finished(4, 0, 1), live_prefetches(), [(1, 0)], [])
    other = [
        2,
        0,
        1,
        UNKNOWN,
        1,
        Ended.RUNNING,
        5,
        0,
        Ended.RUNNING,
        0,
    ]  # another rank knows less of "a"
    agreed = report.agree(
        Min(other, [1, 0, 0, 1, 1])
    )  # ... and abandoned reads of "b" and the unsettled one
    assert agreed.finished == Finished(2, 0, 1)
    assert agreed.prefetch_reports() == [
        (None, 1, Ended.RUNNING),
        (None, 0, Ended.RUNNING),
    ]
    assert (
        agreed.settled == [0] and agreed.writes_landed == [] and agreed.stops == [1, 1]
    )
    assert agreed.abandoned_live == [0, 1] and agreed.abandoned == [1]
