"""`tierctl serve` under load and hostile input: bounded memory, concurrent clients batched,
slow clients dropped, limits on bodies and JSON, auth, an idle server that still polls.
A real uvicorn server on a loopback port in each test; waits for hangs are bounded."""

import http.client
import inspect
import json
import os
import random
import socket
import threading
import time

import pytest

from kvtier.cli.main import main
from kvtier.config import shipped_default
from kvtier.cli.serve import Limits, Listener, Server, _is_loopback
from kvtier.cli.serve_app import build_app, json_depth


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvtier"


@pytest.fixture
def serving(cache_home):
    """Start a server: serving(**Server kwargs, token=..., max_body=..., client_timeout=...)."""
    started = []

    def start(token=None, max_body=1 << 20, client_timeout=10.0, **kwargs):
        server = Server(shipped_default(), **kwargs)
        listener = Listener(
            build_app(server, token, max_body),
            "127.0.0.1",
            0,
            Limits(
                max_body=max_body, client_timeout=client_timeout, log_level="warning"
            ),
        ).start()
        started.append((listener, server))
        return listener, server

    yield start
    for listener, server in started:
        listener.stop()
        server.close()


def post(
    conn: http.client.HTTPConnection, path: str, body, headers=None
) -> tuple[int, dict]:
    conn.request(
        "POST",
        path,
        body=json.dumps(body) if not isinstance(body, bytes) else body,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def connect(listener, timeout=60) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", listener.port, timeout=timeout)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return (
            next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
        )


def test_5000_sessionless_requests_keep_memory_bounded(serving):
    """A sessionless request keeps no history: on main every one was kept forever (RSS
    287 -> 362 MB over 1,800 requests). 400-token prompts sharing 384 tokens: a kept
    history would cost ~40 MB over 5,000 requests."""
    listener, server = serving()
    rng = random.Random(0)
    shared = [rng.randrange(512) for _ in range(384)]

    def client(n: int) -> None:
        conn = connect(listener)
        for _ in range(n):
            code, body = post(
                conn,
                "/generate",
                {
                    "prompt": shared + [rng.randrange(512) for _ in range(16)],
                    "max_new_tokens": 1,
                },
            )
            assert code == 200, body
        conn.close()

    def burst(total: int) -> None:
        threads = [
            threading.Thread(target=client, args=(total // 8,)) for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    burst(400)  # warm: pools, tree, allocator arenas
    before = rss_bytes()
    burst(5000)
    grown = rss_bytes() - before
    stats = json.loads(urllib_get(listener, "/stats"))
    assert stats["sessions"]["sessions"] == 0 and stats["server"]["served"] == 5400
    assert grown < 20 << 20, f"RSS grew {grown / 2**20:.1f} MiB over 5,000 requests"


def urllib_get(listener, path: str, headers=None) -> bytes:
    conn = connect(listener)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return data


def test_200_concurrent_clients_all_get_answers_and_share_batches(serving):
    """On main (ThreadingHTTPServer, backlog 5, one request at a time behind a lock) a
    200-client burst got connections reset."""
    listener, server = serving()
    answers, errors = [], []
    go = threading.Barrier(200)

    def client(i: int) -> None:
        try:
            conn = connect(listener, timeout=300)
            go.wait(60)
            answers.append(
                post(
                    conn,
                    "/generate",
                    {"prompt": [1 + i % 500, 2, 3, 4], "max_new_tokens": 2},
                )
            )
            conn.close()
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert (
        not errors and len(answers) == 200 and all(code == 200 for code, _ in answers)
    ), errors[:3]
    stats = json.loads(urllib_get(listener, "/stats"))
    assert stats["server"]["served"] == 200
    server.cache.check_accounting()


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes) -> bool:
    """Trickle a byte every 0.2 s; True once the server closed the connection."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.2)
    for byte in trickle:
        if time.monotonic() > deadline:
            return False
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(1024) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:  # reset or broken pipe: closed
            return True
    return False


@pytest.mark.parametrize(
    "head",
    [
        b"POST /generate HTTP/1.1\r\nHost: x\r\n",  # headers never end
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n",
    ],
)  # nor the body
def test_a_slow_client_is_dropped_within_the_client_timeout(serving, head):
    """On main a connection trickling a byte every 5 s was still held after 46 s."""
    listener, _ = serving(client_timeout=1.0)
    sock = socket.create_connection(("127.0.0.1", listener.port))
    try:
        sock.sendall(head)
        assert _closed_within(sock, 20.0, b"X" * 1000), (
            "a trickling client was never dropped"
        )
    finally:
        sock.close()
    conn = connect(listener)  # the server goes on serving
    assert post(conn, "/generate", {"prompt": [1, 2, 3], "max_new_tokens": 1})[0] == 200


def test_hostile_bodies_and_headers_get_a_4xx(serving):
    listener, server = serving(token="s3cret", max_body=4096)
    auth = {"Authorization": "Bearer s3cret"}
    conn = connect(listener)
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    code, body = post(
        conn, "/generate", deep, auth
    )  # over the body cap: refused unread
    assert code == 413 and "at most 4096" in body["error"]
    conn = connect(listener)
    code, body = post(
        conn, "/generate", b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", auth
    )
    assert (
        code == 400 and "nests 1001 levels deep; at most 8" in body["error"]
    )  # main: 500 RecursionError
    for bad in ["Bearer s3cr\u00e9t", "Basic czNjcmV0", "Bearer", "bearer s3cret"]:
        conn = connect(listener)
        conn.putrequest("GET", "/stats")
        conn.putheader(
            "Authorization", bad.encode("latin-1")
        )  # main: non-ASCII got no answer at all
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 401 and "token" in json.loads(resp.read())["error"]
    # Content-Length -1 is no length: refused before any body is read (main read it all)
    sock = socket.create_connection(("127.0.0.1", listener.port), timeout=30)
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nContent-Length: -1\r\n\r\n"
        + b"[" * 65536
    )
    assert sock.recv(4096).startswith(b"HTTP/1.1 400")
    sock.close()
    conn = connect(listener)
    assert (
        post(conn, "/generate", {"prompt": [1, 2], "max_new_tokens": 1}, auth)[0] == 200
    )
    assert (
        json_depth(b'{"a": "[[[[", "b": [[1]]}') == 3
    )  # brackets in strings do not count


def test_a_body_of_escaped_quotes_is_measured_in_linear_time():
    """json_depth skips strings with a regex, on the server's event loop. Its pattern
    backtracked quadratically over an unclosed string of escaped quotes: one 80 kB body
    froze the server ~13 s for every client, and a 1 MiB one (under the default cap) ~40
    minutes. The 400 kB bodies here take milliseconds; the bound only stops a hang."""
    import subprocess
    import sys

    code = r"""
from kvtier.cli.serve_app import json_depth
quote, backslash = b'"', b'\\'
unclosed = quote + (backslash + quote) * 200_000
for body in (unclosed, unclosed + backslash, b'{"s": ' + unclosed + quote + b'}'):
    print(json_depth(body))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "0",
        "0",
        "1",
    ]  # an unclosed string runs to the end of the body
    assert json_depth(b'{"a": "x\\"]]", "b": [[1, "\\\\"]]}') == 3


def test_an_idle_server_applies_finished_writes(serving):
    """On main /stats showed writes and backups in flight until the next request came."""
    listener, server = serving()
    conn = connect(listener)
    assert (
        post(conn, "/generate", {"prompt": list(range(1, 200)), "max_new_tokens": 2})[0]
        == 200
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        q = json.loads(urllib_get(listener, "/stats"))["queues"]
        if q["writes"] == q["backups"] == 0:
            break
        time.sleep(0.05)
    assert q["writes"] == q["backups"] == 0, q
    assert json.loads(urllib_get(listener, "/stats"))["server"]["idle_polls"] > 0


def test_sessions_are_bounded_and_counted(serving):
    listener, server = serving(sessions=2)
    conn = connect(listener)
    first = post(
        conn, "/generate", {"prompt": [5, 6, 7], "max_new_tokens": 2, "session": "a"}
    )[1]
    again = post(
        conn, "/generate", {"prompt": [8], "max_new_tokens": 1, "session": "a"}
    )[1]
    assert again["history_tokens"] == 5 and again["prompt_tokens"] == 6
    # a client resending the whole conversation is not given its history twice
    whole = [5, 6, 7, *first["output"], 8, *again["output"], 9]
    resent = post(
        conn, "/generate", {"prompt": whole, "max_new_tokens": 1, "session": "a"}
    )[1]
    assert resent["history_tokens"] == 0 and resent["prompt_tokens"] == len(whole)
    for s in ("b", "c"):
        post(conn, "/generate", {"prompt": [1, 2], "max_new_tokens": 1, "session": s})
    s = json.loads(urllib_get(listener, "/stats"))["sessions"]
    assert s["sessions"] == 2 and s["sessions_cap"] == 2 and s["sessions_evicted"] == 1


def test_stats_url_sends_the_token(serving, capsys, monkeypatch):
    """On main `tierctl stats --url` had no --token and ignored KVTIER_SERVE_TOKEN: a 401."""
    listener, _ = serving(token="s3cret")
    assert main(["stats", "--url", listener.url, "--json"]) == 2
    assert (
        "HTTP 401 (send its token: --token or KVTIER_SERVE_TOKEN)"
        in capsys.readouterr().err
    )
    assert main(["stats", "--url", listener.url, "--token", "s3cret", "--json"]) == 0
    assert "tiers" in json.loads(capsys.readouterr().out)
    monkeypatch.setenv("KVTIER_SERVE_TOKEN", "s3cret")
    assert main(["stats", "--url", listener.url]) == 0


def test_loopback_hosts_bind(cache_home, capsys):
    assert (
        _is_loopback("::1") and _is_loopback("127.0.0.2") and _is_loopback("localhost")
    )
    assert not _is_loopback("0.0.0.0") and not _is_loopback("example.com")
    if not socket.has_ipv6 or not os.path.exists("/proc/net/if_inet6"):
        pytest.skip("no IPv6 on this machine")
    listener = Listener(
        build_app(object()), "::1", 0
    )  # main: listed as loopback, could not bind
    assert listener.url.startswith("http://[::1]:")
    listener.sock.close()


def test_session_ids_are_bounded_and_their_bytes_counted(serving):
    """main: a session id of any length was kept with its history (300 ids of ~900 KB:
    +266 MiB); an id is at most 256 bytes of UTF-8, and /stats counts the ids' bytes."""
    listener, _ = serving(sessions=8)
    conn = connect(listener)
    for long_id in ("x" * 257, "é" * 129, "s" * 900_000):
        status, body = post(
            conn,
            "/generate",
            {"prompt": [1, 2], "max_new_tokens": 1, "session": long_id},
        )
        assert status == 400 and "at most 256 bytes (UTF-8)" in body["error"], body
        assert len(body["error"]) < 200  # the id is not echoed back whole
    for ok_id in ("k" * 256, "é" * 128, "a"):
        status, _ = post(
            conn, "/generate", {"prompt": [1, 2], "max_new_tokens": 1, "session": ok_id}
        )
        assert status == 200
    s = json.loads(urllib_get(listener, "/stats"))["sessions"]
    assert s["sessions"] == 3 and s["session_id_bytes"] == 256 + 256 + 1, s


def test_the_output_cap_is_a_setting_and_named_when_exceeded(serving):
    """main: any request could generate 4,096 tokens, holding its batch row that long; the
    cap is --max-new-tokens (default 1,024), and a request over it is a 400 naming it."""
    listener, server = serving(max_new_tokens=8)
    conn = connect(listener)
    status, body = post(conn, "/generate", {"prompt": [1, 2], "max_new_tokens": 9})
    assert status == 400
    assert body["error"] == (
        "max_new_tokens=9: must be an integer in [1, 8] (--max-new-tokens)"
    )
    status, body = post(conn, "/generate", {"prompt": [1, 2], "max_new_tokens": 8})
    assert status == 200 and len(body["output"]) == 8
    assert inspect.signature(Server).parameters["max_new_tokens"].default == 1024
    stats = json.loads(urllib_get(listener, "/stats"))["server"]
    assert stats["passed_over"] == 0
