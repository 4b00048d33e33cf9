"""The CPU transfer stream: jobs run once each, in submission order, whoever runs them (its
worker, or a thread that would otherwise wait for one the worker has not started)."""

import os
import signal
import threading
import warnings

import pytest

from kvtier.tiers import streams
from kvtier.tiers.streams import CpuTransferStream, Handle, _Finisher
from kvtier.errors import TransferError


class _Parked(_Finisher):
    """A finisher whose thread takes no job: every job is run by a waiter (what happens
    when the worker has not won the GIL by the time the scheduler waits)."""

    def _run(self) -> None:
        return


def test_a_waiter_runs_the_queue_up_to_its_job_in_order_on_its_own_thread():
    ran = []
    worker = _Parked("test", lambda item: item())
    handles = [Handle() for _ in range(4)]
    for i, h in enumerate(handles):
        worker.put(lambda i=i: ran.append((i, threading.current_thread())), h)
    worker.run_until(handles[2])
    assert ran == [
        (0, threading.current_thread()),
        (1, threading.current_thread()),
        (2, threading.current_thread()),
    ]
    assert [h.is_done() for h in handles] == [True, True, True, False]
    worker.run_until(handles[1])  # already done: runs nothing more
    assert len(ran) == 3


def test_a_job_that_fails_under_a_waiter_fails_its_handle_and_the_next_still_runs():
    worker = _Parked("test", lambda item: item())
    bad, good = Handle(1), Handle()

    def boom():
        raise RuntimeError("copy failed")

    worker.put(boom, bad)
    worker.put(lambda: None, good)
    worker.run_until(good)
    assert bad.is_done() and isinstance(bad.error, RuntimeError)
    with pytest.raises(TransferError, match="copy failed"):
        bad.wait_layer(0, timeout=0)  # a layer waiter wakes up and sees the error
    assert good.is_done() and good.error is None


def test_a_waiters_keyboard_interrupt_is_its_own():
    worker = _Parked("test", lambda item: item())
    h = Handle()

    def interrupted():
        raise KeyboardInterrupt

    worker.put(interrupted, h)
    with pytest.raises(KeyboardInterrupt):
        worker.run_until(h)
    assert h.is_done()  # nobody waits forever on it either


def test_a_waiter_does_not_overtake_a_job_running_on_the_worker():
    stream = CpuTransferStream("test")
    try:
        release, started, ran = threading.Event(), threading.Event(), []

        def first(h):
            started.set()
            assert release.wait(10)
            ran.append(1)

        stream.submit(first, Handle())
        assert started.wait(10)
        second = stream.submit(lambda h: ran.append(2), Handle())
        stream._worker.run_until(
            second
        )  # the worker is busy with the first: nothing runs here
        assert ran == [] and not second.is_done()
        release.set()
        assert stream.wait(second, 10)
        assert ran == [1, 2]
    finally:
        stream.close()


def test_jobs_run_once_each_in_order_with_the_worker_and_two_waiters_racing():
    stream = CpuTransferStream("test")
    ran: list[int] = []

    def job(h, i):
        ran.append(i)
        h.layer_done(0)

    handles = [stream.submit(lambda h, i=i: job(h, i), Handle(1)) for i in range(400)]

    def wait_on(hs):  # as a forward does (per layer), and as a drain does (whole job)
        for k, h in enumerate(hs):
            h.wait_layer(0, timeout=10) if k % 2 else stream.wait(h, 10)

    waiters = [threading.Thread(target=wait_on, args=(handles[k::3],)) for k in (1, 2)]
    for t in waiters:
        t.start()
    wait_on(handles[::5])
    for t in waiters:
        t.join(30)
    assert stream.wait(handles[-1], 10)
    stream.close()
    assert ran == list(range(400))


def test_without_helping_every_job_runs_on_the_worker():
    stream = CpuTransferStream("test", help_waiters=False)
    try:
        where = []
        handles = [
            stream.submit(lambda h: where.append(threading.current_thread()), Handle())
            for _ in range(20)
        ]
        for h in handles:
            assert stream.wait(h, 10)
        assert threading.current_thread() not in where and len(where) == 20
    finally:
        stream.close()


def test_a_layer_waiter_goes_on_as_its_layer_lands_while_the_worker_copies_the_next():
    stream = CpuTransferStream("test", help_waiters=False)
    go_on = threading.Event()

    def job(h: Handle) -> None:
        h.layer_done(0)
        assert go_on.wait(
            10
        )  # layer 1 is still being copied while the forward reads layer 0
        h.layer_done(1)

    try:
        h = stream.submit(job, Handle(2))
        h.wait_layer(0, timeout=10)
        assert h.landed == 1 and not h.is_done()
        go_on.set()
        h.wait_layer(1, timeout=10)
        assert stream.wait(h, 10) and h.landed == 2 and h.error is None
    finally:
        go_on.set()
        stream.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_the_signal_lock_is_held_can_still_signal_and_wait():
    with streams._SIGNAL:  # as if a worker were notifying at the moment of the fork
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", DeprecationWarning
            )  # forking with threads running
            pid = os.fork()
        if (
            pid == 0
        ):  # the child: an inherited held lock would hang here (the alarm ends it)
            signal.alarm(10)
            h = Handle(1)
            h.layer_done(0)
            h.finish()
            os._exit(0 if h.wait(1) and h.landed == 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"child status {status}"
    )
