"""tierctl: kvtier's command line.

    tierctl replay [--config FILE] [--workload multiturn] [--requests N] [--verify] [--plot PNG] [--json]
    tierctl serve  [--config FILE] [--host 127.0.0.1] [--port 9400]
    tierctl stats  (--url URL | --config FILE) [--json]
    tierctl bench  transfer|stores|tree|cache|vllm_tier
    tierctl store  ls|du|verify [--prune]|purge (--namespace ID|--tenant SALT|--older-than 7d) [--config FILE]
    tierctl config [--config FILE]      (every setting and where it came from)

Bad flags, a missing or invalid config: exit code 2 and one line naming the problem.
"""

from __future__ import annotations

import argparse
import os
import sys

import kvtier
from kvtier.errors import KvtierConfigError, KvtierError

EXIT_USAGE = 2


def shipped_default() -> str:
    """kvtier.config.shipped_default, imported when a command runs (`--help` imports no
    torch)."""
    from kvtier.config import shipped_default

    return shipped_default()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


BENCHMARKS = ["transfer", "stores", "tree", "cache", "vllm_tier"]


def build_parser() -> argparse.ArgumentParser:
    from kvtier.cli import replay, serve, stats, store

    p = _Parser(prog="tierctl", description="kvtier: hierarchical KV-cache tiering")
    p.add_argument(
        "--version", action="version", version=f"tierctl {kvtier.__version__}"
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    r = sub.add_parser(
        "replay", help="run the reference engine on a workload, print hits per tier"
    )
    replay.add_arguments(r)
    r.set_defaults(func=lambda a: replay.run(a, shipped_default()))
    s = sub.add_parser(
        "serve",
        help="the reference engine behind HTTP (/generate /metrics /stats /flush)",
    )
    serve.add_arguments(s)
    s.set_defaults(func=lambda a: serve.run(a, shipped_default()))
    st = sub.add_parser(
        "stats", help="per-tier stats of a running server, or a store's contents"
    )
    stats.add_arguments(st)
    st.set_defaults(func=stats.run)
    so = sub.add_parser(
        "store", help="maintain an L3 store: ls, du, verify [--prune], purge"
    )
    store.add_arguments(so)
    so.set_defaults(func=lambda a: store.run(a, shipped_default()))
    b = sub.add_parser(
        "bench", help="benchmarks against baselines measured in the same run"
    )
    b.add_argument("name", nargs="?", choices=BENCHMARKS)
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    b.set_defaults(func=_bench)
    c = sub.add_parser("config", help="print every setting and where it came from")
    c.add_argument("--config", default=None)
    c.set_defaults(func=_config)
    return p


def _bench(args) -> int:
    import importlib

    if args.name is None:
        raise KvtierConfigError(
            f"bench: name a benchmark: {', '.join(BENCHMARKS[:-1])} or {BENCHMARKS[-1]} "
            "(`tierctl bench NAME --help` for its options)"
        )
    importlib.import_module(f"kvtier.bench.{args.name}").main(
        args.rest, prog=f"tierctl bench {args.name}"
    )
    return 0


def _config(args) -> int:
    from kvtier.config import explain, load_config

    from kvtier.engine.engine import torch_threads

    threads, origin = torch_threads()
    print(explain(load_config(args.config, base=shipped_default())))
    print(
        f"engine.torch_threads = {threads}  ({origin}; tierctl replay and serve run the reference model with it)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in a message at exit
        return code
    except BrokenPipeError:  # `tierctl config | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (KvtierError, ValueError, OSError) as exc:
        sys.stderr.write(f"tierctl: {_one_line(exc)}\n")
        return EXIT_USAGE


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return (text.splitlines() or [type(exc).__name__])[0]


if __name__ == "__main__":
    sys.exit(main())
