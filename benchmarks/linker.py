"""kvtier's SGLang linker against SGLang's HiCache under SGLang's UnifiedRadixCache. See
kvtier/bench/linker.py."""

import sys

from kvtier.bench.linker import main

if __name__ == "__main__":
    sys.exit(main())
