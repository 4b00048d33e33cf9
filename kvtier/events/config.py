"""The YAML `events:` section: where kvtier publishes KV events (docs/events.md).

    events:
      endpoint: tcp://*:5557          # ZMQ PUB; `*`, `::`, ipc:// and inproc:// bind, other tcp connects
      replay_endpoint: tcp://*:5657   # ROUTER for replays from a sequence number (optional)
      topic: kv@pod-1@my-model        # first frame of every message
      buffer_steps: 10000             # batches kept for replay
      format: map                     # map (vLLM >= 0.11, llm-d >= 0.9) or array (older consumers)

A config without the section publishes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FORMATS = ("map", "array")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(slots=True, frozen=True)
class EventsConfig:
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000  # messages a slow subscriber may fall behind before batches skip it (counted)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread before new ones are dropped (counted)
    format: Literal["map", "array"] = "map"
    data_parallel_rank: int = 0

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
        for name in ("buffer_steps", "hwm", "max_queue_size"):
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
