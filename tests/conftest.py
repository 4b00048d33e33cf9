import os

# Triton kernels must be defined under the interpreter to run on CPU; set before any import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.servers import RedisServer, S3Server, start_cluster


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    nodes = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield nodes
    for n in nodes:
        n.stop()


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server()
    yield server
    server.stop()
