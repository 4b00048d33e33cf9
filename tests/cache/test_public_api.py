"""The public face of kvtier: what `from kvtier import ...` offers, pinned."""

import subprocess
import sys

import kvtier

PUBLIC = [
    "Acquired",
    "DeviceAllocator",
    "DeviceKVPool",
    "KvtierConfig",
    "KvtierConfigError",
    "KvtierError",
    "LayerWaiter",
    "LeaseBoundError",
    "LeaseBounds",
    "PoolConfig",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "TieredCache",
    "TransferError",
    "load_config",
]


def test_the_public_names_are_pinned_and_each_resolves():
    assert kvtier.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(kvtier, name).__name__ == name
    assert issubclass(kvtier.TransferError, kvtier.KvtierError)
    assert kvtier.TieredCache.__module__ == "kvtier.cache.facade"


def test_an_unknown_name_is_an_attribute_error():
    try:
        kvtier.Applier  # noqa: B018
    except AttributeError as exc:
        assert "no attribute 'Applier'" in str(exc)
    else:
        raise AssertionError("kvtier.Applier resolved")


def test_import_kvtier_alone_does_not_import_torch():
    code = (
        "import sys, kvtier; assert 'torch' not in sys.modules; "
        "from kvtier import TieredCache, load_config, TransferError; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert (
        out.stdout.strip() == "True"
    )  # TieredCache needs it; the bare package does not
