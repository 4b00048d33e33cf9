"""kvtier's own small exception tree. Client errors are mapped onto it at the boundary."""


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


class KvtierConfigError(KvtierError, ValueError):
    """A caller's mistake in configuration: names the field, the value and what is allowed."""


class StoreError(KvtierError):
    """An L3 store operation failed (the backend's own error is chained as __cause__)."""


class StoreTimeout(StoreError):
    """An L3 store operation did not finish within its configured timeout."""


class StoreUnavailable(StoreError):
    """The L3 store could not be reached (connection refused, reset, DNS...)."""


class StoreKeyError(StoreError, ValueError):
    """A key is not of the form `<prefix>/<namespace id>/<hex page hash>`."""
