"""Test wrappers of kvtier.bench.servers: a missing server binary skips with the reason
outside CI and fails in CI (where .ci/run must have installed it)."""

from __future__ import annotations

import os

import pytest

from kvtier.bench import servers
from kvtier.bench.servers import S3Server, free_port  # noqa: F401  (re-exported for tests)

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _missing(exc: Exception):
    if IN_CI:
        pytest.fail(f"{exc}; .ci/run must install it")
    pytest.skip(str(exc))


class RedisServer(servers.RedisServer):
    def __init__(self, *args, **kwargs) -> None:
        try:
            super().__init__(*args, **kwargs)
        except servers.ServerMissing as exc:
            _missing(exc)


def start_cluster(workdir, masters: int = 3):
    try:
        return servers.start_cluster(workdir, masters)
    except servers.ServerMissing as exc:
        _missing(exc)
