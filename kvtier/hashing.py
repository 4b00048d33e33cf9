"""Page hash chains, namespace ids and L3 keys (docs/design.md §5).

    page_hash[i] = H(page_hash[i-1] ‖ namespace id ‖ extra key ‖ tokens of page i)

`page_hash[-1]` is a fixed seed. Every input is a tagged, length-prefixed field, so two
different (extra key, tokens) pairs can never encode to the same bytes. Hashes are a pure
function of their inputs: never Python's `hash()`, never seeded per process.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass, fields
from collections.abc import Callable
from typing import Literal

import numpy as np
import xxhash

from kvtier.errors import KvtierConfigError, StoreKeyError
from kvtier.numpy_gil import GIL_CHUNK

HashAlgo = Literal["sha256", "xxh3_128"]
HASH_ALGOS: tuple[str, ...] = ("sha256", "xxh3_128")
KEY_FORMAT_VERSION = 1
SEED = b"kvtier/page-hash-chain/v1"
NAMESPACE_ID_HEX = 32

# fullmatch everywhere: `$` would also match before a trailing newline
PREFIX_RE = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*")
_NS_RE = re.compile(r"[0-9a-f]{32}")
_HASH_RE = re.compile(r"[0-9a-f]{32}|[0-9a-f]{64}")
_COMPONENT_RE = re.compile(r"[a-z]+(?::[a-z_]+=[a-z0-9_.x]+)*")
_DOT_SEGMENT = re.compile(r"(?:^|/)\.\.?(?:/|$)")  # a '.' or '..' path segment


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<I", len(value)) + value


def token_bytes(tokens: np.ndarray) -> bytes:
    """Canonical encoding of token ids: little-endian uint32. Cast in pieces of GIL_CHUNK:
    one numpy cast of a whole prompt gives up the GIL on the scheduler thread."""
    out = np.empty(len(tokens), dtype="<u4")
    for i in range(0, len(tokens), GIL_CHUNK):
        out[i : i + GIL_CHUNK] = tokens[i : i + GIL_CHUNK]
    return out.tobytes()


@dataclass(slots=True, frozen=True)
class Namespace:
    """Everything that changes the bytes of a page. Two caches share pages only if equal."""

    model_id: str
    dtype: str
    layout: str
    page_size: int
    tp_rank: int = 0
    tp_size: int = 1
    tenant_salt: str | None = None
    key_format_version: int = KEY_FORMAT_VERSION
    revision: str | None = (
        None  # the weights' revision or fingerprint (same model id, other bytes)
    )
    tenant_key_id: str | None = (
        None  # hex id of the tenant key (never the key): its pages are sealed
    )
    store_pages: int = 1  # device pages in one store page (`store.page_tokens`)
    # a hybrid model's component and what fixes its pages beyond the pool's layout
    # ("swa:window=16", "mamba"; `kvtier/tiers/components.py`); None: full attention
    component: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise KvtierConfigError(
                f"namespace.page_size={self.page_size!r}: must be an integer >= 1"
            )
        if (
            isinstance(self.store_pages, bool)
            or not isinstance(self.store_pages, int)
            or self.store_pages < 1
        ):
            raise KvtierConfigError(
                f"store_pages={self.store_pages!r}: device pages in a store page, an integer >= 1"
            )
        if self.component is not None and not _COMPONENT_RE.fullmatch(
            str(self.component)
        ):
            raise KvtierConfigError(
                f"namespace.component={self.component!r}: a name of [a-z] with "
                "':key=value' geometry fields of [a-z0-9_.x=] (e.g. 'swa:window=16')"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise KvtierConfigError(
                f"namespace.tp_rank={self.tp_rank!r}: must be in [0, tp_size={self.tp_size})"
            )

    def manifest(self, page_bytes: int) -> dict:
        """What `tierctl store ls` shows of a namespace (docs/formats.md). The tenant salt
        itself is never stored: only a digest that `purge --tenant SALT` can match."""
        out = {
            "format": 1,
            "namespace": self.id,
            "model_id": self.model_id,
            "revision": self.revision,
            "dtype": self.dtype,
            "layout": self.layout,
            "page_size": self.page_size,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "tenant": tenant_digest(self.tenant_salt),
            "key_format_version": self.key_format_version,
            "page_bytes": page_bytes,
        }
        if self.tenant_key_id is not None:
            out["tenant_key_id"] = self.tenant_key_id
        if self.store_pages > 1:
            out["store_pages"] = self.store_pages
        if self.component is not None:
            out["component"] = self.component
        return out

    @property
    def id(self) -> str:
        """32 hex digits naming this namespace in keys and page frames."""
        h = hashlib.sha256(b"kvtier/namespace")
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                f.name in ("revision", "tenant_key_id", "component") and value is None
            ) or (f.name == "store_pages" and value == 1):
                continue  # ids from before these fields existed stay the same
            h.update(
                _field(
                    f.name.encode(),
                    b"\x00" if value is None else b"\x01" + str(value).encode(),
                )
            )
        return h.hexdigest()[:NAMESPACE_ID_HEX]


def tenant_digest(salt: str | None) -> str | None:
    return (
        None
        if salt is None
        else hashlib.sha256(b"kvtier/tenant\x00" + salt.encode()).hexdigest()[:16]
    )


class KeyedHash:
    """The page-hash function of a tenant with a key: keyed BLAKE2b of the digest size its
    `hash_algo` names (32 bytes for sha256, 16 for xxh3_128), so only a holder of the key
    can tell which tokens a page hash stands for (docs/security.md). It goes wherever a
    `hash_algo` name goes; its repr names the key's id, never the key."""

    __slots__ = ("digest_size", "_key", "key_id")

    def __init__(self, hash_key: bytes, algo: str, key_id: str) -> None:
        _hasher(algo)  # refuses an unknown name
        self.digest_size, self._key, self.key_id = (
            (32 if algo == "sha256" else 16),
            hash_key,
            key_id,
        )

    def __call__(self, data: bytes = b""):
        return hashlib.blake2b(data, digest_size=self.digest_size, key=self._key)

    def __repr__(self) -> str:
        return f"keyed-blake2b-{8 * self.digest_size}(key {self.key_id})"


def _hasher(algo):
    if isinstance(algo, KeyedHash):
        return algo
    if algo == "sha256":
        return hashlib.sha256
    if algo == "xxh3_128":
        return xxhash.xxh3_128
    raise KvtierConfigError(
        f"hash_algo={algo!r}: allowed values are {', '.join(HASH_ALGOS)}"
    )


def page_hashes(
    tokens: np.ndarray,
    page_size: int,
    namespace_id: str,
    extra_key: str | None = None,
    prev: bytes | None = None,
    algo: str | KeyedHash = "sha256",
) -> list[bytes]:
    """Hash chain of the *whole* pages of `tokens`, continuing from `prev` (None = seed).

    Each page hashes `field("pv", prev) ‖ field("ns", …) ‖ field("ek", …) ‖ field("tk", page)`
    (docs/formats.md); everything but `prev` and the page's tokens is the same for every
    page, so it is encoded once and each page is one hash call over one joined buffer."""
    return page_hashes_of_bytes(
        token_bytes(tokens), page_size, namespace_id, extra_key, prev, algo
    )


def page_hashes_of_bytes(
    data: bytes,
    page_size: int,
    namespace_id: str,
    extra_key: str | None = None,
    prev: bytes | None = None,
    algo: str | KeyedHash = "sha256",
) -> list[bytes]:
    """`page_hashes` of tokens already encoded (`token_bytes`)."""
    new = _hasher(algo)
    step = 4 * page_size
    middle = (
        _field(b"ns", namespace_id.encode())
        + _field(b"ek", b"\x00" if extra_key is None else b"\x01" + extra_key.encode())
        + b"tk"
        + struct.pack("<I", step)
    )
    h_prev = SEED if prev is None else prev
    pv = b"pv" + struct.pack("<I", len(h_prev))
    pv_digest = b"pv" + struct.pack("<I", new().digest_size)
    out: list[bytes] = []
    join = b"".join
    for start in range(0, len(data) // step * step, step):
        h_prev = new(join((pv, h_prev, middle, data[start : start + step]))).digest()
        pv = pv_digest
        out.append(h_prev)
    return out


def key_maker(prefix: str, namespace_id: str):
    """`make_key` with the prefix and namespace checked once: a function of the page hash
    (16 or 32 bytes) for the hot paths that key every page they move."""
    base = make_key(prefix, namespace_id, bytes(16))[:-32]

    def key(page_hash: bytes) -> str:
        hx = page_hash.hex()
        if len(hx) not in (32, 64):
            raise StoreKeyError(f"page hash of {len(hx) // 2} bytes: expected 16 or 32")
        made = base + hx
        _remember(
            made, (prefix, namespace_id, bytes(page_hash))
        )  # well formed by construction
        return made

    return key


def make_key(prefix: str, namespace_id: str, page_hash: bytes) -> str:
    """`<prefix>/<namespace id>/<hex page hash>`, validated."""
    if not isinstance(prefix, str) or not PREFIX_RE.fullmatch(prefix):
        raise KvtierConfigError(
            f"key prefix={prefix!r}: allowed are path segments of [A-Za-z0-9_.-] separated by '/'"
        )
    return validate_key(f"{prefix}/{namespace_id}/{page_hash.hex()}")


def _parse_key(key: str) -> tuple[str, str, str]:
    """(prefix, namespace id, hex page hash). The last two segments are split off, not
    found by one regex over the whole key: that one backtracked, 5 us a key."""
    parts = key.rsplit("/", 2) if isinstance(key, str) else []
    well_formed = (
        len(parts) == 3
        and _HASH_RE.fullmatch(parts[2])
        and _NS_RE.fullmatch(parts[1])
        and PREFIX_RE.fullmatch(parts[0])
        and not _DOT_SEGMENT.search(parts[0])
    )
    if not well_formed:
        raise StoreKeyError(
            f"key={key!r}: expected '<prefix>/<32 hex namespace id>/<32 or 64 hex page hash>'"
        )
    return parts[0], parts[1], parts[2]


def validate_key(key: str) -> str:
    """Return `key` if it has the L3 key form; raise StoreKeyError naming it otherwise."""
    _parse_key(key)
    return key


def split_key(key: str) -> tuple[str, str, bytes]:
    """(prefix, namespace id, page hash) of a validated key. A store parses each key of
    a batch several times (check, path, index): the recent ones are remembered, and so
    is every key `key_maker` made (the storage thread keys every page it moves: each new
    key was parsed again, four regexes, by the store's check)."""
    if not isinstance(key, str):
        _parse_key(key)  # raises, naming it
    parts = _RECENT.get(key)
    if parts is None:
        prefix, ns, hx = _parse_key(key)
        parts = _remember(key, (prefix, ns, bytes.fromhex(hx)))
    return parts


class Recent(dict):
    """What was made of the keys seen lately, oldest first: an engine moves the same keys
    again and again, and each one made afresh (a parse, a hash, a string) costs more than
    a dict lookup. Bounded: past `bound` entries the older half goes (`keep`). Threads
    share one: a dict's get, set and pop are atomic under the GIL, and so is `list(d)`,
    one C call. An iterator kept across bytecodes is not: another thread's set in between
    ends it with "dictionary changed size during iteration"."""

    __slots__ = ("bound",)

    def __init__(self, bound: int = 1 << 15) -> None:
        super().__init__()
        self.bound = bound

    def keep(self, key, value):
        """`value`, kept for `key`."""
        if len(self) >= self.bound:
            for old in list(self)[: self.bound // 2]:
                self.pop(old, None)
        self[key] = value
        return value

    def each(self, keys, make: Callable, what: str) -> list:
        """What is kept for each of `keys`, or `make(key)` (which checks it and `keep`s
        what it makes). `keys` no collection: a ValueError naming it and `what` it must be
        a collection of; an unhashable key: `make`'s error for it."""
        out, k = [], keys
        try:
            for k in keys:
                made = self.get(k)
                out.append(made if made is not None else make(k))
        except TypeError:
            if k is keys:  # no collection at all
                raise ValueError(
                    f"keys={keys!r}: expected a collection of {what}"
                ) from None
            make(k)  # raises, naming it
            raise
        return out


# Recently parsed or made store keys -> their parts (~300 bytes each). A prefetch's keys
# are made, then read again after its grant: kept this long, they are not parsed again.
_RECENT: Recent = Recent(1 << 15)


def _remember(key: str, parts: tuple[str, str, bytes]) -> tuple[str, str, bytes]:
    return _RECENT.keep(key, parts)
