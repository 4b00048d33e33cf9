"""The file store's check that a page's fan-out directory stays under the store root (no
symlink on the way out): docs/stores.md. Called by the store's loop thread and its I/O
threads (set updates are atomic under the GIL; a directory checked twice at once is only
checked twice)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from enum import Enum

from kvtier.backends.file_calls import dir_status


class Dir(Enum):
    """What `InsideRoot.state` found of a page directory."""

    WHOLE = "whole"  # real directories all the way from "/"
    ABSENT = "absent"  # real directories as far as they go: a write makes the rest
    REFUSED = "refused"  # a symlink or no directory on the way, or not under the root


class InsideRoot:
    """`inside(directory)`: True if `directory` stays under `root`: each of its components,
    from "/" through the root to the page directory, is a real directory, no symlink,
    looked at in that order (what `realpath` would check, without its Python-level
    string work): one `openat2` that resolves no symlink, or where that cannot be asked,
    an `lstat` per component. The first component that is not there yet ends the walk:
    a write makes it and those below it as real directories, and it is walked again next
    time. A directory found whole is remembered; one swapped for a symlink later is not
    noticed (docs/stores.md says so). A directory that cannot be looked at (a file in its
    place, no permission) is refused; `complain(kind, message)` is told why."""

    def __init__(self, root: str, complain: Callable[[str, str], None]) -> None:
        self.root = root.rstrip(
            "/"
        )  # "" for "/": the store's paths are "<root>/..." strings
        self.complain = complain
        self.dirs: set[str] = set()  # directories found whole under the root

    def __call__(self, directory: str) -> bool:
        return self.state(directory) is not Dir.REFUSED

    def state(self, directory: str) -> Dir:
        """`__call__`'s answer, telling a directory not there yet (a write makes it before
        it opens its file there) from one found whole."""
        if directory in self.dirs:
            return Dir.WHOLE
        root = self.root
        if not directory.startswith(root + "/"):
            self.complain(
                "error",
                f"{directory}: not under the store root {root or '/'}; its pages are refused",
            )
            return Dir.REFUSED
        status = dir_status(directory)  # the walk in one system call
        if status == 0:
            self.dirs.add(directory)
            return Dir.WHOLE
        if status == errno.ENOENT:
            return Dir.ABSENT
        return self._walk(directory)

    def _walk(self, directory: str) -> Dir:
        """`state`'s walk, one `lstat` per component: where the system call cannot be
        asked, and to tell what refuses a directory."""
        path = ""
        try:  # from "/": a root (or a directory above it) swapped for a symlink since the open is caught
            for part in directory[1:].split("/"):  # strings, not os.path: ~1 us a part
                path = f"{path}/{part}"
                mode = os.lstat(path).st_mode
                if not stat.S_ISDIR(mode):
                    why = (
                        "a symlink (a store's directories are real ones)"
                        if stat.S_ISLNK(mode)
                        else "not a directory"
                    )
                    self.complain(
                        "error", f"{path}: {why}; the pages under it are refused"
                    )
                    return Dir.REFUSED
        except (
            FileNotFoundError
        ):  # not there yet: a write makes it (walked again next time)
            return Dir.ABSENT
        except OSError as exc:
            self.complain(
                "error",
                f"{path}: {exc.strerror or exc}; the pages under it are refused",
            )
            return Dir.REFUSED
        self.dirs.add(directory)
        return Dir.WHOLE
