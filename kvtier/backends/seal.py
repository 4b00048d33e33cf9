"""Sealed page frames: a tenant key authenticates every page, and may encrypt it.

    magic 'KVTP' | version u16 = 2 | mode u16 | namespace id 16 B | hash len u8 |
    page hash 32 B | payload length u64 | key id 8 B | nonce 12 B | pad 3 B     (88 B, "sealed part")
    | MAC 32 B | pad 8 B                                                         (128 B header)

- mode 1, `mac`: body = the payload; MAC = HMAC-SHA256(mac subkey, sealed part ‖ payload);
  the nonce and the pad are zero.
- mode 2, `aes-256-gcm` (`namespace.encrypt: true`): body = AES-256-GCM ciphertext ‖ its
  16-byte tag, the sealed part as associated data, a random 12-byte nonce, under a key
  derived for this page (keyed BLAKE2b of namespace id ‖ page hash under the aead subkey),
  so nonces need only differ between writes of the same page; the MAC field and pad are
  zero.

A reader with a key ring accepts only sealed frames whose key id it holds and whose MAC
or tag verifies: an unsealed frame, one of another key, or one that does not authenticate
is a miss, counted with the checksum failures. docs/formats.md has the byte layout,
docs/security.md what it protects.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.backends.frame import MAGIC, SEALED_VERSION, VERSION, Buffer, FrameError
from kvtier.tenant_keys import TenantKey, TenantKeys

MODE_MAC, MODE_AEAD = 1, 2
MODES = {MODE_MAC: "hmac-sha256", MODE_AEAD: "aes-256-gcm"}
_SEALED = struct.Struct("<4sHH16sB32sQ8s12s3x")
SEALED_PART = _SEALED.size  # 88
HEADER_SIZE = 128
TAG_SIZE = 16
_ZERO_NONCE = bytes(12)
_PAD = bytes(HEADER_SIZE - SEALED_PART - 32)


class NotSealed(FrameError):
    """A plain (xxh3) frame where a sealed one was required."""


class ForeignKey(FrameError):
    """A frame sealed with a key this reader does not hold."""


def _page_aead(key: TenantKey, ns: bytes, page_hash: bytes) -> AESGCM:
    return AESGCM(hashlib.blake2b(ns + page_hash, key=key.aead_key, digest_size=32).digest())


def _mac(key: TenantKey, sealed: Buffer, payload: Buffer) -> bytes:
    m = hmac.new(key.mac_key, sealed, hashlib.sha256)
    m.update(payload)
    return m.digest()


def key_id_of(blob: Buffer) -> bytes | None:
    """The key id a sealed frame names (unauthenticated: what the frame claims); None for
    anything else."""
    view = memoryview(blob)
    if len(view) < HEADER_SIZE:
        return None
    magic, version, *_rest, key_id, _ = _SEALED.unpack_from(view)
    return key_id if magic == MAGIC and version == SEALED_VERSION else None


class SealedCodec:
    """Frames sealed with the ring's current key; reads any key of the ring. Thread-safe:
    it keeps no state per call."""

    keyed = True
    header_size = HEADER_SIZE

    def __init__(self, keys: TenantKeys, encrypt: bool = False) -> None:
        self.keys, self.encrypt = keys, encrypt
        self.mode = MODE_AEAD if encrypt else MODE_MAC

    def __repr__(self) -> str:
        return f"SealedCodec({MODES[self.mode]}, keys={self.keys.ids})"

    def frame_size(self, payload_length: int) -> int:
        return HEADER_SIZE + payload_length + (TAG_SIZE if self.encrypt else 0)

    def seal(self, namespace_id: str, page_hash: bytes, payload: Buffer) -> tuple[bytes, Buffer]:
        key, ns = self.keys.current, bytes.fromhex(namespace_id)
        length = len(memoryview(payload).cast("B"))
        nonce = os.urandom(12) if self.encrypt else _ZERO_NONCE
        sealed = _SEALED.pack(MAGIC, SEALED_VERSION, self.mode, ns, len(page_hash), page_hash.ljust(32, b"\0"),
                              length, key.key_id, nonce)
        if not self.encrypt:
            return sealed + _mac(key, sealed, payload) + _PAD, payload
        body = bytearray(length + TAG_SIZE)
        _page_aead(key, ns, page_hash).encrypt_into(nonce, payload, sealed, body)
        return sealed + bytes(32) + _PAD, body

    def _open(self, blob: Buffer, namespace_id: str, page_hash: bytes):
        """(key, mode, ns bytes, nonce, sealed part, body) of a frame that names this page
        and a key of the ring; FrameError otherwise (before any MAC or decryption)."""
        view = memoryview(blob).cast("B")
        if len(view) < HEADER_SIZE:
            raise FrameError(f"truncated header ({len(view)} < {HEADER_SIZE} bytes)")
        magic, version, mode, ns, hlen, h, length, key_id, nonce = _SEALED.unpack_from(view)
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic!r}")
        if version == VERSION:
            raise NotSealed("frame not sealed (a plain xxh3 frame): this tenant reads only frames sealed with its key")
        if version != SEALED_VERSION or mode not in MODES:
            raise FrameError(f"frame version {version} mode {mode}, this build reads version {SEALED_VERSION} "
                             f"modes {', '.join(map(str, MODES))}")
        key = self.keys.by_id.get(key_id)
        if key is None:
            raise ForeignKey(f"sealed with key {key_id.hex()}, which is not one of this tenant's keys")
        if ns != bytes.fromhex(namespace_id):
            raise FrameError(f"namespace {ns.hex()} is not {namespace_id}")
        if h[:hlen] != page_hash or hlen != len(page_hash):
            raise FrameError("page hash in the frame differs from the key's")
        unused = SEALED_PART + (32 if mode == MODE_MAC else 0)  # the rest of the header is zero
        if view[unused:HEADER_SIZE] != bytes(HEADER_SIZE - unused):
            raise FrameError("nonzero bytes in the header's unused part")
        body = view[HEADER_SIZE:]
        want = length + (TAG_SIZE if mode == MODE_AEAD else 0)
        if len(body) != want:
            raise FrameError(f"body is {len(body)} bytes, the frame says {want}")
        return key, mode, ns, nonce, view[:SEALED_PART], view[SEALED_PART:SEALED_PART + 32], body

    def decode(self, blob: Buffer, namespace_id: str, page_hash: bytes) -> memoryview:
        key, mode, ns, nonce, sealed, mac, body = self._open(blob, namespace_id, page_hash)
        if mode == MODE_MAC:
            _check_mac(key, sealed, mac, body)
            return body
        out = bytearray(len(body) - TAG_SIZE)
        _decrypt(key, ns, page_hash, nonce, sealed, body, out)
        return memoryview(out)

    def decode_into(self, blob: Buffer, namespace_id: str, page_hash: bytes, view: memoryview) -> None:
        """The authenticated payload into `view`; FrameError otherwise (an encrypted page's
        `view` may then hold garbage, which the caller must not use)."""
        key, mode, ns, nonce, sealed, mac, body = self._open(blob, namespace_id, page_hash)
        length = len(body) - (TAG_SIZE if mode == MODE_AEAD else 0)
        if length != len(view):
            raise FrameError(f"page is {length} bytes, the buffer {len(view)}")
        if mode == MODE_MAC:
            _check_mac(key, sealed, mac, body)
            view[:] = body
            return
        _decrypt(key, ns, page_hash, nonce, sealed, body, view)


def _check_mac(key: TenantKey, sealed: Buffer, mac: Buffer, body: Buffer) -> None:
    if not hmac.compare_digest(_mac(key, sealed, body), mac):
        raise FrameError("MAC mismatch: not sealed with this tenant's key, or altered since")


def _decrypt(key: TenantKey, ns: bytes, page_hash: bytes, nonce: bytes, sealed: Buffer, body: Buffer, out) -> None:
    try:
        _page_aead(key, ns, page_hash).decrypt_into(nonce, body, sealed, out)
    except InvalidTag:
        raise FrameError("AES-GCM tag mismatch: not sealed with this tenant's key, or altered since") from None
