"""An op's phases around its store calls (storeio/call.py `lifetime`, ops.py `Phase`): the
readers of a read, a prefetch or a backup see FINISHED before SETTLED, and ABANDONED only
for an op whose stuck call could still write its pages."""

import asyncio

import numpy as np

from kvtier.errors import KvtierError, StoreAbandoned, StoreTimeout
from kvtier.storeio.breaker import Breaker, BreakerConfig
from kvtier.storeio.call import lifetime, store_call
from kvtier.storeio.ops import BackupOp, Phase, StoreOp


class Read(StoreOp):
    def writes_pages(self) -> bool:
        return True


def run_timed_out(op: StoreOp, outcome, finish_settled: bool = False):
    """A store call that times out; its `settled` ends with `outcome` when the test says.
    Returns (phases seen at each move, the phase before it settled, the op, the breaker)."""
    loop = asyncio.new_event_loop()
    breaker = Breaker("sim", BreakerConfig(failures=3))
    settled = loop.create_future()
    seen = []

    async def call():
        raise StoreTimeout("sim.get_into: no answer", settled=settled)

    async def calls():
        try:
            await store_call(breaker, call)
        except KvtierError as exc:
            return exc
        return None

    task = loop.create_task(
        lifetime(
            breaker,
            op,
            calls,
            lambda: seen.append(op.phase),
            finish_settled=finish_settled,
        )
    )
    for _ in range(5):
        loop.run_until_complete(asyncio.sleep(0))
    before = op.phase
    settled.set_result(outcome)
    loop.run_until_complete(task)
    loop.close()
    return seen, before, breaker


def test_a_read_abandoned_stuck_is_finished_first_then_abandoned_and_the_store_down():
    op = Read()
    seen, before, breaker = run_timed_out(op, StoreAbandoned("1 I/O thread stuck"))
    assert before is Phase.FINISHED  # not settled: its pages stay out of use
    assert seen == [Phase.FINISHED, Phase.ABANDONED]
    assert op.finished and op.settled and op.abandoned
    assert breaker.down  # an abandoned call puts the store down at once


def test_a_read_that_ended_late_settles():
    op = Read()
    seen, before, breaker = run_timed_out(op, None)
    assert seen == [Phase.FINISHED, Phase.SETTLED]
    assert op.settled and not op.abandoned and not breaker.down


def test_a_backup_is_finished_only_once_settled_and_never_abandoned():
    """A write only reads its pages: stuck, it reads no further page (io_threads.py)."""
    op = BackupOp(["k"], np.array([1]), None)
    seen, before, breaker = run_timed_out(
        op, StoreAbandoned("stuck"), finish_settled=True
    )
    assert before is Phase.RUNNING  # not finished: its pages stay protected
    assert seen == [Phase.SETTLED]
    assert op.finished and not op.abandoned and breaker.down
