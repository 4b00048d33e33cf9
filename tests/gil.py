"""`gil_watch`: does a call let the GIL go? (numpy gives it up past 500 elements, torch in
every call; on the scheduler thread each hand-off may cost a switch interval: docs/design.md §2.)"""

import gc
import os
import sys
import threading
import time
from contextlib import contextmanager

# No forced switch comes while a watch runs: a thread waiting for the GIL asks the holder to
# drop it only after this long, and no test's block lasts that long however loaded the
# machine. The spinner takes the GIL only when the watched thread lets it go.
NO_FORCED_SWITCH_S = 3600.0


@contextmanager
def gil_watch():
    """`progress(fn)`: how many times a thread beside this one got the GIL while `fn` ran
    three times. It wants the GIL all along and hands it straight back each time it gets
    it (`os.sched_yield` lets the GIL go), so it gets it only when `fn` lets it go: a count,
    not a race against the clock. The switch interval is set to an hour before it first
    waits, so no forced switch comes however long `fn` takes (a process descheduled on a
    loaded machine included), and no collection runs (one freeing tensors lets the GIL go
    in torch, not in `fn`)."""
    spins, stop = [0], [False]

    def spin():
        while not stop[0]:
            spins[0] += 1
            os.sched_yield()  # the GIL goes back to the watched thread at once

    def progress(fn):
        before = spins[0]
        for _ in range(3):
            fn()
        return spins[0] - before

    spinner = threading.Thread(target=spin, daemon=True)
    interval = sys.getswitchinterval()
    gc.collect()
    try:
        gc.disable()
        sys.setswitchinterval(NO_FORCED_SWITCH_S)  # before the spinner first waits
        spinner.start()
        while spins[0] == 0:
            time.sleep(0.001)  # lets the GIL go: the spinner runs once
        yield progress
    finally:
        stop[0] = True
        if spinner.is_alive():
            spinner.join()
        sys.setswitchinterval(interval)
        gc.enable()
