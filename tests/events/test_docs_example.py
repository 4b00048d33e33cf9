"""The CURVE subscriber docs/events.md shows runs as written, against a publisher with keys
made as the page says (over ipc)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import zmq.auth

from kvtier.events.config import EventsConfig
from kvtier.events.publisher import ZmqPublisher
from kvtier.events.wire import wire_hash
from tests.events.test_publisher import BATCHES, H, ipc, wait_for  # noqa: F401

DOC = Path(__file__).resolve().parents[2] / "docs" / "events.md"


def example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    (tail,) = [b for b in blocks if b.startswith('"""kv_events_tail.py')]
    return tail


def test_the_documented_curve_subscriber_prints_the_events(tmp_path, ipc):  # noqa: F811
    keys, subscribers = tmp_path / "events", tmp_path / "events" / "subscribers"
    subscribers.mkdir(parents=True)
    zmq.auth.create_certificates(str(keys), "publisher")
    zmq.auth.create_certificates(str(subscribers), "router-a")
    client = tmp_path / "router-a.key_secret"
    os.rename(subscribers / "router-a.key_secret", client)
    os.chmod(keys / "publisher.key_secret", 0o600)
    script = tmp_path / "kv_events_tail.py"
    script.write_text(example())
    pub = ZmqPublisher(
        EventsConfig(
            endpoint=ipc[0],
            replay_endpoint=ipc[1],
            topic="kv@pod-1@m",
            curve_secret_key_file=str(keys / "publisher.key_secret"),
            curve_allowed_keys=str(subscribers),
        )
    )
    env = {
        **os.environ,
        "EVENTS_ENDPOINT": ipc[0],
        "EVENTS_REPLAY": ipc[1],
        "EVENTS_TOPIC": "kv@pod-1@",
        "EVENTS_SERVER_KEY": str(keys / "publisher.key"),
        "EVENTS_CLIENT_KEY": str(client),
        "EVENTS_COUNT": "3",
    }
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        wait_for(
            lambda: pub.stats()["subscriptions"] >= 1, "the example's subscription"
        )
        for b in BATCHES:
            assert pub.publish(b)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pub.close()
    assert proc.returncode == 0
    assert out.splitlines() == [
        f"0 BlockStored GPU {[wire_hash(H[0]), wire_hash(H[1])]}",
        f"1 BlockStored CPU {[wire_hash(H[2])]}",
        f"1 BlockStored STORAGE {[wire_hash(h) for h in H[:3]]}",
        f"2 BlockRemoved GPU {[wire_hash(H[0])]}",
        "2 AllBlocksCleared None None",
    ]
