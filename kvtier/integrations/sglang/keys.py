"""SGLang's page keys as kvtier page hashes, for both SGLang seams (the storage backend and
the linker): SGLang names a page by a chained sha256 hex of its tokens."""

from __future__ import annotations

import hashlib
import re

from kvtier.hashing import KeyedHash

_HEX_HASH = re.compile(
    r"[0-9a-f]{32}|[0-9a-f]{64}"
)  # fullmatch: `$` would pass a trailing newline


def page_hash_of(key: str, keyed: KeyedHash | None = None) -> bytes:
    """The page-hash part of kvtier's key for one SGLang key: SGLang's sha256 hex as is,
    any other string (a test key, a suffixed sidecar key) through sha256 with a tag; with
    a tenant's `keyed` hash, every key through it (a key listing then tells nothing of
    SGLang's hashes, which anyone can compute from the tokens)."""
    if not isinstance(key, str) or not key:
        raise ValueError(
            f"key={key!r}: expected a non-empty string (SGLang's page hash)"
        )
    if keyed is not None:
        return keyed(b"kvtier/sglang-key\x00" + key.encode()).digest()
    if _HEX_HASH.fullmatch(key):
        return bytes.fromhex(key)
    return hashlib.sha256(b"kvtier/sglang-key\x00" + key.encode()).digest()
