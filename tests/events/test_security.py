"""KV events that are safe on a network (docs/security.md, "KV events"): endpoints bind
exactly what is written, an open endpoint needs CURVE (or `insecure: true`), only allowed
CURVE keys get anything, and a tenant-keyed cache publishes no tokens and no store key.
Traffic goes over loopback and ipc only; a non-loopback endpoint is only ever refused by
the config, before any socket exists."""

from __future__ import annotations

import logging
import os
import re
import socket

import msgspec
import pytest
import zmq

from kvtier.config import explain, load_config
from kvtier.errors import KvtierConfigError
from kvtier.events.cache_events import EventHashes
from kvtier.events.config import EventsConfig
from kvtier.events.publisher import ZmqPublisher, rank_endpoint
from kvtier.events.subscriber import ClientKeys, PrefixIndex, Subscriber
from kvtier.events.wire import block_stored, wire_hash
from kvtier.tenant_keys import parse_keys
from kvtier.tree import Tier
from kvtier.cache import TieredCache
from kvtier.engine.workloads import generate
from tests.events.test_cache_events import GEOMETRY, run, settle, tree_pages
from tests.events.test_publisher import BATCHES, ipc, vllm_batch_type, wait_for  # noqa: F401

TENANT_KEY = "3f" * 32


def free_port(family=socket.AF_INET, host="127.0.0.1") -> int:
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on `port` (from /proc/net)."""
    names = {
        "0100007F": "127.0.0.1",
        "00000000": "0.0.0.0",
        "00000000000000000000000001000000": "::1",
        "00000000000000000000000000000000": "::",
    }
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, hexport = local.partition(":")
                if state == "0A" and int(hexport, 16) == port:
                    out.add(names.get(addr, addr))
    return out


# -- 1. endpoints bind exactly what is written ------------------------------------------------


@pytest.mark.parametrize(
    "host,family", [("127.0.0.1", socket.AF_INET), ("[::1]", socket.AF_INET6)]
)
def test_a_loopback_endpoint_listens_on_loopback_only_and_a_subscriber_there_receives(
    host, family
):
    """It connected instead (vLLM's rule for a concrete host): nothing listened, and a
    subscriber on the loopback address got 0 events, with no log line."""
    port, replay_port = (free_port(family, host.strip("[]")) for _ in range(2))
    pub = ZmqPublisher(
        EventsConfig(
            endpoint=f"tcp://{host}:{port}",
            replay_endpoint=f"tcp://{host}:{replay_port}",
            topic="kv@p@m",
        )
    )
    sub = Subscriber(
        f"tcp://{host}:{port}", f"tcp://{host}:{replay_port}", topic="kv@p@m"
    )
    try:
        assert pub.describe() == (
            f"PUB bound to tcp://{host}:{port}, replay bound to "
            f"tcp://{host}:{replay_port}; no authentication (loopback or ipc only)"
        )
        assert listening(port) == {host.strip("[]")}
        assert listening(replay_port) == {host.strip("[]")}
        wait_for(lambda: pub.stats()["subscriptions"] >= 1, "the subscription")
        assert pub.publish(BATCHES[0])
        got = sub.recv()
        assert got is not None and got.seq == 0
        assert [m.seq for m in sub.replay(0)] == [0]
    finally:
        pub.close()
        sub.close()


def test_bind_false_connects_to_a_relay_that_binds(ipc):  # noqa: F811
    """Connecting is a setting of its own (SGLang's `bind`), not a guess from the host."""
    relay = zmq.Context.instance().socket(zmq.SUB)
    relay.setsockopt(zmq.LINGER, 0)
    relay.bind(ipc[0])
    relay.setsockopt(zmq.SUBSCRIBE, b"")
    pub = ZmqPublisher(EventsConfig(endpoint=ipc[0], topic="t", bind=False))
    try:
        wait_for(  # the relay's poll attaches the new connection (its thread's work)
            lambda: relay.poll(0) or pub.stats()["subscriptions"] >= 1,
            "the relay's subscription",
        )
        assert pub.publish(BATCHES[0])
        assert relay.poll(10000)
        topic, seq, _ = relay.recv_multipart()
        assert (topic, int.from_bytes(seq, "big")) == (b"t", 0)
    finally:
        pub.close()
        relay.close()


@pytest.mark.parametrize(
    "events,field,value",
    [
        ({"endpoint": "tcp://*:5557"}, "endpoint", "tcp://*:5557"),
        ({"endpoint": "tcp://0.0.0.0:5557"}, "endpoint", "tcp://0.0.0.0:5557"),
        ({"endpoint": "tcp://[::]:5557"}, "endpoint", "tcp://[::]:5557"),
        (
            {"endpoint": "tcp://10.1.2.3:5557", "bind": False},
            "endpoint",
            "tcp://10.1.2.3:5557",
        ),
        (
            {"endpoint": "ipc:///tmp/kv", "replay_endpoint": "tcp://*:5657"},
            "replay_endpoint",
            "tcp://*:5657",
        ),
    ],
)
def test_an_open_endpoint_without_curve_is_refused_at_start_up(events, field, value):
    """One line, naming the field and the value; no socket is made (no traffic)."""
    with pytest.raises(KvtierConfigError) as err:
        load_config(None, {"events": events}, env={})
    msg = str(err.value)
    assert "\n" not in msg
    assert f"events: {field}={value!r}" in msg and "insecure" in msg and "curve" in msg


def test_insecure_true_or_curve_keys_allow_an_open_endpoint(tmp_path):
    cfg = load_config(
        None, {"events": {"endpoint": "tcp://*:5557", "insecure": True}}, env={}
    )
    assert cfg.events.insecure and cfg.events.bind
    secret, allowed = curve_files(tmp_path)[:2]
    cfg = load_config(
        None,
        {
            "events": {
                "endpoint": "tcp://*:5557",
                "curve_secret_key_file": str(secret),
                "curve_allowed_keys": str(allowed),
            }
        },
        env={},
    )
    assert len(cfg.events.curve_keys().allowed) == 1


def test_data_parallel_ranks_offset_loopback_ports_too():
    assert rank_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert rank_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert rank_endpoint("inproc://ev", 1) == "inproc://ev_dp1"


# -- 2. CURVE ---------------------------------------------------------------------------------


def curve_files(tmp_path, mode: int = 0o600):
    """(secret key file, allowed keys file, server public, allowed client pair, other pair)"""
    server_public, server_secret = zmq.curve_keypair()
    client, other = zmq.curve_keypair(), zmq.curve_keypair()
    secret = tmp_path / "events.key_secret"
    secret.write_bytes(server_secret + b"\n")
    secret.chmod(mode)
    allowed = tmp_path / "subscribers"
    allowed.write_bytes(b"# routers allowed in\n" + client[0] + b"\n")
    return secret, allowed, server_public, client, other


def test_only_a_subscriber_with_an_allowed_curve_key_receives(tmp_path, caplog):
    """Before: no authentication at all, anyone who connected got every event. Now a peer
    with another key, or none, completes no handshake: nothing live, no replay; counted.
    What the allowed subscriber gets still decodes as vLLM's KVEventBatch."""
    KVEventBatch = vllm_batch_type()
    secret, allowed, server, client, other = curve_files(tmp_path)
    port, replay_port = free_port(), free_port()
    ep, rep = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    pub = ZmqPublisher(
        EventsConfig(
            endpoint=ep,
            replay_endpoint=rep,
            topic="kv@p@m",
            curve_secret_key_file=str(secret),
            curve_allowed_keys=str(allowed),
        )
    )
    good = Subscriber(ep, rep, "kv@p@m", curve=ClientKeys(server, *client))
    stranger = Subscriber(ep, rep, "kv@p@m", curve=ClientKeys(server, *other))
    plain = Subscriber(ep, rep, "kv@p@m")
    try:
        wait_for(lambda: pub.stats()["subscriptions"] >= 1, "the allowed subscription")
        wait_for(lambda: pub.stats()["refused_peers"] >= 1, "the stranger's refusal")
        for b in BATCHES:
            assert pub.publish(b)
        got = [good.recv() for _ in BATCHES]
        assert [m.seq for m in got] == [0, 1, 2]
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        assert [len(dec.decode(m.payload).events) for m in got] == [1, 2, 2]
        assert [m.seq for m in good.replay(0)] == [0, 1, 2]
        assert stranger.recv(timeout_ms=300) is None
        assert plain.recv(timeout_ms=300) is None
        with pytest.raises(TimeoutError):
            stranger.replay(0, timeout_ms=500)
        assert pub.stats()["subscriptions"] == 1  # only the allowed peer's
        assert pub.stats()["replays"] == 1
    finally:
        pub.close()
        for s in (good, stranger, plain):
            s.close()
    text = caplog.text + repr(pub.config) + repr(pub.config.curve_keys())
    assert secret.read_bytes().strip().decode() not in text


def test_curve_keys_are_read_like_the_tenant_key(tmp_path, caplog):
    """A secret key file others may read is warned about; no error, repr or `tierctl
    config` line shows a key; a malformed key names the field, not the value."""
    secret, allowed, *_ = curve_files(tmp_path, mode=0o644)
    value = secret.read_bytes().strip().decode()
    with caplog.at_level(logging.WARNING, logger="kvtier.events.curve"):
        cfg = load_config(
            None,
            {
                "events": {
                    "curve_secret_key_file": str(secret),
                    "curve_allowed_keys": str(allowed),
                }
            },
            env={},
        )
    assert "chmod 600" in caplog.text and "curve_secret_key_file" in caplog.text
    env = {
        "KVTIER_EVENTS_CURVE_SECRET_KEY": value,
        "KVTIER_EVENTS_CURVE_ALLOWED_KEYS": str(allowed),
    }
    inline = load_config(None, None, env=env)
    assert inline.events.curve_keys().secret == value.encode()
    shown = (
        explain(inline)
        + explain(cfg)
        + repr(inline.events)
        + repr(inline.events.curve_keys())
    )
    assert value not in shown and value not in caplog.text
    assert "events.curve_secret_key = ***" in explain(inline)
    bad = tmp_path / "bad"
    bad.write_text("x" * 39 + "\n")
    with pytest.raises(
        KvtierConfigError, match="curve_secret_key_file=.*not a CURVE secret key"
    ) as err:
        load_config(
            None,
            {
                "events": {
                    "curve_secret_key_file": str(bad),
                    "curve_allowed_keys": str(allowed),
                }
            },
            env={},
        )
    assert "x" * 39 not in str(err.value)
    with pytest.raises(KvtierConfigError, match="curve_allowed_keys: required"):
        load_config(None, {"events": {"curve_secret_key_file": str(secret)}}, env={})


def test_allowed_keys_may_be_a_directory_of_zmq_auth_certificates(tmp_path, ipc):  # noqa: F811
    import zmq.auth

    certs = tmp_path / "certs"
    certs.mkdir()
    zmq.auth.create_certificates(str(tmp_path), "server")
    for name in ("router-a", "router-b"):
        zmq.auth.create_certificates(str(certs), name)
    os.remove(certs / "router-a.key_secret")  # a subscriber's secret stays with it
    os.rename(certs / "router-b.key_secret", tmp_path / "router-b.key_secret")
    server, _ = zmq.auth.load_certificate(str(tmp_path / "server.key_secret"))
    client = zmq.auth.load_certificate(str(tmp_path / "router-b.key_secret"))
    pub = ZmqPublisher(
        EventsConfig(
            endpoint=ipc[0],
            topic="t",
            curve_secret_key_file=str(tmp_path / "server.key_secret"),
            curve_allowed_keys=str(certs),
        )
    )
    sub = Subscriber(ipc[0], topic="t", curve=ClientKeys(server, *client))
    try:
        assert len(pub.config.curve_keys().allowed) == 2
        wait_for(lambda: pub.stats()["subscriptions"] >= 1, "the subscription")
        assert pub.publish(BATCHES[0])
        assert sub.recv().seq == 0
    finally:
        pub.close()
        sub.close()


# -- 3. what a tenant-keyed cache's events give away -----------------------------------------


def keyed_cache(root, ipc, token_ids=None):  # noqa: F811
    doc = {
        "pool": {"size": 1024, **GEOMETRY},
        "mirror": {"ratio": 1.5},
        "controller": {"prefetch_policy": "wait_complete"},
        "store": {"backend": "file", "root": str(root)},
        "namespace": {"tenant_key": TENANT_KEY, "encrypt": True},
        "events": {"endpoint": ipc[0], "replay_endpoint": ipc[1], "topic": "kv@test"},
    }
    if token_ids is not None:
        doc["events"]["tokens"] = token_ids
    return TieredCache(load_config(None, doc, env={}))


def all_payloads(cache, sub) -> list[bytes]:
    pub = cache.events.publisher
    assert pub.wait_sent(30)
    return [m.payload for m in sub.replay(0, timeout_ms=20000)]


def store_hashes(root) -> list[bytes]:
    """The page hashes in the store's keys, as listed (file names)."""
    out = []
    for _, _, files in os.walk(root):
        for name in files:
            out += [bytes.fromhex(h) for h in re.findall(r"[0-9a-f]{32,64}", name)]
    return out


def test_a_tenant_keyed_cache_publishes_no_tokens_and_no_store_key(tmp_path, ipc):  # noqa: F811
    """Before: token ids in clear, and block hashes that were the low 64 bits of the
    keyed page hashes in the store keys. Now: no tokens, and hashes under the tenant's
    event subkey (no 64-bit window of a store key equals one); they still chain, a prefix
    index over them says exactly what each tier holds, and vLLM decodes them."""
    KVEventBatch = vllm_batch_type()
    cache = keyed_cache(tmp_path / "l3", ipc)
    sub = Subscriber(*ipc, topic="kv@test")
    try:
        run(cache, generate("multiturn", 16, 512, seed=3))
        settle(cache)
        payloads = all_payloads(cache, sub)
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        events = [e for p in payloads for e in dec.decode(p).events]
        stored = [e for e in events if type(e).__name__ == "BlockStored"]
        assert stored and all(e.token_ids == [] for e in stored)
        published = {h for e in stored for h in e.block_hashes}
        keys = store_hashes(tmp_path / "l3")
        assert keys, "no page reached the store"
        windows = {
            int.from_bytes(k[i : i + 8], "big") for k in keys for i in range(len(k) - 7)
        }
        assert not published & windows
        assert not {e.parent_block_hash for e in stored} & windows
        # parents chain: every parent is a block some event named
        assert {e.parent_block_hash for e in stored} - {None} <= published
        index = PrefixIndex()
        for p in payloads:
            index.apply(p)
        names = EventHashes(parse_keys(TENANT_KEY, "k").current.event_key)

        def named(tier):
            return {
                wire_hash(n) for h in tree_pages_raw(cache, tier) for n in names([h])
            }

        assert index.blocks["GPU"] == named(Tier.DEVICE)
        assert index.blocks["CPU"] == named(Tier.HOST)
        assert len(index.blocks["GPU"]) == len(tree_pages(cache, Tier.DEVICE))
        cache.tree.sanity_check()
        cache.check_accounting()
    finally:
        cache.close()
        sub.close()


def tree_pages_raw(cache, tier) -> list[bytes]:
    out, stack = [], list(cache.tree.root.children.values())
    while stack:
        node = stack.pop()
        stack += node.children.values()
        if node.values[tier] is not None:
            out += cache.tree.page_hashes(node)
    return out


def test_tokens_true_sends_token_ids_with_a_tenant_key(tmp_path, ipc):  # noqa: F811
    cache = keyed_cache(tmp_path / "l3", ipc, token_ids=True)
    sub = Subscriber(*ipc, topic="kv@test")
    try:
        run(cache, generate("multiturn", 4, 256, seed=1))
        events = [
            e for p in all_payloads(cache, sub) for e in msgspec.msgpack.decode(p)[1]
        ]
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert stored
        assert all(len(e["token_ids"]) == 16 * len(e["block_hashes"]) for e in stored)
        cache.tree.sanity_check()
        cache.check_accounting()
    finally:
        cache.close()
        sub.close()


def test_block_stored_without_tokens_decodes_as_vllm():
    KVEventBatch = vllm_batch_type()
    from kvtier.events.wire import Encoder

    payload = Encoder().payload(
        1.0, [block_stored([b"\1" * 8], None, [], 16, "GPU")], 0
    )
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    assert batch.events[0].token_ids == []
