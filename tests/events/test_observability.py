"""What an operator sees of the KV event publisher: `tierctl config` shows the `events:`
section with its keys masked; a cache's `stats()` (tierctl serve's `/stats`) and its
Prometheus metrics count refused peers, dropped replays and subscriptions."""

from __future__ import annotations

import zmq
from prometheus_client import generate_latest

from kvtier.cache import TieredCache
from kvtier.cli.main import main
from kvtier.config import load_config
from kvtier.events.subscriber import ClientKeys, Subscriber
from tests.events.test_cache_events import GEOMETRY
from tests.events.test_publisher import ipc, wait_for  # noqa: F401
from tests.events.test_security import curve_files


def test_tierctl_config_shows_the_events_section_with_keys_masked(tmp_path, capsys):
    _, allowed, *_ = curve_files(tmp_path)
    secret = zmq.curve_keypair()[1].decode()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "events:\n"
        "  endpoint: tcp://*:5557\n"
        f"  curve_secret_key: '{secret}'\n"
        f"  curve_allowed_keys: {allowed}\n"
        "  tokens: false\n"
    )
    assert main(["config", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert secret not in out
    assert "events.curve_secret_key = ***  (file" in out
    assert f"events.curve_allowed_keys = '{allowed}'" in out
    assert "events.endpoint = 'tcp://*:5557'" in out
    assert "events.tokens = False" in out and "events.max_subscriptions = 256" in out


def test_stats_and_prometheus_count_refused_peers_dropped_replays_and_subscriptions(
    tmp_path,
    ipc,  # noqa: F811
):
    secret, allowed, server, client, other = curve_files(tmp_path)
    doc = {
        "pool": {"size": 256, **GEOMETRY},
        "events": {
            "endpoint": ipc[0],
            "replay_endpoint": ipc[1],
            "topic": "t",
            "curve_secret_key_file": str(secret),
            "curve_allowed_keys": str(allowed),
            "max_replays": 1,
        },
    }
    cache = TieredCache(load_config(None, doc, env={}))
    good = Subscriber(*ipc, topic="t", curve=ClientKeys(server, *client))
    stranger = Subscriber(*ipc, topic="t", curve=ClientKeys(server, *other))
    ctx = zmq.Context()
    unread = []
    try:
        wait_for(
            lambda: (
                cache.stats()["events"]["subscriptions_held"] == 1
                and cache.stats()["events"]["refused_peers"] >= 1
            ),
            "the subscription and the refusal",
        )
        for _ in range(300):  # a replay longer than one window
            cache.events.publisher.publish([{"type": "AllBlocksCleared"}] * 2000)
        assert cache.events.publisher.wait_sent(30)
        for _ in range(2):  # one replay is open, unread; the other request is dropped
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RCVHWM, 1)
            ClientKeys(server, *client).apply(d)
            d.connect(ipc[1])
            d.send_multipart((b"", (0).to_bytes(8, "big")))
            unread.append(d)
        wait_for(
            lambda: cache.stats()["events"]["replays_dropped"] == 1, "a dropped replay"
        )
        events = cache.stats()["events"]
        assert events["replays_open"] == 1 and events["replays"] == 1
        text = generate_latest(cache.metrics_registry()).decode()
        for line in (
            "kvtier_events_refused_peers_total ",
            "kvtier_events_replays_dropped_total 1.0",
            "kvtier_events_subscriptions_total 1.0",
            "kvtier_events_subscriptions_held 1.0",
            "kvtier_events_subscription_resets_total 0.0",
            "kvtier_events_replays_open 1.0",
        ):
            assert line in text, line
    finally:
        for d in unread:
            d.close()
        ctx.term()
        good.close()
        stranger.close()
        cache.close()
