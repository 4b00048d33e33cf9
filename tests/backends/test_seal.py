"""Sealed frames and keyed page hashes (docs/formats.md, docs/security.md), byte by byte."""

import hashlib
import hmac
import os
import struct

import numpy as np
import pytest

from kvtier.backends import frame, seal
from kvtier.backends.frame import FrameError
from kvtier.backends.memory import MemoryStore
from kvtier.hashing import KeyedHash, Namespace, page_hashes
from kvtier.tenant_keys import parse_keys
from tests.backends.stores import NS

OLD, NEW = "01" * 32, "02" * 32
H = bytes(range(32))


def codec(spec: str = NEW, encrypt: bool = False) -> seal.SealedCodec:
    return seal.SealedCodec(parse_keys(spec, "test"), encrypt)


@pytest.mark.parametrize("encrypt", [False, True])
def test_sealed_frame_layout_is_the_documented_one(encrypt):
    c, payload = codec(encrypt=encrypt), os.urandom(4096)
    header, body = c.seal(NS, H, payload)
    blob = header + bytes(body)
    assert len(header) == seal.HEADER_SIZE == 128 and len(blob) == c.frame_size(4096)
    magic, version, mode, ns, hlen, h, length, key_id, nonce = struct.unpack_from("<4sHH16sB32sQ8s12s3x", blob)
    key = c.keys.current
    assert (magic, version, ns, hlen, h, length, key_id) == (b"KVTP", 2, bytes.fromhex(NS), 32, H, 4096, key.key_id)
    if not encrypt:  # HMAC-SHA256 over the sealed part and the payload; body = payload
        assert mode == 1 and nonce == bytes(12) and bytes(body) == payload
        assert blob[88:120] == hmac.new(key.mac_key, blob[:88] + payload, hashlib.sha256).digest()
    else:  # AES-256-GCM, a key per page, the sealed part as associated data; ciphertext ‖ tag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        page_key = hashlib.blake2b(bytes.fromhex(NS) + H, key=key.aead_key, digest_size=32).digest()
        assert mode == 2 and blob[88:128] == bytes(40) and payload not in blob
        assert AESGCM(page_key).decrypt(nonce, blob[128:], blob[:88]) == payload
    assert bytes(c.decode(blob, NS, H)) == payload
    assert c.seal(NS, H, payload)[0] != header if encrypt else c.seal(NS, H, payload)[0] == header  # fresh nonces


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize("offset", [0, 4, 6, 8, 24, 25, 57, 65, 73, 86, 88, 119, 124, 140, -1])
def test_any_byte_changed_in_the_sealed_part_or_the_body_is_a_miss(encrypt, offset):
    c = codec(encrypt=encrypt)
    header, body = c.seal(NS, H, os.urandom(4096))
    blob = bytearray(header + bytes(body))
    blob[offset] ^= 0x01
    with pytest.raises(FrameError):
        c.decode(bytes(blob), NS, H)
    with pytest.raises(FrameError):
        c.decode_into(bytes(blob), NS, H, memoryview(bytearray(4096)))


def test_plain_frames_other_keys_and_truncation_are_misses_not_errors():
    c, payload = codec(), os.urandom(4096)
    with pytest.raises(seal.NotSealed):
        c.decode(frame.encode(NS, H, payload), NS, H)  # the downgrade: a plain frame with a good xxh3
    header, body = codec(OLD).seal(NS, H, payload)
    with pytest.raises(seal.ForeignKey, match="sealed with key"):
        c.decode(header + bytes(body), NS, H)
    with pytest.raises(FrameError, match="frame sealed with a tenant key"):
        frame.decode(header + bytes(body), NS, H)  # a store without a key reads none of them
    header, body = c.seal(NS, H, payload)
    for blob in (header[:60], header + bytes(body)[:-1], header + bytes(body) + b"\0"):
        with pytest.raises(FrameError):
            c.decode(blob, NS, H)
    with pytest.raises(FrameError, match="namespace"):
        c.decode(header + bytes(body), "f" * 32, H)
    with pytest.raises(FrameError, match="page hash"):
        c.decode(header + bytes(body), NS, bytes(32))


def test_a_key_ring_seals_with_its_first_key_and_reads_with_all():
    payload = os.urandom(1024)
    old_header, old_body = codec(OLD).seal(NS, H, payload)
    ring = codec(f"{NEW},\n{OLD}")
    assert bytes(ring.decode(old_header + bytes(old_body), NS, H)) == payload
    header, _ = ring.seal(NS, H, payload)
    assert seal.key_id_of(header) == ring.keys.current.key_id == parse_keys(NEW, "t").current.key_id
    assert ring.keys.ids == [parse_keys(NEW, "t").current.key_id.hex(), parse_keys(OLD, "t").current.key_id.hex()]


async def test_a_store_object_serves_one_tenant():
    store, c = MemoryStore(), codec()
    store.seal_with(c)
    store.seal_with(c)  # the same codec again is fine
    with pytest.raises(ValueError, match="already seals pages for another tenant key"):
        store.seal_with(codec(OLD))


def test_keyed_page_hashes_follow_the_spec_and_unkeyed_ones_are_unchanged():
    toks = np.arange(64)
    key = parse_keys(NEW, "t").current
    keyed = KeyedHash(key.hash_key, "sha256", key.key_id.hex())
    chain = page_hashes(toks, 16, NS, None, None, keyed)
    prev, want = b"kvtier/page-hash-chain/v1", []
    for i in range(4):
        data = (b"pv" + struct.pack("<I", len(prev)) + prev + b"ns" + struct.pack("<I", 32) + NS.encode()
                + b"ek" + struct.pack("<I", 1) + b"\0" + b"tk" + struct.pack("<I", 64)
                + toks[16 * i:16 * i + 16].astype("<u4").tobytes())
        prev = hashlib.blake2b(data, digest_size=32, key=key.hash_key).digest()
        want.append(prev)
    assert chain == want and chain != page_hashes(toks, 16, NS)
    other = parse_keys(OLD, "t").current
    assert page_hashes(toks, 16, NS, None, None, KeyedHash(other.hash_key, "sha256", "x")) != chain
    assert len(page_hashes(toks, 16, NS, None, None, KeyedHash(key.hash_key, "xxh3_128", "x"))[0]) == 16
    assert "02" * 8 not in repr(keyed) and key.key_id.hex() in repr(keyed)
    ns = Namespace("m", "float16", "mha", 16)
    assert ns.id == Namespace("m", "float16", "mha", 16, tenant_key_id=None).id  # ids without a key unchanged
    keyed_ns = Namespace("m", "float16", "mha", 16, tenant_key_id=key.key_id.hex())
    assert keyed_ns.id != ns.id and keyed_ns.manifest(1)["tenant_key_id"] == key.key_id.hex()
    assert "tenant_key_id" not in ns.manifest(1)
