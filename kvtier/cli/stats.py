"""`tierctl stats`: a running server's per-tier stats, or what a store holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import urllib.error
import urllib.request

from kvtier.errors import KvtierConfigError, KvtierError, StoreError


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--url", help="a running `tierctl serve`, e.g. http://127.0.0.1:9400"
    )
    src.add_argument(
        "--config", help="inspect the store this config names, without a server"
    )
    p.add_argument(
        "--token",
        default=None,
        help="with --url: the server's token (or env KVTIER_SERVE_TOKEN)",
    )
    p.add_argument("--json", action="store_true")


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


def run(args) -> int:
    token = args.token or os.environ.get("KVTIER_SERVE_TOKEN") or None
    data = _from_url(args.url, token) if args.url else _from_store(args.config)
    print(
        json.dumps(data, indent=2)
        if args.json
        else (_server_table(data) if args.url else _store_table(data))
    )
    return 0


def _from_url(url: str, token: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url.rstrip("/") + "/stats", headers=headers),
            timeout=10,
        ) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        why = (
            "send its token: --token or KVTIER_SERVE_TOKEN"
            if exc.code == 401
            else exc.reason
        )
        raise StoreError(
            f"cannot read stats from {url}: HTTP {exc.code} ({why})"
        ) from None
    except (OSError, ValueError) as exc:
        raise StoreError(f"cannot read stats from {url}: {exc}") from None


def _from_store(path: str) -> dict:
    cfg, store = _store_from(path)

    async def inspect():
        try:
            return await store.inventory()
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

    inv = asyncio.run(inspect())
    return {"store": cfg.store.backend, **inv}


def _server_table(s: dict) -> str:
    lines = ["tier     total     free  evictable  protected"]
    for tier, t in s["tiers"].items():
        lines.append(
            f"{tier:7s} {t['total_tokens']:6d} {t['free_tokens']:8d} {t['evictable_tokens']:10d} "
            f"{t['protected_tokens']:10d}"
        )
    c = s["counters"]
    lines += [
        f"hits     device {c['device_hit_tokens']}  host {c['host_hit_tokens']}  store {c['storage_hit_tokens']}  "
        f"miss {c['miss_tokens']} (of {c['lookup_tokens']} tokens looked up)",
        f"moved    dev->host {_mib(c['d2h_bytes'])}  host->dev {_mib(c['h2d_bytes'])}  "
        f"host->store {_mib(c['l3_write_bytes'])}  store->host {_mib(c['l3_read_bytes'])}",
        f"evicted  device {c['device_evicted_tokens']}  host {c['host_evicted_tokens']} tokens",
    ]
    if "store" in s:
        st = s["store"]
        lines.append(
            f"store    {st['store']}: hits {st['hits']} misses {st['misses']} "
            f"frame failures {st['frame_failures']} errors {st['errors']} timeouts {st['timeouts']}"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _store_table(d: dict) -> str:
    lines = [
        f"store {d['store']}: {d['pages']} pages, {_mib(d['bytes'])}",
        "namespace                         pages",
    ]
    lines += [f"{ns}  {n}" for ns, n in sorted(d["namespaces"].items())]
    return "\n".join(lines)
