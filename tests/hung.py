"""A hung NFS or FUSE mount, for tests: an `open` of a chosen path blocks, its thread stuck
where the kernel would hold it (the GIL let go), until the mount comes back (`release`);
then the open goes on, on whatever the path holds by then. kvtier opens page files so that a
FIFO in the store does not block (hostile contents are a miss, not a hang), so a FIFO can no
longer stand in for a hung mount."""

from __future__ import annotations

import os
import threading


class HungMount:
    def __init__(self, monkeypatch) -> None:
        self.paths: set[str] = set()
        self.back = threading.Event()
        self.stuck: list[threading.Thread] = []  # the threads whose open got stuck
        real = os.open

        def open_(path, flags, mode=0o777, *, dir_fd=None):
            if os.fspath(path) in self.paths and not self.back.is_set():
                self.stuck.append(threading.current_thread())
                self.back.wait()
            return real(path, flags, mode, dir_fd=dir_fd)

        monkeypatch.setattr(os, "open", open_)

    def hang(self, *paths) -> None:
        """Opens of `paths` block from now on, until `release`."""
        self.paths.update(os.fspath(p) for p in paths)

    def release(self) -> None:
        """The mount is back: stuck opens go on, later ones do not block."""
        self.back.set()

    def come_back(self, timeout: float = 30.0) -> None:
        """`release`, then wait until every thread that was stuck has ended: a store's I/O
        thread given up on ends after its job (io_threads.py), whatever that job did."""
        self.release()
        assert self.stuck, "no open got stuck on a hung path"
        for t in self.stuck:
            t.join(timeout)
            assert not t.is_alive(), (
                f"{t.name} still runs {timeout}s after the mount came back"
            )
