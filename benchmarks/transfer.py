"""Pool <-> mirror transfer GB/s against memcpy of the same bytes. See kvtier/bench/transfer.py."""

from kvtier.bench.transfer import main

if __name__ == "__main__":
    main()
