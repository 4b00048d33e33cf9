"""The file store's two Linux calls (file_calls.py) and what the write path and the
directory check make of them: the same answers as the portable way they stand in for."""

import ctypes
import errno
import os

import pytest

from kvtier.backends import file_calls, file_dirs, file_io
from kvtier.backends.file_dirs import Dir, InsideRoot


def _openat2_here() -> bool:
    """Whether the kernel has openat2 for this process: asked with no `open_how`, it
    answers EFAULT (ENOSYS or EPERM where it is missing or a sandbox blocks it). Not
    `dir_status("/") is None`: a call `file_calls` gets wrong (EINVAL) would skip the
    tests that should catch it."""
    if file_calls._SYSCALL is None:
        return False
    file_calls._SYSCALL(
        file_calls._SYS_OPENAT2, file_calls._AT_FDCWD, None, None, file_calls._HOW_SIZE
    )
    return ctypes.get_errno() == errno.EFAULT


linux_calls = pytest.mark.skipif(
    not _openat2_here(), reason="openat2 cannot be asked here"
)
renameat2_here = pytest.mark.skipif(
    file_calls._RENAMEAT2 is None, reason="the C library has no renameat2"
)


@linux_calls
def test_dir_status_names_what_stops_a_path_from_being_real_directories(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "file").write_bytes(b"x")
    os.symlink(tmp_path / "a", tmp_path / "link")
    assert file_calls.dir_status(str(tmp_path / "a" / "b")) == 0
    assert file_calls.dir_status(str(tmp_path / "a" / "b" / "c" / "d")) == errno.ENOENT
    assert file_calls.dir_status(str(tmp_path / "link" / "b")) == errno.ELOOP
    assert file_calls.dir_status(str(tmp_path / "link" / "gone")) == errno.ELOOP
    assert file_calls.dir_status(str(tmp_path / "link")) == errno.ELOOP
    assert file_calls.dir_status(str(tmp_path / "file" / "b")) == errno.ENOTDIR
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(200):  # each call's descriptor closed (a leak: 200 more)
        assert file_calls.dir_status(str(tmp_path / "a")) == 0
    assert len(os.listdir("/proc/self/fd")) < fds + 100


@renameat2_here
def test_rename_new_renames_only_where_nothing_is_there(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(b"new")
    assert file_calls.rename_new(str(src), str(dst)) is True
    assert dst.read_bytes() == b"new" and not src.exists()
    src.write_bytes(b"newer")
    assert file_calls.rename_new(str(src), str(dst)) is False
    assert dst.read_bytes() == b"new" and src.read_bytes() == b"newer"


@pytest.mark.parametrize("noreplace", [True, False], ids=["renameat2", "stat"])
def test_write_atomically_returns_the_bytes_of_the_file_it_replaced(
    tmp_path, monkeypatch, noreplace
):
    if not noreplace:  # where renameat2 cannot be asked: stat, then rename
        monkeypatch.setattr(file_io, "rename_new", lambda src, dst: False)
    final = str(tmp_path / "ab" / "cd" / "page")
    assert file_io.write_atomically(final, b"x" * 100, False) == 0
    assert file_io.write_atomically(final, b"y" * 30, False) == 100
    assert open(final, "rb").read() == b"y" * 30
    assert os.listdir(tmp_path / "ab" / "cd") == ["page"]  # no temp file left


@pytest.mark.parametrize("walk_only", [False, True], ids=["openat2", "walk"])
def test_inside_root_refuses_a_symlink_on_the_way_and_says_which(
    tmp_path, monkeypatch, walk_only
):
    if walk_only:
        monkeypatch.setattr(file_dirs, "dir_status", lambda path: None)
    root = tmp_path / "root"
    (root / "ns" / "aa").mkdir(parents=True)
    os.symlink(tmp_path, root / "ns" / "bb")
    said = []
    inside = InsideRoot(str(root), lambda kind, message: said.append(message))
    assert inside(str(root / "ns" / "aa"))
    assert inside.state(str(root / "ns" / "aa")) is Dir.WHOLE
    assert (
        inside.state(str(root / "ns" / "cc" / "01")) is Dir.ABSENT
    )  # a write makes it
    assert inside(str(root / "ns" / "cc" / "01"))
    assert str(root / "ns" / "cc" / "01") not in inside.dirs  # walked again next time
    assert not inside(str(root / "ns" / "bb" / "01"))
    assert said == [
        f"{root}/ns/bb: a symlink (a store's directories are real ones); "
        "the pages under it are refused"
    ]
    assert inside.dirs == {str(root / "ns" / "aa")}


def test_a_call_the_kernel_lacks_is_asked_once(tmp_path, monkeypatch):
    """On a kernel without openat2 or renameat2 (ENOSYS) each page paid a failed call
    before the portable way; the first ENOSYS ends the asking for the process."""
    asked = []

    def lacking(*args):
        asked.append(args)
        ctypes.set_errno(errno.ENOSYS)
        return -1

    monkeypatch.setattr(file_calls, "_MISSING", set())
    monkeypatch.setattr(file_calls, "_SYSCALL", lacking)
    monkeypatch.setattr(file_calls, "_RENAMEAT2", lacking)
    assert file_calls.dir_status(str(tmp_path)) is None
    assert file_calls.dir_status(str(tmp_path)) is None
    (tmp_path / "a").write_bytes(b"x")
    assert not file_calls.rename_new(str(tmp_path / "a"), str(tmp_path / "b"))
    assert not file_calls.rename_new(str(tmp_path / "a"), str(tmp_path / "b"))
    assert len(asked) == 2  # one of each
    assert file_io.write_atomically(str(tmp_path / "b"), b"page", False) == 0
    assert (tmp_path / "b").read_bytes() == b"page"
