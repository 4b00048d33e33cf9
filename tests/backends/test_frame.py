"""The plain page frame (docs/formats.md), byte by byte, and an older kvtier's frames."""

import os
import re
import struct

import numpy as np
import pytest
import xxhash

from kvtier.backends import file_io, frame
from kvtier.backends.frame import FrameError
from tests.backends.stores import NS, version_1_frame

H = bytes(range(32))


def test_plain_frame_layout_is_the_documented_one():
    payload = os.urandom(4096)
    blob = frame.encode(NS, H, payload)
    assert frame.HEADER_SIZE == 128 and len(blob) == 128 + 4096
    fields = struct.unpack_from("<4sHH16sB32sQQ", blob)
    assert fields == (
        b"KVTP",
        3,
        0,
        bytes.fromhex(NS),
        32,
        H,
        4096,
        xxhash.xxh3_64_intdigest(payload),
    )
    assert blob[73:128] == bytes(55) and blob[128:] == payload
    short = frame.encode(NS, H[:16], payload)  # an xxh3-128 page hash, zero padded
    assert short[24] == 16 and short[25:57] == H[:16] + bytes(16)
    assert bytes(frame.decode(blob, NS, H)) == payload


@pytest.mark.parametrize(
    "offset", [0, 4, 6, 7, 8, 24, 25, 56, 57, 65, 72, 73, 100, 127, 128, -1]
)
def test_any_byte_changed_in_the_header_or_the_payload_is_a_miss(offset):
    """Reserved bytes and padding included: they are zero, and a reader checks it."""
    blob = bytearray(frame.encode(NS, H, os.urandom(4096)))
    blob[offset] ^= 0x01
    with pytest.raises(FrameError):
        frame.decode(bytes(blob), NS, H)
    with pytest.raises(FrameError):
        frame.PLAIN.decode_into(bytes(blob), NS, H, memoryview(bytearray(4096)))


@pytest.mark.parametrize("size", [4096, 16])
def test_an_older_kvtiers_version_1_frame_is_a_miss_that_says_so(size):
    """An older kvtier's frame (an 80-byte header; its xxh3 good) is never read as data:
    read as this build's frame, its header's first 48 bytes past 80 would be taken for
    payload. A page shorter than the new header says the version too, not "truncated"."""
    blob = version_1_frame(NS, H, os.urandom(size))
    reason = re.escape("frame version 1 (an older kvtier), this build reads 3")
    with pytest.raises(FrameError, match=reason):
        frame.decode(blob, NS, H)
    with pytest.raises(FrameError, match=reason):
        frame.PLAIN.decode_into(blob, NS, H, memoryview(bytearray(size)))


@pytest.mark.parametrize("in_memory", [True, False])
def test_the_file_stores_reads_miss_an_older_kvtiers_frame(
    in_memory, tmp_path, monkeypatch
):
    """The direct read (the vLLM tier's: straight into the row for a file in memory, in
    chunks otherwise) gives a version-1 page its reason, and the good page beside it its
    bytes."""
    monkeypatch.setattr(file_io, "_in_memory", lambda fd, device: in_memory)
    size = 4 * file_io._READ_CHUNK if not in_memory else 256 << 10
    old, new = os.urandom(size), os.urandom(size)
    (tmp_path / "old").write_bytes(version_1_frame(NS, H, old))
    (tmp_path / "new").write_bytes(frame.encode(NS, H, new))
    rows = np.zeros((2, size), dtype=np.uint8)
    got = file_io.read_pages_into(
        [
            (str(tmp_path / "old"), NS, H, memoryview(rows[0])),
            (str(tmp_path / "new"), NS, H, memoryview(rows[1])),
        ]
    )
    assert isinstance(got[0], FrameError) and "an older kvtier" in str(got[0])
    assert got[1] is True and rows[1].tobytes() == new
    with pytest.raises(FrameError, match="an older kvtier"):
        frame.decode(file_io.read_file(tmp_path / "old", page=True), NS, H)
