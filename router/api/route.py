"""``POST /v1/route``: place one request -- an ordinary route of the app.

It is served as a Starlette ``Route`` added to the FastAPI app (:data:`SERVED`): below the same
ASGI front, FastAPI middleware stack and exception handlers as every route, and cheaper in server
CPU than an ``APIRoute`` (``docs/results.md``, "Router"); the ``APIRoute`` of the same handler
(``router``) is kept for the OpenAPI document. What keeps it cheap is on public APIs: the handler
takes the :class:`Request` (no dependency to resolve), authenticates like every keyed route
(``router.http.deps.authenticate``), reads the body and validates it in one pass into
:class:`RouteRequest` (errors raised as FastAPI's ``RequestValidationError``, so the 422 is the
one every route gives), and answers with a :class:`Response` holding the answer's bytes, built
once by the engine (no response-model serialization)."""

from __future__ import annotations

import re

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from router.http.deps import authenticate_inference
from router.http.errors import NOT_JSON, is_json, not_utf8
from router.http.routing import ServedRoute
from router.service.admission import route_decision
from router.service.admission_queue import client_gone
from xroute.schema.decision import ErrorResponse, RouteRequest, RouteResponse
from xroute.schema.quota import TooManyRequests

router = APIRouter(prefix="/v1", tags=["route"])


_ERRORS = {401: {"model": ErrorResponse, "description": "missing or invalid API key"},
           403: {"model": ErrorResponse, "description": "unknown_tenant: the key's tenant is not declared on this "
                 "router (docs/policies.md)"},
           413: {"model": ErrorResponse, "description": "request body too large"},
           422: {"model": ErrorResponse, "description": "the body is not JSON (not UTF-8, does not parse, or sent "
                 "without a JSON content type: `fields` names `body`), a field is invalid (named in `fields`), an unknown "
                 "origin (with close matches), `invalid_constraints`: a constraint names a value the served catalog "
                 "lacks (close matches in `suggestions`; `GET /v1/offerings` lists the catalog), `no_offering`: "
                 "the constraints and routing policies together exclude every offering, `idempotency_key_reused`: the key "
                 "came with another body, `invalid_prefix`: more prefix_hashes than the prompt has blocks, "
                 "`quota_too_small`: input + max_output_tokens alone is over the tenant's tokens_per_minute; `priority` not one "
                 "of critical, standard, sheddable"},
           409: {"model": ErrorResponse, "description": "a request with the same Idempotency-Key is being decided"},
           429: {"model": TooManyRequests, "description": "`quota_exceeded`: the tenant is over one of its quotas "
                 "(`limit` names it: max_concurrent, tokens_per_minute, requests_per_day or usd_per_day, for the "
                 "tenant or for the model; docs/quotas.md), or `no_capacity`: no allowed offering can take the request "
                 "now (spot pools down, queues full, pools at their capacity in the shared state, offerings at their "
                 "cloud quota; `excluded` says why); with admission on (docs/router.md), `slo_unattainable`: no pool "
                 "is predicted to serve the request within its ttft_ms (a sheddable one at once, a critical or "
                 "standard one once its budget ran out waiting; `best_predicted_ttft_ms`), or `admission_queue_full`; "
                 "see Retry-After"},
           503: {"model": ErrorResponse, "description": "`unavailable`: the decision log cannot record decisions; "
                 "`state_unavailable`: the shared state cannot be reached; `state_restoring`: it came back empty and "
                 "an Idempotency-Key it does not hold yet is not decided anew until the decision logs are back in it; "
                 "see Retry-After"}}


# ---------------------------------------------------------------------------------------- the state's side
_KEY = re.compile(r"[\x21-\x7e]{1,255}")


def idempotency_key(request: Request) -> str | None:
    """The request's ``Idempotency-Key`` header (1-255 visible ASCII characters), or None; anything
    else is a 422 on ``header.Idempotency-Key``."""
    for name, value in request.scope["headers"]:
        if name == b"idempotency-key":
            key = value.decode("latin-1")
            if not _KEY.fullmatch(key):
                raise RequestValidationError([{"type": "value_error", "loc": ("header", "Idempotency-Key"),
                                               "msg": "must be 1 to 255 visible ASCII characters", "input": None}])
            return key
    return None


#: the request body as documented (``RouteRequest``'s schema is added to the document's components
#: by ``router.app.factory``): the handler reads and validates the body itself (:func:`route_request`)
_BODY = {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RouteRequest"}}}}


def route_request(raw: bytes, content_type: str | None) -> RouteRequest:
    """The body as a :class:`RouteRequest`, parsed and validated in one pass (pydantic's JSON
    mode); anything else raises FastAPI's :class:`RequestValidationError` with every error located
    under ``body`` (``router.http.errors`` renders it as the 422 naming each field)."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    if not is_json(content_type):
        raise RequestValidationError([{"type": "content_type", "loc": ("body",), "input": None, "msg": NOT_JSON}])
    try:
        return RouteRequest.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors()
        if errors and errors[0]["type"] == "json_invalid":  # said as every JSON route says it
            bad = not_utf8(raw)
            if bad is not None:
                raise RequestValidationError([bad]) from None
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in errors]) from None


#: the optional ``Idempotency-Key`` header, as documented
IDEMPOTENCY_HEADER = {"name": "Idempotency-Key", "in": "header", "required": False,
                      "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": r"^[\x21-\x7e]+$"},
                      "description": "a retry with the same key (and body) gets the first answer's bytes and books "
                                     "nothing; remembered for idempotency_ttl_s"}


@router.post("/route", response_model=RouteResponse, responses=_ERRORS,  # type: ignore[arg-type]
             openapi_extra={"requestBody": _BODY, "parameters": [IDEMPOTENCY_HEADER]},
             summary="Choose the offering for one inference request")
async def route(request: Request) -> Response:
    """Decide, reserve capacity on the chosen pool, record the decision durably (group commit),
    then answer.

    The answer names the offering, its expected latency and cost, the next best alternatives with
    their scores, the policy that decided (model version or fallback, with the reason), the
    offerings excluded and why, and the telemetry time and age used."""
    # the caller and the body without FastAPI's dependency and body machinery (docs/results.md):
    # the same checks and errors as ``CallerDep`` and a ``RouteRequest`` parameter
    caller = await authenticate_inference(request)
    body = route_request(await request.body(), request.headers.get("content-type"))
    svc = caller.svc
    payload = await route_decision(svc, body, caller.who, request.scope.setdefault("state", {}),
                                   idempotency_key(request),
                                   left=None if svc.admission is None else client_gone(request.receive))
    return Response(payload, media_type="application/json")


#: what the app serves: the same handler as a Starlette ``Route`` (``router.app.factory``; ``router`` above
#: holds its APIRoute for the OpenAPI document only)
SERVED = ServedRoute("/v1/route", route, methods=["POST"], name="route")
