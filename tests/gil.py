"""`gil_watch`: does a call let the GIL go? (numpy gives it up past 500 elements, torch in
every call; on the scheduler thread each hand-off may cost a switch interval: docs/design.md §2.)"""

import gc
import sys
import threading
from contextlib import contextmanager


@contextmanager
def gil_watch():
    """`progress(fn)`: how far a thread spinning beside this one got while `fn` ran three
    times. It wants the GIL all along, so it gets anywhere only if `fn` lets the GIL go
    (no forced switch comes within the half-second interval set before it first waited:
    the block must end within it; no collection runs: one freeing tensors lets the GIL go
    in torch, not in `fn`)."""
    spins, stop = [0], [False]

    def spin():
        while not stop[0]:
            spins[0] += 1

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
        sys.setswitchinterval(
            0.5
        )  # before the spinner waits: a wait begun at 5 ms would force a switch mid-call
        spinner.start()
        while spins[0] == 0:
            pass  # it ran: now it wants the GIL back, and takes it only if this thread lets it go
        yield progress
    finally:
        sys.setswitchinterval(interval)
        stop[0] = True
        if spinner.is_alive():
            spinner.join()
        gc.enable()
