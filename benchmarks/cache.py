"""Hit rate per tier against the infinite-cache bound. See kvtier/bench/cache.py."""

from kvtier.bench.cache import main

if __name__ == "__main__":
    main()
