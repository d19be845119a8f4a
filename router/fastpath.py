"""A pure-ASGI fast path for the successful ``POST /v1/route``.

FastAPI's request machinery (its middleware stack, routing, dependency resolution, body reading
and validation wrappers, exception-handler plumbing) cost about as much per request as the whole
routing decision (profiled with py-spy under wrk: ~45 % of the event loop's time). The hot route
therefore answers here, in front of FastAPI, *only when everything goes right*: a JSON body whose
``Content-Length`` is known, a valid key, a body that validates as :class:`RouteRequest` (in
pydantic's JSON mode, one pass; it accepts exactly what FastAPI's ``json.loads`` then Python-mode
validation accepts, ``tests/test_router_unit.py``), a decision, and the durable
commit of its row. Everything else -- no or a bad key, invalid JSON or fields, an unusual content
type, a chunked body -- is handed to the FastAPI app with the body replayed, so every error
response is the one the FastAPI route produces (same status, JSON shape and field names). The
errors raised by the decision itself (unknown origin, constraints excluding everything, no
capacity, the decision log down, an unexpected exception) are rendered by the same handlers as
``router.errors`` installs, without deciding twice.

The FastAPI route (``router/routes/route.py``) stays: it documents the endpoint in OpenAPI and
serves the requests the fast path hands over; both go through :func:`route_decision`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router import errors
from router.engine import RouteFailure
from router.logs import new_sorted_id
from router.store import StoreClosed
from xroute.schema.decision import RouteRequest

ROUTE_PATH = "/v1/route"
_JSON_HEADERS = [(b"content-type", b"application/json")]


def begin_route(svc: Any, body: RouteRequest, who: Any, decision_id: str, t0: float
                ) -> tuple[bytes, asyncio.Future[int], str, dict[str, Any]]:
    """Decide and queue the decision's row for the next group commit: (answer JSON, the commit's
    future, offering id, policy info). The answer may be sent once the future is done without an
    exception (then call :func:`end_route`). Raises what ``RoutingEngine.decide`` and
    ``DecisionStore.record_decision`` raise."""
    payload, row, offering_id, pinfo = svc.engine.decide(body, who, decision_id, time.time())
    svc.metrics.decision_seconds.observe(time.perf_counter() - t0)
    return payload, svc.store.record_decision(row), offering_id, pinfo


def end_route(svc: Any, offering_id: str, pinfo: dict[str, Any], t0: float) -> None:
    """The metrics of a decision whose row is durable."""
    m = svc.metrics
    m.decided(offering_id, pinfo["kind"], pinfo["reason"])
    m.route_seconds.observe(time.perf_counter() - t0)


async def route_decision(svc: Any, body: RouteRequest, who: Any, state: Any) -> bytes:
    """Decide, record the decision durably (group commit), then return the answer's JSON.

    ``state`` gets ``decision_id`` (for the access log); raises what ``RoutingEngine.decide`` and
    ``DecisionStore.record_decision`` raise."""
    t0 = time.perf_counter()
    decision_id = "d_" + new_sorted_id()
    state["decision_id"] = decision_id
    payload, committed, offering_id, pinfo = begin_route(svc, body, who, decision_id, t0)
    await committed
    end_route(svc, offering_id, pinfo, t0)
    return payload


def bearer_of(value: bytes) -> str | None:
    """The key in an ``Authorization: Bearer <key>`` value (None for another scheme or no key)."""
    scheme, _, cred = value.decode("latin-1").partition(" ")
    return (cred.strip() or None) if scheme.lower() == "bearer" else None


def route_headers(headers: Any) -> tuple[str | None, bytes | None, bytes | None, bytes | None, bytes | None, bool]:
    """What the fast paths read of a request's headers (lower-case names): (API key, as
    ``router.deps.api_key`` reads it; ``Content-Length``; ``Content-Type``; the raw
    ``X-Request-ID`` and ``traceparent``, unchecked; whether there is a ``Transfer-Encoding``)."""
    bearer = xkey = length = ctype = rid = trace = None
    chunked = False
    for k, v in headers:
        if k == b"authorization":
            if bearer is None:
                bearer = bearer_of(v)
        elif k == b"x-api-key":
            xkey = v.decode("latin-1").strip() or None
        elif k == b"content-length":
            length = v
        elif k == b"content-type":
            ctype = v
        elif k == b"x-request-id":
            rid = v
        elif k == b"traceparent":
            trace = v
        elif k == b"transfer-encoding":
            chunked = True
    return (bearer if bearer is not None else xkey), length, ctype, rid, trace, chunked


def is_json(content_type: bytes) -> bool:
    ct = content_type.lower()
    return ct == b"application/json" or (ct.startswith(b"application/json") and ct[16:].lstrip()[:1] == b";")


class RouteFastPath:
    """ASGI app: ``POST /v1/route`` answered directly when it succeeds, anything else -> ``app``."""

    def __init__(self, app: ASGIApp, fastapi_app: Any):
        self.app = app
        self.fastapi_app = fastapi_app  # a router.app.RouterApp: its ``services`` attribute
        self.route = _RouteLabel()  # what RequestContext reads from scope["route"] (the metrics/log label)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != ROUTE_PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        svc = self.fastapi_app.services
        key, length, ctype, _, _, _ = route_headers(scope["headers"])
        if svc is None or key is None or length is None or ctype is None or not is_json(ctype):
            await self.app(scope, receive, send)
            return
        # the body (its size is bounded: RequestContext checked Content-Length against the limit)
        chunks: list[bytes] = []
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay(messages, receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        who = svc.keys.verify(key)
        body = None
        if who is not None and raw:
            try:  # parsed and validated in one pass (pydantic's JSON mode accepts what json.loads + the
                body = RouteRequest.model_validate_json(raw)  # model accept for this schema: tested)
            except (ValueError, ValidationError):
                body = None
        if body is None:  # no valid key, or an invalid body: the FastAPI route answers (same errors)
            await self.app(scope, _replay(messages, receive), send)
            return
        state = scope.setdefault("state", {})
        state["tenant"] = who.tenant
        scope["route"] = self.route
        try:
            payload = await route_decision(svc, body, who, state)
        except RouteFailure as e:
            await errors.route_failure_response(e)(scope, receive, send)
            return
        except StoreClosed as e:
            await errors.store_closed_response(e)(scope, receive, send)
            return
        except Exception as e:
            await errors.unexpected_response(ROUTE_PATH, e)(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_JSON_HEADERS, (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


class _RouteLabel:
    path = ROUTE_PATH


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that first yields the messages already read."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
