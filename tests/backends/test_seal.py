"""Sealed frames and keyed page hashes (docs/formats.md, docs/security.md), byte by byte."""

import copy
import hashlib
import os
import pickle
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.backends import frame, seal
from kvtier.backends.frame import FrameError
from kvtier.backends.memory import MemoryStore
from kvtier.hashing import KeyedHash, Namespace, page_hashes
from kvtier.tenant_keys import parse_keys
from tests.backends.stores import NS, version_1_frame

OLD, NEW = "01" * 32, "02" * 32
H = bytes(range(32))


def codec(spec: str = NEW, encrypt: bool = False) -> seal.SealedCodec:
    return seal.SealedCodec(parse_keys(spec, "test"), encrypt)


def read_into(
    c: seal.SealedCodec, blob: bytes, out: memoryview, h: bytes = H, spare=None
) -> None:
    """`c.read_into` as the file store calls it: one readv of the file `blob` into the
    buffers it gives, a job's spare header and byte among them (`spare`: one a job
    reads earlier pages into too)."""

    def read(bufs, want):
        got = 0
        for b in bufs:
            b = memoryview(b).cast("B")
            n = min(len(b), len(blob) - got)
            b[:n] = blob[got : got + n]
            got += n
        return got

    spare = spare or (bytearray(seal.HEADER_SIZE), bytearray(seal.TAG_SIZE + 1))
    c.read_into(read, NS, h, out, lambda n: memoryview(bytearray(n)), spare)


@pytest.mark.parametrize("encrypt", [False, True])
def test_sealed_frame_layout_is_the_documented_one(encrypt):
    c, payload = codec(encrypt=encrypt), os.urandom(4096)
    header, body = c.seal(NS, H, payload)
    blob = header + bytes(body)
    assert len(header) == seal.HEADER_SIZE == 128 and len(blob) == c.frame_size(4096)
    magic, version, mode, ns, hlen, h, length, key_id, nonce = struct.unpack_from(
        "<4sHH16sB32sQ8s12s3x", blob
    )
    key = c.keys.current
    assert (magic, version, ns, hlen, h, length, key_id) == (
        b"KVTP",
        2,
        bytes.fromhex(NS),
        32,
        H,
        4096,
        key.key_id,
    )
    write_key = hashlib.blake2b(
        blob[:88], key=key.aead_key if encrypt else key.mac_key, digest_size=32
    ).digest()  # a key per write, from the whole sealed part
    if (
        not encrypt
    ):  # GMAC (AES-256-GCM without plaintext) of the payload; body = payload
        assert mode == 1 and bytes(body) == payload and blob[104:128] == bytes(24)
        assert AESGCM(write_key).encrypt(nonce, b"", payload) == blob[88:104]
    else:  # AES-256-GCM, the sealed part as associated data; ciphertext ‖ tag
        assert mode == 2 and blob[88:128] == bytes(40) and payload not in blob
        assert AESGCM(write_key).decrypt(nonce, blob[128:], blob[:88]) == payload
    assert bytes(c.decode(blob, NS, H)) == payload
    assert c.seal(NS, H, payload)[0] != header  # a fresh nonce every time


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize(
    "offset", [0, 4, 6, 8, 24, 25, 57, 65, 73, 86, 88, 103, 104, 119, 124, 140, -1]
)
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
        c.decode(
            frame.encode(NS, H, payload), NS, H
        )  # the downgrade: a plain frame with a good xxh3
    with pytest.raises(seal.NotSealed):  # an older kvtier's plain frame, too
        c.decode(version_1_frame(NS, H, payload), NS, H)
    header, body = codec(OLD).seal(NS, H, payload)
    with pytest.raises(seal.ForeignKey, match="sealed with key"):
        c.decode(header + bytes(body), NS, H)
    with pytest.raises(FrameError, match="frame sealed with a tenant key"):
        frame.decode(
            header + bytes(body), NS, H
        )  # a store without a key reads none of them
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
    assert (
        seal.key_id_of(header)
        == ring.keys.current.key_id
        == parse_keys(NEW, "t").current.key_id
    )
    assert ring.keys.ids == [
        parse_keys(NEW, "t").current.key_id.hex(),
        parse_keys(OLD, "t").current.key_id.hex(),
    ]


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
        data = (
            b"pv"
            + struct.pack("<I", len(prev))
            + prev
            + b"ns"
            + struct.pack("<I", 32)
            + NS.encode()
            + b"ek"
            + struct.pack("<I", 1)
            + b"\0"
            + b"tk"
            + struct.pack("<I", 64)
            + toks[16 * i : 16 * i + 16].astype("<u4").tobytes()
        )
        prev = hashlib.blake2b(data, digest_size=32, key=key.hash_key).digest()
        want.append(prev)
    assert chain == want and chain != page_hashes(toks, 16, NS)
    other = parse_keys(OLD, "t").current
    assert (
        page_hashes(toks, 16, NS, None, None, KeyedHash(other.hash_key, "sha256", "x"))
        != chain
    )
    assert (
        len(
            page_hashes(
                toks, 16, NS, None, None, KeyedHash(key.hash_key, "xxh3_128", "x")
            )[0]
        )
        == 16
    )
    assert "02" * 8 not in repr(keyed) and key.key_id.hex() in repr(keyed)
    ns = Namespace("m", "float16", "mha", 16)
    assert (
        ns.id == Namespace("m", "float16", "mha", 16, tenant_key_id=None).id
    )  # ids without a key unchanged
    keyed_ns = Namespace("m", "float16", "mha", 16, tenant_key_id=key.key_id.hex())
    assert (
        keyed_ns.id != ns.id
        and keyed_ns.manifest(1)["tenant_key_id"] == key.key_id.hex()
    )
    assert "tenant_key_id" not in ns.manifest(1)


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize(
    "damage",
    [
        "none",
        "flip_first",
        "flip_last",
        "one_byte_short",
        "one_byte_more",
        "header_only",
        "empty",
    ],
)
async def test_the_file_stores_piecewise_sealed_read_misses_every_damage(
    tmp_path, encrypt, damage
):
    """The file store reads a sealed page header first, then the body into the caller's
    buffer (authenticated) or its thread's scratch buffer (encrypted)."""
    from kvtier.backends.file import FileStore, FileStoreConfig
    from tests.backends.stores import new_key

    store = FileStore(FileStoreConfig(root=str(tmp_path)))
    store.seal_with(codec(encrypt=encrypt))
    k, payload = new_key(), os.urandom((2 << 20) + 4096)
    assert await store.batch_set([k], [payload]) == [True]
    path = store.path(k)
    blob = bytearray(path.read_bytes())
    blob = {
        "flip_first": lambda b: b[:128] + bytes([b[128] ^ 1]) + b[129:],
        "flip_last": lambda b: b[:-1] + bytes([b[-1] ^ 1]),
        "one_byte_short": lambda b: b[:-1],
        "one_byte_more": lambda b: b + b"\0",
        "header_only": lambda b: b[:128],
        "empty": lambda b: b"",
    }.get(damage, lambda b: b)(blob)
    path.write_bytes(bytes(blob))
    buf = bytearray(len(payload))
    assert await store.batch_get_into([k], [buf]) == [damage == "none"]
    assert (
        (bytes(buf) == payload)
        if damage == "none"
        else store.stats()["frame_failures"] == 1
    )
    await store.close()


@pytest.mark.parametrize("written_encrypted", [False, True])
async def test_the_file_store_reads_pages_of_the_other_mode(
    tmp_path, written_encrypted
):
    """`encrypt` switched on (or off) with the same key: the pages sealed before still
    read, though the file store lays out its read for its own mode."""
    from kvtier.backends.file import FileStore, FileStoreConfig
    from tests.backends.stores import new_key

    cfg = FileStoreConfig(root=str(tmp_path))
    writer, reader = FileStore(cfg), FileStore(cfg)
    writer.seal_with(codec(encrypt=written_encrypted))
    reader.seal_with(codec(encrypt=not written_encrypted))
    keys, pages = [new_key(), new_key()], [os.urandom(4096), os.urandom(3 << 20)]
    assert await writer.batch_set(keys, pages) == [True, True]
    bufs = [bytearray(len(p)) for p in pages]
    assert await reader.batch_get_into(keys, bufs) == [True, True] and bufs == pages
    path = reader.path(keys[0])
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))
    assert await reader.batch_get_into(keys[:1], [bytearray(4096)]) == [False]
    for s in (writer, reader):
        await s.close()


# Frames sealed by the build before the frame subkeys' keyed states were kept per key:
# key "02" * 32, namespace NS, page hash H, payload bytes(range(48)); mode 1, then mode 2.
EARLIER_FRAMES = {
    False: (
        "4b565450020001000123456789abcdef0123456789abcdef20000102030405060708090a0b0c"
        "0d0e0f101112131415161718191a1b1c1d1e1f3000000000000000e65d2680f7db1c3ca5c2df"
        "5be805f63cd63e886c0000003404451f99284491b377af6c907ce4d700000000000000000000"
        "0000000000000000000000000000000102030405060708090a0b0c0d0e0f1011121314151617"
        "18191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f"
    ),
    True: (
        "4b565450020002000123456789abcdef0123456789abcdef20000102030405060708090a0b0c"
        "0d0e0f101112131415161718191a1b1c1d1e1f3000000000000000e65d2680f7db1c3c5d22d8"
        "87e4fd063e33fab4570000000000000000000000000000000000000000000000000000000000"
        "00000000000000000000000000008fddcd77a79175aecb8d5754c780fd46854968676a30df15"
        "5cffdcc42260a2a681246568b8e12d6147a01958745a39468e830034acf896f441444657d29c"
        "5b83"
    ),
}


@pytest.mark.parametrize("written_encrypted", [False, True])
@pytest.mark.parametrize("encrypt", [False, True])
def test_frames_sealed_by_an_earlier_build_still_open_and_still_fail_when_altered(
    written_encrypted, encrypt
):
    blob = bytes.fromhex(EARLIER_FRAMES[written_encrypted])
    c, payload = codec(encrypt=encrypt), bytes(range(48))
    assert bytes(c.decode(blob, NS, H)) == payload
    out = memoryview(bytearray(48))
    c.decode_into(blob, NS, H, out)
    assert bytes(out) == payload

    out = memoryview(bytearray(48))
    read_into(c, blob, out)
    assert bytes(out) == payload
    for offset in (8, 30, 80, 90, 110, 128, len(blob) - 1):
        bad = bytearray(blob)
        bad[offset] ^= 0x01
        with pytest.raises(FrameError):
            c.decode(bytes(bad), NS, H)
    with pytest.raises(seal.ForeignKey):
        codec(OLD, encrypt).decode(blob, NS, H)


@pytest.mark.parametrize("encrypted", [False, True])
def test_a_keys_frame_key_state_is_copied_per_frame_never_advanced(encrypted):
    """The keyed BLAKE2b state a tenant key keeps for its frame subkeys is copied for each
    frame: every frame key is the spec's keyed hash of its own sealed part alone, however
    many frames came before it, from any number of threads."""
    from concurrent.futures import ThreadPoolExecutor

    key = parse_keys(NEW, "t").current
    subkey = key.aead_key if encrypted else key.mac_key
    parts = [os.urandom(seal.SEALED_PART) for _ in range(400)]
    want = [hashlib.blake2b(p, key=subkey, digest_size=32).digest() for p in parts]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: key.frame_key(encrypted, p), parts))
    assert got == want
    assert key.frame_key(encrypted, parts[0]) == want[0]
    assert key.frame_key(not encrypted, parts[0]) != want[0]
    for copied in (copy.deepcopy(key), pickle.loads(pickle.dumps(key))):
        assert (
            copied.key_id == key.key_id
            and copied.frame_key(encrypted, parts[1]) == want[1]
        )


def test_a_retired_key_opens_nothing_once_the_ring_drops_it_though_its_state_was_used():
    """A key's frame state lives on the key itself, found only through a ring that holds
    it: the ring a cache reads with after a rotation (`current_only`, the same key objects)
    refuses what the retired key sealed at once, though that key opened frames in this
    process a moment before; and another tenant's ring opens none of it."""
    payload = os.urandom(4096)
    header, body = codec(OLD).seal(NS, H, payload)
    blob = header + bytes(body)
    ring = codec(f"{NEW},{OLD}")
    assert bytes(ring.decode(blob, NS, H)) == payload
    rotated = seal.SealedCodec(ring.keys.current_only())
    assert rotated.keys.current is ring.keys.current
    with pytest.raises(seal.ForeignKey):
        rotated.decode(blob, NS, H)
    with pytest.raises(seal.ForeignKey):
        codec("03" * 32).decode(blob, NS, H)
    assert bytes(ring.decode(blob, NS, H)) == payload


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_page_read_again_reuses_its_frame_key_and_is_still_checked_every_time(
    encrypt, monkeypatch
):
    """A codec keeps the key objects of the frames it opened (a page promoted again skips
    deriving its key), at most `OPENED_KEYS` of them; a kept key never spares a read its
    tag check: the same frame altered afterwards in its body or tag fails, and one whose
    sealed part is altered is another frame, of another key."""
    monkeypatch.setattr(seal, "OPENED_KEYS", 3)
    c, payload = codec(encrypt=encrypt), os.urandom(4096)
    header, body = c.seal(NS, H, payload)
    blob = header + bytes(body)
    assert c._opened == {}  # a write's key is never read again: not kept
    assert bytes(c.decode(blob, NS, H)) == payload
    kept = dict(c._opened)
    assert list(kept) == [blob[: seal.SEALED_PART]]
    assert bytes(c.decode(blob, NS, H)) == payload and c._opened == kept
    for offset in (60, 90, 100, 128, len(blob) - 1):
        bad = bytearray(blob)
        bad[offset] ^= 0x01
        with pytest.raises(FrameError):
            c.decode(bytes(bad), NS, H)
    assert all(v is kept[k] for k, v in c._opened.items() if k in kept)
    for _ in range(10):
        header, body = c.seal(NS, H, payload)
        assert bytes(c.decode(header + bytes(body), NS, H)) == payload
        assert 1 <= len(c._opened) <= 3


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_kept_frame_key_opens_nothing_once_its_codecs_ring_no_longer_holds_the_key(
    encrypt,
):
    """The ring is asked before the kept key objects: a frame this very codec opened a
    moment ago (its key object kept) is refused as soon as the ring stops holding its key
    id, and opens again once the ring holds it again."""
    c, payload = codec(f"{NEW},{OLD}", encrypt), os.urandom(4096)
    header, body = codec(OLD, encrypt).seal(NS, H, payload)
    blob = header + bytes(body)
    assert bytes(c.decode(blob, NS, H)) == payload
    assert blob[: seal.SEALED_PART] in c._opened
    read_into(c, blob, memoryview(bytearray(len(payload))))  # the kept key's read
    old = c.keys.keys[1]
    del c.keys.by_id[old.key_id]
    for read in (
        lambda: c.decode(blob, NS, H),
        lambda: c.decode_into(blob, NS, H, memoryview(bytearray(len(payload)))),
        lambda: read_into(c, blob, memoryview(bytearray(len(payload)))),
    ):
        with pytest.raises(seal.ForeignKey):
            read()
    c.keys.by_id[old.key_id] = old
    assert bytes(c.decode(blob, NS, H)) == payload


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_codec_that_opened_frames_still_copies_and_pickles(encrypt):
    """A codec's kept key objects (AES-GCM objects, which cannot be pickled) stay out of a
    copy or pickle of it, as a codec copied and pickled before it kept any: the copy
    starts with none kept and opens the same frames."""
    c, payload = codec(encrypt=encrypt), os.urandom(4096)
    header, body = c.seal(NS, H, payload)
    blob = header + bytes(body)
    assert bytes(c.decode(blob, NS, H)) == payload and c._opened
    for copied in (copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
        assert copied._opened == {} and copied.mode == c.mode
        assert bytes(copied.decode(blob, NS, H)) == payload
        bad = bytearray(blob)
        bad[-1] ^= 1
        with pytest.raises(FrameError):
            copied.decode(bytes(bad), NS, H)


@settings(max_examples=300, deadline=None)
@given(
    encrypt=st.booleans(),
    change=st.one_of(
        st.tuples(st.just("byte"), st.integers(0, 128 + 256 - 1), st.integers(1, 255)),
        st.tuples(st.just("cut"), st.integers(1, 128 + 256), st.just(0)),
        st.tuples(st.just("more"), st.integers(1, 17), st.integers(0, 255)),
        st.tuples(st.just("hash"), st.integers(0, 31), st.integers(1, 255)),
    ),
)
def test_a_page_read_again_through_the_file_stores_read_is_checked_like_the_first(
    encrypt, change
):
    """The file store's read of an authenticated page whose key object is kept (a page
    read again: `read_into` compares its header with what `seal` writes and checks the
    tag, with few Python steps) refuses all that the first read refuses: any byte of the
    header or the body changed, the file cut short or grown, another page asked for. The
    unchanged frame still reads. The job's header buffer, which holds the first read's
    header, is the one each read fills."""
    writer, reader = codec(), codec(encrypt=encrypt)
    payload = os.urandom(256)
    header, body = writer.seal(NS, H, payload)
    blob = header + bytes(body)
    out = memoryview(bytearray(256))
    spare = (bytearray(seal.HEADER_SIZE), bytearray(seal.TAG_SIZE + 1))  # the job's
    read_into(reader, blob, out, spare=spare)  # the first read keeps its key object
    assert bytes(out) == payload and blob[: seal.SEALED_PART] in reader._opened
    kind, at, value = change
    bad, h = bytearray(blob), H
    if kind == "byte":
        bad[at] ^= value
    elif kind == "cut":
        del bad[-at:]
    elif kind == "more":
        bad += bytes([value]) * at
    else:
        h = bytearray(H)
        h[at] ^= value
        h = bytes(h)
    with pytest.raises(FrameError):
        reader.decode(bytes(bad), NS, h)  # what the first read's checks say
    with pytest.raises(FrameError):
        read_into(reader, bytes(bad), memoryview(bytearray(256)), h, spare)
    read_into(reader, blob, out, spare=spare)
    assert bytes(out) == payload
