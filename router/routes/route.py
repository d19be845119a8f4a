"""``POST /v1/route``: place one request -- a plain FastAPI route, like every other one.

What keeps it cheap is on FastAPI's public API: the handler takes the :class:`Request` (no
dependency to resolve), authenticates like every keyed route (``router.deps.authenticate``), reads
the body and validates it in one pass into :class:`RouteRequest` (errors raised as FastAPI's
``RequestValidationError``, so the 422 is the one every route gives), and answers with a
:class:`Response` holding the answer's bytes, built once by the engine (no response-model
serialization)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from router.deps import authenticate
from router.logs import new_sorted_id
from xroute.schema.decision import ErrorResponse, RouteRequest, RouteResponse

router = APIRouter(prefix="/v1", tags=["route"])

_ERRORS = {401: {"model": ErrorResponse, "description": "missing or invalid API key"},
           413: {"model": ErrorResponse, "description": "request body too large"},
           422: {"model": ErrorResponse, "description": "a field is invalid (named in `fields`), an unknown "
                 "origin (with close matches) or constraints that exclude every offering"},
           429: {"model": ErrorResponse, "description": "no allowed offering can take the request now "
                 "(spot pools down, queues full); see Retry-After"},
           503: {"model": ErrorResponse, "description": "the decision log cannot record decisions"}}


def begin_route(svc: Any, body: RouteRequest, who: Any, decision_id: str, t0: float
                ) -> tuple[bytes, asyncio.Future[int], str, dict[str, Any]]:
    """Decide and queue the decision's row for the next group commit: (answer JSON, the commit's
    future, offering id, policy info). The answer may be sent once the future is done without an
    exception (then call :func:`end_route`). Raises what ``RoutingEngine.decide`` and the decision
    log's ``record_decision`` raise."""
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
    the decision log's ``record_decision`` raise (``router.errors`` renders them)."""
    t0 = time.perf_counter()
    decision_id = "d_" + new_sorted_id()
    state["decision_id"] = decision_id
    payload, committed, offering_id, pinfo = begin_route(svc, body, who, decision_id, t0)
    await committed
    end_route(svc, offering_id, pinfo, t0)
    return payload


#: the request body as documented (``RouteRequest``'s schema is added to the document's components
#: by ``router.app``): the handler reads and validates the body itself (:func:`route_request`)
_BODY = {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RouteRequest"}}}}


def _is_json(content_type: str | None) -> bool:
    """``application/json`` or ``application/<anything>+json``, parameters ignored (what FastAPI
    reads as JSON)."""
    if content_type is None:
        return False
    mime = content_type.partition(";")[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def route_request(raw: bytes, content_type: str | None) -> RouteRequest:
    """The body as a :class:`RouteRequest`, parsed and validated in one pass (pydantic's JSON
    mode); anything else raises FastAPI's :class:`RequestValidationError` with every error located
    under ``body`` (``router.errors`` renders it as the 422 naming each field)."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    if not _is_json(content_type):
        raise RequestValidationError([{"type": "content_type", "loc": ("body",), "input": None,
                                       "msg": "expected a JSON body (Content-Type: application/json)"}])
    try:
        return RouteRequest.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


@router.post("/route", response_model=RouteResponse, responses=_ERRORS,  # type: ignore[arg-type]
             openapi_extra={"requestBody": _BODY}, summary="Choose the offering for one inference request")
async def route(request: Request) -> Response:
    """Decide, record the decision durably (group commit), then answer.

    The answer names the offering, its expected latency and cost, the next best alternatives with
    their scores, the policy that decided (model version or fallback, with the reason), the
    offerings excluded and why, and the telemetry time and age used."""
    # the caller and the body without FastAPI's dependency and body machinery (~25 us a request):
    # the same checks and errors as ``CallerDep`` and a ``RouteRequest`` parameter
    caller = await authenticate(request)
    body = route_request(await request.body(), request.headers.get("content-type"))
    payload = await route_decision(caller.svc, body, caller.who, request.scope.setdefault("state", {}))
    return Response(payload, media_type="application/json")
