"""Sealed page frames: a tenant key authenticates every page, and may encrypt it.

    magic 'KVTP' | version u16 = 2 | mode u16 | namespace id 16 B | hash len u8 |
    page hash 32 B | payload length u64 | key id 8 B | nonce 12 B | zero 3 B   (88 B, "sealed part")
    | tag 16 B (mode 1) or zero | zero 24 B                                    (128 B header)

Every write draws a random nonce, and seals under its own AES-256 key: keyed BLAKE2b-256 of
the whole sealed part under the mode's subkey. So any change to the sealed part (namespace,
page hash, length, key id, nonce, mode) gives another key and the tag fails, and no two
writes share a key, so nonces never need counting.

- mode 1, `aes-256-gmac` (the default): body = the payload; tag = AES-256-GCM with no
  plaintext and the payload as associated data (GMAC). HMAC-SHA256 measured 0.5-0.7 GB/s
  here, 10-20x this (docs/security.md).
- mode 2, `aes-256-gcm` (`namespace.encrypt: true`): body = AES-256-GCM ciphertext of the
  payload ‖ its 16-byte tag, the sealed part as associated data.

A reader with a key ring accepts only sealed frames whose key id it holds and whose tag
verifies: an unsealed frame, one of another key, or one that does not authenticate is a
miss, counted with the checksum failures. docs/formats.md has the byte layout,
docs/security.md what it protects.
"""

from __future__ import annotations

import functools
import os
import struct
from typing import NamedTuple
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.backends.frame import HEADER_SIZE as PLAIN_HEADER_SIZE
from kvtier.backends.frame import (
    MAGIC,
    OLD_VERSION,
    SEALED_VERSION,
    VERSION,
    Buffer,
    FrameError,
)
from kvtier.tenant_keys import TenantKeys

MODE_MAC, MODE_AEAD = 1, 2
MODES = {MODE_MAC: "aes-256-gmac", MODE_AEAD: "aes-256-gcm"}
_SEALED = struct.Struct("<4sHH16sB32sQ8s12s3x")
SEALED_PART = _SEALED.size  # 88
HEADER_SIZE = 128
TAG_SIZE = 16
# the header's unused tail past the sealed part (and mode 1's tag), which must be zero
_UNUSED = {
    MODE_MAC: bytes(HEADER_SIZE - SEALED_PART - TAG_SIZE),
    MODE_AEAD: bytes(HEADER_SIZE - SEALED_PART),
}


# a header's sealed part, its tag slot and the rest, as bytes
_PARTS = struct.Struct(
    f"{SEALED_PART}s{TAG_SIZE}s{HEADER_SIZE - SEALED_PART - TAG_SIZE}s"
)

_PREFIX = struct.Struct(
    "<4sHH16sB32sQ"
)  # what plain and sealed headers share: up to the payload length


# where the key id and the nonce lie in the sealed part
_KEY_ID = slice(SEALED_PART - 23, SEALED_PART - 15)
_NONCE = slice(SEALED_PART - 15, SEALED_PART - 3)
_MAC_MISMATCH = "MAC mismatch: not sealed with this tenant's key, or altered since"


def frame_bound(header: Buffer) -> int | None:
    """At most how many bytes follow the first `frame.HEADER_SIZE` bytes of a plain or
    sealed frame that starts with `header`, as its header claims (unverified: a bound for a
    read, which decoding then checks); None if `header` starts no frame."""
    view = memoryview(header).cast("B")
    if len(view) < _PREFIX.size:
        return None
    magic, version, *_rest, length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        return None
    if version == VERSION:
        return length
    if version == SEALED_VERSION:
        return HEADER_SIZE - PLAIN_HEADER_SIZE + length + TAG_SIZE
    return None


class NotSealed(FrameError):
    """A plain (xxh3) frame where a sealed one was required."""


class ForeignKey(FrameError):
    """A frame sealed with a key this reader does not hold."""


class Opened(NamedTuple):
    """A sealed header that names the page asked for and a key of the ring."""

    cipher: AESGCM  # under this write's key
    mode: int
    nonce: bytes
    sealed: bytes  # the sealed part
    tag: bytes  # mode 1's tag (zero in mode 2)
    length: int  # the payload's

    @property
    def body_size(self) -> int:
        return self.length + (TAG_SIZE if self.mode == MODE_AEAD else 0)


def key_id_of(blob: Buffer) -> bytes | None:
    """The key id a sealed frame names (unauthenticated: what the frame claims); None for
    anything else."""
    view = memoryview(blob)
    if len(view) < HEADER_SIZE:
        return None
    magic, version, *_rest, key_id, _ = _SEALED.unpack_from(view)
    return key_id if magic == MAGIC and version == SEALED_VERSION else None


# how many frames' key objects a codec keeps for pages read again (`SealedCodec._opened`;
# an AES-GCM object holds about 2.4 KB: two cipher contexts)
OPENED_KEYS = 1024


class SealedCodec:
    """Frames sealed with the ring's current key; reads any key of the ring. Thread-safe:
    it keeps no state per call, only the key objects of frames it opened (`_cipher`)."""

    keyed = True
    header_size = HEADER_SIZE

    def __init__(self, keys: TenantKeys, encrypt: bool = False) -> None:
        self.keys, self.encrypt = keys, encrypt
        self.mode = MODE_AEAD if encrypt else MODE_MAC
        # the AES-GCM objects of frames opened lately, by sealed part, which names the key
        # id and the mode: with this codec's ring (fixed for its life, a rotation makes
        # another codec) it determines the frame's key. Bounded: emptied when full.
        self._opened: dict[bytes, AESGCM] = {}

    def __getstate__(self) -> dict:  # a copy or pickle leaves the kept key objects out
        return {k: v for k, v in self.__dict__.items() if k != "_opened"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._opened = {}

    def __repr__(self) -> str:
        return f"SealedCodec({MODES[self.mode]}, keys={self.keys.ids})"

    def frame_size(self, payload_length: int) -> int:
        return HEADER_SIZE + payload_length + (TAG_SIZE if self.encrypt else 0)

    def seal(
        self, namespace_id: str, page_hash: bytes, payload: Buffer
    ) -> tuple[bytes, Buffer]:
        """(header, body) of one page: the body is `payload` itself (its tag is over these
        very bytes, no copy made) or, encrypted, its ciphertext and tag."""
        key, length = self.keys.current, memoryview(payload).nbytes
        nonce = os.urandom(12)
        sealed = _SEALED.pack(  # "32s" pads the page hash with zeros
            MAGIC,
            SEALED_VERSION,
            self.mode,
            _namespace_bytes(namespace_id),
            len(page_hash),
            page_hash,
            length,
            key.key_id,
            nonce,
        )
        cipher = AESGCM(key.frame_key(self.encrypt, sealed))
        if not self.encrypt:
            return sealed + cipher.encrypt(nonce, b"", payload) + _UNUSED[
                MODE_MAC
            ], payload
        body = bytearray(length + TAG_SIZE)
        cipher.encrypt_into(nonce, payload, sealed, body)
        return sealed + _UNUSED[MODE_AEAD], body

    def open_header(
        self, header: Buffer, namespace_id: str, page_hash: bytes
    ) -> Opened:
        """What a sealed header says, checked against the page asked for; FrameError if it
        is not a sealed header for it under a key of the ring (before any tag is checked)."""
        view = (
            header
            if isinstance(header, (bytes, bytearray))
            else memoryview(header).cast("B")
        )
        if len(view) < HEADER_SIZE:
            raise FrameError(f"truncated header ({len(view)} < {HEADER_SIZE} bytes)")
        magic, version, mode, ns, hlen, h, length, key_id, nonce = _SEALED.unpack_from(
            view
        )
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic!r}")
        if version in (VERSION, OLD_VERSION):
            raise NotSealed(
                "frame not sealed (a plain xxh3 frame): this tenant reads only frames sealed with its key"
            )
        if version != SEALED_VERSION or mode not in MODES:
            raise FrameError(
                f"frame version {version} mode {mode}, this build reads version {SEALED_VERSION} "
                f"modes {', '.join(map(str, MODES))}"
            )
        key = self.keys.by_id.get(key_id)
        if key is None:
            raise ForeignKey(
                f"sealed with key {key_id.hex()}, which is not one of this tenant's keys"
            )
        if ns != _namespace_bytes(namespace_id):
            raise FrameError(f"namespace {ns.hex()} is not {namespace_id}")
        if h[:hlen] != page_hash or hlen != len(page_hash):
            raise FrameError("page hash in the frame differs from the key's")
        sealed, tag, rest = _PARTS.unpack_from(view)
        if (rest if mode == MODE_MAC else tag + rest) != _UNUSED[mode]:
            raise FrameError("nonzero bytes in the header's unused part")
        return Opened(self._cipher(key, mode, sealed), mode, nonce, sealed, tag, length)

    def _cipher(self, key, mode: int, sealed: bytes) -> AESGCM:
        """The key object of the frame whose sealed part is `sealed`, under `key` (the
        ring's key of the id it names): derived once, kept for a page read again (a tag is
        checked on every read all the same)."""
        cipher = self._opened.get(sealed)
        if cipher is None:
            cipher = AESGCM(key.frame_key(mode == MODE_AEAD, sealed))
            if len(self._opened) >= OPENED_KEYS:
                self._opened.clear()
            self._opened[sealed] = cipher
        return cipher

    def check_as_written(
        self, header: bytearray, namespace_id: str, page_hash: bytes, view: memoryview
    ) -> bool:
        """An authenticated page checked in few Python steps (on two cores, what a page
        costs in Python is what sealed loads of 256 KiB pages are slow by): True if
        `header` is byte for byte what `seal` writes for this page (mode 1, this length, a
        zero tail), under a key of the ring, and its tag verifies `view`; FrameError if the
        tag does not; False for anything else, which `open_header` then checks and names
        (a page hash longer than its room in the header among them: `seal` cut it, so the
        header never matches)."""
        expected = _PREFIX.pack(
            MAGIC,
            SEALED_VERSION,
            MODE_MAC,
            _namespace_bytes(namespace_id),
            len(page_hash),
            page_hash,
            len(view),
        )
        if not (header.startswith(expected) and header.endswith(_UNUSED[MODE_MAC])):
            return False
        sealed = bytes(header[:SEALED_PART])
        key = self.keys.by_id.get(sealed[_KEY_ID])
        if key is None:  # not a key of the ring (asked before any kept key object)
            return False
        cipher = self._opened.get(sealed) or self._cipher(key, MODE_MAC, sealed)
        tag = bytes(header[SEALED_PART : SEALED_PART + TAG_SIZE])
        try:
            cipher.decrypt(sealed[_NONCE], tag, view)
        except InvalidTag:
            raise FrameError(_MAC_MISMATCH) from None
        return True

    def decode(self, blob: Buffer, namespace_id: str, page_hash: bytes) -> memoryview:
        view = memoryview(blob).cast("B")
        opened = self.open_header(view[:HEADER_SIZE], namespace_id, page_hash)
        body = _body(view, opened)
        if opened.mode == MODE_MAC:
            check_tag(opened, body)
            return body
        out = bytearray(opened.length)
        decrypt(opened, body, out)
        return memoryview(out)

    def decode_into(
        self, blob: Buffer, namespace_id: str, page_hash: bytes, view: memoryview
    ) -> None:
        """The authenticated payload into `view`; FrameError otherwise (an encrypted page's
        `view` may then hold garbage, which the caller must not use)."""
        whole = memoryview(blob).cast("B")
        opened = self.open_header(whole[:HEADER_SIZE], namespace_id, page_hash)
        if opened.length != len(view):
            raise FrameError(f"page is {opened.length} bytes, the buffer {len(view)}")
        body = _body(whole, opened)
        if opened.mode == MODE_MAC:
            check_tag(opened, body)
            view[:] = body
            return
        decrypt(opened, body, view)

    def read_into(
        self,
        read: Callable[[list, int], int],
        namespace_id: str,
        page_hash: bytes,
        view: memoryview,
        scratch: Callable[[int], memoryview],
        spare: tuple[bytearray, bytearray] | None = None,
    ) -> None:
        """A frame read in one go (the file store): `read(buffers, want)` fills the header,
        the body and a byte more into buffers from the frame's start, at least `want` bytes
        unless the file ends first, and says how many bytes it read. The body goes where
        this codec's own mode wants it: an authenticated one straight into `view`, checked
        there; an encrypted one into `scratch(n)` (a buffer of at least n bytes), decrypted
        into `view`; a frame of the other mode is moved over first. The header and the byte
        more go into `spare` (`HEADER_SIZE` and `TAG_SIZE + 1` bytes), a job's own, or into
        new buffers. FrameError if it does not authenticate (`view` may then hold garbage)."""
        size = len(view)
        header, tail = spare or (bytearray(HEADER_SIZE), bytearray(TAG_SIZE + 1))
        body = None
        if self.encrypt:
            body = scratch(size + TAG_SIZE + 1)[: size + TAG_SIZE + 1]
            n = read([header, body], HEADER_SIZE + size + TAG_SIZE) - HEADER_SIZE
        else:
            n = read([header, view, tail], HEADER_SIZE + size) - HEADER_SIZE
            if n == size and self.check_as_written(
                header, namespace_id, page_hash, view
            ):
                return
        opened = self.open_header(
            header if n >= 0 else header[: HEADER_SIZE + n], namespace_id, page_hash
        )
        if opened.length != size:
            raise FrameError(f"page is {opened.length} bytes, the buffer {size}")
        _check_length(n, opened)
        if opened.mode == MODE_MAC:
            if body is not None:
                view[:] = body[:size]
            check_tag(opened, view)
            return
        if (
            body is None
        ):  # ciphertext in `view`, its tag in `tail`: together, as AES-GCM takes them
            body = scratch(opened.body_size)
            body[:size], body[size : opened.body_size] = view, tail[:TAG_SIZE]
        decrypt(opened, body[: opened.body_size], view)


@functools.lru_cache(maxsize=256)
def _namespace_bytes(namespace_id: str) -> bytes:
    """The 16 bytes of a namespace id (a store sees a handful: parsed once each)."""
    return bytes.fromhex(namespace_id)


def _body(view: memoryview, opened: Opened) -> memoryview:
    body = view[HEADER_SIZE:]
    _check_length(len(body), opened)
    return body


def _check_length(n: int, opened: Opened) -> None:
    if n != opened.body_size:
        raise FrameError(f"body is {n} bytes, the frame says {opened.body_size}")


def check_tag(opened: Opened, payload: Buffer) -> None:
    try:
        opened.cipher.decrypt(opened.nonce, opened.tag, payload)
    except InvalidTag:
        raise FrameError(_MAC_MISMATCH) from None


def decrypt(opened: Opened, body: Buffer, out) -> None:
    try:
        opened.cipher.decrypt_into(opened.nonce, body, opened.sealed, out)
    except InvalidTag:
        raise FrameError(
            "AES-GCM tag mismatch: not sealed with this tenant's key, or altered since"
        ) from None
