"""The gateway's HTTP routes: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``.

Served as Starlette ``Route``s of the app (:data:`SERVED`), like ``POST /v1/route``: under the same
front (request id, trace, body limit -- ``gateway.max_body_bytes`` for these two --, access log),
FastAPI middleware stack and API keys (``router.http.deps.authenticate``) as every route, without an
``APIRoute``'s per-request dependency and body machinery; the ``APIRoute``s of :data:`docs` are
for the OpenAPI document only. Errors are the router's (``router.http.errors``: the same codes,
messages and fields), rendered by the app's own exception handlers and put in OpenAI's shape
(``router.gateway.openai_api``)."""

from __future__ import annotations

import inspect
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from router.gateway.openai_api import ChatBody, CompletionBody, Kind, reshape_response
from router.http.deps import authenticate, authenticate_inference
from router.http.errors import unexpected_response
from router.http.routing import ServedRoute

PATHS = ("/v1/chat/completions", "/v1/completions")


async def _error(request: Request, exc: Exception) -> Response:
    """``exc`` as the app's exception handlers render it, in OpenAI's shape."""
    handlers = request.app.exception_handlers
    for cls in type(exc).__mro__:
        handler = handlers.get(cls)
        if handler is not None:
            response = handler(request, exc)
            if inspect.isawaitable(response):
                response = await response
            return reshape_response(response)
    return reshape_response(unexpected_response(request.url.path, exc))


def _gateway(caller: Any) -> Any:
    gw = getattr(caller.svc, "gateway", None)
    if gw is None:
        raise HTTPException(503, "the gateway is starting")
    return gw


async def _serve(request: Request, kind: Kind) -> Response:
    arrived = time.perf_counter()
    try:
        caller = await authenticate_inference(request)
        gw = _gateway(caller)
        call = await gw.read(await request.body(), request.scope["headers"], caller.who.tenant, kind, arrived)
        return await gw.serve(call, caller, request.receive, request.scope.setdefault("state", {}))  # type: ignore[no-any-return]
    except Exception as exc:
        return await _error(request, exc)


async def chat_completions(request: Request) -> Response:
    return await _serve(request, "chat")


async def completions(request: Request) -> Response:
    return await _serve(request, "completion")


async def list_models(request: Request) -> Response:
    try:
        caller = await authenticate(request)
        return JSONResponse({"object": "list", "data": _gateway(caller).models()})
    except Exception as exc:
        return await _error(request, exc)


#: what the app serves
SERVED = [ServedRoute("/v1/chat/completions", chat_completions, methods=["POST"], name="chat_completions"),
          ServedRoute("/v1/completions", completions, methods=["POST"], name="completions"),
          ServedRoute("/v1/models", list_models, methods=["GET"], name="models")]

# ------------------------------------------------------------------------------------ the document
docs = APIRouter(prefix="/v1", tags=["gateway"])
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"description": "missing or invalid API key"},
    404: {"description": "`model_not_found`: a model no inference server is configured for (GET /v1/models)"},
    413: {"description": "request body larger than gateway.max_body_bytes"},
    422: {"description": "a field or header is invalid (named in `error.param` and `error.fields`)"},
    429: {"description": "`no_capacity`: no allowed offering can take the request now; `upstream_rate_limited`: the "
                         "servers tried refused it (429); see Retry-After"},
    502: {"description": "`upstream_unavailable`: every server tried failed before its first token (`error.attempts`)"},
    503: {"description": "the decision log or the shared state cannot be reached; see Retry-After"},
    504: {"description": "`upstream_timeout`: no first token (or, not streamed, no answer) in time"},
}
_HEADERS = [
    {"name": "X-Xroute-TTFT-Ms", "in": "header", "required": False, "schema": {"type": "number"},
     "description": "SLO: time to first token, ms (default: the tenant's, else gateway.ttft_ms); also the budget "
                    "within which a failed attempt is retried on the next offering"},
    {"name": "X-Xroute-TPOT-Ms", "in": "header", "required": False, "schema": {"type": "number"},
     "description": "SLO: time per output token, ms"},
    {"name": "X-Xroute-Deadline-Ms", "in": "header", "required": False, "schema": {"type": "number"},
     "description": "SLO: end-to-end deadline, ms"},
    {"name": "X-Xroute-Origin", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "where the request comes from, a location id (default: the tenant's, else gateway.origin)"},
    {"name": "X-Session-Id", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "opaque session id, stored with each decision"},
]


def _body(model: type) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}, "parameters": _HEADERS}


@docs.post("/chat/completions", responses=_ERRORS, openapi_extra=_body(ChatBody),  # type: ignore[arg-type]
           summary="OpenAI chat completion, routed, forwarded and measured (streamed as SSE with stream: true)")
async def _chat_doc(request: Request) -> Response:
    """Route the request (the same decision path, tenants and policies as POST /v1/route), forward it
    to the chosen pool's inference server, and answer as OpenAI does. The answer's headers name the
    decision (`X-Xroute-Decision-Id`), the offering and the attempts."""
    raise NotImplementedError  # documentation only: SERVED answers


@docs.post("/completions", responses=_ERRORS, openapi_extra=_body(CompletionBody),  # type: ignore[arg-type]
           summary="OpenAI (legacy) completion, routed, forwarded and measured")
async def _completion_doc(request: Request) -> Response:
    raise NotImplementedError  # documentation only: SERVED answers


@docs.get("/models", summary="The models of configs/models.yaml that some pool's servers run")
async def _models_doc(request: Request) -> Response:
    raise NotImplementedError  # documentation only: SERVED answers
