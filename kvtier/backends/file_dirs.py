"""The file store's check that a page's fan-out directory stays under the store root (no
symlink on the way out): docs/stores.md. Called by the store's loop thread and its I/O
threads (set and dict updates are atomic under the GIL; a directory checked twice at once
is only checked twice)."""

from __future__ import annotations

import os
import stat
from typing import Callable


class InsideRoot:
    """`inside(directory)`: True if `directory` stays under the root, checked once per
    directory: by a whole-path `realpath`, or, under a parent seen as a real directory
    inside the root, by two calls: the parent is still that directory (same device and
    inode: not swapped for a symlink, nor anything above it) and `directory` is no symlink
    (a fresh store has 65,536 of them). A directory that cannot be looked at (not a
    directory, no permission) is refused; `complain(kind, message)` is told why."""

    def __init__(self, complain: Callable[[str, str], None]) -> None:
        self.complain = complain
        self.dirs: set[str] = set()  # directories found inside
        self.parents: dict[str, tuple[int, int]] = {}  # their parents seen inside: (device, inode)

    def __call__(self, directory: str) -> bool:
        if directory in self.dirs:
            return True
        parent = os.path.dirname(directory)
        seen = self.parents.get(parent)
        try:
            if seen is not None and _identity(os.stat(parent)) == seen:
                inside = not stat.S_ISLNK(os.lstat(directory).st_mode)
            else:
                inside = os.path.realpath(directory) == directory
                st = os.lstat(parent) if inside else None  # not followed: a symlink made meanwhile is no parent
                if st is not None and stat.S_ISDIR(st.st_mode):
                    self.parents[parent] = _identity(st)
        except FileNotFoundError:  # none yet: a write makes it, a real one (checked again next time)
            return True
        except OSError as exc:
            self.complain("error", f"{directory}: {exc.strerror or exc}; its pages are refused")
            return False
        if not inside:
            self.complain("error", f"{directory}: a symlink leads out of the store root; its pages are refused")
            return False
        self.dirs.add(directory)
        return True


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino
