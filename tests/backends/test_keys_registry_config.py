import textwrap

import numpy as np
import pytest

from kvtier.backends.file import FileStore, FileStoreConfig
from kvtier.backends.frame import HEADER_SIZE
from kvtier.backends.registry import build_store, known_names, resolve
from kvtier.config import explain, load_config
from kvtier.errors import KvtierConfigError, StoreKeyError
from kvtier.hashing import (
    Namespace,
    key_maker,
    make_key,
    page_hashes,
    split_key,
    validate_key,
)
from tests.backends.stores import NS, new_key


def test_hash_chain_is_pure_and_covers_every_input():
    toks = np.arange(64)
    a = page_hashes(toks, 16, NS)
    assert len(a) == 4 and a == page_hashes(toks, 16, NS)
    assert page_hashes(toks[:48], 16, NS) == a[:3]  # a chain: prefixes share hashes
    assert page_hashes(toks[32:], 16, NS, prev=a[1]) == a[2:]
    assert page_hashes(toks, 16, NS, extra_key="lora-1") != a
    assert page_hashes(toks, 16, "f" * 32) != a
    assert (
        page_hashes(toks, 16, NS, algo="xxh3_128") != a
        and len(page_hashes(toks, 16, NS, algo="xxh3_128")[0]) == 16
    )
    # tagged fields: moving a token into the extra key changes the hash
    assert page_hashes(np.array([1, 2]), 2, NS, extra_key="") != page_hashes(
        np.array([1, 2]), 2, NS, extra_key=None
    )


def _spec_chain(tokens, page_size, ns, extra, prev, algo):
    """docs/formats.md, "Page hash chain", written out field by field."""
    import hashlib
    import struct

    import xxhash

    def field(tag, v):
        return tag + struct.pack("<I", len(v)) + v

    h_prev = b"kvtier/page-hash-chain/v1" if prev is None else prev
    out = []
    for i in range(len(tokens) // page_size):
        page = np.asarray(
            tokens[i * page_size : (i + 1) * page_size], dtype="<u4"
        ).tobytes()
        body = (
            field(b"pv", h_prev)
            + field(b"ns", ns.encode())
            + field(b"ek", b"\x00" if extra is None else b"\x01" + extra.encode())
            + field(b"tk", page)
        )
        h_prev = (
            hashlib.sha256(body) if algo == "sha256" else xxhash.xxh3_128(body)
        ).digest()
        out.append(h_prev)
    return out


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
@pytest.mark.parametrize(
    "extra,prev",
    [(None, None), ("lora-1", None), (None, b"\x07" * 32), ("", b"\x01" * 16)],
)
def test_hash_chain_is_the_documented_format(algo, extra, prev):
    toks = np.random.default_rng(5).integers(0, 2**31, 100)
    for ps in (1, 16):
        assert page_hashes(toks, ps, NS, extra, prev, algo) == _spec_chain(
            toks, ps, NS, extra, prev, algo
        )


def test_key_maker_is_make_key():
    key = key_maker("kvtier/x", NS)
    for h in (bytes(range(16)), bytes(range(32))):
        assert key(h) == make_key("kvtier/x", NS, h) == validate_key(key(h))
    with pytest.raises(StoreKeyError, match="page hash of 8 bytes"):
        key(bytes(8))
    with pytest.raises(KvtierConfigError, match="key prefix"):
        key_maker("bad prefix", NS)
    with pytest.raises(StoreKeyError):
        key_maker("../up", NS)


def test_namespace_covers_what_changes_bytes():
    base = Namespace("m", "float16", "page_first", 16)
    ids = {base.id}
    for change in [
        dict(dtype="bfloat16"),
        dict(layout="layer_first"),
        dict(page_size=32),
        dict(model_id="n"),
        dict(tp_rank=1, tp_size=2),
        dict(tenant_salt="t"),
        dict(key_format_version=2),
    ]:
        fields = dict(model_id="m", dtype="float16", layout="page_first", page_size=16)
        fields.update(change)
        ids.add(Namespace(**fields).id)
    assert len(ids) == 8 and all(len(i) == 32 for i in ids)


@pytest.mark.parametrize(
    "bad",
    [
        "../etc/passwd",
        "kvtier/" + NS + "/xyz",
        "kvtier/../" + NS + "/" + "a" * 64,
        "/abs/" + NS + "/" + "a" * 64,
        NS + "/" + "a" * 64,
        "kvtier/" + NS + "/" + "A" * 64,
    ],
)
def test_bad_keys_are_refused(bad, tmp_path):
    with pytest.raises(StoreKeyError, match="expected '<prefix>/<32 hex namespace id>"):
        validate_key(bad)
    store = FileStore(FileStoreConfig(root=str(tmp_path)))
    with pytest.raises(ValueError):
        store.path(bad)
    with pytest.raises(ValueError):
        store._file(bad)


def test_file_store_hot_path_names_the_documented_path(tmp_path):
    store = FileStore(FileStoreConfig(root=str(tmp_path)))
    for k in (
        make_key("kvtier/a/b", NS, bytes(range(32))),
        make_key("p", NS, b"\xab" * 16),
    ):
        assert store._file(k) == str(store.path(k))
        hx = k.rpartition("/")[2]
        assert store.path(k).relative_to(tmp_path).parts[-4:] == (
            NS,
            hx[:2],
            hx[2:4],
            hx,
        )


def test_key_round_trip():
    k = make_key("kvtier/a", NS, b"\x01" * 32)
    assert split_key(k) == ("kvtier/a", NS, b"\x01" * 32)
    assert split_key(k) == ("kvtier/a", NS, b"\x01" * 32)  # remembered: the same answer
    for bad in (k + "0", k.encode(), None):  # refused every time, never remembered
        for _ in range(2):
            with pytest.raises(
                StoreKeyError, match="expected '<prefix>/<32 hex namespace id>"
            ):
                split_key(bad)
    with pytest.raises(KvtierConfigError, match="key prefix='a b'"):
        make_key("a b", NS, b"\x01" * 32)


def test_a_key_the_maker_made_is_split_without_parsing_it_again(monkeypatch):
    import kvtier.hashing as hashing

    key_of = key_maker("kvtier/a", NS)
    made = key_of(b"\x07" * 16)
    assert made == make_key(
        "kvtier/a", NS, b"\x07" * 16
    )  # the same key make_key validates

    def no_parse(key):
        raise AssertionError(f"parsed {key!r} again")

    monkeypatch.setattr(hashing, "_parse_key", no_parse)
    assert split_key(made) == ("kvtier/a", NS, b"\x07" * 16)
    from array import array

    for bad in (
        memoryview(array("I", range(16))),
        b"\x07" * 20,
    ):  # 16 items but 64 bytes; 20 bytes
        with pytest.raises(StoreKeyError, match="expected 16 or 32"):
            key_of(bad)


def test_remembered_keys_are_bounded(monkeypatch):
    import kvtier.hashing as hashing

    monkeypatch.setattr(hashing, "_RECENT", hashing.Recent(4))
    keys = [make_key("p", NS, bytes([i]) * 16) for i in range(10)]
    for k in keys:
        assert split_key(k)[2] == bytes.fromhex(k.rpartition("/")[2])
        assert len(hashing._RECENT) <= 4
    assert (
        list(hashing._RECENT) == keys[-4:]
    )  # the newest kept: each time it filled, the older half went


def test_remembered_keys_survive_threads_that_make_and_split_keys_at_once(monkeypatch):
    """Review: dropping the older half iterated the table across bytecodes; another
    thread's key in between raised "dictionary changed size during iteration" out of
    `key_maker` (the vLLM tier keys pages on vLLM's thread while the store's loop splits
    them). Eight threads, a small table and a switch at every chance: failed 6 runs of 6."""
    import sys
    import threading

    import kvtier.hashing as hashing

    monkeypatch.setattr(hashing, "_RECENT", hashing.Recent(64))
    key_of, errors = key_maker("p", NS), []

    def make_and_split(seed: int) -> None:
        try:
            for i in range(25_000):
                h = ((seed << 40) + i).to_bytes(16, "big")
                assert split_key(key_of(h))[2] == h
        except Exception as exc:
            errors.append(repr(exc))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [
            threading.Thread(target=make_and_split, args=(seed,)) for seed in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert len(hashing._RECENT) <= 64


async def test_file_store_rebuilds_index_on_reopen_without_reading(tmp_path):
    cfg = FileStoreConfig(root=str(tmp_path))
    store = FileStore(cfg)
    keys = [new_key() for _ in range(3)]
    await store.batch_set(keys, [b"a" * 100, b"b" * 100, b"c" * 100])
    import os
    import socket
    import subprocess
    import sys
    import time

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
    )
    here = store.path(keys[0]).parent
    host = socket.gethostname()
    (here / f".tmp-{host}.{dead.stdout.strip()}.x").write_bytes(
        b"half"
    )  # its writer crashed
    (here / f".tmp-{host}.{os.getpid()}.y").write_bytes(
        b"half"
    )  # a live writer's page in flight
    old = here / ".tmp-otherhost.1.z"
    old.write_bytes(b"half")
    os.utime(old, (time.time() - 7200, time.time() - 7200))  # untouched for two hours
    reopened = FileStore(cfg)
    assert reopened.stats()["pages"] == 3 and reopened.used_bytes == store.used_bytes
    assert await reopened.batch_exists(keys) == 3
    assert [p.name for p in tmp_path.rglob(".tmp-*")] == [
        f".tmp-{host}.{os.getpid()}.y"
    ]
    inv = await reopened.inventory()
    assert inv["pages"] == 3 and list(inv["namespaces"]) == [NS]


def test_registry_unknown_name_lists_known_ones():
    with pytest.raises(
        KvtierConfigError,
        match=r"store.backend='nope': unknown store; known: none, file, memory, redis, s3",
    ):
        resolve("nope")
    assert {"memory", "file", "redis", "s3"} <= set(known_names())


def test_registry_module_class_and_failing_plugin():
    cls, cfg = resolve("kvtier.backends.memory:MemoryStore")
    assert cls.__name__ == "MemoryStore" and cfg.__name__ == "MemoryStoreConfig"
    with pytest.raises(KvtierConfigError, match="cannot import 'no_such_module_kv'"):
        resolve("no_such_module_kv:Store")
    with pytest.raises(KvtierConfigError, match="has no attribute 'Nope'"):
        resolve("kvtier.backends.memory:Nope")
    assert (
        type(build_store("memory", {"capacity_bytes": 1024})).__name__ == "MemoryStore"
    )


def test_every_shipped_config_loads_by_name():
    from kvtier.config import shipped_configs

    assert {"default", "memory", "redis", "redis-cluster", "s3"} <= set(
        shipped_configs()
    )
    for name in shipped_configs():
        cfg = load_config(name, env={})
        assert cfg.store.backend in ("file", "memory", "redis", "s3")
        assert f"kvtier/configs/{name}.yaml, line " in cfg.sources["pool.size"]


def test_the_wheel_ships_the_configs(tmp_path):
    """`pip install .` (not -e) must find its configs: build the wheel and look inside."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(root),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    [wheel] = tmp_path.glob("kvtier-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"kvtier/configs/default.yaml", "kvtier/configs/redis.yaml"} <= set(names)


def test_precedence_args_over_env_over_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        "pool: {size: 1024, num_layers: 2}\nstore: {backend: memory, capacity_bytes: 4096}\n"
    )
    cfg = load_config(
        p,
        env={"KVTIER_POOL_SIZE": "2048", "KVTIER_STORE_CAPACITY_BYTES": "8192"},
        overrides={"pool": {"size": 512}},
    )
    assert (
        cfg.pool.size == 512
        and cfg.pool.num_layers == 2
        and cfg.store.options.capacity_bytes == 8192
    )
    text = explain(cfg)
    assert (
        "pool.size = 512  (arg)" in text
        and "store.capacity_bytes = 8192  (env KVTIER_STORE_CAPACITY_BYTES)" in text
    )
    assert (
        "pool.num_layers = 2  (file" in text
        and "tree.slru_threshold = 2  (default)" in text
    )


def test_switching_backend_by_env_drops_the_files_other_options(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("store: {backend: redis, url: 'redis://127.0.0.1:1/0', ttl_s: 60}\n")
    cfg = load_config(p, env={"KVTIER_STORE_BACKEND": "memory"})
    assert cfg.store.backend == "memory" and "store.url" not in explain(cfg)
    with pytest.raises(
        KvtierConfigError,
        match=r"store.url: unknown key; allowed with store.backend='memory' \(env "
        r"KVTIER_STORE_BACKEND\): backend, "
        r"key_prefix, timeout_s, required, page_tokens, capacity_bytes \(env KVTIER_STORE_URL\)",
    ):
        load_config(
            p,
            env={"KVTIER_STORE_BACKEND": "memory", "KVTIER_STORE_URL": "redis://x:1/0"},
        )
    with pytest.raises(
        KvtierConfigError,
        match=r"pool.size='lots': expected an integer \(env KVTIER_POOL_SIZE\)",
    ):
        load_config(p, env={"KVTIER_POOL_SIZE": "lots"})


async def test_a_file_page_that_cannot_be_read_is_a_miss_and_leaves_the_index(tmp_path):
    store = FileStore(FileStoreConfig(root=str(tmp_path)))
    keys = [new_key() for _ in range(3)]
    await store.batch_set(keys, [b"a" * 64, b"b" * 64, b"c" * 64])
    store.path(keys[1]).unlink()
    store.path(
        keys[1]
    ).mkdir()  # reading it fails with an OSError (root ignores permissions)
    bufs = [bytearray(64) for _ in keys]
    assert await store.batch_get_into(keys, bufs) == [
        True,
        False,
        True,
    ]  # the good pages still arrive
    assert bytes(bufs[2]) == b"c" * 64
    assert store.stats()["errors"] == 1 and await store.batch_exists([keys[1]]) == 0
    await store.close()


def test_file_store_refuses_a_root_that_is_not_a_kvtier_store(tmp_path):
    from kvtier.errors import StoreUnavailable

    (tmp_path / "thesis.tex").write_text("years of work")
    with pytest.raises(StoreUnavailable, match="not a kvtier store"):
        FileStore(FileStoreConfig(root=str(tmp_path)))
    assert (tmp_path / "thesis.tex").read_text() == "years of work"
    old = tmp_path / "old-store"
    first = FileStore(FileStoreConfig(root=str(old)))
    (old / ".kvtier-store").unlink()  # a store written before markers existed: adopted
    assert (
        FileStore(FileStoreConfig(root=str(old))).stats()["pages"]
        == first.stats()["pages"]
    )


async def test_file_store_pages_and_directories_are_private(tmp_path):
    store = FileStore(FileStoreConfig(root=str(tmp_path / "l3")))
    k = new_key()
    await store.batch_set([k], [b"x" * 64])
    assert store.path(k).stat().st_mode & 0o777 == 0o600
    assert store.path(k).parent.stat().st_mode & 0o777 == 0o700
    await store.close()


async def test_file_store_capacity_holds_across_processes_sharing_a_root(tmp_path):
    """Two stores (as two processes would) on one root: the root stays under the cap."""
    from kvtier.backends import frame

    cap = 6 * (1024 + frame.HEADER_SIZE)
    a, b = (
        FileStore(FileStoreConfig(root=str(tmp_path), capacity_bytes=cap))
        for _ in range(2)
    )
    for i in range(8):
        await (a if i % 2 else b).batch_set([new_key()], [bytes([i]) * 1024])
    pages = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file() and not p.name.startswith(".kvtier")
    ]
    assert sum(p.stat().st_size for p in pages) <= cap and len(pages) == 6
    await a.close()
    await b.close()


def test_file_store_evicting_under_concurrent_writes_does_not_block_its_loop(tmp_path):
    """Two batches written at once into a full root both evict. The root's lock must not be
    held across an await: the second writer's flock (same process, another open file)
    would block the event loop thread for good, and no store timeout could fire. The
    loop runs on its own thread here so that a regression fails instead of hanging."""
    import asyncio
    import threading

    from kvtier.backends import frame

    cap = 16 * (1024 + frame.HEADER_SIZE)
    store = FileStore(FileStoreConfig(root=str(tmp_path), capacity_bytes=cap))
    outcome = {}

    async def writes():
        await store.batch_set(
            [new_key() for _ in range(16)], [bytes(1024)] * 16
        )  # full
        batches = [[new_key() for _ in range(8)] for _ in range(3)]
        outcome["ok"] = await asyncio.gather(
            *(
                store.batch_set(b, [bytes([i]) * 1024] * 8)
                for i, b in enumerate(batches)
            )
        )
        outcome["last"] = await store.batch_exists(batches[-1])

    worker = threading.Thread(target=lambda: asyncio.run(writes()), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), (
        "the store's event loop is blocked (a lock held across an await?)"
    )
    assert outcome["ok"] == [[True] * 8] * 3 and outcome["last"] == 8
    pages = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file() and not p.name.startswith(".kvtier")
    ]
    assert len(pages) == 16 and sum(p.stat().st_size for p in pages) <= cap
    assert store.stats()["evictions"] == 24
    assert int((tmp_path / ".kvtier-usage").read_text()) == sum(
        p.stat().st_size for p in pages
    )


async def test_file_store_root_count_survives_a_lost_or_damaged_usage_file(tmp_path):
    """The shared byte count is rewritten in place; lost or unreadable, it is recounted
    from the directory, and the next write leaves exactly the new count."""
    store = FileStore(FileStoreConfig(root=str(tmp_path)))
    usage = tmp_path / ".kvtier-usage"

    def on_disk() -> int:
        return sum(
            p.stat().st_size
            for p in tmp_path.rglob("*")
            if p.is_file() and not p.name.startswith(".kvtier")
        )

    await store.batch_set([new_key()], [bytes(1000)])
    assert usage.read_text() == f"{on_disk():020d}"
    usage.unlink()
    await store.batch_set([new_key()], [bytes(2000)])
    assert usage.read_text() == f"{on_disk():020d}"
    usage.write_text("garbage that is longer than twenty digits")
    await store.batch_set([new_key()], [bytes(3000)])
    assert usage.read_text() == f"{on_disk():020d}"
    usage.write_text(
        "7"
    )  # a short count, as another version may write it: read, then widened
    await store.batch_set([new_key()], [bytes(10)])
    assert (
        int(usage.read_text()) == 7 + 10 + HEADER_SIZE and len(usage.read_text()) == 20
    )
    await store.close()


def test_unknown_kvtier_variables_are_warned_about_once_and_ignored(caplog):
    """A deployment's unrelated `KVTIER_HOME` (a variable of our prefix whose section is
    none of ours) once stopped every start (exit 2): it is a warning naming the variable and
    the nearest setting, given once per process, and the variable is ignored. A known
    section's unknown key or bad value is still an error."""
    caplog.set_level("WARNING", logger="kvtier.config")
    env = {"KVTIER_HOME_DIR_X1": "/srv", "KVTIER_POOOL_SIZE": "64"}
    assert load_config(None, env=env) == load_config(None, env={})
    load_config(None, env=env)  # a second load: no second warning
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert any(
        m.startswith("env KVTIER_POOOL_SIZE: no such setting, ignored")
        and "did you mean KVTIER_POOL_SIZE?" in m
        for m in warned
    ), warned
    assert any(m.startswith("env KVTIER_HOME_DIR_X1: no such setting") for m in warned)
    with pytest.raises(KvtierConfigError, match="pool.colour: unknown key"):
        load_config(None, env={"KVTIER_POOL_COLOUR": "red"})
    with pytest.raises(
        KvtierConfigError, match="pool.size='lots': expected an integer"
    ):
        load_config(None, env={"KVTIER_POOL_SIZE": "lots"})
    load_config(
        None, env={"KVTIER_DEBUG_POOL": "1", "KVTIER_SERVE_TOKEN": "t"}
    )  # read elsewhere: fine


def test_overrides_name_what_is_wrong_and_mirror_none_turns_the_host_tier_off():
    """Overrides are {section: {key: value}}; anything else is refused naming it (a value
    that is not a mapping once failed in `dict()` with Python's own message), and
    `mirror: None` means no host tier, as `mirror: null` does in YAML."""
    with pytest.raises(
        KvtierConfigError,
        match="'store.backend': unknown section; allowed: namespace, pool",
    ):
        load_config(None, {"store.backend": "memory"}, env={})
    with pytest.raises(
        KvtierConfigError, match="store: expected a mapping of keys, got 'memory'"
    ):
        load_config(None, {"store": "memory"}, env={})
    with pytest.raises(
        KvtierConfigError, match="overrides: expected a mapping of sections .* got list"
    ):
        load_config(None, [("store", {"backend": "memory"})], env={})
    assert load_config(None, {"mirror": None}, env={}).mirror is None
    given = {"store": {"backend": "memory"}}
    assert load_config(None, given, env={}).store.backend == "memory" and given == {
        "store": {"backend": "memory"}
    }


def test_a_required_store_that_cannot_be_reached_fails_at_start():
    from kvtier.bench.servers import free_port
    from kvtier.cache import TieredCache
    from kvtier.errors import StoreUnavailable

    cfg = load_config(
        None,
        {
            "pool": {"size": 64, "num_layers": 1, "page_size": 4},
            "store": {
                "backend": "redis",
                "url": f"redis://127.0.0.1:{free_port()}/0",
                "required": True,
                "timeout_s": 2,
            },
        },
        env={},
    )
    with pytest.raises(
        StoreUnavailable,
        match="store.required: the redis store cannot be reached at start",
    ):
        TieredCache(cfg)


def test_secrets_are_not_printed(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("store: {backend: redis, password: hunter2}\n")
    assert "hunter2" not in explain(load_config(p, env={}))


KEY = "c0ffee" * 10 + "f00d"  # 64 hex digits
SECRET_BITS = ("c0ffee", "f00d", "123456789")


def _no_secret(text: str) -> None:
    assert not any(bit in text for bit in SECRET_BITS), text


def test_tenant_key_is_never_printed_by_config_or_reprs(tmp_path, caplog):
    from kvtier.backends.seal import SealedCodec
    from kvtier.cache import TieredCache
    from kvtier.hashing import KeyedHash

    key_file = tmp_path / "tenant.key"
    key_file.write_text(f"# current first\n{KEY}\n{'ab' * 32}\n")
    key_file.chmod(0o644)
    with caplog.at_level("WARNING"):
        load_config(None, {"namespace": {"tenant_key_file": str(key_file)}}, env={})
    assert "others than its owner may read it (mode 644); chmod 600 it" in caplog.text
    for namespace, env in (
        (f"{{tenant_key: '{KEY}'}}", {}),
        ("{}", {"KVTIER_NAMESPACE_TENANT_KEY": KEY}),
        (f"{{tenant_key_file: '{key_file}', encrypt: true}}", {}),
    ):
        p = tmp_path / "k.yaml"
        p.write_text(
            f"namespace: {namespace}\npool: {{size: 64, num_layers: 1, page_size: 4}}\n"
            "store: {backend: memory}\n"
        )
        cfg = load_config(p, env=env)
        text = explain(cfg)
        _no_secret(text + repr(cfg) + str(cfg))
        assert (
            "namespace.tenant_key = ***" in text
            or "namespace.tenant_key_file = " in text
        )
        keys = cfg.namespace.tenant_keys()
        _no_secret(
            repr(keys)
            + repr(keys.current)
            + repr(SealedCodec(keys))
            + repr(
                KeyedHash(keys.current.hash_key, "sha256", keys.current.key_id.hex())
            )
        )
        with caplog.at_level("DEBUG"):
            cache = TieredCache(cfg)
            cache.close()
        _no_secret(caplog.text)


@pytest.mark.parametrize(
    "namespace,env,message",
    [
        (
            "{tenant_key: 'c0ffee'}",
            {},
            "namespace.tenant_key: key 1 of 1 is 6 characters; expected 64 hex digits",
        ),
        (
            "{tenant_key: 123456789}",
            {},
            "namespace.tenant_key: expected a string (the value is not shown: a secret)",
        ),
        (
            "{}",
            {"KVTIER_NAMESPACE_TENANT_KEY": KEY + "x"},
            "key 1 of 1 is 65 characters, not all hex digits",
        ),
        (
            "{}",
            {"KVTIER_NAMESPACE_TENANT_KEY": f"{KEY},{KEY}"},
            "namespace.tenant_key: the same key appears twice",
        ),
        (
            "{}",
            {"KVTIER_NAMESPACE_TENANT_KEY": " , "},
            "namespace.tenant_key: no key in it",
        ),
        (
            f"{{tenant_key: '{KEY}', tenant_key_file: /x}}",
            {},
            "tenant_key and namespace.tenant_key_file are both set",
        ),
        (
            "{tenant_key_file: /no/such/key}",
            {},
            "tenant_key_file='/no/such/key': cannot read it (FileNotFoundError",
        ),
        (
            "{encrypt: true}",
            {},
            "encrypt=True: needs namespace.tenant_key or namespace.tenant_key_file",
        ),
    ],
)
def test_bad_tenant_keys_are_refused_without_showing_them(
    tmp_path, namespace, env, message
):
    p = tmp_path / "k.yaml"
    p.write_text(f"namespace: {namespace}\n")
    with pytest.raises(KvtierConfigError) as err:
        load_config(p, env=env)
    assert message in str(err.value)
    _no_secret(str(err.value))


def test_a_bad_key_in_a_key_file_is_refused_without_showing_it(tmp_path):
    key_file = tmp_path / "tenant.key"
    key_file.write_text(f"{KEY}\n{KEY[:-1]}g\n")
    with pytest.raises(KvtierConfigError) as err:
        load_config(None, {"namespace": {"tenant_key_file": str(key_file)}}, env={})
    assert "key 2 of 2 is 64 characters, not all hex digits" in str(err.value)
    _no_secret(str(err.value))


BAD = {
    "unknown section": (
        "poool: {size: 1}",
        "'poool': unknown section (did you mean 'pool'?); allowed: namespace, pool",
    ),
    "unknown key": (
        "pool: {size: 16, num_layers: 1, sise: 3}",
        "pool.sise: unknown key; allowed: size, num_layers",
    ),
    "bad type": (
        "pool: {size: lots, num_layers: 1}",
        "pool.size='lots': expected an integer",
    ),
    "bad enum": (
        "controller: {write_policy: sometimes}",
        "controller.write_policy='sometimes': allowed values are write_through",
    ),
    "bad literal": (
        "mirror: {layout: diagonal}",
        "mirror.layout='diagonal': allowed values are layer_first, page_first",
    ),
    "bad value": (
        "pool: {size: 16, num_layers: 1, page_size: 0}",
        "page_size=0: must be an integer >= 1",
    ),
    "bad backend": (
        "store: {backend: floppy}",
        "store.backend='floppy': unknown store",
    ),
    "bad store key": (
        "store: {backend: file, rooot: /tmp}",
        "store.rooot: unknown key (did you mean 'root'?); allowed with store.backend='file': "
        "backend, key_prefix, timeout_s, required, page_tokens, root, capacity_bytes",
    ),
    "options without backend": (
        "store: {root: /tmp}",
        "store.root: unknown key; store.backend is not set (its default, 'none', takes no "
        "options)",
    ),
    "bad redis url": (
        "store: {backend: redis, url: 'http://x'}",
        "url='http://x': must start with redis://",
    ),
    "not a mapping": ("- a\n- b", "expected a mapping of sections, got list"),
    "bad yaml": ("pool: {size: [", "not valid YAML"),
    "bad policy": (
        "tree: {eviction_policy: random}",
        "tree.eviction_policy='random': allowed values are lru",
    ),
    "bad bool": (
        "store: {backend: file, fsync: maybe}",
        "store.fsync='maybe': expected true or false",
    ),
    "zero timeout": (
        "store: {backend: memory, timeout_s: 0}",
        "timeout_s=0.0: must be a number > 0 (file",
    ),
    "negative timeout": (
        "store: {backend: memory, timeout_s: -5}",
        "timeout_s=-5.0: must be a number > 0",
    ),
    "zero concurrency": (
        "store: {backend: file, max_concurrency: 0}",
        "max_concurrency=0: must be an integer > 0",
    ),
    "negative capacity": (
        "store: {backend: memory, capacity_bytes: -1}",
        "capacity_bytes=-1: must be an integer > 0",
    ),
    "bad key prefix": (
        "store: {backend: memory, key_prefix: '../x'}",
        "key_prefix='../x': path segments",
    ),
    "missing pool keys": (
        "pool: {page_size: 16}",
        "pool: size, num_layers required (a pool section sets size, "
        "num_layers at least) (file",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_yaml_fails_with_the_right_message(name, tmp_path):
    text, message = BAD[name]
    p = tmp_path / "bad.yaml"
    p.write_text(textwrap.dedent(text))
    with pytest.raises(KvtierConfigError) as err:
        load_config(p, env={})
    assert message in str(err.value)


def test_missing_config_file():
    with pytest.raises(KvtierConfigError, match="config file 'nope.yaml': not found"):
        load_config("nope.yaml")


def test_a_trailing_newline_makes_no_key_valid():
    """`$` in a regex also matches before a final newline: a key, a prefix or an SGLang
    page hash ending in one was taken as valid (and named a different file)."""
    from kvtier.config import StoreConfig
    from kvtier.integrations.sglang.keys import page_hash_of

    k = make_key("kvtier", NS, b"\x01" * 32)
    for bad in (
        k + "\n",
        k.replace("kvtier", "kvtier\n"),
        k.replace(f"/{NS}/", f"/{NS}\n/"),
    ):
        with pytest.raises(
            StoreKeyError, match="expected '<prefix>/<32 hex namespace id>"
        ):
            validate_key(bad)
    with pytest.raises(KvtierConfigError, match="key prefix"):
        make_key("kvtier\n", NS, b"\x01" * 32)
    with pytest.raises(ValueError, match="key_prefix"):
        StoreConfig(key_prefix="kvtier\n")
    h = "ab" * 32
    assert page_hash_of(h) == bytes.fromhex(h)
    assert page_hash_of(h + "\n") != page_hash_of(
        h
    )  # another string: hashed with a tag, not read as hex


def test_the_default_io_threads_count_the_cores_this_process_may_run_on(monkeypatch):
    """A process confined to a few cores of a large machine (a container's cpuset,
    `taskset`) got I/O threads for the machine's cores: half of 64 capped at 4, where two
    cores should give one. The store defaults count the affinity mask."""
    import os

    from kvtier.validate import io_threads, usable_cores

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 7}, raising=False)
    assert usable_cores() == 2 and io_threads() == 1
    assert FileStoreConfig().max_concurrency == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert usable_cores() == 16 and io_threads() == 4 and io_threads(2) == 2
    monkeypatch.delattr(os, "sched_getaffinity")  # a platform without masks
    assert usable_cores() == 64 and io_threads() == 4
