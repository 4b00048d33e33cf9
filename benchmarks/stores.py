"""Store set/get throughput against raw clients. See kvtier/bench/stores.py."""

from kvtier.bench.stores import main

if __name__ == "__main__":
    main()
