"""Radix tree ops/s and match-time scaling. See kvtier/bench/tree.py."""

from kvtier.bench.tree import main

if __name__ == "__main__":
    main()
