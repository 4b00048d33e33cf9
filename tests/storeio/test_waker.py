"""Waking the store loop from the scheduler thread, keeping the GIL (storeio/waker.py)."""


def test_waker_runs_on_the_loop_thread_and_never_blocks():
    """`wake()` from the scheduler thread runs the callback on the loop's thread; a full pipe
    (thousands of wake-ups the loop has not read yet) neither blocks nor raises."""
    import asyncio
    import sys
    import threading

    from kvtier.storeio import waker as waker_mod

    loop = asyncio.new_event_loop()
    ran, hold = [], threading.Event()
    w = waker_mod.Waker(loop, lambda: ran.append(threading.current_thread().name))
    thread = threading.Thread(target=loop.run_forever, name="loop", daemon=True)
    thread.start()
    loop.call_soon_threadsafe(
        hold.wait
    )  # the loop reads nothing while we fill its pipe
    for _ in range(200_000):
        w.wake()
    hold.set()
    w.wake()
    done = threading.Event()
    loop.call_soon_threadsafe(
        lambda: loop.call_soon(done.set)
    )  # after the wake-ups were read
    assert done.wait(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    w.close(loop)
    loop.close()
    assert ran and set(ran) == {"loop"}
    if sys.platform.startswith(
        "linux"
    ):  # the GIL-holding libc write, not a GIL-releasing send
        assert waker_mod._gil_holding_write() is not waker_mod._os_write


def test_a_closed_waker_writes_nowhere(tmp_path):
    """The wake-up is a raw write to a file descriptor: once closed, that number may be
    reused by another file, which must not receive a byte."""
    import asyncio
    import os

    from kvtier.storeio.waker import Waker

    loop = asyncio.new_event_loop()
    w = Waker(loop, lambda: None)
    number = w._fd
    w.close(loop)
    loop.close()
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
    os.dup2(other, number)  # another file now has the waker's old number
    try:
        w.wake()
        assert os.path.getsize(tmp_path / "other") == 0
    finally:
        os.close(number)
        os.close(other)


def test_a_posted_call_that_raises_does_not_drop_the_rest_of_its_batch(caplog):
    """Calls posted together run as one batch on the loop: one that raises (a bug) is
    logged, and the calls posted after it still run (a lost one could be a job whose
    future nobody would ever end, and a `drain` waiting on it forever)."""
    import threading

    from kvtier.storeio.loop import StoreLoop

    loop = StoreLoop(name="test-loop")
    ran, done, hold = [], threading.Event(), threading.Event()
    try:
        loop.post(hold.wait)  # the batch below is posted while the loop is busy
        loop.post(lambda: 1 / 0)
        loop.post(lambda: ran.append("after"))
        loop.post(done.set)
        hold.set()
        assert done.wait(10)
    finally:
        loop.close()
    assert ran == ["after"]
    assert "a posted call raised" in caplog.text
