"""`tierctl store`: maintenance of an L3 store (file, redis, s3 or a plugin).

    tierctl store ls     [--config C] [--json]      namespaces: model, dtype, layout, pages, bytes, age
    tierctl store du     [--config C] [--json]      bytes per namespace and in all
    tierctl store verify [--config C] [--prune]     read every page: good / bad / orphaned; exit 1 if bad
    tierctl store purge  [--config C] (--namespace ID | --tenant [SALT] | --older-than 7d) [--dry-run]

Every command streams the store in batches (SCAN on Redis, list pages on S3); a progress
line is drawn on a terminal. The page and manifest formats: docs/formats.md. With a tenant
key in the config (`namespace.tenant_key`), `verify` authenticates that tenant's sealed
pages and `purge --tenant` also finds them by their seal (docs/security.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import time
from collections import defaultdict

from kvtier.backends import frame, seal
from kvtier.errors import KvtierConfigError, KvtierError, StoreError
from kvtier.hashing import split_key

BATCH = 256
# bytes of pages one check reads at once, by their listed sizes (one page at least): each
# value is bounded by max_page_bytes, but anyone who can write the store lists 256 huge ones
BATCH_BYTES = 64 << 20


def add_arguments(p) -> None:
    sub = p.add_subparsers(
        dest="action", metavar="ACTION", required=True, parser_class=type(p)
    )
    for name, text in (
        ("ls", "namespaces in the store"),
        ("du", "bytes per namespace"),
        ("verify", "read and check every page"),
        ("purge", "delete a namespace, a tenant or old pages"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument(
            "--config",
            default=None,
            help="a YAML file or a shipped config name (default: default)",
        )
        s.add_argument("--json", action="store_true")
        if name == "verify":
            s.add_argument(
                "--prune",
                action="store_true",
                help="delete the pages that do not verify",
            )
        if name == "purge":
            which = s.add_mutually_exclusive_group(required=True)
            which.add_argument(
                "--namespace",
                type=_namespace_id,
                help="a namespace id (see `tierctl store ls`)",
            )
            which.add_argument(
                "--tenant",
                nargs="?",
                const="",
                metavar="SALT",
                help="a tenant salt: every namespace made with it; alone: the --config's tenant "
                "(its salt, and every page sealed with its tenant key, manifest or not)",
            )
            which.add_argument(
                "--older-than",
                type=_age,
                help="pages written longer ago than this: 90m, 12h, 7d",
            )
            s.add_argument(
                "--dry-run",
                action="store_true",
                help="say what would go, delete nothing",
            )


def _age(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a number and a unit s, m, h or d (e.g. 7d)"
        )
    return float(m[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]]


def _store_from(config_path: str):
    from kvtier.backends.registry import build_store
    from kvtier.config import shipped_default
    from kvtier.config import load_config

    cfg = load_config(config_path, base=shipped_default())
    if cfg.store.backend == "none":
        raise KvtierConfigError(
            f"{config_path}: store.backend is 'none': no store here"
        )
    return cfg, build_store(cfg.store.backend, cfg.store.options, cfg.store.timeout_s)


def run(args, default_config: str) -> int:
    cfg, store = _store_from(args.config or default_config)
    action = {"ls": _ls, "du": _du, "verify": _verify, "purge": _purge}[args.action]
    args.tenant_config = (
        cfg.namespace
    )  # the config's tenant: its salt and key ring (verify, purge)
    args.loaded_config = cfg  # the namespace ids it makes (purge --tenant)

    async def go():
        try:
            return await action(store, cfg.store.key_prefix, args)
        except KvtierError:
            raise
        except (
            Exception
        ) as exc:  # the store's client outside a timed call (a listing): one line
            raise StoreError(
                f"{store.name} store: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            with contextlib.suppress(Exception):
                await store.close()

    return asyncio.run(go())


class _Progress:
    def __init__(self, what: str) -> None:
        self.what, self.n, self.tty = what, 0, sys.stderr.isatty()

    def add(self, n: int) -> None:
        self.n += n
        if self.tty:
            sys.stderr.write(f"\r{self.what}: {self.n} pages")
            sys.stderr.flush()

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


async def _by_namespace(store, prefix: str, what: str) -> dict[str, dict]:
    spaces: dict[str, dict] = defaultdict(
        lambda: {
            "pages": 0,
            "bytes": 0,
            "oldest": None,
            "newest": None,
            "keys": [],
            "sizes": [],
        }
    )
    progress = _Progress(what)
    async for batch in store.scan(BATCH):
        for p in batch:
            pre, ns, _ = split_key(p.key)
            if pre != prefix:
                continue
            s = spaces[ns]
            s["pages"] += 1
            s["bytes"] += p.size
            s["keys"].append((p.key, p.mtime))
            s["sizes"].append(p.size)
            if p.mtime is not None:
                s["oldest"] = (
                    p.mtime if s["oldest"] is None else min(s["oldest"], p.mtime)
                )
                s["newest"] = (
                    p.mtime if s["newest"] is None else max(s["newest"], p.mtime)
                )
        progress.add(len(batch))
    progress.done()
    return dict(spaces)


async def _ls(store, prefix, args) -> int:
    spaces = await _by_namespace(store, prefix, "listing")
    rows = []
    for ns, s in sorted(spaces.items()):
        m = await store.get_manifest(prefix, ns) or {}
        rows.append(
            {
                "namespace": ns,
                "model_id": m.get("model_id"),
                "revision": m.get("revision"),
                "dtype": m.get("dtype"),
                "layout": m.get("layout"),
                "page_size": m.get("page_size"),
                "store_pages": m.get("store_pages", 1) if m else None,
                "tenant": m.get("tenant"),
                "pages": s["pages"],
                "bytes": s["bytes"],
                "oldest": s["oldest"],
                "newest": s["newest"],
                "manifest": bool(m),
            }
        )
    if args.json:
        print(json.dumps({"store": store.name, "namespaces": rows}, indent=2))
        return 0
    print(
        f"store {store.name}: {len(rows)} namespaces, {sum(r['pages'] for r in rows)} pages, "
        f"{_size(sum(r['bytes'] for r in rows))}"
    )
    print(
        f"{'namespace':32}  {'model':24} {'dtype':8} {'page':>5} {'tenant':16} {'pages':>7} {'size':>10}  newest"
    )
    for r in rows:
        print(
            f"{r['namespace']:32}  {_shown(r['model_id'] or '(no manifest)')[:24]:24} {_shown(r['dtype'] or '-'):8} "
            f"{_page(r):>5} {_shown(r['tenant'] or '-'):16} {r['pages']:>7} "
            f"{_size(r['bytes']):>10}  {_when(r['newest'])}"
        )
    return 0


def _page(row: dict) -> str:
    """A namespace's page size, and the device pages in a store page where several (`16x4`)."""
    size, group = _shown(row["page_size"] or "-"), row["store_pages"]
    return f"{size}x{group}" if isinstance(group, int) and group > 1 else size


async def _du(store, prefix, args) -> int:
    spaces = await _by_namespace(store, prefix, "measuring")
    total = sum(s["bytes"] for s in spaces.values())
    if args.json:
        print(
            json.dumps(
                {
                    "store": store.name,
                    "bytes": total,
                    "namespaces": {ns: s["bytes"] for ns, s in sorted(spaces.items())},
                },
                indent=2,
            )
        )
        return 0
    for ns, s in sorted(spaces.items(), key=lambda kv: -kv[1]["bytes"]):
        print(f"{_size(s['bytes']):>10}  {ns}")
    print(f"{_size(total):>10}  total ({store.name})")
    return 0


def check_batches(space: dict):
    """A namespace's page keys (its listing, `_by_namespace`) in batches to read at once: at
    most BATCH pages and BATCH_BYTES by their listed sizes, one page at least."""
    chunk: list[str] = []
    total = 0
    for (key, _), size in zip(space["keys"], space["sizes"]):
        if chunk and (len(chunk) == BATCH or total + size > BATCH_BYTES):
            yield chunk
            chunk, total = [], 0
        chunk.append(key)
        total += size or 0  # a plugin that lists no size: counted by pages
    if chunk:
        yield chunk


class _AnyFrame:
    """The codec for a namespace without a manifest: a plain frame is checked as plain, a
    sealed one with the config's keys (ForeignKey where it names a key not given)."""

    def __init__(self, sealed: seal.SealedCodec | None) -> None:
        self.sealed = sealed

    def decode(self, blob, ns: str, h: bytes):
        if seal.key_id_of(blob) is None:
            return frame.PLAIN.decode(blob, ns, h)
        if self.sealed is None:
            raise seal.ForeignKey("sealed with a tenant key, and --config gives none")
        return self.sealed.decode(blob, ns, h)


def _codec_for(manifest: dict | None, keys) -> object | None:
    """How `verify` checks a namespace's pages: sealed with the config's keys where its
    manifest names one of them (then every page must authenticate: strict), per frame where
    it names no key or has no manifest (a manifest is anyone's to write: a sealed page that
    authenticates is never pruned for what it says), or None for a namespace sealed with a
    key the config does not give (not checked)."""
    sealed = None if keys is None else seal.SealedCodec(keys)
    key_id = None if manifest is None else manifest.get("tenant_key_id")
    if key_id is None:
        return _AnyFrame(sealed)
    return sealed if keys is not None and key_id in keys.ids else None


async def _verify(store, prefix, args) -> int:
    """good: frame and checksum (or seal) verify; bad: they do not; orphaned: a namespace
    without a manifest (written by something else, or its manifest was lost); foreign:
    sealed with a tenant key the config does not give (not checked, never pruned)."""
    spaces = await _by_namespace(store, prefix, "listing")
    keys = args.tenant_config.tenant_keys()
    good = bad = orphaned = pruned = foreign = 0
    bad_keys: list[tuple[str, str]] = []
    progress = _Progress("verifying")
    for ns, s in sorted(spaces.items()):
        manifest = await store.get_manifest(prefix, ns)
        codec = _codec_for(manifest, keys)
        page_keys = [k for k, _ in s["keys"]]
        if codec is None:
            foreign += len(page_keys)
            continue
        for chunk in check_batches(s):
            verdicts = await store.check(chunk, codec)
            for k, why in zip(chunk, verdicts):
                if why is None:
                    good += 1
                    orphaned += manifest is None
                elif isinstance(why, seal.ForeignKey) and isinstance(
                    codec, _AnyFrame
                ):  # else strict: our key's
                    foreign += 1
                elif why != "missing":  # deleted meanwhile: nothing to say
                    bad += 1
                    bad_keys.append((k, str(why)))
            progress.add(len(chunk))
    progress.done()
    if args.prune and bad_keys:
        pruned = await store.delete([k for k, _ in bad_keys])
    if args.json:
        print(
            json.dumps(
                {
                    "store": store.name,
                    "good": good,
                    "bad": bad,
                    "orphaned": orphaned,
                    "foreign": foreign,
                    "pruned": pruned,
                    "bad_pages": [{"key": k, "why": w} for k, w in bad_keys],
                },
                indent=2,
            )
        )
    else:
        print(
            f"store {store.name}: {good} good, {bad} bad, {orphaned} orphaned (no manifest)"
            + (
                f", {foreign} sealed with keys not given (not checked)"
                if foreign
                else ""
            )
            + (f", {pruned} bad pages deleted" if args.prune else "")
        )
        for k, why in bad_keys[:20]:
            print(f"  bad: {k}: {why}")
        if len(bad_keys) > 20:
            print(f"  ... {len(bad_keys) - 20} more")
    return 1 if bad and not args.prune else 0


async def _purge(store, prefix, args) -> int:
    spaces = await _by_namespace(store, prefix, "listing")
    victims: list[str] = []
    if args.namespace:
        victims = [k for k, _ in spaces.get(args.namespace, {"keys": []})["keys"]]
    elif args.tenant is not None:
        victims = await _tenant_pages(store, prefix, spaces, args)
    else:
        ages = [t for s in spaces.values() for _, t in s["keys"]]
        if ages and all(t is None for t in ages):
            raise KvtierConfigError(
                f"purge --older-than: the {store.name} store keeps no write times; "
                "expire pages with the store's own TTL instead (store.ttl_s on redis)"
            )
        cutoff = time.time() - args.older_than
        victims = [
            k
            for s in spaces.values()
            for k, t in s["keys"]
            if t is not None and t < cutoff
        ]
    if args.dry_run:
        print(f"would delete {len(victims)} pages")
        return 0
    deleted = 0
    progress = _Progress("deleting")
    for start in range(0, len(victims), BATCH):
        deleted += await store.delete(victims[start : start + BATCH])
        progress.add(len(victims[start : start + BATCH]))
    progress.done()
    print(f"deleted {deleted} pages")
    return 0


async def _tenant_pages(store, prefix, spaces: dict, args) -> list[str]:
    """A tenant's pages, from what proves them its own (`store_tenant`): with the tenant's
    key, every page that authenticates under it; with a salt, the namespaces made with it.
    What a manifest claims but nothing proves is said, and kept."""
    from kvtier.cli.store_tenant import tenant_pages

    mine = args.tenant_config
    salt = args.tenant or mine.tenant_salt
    keys = mine.tenant_keys() if salt == mine.tenant_salt else None
    if salt is None and keys is None:
        raise KvtierConfigError(
            "purge --tenant: give a SALT, or a --config with namespace.tenant_salt or "
            "namespace.tenant_key"
        )
    found = await tenant_pages(
        store, prefix, spaces, args.loaded_config, salt, keys, batches=check_batches
    )
    for line in found.unproven:
        print(f"not proven the tenant's: {line}")
    return found.victims


def _shown(value) -> str:
    """A manifest field for a terminal: what another writer put there is escaped (no
    control or escape sequence reaches the terminal)."""
    text = str(value)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _namespace_id(text: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{32}", text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a namespace id is 32 lowercase hex digits "
            "(see `tierctl store ls`)"
        )
    return text


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
