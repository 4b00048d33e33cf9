"""`tierctl store purge --tenant`: which pages are a tenant's, from what can be proven.

A manifest is anyone's to write (docs/security.md): what it says is a hint, never proof.
Two things are proof:

- a page that authenticates under the tenant's key (the config's key ring) is the
  tenant's, whichever namespace holds it and whatever its manifest says;
- a namespace id commits to the salt it was made with: a namespace whose id is the one
  that a manifest's fields (or the config's) make with the salt is that salt's, all of it.
  A manifest that names the salt's digest in a namespace of another id proves nothing.

What neither proves is counted and said (`Attribution.unproven`), never deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.backends import seal
from kvtier.errors import KvtierConfigError
from kvtier.hashing import KEY_FORMAT_VERSION, Namespace, tenant_digest

TP_SIZES = (1, 2, 4, 8)  # tensor-parallel sizes whose namespace ids a config may make


@dataclass(slots=True)
class Attribution:
    victims: list[str] = field(default_factory=list)  # keys of the tenant's pages
    unproven: list[str] = field(
        default_factory=list
    )  # one line per reason, with counts


def made_with(manifest: dict, namespace_id: str, salt: str) -> bool:
    """Is `namespace_id` the id that the manifest's fields make with `salt`?"""
    try:
        made = Namespace(
            manifest["model_id"],
            manifest["dtype"],
            manifest["layout"],
            manifest["page_size"],
            manifest.get("tp_rank", 0),
            manifest.get("tp_size", 1),
            salt,
            manifest.get("key_format_version", KEY_FORMAT_VERSION),
            manifest.get("revision"),
            manifest.get("tenant_key_id"),
            manifest.get("store_pages", 1),
        )
    except (KeyError, TypeError, ValueError, KvtierConfigError):
        return False
    return made.id == namespace_id


def config_namespaces(
    config, salt: str, key_ids: list[str], revisions: set
) -> set[str]:
    """The namespace ids the config makes with `salt`: every TP rank of the usual TP
    sizes, without a key and with each of `key_ids`, for each of `revisions`. A namespace
    whose manifest was lost (evicted: Redis allkeys-lru) is still found by its id."""
    pool = config.pool
    return {
        Namespace(
            config.namespace.model_id,
            pool.dtype,
            pool.page_layout,
            pool.page_size,
            rank,
            size,
            salt,
            revision=revision,
            tenant_key_id=key_id,
            store_pages=config.store_pages,
        ).id
        for size in TP_SIZES
        for rank in range(size)
        for key_id in [None, *key_ids]
        for revision in revisions
    }


async def tenant_pages(
    store, prefix: str, spaces: dict, config, salt, keys, *, batches
):
    """The tenant's pages among `spaces` (namespace id -> its listing): by its salt
    (`salt`: namespaces made with it; None: none) and by its key ring (`keys`: pages that
    authenticate; None: none). A namespace of the salt made with a key not in `keys` is
    another key holder's and left alone when `keys` is given. `batches(listing)` yields
    a namespace's keys in the batches one check reads (tierctl store's bound)."""
    out = Attribution()
    manifests = {ns: await store.get_manifest(prefix, ns) for ns in spaces}
    key_ids = list(keys.ids) if keys is not None else []
    mine: set[str] = set()
    named: list[str] = []  # namespaces whose manifest names the salt's digest, unproven
    sealed: dict[str, int] = {}  # namespace id -> its pages that authenticate
    if salt is not None:
        revisions = {config.namespace.revision} | {
            m.get("revision") for m in manifests.values() if isinstance(m, dict)
        }
        if config.namespace.revision is None:
            revisions.add(reference_revision())
        derived = config_namespaces(config, salt, key_ids, revisions)
        unnamed = 0
        for ns, m in manifests.items():
            ours_by_key = keys is None or (m or {}).get("tenant_key_id") in (
                None,
                *key_ids,
            )
            made = isinstance(m, dict) and made_with(m, ns, salt)
            if ns in derived or (made and ours_by_key):
                mine.add(ns)
            elif made:  # the salt's, with another key: its holder's, not unproven
                continue
            elif isinstance(m, dict) and m.get("tenant") == tenant_digest(salt):
                named.append(ns)  # an edited or copied manifest
            elif m is None and keys is None:
                unnamed += spaces[ns]["pages"]
        if unnamed:
            out.unproven.append(
                f"{unnamed} pages of namespaces without a manifest, whose id this config "
                "does not make with this salt: kept (nothing shows whose they are; with "
                "the tenant's key in --config, its sealed pages are found by their seal)"
            )
    for ns in mine:
        out.victims += [k for k, _ in spaces[ns]["keys"]]
    if keys is not None:
        codec = seal.SealedCodec(keys)
        for ns, s in spaces.items():
            if ns in mine:
                continue
            for chunk in batches(s):
                verdicts = await store.check(chunk, codec)
                found = [k for k, why in zip(chunk, verdicts) if why is None]
                out.victims += found
                sealed[ns] = sealed.get(ns, 0) + len(found)
    kept = sum(spaces[ns]["pages"] - sealed.get(ns, 0) for ns in named)
    if kept:  # what the seal found is deleted, not kept
        out.unproven.append(
            f"{kept} pages of namespaces whose manifest names this salt but whose id "
            "it does not make (an edited or copied manifest): kept"
        )
    return out


def reference_revision() -> str:
    """The revision `tierctl replay` and `serve` give their namespace when the config names
    none: the reference model's weights' fingerprint (`with_weights`)."""
    from kvtier.engine.model import ModelConfig, TinyTransformer

    return TinyTransformer(ModelConfig(seed=0)).fingerprint()
