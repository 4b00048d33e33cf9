"""What the engine adapters' tenant-key tests (docs/security.md) do to a store: list and
read it as anyone who can does, and re-frame a stored page as anyone who can write it
does (another page's payload under a freshly computed plain xxh3 checksum)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import NamedTuple

from kvtier.backends import frame, seal
from kvtier.backends.registry import build_store
from kvtier.config import load_config
from kvtier.tenant_keys import parse_keys

KEY_A = "a1" * 32
KEY_B = "b2" * 32
KEY_A_ID = parse_keys(KEY_A, "test").current.key_id.hex()


class Listing(NamedTuple):
    keys: list[str]  # the namespace's page keys
    plain: int  # how many of them a store without a key reads as valid frames
    manifest: dict | None


def list_store(section: dict, namespace_id: str, prefix: str = "kvtier") -> Listing:
    """What anyone who can list and read the store `section` sees of `namespace_id`,
    through a store of their own without a key."""
    cfg = load_config(None, overrides={"store": section}).store

    async def run() -> Listing:
        store = build_store(cfg.backend, cfg.options, cfg.timeout_s)
        try:
            keys = [
                p.key
                async for batch in store.scan()
                for p in batch
                if f"/{namespace_id}/" in p.key
            ]
            checked = await store.check(keys)
            return Listing(
                keys,
                checked.count(None),
                await store.get_manifest(prefix, namespace_id),
            )
        finally:
            await store.close()

    return asyncio.run(run())


def reframe_plain(page: Path, donor: Path) -> None:
    """The file store's `page` re-framed with `donor`'s payload: a plain frame for the
    page's own namespace and hash, its xxh3 checksum computed for the new payload."""
    ns, h = page.parents[2].name, bytes.fromhex(page.name)
    blob = donor.read_bytes()
    body = blob[
        seal.HEADER_SIZE if seal.key_id_of(blob) is not None else frame.HEADER_SIZE :
    ]
    page.write_bytes(frame.encode(ns, h, body))


def leaks_key(text: str) -> bool:
    """Whether `text` shows either test key (in any case)."""
    return KEY_A in text.lower() or KEY_B in text.lower()
