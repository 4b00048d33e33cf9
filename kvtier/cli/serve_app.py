"""The ASGI app of `tierctl serve` (Starlette) and the request checks in front of it.

Routes in docs/http-api.md. Every answer the app gives is JSON (but /metrics); a bad
request is a 4xx, a failure of ours a 5xx, and the server keeps serving. With a token,
every request needs exactly one `Authorization: Bearer <token>` header: anything else
(missing, twice, not ASCII, another scheme) is a 401.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

log = logging.getLogger(__name__)
MAX_BODY = 1 << 20  # a /generate body is a list of token ids: 1 MiB is ~100k tokens
MAX_DEPTH = 8  # JSON nesting: a /generate body needs 2
# a JSON string, or an unclosed one to the end of the body: possessive (no backtracking), and
# every match attempt succeeds, so one pass is linear whatever the body (the pattern without
# both took quadratic time over an unclosed string of escaped quotes, on the event loop)
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.S)


class RequestRejected(ValueError):
    """The request itself is the problem (too large for this server): a 413."""


class RequestFailed(RuntimeError):
    """The request was released after a failure on our side (a failed load): a 503."""


class _TooLarge(ValueError):
    pass


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in `raw` (strings skipped), without parsing it:
    a deep body is refused before `json.loads` recurses into it."""
    depth = deepest = 0
    for ch in _STRINGS.sub(b'""', raw).translate(
        None, b' \t\r\n"0123456789,:.-+eEtrufalsn'
    ):
        if ch in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in b"]}":
            depth -= 1
    return deepest


def parse_body(raw: bytes, max_depth: int = MAX_DEPTH) -> dict:
    depth = json_depth(raw)
    if depth > max_depth:
        raise ValueError(f"body nests {depth} levels deep; at most {max_depth}")
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
    return body


async def read_body(request: Request, max_body: int) -> bytes:
    """The body, refused (413) once it passes `max_body`: a declared length at once, a
    chunked one as it arrives. Nothing beyond the limit is read or kept."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise _TooLarge(f"body of {declared} bytes; at most {max_body} (--max-body)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise _TooLarge(
                f"body of more than {max_body} bytes; at most {max_body} (--max-body)"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def _error(code: int, message: str, close: bool = False) -> JSONResponse:
    return JSONResponse(
        {"error": message},
        status_code=code,
        headers={"Connection": "close"} if close else None,
    )


class TokenGate:
    """ASGI middleware: 401 unless the request carries exactly `Bearer <token>`."""

    def __init__(self, app, token: str | None) -> None:
        self.app = app
        self.expected = None if token is None else b"Bearer " + token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.expected is None:
            return await self.app(scope, receive, send)
        sent = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(sent) == 1 and hmac.compare_digest(sent[0], self.expected):
            return await self.app(scope, receive, send)
        response = _error(
            401, "missing or wrong token: send one header Authorization: Bearer <token>"
        )
        await response(scope, receive, send)


def build_app(
    server,
    token: str | None = None,
    max_body: int = MAX_BODY,
    max_depth: int = MAX_DEPTH,
):
    """`server`: a `kvtier.cli.serve.Server` (validation, the engine loop)."""
    from kvtier.engine.loop import Busy

    async def on_loop(fn):
        return await asyncio.wrap_future(server.loop.call(fn))

    async def generate(request: Request):
        try:
            body = parse_body(await read_body(request, max_body), max_depth)
            turn, remember = server.turn_of(body)
            result = await asyncio.wrap_future(server.loop.generate(turn, remember))
            return JSONResponse(server.answer(body, result))
        except _TooLarge as exc:
            return _error(413, str(exc), close=True)  # the rest of the body is not read
        except ClientDisconnect:
            return Response(status_code=400)
        except RequestRejected as exc:
            return _error(413, str(exc))
        except (RequestFailed, Busy) as exc:
            return _error(503, str(exc))
        except ValueError as exc:
            return _error(400, str(exc))

    async def flush(request: Request):
        try:
            parse_body(await read_body(request, max_body), max_depth)
            return JSONResponse(await on_loop(server.flush))
        except _TooLarge as exc:
            return _error(413, str(exc), close=True)
        except ValueError as exc:
            return _error(400, str(exc))

    async def hint(request: Request):
        from kvtier.cache.hints import LeaseBoundError
        from kvtier.cli import serve_hints

        op = request.path_params["op"]
        if op not in serve_hints.OPS:
            return _error(404, f"no hint {op!r}; hints: {', '.join(serve_hints.OPS)}")
        try:
            body = parse_body(await read_body(request, max_body), max_depth)
            args = serve_hints.check(op, body, server.model.config.vocab)
            return JSONResponse(await on_loop(lambda: server.hint(op, args)))
        except _TooLarge as exc:
            return _error(413, str(exc), close=True)
        except ClientDisconnect:
            return Response(status_code=400)
        except serve_hints.UnknownSession as exc:
            return _error(404, str(exc))
        except LeaseBoundError as exc:  # the tenant holds its bound: nothing changed
            return _error(409, str(exc))
        except ValueError as exc:
            return _error(400, str(exc))

    async def stats(request: Request):
        return JSONResponse(await on_loop(server.stats))

    async def metrics(request: Request):
        return Response(
            await on_loop(server.metrics), media_type="text/plain; version=0.0.4"
        )

    async def not_found(request: Request, exc: HTTPException):
        if exc.status_code in (404, 405):
            return _error(
                404 if exc.status_code == 404 else 405,
                f"no route {request.method} {request.url.path}; routes: GET /stats /metrics, "
                "POST /generate /flush /hints/{pin,prefetch,demote,retain,release}",
            )
        return _error(exc.status_code, str(exc.detail))

    async def internal(request: Request, exc: Exception):
        log.exception(
            "serve: %s %s failed", request.method, request.url.path, exc_info=exc
        )
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    app = Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/flush", flush, methods=["POST"]),
            Route("/hints/{op}", hint, methods=["POST"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: not_found, Exception: internal},
    )
    return TokenGate(app, token)
