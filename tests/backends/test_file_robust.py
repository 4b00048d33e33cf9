"""The file store against a root that others (or accidents) changed: entries that vanish or do
not stat, oversized and sparse page files, a wrong usage count, symlinked fan-out
directories, a root that is a file. Each failed on main as the test says."""

import contextlib
import os
import shutil

import pytest

from kvtier.backends import file_dirs
from kvtier.backends.file import USAGE, FileStore, FileStoreConfig
from kvtier.errors import StoreError, StoreUnavailable
from kvtier.hashing import make_key

NS = "cd" * 16
PAGE = bytes(range(256)) * 4  # 1 KiB


def _key(i: int, first: int | None = None) -> str:
    h = bytes([i]) * 32 if first is None else bytes([first]) + bytes([i]) * 31
    return make_key("kvtier", NS, h)


@pytest.fixture(params=["openat2", "walk"])
def dir_check(request, monkeypatch):
    """The directory check two ways: one openat2, and the lstat walk alone (where that
    call cannot be asked)."""
    if request.param == "walk":
        monkeypatch.setattr(file_dirs, "dir_status", lambda path: None)


def store_at(tmp_path, **cfg) -> FileStore:
    return FileStore(
        FileStoreConfig(root=str(tmp_path / "l3"), max_concurrency=1, **cfg),
        timeout_s=10,
    )


async def filled(tmp_path, n=10, **cfg) -> FileStore:
    store = store_at(tmp_path, **cfg)
    keys = [_key(i) for i in range(1, n + 1)]
    assert all(await store.batch_set(keys, [PAGE] * n))
    return store


async def test_open_tolerates_a_page_path_that_does_not_stat(tmp_path):
    """main: FileNotFoundError from the open's stat; every tierctl command exited at start."""
    store = await filled(tmp_path)
    await store.close()
    dangling = store.path(_key(99))
    dangling.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(tmp_path / "nowhere", dangling)
    again = store_at(tmp_path)
    assert await again.batch_exists([_key(i) for i in range(1, 11)]) == 10
    assert await again.batch_exists([_key(99)]) == 0
    await again.close()


async def test_verify_reads_at_most_a_pages_declared_size(tmp_path):
    """main: a page file read whole (a symlink to /dev/zero never ends; a huge one fills memory)."""
    store = await filled(tmp_path, n=3)
    zero = store.path(_key(1))
    os.unlink(zero)
    os.symlink("/dev/zero", zero)
    big = store.path(_key(2))
    with open(big, "r+b") as f:
        f.seek(64 << 20)
        f.write(b"x")  # a sparse 64 MiB tail past the declared payload
    got = await store.check([_key(1), _key(2), _key(3)])
    assert (
        got[0] and got[1] and got[2] is None
    )  # bad, bad, good: each said, none read whole
    assert "trailing" in str(got[1]) or "payload" in str(got[1])
    await store.close()


def test_verify_reads_no_more_than_the_stores_page_limit_whatever_a_header_declares(
    tmp_path,
):
    """A header is anyone's to write: one declaring a 1 GiB payload (a sparse file, no disk)
    made `check` (tierctl store verify, batch_get) read and join all of it, >2 GiB of memory
    whatever `max_page_bytes` said; tens of GiB would kill the process. A header declaring
    more than the store's page limit is read alone, and its frame fails to decode."""
    import subprocess
    import sys

    from kvtier.backends.frame import header_with

    root = tmp_path / "l3"
    h = bytes([7]) * 32
    page = root / "kvtier" / NS / h.hex()[:2] / h.hex()[2:4] / h.hex()
    page.parent.mkdir(parents=True)
    header = header_with(NS, h, 1 << 30, 0)
    with open(page, "wb") as f:
        f.write(header)
        f.truncate(len(header) + (1 << 30))
    code = (
        "import asyncio, resource, sys\n"
        "from kvtier.backends.file import FileStore, FileStoreConfig\n"
        "store = FileStore(FileStoreConfig(root=sys.argv[1], max_page_bytes=1 << 20))\n"
        "[why] = asyncio.run(store.check([sys.argv[2]]))\n"
        # the peak of this process's own memory since exec (VmHWM): ru_maxrss keeps the
        # peak of the process before exec, a copy of pytest's after its biggest tests
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')]\n"
        "kib = int(hwm[0].split()[1]) if hwm else "
        "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(type(why).__name__, kib // 1024)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), make_key("kvtier", NS, h)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    verdict, peak_mib = out.stdout.split()
    assert verdict == "FrameError" and int(peak_mib) < 512


async def test_a_sparse_huge_page_file_is_evicted_first_not_the_good_pages(tmp_path):
    """main: one sparse 8 GiB page file made the next replay evict 505 of 588 pages."""
    store = await filled(tmp_path, capacity_bytes=64 << 10, max_page_bytes=8 << 10)
    await store.close()
    with open(store.path(_key(5)), "r+b") as f:
        f.truncate(1 << 30)  # sparse: a 1 GiB size, no blocks
    again = store_at(tmp_path, capacity_bytes=64 << 10, max_page_bytes=8 << 10)
    assert await again.batch_set([_key(50)], [PAGE]) == [True]
    assert again.counters.evictions == 1  # the oversized file only
    keys = [_key(i) for i in range(1, 11) if i != 5]
    assert [await again.batch_exists([k]) for k in keys] == [1] * 9
    await again.close()


async def test_a_wrong_usage_count_is_recounted_before_anything_is_evicted(tmp_path):
    """main: one flipped digit in .kvtier-usage evicted 620 pages."""
    store = await filled(tmp_path, capacity_bytes=64 << 10)
    with open(store.root / USAGE, "wb") as f:
        f.write(b"%020d" % (9 << 30))
    assert await store.batch_set([_key(50)], [PAGE]) == [True]
    assert store.counters.evictions == 0
    assert int((store.root / USAGE).read_bytes()) < 64 << 10
    await store.close()


@pytest.mark.usefixtures("dir_check")
async def test_a_symlinked_fanout_directory_never_takes_a_write_outside_the_root(
    tmp_path,
):
    """main: writes followed the symlink (133 page files outside the root)."""
    store = store_at(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    key = _key(7, first=0xAA)
    fanout = store.path(key).parent.parent  # <root>/kvtier/<ns>/aa
    fanout.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, fanout)
    assert await store.batch_set([key, _key(8)], [PAGE, PAGE]) == [False, True]
    assert not any(outside.rglob("*"))
    assert await store.batch_exists([key]) == 0
    await store.close()


@pytest.mark.usefixtures("dir_check")
async def test_a_symlinked_leaf_directory_under_a_checked_parent_is_refused(tmp_path):
    """Its siblings were found whole and remembered; a new leaf directory that is a
    symlink still takes no write and serves no page."""
    store = store_at(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    assert await store.batch_set([_key(7, first=0xAA)], [PAGE]) == [
        True
    ]  # makes <ns>/aa and aa/07
    assert await store.batch_set([_key(6, first=0xAA)], [PAGE]) == [
        True
    ]  # <ns>/aa is there: checked once
    (outside / store.path(_key(8, first=0xAA)).name).write_bytes(
        PAGE
    )  # a page waiting out there
    leaf = store.path(_key(8, first=0xAA)).parent  # <root>/kvtier/<ns>/aa/08
    os.symlink(outside, leaf)
    assert await store.batch_exists([_key(8, first=0xAA)]) == 0
    assert await store.batch_set(
        [_key(8, first=0xAA), _key(9, first=0xAA)], [PAGE, PAGE]
    ) == [False, True]
    assert sorted(p.name for p in outside.iterdir()) == [
        store.path(_key(8, first=0xAA)).name
    ]
    assert await store.batch_exists([_key(i, first=0xAA) for i in (6, 7, 9)]) == 3
    await store.close()


@pytest.mark.usefixtures("dir_check")
async def test_a_checked_parent_swapped_for_a_symlink_takes_no_write_and_serves_no_page(
    tmp_path,
):
    """A parent walked before is walked again for each new directory under it: renamed
    away and replaced by a symlink, it is refused."""
    store = store_at(tmp_path)
    outside = tmp_path / "outside"
    (outside / "04").mkdir(parents=True)
    (outside / "04" / store.path(_key(4, first=0xAA)).name).write_bytes(
        PAGE
    )  # a page waiting out there
    assert await store.batch_set([_key(1, first=0xAA)], [PAGE]) == [True]
    assert await store.batch_set([_key(2, first=0xAA)], [PAGE]) == [
        True
    ]  # <ns>/aa seen: a checked parent
    fanout = store.path(_key(1, first=0xAA)).parent.parent
    fanout.rename(tmp_path / "moved")
    os.symlink(outside, fanout)
    assert await store.batch_set([_key(3, first=0xAA), _key(5)], [PAGE, PAGE]) == [
        False,
        True,
    ]
    assert await store.batch_exists([_key(4, first=0xAA)]) == 0
    assert sorted(p.name for p in outside.iterdir()) == ["04"]
    await store.close()


@pytest.mark.usefixtures("dir_check")
async def test_an_ancestor_swapped_for_a_symlink_to_the_same_directory_takes_no_write(
    tmp_path,
):
    """Review: the namespace directory renamed out of the root and a symlink to it put in
    its place. A check of the page directory's parent identity (device, inode) passed, as
    the parent is the same directory still: a write landed outside the root."""
    store = store_at(tmp_path)
    assert await store.batch_set([_key(1, first=0xAA)], [PAGE]) == [True]
    assert await store.batch_set([_key(2, first=0xAA)], [PAGE]) == [True]
    namespace = store.path(_key(1, first=0xAA)).parent.parent.parent
    moved = tmp_path / "moved"
    namespace.rename(moved)
    os.symlink(moved, namespace)
    with pytest.raises(
        StoreError, match="refused"
    ):  # every page is under it: the batch fails whole
        await store.batch_set([_key(3, first=0xAA)], [PAGE])
    assert sorted(p.name for p in (moved / "aa").iterdir()) == ["01", "02"]
    assert (
        await store.batch_exists([_key(1, first=0xAA)]) == 1
    )  # found whole before the swap (docs/stores.md)
    await store.close()


@pytest.mark.usefixtures("dir_check")
async def test_an_ancestor_swapped_for_a_symlink_to_an_empty_directory_takes_no_write(
    tmp_path,
):
    """Review: with the namespace directory a symlink to an empty directory, the checked
    parent was not found, the directory counted as not there yet, and the write made it
    (and the page) through the symlink."""
    store = store_at(tmp_path)
    assert await store.batch_set([_key(1, first=0xAA)], [PAGE]) == [True]
    assert await store.batch_set([_key(2, first=0xAA)], [PAGE]) == [True]
    namespace = store.path(_key(1, first=0xAA)).parent.parent.parent
    anywhere = tmp_path / "anywhere"
    anywhere.mkdir()
    shutil.rmtree(namespace)
    os.symlink(anywhere, namespace)
    with pytest.raises(StoreError, match="refused"):
        await store.batch_set([_key(3, first=0xAA)], [PAGE])
    assert not any(anywhere.rglob("*"))
    assert await store.batch_exists([_key(3, first=0xAA)]) == 0
    await store.close()


async def test_a_page_directory_absent_at_an_exists_check_is_walked_again_when_written(
    tmp_path,
):
    """Review: `realpath` of a directory not there yet is the path itself; remembered as
    inside, it took a write once it had become a symlink out of the root."""
    store = store_at(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    assert await store.batch_set([_key(1, first=0xAA)], [PAGE]) == [True]
    assert await store.batch_exists([_key(8, first=0xAA)]) == 0  # aa/08 is not there
    os.symlink(outside, store.path(_key(8, first=0xAA)).parent)
    assert await store.batch_set([_key(8, first=0xAA), _key(9)], [PAGE, PAGE]) == [
        False,
        True,
    ]
    assert not any(outside.iterdir())
    await store.close()


async def test_a_root_swapped_for_a_symlink_after_the_open_takes_no_write(tmp_path):
    """Review: the walk began below the root; a root renamed away and replaced by a
    symlink since the store opened took writes wherever the symlink led."""
    store = store_at(tmp_path)
    assert await store.batch_set([_key(1)], [PAGE]) == [True]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "l3").rename(tmp_path / "moved")
    os.symlink(elsewhere, tmp_path / "l3")
    with pytest.raises(StoreError, match="refused"):
        await store.batch_set([_key(2)], [PAGE])
    assert not any(elsewhere.rglob("*"))
    await store.close()


async def test_a_page_file_that_is_a_symlink_is_not_read(tmp_path):
    """Its target is the right page, copied out of the root: a symlink is no page file
    (as `tierctl store verify` says), so it is a miss, never followed."""
    store = store_at(tmp_path)
    assert await store.batch_set([_key(1)], [PAGE]) == [True]
    path = store.path(_key(1))
    copy = tmp_path / "copy"
    copy.write_bytes(path.read_bytes())
    path.unlink()
    os.symlink(copy, path)
    buf = bytearray(len(PAGE))
    assert await store.batch_get_into([_key(1)], [buf]) == [False]
    await store.close()


async def test_a_page_directory_that_cannot_be_looked_at_is_a_miss_not_an_error(
    tmp_path,
):
    """A file where a checked parent was: its pages are misses and refused writes; the call
    itself does not fail (the breaker would count it)."""
    store = store_at(tmp_path)
    assert await store.batch_set([_key(1, first=0xAA)], [PAGE]) == [True]
    assert await store.batch_set([_key(2, first=0xAA)], [PAGE]) == [True]
    fanout = store.path(_key(1, first=0xAA)).parent.parent
    shutil.rmtree(fanout)
    fanout.write_bytes(b"not a directory")
    assert await store.batch_exists([_key(3, first=0xAA)]) == 0
    assert await store.batch_set([_key(3, first=0xAA), _key(5)], [PAGE, PAGE]) == [
        False,
        True,
    ]
    await store.close()


async def test_an_exists_check_looks_at_no_directory_past_the_first_absent_page(
    tmp_path,
):
    """A prompt's new pages are absent: the leading run ends at the first, and the pages
    after it cost no directory check (a syscall each in a fresh store)."""
    store = store_at(tmp_path)
    present = [_key(i) for i in range(1, 4)]
    assert await store.batch_set(present, [PAGE] * 3) == [True] * 3
    looked = []
    inside = store._inside
    store._inside = lambda directory: (looked.append(directory), inside(directory))[1]
    assert await store.batch_exists(present + [_key(i) for i in range(10, 60)]) == 3
    assert looked == [os.path.dirname(store._file(_key(10)))]
    await store.close()


def test_a_root_that_is_a_file_is_one_clear_line(tmp_path):
    """main: 'File exists'."""
    root = tmp_path / "l3"
    root.write_text("not a directory")
    with pytest.raises(StoreUnavailable, match="is a file, not a directory"):
        FileStore(FileStoreConfig(root=str(root)))


async def test_opening_a_root_that_another_process_churns(tmp_path):
    """main: the open walked the root, then stat'ed each page: one unlinked in between raised
    FileNotFoundError (300 opens against a churning writer)."""
    import threading

    store = await filled(tmp_path, n=40)
    await store.close()
    paths = [store.path(_key(i)) for i in range(1, 41)]
    stop = threading.Event()

    def churn():
        while (
            not stop.is_set()
        ):  # every page gone, then all back: opens meet both halves
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
            for p in paths:
                p.write_bytes(PAGE)

    writer = threading.Thread(target=churn, daemon=True)
    writer.start()
    try:
        for _ in range(150):
            store_at(tmp_path)  # no I/O threads start before a call
    finally:
        stop.set()
        writer.join(10)


@pytest.mark.parametrize("encrypt", [False, True])
async def test_verify_of_a_sealed_store_reads_a_pages_declared_size(tmp_path, encrypt):
    """The bounded read knows a sealed header's size too: sealed pages verify good, and a
    sealed page with a sparse tail is bad, not read whole (with the plain header's bound
    alone every sealed page was bad)."""
    from kvtier.backends.seal import SealedCodec
    from kvtier.tenant_keys import parse_keys

    store = store_at(tmp_path)
    store.seal_with(SealedCodec(parse_keys("07" * 32, "test"), encrypt))
    keys = [_key(i) for i in range(1, 4)]
    assert all(await store.batch_set(keys, [PAGE] * 3))
    with open(store.path(keys[0]), "r+b") as f:
        f.seek(64 << 20)
        f.write(b"x")
    got = await store.check(keys)
    assert got[0] is not None and got[1] is None and got[2] is None
    await store.close()


@pytest.mark.parametrize(
    "content",
    ["[" * 100_000, "[1]", '{"tenant_key_id": [1], "tenant": {}, "model_id": "m"}'],
)
def test_a_hostile_manifest_reads_as_none_and_the_store_tools_go_on(
    tmp_path, content, capsys
):
    """Anyone who can write the store can write a namespace's manifest.json. A deeply
    nested one raised RecursionError out of get_manifest, which the storage worker reads
    before backups: every backup of that namespace failed for good, and `store.required`
    refused to start. One that is no object, or has list fields, made `tierctl store ls`,
    `verify` and `purge` fail for the whole store. It reads as none (fields that are no
    scalar are dropped), so the worker writes it again as it does a missing one."""
    import asyncio

    from kvtier.backends.base import manifest_key
    from kvtier.cli.main import main

    async def read_back():
        store = await filled(tmp_path, n=2)
        path = store.root.joinpath(*manifest_key("kvtier", NS).split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        try:
            return await store.get_manifest("kvtier", NS)
        finally:
            await store.close()

    manifest = asyncio.run(read_back())
    assert manifest is None or manifest == {"model_id": "m"}
    config = tmp_path / "c.yaml"
    config.write_text(f"store:\n  backend: file\n  root: {tmp_path / 'l3'}\n")
    for argv in (["ls"], ["verify"], ["purge", "--tenant", "salt"]):
        assert main(["store", *argv, "--config", str(config)]) == 0, argv
    capsys.readouterr()


async def test_a_root_removed_while_in_use_is_made_again_with_its_marker(
    tmp_path, caplog
):
    """main: the next write made the root again without its .kvtier-store marker, beside a
    manifest; every later open refused it ("not a kvtier store", tierctl exit 2) until
    fixed by hand. The root comes back marked: the next open adopts it, pages and all."""
    store = await filled(tmp_path, n=3)
    shutil.rmtree(store.root)
    await store.put_manifest("kvtier", NS, {"format": 1, "namespace": NS})
    assert await store.batch_set([_key(7)], [PAGE]) == [True]
    assert "lost its .kvtier-store marker while in use" in caplog.text
    await store.close()
    again = store_at(tmp_path)
    assert await again.batch_exists([_key(7)]) == 1
    assert await again.batch_exists([_key(1)]) == 0  # removed with the root
    assert (await again.get_manifest("kvtier", NS))["namespace"] == NS
    await again.close()
