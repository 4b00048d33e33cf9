"""`tierctl serve`: the reference engine behind a small HTTP server (loopback by default).

    POST /generate  {"prompt": [ids], "max_new_tokens": 16, "session": "optional"}
    GET  /metrics   Prometheus text
    GET  /stats     JSON (cache.stats())
    POST /flush     drop device and host contents (the store keeps its pages)
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvtier.errors import KvtierConfigError

log = logging.getLogger(__name__)
MAX_BODY = 1 << 20  # a /generate body is a list of token ids: 1 MiB is ~100k tokens
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(p) -> None:
    p.description = "The reference engine behind HTTP. API, request and response, metrics: docs/http-api.md."
    p.add_argument("--config", default=None, help="a YAML file, or a shipped config by name: default, memory, redis, redis-cluster, s3")
    p.add_argument("--host", default="127.0.0.1", help="a non-loopback address needs --token")
    p.add_argument("--port", type=int, default=9400)
    p.add_argument("--token", default=None, help="require Authorization: Bearer TOKEN (or env KVTIER_SERVE_TOKEN)")
    p.add_argument("--max-body", type=int, default=MAX_BODY, help="largest request body in bytes (default 1 MiB)")


class RequestRejected(ValueError):
    """The request itself is the problem (too large for this server): a 4xx."""


class RequestFailed(RuntimeError):
    """The request was released after a failure on our side (a failed load): a 503."""


class Server:
    """Engine + cache behind one lock: the engine runs one batch at a time."""

    def __init__(self, config_path: str, seed: int = 0) -> None:
        from kvtier.cache import TieredCache
        from kvtier.cli.replay import with_weights
        from kvtier.config import load_config
        from kvtier.engine.engine import Engine
        from kvtier.engine.model import ModelConfig, TinyTransformer

        self.model = TinyTransformer(ModelConfig(seed=seed))
        self.cache = TieredCache(with_weights(load_config(config_path), self.model))
        self.engine = Engine(self.cache, self.model)
        self.lock = threading.Lock()
        self.served = 0

    def generate(self, body: dict) -> dict:
        unknown = sorted(set(body) - _GENERATE_FIELDS)
        if unknown:  # a misspelt max_new_tokens would silently get the default
            raise ValueError(f"unknown field {unknown[0]!r}; allowed: {', '.join(sorted(_GENERATE_FIELDS))}")
        prompt = body.get("prompt")
        vocab = self.model.config.vocab
        if not isinstance(prompt, list) or not prompt or not all(_is_int(t) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt must be a non-empty list of token ids in [0, {vocab})")
        n = body.get("max_new_tokens", 16)
        if not _is_int(n) or not 1 <= n <= 4096:
            raise ValueError(f"max_new_tokens={n!r}: must be an integer in [1, 4096]")
        if body.get("session") is not None and not isinstance(body["session"], str):
            raise ValueError(f"session={body['session']!r}: must be a string")
        with self.lock:
            self.served += 1
            from kvtier.engine.workloads import Turn

            session = str(body.get("session") or f"http-{self.served}")
            [r] = self.engine.run([Turn(session, 0, tuple(prompt), n)])
        if r.error is not None:
            raise (RequestRejected if r.rejected else RequestFailed)(r.error)
        return {"output": r.output, "prompt_tokens": len(r.prompt), "cached_tokens": r.cached,
                "hits": {"device": r.device_hit, "host": r.host_hit, "storage": r.storage_hit}}

    def stats(self) -> dict:
        with self.lock:
            return self.cache.stats()

    def metrics(self) -> bytes:
        from prometheus_client import generate_latest

        with self.lock:
            return generate_latest(self.cache.metrics_registry())

    def flush(self) -> dict:
        with self.lock:
            self.cache.flush()
        return {"flushed": True}

    def close(self) -> None:
        with self.lock:
            self.cache.close()


def make_handler(server: Server, token: str | None = None, max_body: int = MAX_BODY):
    """Routes in docs/http-api.md. Every answer is JSON (but /metrics); a bad request is a
    4xx, a failure of ours a 5xx, and the server keeps serving. With `token`, every request
    needs `Authorization: Bearer <token>`."""

    class Handler(BaseHTTPRequestHandler):
        timeout = 30  # seconds a client may take to send its request

        def log_message(self, fmt, *args):  # quiet: metrics carry the numbers
            return

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj: dict) -> None:
            self._send(code, json.dumps(obj).encode())

        def _allowed(self) -> bool:
            if token is None or hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {token}"):
                return True
            self._json(401, {"error": "missing or wrong token: send Authorization: Bearer <token>"})
            return False

        def do_GET(self):
            if not self._allowed():
                return
            try:
                if self.path == "/stats":
                    self._json(200, server.stats())
                elif self.path == "/metrics":
                    self._send(200, server.metrics(), "text/plain; version=0.0.4")
                else:
                    self._json(404, {"error": f"no route GET {self.path}; routes: GET /stats /metrics, "
                                              "POST /generate /flush"})
            except Exception as exc:
                log.exception("serve: GET %s failed", self.path)
                self._json(500, {"error": f"internal error: {type(exc).__name__}: {exc}"})

        def do_POST(self):
            """Every request gets a JSON answer; no error drops the connection or the server."""
            if not self._allowed():
                return
            try:
                body = self._body()
                if self.path == "/generate":
                    self._json(200, server.generate(body))
                elif self.path == "/flush":
                    self._json(200, server.flush())
                else:
                    self._json(404, {"error": f"no route POST {self.path}; routes: POST /generate /flush"})
            except _TooLarge as exc:
                self.close_connection = True  # the rest of the body is not read
                self._json(413, {"error": str(exc)})
            except RequestRejected as exc:
                self._json(413, {"error": str(exc)})
            except RequestFailed as exc:
                self._json(503, {"error": str(exc)})
            except (ValueError, json.JSONDecodeError) as exc:
                self._json(400, {"error": str(exc)})
            except Exception as exc:  # a bug of ours: say so, keep serving
                log.exception("serve: %s %s failed", self.command, self.path)
                self._json(500, {"error": f"internal error: {type(exc).__name__}: {exc}"})

        def _body(self) -> dict:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise ValueError("Content-Length must be an integer") from None
            if length > max_body:
                raise _TooLarge(f"body of {length} bytes; at most {max_body}")
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
            return body

    return Handler


class _TooLarge(ValueError):
    pass


def run(args, default_config: str) -> int:
    token = args.token or os.environ.get("KVTIER_SERVE_TOKEN") or None
    if args.host not in LOOPBACK and token is None:
        raise KvtierConfigError(f"serve --host {args.host}: a non-loopback address needs a token "
                                "(--token or KVTIER_SERVE_TOKEN); clients send Authorization: Bearer <token>")
    if not 0 <= args.port <= 65535:
        raise KvtierConfigError(f"serve --port {args.port}: must be in 0..65535")
    server = Server(args.config or default_config)
    try:
        httpd = ThreadingHTTPServer((args.host, args.port), make_handler(server, token, args.max_body))
    except OSError as exc:
        server.close()
        raise KvtierConfigError(f"serve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    httpd.daemon_threads = True

    def drain(signum, frame):  # SIGTERM: stop accepting, finish the request in hand, close the cache
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    previous = signal.signal(signal.SIGTERM, drain)
    print(f"tierctl serve: http://{args.host}:{httpd.server_address[1]} (/generate /metrics /stats /flush)", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        httpd.server_close()
        server.close()
    return 0


_GENERATE_FIELDS = {"prompt", "max_new_tokens", "session"}


def _is_int(value) -> bool:
    """A JSON integer: `true` is a bool, which Python counts as an int."""
    return isinstance(value, int) and not isinstance(value, bool)
