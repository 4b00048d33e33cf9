"""KV events as vLLM 0.33.0 puts them on the wire (`vllm/distributed/kv_events.py`).

A message is three ZMQ frames: topic, sequence number (8 bytes big-endian, 0, 1, 2, ... per
publisher) and a msgpack payload `[ts, [events], data_parallel_rank]`. In the `map` format
each event is a map tagged by `type` (vLLM since PR #42892; llm-d from v0.9.0); `BlockStored`
always carries all of `block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name` (vLLM's decoder refuses a map without `lora_name`). The `array` format is
the positional layout older consumers decode:

    ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", hashes, medium]
    ["AllBlocksCleared"]

A block hash on the wire is the low 64 bits of the hash bytes read big-endian, as vLLM
sends them (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

MEDIUMS = ("GPU", "CPU", "STORAGE")
_MASK = (1 << 64) - 1


def wire_hash(h: bytes) -> int:
    return int.from_bytes(h, "big") & _MASK


def block_stored(
    hashes: Sequence[bytes],
    parent: bytes | None,
    token_ids: Sequence[int],
    block_size: int,
    medium: str,
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [wire_hash(h) for h in hashes],
        "parent_block_hash": None if parent is None else wire_hash(parent),
        "token_ids": [int(t) for t in token_ids],
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def block_removed(hashes: Sequence[bytes], medium: str) -> dict[str, Any]:
    return {
        "type": "BlockRemoved",
        "block_hashes": [wire_hash(h) for h in hashes],
        "medium": medium,
    }


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


_POSITIONS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def positional(event: dict[str, Any]) -> list:
    kind = event["type"]
    return [kind, *(event[f] for f in _POSITIONS[kind])]


class Encoder:
    """Payloads of one format; not shared between threads (msgspec's encoder is not)."""

    def __init__(self, fmt: str = "map") -> None:
        self.format = fmt
        self._enc = msgspec.msgpack.Encoder()

    def payload(self, ts: float, events: list[dict[str, Any]], dp_rank: int) -> bytes:
        if self.format == "array":
            events = [positional(e) for e in events]
        return self._enc.encode([ts, events, dp_rank])
