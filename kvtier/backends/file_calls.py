"""Two Linux system calls the file store's hot path uses that Python's `os` lacks, each
one call where the portable way takes several (and a Python exception on the common
answer). Both say when they cannot answer (another OS, an old kernel, a sandbox that
blocks the call): the caller then takes the portable way, which decides alone.

- `dir_status(path)`: `openat2` with RESOLVE_NO_SYMLINKS: whether `path` resolves, from
  "/", through real directories only (`file_dirs.InsideRoot`).
- `rename_new(src, dst)`: `renameat2` with RENAME_NOREPLACE: a rename that fails where
  `dst` exists, so a new page's rename also says that it replaced nothing
  (`file_io.write_atomically`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RESOLVE_NO_SYMLINKS = 0x04
# openat2's number in the system call table that these machines share (alpha, ia64 and
# mips number it otherwise: there it is not asked)
_SYS_OPENAT2 = 437
_OPENAT2_MACHINES = frozenset(
    {"x86_64", "i386", "i686", "aarch64", "arm64", "armv7l", "armv8l", "riscv64"}
    | {"ppc64", "ppc64le", "s390x", "loongarch64"}
)


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_DIR_HOW = _OpenHow(  # O_PATH is Linux's: 0 elsewhere, where openat2 is not asked
    getattr(os, "O_PATH", 0) | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE_NO_SYMLINKS
)
_DIR_HOW_REF, _HOW_SIZE = ctypes.byref(_DIR_HOW), ctypes.sizeof(_DIR_HOW)

# errors that mean "this call cannot answer here", not "the answer is no"
_UNANSWERED = frozenset({errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.EOPNOTSUPP})


def _libc():
    """The C library's `syscall` and `renameat2` (None for a missing one), or None off
    Linux. ctypes lets the GIL go for the call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    syscall = getattr(libc, "syscall", None)
    if platform.machine() not in _OPENAT2_MACHINES:
        syscall = None
    return syscall, getattr(libc, "renameat2", None)


_CALLS = _libc()
_SYSCALL, _RENAMEAT2 = _CALLS if _CALLS is not None else (None, None)
# a call this kernel lacks (ENOSYS) is not asked again: every page would pay a failed one
_MISSING: set[str] = set()


def dir_status(path: str) -> int | None:
    """0 if `path` is a directory reached from "/" through real directories (no
    component a symlink), else the errno of the first component that is not one (ELOOP
    a symlink, ENOENT not there, ENOTDIR, EACCES ...); None where this cannot be asked
    (the caller walks the path itself)."""
    if _SYSCALL is None or "openat2" in _MISSING:
        return None
    fd = _SYSCALL(_SYS_OPENAT2, _AT_FDCWD, os.fsencode(path), _DIR_HOW_REF, _HOW_SIZE)
    if fd < 0:
        err = ctypes.get_errno()
        if err == errno.ENOSYS:
            _MISSING.add("openat2")
        return None if err in _UNANSWERED else err
    os.close(fd)
    return 0


def rename_new(src: str, dst: str) -> bool:
    """Rename `src` to `dst` if nothing is at `dst`: True if it did (it replaced
    nothing). False where `dst` exists, and where this cannot be asked or failed
    otherwise: nothing was renamed, and the caller renames the portable way (which
    raises the error, if any, itself)."""
    if _RENAMEAT2 is None or "renameat2" in _MISSING:
        return False
    done = _RENAMEAT2(
        _AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE
    )
    if done != 0 and ctypes.get_errno() == errno.ENOSYS:
        _MISSING.add("renameat2")
    return done == 0
