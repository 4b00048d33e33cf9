"""numpy gives up the GIL for an elementwise op over more than 500 elements
(NPY_BEGIN_THREADS_THRESHOLDED) and for every sort. On the scheduler thread each hand-off
may cost a switch interval (docs/design.md §2), so its hot paths work in pieces of at most
GIL_CHUNK elements. No torch here: the CLI's help must not import it."""

import sys

GIL_CHUNK = 500
HIGH = 1 if sys.byteorder == "little" else 0  # the upper 32 bits of an int64, viewed as two uint32s
