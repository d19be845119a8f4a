"""One pure-ASGI middleware for every request: request id, W3C ``traceparent``, body size limit,
access log and error counting. (Pure ASGI rather than ``BaseHTTPMiddleware``: it adds a few
microseconds, not a task per request.)"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.core import tracing
from router.core.logs import access, new_id, request_id_var, trace_id_var
from router.core.metrics import Metrics

_TRACEPARENT = re.compile(rb"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


def request_id_of(value: bytes) -> bytes | None:
    """A caller's ``X-Request-ID`` when it is safe to echo and log (1-128 of ``[A-Za-z0-9._:-]``)."""
    return value if _REQUEST_ID.fullmatch(value) else None


def traceparent_of(value: bytes) -> bytes | None:
    """A W3C ``traceparent`` normalized to lower case, or None when it is not a valid one
    (version ff and the all-zero trace id are invalid)."""
    trace = value.strip().lower()
    if not _TRACEPARENT.fullmatch(trace) or trace.startswith(b"ff") or trace[3:35] == b"0" * 32:
        return None
    return trace


class RequestContext:
    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: Metrics | None = None, access_log: bool = True,
                 path_limits: dict[str, int] | None = None):
        self.app = app
        self.max_body = max_body_bytes
        #: paths with a body limit of their own (the gateway's chat and completion bodies)
        self.path_limits = path_limits or {}
        self.metrics = metrics
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        rid = trace = length = None
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                rid = request_id_of(v)
            elif k == b"traceparent":
                trace = traceparent_of(v)
            elif k == b"content-length":
                length = v
        rid_s = rid.decode() if rid is not None else new_id(64)
        token = request_id_var.set(rid_s)
        ttoken = trace_id_var.set(trace[3:35].decode()) if trace is not None else None
        extra: list[tuple[bytes, bytes]] = [(b"x-request-id", rid_s.encode())]
        if trace is not None:
            extra.append((b"traceparent", trace))
        status = 0

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), *extra]
            await send(message)

        limit = self.path_limits.get(scope["path"], self.max_body) if self.path_limits else self.max_body
        try:
            if length is not None and (not length.isdigit() or int(length) > limit):
                await _too_large(send_with_headers, limit, rid_s)
            else:
                app = self.app if not tracing.ON else tracing.asgi(self.app, trace)
                await app(scope, receive if length is not None else self._limited(receive, limit), send_with_headers)
        finally:
            dt = time.perf_counter() - t0
            route: Any = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            if status >= 400 and self.metrics is not None:
                self.metrics.error(path, status)
            if self.access_log:
                state = scope.get("state") or {}
                access(rid_s, scope["method"], path, status, round(dt * 1000.0, 3), state.get("tenant"),
                       state.get("decision_id"), trace[3:35].decode() if trace is not None else None)
            request_id_var.reset(token)
            if ttoken is not None:
                trace_id_var.reset(ttoken)

    def _limited(self, receive: Receive, limit: int) -> Receive:
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, f"request body larger than {limit} bytes")
            return message

        return wrapped


async def _too_large(send: Send, limit: int, rid: str) -> None:
    body = json.dumps({"error": "payload_too_large", "message": f"request body larger than {limit} bytes "
                       "(or a bad Content-Length)", "fields": [{"field": "body", "message": "too large",
                                                               "suggestions": []}],
                       "request_id": rid}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
