"""A KV event publisher alone in a process, for tests that read its memory: `python -m
tests.events.rss_publisher PUB REPLAY BATCHES BYTES CONFIG_JSON`. It publishes BATCHES
batches of about BYTES each, resets its peak RSS, prints one JSON line and then answers
each line it reads: `rss` (its RSS and peak since the reset, MiB, and the publisher's
stats), `publish` (one more batch, sent), `quit`."""

from __future__ import annotations

import gc
import json
import sys

from kvtier.events.config import EventsConfig
from kvtier.events.publisher import ZmqPublisher
from kvtier.events.wire import block_stored


def memory() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    kib = {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}
    return {"rss": kib["VmRSS"] / 1024, "peak": kib["VmHWM"] / 1024}


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def batch(i: int, size: int) -> list:
    tokens = list(range(size // 3))  # msgpack: about 3 bytes a token
    return [block_stored([i.to_bytes(8, "big")], None, tokens, 16, "GPU")]


def main(pub_ep: str, replay_ep: str, batches: str, size: str, config: str) -> None:
    pub = ZmqPublisher(
        EventsConfig(
            endpoint=pub_ep,
            replay_endpoint=replay_ep,
            **json.loads(config),
        )
    )
    n = 0
    for n in range(int(batches)):
        pub.publish(batch(n, int(size)))
    assert pub.wait_sent(60)
    gc.collect()
    reset_peak()
    print(json.dumps({**memory(), "stats": pub.stats()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "publish":
            n += 1
            pub.publish(batch(n, int(size)))
            pub.wait_sent(60)
        elif cmd == "quit":
            break
        print(json.dumps({**memory(), "stats": pub.stats()}), flush=True)
    pub.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
