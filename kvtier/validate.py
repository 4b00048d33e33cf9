"""Checks and defaults for config sections that any layer may use (no torch here: the
stores and the CLI's help import it)."""

from __future__ import annotations

import os


def check_positive(obj: object, *names: str, integer: bool = False) -> None:
    """Each named field of a config dataclass is a number > 0 (an int when `integer`)."""
    for name in names:
        value = getattr(obj, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int if integer else (int, float))
            or not value > 0
        ):
            kind = "an integer" if integer else "a number"
            raise ValueError(f"{name}={value!r}: must be {kind} > 0")


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the platform keeps one
    (a container's cpuset, `taskset`), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity masks here
        return os.cpu_count() or 1


def io_threads(most: int = 4) -> int:
    """Default thread count for a store's I/O: up to `most`, but at most half the cores
    this process may run on (`usable_cores`), so that on a small machine the scheduler
    thread keeps a core to itself."""
    return max(1, min(most, usable_cores() // 2))
