"""ZMQ CURVE keys for the KV event sockets (docs/events.md, "Authentication").

The publisher is the CURVE server of both its sockets: it holds a key pair, and only a
peer whose public key is in the allowed list completes the handshake (a ZAP handler on the
publisher's own ZMQ context says yes or no). Keys are Z85 text, 40 characters, as
`zmq.curve_keypair()` makes them; a key file is either such a key alone or a certificate
that `zmq.auth.create_certificates` wrote (`*.key_secret` for the publisher's own pair,
`*.key` for a subscriber's public key).

The secret key is read like the tenant key (kvtier/tenant_keys.py): never printed (a repr
names the public key only), a warning when others than the owner may read its file.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq

log = logging.getLogger(__name__)
_Z85_KEY = re.compile(rb"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
_HOW = (
    "40 Z85 characters (python -c 'import zmq; print(zmq.curve_keypair()[1].decode())') "
    "or a certificate written by zmq.auth.create_certificates"
)


@dataclass(slots=True, frozen=True)
class CurveKeys:
    """The publisher's key pair and the subscriber keys it lets in (Z85 bytes)."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]

    def __repr__(self) -> str:
        return f"CurveKeys(public={self.public.decode()}, allowed={len(self.allowed)} keys)"

    __str__ = __repr__


def _words(text: bytes) -> list[bytes]:
    """The words of `text` but its comment lines: those that start with `#` and are not
    a key (Z85 has `#` in its alphabet, so a key may start with one)."""
    lines = (line.strip() for line in text.splitlines())
    return [
        w
        for line in lines
        if _Z85_KEY.fullmatch(line) or not line.startswith(b"#")
        for w in line.split()
    ]


def _certificate_key(text: bytes, name: bytes) -> bytes | None:
    """`public-key = "..."` / `secret-key = "..."` of a zmq.auth certificate, if there."""
    m = re.search(rb"^\s*" + name + rb'\s*=\s*"([^"]{40})"', text, re.MULTILINE)
    return None if m is None else m.group(1)


def parse_secret(text: bytes, field: str) -> tuple[bytes, bytes]:
    """(public, secret) of a secret key written alone or in a certificate. Errors name
    `field` and never the text."""
    key = _certificate_key(text, b"secret-key")
    if key is None:
        words = _words(text)
        key = words[0] if len(words) == 1 else None
    if key is None or not _Z85_KEY.fullmatch(key):
        raise ValueError(f"{field}: not a CURVE secret key; expected {_HOW}")
    try:
        return zmq.curve_public(key), key
    except (zmq.ZMQError, ValueError):
        raise ValueError(f"{field}: not a CURVE secret key; expected {_HOW}") from None


def read_secret_file(path: str, field: str) -> tuple[bytes, bytes]:
    """(public, secret) from the file at `path`; warns when group or others may read it."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read()
    except OSError as exc:
        raise ValueError(
            f"{field}={path!r}: cannot read it ({type(exc).__name__}: {exc.strerror})"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "%s=%r: others than its owner may read it (mode %03o); chmod 600 it",
            field,
            path,
            stat.S_IMODE(mode),
        )
    return parse_secret(text, f"{field}={path!r}")


def _public_keys(text: bytes, where: str) -> list[bytes]:
    key = _certificate_key(text, b"public-key")
    if key is not None:
        if _certificate_key(text, b"secret-key") is not None:
            raise ValueError(
                f"{where}: holds a secret key; list only subscribers' public keys "
                "(the *.key file of a certificate, not *.key_secret)"
            )
        keys = [key]
    else:
        keys = _words(text)
    for i, k in enumerate(keys):
        if not _Z85_KEY.fullmatch(k):
            raise ValueError(
                f"{where}: entry {i + 1} of {len(keys)} is not a CURVE public key "
                f"(expected 40 Z85 characters per line, or a zmq.auth certificate)"
            )
    return keys


def read_allowed(path: str, field: str) -> frozenset[bytes]:
    """The public keys in a file (one per line, `#` comments, or one certificate) or in
    a directory's `*.key` certificates."""
    p = Path(path)
    try:
        files = sorted(p.glob("*.key")) if p.is_dir() else [p]
        keys = [
            k
            for f in files
            for k in _public_keys(f.read_bytes(), f"{field}={str(f)!r}")
        ]
    except OSError as exc:
        raise ValueError(
            f"{field}={path!r}: cannot read it ({type(exc).__name__}: {exc.strerror})"
        ) from None
    if not keys:
        raise ValueError(
            f"{field}={path!r}: no public key in it; list the subscribers allowed in "
            "(40 Z85 characters per line, or a directory of zmq.auth *.key certificates)"
        )
    return frozenset(keys)


class Gate:
    """The ZAP handler's answer: an allowed key gets in; every other is refused and
    counted. Called on the authenticator's thread."""

    def __init__(self, allowed: frozenset[bytes], counters: dict, complain) -> None:
        self.allowed = allowed
        self.counters = counters
        self.complain = complain

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        self.counters["refused_peers"] += 1
        self.complain(
            "refused",
            "refused a peer whose CURVE key is not in events.curve_allowed_keys",
        )
        return False


def start_authenticator(context: zmq.Context, gate: Gate):
    """A ZAP handler on `context` that asks `gate` about every CURVE handshake; stop() it."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(context, log=logging.getLogger("kvtier.events.zap"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=gate)
    return auth


def serve_curve(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` a CURVE server with the publisher's key pair (before bind/connect)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
