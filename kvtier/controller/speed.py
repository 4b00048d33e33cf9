"""Is loading from the store faster than recomputing? The cache must never make a request
slower than no cache.

The storage thread measures the store: `call_s`, the time of one call that moves no pages
(`batch_exists`: a round trip), and `page_s`, the time per page of a read beyond that round
trip. A prefetch of `pages` pages read in `calls` calls is then expected to take
`calls * call_s + pages * page_s`. The engine reports its prefill rate (tokens/s); when the
load of a prefetch is expected to take longer than computing its tokens, the prefetch is
skipped: its pages are misses, agreed like any other prefetch result (`present: 0`).

Until the engine reports a rate, or the store has been measured, nothing is skipped. While
loads are being skipped, one prefetch per `probe_s` still goes through so that the
estimate follows a store that got faster. Averages are exponential (weight `alpha`).
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Callable


class LoadSpeed:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        probe_s: float = 1.0,
        alpha: float = 0.2,
    ) -> None:
        self.clock = clock
        self.probe_s = probe_s
        self.alpha = alpha
        self.call_s: float | None = None
        self.page_s: float | None = None
        self._prefill: float | None = None  # tokens/s; written by the scheduler thread
        self._lock = threading.Lock()
        self.next_probe = 0.0
        self.skipped = 0
        self.skipped_tokens = 0
        self.probes = 0

    # -- the engine (scheduler thread) -----------------------------------------------------

    def set_prefill_rate(self, tokens_per_s: float | None) -> None:
        if tokens_per_s is not None and not (
            isinstance(tokens_per_s, (int, float))
            and tokens_per_s > 0
            and math.isfinite(tokens_per_s)
        ):
            raise ValueError(
                f"prefill tokens_per_s={tokens_per_s!r}: must be a finite number > 0, or None"
            )
        with self._lock:
            self._prefill = None if tokens_per_s is None else float(tokens_per_s)

    def report_prefill(self, tokens: int, seconds: float) -> None:
        """One prefill the engine ran: `tokens` computed in `seconds` (averaged in; bad
        values are refused, see `prefill_rate`)."""
        rate = prefill_rate(tokens, seconds)
        if rate is None:
            return
        with self._lock:
            self._prefill = (
                rate
                if self._prefill is None
                else self._prefill + self.alpha * (rate - self._prefill)
            )

    @property
    def prefill_tokens_per_s(self) -> float | None:
        with self._lock:
            return self._prefill

    # -- the storage thread ----------------------------------------------------------------

    def observe_call(self, seconds: float) -> None:
        self.call_s = self._avg(self.call_s, max(0.0, seconds))

    def observe_read(self, pages: int, seconds: float) -> None:
        if pages > 0:
            self.page_s = self._avg(
                self.page_s, max(0.0, seconds - (self.call_s or 0.0)) / pages
            )

    def expected_s(self, pages: int, calls: int) -> float | None:
        if self.call_s is None or self.page_s is None:
            return None
        return calls * self.call_s + pages * self.page_s

    def worth_loading(self, pages: int, calls: int, tokens: int) -> bool:
        """False when loading `pages` (in `calls` reads) is expected to take longer than
        prefilling their `tokens` (then counted as skipped)."""
        prefill = self.prefill_tokens_per_s
        expected = self.expected_s(pages, calls)
        if prefill is None or expected is None or expected <= tokens / prefill:
            return True
        now = self.clock()
        if now >= self.next_probe:
            self.next_probe = now + self.probe_s
            self.probes += 1
            return True
        self.skipped += 1
        self.skipped_tokens += tokens
        return False

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def stats(self) -> dict:
        prefill = self.prefill_tokens_per_s
        return {
            "prefetch_skipped_slow": self.skipped,
            "prefetch_skipped_slow_tokens": self.skipped_tokens,
            "store_call_ms": None if self.call_s is None else self.call_s * 1e3,
            "store_page_ms": None if self.page_s is None else self.page_s * 1e3,
            "prefill_tokens_per_s": prefill,
        }


def prefill_rate(tokens: int, seconds: float) -> float | None:
    """Tokens/s of one prefill the engine reports; None for one that computed nothing, or
    too short for the clock to see (0 s): it teaches nothing. A negative, infinite or NaN
    value, or one that is not a number, is an engine bug and raises ValueError naming it:
    averaged in, it would make every load look slower (or faster) than recomputing."""
    if (
        isinstance(tokens, bool)
        or not isinstance(tokens, numbers.Integral)
        or tokens < 0
    ):
        raise ValueError(f"report_prefill: tokens={tokens!r}: must be an integer >= 0")
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, numbers.Real)
        or not 0 <= seconds < math.inf
    ):
        raise ValueError(
            f"report_prefill: seconds={seconds!r}: must be a finite number >= 0"
        )
    if tokens == 0 or seconds == 0:
        return None
    rate = tokens / seconds
    if not math.isfinite(rate):  # a subnormal `seconds`: no clock measures that
        raise ValueError(
            f"report_prefill: {tokens} tokens in seconds={seconds!r}: not a measurable rate"
        )
    return rate
