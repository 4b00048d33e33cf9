"""Where kvtier's own threads run: `controller.cpus` (docs/design.md §7).

A CPU list in the kernel's notation ("1-3,6", as `taskset -c` takes it). kvtier's threads
(the storage loop, the store's I/O threads it starts, the copy workers) are confined to
those CPUs; the scheduler thread is never touched. Leave the scheduler's core out of the
list: a helper that runs on that core while the scheduler waits leaves it cold caches, and
every tree and allocator call after costs more (`benchmarks/cache.py` measures both).
Linux only; null (the default) leaves every thread where the process may run.
"""

from __future__ import annotations

import logging
import os
import threading

from kvtier.errors import KvtierConfigError


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs named by `text` ("0-3,8"); ValueError naming `cpus`, the value and the syntax."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            lo, hi = -1, -2
        if lo < 0 or hi < lo:
            raise ValueError(
                f"cpus={text!r}: expected a CPU list such as '1-3,6' (ids >= 0, ranges low-high)"
            )
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def allowed_cpus() -> frozenset[int] | None:
    """The CPUs this process may run on, or None where the platform cannot confine threads."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return None
    return frozenset(os.sched_getaffinity(0))


def check_cpus(text: str | None) -> frozenset[int] | None:
    """`controller.cpus` resolved on this machine: None (leave threads be) or CPUs this
    process may run on; else KvtierConfigError naming the field, the value and what is allowed."""
    if text is None:
        return None
    try:
        cpus = parse_cpu_list(text)
    except ValueError as exc:
        raise KvtierConfigError(f"controller.{exc}") from None
    allowed = allowed_cpus()
    if allowed is None:
        raise KvtierConfigError(
            f"controller.cpus={text!r}: confining threads needs Linux (sched_setaffinity); "
            f"leave it null"
        )
    if not cpus <= allowed:
        raise KvtierConfigError(
            f"controller.cpus={text!r}: CPUs {format_cpu_list(cpus - allowed)} are not ones "
            f"this process may run on ({format_cpu_list(allowed)})"
        )
    return cpus


def confine(native_id: int, cpus: frozenset[int] | None) -> None:
    """Keep the thread `native_id` on `cpus` (threads it starts later inherit them). A CPU
    gone offline since `check_cpus` is logged, not raised: the thread must still run."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(native_id, cpus)
    except OSError as exc:
        logging.getLogger(__name__).warning(
            "thread %d: could not keep to CPUs %s (%s); running anywhere",
            native_id,
            format_cpu_list(cpus),
            exc,
        )


def keep_to(cpus: frozenset[int] | None) -> None:
    """Confine the calling thread: a thread's first act, before it starts others."""
    confine(threading.get_native_id(), cpus)


def format_cpu_list(cpus) -> str:
    """ "1-3,6" for {1, 2, 3, 6}."""
    out, ids = [], sorted(cpus)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)
