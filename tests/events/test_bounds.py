"""Whatever peers do, the publisher's memory stays bounded and it keeps publishing: many
subscriptions, replays nobody reads, a huge frame. The publisher runs alone in a process
(tests/events/rss_publisher.py) so its RSS, and its peak RSS since the attack began, are
its own; the peers are this process. Over ipc only."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import pytest
import zmq

from kvtier.events.subscriber import Subscriber
from tests.events.test_publisher import ipc, wait_for  # noqa: F401
from tests.events.test_security import free_port

BUDGET_MIB = 64
TOPIC = "kv@pod-7d9f8b6c5-x2x4q@meta-llama/Llama-3.1-8B-Instruct"  # 56 bytes


class Child:
    """The publisher's process: `ask("rss")` -> its memory and stats."""

    def __init__(self, ipc, batches: int, size: int, **config) -> None:  # noqa: F811
        root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.events.rss_publisher",
                *ipc,
                str(batches),
                str(size),
                json.dumps({"topic": TOPIC, **config}),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=root,
            env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", root)},
        )
        self.start = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the publisher process ended (rc {self.proc.wait()})"
        return json.loads(line)

    def ask(self, cmd: str = "rss") -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stats(self) -> dict:
        return self.ask()["stats"]

    def assert_bounded(self) -> dict:
        now = self.ask()
        grew, peak = now["rss"] - self.start["rss"], now["peak"] - self.start["rss"]
        assert peak < BUDGET_MIB, f"peak RSS grew {peak:.0f} MiB (now +{grew:.0f})"
        assert grew < BUDGET_MIB, f"RSS grew {grew:.0f} MiB"
        return now

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def child(ipc):  # noqa: F811
    made = []

    def make(batches: int = 10, size: int = 256, endpoints=None, **config) -> Child:
        made.append(Child(endpoints or ipc, batches, size, **config))
        return made[-1]

    yield make
    for c in made:
        c.close()


def publishing_continues(c: Child, ipc) -> None:  # noqa: F811
    """A new subscriber gets the next batch live, and a replay of it."""
    held = c.stats()["subscriptions"]  # before it subscribes
    sub = Subscriber(*ipc, topic=TOPIC)
    try:
        wait_for(
            lambda: sub.sub.poll(0) or c.stats()["subscriptions"] > held,
            "the new subscription",
        )
        n = c.ask("publish")["stats"]["batches"]
        got = sub.recv(timeout_ms=20000)
        assert got is not None and got.seq == n - 1
        assert [m.seq for m in sub.replay(n - 1, timeout_ms=20000)] == [n - 1]
    finally:
        sub.close()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_20000_subscriptions_leave_the_publisher_bounded(child, ipc, transport):  # noqa: F811
    """Before: the PUB kept every distinct subscription, still held after the peer left
    (7.9 GiB for 200,000 long ones). Now a subscription is at most the topic and a
    handshake's length (longer ones drop the connection), and past max_subscriptions
    held the socket reopens, which frees them (over tcp too: its listener rebinds)."""
    if transport == "tcp":
        ipc = tuple(f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    c = child(endpoints=ipc)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.SUB)
    peer.setsockopt(zmq.SNDHWM, 0)  # every subscription goes out
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(ipc[0])
    rnd = random.Random(7)
    try:
        for _ in range(20_000):
            peer.setsockopt(zmq.SUBSCRIBE, rnd.randbytes(len(TOPIC) + 40))
        wait_for(
            lambda: (
                (s := c.stats()).get("subscription_resets", 0) >= 1
                or s["subscriptions"] >= 20_000
            ),
            "the publisher to read the subscriptions",
            timeout=60,
        )
    finally:
        peer.close()
        ctx.term()
    c.assert_bounded()
    publishing_continues(c, ipc)
    assert c.stats()["subscription_resets"] >= 1


def test_1000_unread_replays_leave_the_publisher_bounded(child, ipc):  # noqa: F811
    """Before: each request queued a copy of the whole buffer for a peer that never read
    it (+1.2 GiB for 1,800, still held after they left). Now at most max_replays are open,
    each with a window of unread bytes; the rest get no reply, counted; when the peers
    leave their replays close and a reader's replay is served."""
    c = child(batches=100, size=2048)
    ctx = zmq.Context()
    peers = []
    try:
        for _ in range(10):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.RCVHWM, 1)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(ipc[1])
            peers.append(d)
        for d in peers:
            for _ in range(100):
                d.send_multipart((b"", (0).to_bytes(8, "big")))
        wait_for(
            lambda: (s := c.stats())["replays"] + s.get("replays_dropped", 0) >= 1000,
            "the publisher to read the 1,000 requests",
            timeout=60,
        )
        c.assert_bounded()
        assert c.stats()["replays_dropped"] > 0
    finally:
        for d in peers:
            d.close()
        ctx.term()
    wait_for(lambda: c.stats()["replays_open"] == 0, "the replays to close")
    publishing_continues(c, ipc)
    c.assert_bounded()


def test_a_300_mib_frame_leaves_the_publisher_bounded(child, ipc):  # noqa: F811
    """Before: the replay ROUTER read it whole (peak +600 MiB). Now a message longer than
    a request drops its connection unread."""
    c = child()
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(ipc[1])
    try:
        frame = zmq.Frame(bytes(300 << 20), track=True)
        tracker = frame.tracker
        peer.send(frame, copy=False)
        del frame
        wait_for(  # sent whole, or its connection dropped; polls attach the connection
            lambda: peer.poll(0) or tracker.done, "the frame to go", timeout=60
        )
    finally:
        peer.close()
        ctx.term()
    publishing_continues(c, ipc)
    c.assert_bounded()


def test_a_peer_that_leaves_gives_back_its_subscriptions(ipc):  # noqa: F811
    """What a subscriber can match with is given back when it leaves and never counts
    against max_subscriptions: peers that come and go never add up to a reopen."""
    from kvtier.events.config import EventsConfig
    from kvtier.events.publisher import ZmqPublisher

    prefixes = [TOPIC[:i].encode() for i in range(1, len(TOPIC) + 1)]  # all can match
    pub = ZmqPublisher(EventsConfig(endpoint=ipc[0], topic=TOPIC, max_subscriptions=16))
    try:
        for _ in range(3):
            before = pub.stats()["subscriptions"]
            ctx = zmq.Context()
            peer = ctx.socket(zmq.SUB)
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(ipc[0])
            for p in prefixes:
                peer.setsockopt(zmq.SUBSCRIBE, p)
            wait_for(  # well past max_subscriptions
                lambda: pub.stats()["subscriptions_held"] >= 50,
                "50 subscriptions held",
            )
            peer.close()
            ctx.term()
            wait_for(lambda: pub.stats()["subscriptions_held"] == 0, "them given back")
            assert pub.stats()["subscriptions"] - before >= 50
        stats = pub.stats()
        assert stats["subscriptions"] == stats["unsubscriptions"]
        assert stats["subscription_resets"] == 0
    finally:
        pub.close()


def _zmtp_frame(body: bytes, command: bool = False) -> bytes:
    flags = 0x04 if command else 0
    if len(body) > 255:
        return bytes([flags | 0x02]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body


def test_cancelling_what_it_never_subscribed_does_not_lift_the_limit(child):
    """ZMQ hands up a peer's cancellation of a subscription it never made (pyzmq's own
    sockets never send one, a peer that speaks ZMTP itself can). Counted as given back,
    subscriptions each followed by such a cancellation never reached the limit (20,000:
    +91 MiB, no reopen). Now a subscription that cannot match the topic counts until the
    socket reopens: 2,000 of them reopen it."""
    eps = tuple(f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    c = child(endpoints=eps)
    port = int(eps[0].rpartition(":")[2])
    rnd = random.Random(7)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        # ZMTP 3.0 greeting (NULL mechanism) and READY as a SUB
        s.sendall(
            b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
        )
        greeting = b""
        while len(greeting) < 64:
            more = s.recv(64 - len(greeting))
            assert more, "the publisher closed the connection in the handshake"
            greeting += more
        ready = b"\x05READY\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB"
        s.sendall(_zmtp_frame(ready, command=True))
        batch = []
        try:
            for i in range(2_000):
                batch.append(_zmtp_frame(b"\x01" + rnd.randbytes(len(TOPIC) + 40)))
                batch.append(_zmtp_frame(b"\x00never" + i.to_bytes(4, "big")))
                if len(batch) >= 200:
                    s.sendall(b"".join(batch))
                    batch = []
        except OSError:
            pass  # the publisher reopened and dropped this connection
        wait_for(
            lambda: (
                (st := c.stats())["subscription_resets"] >= 1
                or st["subscriptions"] >= 2_000
            ),
            "the publisher to read the subscriptions",
            timeout=60,
        )
    c.assert_bounded()
    assert c.stats()["subscription_resets"] >= 1
    publishing_continues(c, eps)


def test_unread_replays_of_small_batches_hold_their_window_only(child, ipc):  # noqa: F811
    """A replay's window counts the bytes ZMQ still holds for a peer that does not read.
    pyzmq copies a payload under 64 KiB into its own message unless told not to, and a
    copy's tracker is done at once: the window stayed empty, and each of max_replays
    peers that never read was queued up to 1,000 copies of the buffer's batches (here
    8 x 300 x 60 KB: +138 MiB). Sent as the buffer's own bytes, each holds its 1 MiB."""
    c = child(batches=300, size=60_000)
    ctx = zmq.Context()
    peers = []
    try:
        for _ in range(8):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.RCVHWM, 1)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(ipc[1])
            d.send_multipart((b"", (0).to_bytes(8, "big")))
            peers.append(d)
        wait_for(  # every replay ended, or each filled its window (the peers never read)
            lambda: (
                (s := c.stats())["replays"] == 8
                and (s["replays_open"] == 0 or s["replays_unread_bytes"] >= 8 << 20)
            ),
            "the 8 replays to send what they may",
        )
        c.assert_bounded()
        assert c.stats()["replays_open"] == 8  # unread, so not over
    finally:
        for d in peers:
            d.close()
        ctx.term()
    wait_for(lambda: c.stats()["replays_open"] == 0, "the replays to close")
    publishing_continues(c, ipc)
