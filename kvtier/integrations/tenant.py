"""What the YAML's tenant key (docs/security.md) gives every engine adapter: the key id for
its namespace, the keyed hash its engine's page keys go through before they become store
keys, the seal of its store."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.backends.base import Store
from kvtier.backends.seal import SealedCodec
from kvtier.config import NamespaceConfig
from kvtier.hashing import KeyedHash


@dataclass(slots=True, frozen=True)
class StoreTenant:
    """A tenant key's part in an engine adapter; all None without a key. Its repr names
    only the key's id."""

    key_id: str | None = None  # hex: the adapter's Namespace(tenant_key_id=...)
    keyed: KeyedHash | None = (
        None  # the engine's page keys go through it before they become store keys
    )
    codec: SealedCodec | None = None

    def seal(self, store: Store | None) -> None:
        """The store frames and reads every page sealed with the tenant's key."""
        if self.codec is not None and store is not None:
            store.seal_with(self.codec)


def tenant_of(ns: NamespaceConfig) -> StoreTenant:
    """The tenant key of the YAML's `namespace:` (`tenant_key`, `encrypt`) for an engine
    adapter; its keyed hash gives 32-byte page hashes, as SGLang's sha256 keys are."""
    keys = ns.tenant_keys()
    if keys is None:
        return StoreTenant()
    return StoreTenant(
        keys.current.key_id.hex(),
        keys.current.page_hash("sha256"),
        SealedCodec(keys.current_only(), ns.encrypt),
    )
