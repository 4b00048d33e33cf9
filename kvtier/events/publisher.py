"""The KV event publisher: ZMQ PUB of `(topic, seq, payload)` and a replay ROUTER, on one
thread of its own (docs/events.md; the frames are `wire.py`'s).

`publish` hands a batch to the thread and never blocks: the scheduler thread that calls it
must not wait on a subscriber. The thread numbers batches 0, 1, 2, ... in the order they
were handed over, sends each, and keeps the last `buffer_steps` for replay. A replay request
`[identity, b"", start_seq (8 bytes big-endian)]` is answered with every kept batch from
`start_seq` on, as `[identity, b"", topic, seq, payload]`, then the end marker
`[identity, b"", b"", seq -1 (signed), b""]`, exactly as vLLM's publisher does.

Nothing is lost silently while the publisher is up: a batch a subscriber is too slow for
(its queue at `hwm` messages) is not sent live to anyone, counted and logged, and stays in
the replay buffer; a batch handed over while `max_queue_size` batches wait is refused,
counted and logged. `stats()` has the counts.

What peers can make it hold is bounded (docs/security.md, "KV events"): a message from a
peer is at most a topic plus a handshake's worth of bytes (`ZMQ_MAXMSGSIZE`; a bigger one
drops that connection before it is read); the PUB takes at most `max_subscriptions`
subscriptions that cannot match the topic (a peer can cancel one it never made, so they
count until the socket reopens), past which it is reopened, which drops every peer and
frees what they subscribed (they reconnect and subscribe again); at most `max_replays`
replays are served or unread at once, one per peer, each with at most `REPLAY_WINDOW`
bytes sent that the peer has not taken (the payloads are the buffer's own bytes, not
copies); a request past that gets no reply (counted). Every socket has its HWMs.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvtier.errors import Complaints
from kvtier.events.config import EventsConfig, tcp_host
from kvtier.events.curve import Gate, serve_curve, start_authenticator
from kvtier.events.wire import Encoder

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()
# the longest message a peer may send past the topic: a replay request is 8 bytes, a
# subscription a topic; a handshake's commands must fit too (CURVE's INITIATE is ~300)
NULL_HANDSHAKE_BYTES, CURVE_HANDSHAKE_BYTES = 64, 512
SUBSCRIPTION_RCVHWM = 16  # subscription messages queued per peer
REPLAY_WINDOW = 1 << 20  # bytes a replay may have sent that its peer has not taken
REPLAY_RCVHWM = 100  # replay requests queued per peer
REPLAY_SNDHWM = 1000  # replay messages queued per peer


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Data-parallel rank r publishes on port + r (tcp) or `_dp{r}` (inproc), as vLLM."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    raise ValueError(
        f"endpoint={endpoint!r}: an ipc endpoint serves data_parallel_rank 0 only; use tcp or inproc"
    )


@dataclass(slots=True)
class _Replay:
    """One peer's replay: batches `next_seq` up to `end_seq` still to send, and the
    trackers of what it was sent and has not taken (zero-copy frames of the buffer's
    payloads, released when the peer's connection took them or closed)."""

    client: bytes
    next_seq: int
    end_seq: int
    unread: deque = field(default_factory=deque)  # (tracker, bytes)
    unread_bytes: int = 0
    ended: bool = False

    def release(self) -> None:
        while self.unread and self.unread[0][0].done:
            self.unread_bytes -= self.unread.popleft()[1]

    @property
    def finished(self) -> bool:
        return self.ended and not self.unread


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc; elsewhere nothing): what
    dropped peers held was freed into it, and RSS says it is still ours until trimmed."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class ZmqPublisher:
    def __init__(
        self, config: EventsConfig, context: zmq.Context | None = None
    ) -> None:
        self.config = config
        self.topic = config.topic.encode()
        self.endpoint = rank_endpoint(config.endpoint, config.data_parallel_rank)
        self.replay_endpoint = rank_endpoint(
            config.replay_endpoint, config.data_parallel_rank
        )
        self._keys = config.curve_keys()
        self._overhead = (
            NULL_HANDSHAKE_BYTES if self._keys is None else CURVE_HANDSHAKE_BYTES
        )
        # a ZAP handler serves one context: CURVE gets a context of its own (a caller's
        # context given with CURVE keys must not have another ZAP handler)
        self._own_ctx = context is None and self._keys is not None
        self._ctx = (
            zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        )
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._replays: dict[bytes, _Replay] = {}
        self._held = 0  # subscriptions to a prefix of the topic the PUB holds now
        self._stray = (
            0  # others it took since it opened (docs/events.md, "Subscriptions")
        )
        self._replays_unread = 0  # payload bytes sent to replay peers, not yet taken
        self._trim_due: float | None = None
        self._complain = Complaints(log, "kv events: ")
        self.counters = {
            "batches": 0,
            "events": 0,
            "replays": 0,
            "replays_dropped": 0,
            "refused_queue_full": 0,
            "refused_peers": 0,
            "skipped_hwm": 0,
            "subscriptions": 0,
            "unsubscriptions": 0,
            "subscription_resets": 0,
        }
        self._auth = None
        self._pub = self._replay = None
        try:
            if self._keys is not None:
                gate = Gate(self._keys.allowed, self.counters, self._complain)
                self._auth = start_authenticator(self._ctx, gate)
            # made here so a bad endpoint fails the caller; used only by the thread from then on
            self._pub = self._open_pub()
            if self.replay_endpoint is not None:
                self._replay = self._open_replay()
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(
                f"events: cannot open endpoint {self.endpoint!r} / replay {self.replay_endpoint!r}: "
                f"{exc}"
            ) from exc
        log.info("kv events: %s", self.describe())
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="kvtier-events", daemon=True
        )
        self._thread.start()

    def _socket(self, kind: int, max_msg: int, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
        if ":" in (tcp_host(endpoint) or ""):  # tcp://[::1]:P
            sock.setsockopt(zmq.IPV6, 1)  # ZMQ takes an IPv6 address only with this
        if self._keys is not None:
            serve_curve(sock, self._keys)
        return sock

    def _open_pub(self) -> zmq.Socket:
        """XPUB: a SUB subscribes as to PUB; NODROP lets us see a full queue; VERBOSER hands
        up every subscription and cancellation (those of a peer that left included), so the
        thread knows how many the socket holds."""
        sock = self._socket(zmq.XPUB, len(self.topic) + self._overhead, self.endpoint)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, SUBSCRIPTION_RCVHWM)
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        sock.setsockopt(zmq.XPUB_VERBOSER, 1)
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            (sock.bind if self.config.bind else sock.connect)(self.endpoint)
        except zmq.ZMQError:
            sock.close(0)
            raise
        return sock

    def _open_replay(self) -> zmq.Socket:
        sock = self._socket(zmq.ROUTER, self._overhead, self.replay_endpoint)
        sock.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
        sock.setsockopt(zmq.SNDHWM, REPLAY_SNDHWM)
        sock.setsockopt(
            zmq.ROUTER_MANDATORY, 1
        )  # a full or gone peer is an error, not a silent drop
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.replay_endpoint)
        except zmq.ZMQError:
            sock.close(0)
            raise
        return sock

    def describe(self) -> str:
        """Where it listens and who may connect (never a key)."""
        where = f"{'bound to' if self.config.bind else 'connected to'} {self.endpoint}"
        replay = f", replay bound to {self.replay_endpoint}" if self._replay else ""
        if self._keys is not None:
            who = f"CURVE, {len(self._keys.allowed)} subscriber keys allowed"
        elif self.config.insecure:
            who = "no authentication (events.insecure)"
        else:
            who = "no authentication (loopback or ipc only)"
        return f"PUB {where}{replay}; {who}"

    def publish(self, events: list[dict[str, Any]], ts: float | None = None) -> bool:
        """Hand one batch to the publisher thread; False (counted, logged) if it cannot take it."""
        if self._closed:
            raise RuntimeError("kv events publisher: closed")
        if not events:
            return True
        try:
            self._queue.put_nowait((time.time() if ts is None else ts, events))
        except queue.Full:
            self.counters["refused_queue_full"] += 1
            self._complain(
                "queue_full",
                f"{self._queue.qsize()} batches wait for the publisher thread; a batch of "
                f"{len(events)} events was refused",
            )
            return False
        return True

    # -- the publisher thread ------------------------------------------------------------------

    def _run(self) -> None:
        encoder = Encoder(self.config.format)
        seq = 0
        while True:
            busy = self._serve_replays()
            self._drain_subscriptions()
            self._maybe_trim()
            try:
                item = self._queue.get(timeout=0.002 if busy else 0.05)
            except queue.Empty:
                continue
            if item is _STOP:
                self._queue.task_done()
                break
            ts, events = item
            payload = encoder.payload(ts, events, self.config.data_parallel_rank)
            self._send(seq, payload, len(events))
            seq += 1
            self._queue.task_done()  # after `_send` counted it: `wait_sent` and `unsent` see it sent

    def _send(self, seq: int, payload: bytes, n_events: int) -> None:
        seq_bytes = seq.to_bytes(8, "big")
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart(
                (self.topic, seq_bytes, payload), flags=zmq.NOBLOCK
            )
        except zmq.Again:
            self.counters["skipped_hwm"] += 1
            self._complain(
                "hwm",
                f"a subscriber is {self.config.hwm} messages behind (events.hwm): batch {seq} "
                "was not sent live; it is kept for replay",
            )
        except zmq.ZMQError as exc:
            self._complain("send", f"sending batch {seq}: {exc}; it is kept for replay")
        self.counters["batches"] += 1
        self.counters["events"] += n_events

    def _drain_subscriptions(self) -> None:
        """XPUB hands (un)subscribe messages up (first byte 1 or 0): read, counted; past
        `max_subscriptions` held, the socket is reopened. ZMQ adds a subscription to the
        socket's trie when it takes it from the peer's queue, before this reads it: the
        queue is short (`SUBSCRIPTION_RCVHWM`) and the reads are `recv`s, which take
        commands (more of the queue) once per 100 messages, so the trie holds at most a
        few queues more than this has counted.

        Only a prefix of the topic can match a message; a peer holds at most one of each
        (ZMQ keeps a set per peer), so they cost what connections do and are not limited.
        Every other subscription counts against the limit until the socket reopens: ZMQ
        also hands up a cancellation of a subscription the peer never made, so a peer could
        uncount what it holds (cancel from a second connection what the first subscribed)
        and grow the trie without end."""
        left = 0
        while True:
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            matches = self.topic.startswith(msg[1:])
            if msg[:1] == b"\x01":
                self.counters["subscriptions"] += 1
                if matches:
                    self._held += 1
                else:
                    self._stray += 1
            elif msg[:1] == b"\x00":
                self.counters["unsubscriptions"] += 1
                if matches:
                    self._held = max(0, self._held - 1)
                left += 1
            if self._stray > self.config.max_subscriptions:
                self._reset_pub()
                return
        if left >= 64:  # peers left: what they subscribed is freed
            self._schedule_trim()

    def _reset_pub(self) -> None:
        self.counters["subscription_resets"] += 1
        self._complain(
            "subscriptions",
            f"peers hold more than {self.config.max_subscriptions} subscriptions "
            "(events.max_subscriptions): the PUB socket is reopened, which drops every "
            "subscriber; they reconnect, and replay what they missed",
        )
        self._pub.close(0)
        self._held = self._stray = 0
        tries = 0
        while True:  # the old socket's listener closes on ZMQ's I/O thread
            try:
                self._pub = self._open_pub()
                break
            except zmq.ZMQError as exc:
                tries += 1
                if tries % 500 == 0:  # every ~5 s: someone else holds the address
                    log.error("kv events: cannot reopen %r: %s", self.endpoint, exc)
                time.sleep(0.01)
        self._schedule_trim()

    def _schedule_trim(self) -> None:
        if self._trim_due is None:
            self._trim_due = time.monotonic() + 0.2  # after ZMQ's threads freed it

    def _maybe_trim(self) -> None:
        if self._trim_due is not None and time.monotonic() >= self._trim_due:
            self._trim_due = None
            _trim_heap()

    # -- replays --------------------------------------------------------------------------------

    def _serve_replays(self) -> bool:
        """Take new requests, send each replay what its window allows; True while a replay
        could send more now."""
        if self._replay is None:
            return False
        while self._replay.poll(0):
            self._take_request(self._replay.recv_multipart())
        busy, unread = False, 0
        for client, r in list(self._replays.items()):
            r.release()
            unread += r.unread_bytes  # what its peer has not taken since the last turn
            if not r.ended:
                busy |= self._advance(r)
            if r.finished:
                del self._replays[client]
        self._replays_unread = unread
        return busy

    def _take_request(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self._complain(
                "replay",
                f"a replay request of {len(frames)} frames; expected "
                "[identity, '', start seq (8 bytes)]",
            )
            return
        client, _, start = frames
        if client in self._replays or len(self._replays) >= self.config.max_replays:
            self.counters["replays_dropped"] += 1
            self._complain(
                "replays",
                f"a replay request got no reply: {len(self._replays)} replays are served "
                f"or unread (events.max_replays={self.config.max_replays}), one per peer",
            )
            return
        end = self._buffer[-1][0] + 1 if self._buffer else 0
        self._replays[client] = _Replay(client, int.from_bytes(start, "big"), end)
        self.counters["replays"] += 1

    def _advance(self, r: _Replay) -> bool:
        """Send `r` its next batches while its window has room; the end marker last."""
        first = self._buffer[0][0] if self._buffer else r.end_seq
        r.next_seq = max(r.next_seq, first)  # batches that left the buffer meanwhile
        while r.next_seq < r.end_seq:
            if r.unread and r.unread_bytes >= REPLAY_WINDOW:
                return False
            seq, payload = self._buffer[r.next_seq - first]
            if not self._send_replay(r, (self.topic, seq.to_bytes(8, "big"), payload)):
                return False
            r.next_seq += 1
        if self._send_replay(r, (b"", END_SEQ, b"")):
            r.ended = True
        return False

    def _send_replay(self, r: _Replay, frames: tuple[bytes, bytes, bytes]) -> bool:
        """One message to `r`'s peer, its payload the buffer's bytes; False when its queue
        is full (try again later) or it left (the replay ends)."""
        # copy=False: pyzmq copies a payload under 64 KiB by default, and a copy's tracker
        # is done at once, which would leave the window empty whatever the peer holds
        payload = zmq.Frame(frames[2], track=True, copy=False)
        try:
            self._replay.send_multipart(
                (r.client, b"", frames[0], frames[1], payload),
                flags=zmq.NOBLOCK,
                copy=False,
            )
        except zmq.Again:
            return False
        except zmq.ZMQError:  # EHOSTUNREACH: the peer left
            r.ended, r.next_seq = True, r.end_seq
            return False
        r.unread.append((payload.tracker, len(frames[2])))
        r.unread_bytes += len(frames[2])
        return True

    # -- lifetime ---------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters; `queued`: batches waiting for the thread; `unsent`: batches handed over
        and not yet sent (or kept for replay), the one the thread is encoding included;
        `subscriptions_held`, `replays_open` and `replays_unread_bytes`: what peers hold
        now."""
        return {
            **self.counters,
            "queued": self._queue.qsize(),
            "unsent": self._queue.unfinished_tasks,
            "buffered": len(self._buffer),
            "subscriptions_held": self._held + self._stray,
            "replays_open": len(self._replays),
            "replays_unread_bytes": self._replays_unread,
        }

    def wait_sent(self, timeout: float = 5.0) -> bool:
        """Wait until every batch handed over so far is sent (or, past the HWM, kept for
        replay); False if that took longer than `timeout` seconds. An empty queue is not
        enough: the thread may hold a batch it took and has not sent yet."""
        done = self._queue.all_tasks_done
        with done:
            return done.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Send what was handed over, then close; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "kv events: the publisher thread did not stop within %.1fs", timeout
            )
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx:
            self._ctx.term()
