"""What every engine adapter builds before it serves a page: its namespace, its store
(sealed with the tenant's key), the keyed hash its engine's page keys go through, and the
store's thread and breaker (docs/sglang.md, docs/vllm.md, docs/security.md).

An adapter translates its engine's geometry into a `Geometry` (the namespace's layout
string is the adapter's own: it names what the engine's page bytes depend on) and calls
`build_stack` once. Nothing else in `integrations/` makes a `Namespace`, builds a store or
seals one, so a store key depends only on the YAML and the geometry, the same way for
every engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvtier.backends.base import Store
from kvtier.backends.registry import build_store
from kvtier.config import KvtierConfig, refuse_store_pages
from kvtier.errors import KvtierConfigError
from kvtier.hashing import KeyedHash, Namespace, key_maker
from kvtier.integrations.tenant import StoreTenant, tenant_of
from kvtier.storeio.breaker import Breaker, BreakerConfig
from kvtier.storeio.cpus import check_cpus
from kvtier.storeio.loop import StoreLoop

log = logging.getLogger(__name__)


def _text(field: str, value: Any, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise KvtierConfigError(f"geometry.{field}={value!r}: expected {what}")


def _count(field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise KvtierConfigError(
            f"geometry.{field}={value!r}: expected an integer >= {minimum}"
        )


@dataclass(slots=True, frozen=True)
class Geometry:
    """What the engine says changes its pages' bytes, checked at construction: each
    error names the field, the value and what is allowed. `model_id` and `tenant_salt`
    None take the YAML's `namespace:` ones."""

    dtype: str  # the KV dtype as the engine names it (with a quantized cache's, if any)
    layout: str  # the adapter's: geometry, host layout, shard; one string per engine
    page_size: int  # tokens in one engine page (one store page)
    tp_rank: int = 0  # 0 of 1 where every rank's pages are the same (MLA)
    tp_size: int = 1
    model_id: str | None = None
    tenant_salt: str | None = None

    def __post_init__(self) -> None:
        _text("dtype", self.dtype, "a non-empty string such as 'bfloat16'")
        _text("layout", self.layout, "a non-empty string naming the page's make-up")
        _count("page_size", self.page_size, 1)
        _count("tp_size", self.tp_size, 1)
        _count("tp_rank", self.tp_rank, 0)
        if self.tp_rank >= self.tp_size:
            raise KvtierConfigError(
                f"geometry.tp_rank={self.tp_rank!r}: must be in [0, tp_size={self.tp_size})"
            )
        if self.model_id is not None:
            _text("model_id", self.model_id, "a non-empty string, or None (the YAML's)")
        if self.tenant_salt is not None:
            _text(
                "tenant_salt",
                self.tenant_salt,
                "a non-empty string, or None (the YAML's)",
            )


@dataclass(slots=True, frozen=True)
class Stack:
    """One adapter's store side. `store` is None only where the YAML says
    `store.backend: none` and the adapter allows it; `loop` and `breaker` are None where
    the adapter runs its store calls elsewhere (the linker's storage worker, which takes
    `breaker_config`)."""

    config: KvtierConfig
    namespace: Namespace
    tenant: StoreTenant  # its repr names only the key's id
    store: Store | None
    key: Callable[[bytes], str]  # a page hash -> its full store key in this namespace
    cpus: frozenset[int] | None  # `controller.cpus`, resolved on this machine
    breaker_config: BreakerConfig
    loop: StoreLoop | None = None
    breaker: Breaker | None = None

    @property
    def key_prefix(self) -> str:
        return self.config.store.key_prefix

    @property
    def keyed(self) -> KeyedHash | None:
        """The tenant's keyed hash: the engine's page keys go through it (None: no key)."""
        return self.tenant.keyed

    def close(self) -> None:
        """Stop the store's thread (the adapter closes the store on it first)."""
        if self.loop is not None:
            self.loop.close()


def check_config(config: Any, who: str, store_required: bool = True) -> None:
    """What `build_stack` refuses of the YAML, for an adapter that checks it before its
    engine's geometry is known: every error names the field, the value and what is
    allowed."""
    if not isinstance(config, KvtierConfig):
        raise KvtierConfigError(
            f"config={type(config).__name__}: {who} needs a KvtierConfig (load_config)"
        )
    refuse_store_pages(config, who)
    if store_required and config.store.backend == "none":
        raise KvtierConfigError(
            f"store.backend='none': {who} needs a store (file, redis, s3 or a plugin)"
        )
    check_cpus(config.controller.cpus)  # controller.cpus on this machine


def build_stack(
    *,
    config: KvtierConfig,
    geometry: Geometry,
    who: str,
    store_required: bool = True,
    store_options: Any = None,
    thread: str | None = None,
) -> Stack:
    """The namespace, sealed store, keyed hash and (with `thread`, the name of the store
    thread to start) the store's loop and breaker, for `who` (the adapter, named in every
    error). `store_options` replaces the YAML's `store:` options (same type) where the
    adapter tunes them. On any error nothing is left running."""
    check_config(config, who, store_required)
    if not isinstance(geometry, Geometry):
        raise KvtierConfigError(
            f"geometry={type(geometry).__name__}: {who} needs a Geometry"
        )
    ns, c = config.namespace, config.controller
    tenant = tenant_of(ns)  # docs/security.md: key id, keyed page keys, sealed store
    namespace = Namespace(
        model_id=geometry.model_id or ns.model_id,
        dtype=geometry.dtype,
        layout=geometry.layout,
        page_size=geometry.page_size,
        tp_rank=geometry.tp_rank,
        tp_size=geometry.tp_size,
        tenant_salt=(
            geometry.tenant_salt if geometry.tenant_salt is not None else ns.tenant_salt
        ),
        revision=ns.revision,
        tenant_key_id=tenant.key_id,
    )
    key = key_maker(config.store.key_prefix, namespace.id)  # checks the prefix now
    cpus = check_cpus(c.cpus)
    breaker_config = c.breaker_config()
    options = config.store.options if store_options is None else store_options
    rt = _runtime(config, options, tenant, cpus, breaker_config, thread)
    return Stack(
        config,
        namespace,
        tenant,
        rt.store,
        key,
        cpus,
        breaker_config,
        rt.loop,
        rt.breaker,
    )


# -- the store's runtime: the thread it is built on and called from, its breaker -----------


class _Runtime(NamedTuple):
    store: Store | None
    loop: StoreLoop | None
    breaker: Breaker | None


def _runtime(
    config: KvtierConfig,
    options: Any,
    tenant: StoreTenant,
    cpus: frozenset[int] | None,
    breaker_config: BreakerConfig,
    thread: str | None,
) -> _Runtime:
    """The sealed store, and with `thread` the loop it is built on and called from and
    the breaker in front of its calls. On any error the loop is stopped again."""
    loop = None if thread is None else StoreLoop(cpus, name=thread)
    try:
        store = _store(config, options, loop)
        tenant.seal(store)
    except BaseException:
        if loop is not None:
            loop.close()
        raise
    if loop is None or store is None:
        return _Runtime(store, loop, None)
    return _Runtime(store, loop, Breaker(store.name, breaker_config))


def _store(config: KvtierConfig, options: Any, loop: StoreLoop | None) -> Store | None:
    """The YAML's store, built on `loop` where given (a client binds to the loop it is
    made on), else here."""
    if config.store.backend == "none":
        return None
    s = config.store

    async def build() -> Store:
        return build_store(s.backend, options, s.timeout_s)

    if loop is None:
        return build_store(s.backend, options, s.timeout_s)
    return loop.run(build())
