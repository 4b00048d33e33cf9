"""kvtier's own small exception tree (client errors are mapped onto it at the boundary),
and how repeated failures are logged."""

import logging
from collections.abc import Awaitable


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


class KvtierConfigError(KvtierError, ValueError):
    """A caller's mistake in configuration: names the field, the value and what is allowed."""


class StoreError(KvtierError):
    """An L3 store operation failed (the backend's own error is chained as __cause__)."""


class StoreTimeout(StoreError):
    """An L3 store operation did not finish within its configured timeout.

    `settled`: None, or an awaitable that ends once the call has really stopped touching
    the caller's buffers (a timed-out thread job finishes its page first); its result is
    a `StoreAbandoned` when the call's threads were given up on stuck. Buffers are the
    caller's again only after it."""

    def __init__(self, message: str = "", settled: Awaitable | None = None) -> None:
        super().__init__(message)
        self.settled = settled


class StoreAbandoned(StoreTimeout):
    """A store call stuck in the kernel (a hung mount) was given up on: its threads may still
    write the buffers it was given, which stay out of use for good."""


class StoreDown(StoreError):
    """The breaker kept a call from the store: it is down after failed calls (no call was
    made, so nothing is known of the keys)."""


class StoreUnavailable(StoreError):
    """The L3 store could not be reached (connection refused, reset, DNS...)."""


class StoreKeyError(StoreError, ValueError):
    """A key is not of the form `<prefix>/<namespace id>/<hex page hash>`."""


class TransferError(KvtierError):
    """A pool<->mirror copy failed; the pages it was moving are not usable."""


class Complaints:
    """Logs the first failure of each kind, then every `every`-th with the running count. A
    sick store fails every call: a line per call would bury the log (counters keep them all)."""

    def __init__(
        self, logger: logging.Logger, prefix: str = "", every: int = 100
    ) -> None:
        self.log, self.prefix, self.every = logger, prefix, every
        self.seen: dict[str, int] = {}

    def __call__(self, kind: str, message: str) -> None:
        seen = self.seen.get(kind, 0) + 1
        self.seen[kind] = seen
        if seen == 1:
            self.log.warning("%s%s", self.prefix, message)
        elif seen % self.every == 0:
            self.log.warning(
                "%s%d %s failures so far; latest: %s", self.prefix, seen, kind, message
            )


class LogOnce:
    """Logs the first failure of each kind at ERROR, the rest at DEBUG (counters carry them)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.log = logger
        self.seen: set[str] = set()

    def __call__(self, kind: str, message: str) -> None:
        if kind in self.seen:
            self.log.debug("%s", message)
        else:
            self.seen.add(kind)
            self.log.error(
                "%s (further %s failures are counted in stats, not logged)",
                message,
                kind,
            )
