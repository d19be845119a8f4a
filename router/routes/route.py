"""``POST /v1/route``: place one request."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from router.deps import CallerDep
from router.fastpath import route_decision
from xroute.schema.decision import ErrorResponse, RouteRequest, RouteResponse

router = APIRouter(prefix="/v1", tags=["route"])

_ERRORS = {401: {"model": ErrorResponse, "description": "missing or invalid API key"},
           413: {"model": ErrorResponse, "description": "request body too large"},
           422: {"model": ErrorResponse, "description": "a field is invalid (named in `fields`), an unknown "
                 "origin (with close matches) or constraints that exclude every offering"},
           429: {"model": ErrorResponse, "description": "no allowed offering can take the request now "
                 "(spot pools down, queues full); see Retry-After"},
           503: {"model": ErrorResponse, "description": "the decision log cannot record decisions"}}


@router.post("/route", response_model=RouteResponse, responses=_ERRORS,  # type: ignore[arg-type]
             summary="Choose the offering for one inference request")
async def route(body: RouteRequest, caller: CallerDep) -> Response:
    """Decide, record the decision durably (group commit), then answer.

    The answer names the offering, its expected latency and cost, the next best alternatives with
    their scores, the policy that decided (model version or fallback, with the reason), the
    offerings excluded and why, and the telemetry time and age used."""
    payload = await route_decision(caller.svc, body, caller.who, caller.request.scope.setdefault("state", {}))
    return Response(payload, media_type="application/json")
