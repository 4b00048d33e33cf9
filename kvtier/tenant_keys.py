"""Tenant keys (docs/security.md): the secret that keys a tenant's page hashes and seals
its page frames.

A tenant key is 32 random bytes, written as 64 hex digits. Nothing here ever prints one:
a key shows as its id, 8 bytes derived from it one way (`TenantKey.key_id`), which every
sealed frame and manifest carries. Several keys, separated by commas or new lines, make a
key ring: the first seals new pages and keys the page hashes, the others only let
`tierctl store verify` and `purge` recognise pages of earlier keys (docs/security.md,
"Rotating a key"). Every purpose uses its own subkey, derived with keyed BLAKE2b.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat

from kvtier.hashing import KeyedHash

KEY_BYTES = 32
KEY_ID_BYTES = 8
_HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")
_PERSON = b"kvtier-tenant"
# a key file holds a key ring: a few keys and comments, never more than this
KEY_FILE_MAX_BYTES = 64 << 10
log = logging.getLogger(__name__)


def _derive(secret: bytes, purpose: bytes, size: int) -> bytes:
    return hashlib.blake2b(
        purpose, key=secret, digest_size=size, person=_PERSON
    ).digest()


class TenantKey:
    """One tenant key's subkeys. Its repr and str name only its id."""

    __slots__ = (
        "key_id",
        "hash_key",
        "mac_key",
        "aead_key",
        "event_key",
        "_frame_mac",
        "_frame_aead",
    )

    def __init__(self, secret: bytes) -> None:
        if len(secret) != KEY_BYTES:
            raise ValueError(f"a tenant key is {KEY_BYTES} bytes, not {len(secret)}")
        self.key_id = _derive(secret, b"key-id", KEY_ID_BYTES)
        self.hash_key = _derive(secret, b"page-hash", 32)
        self.mac_key = _derive(secret, b"frame-mac", 32)
        self.aead_key = _derive(secret, b"frame-aead", 32)
        self.event_key = _derive(secret, b"event-hash", 32)  # KV events' block hashes
        self._key_frame_states()

    def _key_frame_states(self) -> None:
        """Keyed BLAKE2b states of the frame subkeys, keyed once: a sealed frame's key
        copies one (`frame_key`) instead of keying a hash per page."""
        self._frame_mac = hashlib.blake2b(key=self.mac_key, digest_size=32)
        self._frame_aead = hashlib.blake2b(key=self.aead_key, digest_size=32)

    def __getstate__(self) -> dict:  # a copy or pickle holds the subkeys, as before
        return {s: getattr(self, s) for s in self.__slots__ if not s.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._key_frame_states()

    def frame_key(
        self, encrypted: bool, sealed: bytes | bytearray | memoryview
    ) -> bytes:
        """The AES-256 key of one sealed frame: keyed BLAKE2b-256 of its sealed part under
        the frame-aead subkey (`encrypted`) or the frame-mac one
        (kvtier/backends/seal.py, docs/formats.md). Thread-safe."""
        state = (self._frame_aead if encrypted else self._frame_mac).copy()
        state.update(sealed)
        return state.digest()

    def page_hash(self, hash_algo: str) -> KeyedHash:
        """The keyed page hash that stands in for `hash_algo` (same digest size)."""
        return KeyedHash(self.hash_key, hash_algo, self.key_id.hex())

    def __repr__(self) -> str:
        return f"TenantKey(id={self.key_id.hex()})"

    __str__ = __repr__


class TenantKeys:
    """A key ring: `current` seals and hashes; every key in it is recognised by its id."""

    __slots__ = ("keys", "by_id")

    def __init__(self, keys: list[TenantKey]) -> None:
        if not keys:
            raise ValueError("a key ring needs at least one tenant key")
        self.keys = tuple(keys)
        self.by_id = {k.key_id: k for k in keys}

    @property
    def current(self) -> TenantKey:
        return self.keys[0]

    @property
    def ids(self) -> list[str]:
        return [k.key_id.hex() for k in self.keys]

    def current_only(self) -> TenantKeys:
        """The ring of the current key alone: what a cache seals and reads with. The other
        keys are for `tierctl store verify` and `purge`: a page sealed with a retired key
        (a leaked one is why keys rotate) is never served (docs/security.md)."""
        return self if len(self.keys) == 1 else TenantKeys([self.current])

    def __repr__(self) -> str:
        return f"TenantKeys(ids={self.ids})"

    __str__ = __repr__


def parse_keys(text: str, field: str) -> TenantKeys:
    """The key ring written in `text` (keys separated by commas, spaces or new lines; `#`
    starts a comment). Errors name `field` and what is wrong, never the text."""
    if not isinstance(text, str):
        raise ValueError(
            f"{field}: expected a string of 64 hex digits per key, got a {type(text).__name__}"
        )
    words = [
        w
        for line in text.splitlines()
        for w in re.split(r"[,\s]+", line.split("#", 1)[0])
        if w
    ]
    if not words:
        raise ValueError(f"{field}: no key in it (expected 64 hex digits per key)")
    for i, w in enumerate(words):
        if not _HEX_KEY.fullmatch(w):
            raise ValueError(
                f"{field}: key {i + 1} of {len(words)} is {len(w)} characters"
                f"{'' if re.fullmatch(r'[0-9a-fA-F]*', w) else ', not all hex digits'}; expected 64 hex "
                f"digits ({KEY_BYTES} random bytes, e.g. python -c 'import secrets; "
                f"print(secrets.token_hex(32))')"
            )
    keys = [TenantKey(bytes.fromhex(w)) for w in words]
    if len({k.key_id for k in keys}) != len(keys):
        raise ValueError(f"{field}: the same key appears twice")
    return TenantKeys(keys)


def load_keys(
    tenant_key: str | None, tenant_key_file: str | None, section: str = "namespace"
) -> TenantKeys | None:
    """The key ring of `tenant_key` (the keys themselves) or `tenant_key_file` (a file
    holding them); None without either. Errors never show a key."""
    if tenant_key is not None and tenant_key_file is not None:
        raise ValueError(
            f"{section}.tenant_key and {section}.tenant_key_file are both set: give one"
        )
    if tenant_key is not None:
        return parse_keys(tenant_key, f"{section}.tenant_key")
    if tenant_key_file is None:
        return None
    mode, text = _read_key_file(tenant_key_file, f"{section}.tenant_key_file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "%s.tenant_key_file=%r: others than its owner may read it (mode %03o); chmod 600 it",
            section,
            tenant_key_file,
            stat.S_IMODE(mode),
        )
    return parse_keys(text, f"{section}.tenant_key_file={tenant_key_file!r}")


def _read_key_file(path: str, field: str) -> tuple[int, str]:
    """The mode and text of the key file at `path`, read as a store reads a page: a regular
    file only (a FIFO, a device or a directory is refused, never waited on: the open does
    not block), at most KEY_FILE_MAX_BYTES (/dev/zero or a huge file is never read whole).
    Errors name `field` and the path, never the text."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(
                    f"{field}={path!r}: not a regular file ({_kind(st.st_mode)}); "
                    "expected a file holding the key"
                )
            data = _read_upto(fd, KEY_FILE_MAX_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > KEY_FILE_MAX_BYTES:
            raise ValueError(
                f"{field}={path!r}: larger than {KEY_FILE_MAX_BYTES} bytes; a key file "
                f"holds 64 hex digits per key"
            )
        return st.st_mode, data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{field}={path!r}: cannot read it "
            f"({type(exc).__name__}: {getattr(exc, 'strerror', None) or 'not text'})"
        ) from None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return f"mode {stat.S_IFMT(mode):o}"


def _read_upto(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = os.read(fd, n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)
