"""tierctl: kvtier's command line."""

from __future__ import annotations

import argparse
import sys

import kvtier


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierctl", description="kvtier: hierarchical KV-cache tiering")
    p.add_argument("--version", action="version", version=f"tierctl {kvtier.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="build a pool and a mirror, move pages both ways, print GB/s")
    demo.add_argument("--gib", type=float, default=0.25, help="bytes of pages to move (default 0.25 GiB)")
    demo.set_defaults(func=_demo)
    return p


def _demo(args: argparse.Namespace) -> int:
    from kvtier.bench.transfer import run

    run(gib=args.gib, repeat=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
