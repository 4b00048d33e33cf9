"""`tierctl serve`: the reference engine behind HTTP (uvicorn + Starlette; loopback by default).

    POST /generate  {"prompt": [ids], "max_new_tokens": 16, "session": "optional"}
    GET  /metrics   Prometheus text
    GET  /stats     JSON (cache.stats(), sessions, server)
    POST /flush     drop device and host contents (the store keeps its pages)
    POST /hints/{pin,prefetch,demote,retain,release}  {"prompt": [ids] | "session": ..., ...}

One scheduler thread owns the engine and the cache (`kvtier.engine.loop`): concurrent
requests share its batches. The limits (docs/http-api.md): a client has `--client-timeout`
seconds to send a whole request, bodies over `--max-body` and JSON nested deeper than 8
are refused, at most `--max-connections` connections and `--max-queue` queued requests,
a listen backlog of `--backlog`; at most `--sessions` session histories, each dropped
after `--session-ttl` seconds unused.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

from kvtier.cli.serve_app import MAX_BODY, RequestFailed, RequestRejected, build_app
from kvtier.errors import KvtierConfigError

log = logging.getLogger(__name__)
MAX_NEW_TOKENS = 1024  # per request: a longer generation holds its batch row that long
# decode steps a request runs before it yields its batch row to a waiting one (its KV is
# cached and it goes on later where it stopped): a short request never waits for long
# decodes to end
TIME_SLICE = 64
MAX_SESSION_ID = 256  # bytes of a session id, UTF-8: a name or a UUID, never a document
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_arguments(p) -> None:
    p.description = "The reference engine behind HTTP. API, request and response, limits, metrics: docs/http-api.md."
    p.add_argument(
        "--config",
        default=None,
        help="a YAML file, or a shipped config by name: default, memory, redis, redis-cluster, s3",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="a non-loopback address needs --token"
    )
    p.add_argument("--port", type=int, default=9400)
    p.add_argument(
        "--token",
        default=None,
        help="require Authorization: Bearer TOKEN (or env KVTIER_SERVE_TOKEN)",
    )
    p.add_argument(
        "--max-body",
        type=int,
        default=MAX_BODY,
        help="largest request body in bytes (default 1 MiB)",
    )
    p.add_argument(
        "--client-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send a whole request",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections at most; more get a 503",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="generate requests queued at most; more get a 503",
    )
    p.add_argument(
        "--backlog",
        type=int,
        default=2048,
        help="connections the kernel queues before accept",
    )
    p.add_argument(
        "--batch", type=int, default=4, help="requests per forward (default 4)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=MAX_NEW_TOKENS,
        help=f"the most tokens one request may generate (default {MAX_NEW_TOKENS})",
    )
    p.add_argument(
        "--time-slice",
        type=int,
        default=TIME_SLICE,
        help="decode steps a request runs before a waiting request may take its batch "
        f"row; it goes on later from the cache (default {TIME_SLICE})",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=4096,
        help="session histories kept at most (LRU)",
    )
    p.add_argument(
        "--session-ttl",
        type=float,
        default=3600.0,
        help="seconds a session's history outlives its last turn",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="info logs every request (access log)",
    )


@dataclass(frozen=True, slots=True)
class Limits:
    max_body: int = MAX_BODY
    client_timeout: float = 10.0
    max_connections: int = 1024
    backlog: int = 2048
    log_level: str = "info"


def check_arguments(args) -> None:
    """One line naming the flag, its value and what is allowed."""
    if not 0 <= args.port <= 65535:
        raise KvtierConfigError(f"serve --port {args.port}: must be in 0..65535")
    for flag, value in (
        ("--max-body", args.max_body),
        ("--max-connections", args.max_connections),
        ("--max-queue", args.max_queue),
        ("--backlog", args.backlog),
        ("--batch", args.batch),
        ("--sessions", args.sessions),
        ("--max-new-tokens", args.max_new_tokens),
        ("--time-slice", args.time_slice),
    ):
        if value < 1:
            raise KvtierConfigError(f"serve {flag} {value}: must be an integer >= 1")
    for flag, value in (
        ("--client-timeout", args.client_timeout),
        ("--session-ttl", args.session_ttl),
    ):
        if not 0 < value < float("inf"):
            raise KvtierConfigError(
                f"serve {flag} {value}: must be a number of seconds > 0"
            )


class Server:
    """Engine + cache on one scheduler thread (`EngineLoop`); request checks here."""

    def __init__(
        self,
        config_path: str,
        seed: int = 0,
        batch: int = 4,
        sessions: int = 4096,
        session_ttl_s: float | None = 3600.0,
        max_queue: int = 1024,
        max_new_tokens: int = MAX_NEW_TOKENS,
        time_slice: int | None = TIME_SLICE,
    ) -> None:
        from kvtier.cache import TieredCache
        from kvtier.config import shipped_default
        from kvtier.cli.replay import model_of, with_weights
        from kvtier.config import load_config
        from kvtier.engine.engine import Engine
        from kvtier.engine.loop import EngineLoop
        from kvtier.engine.sessions import Histories

        config = load_config(config_path, base=shipped_default())
        self.model = model_of(config, seed)
        self.cache = TieredCache(with_weights(config, self.model))
        self.histories = Histories(sessions, session_ttl_s)
        try:  # a model the cache cannot hold is refused here: the cache's threads end
            self.engine = Engine(
                self.cache,
                self.model,
                max_batch=batch,
                histories=self.histories,
                time_slice=time_slice,
            )
        except BaseException:
            self.cache.close()
            raise
        self.loop = EngineLoop(self.engine, max_queue=max_queue)
        self.max_new_tokens = max_new_tokens
        self._anonymous = 0

    def turn_of(self, body: dict):
        """The engine turn a /generate body asks for, and whether its session is kept."""
        from kvtier.engine.workloads import Turn

        unknown = sorted(set(body) - _GENERATE_FIELDS)
        if unknown:  # a misspelt max_new_tokens would silently get the default
            raise ValueError(
                f"unknown field {unknown[0]!r}; allowed: {', '.join(sorted(_GENERATE_FIELDS))}"
            )
        prompt = body.get("prompt")
        vocab = self.model.config.vocab
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(_is_int(t) and 0 <= t < vocab for t in prompt)
        ):
            raise ValueError(
                f"prompt must be a non-empty list of token ids in [0, {vocab})"
            )
        n = body.get("max_new_tokens", 16)
        if not _is_int(n) or not 1 <= n <= self.max_new_tokens:
            raise ValueError(
                f"max_new_tokens={n!r}: must be an integer in [1, {self.max_new_tokens}] "
                "(--max-new-tokens)"
            )
        session = body.get("session")
        if session is not None and not isinstance(session, str):
            raise ValueError(f"session={json.dumps(session)[:40]}: must be a string")
        if session is not None and len(session.encode("utf-8", "surrogatepass")) > (
            MAX_SESSION_ID
        ):  # every kept history keeps its id: --sessions ids of any length had no bound
            raise ValueError(
                f"session={session[:24]!r}...: an id of "
                f"{len(session.encode('utf-8', 'surrogatepass'))} bytes; at most "
                f"{MAX_SESSION_ID} bytes (UTF-8)"
            )
        if session is None:  # one request, no history kept: its id only keeps it apart
            self._anonymous += 1
            return Turn(f"\0anonymous-{self._anonymous}", 0, tuple(prompt), n), False
        return Turn(session, 0, tuple(prompt), n), True

    def answer(self, body: dict, r) -> dict:
        if r.error is not None:
            raise (RequestRejected if r.rejected else RequestFailed)(r.error)
        return {
            "output": r.output,
            "prompt_tokens": len(r.prompt),
            "history_tokens": len(r.prompt) - len(body["prompt"]),
            "cached_tokens": r.cached,
            "hits": {
                "device": r.device_hit,
                "host": r.host_hit,
                "storage": r.storage_hit,
            },
        }

    # the rest runs on the engine loop's thread (EngineLoop.call)
    def stats(self) -> dict:
        return {
            **self.cache.stats(),
            "sessions": self.histories.stats(),
            "server": self.loop.stats(),
        }

    def metrics(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.cache.metrics_registry())

    def flush(self) -> dict:
        self.cache.flush()
        return {"flushed": True}

    def hint(self, op: str, args: dict) -> dict:
        """An agent's hint (`serve_hints.check`ed) for a prompt's or a session's prefix."""
        from kvtier.cli import serve_hints

        return serve_hints.apply(self.cache, self.histories, op, args)

    def close(self) -> None:
        self.loop.close()


class Listener:
    """uvicorn on a socket bound here (so `--port 0` names its port before serving)."""

    def __init__(
        self,
        app,
        host: str,
        port: int,
        limits: Limits = Limits(),
        log_config: dict | None = None,
    ) -> None:
        """`log_config`: a logging dictConfig to apply (the CLI's); None leaves logging alone."""
        import uvicorn

        from kvtier.cli.serve_http import protocol_with_deadline

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(
                limits.backlog
            )  # clients queue from here on, before uvicorn accepts
        except OSError as exc:
            self.sock.close()
            raise KvtierConfigError(
                f"serve: cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        self.port = self.sock.getsockname()[1]
        self.url = (
            f"http://{f'[{host}]' if family == socket.AF_INET6 else host}:{self.port}"
        )
        config = uvicorn.Config(
            app,
            http=protocol_with_deadline(limits.client_timeout),
            lifespan="off",
            backlog=limits.backlog,
            limit_concurrency=limits.max_connections,
            timeout_keep_alive=5,
            timeout_graceful_shutdown=30,
            log_level=limits.log_level,
            access_log=limits.log_level in ("info", "debug"),
            log_config=log_config,
        )
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def serve(self) -> None:
        """Serve until SIGTERM/SIGINT (in the main thread) or `stop()`; graceful."""
        self.server.run(sockets=[self.sock])

    def start(self, timeout: float = 30.0) -> Listener:
        """Serve on a thread (no signal handling there); returns once it accepts."""
        self._thread = threading.Thread(
            target=self.serve, name="kvtier-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while (
            not self.server.started
            and self._thread.is_alive()
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.sock.close()


def run(args, default_config: str) -> int:
    token = args.token or os.environ.get("KVTIER_SERVE_TOKEN") or None
    if not _is_loopback(args.host) and token is None:
        raise KvtierConfigError(
            f"serve --host {args.host}: a non-loopback address needs a token "
            "(--token or KVTIER_SERVE_TOKEN); clients send Authorization: Bearer <token>"
        )
    check_arguments(args)
    limits = Limits(
        args.max_body,
        args.client_timeout,
        args.max_connections,
        args.backlog,
        args.log_level,
    )
    server = Server(
        args.config or default_config,
        batch=args.batch,
        sessions=args.sessions,
        session_ttl_s=args.session_ttl,
        max_queue=args.max_queue,
        max_new_tokens=args.max_new_tokens,
        time_slice=args.time_slice,
    )
    try:
        listener = Listener(
            build_app(server, token, args.max_body),
            args.host,
            args.port,
            limits,
            _log_config(args.log_level),
        )
    except KvtierConfigError:
        server.close()
        raise

    # before uvicorn installs its handlers, and when it re-raises the signal that stopped it
    # once done: stop (again), then close the cache and return
    def stop(*_) -> None:
        listener.server.should_exit = True

    previous = {
        sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    print(
        f"tierctl serve: {listener.url} (/generate /metrics /stats /flush)", flush=True
    )
    log.info(
        "serving %s: batch %d, sessions %d (ttl %.0fs), client timeout %.1fs, max body %d, token %s",
        listener.url,
        args.batch,
        args.sessions,
        args.session_ttl,
        args.client_timeout,
        args.max_body,
        "required" if token else "none",
    )
    try:
        listener.serve()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        listener.sock.close()
        server.close()
    return 0


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _log_config(level: str) -> dict:
    """uvicorn's logging (its access log included), with kvtier's loggers on the same handler."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["loggers"]["kvtier"] = {
        "handlers": ["default"],
        "level": level.upper(),
        "propagate": False,
    }
    return cfg


_GENERATE_FIELDS = {"prompt", "max_new_tokens", "session"}


def _is_int(value) -> bool:
    """A JSON integer: `true` is a bool, which Python counts as an int."""
    return isinstance(value, int) and not isinstance(value, bool)
