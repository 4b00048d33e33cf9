"""What a vLLM job's keys resolve to is remembered (the tier's `StoreKeys`, the file
store's `PageLocations`), bounded, and always what it would be made afresh: the store key
format is pinned (docs/formats.md), a tenant's keys go through its keyed hash, and a bad
key is refused by name whether it was seen before or not."""

import os

import pytest

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.backends.file_direct import PageLocations
from kvtier.errors import StoreKeyError
from kvtier.hashing import KeyedHash, key_maker
from kvtier.integrations.vllm.keys import StoreKeys, page_hash_of

NS = "0123456789abcdef0123456789abcdef"


def offload_keys(n: int) -> list[bytes]:
    return [os.urandom(32) + b"\0\0\0\0" for _ in range(n)] + [
        os.urandom(32) + b"\0\0\0\1"  # another KV group: through the tagged sha256
    ]


@pytest.mark.parametrize("keyed", [None, KeyedHash(b"k" * 32, "sha256", "kid")])
def test_store_keys_stay_the_keys_made_afresh_past_their_bound(keyed):
    make = key_maker("kvtier", NS)
    keys = StoreKeys(make, keyed, bound=8)
    sample = offload_keys(20)
    for _ in range(3):  # made, remembered, dropped and made again
        assert keys(sample) == [make(page_hash_of(k, keyed)) for k in sample]
        assert keys(sample[:3]) == [make(page_hash_of(k, keyed)) for k in sample[:3]]
        assert len(keys._known) <= 8
    plain = StoreKeys(make, None)(sample)
    tenant = StoreKeys(make, KeyedHash(b"t" * 32, "sha256", "t"))(sample)
    assert not set(plain) & set(tenant)


def test_store_keys_refuse_what_is_not_an_offload_key_by_name():
    keys = StoreKeys(key_maker("kvtier", NS), None)
    good = offload_keys(1)
    keys(good)
    for bad in (b"abc", "x" * 36, [1, 2]):
        with pytest.raises(ValueError, match="OffloadKey"):
            keys([*good, bad])


def test_page_locations_are_the_stores_paths_past_their_bound(tmp_path):
    store = FileStore(FileStoreConfig(root=str(tmp_path / "l3")))
    make = key_maker("kvtier", NS)
    full = [make(page_hash_of(k)) for k in offload_keys(20)]
    where = PageLocations(str(store.root), bound=8)
    for _ in range(3):
        got = where(full)
        assert [w[0] for w in got] == [str(store.path(k)) for k in full]
        assert [(w[1], w[2]) for w in got] == [
            (NS, bytes.fromhex(k.rsplit("/", 1)[1])) for k in full
        ]
        assert len(where._known) <= 8


def test_page_locations_refuse_a_bad_key_by_name(tmp_path):
    where = PageLocations(str(tmp_path))
    good = key_maker("kvtier", NS)(bytes(32))
    where([good])
    for bad in ("kvtier/../" + NS + "/" + "0" * 64, "kvtier/" + NS + "/xyz", b"k"):
        with pytest.raises(StoreKeyError, match="key="):
            where([good, bad])
    with pytest.raises(ValueError, match="one string"):
        where(good)


def test_keys_that_are_no_collection_are_refused_by_name(tmp_path):
    """Not a collection at all: the `keys` argument named, not a crash on a variable
    the loop never bound."""
    for resolve in (PageLocations(str(tmp_path)), StoreKeys(key_maker("k", NS), None)):
        for bad in (None, 5):
            with pytest.raises(ValueError, match=f"keys={bad!r}: expected"):
                resolve(bad)
