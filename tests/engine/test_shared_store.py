"""One store, many servers: engine processes on one real redis-server, same namespace,
share prefixes (store hits, verified); concurrent writers leave no torn page; another
tenant or model sees none of them (docs/scale-out.md)."""

import json
import os
import subprocess
import sys

import pytest


def replay(url: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "kvtier.cli.main",
        "replay",
        "--config",
        "redis",
        "--requests",
        "16",
        "--verify",
        "--json",
        *extra,
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KVTIER_STORE_URL": url, **(env or {})},
    )


def summary(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out[-3000:], err[-3000:])
    s = json.loads(out)
    assert (
        s["verify_failures"] == []
        and s["verified_requests"] == 16
        and s["failed_requests"] == 0
    )
    return s


@pytest.fixture
def url(redis_server):
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    return redis_server.url


def test_two_servers_share_a_redis_store_and_tenants_stay_apart(url):
    first, second = (
        replay(url),
        replay(url),
    )  # two processes writing the same pages at once
    a, b = summary(first), summary(second)
    assert a["bytes"]["host_to_store"] > 0 and b["bytes"]["host_to_store"] > 0
    third = summary(
        replay(url)
    )  # a new server: what the others computed is a store hit
    assert third["hit_tokens"]["storage"] > 0
    verify = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli.main",
            "store",
            "verify",
            "--config",
            "redis",
            "--json",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "KVTIER_STORE_URL": url},
    )
    v = json.loads(verify.stdout)
    assert (
        verify.returncode == 0 and v["bad"] == 0 and v["good"] > 0
    )  # no torn or mixed page
    salted = summary(replay(url, env={"KVTIER_NAMESPACE_TENANT_SALT": "tenant-b"}))
    assert (
        salted["hit_tokens"]["storage"] == 0 and salted["bytes"]["store_to_host"] == 0
    )
    other = summary(replay(url, env={"KVTIER_NAMESPACE_MODEL_ID": "another-model"}))
    assert other["hit_tokens"]["storage"] == 0 and other["bytes"]["store_to_host"] == 0


def test_purge_by_salt_finds_a_namespace_whose_manifest_redis_evicted(
    url, capsys, monkeypatch, tmp_path
):
    """main: under allkeys-lru Redis evicts the manifest (read once per 64 backups, it is
    the coldest key), and `purge --tenant SALT` found the namespace by its manifest alone:
    0 pages deleted. The config makes the namespace's id with the salt: all are found."""
    import redis

    from kvtier.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("KVTIER_STORE_URL", url)
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_SALT", "acme")
    assert main(["replay", "--config", "redis", "--requests", "10"]) == 0
    client = redis.Redis.from_url(url)
    manifests = list(client.scan_iter("*manifest*"))
    pages = [k for k in client.scan_iter("kvtier/*") if k not in manifests]
    assert len(manifests) == 1 and len(pages) > 10
    client.delete(*manifests)  # what allkeys-lru did
    capsys.readouterr()
    monkeypatch.delenv("KVTIER_NAMESPACE_TENANT_SALT")
    assert main(["store", "purge", "--config", "redis", "--tenant", "acme"]) == 0
    assert f"deleted {len(pages)} pages" in capsys.readouterr().out
    assert list(client.scan_iter("kvtier/*")) == []


def test_a_manifest_key_of_another_type_does_not_stop_a_purge(
    url, capsys, monkeypatch, tmp_path
):
    """Anyone who can write the store can put a list where a namespace's manifest belongs
    (a page key of another type is already a miss). The old code raised WRONGTYPE out of
    get_manifest, so every `store ls` and every tenant's `purge --tenant` failed (exit 2,
    nothing deleted); a manifest of another type is none, as on the file store."""
    import redis

    from kvtier.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("KVTIER_STORE_URL", url)
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_SALT", "acme")
    assert main(["replay", "--config", "redis", "--requests", "10"]) == 0
    client = redis.Redis.from_url(url)
    [manifest] = list(client.scan_iter("*manifest*"))
    pages = [k for k in client.scan_iter("kvtier/*") if k != manifest]
    client.delete(manifest)
    client.rpush(manifest, b"planted")
    capsys.readouterr()
    assert main(["store", "ls", "--config", "redis"]) == 0
    assert main(["store", "purge", "--config", "redis", "--tenant"]) == 0
    assert f"deleted {len(pages)} pages" in capsys.readouterr().out
    assert list(client.scan_iter("kvtier/*")) == [manifest]
