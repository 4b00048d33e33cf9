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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import zmq

from kvtier.errors import Complaints
from kvtier.events.config import EventsConfig
from kvtier.events.wire import Encoder

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard, ipc and inproc endpoints bind; a concrete tcp host connects."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
    )


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
        self._ctx = context or zmq.Context.instance()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._complain = Complaints(log, "kv events: ")
        self.counters = {
            "batches": 0,
            "events": 0,
            "replays": 0,
            "refused_queue_full": 0,
            "skipped_hwm": 0,
            "subscriptions": 0,
            "unsubscriptions": 0,
        }
        # made here so a bad endpoint fails the caller; used only by the thread from then on
        self._pub = self._ctx.socket(
            zmq.XPUB
        )  # a SUB subscribes as to PUB; NODROP lets us see a full queue
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._replay = None
        try:
            (self._pub.bind if binds(self.endpoint) else self._pub.connect)(
                self.endpoint
            )
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(
                    zmq.SNDHWM, 2 * (config.buffer_steps + 1)
                )  # a whole replay fits
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(
                f"events: cannot open endpoint {self.endpoint!r} / replay {self.replay_endpoint!r}: "
                f"{exc}"
            ) from exc
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="kvtier-events", daemon=True
        )
        self._thread.start()

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
            self._serve_replays()
            self._drain_subscriptions()
            try:
                item = self._queue.get(timeout=0.05)
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
        """XPUB hands (un)subscribe messages up (first byte 1 or 0): read, counted."""
        while self._pub.poll(0):
            msg = self._pub.recv(zmq.NOBLOCK)
            if msg[:1] == b"\x01":
                self.counters["subscriptions"] += 1
            elif msg[:1] == b"\x00":
                self.counters["unsubscriptions"] += 1

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                self._complain(
                    "replay",
                    f"a replay request of {len(frames)} frames; expected "
                    "[identity, '', start seq (8 bytes)]",
                )
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart(
                        (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                    )
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
            self.counters["replays"] += 1

    # -- lifetime ---------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters; `queued`: batches waiting for the thread; `unsent`: batches handed over
        and not yet sent (or kept for replay), the one the thread is encoding included."""
        return {
            **self.counters,
            "queued": self._queue.qsize(),
            "unsent": self._queue.unfinished_tasks,
            "buffered": len(self._buffer),
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
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
