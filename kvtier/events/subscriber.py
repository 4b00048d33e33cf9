"""A KV event consumer of the kind routers run: live frames, gap-free replays, and a prefix
index fed by them (docs/events.md). For checks and tools; routers bring their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import zmq

from kvtier.events.wire import MEDIUMS


@dataclass(slots=True, frozen=True)
class Message:
    topic: bytes
    seq: int
    payload: bytes


@dataclass(slots=True, frozen=True)
class ClientKeys:
    """A subscriber's CURVE keys (Z85): the publisher's public key, and its own pair,
    whose public half the publisher's `events.curve_allowed_keys` lists."""

    server: bytes
    public: bytes
    secret: bytes = field(repr=False)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


class Subscriber:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        context: zmq.Context | None = None,
        rcvhwm: int = 1000,
        curve: ClientKeys | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self.curve = curve
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sub.setsockopt(zmq.IPV6, int("[" in endpoint))
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay_endpoint = replay_endpoint

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(sock)
        return sock

    def recv(self, timeout_ms: int = 5000) -> Message | None:
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        return Message(topic, int.from_bytes(seq, "big"), payload)

    def replay(self, start_seq: int, timeout_ms: int = 5000) -> list[Message]:
        """Every batch the publisher still keeps from `start_seq` on, up to its end marker."""
        if self.replay_endpoint is None:
            raise ValueError("replay: this subscriber has no replay_endpoint")
        req = self._socket(zmq.DEALER)
        req.setsockopt(zmq.IPV6, int("[" in self.replay_endpoint))
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart((b"", start_seq.to_bytes(8, "big")))
            out = []
            while req.poll(timeout_ms):
                _, topic, seq, payload = req.recv_multipart()
                n = int.from_bytes(seq, "big", signed=True)
                if n == -1:
                    return out
                out.append(Message(topic, n, payload))
            raise TimeoutError(
                f"replay from {start_seq}: no end marker within {timeout_ms} ms"
            )
        finally:
            req.close()

    def close(self) -> None:
        self.sub.close()


@dataclass
class PrefixIndex:
    """Which block hashes each medium holds, as the events say, and the chain each block
    hangs from: what a router's index keeps."""

    blocks: dict[str, set[int]] = field(
        default_factory=lambda: {m: set() for m in MEDIUMS}
    )
    parents: dict[int, int | None] = field(default_factory=dict)
    batches: int = 0

    def apply(self, payload: bytes) -> None:
        _, events, _ = msgspec.msgpack.decode(payload)
        self.batches += 1
        for e in events:
            kind = e["type"]
            if kind == "AllBlocksCleared":
                for held in self.blocks.values():
                    held.clear()
            elif kind == "BlockStored":
                parent = e["parent_block_hash"]
                for h in e["block_hashes"]:
                    self.blocks[e["medium"]].add(h)
                    self.parents[h] = parent
                    parent = h
            elif kind == "BlockRemoved":
                self.blocks[e["medium"]].difference_update(e["block_hashes"])

    def prefix(self, medium: str, hashes: list[int]) -> int:
        """How many of `hashes` (a request's chain), from the first, `medium` holds."""
        held, n = self.blocks[medium], 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n
