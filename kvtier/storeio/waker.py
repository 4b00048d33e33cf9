"""Waking the storage thread's event loop from the scheduler thread, keeping the GIL.

`loop.call_soon_threadsafe` wakes a loop by `socket.send` on its self-pipe, and Python
releases the GIL around every `send`. The woken loop thread takes the GIL at once and
the scheduler waits until the loop gives it back: with the storage and copy threads busy,
a wake-up costs the scheduler hundreds of microseconds against about one for the write
below (docs/design.md §2). So the scheduler writes the wake-up byte with libc's `write` called through
`ctypes.PyDLL`, which holds the GIL for the call: a non-blocking one-byte write never
waits. Where libc cannot be loaded this falls back to `os.write`.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
from collections.abc import Callable


def _gil_holding_write() -> Callable[[int], None]:
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return _os_write
    write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t
    return lambda fd: write(
        fd, b"\0", 1
    )  # -1 (pipe full) is fine: a wake-up is pending


def _os_write(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:  # full: a wake-up is pending
        pass


class Waker:
    """A private self-pipe on `loop`: `wake()` (any thread) makes the loop call `on_wake`."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_wake: Callable[[], None]
    ) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)
        self._fd = self._write.fileno()
        self._send = _gil_holding_write()
        self._on_wake = on_wake
        loop.add_reader(
            self._read.fileno(), self._woken
        )  # before the loop runs: no race

    def wake(self) -> None:
        if self._fd >= 0:  # after close the number may name another file by now
            self._send(self._fd)

    def _woken(self) -> None:
        try:
            while self._read.recv(4096):
                pass
        except BlockingIOError:
            pass
        self._on_wake()

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = -1
        loop.remove_reader(self._read.fileno())
        self._read.close()
        self._write.close()
