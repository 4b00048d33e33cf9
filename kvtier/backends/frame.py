"""The L3 page frame: every stored page is `header ‖ payload`.

    magic 'KVTP' | version u16 (3) | reserved u16 | namespace id 16 B | hash len u8 |
    page hash 32 B (zero padded) | payload length u64 | xxh3-64 of payload u64 | zero 55 B

128 bytes, as the sealed header: the payload starts on a cache line, where the kernel
copies it out of the page cache fastest. A frame that does not verify (magic, version,
namespace, page hash, length, checksum, zero reserved and padding) is a miss, never data;
so is an older kvtier's version-1 frame (an 80-byte header). That is the frame of a store
without a tenant key (`PLAIN`); with one, pages are sealed instead (`kvtier/backends/seal.py`,
docs/formats.md). A store frames and reads through its codec: `PLAIN` here, or a
`SealedCodec`.
"""

from __future__ import annotations

import functools
import struct

import xxhash

MAGIC = b"KVTP"
VERSION = 3
OLD_VERSION = 1  # an older kvtier's plain frame (an 80-byte header): a miss
_FIELDS = "<4sHH16sB32sQQ"
_FIELDS_SIZE = struct.calcsize(_FIELDS)  # 73; zero up to HEADER_SIZE
HEADER_SIZE = 128
_HEADER = struct.Struct(f"{_FIELDS}{HEADER_SIZE - _FIELDS_SIZE}x")
_ZERO = bytes(HEADER_SIZE - _FIELDS_SIZE)

Buffer = bytes | bytearray | memoryview


SEALED_VERSION = 2  # the version of a frame sealed with a tenant key (seal.py)


class FrameError(Exception):
    """Why a stored blob is not the page asked for (turned into a miss by the store)."""


class PlainCodec:
    """The xxh3 frame: detects damage, not forgery (anyone who can write the store can
    frame any bytes). The codec of a store without a tenant key."""

    keyed = False
    header_size = HEADER_SIZE

    def frame_size(self, payload_length: int) -> int:
        return HEADER_SIZE + payload_length

    def seal(
        self, namespace_id: str, page_hash: bytes, payload: Buffer
    ) -> tuple[bytes, Buffer]:
        """(header, body): what the store writes for this page."""
        return encode_header(namespace_id, page_hash, payload), payload

    def decode(self, blob: Buffer, namespace_id: str, page_hash: bytes) -> memoryview:
        return decode(blob, namespace_id, page_hash)

    def decode_into(
        self, blob: Buffer, namespace_id: str, page_hash: bytes, view: memoryview
    ) -> None:
        """The verified payload of `blob` into `view` (same length); FrameError otherwise,
        `view` then untouched."""
        payload = decode(blob, namespace_id, page_hash)
        if len(payload) != len(view):
            raise FrameError(f"page is {len(payload)} bytes, the buffer {len(view)}")
        view[:] = payload


PLAIN = PlainCodec()


def encode_header(namespace_id: str, page_hash: bytes, payload: Buffer) -> bytes:
    checksum = xxhash.xxh3_64_intdigest(payload)
    return _HEADER.pack(
        MAGIC,
        VERSION,
        0,
        namespace_bytes(namespace_id),
        len(page_hash),
        page_hash.ljust(32, b"\0"),
        len(memoryview(payload).cast("B")),
        checksum,
    )


def header_with(
    namespace_id: str, page_hash: bytes, length: int, checksum: int
) -> bytes:
    return _HEADER.pack(
        MAGIC,
        VERSION,
        0,
        namespace_bytes(namespace_id),
        len(page_hash),
        page_hash.ljust(32, b"\0"),
        length,
        checksum,
    )


class Frame:
    """One page to store: its payload (the caller's buffer), and a header and body (what
    is written after the header) made by its codec on first use.

    The header's checksum (or MAC, or the encryption) is one pass over the payload; a
    store makes it where it is cheapest (in its I/O threads, or while streaming the payload
    of a plain frame: `header_with`). The body is the payload itself, except for an
    encrypted frame. A frame unpacks as `(header, body)` for stores that want both."""

    __slots__ = ("namespace_id", "page_hash", "payload", "codec", "_header", "_body")

    def __init__(
        self, namespace_id: str, page_hash: bytes, payload: memoryview, codec=PLAIN
    ) -> None:
        self.namespace_id, self.page_hash, self.payload, self.codec = (
            namespace_id,
            page_hash,
            payload,
            codec,
        )
        self._header: bytes | None = None
        self._body: Buffer = payload

    @property
    def size(self) -> int:
        return self.codec.frame_size(len(self.payload))

    @property
    def header(self) -> bytes:
        if self._header is None:
            self._header, self._body = self.codec.seal(
                self.namespace_id, self.page_hash, self.payload
            )
        return self._header

    @property
    def body(self) -> Buffer:
        """What follows the header (made with it: ask for the header first or at once)."""
        self.header  # noqa: B018 (decodes the header and sets _body)
        return self._body

    def header_with(self, checksum: int) -> bytes:
        """The plain header for a checksum the caller computed over the payload."""
        assert not self.codec.keyed, (
            "a sealed frame is made by its codec, not from an xxh3 checksum"
        )
        return header_with(
            self.namespace_id, self.page_hash, len(self.payload), checksum
        )

    def __iter__(self):
        yield self.header
        yield self._body


def encode(namespace_id: str, page_hash: bytes, payload: Buffer) -> bytes:
    return encode_header(namespace_id, page_hash, payload) + bytes(payload)


def check_header(
    header: Buffer, namespace_id: str, page_hash: bytes
) -> tuple[int, int]:
    """(payload length, checksum) of a header that names this namespace and page; else FrameError."""
    if len(header) < HEADER_SIZE:
        raise FrameError(_short_header(header))
    magic, version, reserved, ns, hlen, h, length, checksum = _HEADER.unpack_from(
        header
    )
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if version != VERSION:
        raise FrameError(_other_version(version))
    if ns != namespace_bytes(namespace_id):
        raise FrameError(f"namespace {ns.hex()} is not {namespace_id}")
    if h[:hlen] != page_hash or hlen != len(page_hash):
        raise FrameError("page hash in the frame differs from the key's")
    if reserved or header[_FIELDS_SIZE:HEADER_SIZE] != _ZERO:
        raise FrameError("nonzero bytes in the header's reserved part or padding")
    return length, checksum


def _other_version(version: int) -> str:
    if version == SEALED_VERSION:
        return "frame sealed with a tenant key, and this store has no key for it"
    if version == OLD_VERSION:
        return f"frame version {version} (an older kvtier), this build reads {VERSION}"
    return f"frame version {version}, this build reads {VERSION}"


def _short_header(header: Buffer) -> str:
    """Why a header shorter than HEADER_SIZE is none: an older kvtier's frame of a tiny
    page says so, anything else is truncated."""
    prefix = bytes(memoryview(header).cast("B")[:6])
    if len(prefix) == 6 and prefix[:4] == MAGIC:
        version = int.from_bytes(prefix[4:], "little")
        if version != VERSION:
            return _other_version(version)
    return f"truncated header ({len(header)} < {HEADER_SIZE} bytes)"


@functools.lru_cache(maxsize=256)
def namespace_bytes(namespace_id: str) -> bytes:
    """The 16 bytes of a namespace id (a store sees a handful: parsed once each)."""
    return bytes.fromhex(namespace_id)


def check_payload(payload: Buffer, length: int, checksum: int) -> None:
    if len(payload) != length:
        raise FrameError(f"payload is {len(payload)} bytes, the frame says {length}")
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise FrameError("checksum mismatch")


def decode(blob: Buffer, namespace_id: str, page_hash: bytes) -> memoryview:
    """The verified payload of `blob` (a view, no copy); FrameError if it does not verify."""
    view = memoryview(blob)
    length, checksum = check_header(view[:HEADER_SIZE], namespace_id, page_hash)
    payload = view[HEADER_SIZE:]
    check_payload(payload, length, checksum)
    return payload
