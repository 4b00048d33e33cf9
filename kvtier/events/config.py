"""The YAML `events:` section: where kvtier publishes KV events (docs/events.md).

    events:
      endpoint: tcp://127.0.0.1:5557  # ZMQ PUB: binds exactly this address (bind: false connects)
      replay_endpoint: tcp://127.0.0.1:5657  # ROUTER for replays from a sequence number (optional)
      topic: kv@pod-1@my-model        # first frame of every message
      buffer_steps: 10000             # batches kept for replay
      format: map                     # map (vLLM >= 0.11, llm-d >= 0.9) or array (older consumers)
      curve_secret_key_file: /etc/kvtier/events.key_secret  # CURVE: needed off loopback
      curve_allowed_keys: /etc/kvtier/subscribers/         # their public keys

A config without the section publishes nothing. A tcp endpoint that is not loopback (`*`
included) needs CURVE keys, or `insecure: true` (docs/security.md, "KV events").
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal

from kvtier.events.curve import CurveKeys, parse_secret, read_allowed, read_secret_file

FORMATS = ("map", "array")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


def tcp_host(endpoint: str) -> str | None:
    """The host of a tcp endpoint (`*`, an address without brackets, a name); None for
    ipc and inproc."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    host = host.rpartition(";")[2]  # `tcp://source;host:port` connects from a source
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(endpoint: str) -> bool:
    """ipc and inproc, or a tcp endpoint on 127.0.0.0/8, ::1 or localhost."""
    host = tcp_host(endpoint)
    if host is None:
        return True
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # `*`, an interface or a host name


@dataclass(slots=True, frozen=True)
class EventsConfig:
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000  # messages a slow subscriber may fall behind before batches skip it (counted)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread before new ones are dropped (counted)
    format: Literal["map", "array"] = "map"
    data_parallel_rank: int = 0
    bind: bool = True  # False: the PUB connects to `endpoint` (a relay that binds); the replay ROUTER always binds
    insecure: bool = False  # True: allow a non-loopback tcp endpoint without CURVE
    curve_secret_key: str | None = field(
        default=None, repr=False
    )  # the publisher's CURVE secret key (Z85)
    curve_secret_key_file: str | None = (
        None  # ... or a file holding it (or a zmq.auth certificate)
    )
    curve_allowed_keys: str | None = (
        None  # file or directory of the subscribers' public keys
    )
    tokens: bool | None = (
        None  # BlockStored token_ids; None: sent without a tenant key, withheld with one
    )
    max_subscriptions: int = (
        256  # held by the PUB socket at once; past it every peer is dropped (counted)
    )
    max_replays: int = (
        8  # replays served or unread at once; requests past it get no reply (counted)
    )

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(_SCHEMES):
                raise ValueError(
                    f"{name}={value!r}: expected a ZMQ endpoint starting with {', '.join(_SCHEMES)}"
                )
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint:
            raise ValueError(
                f"replay_endpoint={self.replay_endpoint!r}: must differ from endpoint"
            )
        for name in (
            "buffer_steps",
            "hwm",
            "max_queue_size",
            "max_subscriptions",
            "max_replays",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if self.format not in FORMATS:
            raise ValueError(
                f"format={self.format!r}: allowed values are {', '.join(FORMATS)}"
            )
        if (
            isinstance(self.data_parallel_rank, bool)
            or not isinstance(self.data_parallel_rank, int)
            or self.data_parallel_rank < 0
        ):
            raise ValueError(
                f"data_parallel_rank={self.data_parallel_rank!r}: must be an integer >= 0"
            )
        keys = self.curve_keys()  # refuses an unreadable or malformed key now
        if keys is None and not self.insecure:
            self._refuse_open_endpoints()

    def _refuse_open_endpoints(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not is_loopback(value):
                where = (
                    "listens on every interface" if "*" in value else "is not loopback"
                )
                raise ValueError(
                    f"{name}={value!r}: {where} and no peer is authenticated; set "
                    "events.curve_secret_key_file and events.curve_allowed_keys, use a "
                    "loopback address or ipc://, or set events.insecure: true (docs/events.md)"
                )

    def curve_keys(self) -> CurveKeys | None:
        """The publisher's CURVE keys, or None without them. Errors never show a key."""
        inline, path = self.curve_secret_key, self.curve_secret_key_file
        if inline is not None and path is not None:
            raise ValueError(
                "curve_secret_key and curve_secret_key_file are both set: give one"
            )
        if inline is None and path is None:
            if self.curve_allowed_keys is not None:
                raise ValueError(
                    f"curve_allowed_keys={self.curve_allowed_keys!r}: needs the publisher's "
                    "key, events.curve_secret_key_file (or curve_secret_key)"
                )
            return None
        if self.curve_allowed_keys is None:
            raise ValueError(
                "curve_allowed_keys: required with a CURVE secret key (a file or directory "
                "of the subscribers' public keys; docs/events.md)"
            )
        if inline is not None:
            if not isinstance(inline, str):
                raise ValueError(
                    "curve_secret_key: expected a string of 40 Z85 characters"
                )
            public, secret = parse_secret(inline.encode(), "curve_secret_key")
        else:
            public, secret = read_secret_file(path, "curve_secret_key_file")
        return CurveKeys(
            public, secret, read_allowed(self.curve_allowed_keys, "curve_allowed_keys")
        )
