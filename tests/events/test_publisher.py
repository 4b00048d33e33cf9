"""The KV event publisher on loopback ipc: frames and payloads that vLLM 0.33.0's own
`KVEventBatch` decodes, the positional layout older consumers decode, replays that return
exactly the missed batches with the end marker."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time

import msgspec
import pytest

from kvtier.config import load_config
from kvtier.errors import KvtierConfigError
from kvtier.events.config import EventsConfig
from kvtier.events.publisher import ZmqPublisher
from kvtier.events.subscriber import Subscriber
from kvtier.events.wire import (
    all_blocks_cleared,
    block_removed,
    block_stored,
    wire_hash,
)


@pytest.fixture
def ipc():
    d = tempfile.mkdtemp(prefix="kvev")  # short: ipc paths are limited to ~100 bytes
    yield f"ipc://{d}/pub", f"ipc://{d}/replay"
    shutil.rmtree(d, ignore_errors=True)


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def connected(ipc, rcvhwm: int = 1000, **cfg):
    pub = ZmqPublisher(
        EventsConfig(endpoint=ipc[0], replay_endpoint=ipc[1], topic="kv@pod@m", **cfg)
    )
    sub = Subscriber(ipc[0], ipc[1], topic="kv@pod@m", rcvhwm=rcvhwm)
    wait_for(
        lambda: pub.stats()["subscriptions"] >= 1, "the subscription"
    )  # no slow-joiner loss
    return pub, sub


H = [bytes([i]) * 32 for i in range(1, 5)]
BATCHES = [
    [block_stored(H[:2], None, list(range(32)), 16, "GPU")],
    [
        block_stored(H[2:3], H[1], list(range(32, 48)), 16, "CPU"),
        block_stored(H[:3], None, list(range(48)), 16, "STORAGE"),
    ],
    [block_removed(H[:1], "GPU"), all_blocks_cleared()],
]


def vllm_batch_type():
    try:
        from vllm.distributed.kv_events import KVEventBatch
    except ImportError as exc:
        from tests.servers import IN_CI

        if IN_CI:
            pytest.fail(
                f"vLLM's kv_events does not import ({exc}); .ci/run must install vllm==0.33.0"
            )
        pytest.skip(
            f"vLLM is not installed ({exc}): pip install --no-deps vllm==0.33.0"
        )
    return KVEventBatch


def test_live_frames_decode_as_vllm_kv_event_batches(ipc):
    KVEventBatch = vllm_batch_type()
    pub, sub = connected(ipc)
    try:
        for ts, b in enumerate(BATCHES):
            assert pub.publish(b, ts=float(ts))
        got = [sub.recv() for _ in BATCHES]
    finally:
        pub.close()
        sub.close()
    assert [m.seq for m in got] == [0, 1, 2] and {m.topic for m in got} == {b"kv@pod@m"}
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    typed = [dec.decode(m.payload) for m in got]
    assert [[type(e).__name__ for e in b.events] for b in typed] == [
        ["BlockStored"],
        ["BlockStored", "BlockStored"],
        ["BlockRemoved", "AllBlocksCleared"],
    ]
    first = typed[0].events[0]
    assert (
        first.block_hashes == [wire_hash(H[0]), wire_hash(H[1])]
        and first.parent_block_hash is None
    )
    assert (
        first.token_ids == list(range(32))
        and first.block_size == 16
        and first.medium == "GPU"
    )
    assert first.lora_id is None and first.lora_name is None
    assert (
        typed[1].events[0].parent_block_hash == wire_hash(H[1])
        and typed[1].events[1].medium == "STORAGE"
    )
    assert [b.ts for b in typed] == [0.0, 1.0, 2.0] and {
        b.data_parallel_rank for b in typed
    } == {0}
    raw = msgspec.msgpack.decode(
        got[0].payload
    )  # the map layout: every required key present, even null
    assert list(raw[1][0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]


class PStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class PRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class PCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class PBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[PStored | PRemoved | PCleared]
    data_parallel_rank: int | None = None


def test_array_format_decodes_positionally(ipc):
    """The layout of llm-d before v0.9.0: events as tagged arrays, fields by position."""
    pub, sub = connected(ipc, format="array")
    try:
        for b in BATCHES:
            pub.publish(b)
        got = [sub.recv() for _ in BATCHES]
    finally:
        pub.close()
        sub.close()
    typed = [msgspec.msgpack.Decoder(type=PBatch).decode(m.payload) for m in got]
    assert [[type(e).__name__ for e in b.events] for b in typed] == [
        ["PStored"],
        ["PStored", "PStored"],
        ["PRemoved", "PCleared"],
    ]
    assert typed[1].events[0] == PStored(
        [wire_hash(H[2])], wire_hash(H[1]), list(range(32, 48)), 16, None, "CPU"
    )
    assert msgspec.msgpack.decode(got[2].payload)[1] == [
        ["BlockRemoved", [wire_hash(H[0])], "GPU"],
        ["AllBlocksCleared"],
    ]


def test_replay_from_a_seq_returns_exactly_the_missed_batches(ipc):
    pub, sub = connected(ipc)
    try:
        for i in range(10):
            pub.publish([block_removed([bytes([i]) * 32], "CPU")])
        live = [sub.recv() for _ in range(10)]
        missed = sub.replay(4)  # a subscriber that lost 4..9
        everything = sub.replay(0)
        beyond = sub.replay(10)
    finally:
        pub.close()
        sub.close()
    assert [m.seq for m in missed] == list(range(4, 10))
    assert [m.payload for m in missed] == [
        m.payload for m in live[4:]
    ]  # the same bytes, not re-encoded
    assert [m.seq for m in everything] == list(range(10)) and beyond == []


def test_replay_keeps_only_buffer_steps(ipc):
    pub, sub = connected(ipc, buffer_steps=3)
    try:
        for _ in range(5):
            pub.publish([all_blocks_cleared()])
        [sub.recv() for _ in range(5)]
        assert [m.seq for m in sub.replay(0)] == [2, 3, 4]
    finally:
        pub.close()
        sub.close()


def test_a_full_queue_refuses_and_counts(ipc):
    """publish never blocks the scheduler: past max_queue_size a batch is refused, counted."""
    pub = ZmqPublisher(EventsConfig(endpoint=ipc[0], max_queue_size=1))
    try:
        results = [pub.publish([all_blocks_cleared()]) for _ in range(200)]
        assert results[0] is True
        assert pub.stats()["refused_queue_full"] == results.count(False)
    finally:
        pub.close()


def test_events_section_errors_name_the_field():
    with pytest.raises(
        KvtierConfigError,
        match=r"events: endpoint='localhost:5557': expected a ZMQ endpoint",
    ):
        load_config(None, {"events": {"endpoint": "localhost:5557"}})
    with pytest.raises(
        KvtierConfigError, match=r"events.buffer_steps='x': expected an integer"
    ):
        load_config(None, {"events": {"buffer_steps": "x"}})
    with pytest.raises(KvtierConfigError, match=r"events.topc: unknown key"):
        load_config(None, {"events": {"topc": "kv"}})
    assert load_config(None).events is None


def test_a_subscriber_that_stops_reading_is_bounded_by_hwm_and_counted(ipc):
    """It never makes publish block or the publisher thread stall: batches it cannot take are
    not sent live (counted, logged) and stay replayable, every one."""
    pub, sub = connected(ipc, rcvhwm=1, hwm=1)
    big = list(
        range(8192)
    )  # ~24 KiB a batch: the socket buffers fill after a few dozen
    try:
        for _ in range(300):
            assert pub.publish([block_stored(H[:1], None, big, 16, "GPU")])
        wait_for(
            lambda: pub.stats()["batches"] == 300, "the publisher to take every batch"
        )
        assert pub.stats()["skipped_hwm"] > 0
        assert [m.seq for m in sub.replay(0, timeout_ms=20000)] == list(range(300))
    finally:
        pub.close()
        sub.close()


def test_wait_sent_waits_for_the_batch_the_thread_holds(ipc, monkeypatch):
    """An empty queue does not mean sent: the thread may have taken a batch and not sent it
    yet. A reader that stops at `queued == 0` misses it; `wait_sent` and `unsent` do not."""
    import kvtier.events.publisher as publisher

    taken, release = threading.Event(), threading.Event()
    real = publisher.Encoder.payload

    def held(self, *args):
        taken.set()
        release.wait(10)
        return real(self, *args)

    monkeypatch.setattr(publisher.Encoder, "payload", held)
    pub, sub = connected(ipc)
    try:
        assert pub.publish(BATCHES[0])
        assert taken.wait(10)
        stats = pub.stats()
        assert (stats["queued"], stats["unsent"], stats["batches"]) == (0, 1, 0)
        assert pub.wait_sent(0.05) is False
        release.set()
        assert pub.wait_sent(10) is True
        assert (pub.stats()["unsent"], pub.stats()["batches"]) == (0, 1)
        assert sub.recv().seq == 0
    finally:
        release.set()
        pub.close()
        sub.close()
