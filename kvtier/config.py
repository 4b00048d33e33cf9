"""One YAML file configures a cache; each section maps onto a frozen dataclass.

Precedence: explicit arguments > environment (`KVTIER_<SECTION>_<KEY>`) > file > defaults.
Unknown sections or keys and bad values raise KvtierConfigError naming the field, the
value and what is allowed. `explain(config)` prints where every value came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal
from collections.abc import Mapping

import yaml

from kvtier.controller.config import ControllerConfig
from kvtier.errors import KvtierConfigError
from kvtier.events.config import EventsConfig
from kvtier.hashing import PREFIX_RE, HASH_ALGOS
from kvtier.secrets import mask_credentials, scrub_error, shown
from kvtier.tenant_keys import TenantKeys, load_keys
from kvtier.validate import check_positive
from kvtier.tiers.mirror import MirrorConfig
from kvtier.tiers.pool import PoolConfig
from kvtier.tree.policy import EvictionPolicy

ENV_PREFIX = "KVTIER_"
log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class NamespaceConfig:
    """What names the bytes beyond the pool's geometry: `model_id`, plus `revision` when
    one model id can have several weights (a fine-tune, a checkpoint: pages of another
    revision are never served), and a `tenant_salt` that keeps tenants apart.

    `tenant_key` (a secret: 64 hex digits, or several separated by commas, the first
    current) or `tenant_key_file` (a file holding them) keys the tenant's page hashes and
    seals its frames, with `encrypt: true` encrypting them too (docs/security.md)."""

    model_id: str = "default"
    tenant_salt: str | None = None
    revision: str | None = None
    tenant_key: str | None = field(default=None, repr=False)
    tenant_key_file: str | None = None
    encrypt: bool = False

    def __post_init__(self) -> None:
        self.tenant_keys()  # refuses a malformed key now, naming the field but never the key
        if self.encrypt and self.tenant_key is None and self.tenant_key_file is None:
            raise ValueError(
                "encrypt=True: needs namespace.tenant_key or namespace.tenant_key_file"
            )

    def tenant_keys(self) -> TenantKeys | None:
        """The tenant's key ring, or None without a key."""
        return load_keys(self.tenant_key, self.tenant_key_file)


@dataclass(slots=True, frozen=True)
class TreeConfig:
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    slru_threshold: int = 2
    hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"hash_algo={self.hash_algo!r}: allowed values are {', '.join(HASH_ALGOS)}"
            )


@dataclass(slots=True, frozen=True)
class StoreConfig:
    """`backend`: none, a built-in name, an entry-point name or `module:Class`.
    `options`: the backend's own settings (validated against its config class)."""

    backend: str = "none"
    key_prefix: str = "kvtier"
    timeout_s: float = 5.0
    required: bool = False  # True: a store that cannot be reached at start is an error, not a warning
    page_tokens: int | None = (
        None  # tokens in one store page: a multiple of pool.page_size (None: one device page)
    )
    options: Any = None

    def __post_init__(self) -> None:
        check_positive(self, "timeout_s")
        if self.page_tokens is not None:
            check_positive(self, "page_tokens", integer=True)
        if not PREFIX_RE.fullmatch(self.key_prefix) or {".", ".."} & set(
            self.key_prefix.split("/")
        ):
            raise ValueError(
                f"key_prefix={self.key_prefix!r}: path segments of [A-Za-z0-9_.-] separated by '/'"
            )


@dataclass(slots=True, frozen=True)
class ModelSettings:
    """The reference model `tierctl replay` and `serve` run: `tiny` (full attention) or
    `hybrid` (full, sliding-window and recurrent layers; `window`: tokens before a query a
    sliding-window layer sees). `model: hybrid` is short for `model: {kind: hybrid}`."""

    kind: Literal["tiny", "hybrid"] = "tiny"
    window: int = 16

    def __post_init__(self) -> None:
        check_positive(self, "window", integer=True)


@dataclass(slots=True, frozen=True)
class KvtierConfig:
    namespace: NamespaceConfig = NamespaceConfig()
    pool: PoolConfig = PoolConfig(size=4096, num_layers=4)
    mirror: MirrorConfig | None = MirrorConfig()
    tree: TreeConfig = TreeConfig()
    controller: ControllerConfig = ControllerConfig()
    store: StoreConfig = StoreConfig()
    events: EventsConfig | None = (
        None  # KV events for routers (docs/events.md); none without the section
    )
    model: ModelSettings = ModelSettings()
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.store_pages  # noqa: B018 (refuses a store page that is not whole device pages)

    @property
    def store_pages(self) -> int:
        """Device pages in one store page (`store.page_tokens`; docs/stores.md)."""
        tokens, ps = self.store.page_tokens, self.pool.page_size
        if tokens is None:
            return 1
        if tokens % ps:
            origin = self.sources.get("store.page_tokens", "default")
            raise KvtierConfigError(
                f"store.page_tokens={tokens!r}: must be a multiple of pool.page_size={ps} ({origin})"
            )
        return tokens // ps


_SECTIONS: dict[str, type] = {
    "namespace": NamespaceConfig,
    "pool": PoolConfig,
    "mirror": MirrorConfig,
    "tree": TreeConfig,
    "controller": ControllerConfig,
    "store": StoreConfig,
    "events": EventsConfig,
    "model": ModelSettings,
}
_STORE_COMMON = ("backend", "key_prefix", "timeout_s", "required", "page_tokens")
# variables of this prefix that other parts read (not config keys)
_OTHER_ENV = {"KVTIER_DEBUG_POOL", "KVTIER_CONSENSUS_CHECK", "KVTIER_SERVE_TOKEN"}


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    base: str | os.PathLike | None = None,
) -> KvtierConfig:
    """Build a KvtierConfig from defaults, a YAML file, the environment and `overrides`.

    `base` (tierctl passes its shipped `default`): a config read first, which the file at
    `path` overrides key by key, so a file of only `store:` keeps the base's pool. A file
    whose `store:` names a backend replaces the base's store section whole (the store an
    engine's adapter, which reads the file alone, would open)."""
    env = os.environ if env is None else env
    layers: list[tuple[str, dict]] = []
    lines: dict[str, int] = {}
    if base is not None and (path is None or config_path(path) != config_path(base)):
        layers.append((f"shipped config {Path(base).stem}", _read_yaml(base)[0]))
    if path is not None:
        data, lines = _read_yaml(path)
        layers.append((f"file {config_path(path)}", data))
    layers.append(("env", _from_env(env)))
    if overrides is not None and not isinstance(overrides, Mapping):
        raise KvtierConfigError(
            f"overrides: expected a mapping of sections such as {{'store': {{'backend': "
            f"'memory'}}}}, got {type(overrides).__name__}"
        )
    # copied, so the caller's dicts stay theirs; what is not a mapping is refused below, by name
    layers.append(
        (
            "arg",
            {
                s: dict(v) if isinstance(v, Mapping) else v
                for s, v in (overrides or {}).items()
            },
        )
    )
    merged: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    backend_of: dict[str, str] = {}  # store option -> the backend named when it was set
    for origin, layer in layers:
        for section, values in layer.items():
            where = _where(origin, lines, section)
            if section not in _SECTIONS:
                near = difflib.get_close_matches(str(section), _SECTIONS, n=1)
                raise KvtierConfigError(
                    f"{section!r}: unknown section"
                    f"{f' (did you mean {near[0]!r}?)' if near else ''}; "
                    f"allowed: {', '.join(_SECTIONS)}{f' ({where})' if where else ''}"
                )
            if section == "model" and isinstance(values, str):  # `model: hybrid`
                values = {"kind": values}
            elif section == "model" and not isinstance(values, Mapping):
                kinds = typing.get_args(typing.get_type_hints(ModelSettings)["kind"])
                raise KvtierConfigError(
                    f"model: expected a model name ({', '.join(kinds)}) or a mapping of "
                    f"keys (kind, window), got {values!r}"
                    + (f" ({where})" if where else "")
                )
            if values is None and section == "mirror":  # `mirror: null`: no host tier
                merged[section] = None
                sources["mirror"] = where
                continue
            if not isinstance(values, Mapping):
                raise KvtierConfigError(
                    mask_credentials(
                        f"{section}: expected a mapping of keys, got {values!r}"
                    )
                    + (f" ({where})" if where else "")
                )
            target = merged.get(section)
            if target is None:
                target = merged[section] = {}
            if section == "store" and origin.startswith("file") and "backend" in values:
                # a user's file naming its backend brings its whole store section, as an
                # engine reads the file alone: the shipped default's store is not mixed in
                for key in [k for k in target if _is_shipped(sources, f"store.{k}")]:
                    del target[key]
                    sources.pop(f"store.{key}", None)
                    backend_of.pop(key, None)
            for key, value in values.items():
                target[key] = value
                sources[f"{section}.{key}"] = _where(origin, lines, f"{section}.{key}")
            if section == "store":
                backend = str(target.get("backend", StoreConfig.backend))
                backend_of.update((key, backend) for key in values)
    built = {
        name: _build_section(name, merged.get(name, {}), sources, backend_of)
        for name in _SECTIONS
        if name in merged
    }
    return KvtierConfig(**built, sources=sources)


def _is_shipped(sources: Mapping[str, str], name: str) -> bool:
    return sources.get(name, "").startswith("shipped")


def _where(origin: str, lines: Mapping[str, int], name: str) -> str:
    """Where a setting came from: the user's file and line, the env variable, ..."""
    if origin == "env":
        section, _, key = name.partition(".")
        return f"env {ENV_PREFIX}{section.upper()}_{key.upper()}" if key else origin
    if origin.startswith("file") and name in lines:
        return f"{origin}, line {lines[name]}"
    return origin


def refuse_store_pages(config: KvtierConfig, where: str) -> None:
    """Where the engine names the store's pages (SGLang's linker and storage backend, vLLM's
    tier), a store page is one engine page: `store.page_tokens` is refused, not ignored."""
    if config.store.page_tokens is not None:
        raise KvtierConfigError(
            f"store.page_tokens={config.store.page_tokens!r}: {where} stores one engine page "
            "per store page; remove the key (it is for TieredCache, docs/stores.md)"
        )


def explain(config: KvtierConfig) -> str:
    """One line per setting: `section.key = value  (origin)`."""
    lines = []
    for name in _SECTIONS:
        section = getattr(config, name)
        if section is None:
            lines.append(f"{name} = null  ({config.sources.get(name, 'default')})")
            continue
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if name == "store" and f.name == "options":
                for k, v in _options_items(value):
                    lines.append(
                        f"store.{k} = {_show(k, v)}  ({config.sources.get(f'store.{k}', 'default')})"
                    )
                continue
            lines.append(
                f"{name}.{f.name} = {_show(f.name, value)}  ({config.sources.get(f'{name}.{f.name}', 'default')})"
            )
    return "\n".join(lines)


def _show(key: str, value: Any) -> str:
    value = shown(key, value)
    if value == "***":
        return value
    return value.value if isinstance(value, Enum) else repr(value)


def _options_items(options: Any) -> list[tuple[str, Any]]:
    if options is None:
        return []
    if dataclasses.is_dataclass(options):
        return [(f.name, getattr(options, f.name)) for f in dataclasses.fields(options)]
    return sorted(dict(options).items())


def shipped_default() -> str:
    """The path of the config `tierctl` reads beneath a user's file (`default`)."""
    return str(shipped_configs()["default"])


def shipped_configs() -> dict[str, Path]:
    """The configs inside the package, by name (`default`, `redis`, ...)."""
    from importlib.resources import files

    root = Path(str(files("kvtier") / "configs"))
    return {p.stem: p for p in sorted(root.glob("*.yaml"))}


def config_path(path: str | os.PathLike) -> Path:
    """A YAML file's path, or the shipped config of that name (`--config redis`)."""
    p = Path(path)
    if p.is_file():
        return p
    shipped = shipped_configs()
    if str(path) in shipped:
        return shipped[str(path)]
    raise KvtierConfigError(
        f"config file {str(p)!r}: not found (shipped configs: {', '.join(shipped)})"
    )


def _read_yaml(path: str | os.PathLike) -> tuple[dict, dict[str, int]]:
    """The file's sections, and the line of each section and `section.key` (from PyYAML's
    node marks), so that an error names the line the user wrote."""
    p = config_path(path)
    try:
        text = p.read_text()
        data = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise KvtierConfigError(
            f"config file {str(p)!r}: not valid YAML: {mask_credentials(str(exc))}"
        ) from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise KvtierConfigError(
            f"config file {str(p)!r}: expected a mapping of sections, got {type(data).__name__}"
        )
    return data, _lines(node)


def _lines(node: yaml.Node) -> dict[str, int]:
    lines: dict[str, int] = {}
    for key, value in node.value:
        section = str(key.value)
        lines[section] = key.start_mark.line + 1
        if isinstance(value, yaml.MappingNode):
            for k, _ in value.value:
                lines[f"{section}.{k.value}"] = k.start_mark.line + 1
    return lines


def _from_env(env: Mapping[str, str]) -> dict:
    """`KVTIER_<SECTION>_<KEY>` variables by section. A variable of this prefix whose
    section is no section (an unrelated `KVTIER_HOME`, a typo of a section) is warned about
    once per process, naming the nearest setting, and ignored; a known section's unknown
    key or bad value is an error (`_make`)."""
    out: dict[str, dict[str, str]] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in _OTHER_ENV:
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        section, _, key = rest.partition("_")
        if section not in _SECTIONS or not key:
            _warn_unknown_env(name)
            continue
        out.setdefault(section, {})[key] = value
    return out


# the variables already warned about: one warning each per process
_warned_env: set[str] = set()


def _warn_unknown_env(name: str) -> None:
    if name in _warned_env:
        return
    _warned_env.add(name)
    n = len(ENV_PREFIX)  # compared without the prefix every name shares
    near = difflib.get_close_matches(name[n:], [s[n:] for s in _env_settings()], n=1)
    near = [ENV_PREFIX + s for s in near]
    log.warning(
        "env %s: no such setting, ignored (%s; settings are KVTIER_<SECTION>_<KEY> with a "
        "section of %s)",
        name,
        f"did you mean {near[0]}?" if near else "no setting is close",
        ", ".join(_SECTIONS),
    )


def _env_settings() -> list[str]:
    """Every variable name a setting of a section takes, and the other variables read."""
    names = set(_OTHER_ENV)
    for section, cls in _SECTIONS.items():
        keys = [f.name for f in dataclasses.fields(cls) if f.init]
        if section == "store":
            keys = [k for k in keys if k != "options"]
        names.update(f"{ENV_PREFIX}{section}_{k}".upper() for k in keys)
    return sorted(names)


def _build_section(
    name: str,
    values: dict | None,
    sources: dict[str, str],
    backend_of: Mapping[str, str],
) -> Any:
    if values is None:
        return None
    cls = _SECTIONS[name]
    if name == "store":
        return _build_store(values, sources, backend_of)
    return _make(name, cls, values, sources)


_ORDER = ("shipped", "file", "env", "arg")


def _layer(origin: str) -> int:
    return next(i for i, o in enumerate(_ORDER) if origin.startswith(o))


def _build_store(
    values: dict, sources: dict[str, str], backend_of: Mapping[str, str]
) -> StoreConfig:
    """A later layer that switches the backend (`KVTIER_STORE_BACKEND=memory` over a redis
    file) drops the earlier layers' options that the new backend does not take, with a note;
    options the backend does not take from the same or a later layer are errors. A backend
    without a config class (a plugin whose options are a dict) takes every option written
    while it was the backend named (`backend_of`), and none written for another."""
    from kvtier.backends.registry import resolve

    common = {k: values[k] for k in _STORE_COMMON if k in values}
    base = _make("store", StoreConfig, common, sources)
    rest = {k: v for k, v in values.items() if k not in _STORE_COMMON}
    _, options_cls = (None, None) if base.backend == "none" else resolve(base.backend)
    allowed = (
        set()
        if options_cls is None and base.backend == "none"
        else (
            {f.name for f in dataclasses.fields(options_cls)}
            if options_cls is not None
            else set(rest)
        )
    )
    backend_layer = _layer(sources.get("store.backend", "file"))
    dropped = [
        k
        for k in rest
        if (
            k not in allowed
            and _layer(sources.get(f"store.{k}", "file")) < backend_layer
        )
        or (
            options_cls is None
            and base.backend != "none"
            and backend_of.get(k, base.backend) != base.backend
        )
    ]
    for k in dropped:
        log.info(
            "config: store.%s (%s) dropped: store.backend=%r (%s) does not take it",
            k,
            sources.get(f"store.{k}"),
            base.backend,
            sources.get("store.backend"),
        )
        del rest[k]
        sources.pop(f"store.{k}", None)
    if base.backend == "none":
        if rest:
            k = next(iter(rest))
            why = (
                f"not allowed with store.backend='none' ({sources['store.backend']})"
                if "store.backend" in sources
                else "unknown key; store.backend is not set (its default, 'none', takes "
                f"no options): allowed are {', '.join(_STORE_COMMON)} and the options "
                "of the backend it names"
            )
            raise KvtierConfigError(
                f"store.{k}: {why} ({sources.get(f'store.{k}', 'default')})"
            )
        return base
    unknown = [k for k in rest if k not in allowed]
    if unknown:  # all of the store's keys are listed: a typo of a common key is named
        k = unknown[0]
        keys = [*_STORE_COMMON, *(f.name for f in dataclasses.fields(options_cls))]
        near = difflib.get_close_matches(str(k), keys, n=1)
        backend = f"store.backend={base.backend!r}"
        if not sources.get("store.backend", "").startswith("file"):
            backend += f" ({sources.get('store.backend', 'default')})"
        raise KvtierConfigError(
            f"store.{k}: unknown key{f' (did you mean {near[0]!r}?)' if near else ''}; "
            f"allowed with {backend}: {', '.join(keys)} "
            f"({sources.get(f'store.{k}', 'default')})"
        )
    options = (
        _make("store", options_cls, rest, sources)
        if options_cls is not None
        else dict(rest)
    )
    return dataclasses.replace(base, options=options)


def _make(
    section: str,
    cls: type,
    values: Mapping[str, Any],
    sources: Mapping[str, str] | None = None,
) -> Any:
    """Build `cls` from `values`; every error names the field, its value, where it came from
    (file, env variable, argument) and what is allowed, with every secret in it masked."""
    try:
        return _make_section(section, cls, values, sources or {})
    except KvtierConfigError as exc:
        raise KvtierConfigError(scrub_error(str(exc), dict(values))) from None


def _make_section(
    section: str, cls: type, values: Mapping[str, Any], sources: Mapping[str, str]
) -> Any:
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in values.items():
        where = (
            f" ({sources[f'{section}.{key}']})" if f"{section}.{key}" in sources else ""
        )
        if key not in allowed:
            raise KvtierConfigError(
                f"{section}.{key}: unknown key; allowed: {', '.join(allowed)}{where}"
            )
        try:
            if (
                hints[key] is bool
                and isinstance(value, str)
                and sources.get(f"{section}.{key}", "").startswith("file")
            ):
                raise KvtierConfigError(
                    f"{section}.{key}={value!r}: expected true or false "
                    "(quoted, it is a string in YAML)"
                )
            kwargs[key] = _coerce(f"{section}.{key}", hints[key], value)
        except KvtierConfigError as exc:
            if (
                shown(key, value) == "***"
            ):  # a secret's value is never printed, even when wrong
                raise KvtierConfigError(
                    f"{section}.{key}: {str(exc).rpartition(': ')[2]} "
                    f"(the value is not shown: a secret){where}"
                ) from None
            raise KvtierConfigError(f"{exc}{where}") from None
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    missing = [k for k in required if k not in kwargs]
    if missing:  # named, not Python's "missing 2 required positional arguments"
        given = sorted(
            {sources[f"{section}.{k}"] for k in values if f"{section}.{k}" in sources}
        )
        where = f" ({', '.join(given)})" if given else ""
        raise KvtierConfigError(
            f"{section}: {', '.join(missing)} required (a {section} section sets "
            f"{', '.join(required)} at least){where}"
        )
    try:
        return cls(**kwargs)
    except KvtierConfigError:
        raise
    except (ValueError, TypeError) as exc:
        name = str(exc).split("=", 1)[0].strip()
        where = (
            f" ({sources[f'{section}.{name}']})"
            if f"{section}.{name}" in sources
            else ""
        )
        raise KvtierConfigError(f"{section}: {exc}{where}") from exc


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """Check (YAML) or convert (env strings) `value` to `hint`; error names field and value
    (a secret's value as ***)."""
    try:
        return _coerce_value(name, hint, value)
    except KvtierConfigError as exc:
        if shown(name.rpartition(".")[2], value) == "***":
            raise KvtierConfigError(str(exc).replace(repr(value), "***")) from None
        raise


def _coerce_value(name: str, hint: Any, value: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (
            isinstance(value, str) and value.lower() in ("null", "none", "~")
        ):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce_value(name, inner[0], value) if len(inner) == 1 else value
    if origin is Literal:
        if value not in args:
            raise KvtierConfigError(
                f"{name}={value!r}: allowed values are {', '.join(map(str, args))}"
            )
        return value
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            raise KvtierConfigError(
                f"{name}={value!r}: allowed values are {', '.join(e.value for e in hint)}"
            ) from None
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in (
            "1",
            "true",
            "yes",
            "on",
            "0",
            "false",
            "no",
            "off",
        ):
            return value.lower() in ("1", "true", "yes", "on")
        raise KvtierConfigError(f"{name}={value!r}: expected true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""), 0)
            except ValueError:
                pass
        raise KvtierConfigError(f"{name}={value!r}: expected an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise KvtierConfigError(f"{name}={value!r}: expected a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise KvtierConfigError(f"{name}={value!r}: expected a string")
    return value
