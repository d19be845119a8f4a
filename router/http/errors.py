"""Every error leaves as JSON: ``{"error": code, "message": ..., "fields": [{"field", "message",
"suggestions"}], "request_id"}`` (:class:`xroute.schema.decision.ErrorResponse`). Bad input is a 4xx
naming the field; an unexpected exception is logged and answered 500 without internals."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import from_json
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import Scope

from router.core.logs import LOG, request_id_var
from router.decision.engine import RouteFailure
from router.state.base import StateRestoring, StateUnavailable
from router.store.sqlite import StoreClosed

CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
         406: "not_acceptable", 409: "conflict", 413: "payload_too_large", 415: "unsupported_media_type",
         422: "invalid_request", 429: "too_many_requests", 503: "unavailable"}


def error_body(error: str, message: str, fields: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"error": error, "message": message, "fields": fields or [], "request_id": request_id_var.get(), **extra}


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


#: what a JSON body route says when the body is not JSON at all (``POST /v1/route`` says the same)
NOT_JSON = "expected a JSON body (Content-Type: application/json)"
#: how a route that takes a JSON body documents its 422 for a body that is not JSON
BODY_NOT_JSON_422 = ("the body is not JSON (not UTF-8, does not parse, or sent without a JSON content type: "
                     "`fields` names `body`)")
#: pydantic's error types for a body that is no object -- what FastAPI reports for a body sent
#: without ``Content-Type: application/json`` (it then does not parse the bytes)
_NOT_AN_OBJECT = frozenset({"model_attributes_type", "dict_type", "model_type"})


def is_json(content_type: str | None) -> bool:
    """``application/json`` or ``application/<anything>+json``, parameters ignored (what FastAPI
    reads as JSON)."""
    if content_type is None:
        return False
    mime = content_type.partition(";")[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def _message(request: Request, err: dict[str, Any]) -> tuple[tuple[Any, ...], str]:
    """One validation error's field and message, said for a user: an unknown field, JSON that
    does not parse (with the character offset), a body without the JSON content type."""
    loc, kind = tuple(err.get("loc", ())), err.get("type")
    if kind == "json_invalid":
        # FastAPI's loc is ("body", offset) and ctx the decoder's message
        where = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
        reason = str((err.get("ctx") or {}).get("error") or "not valid JSON")
        return ("body",), f"invalid JSON: {reason}" + (f" (character {where} of the body)" if where is not None else "")
    if kind in _NOT_AN_OBJECT and loc == ("body",) and not is_json(request.headers.get("content-type")):
        return loc, NOT_JSON
    return loc, "unknown field" if kind == "extra_forbidden" else str(err.get("msg", "invalid"))


def not_utf8(raw: bytes) -> dict[str, Any] | None:
    """The validation error of a body that is not UTF-8 (JSON must be: RFC 8259), or None when it is.
    Both JSON routes say it alike: ``POST /v1/route`` (which parses its body itself) and the routes
    whose body FastAPI parses (:func:`_http` turns FastAPI's bare 400 into this 422)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _not_utf8_error(e)
    return None


def json_body(raw: bytes) -> Any:
    """A JSON body a route parses by hand, read by the parser ``POST /v1/route``'s pydantic model
    reads its body with (pydantic-core's: strict RFC 8259 text in UTF-8, arrays and objects nested
    at most 200 deep, no recursion in Python) and failing the same way: a ``RequestValidationError``
    on ``body`` (:func:`_validation`'s 422: ``invalid JSON: <what and where>``, e.g. ``recursion
    limit exceeded at line 1 column 202``; the body is not UTF-8: that byte) -- never a
    ``RecursionError`` reaching the client as a 500."""
    try:
        return from_json(raw)
    except ValueError as e:
        bad = not_utf8(raw)
        raise RequestValidationError([bad if bad is not None else
                                      {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                       "input": None, "ctx": {"error": str(e)}}]) from None


def loads_or_none(raw: bytes) -> Any:
    """JSON from a server the router talks to (an inference server's answer or event), by the
    same parser as :func:`json_body`; None when it is not JSON it can read (nested too deeply
    included)."""
    try:
        return from_json(raw)
    except ValueError:
        return None


def _not_utf8_error(e: UnicodeDecodeError) -> dict[str, Any]:
    return {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "input": None,
            "ctx": {"error": f"the body is not UTF-8 (byte {e.start}: 0x{e.object[e.start]:02x})"}}


#: body fields whose model's own rules (a ``value_error``: a schema-valid value the model refuses,
#: e.g. two policies of one name in a whole policy set) are a semantic error of that kind, as the
#: same rules broken by a policy write are
_SEMANTIC_FIELDS = {("body", "policy_set"): "invalid_policy"}


def _validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    fields = []
    errors = exc.errors()
    for err in errors:
        loc, msg = _message(request, err)
        fields.append({"field": _field(loc), "message": msg, "suggestions": []})
    summary = "; ".join(f"{f['field']}: {f['message']}" for f in fields[:3])
    kinds = {_SEMANTIC_FIELDS.get(tuple(e.get("loc", ())[:2])) if e.get("type") == "value_error" else None
             for e in errors}
    code = (kinds.pop() if len(kinds) == 1 else None) or "invalid_request"
    return JSONResponse(error_body(code, f"invalid request ({summary})", fields), status_code=422)


#: the methods a route may serve, in the order an ``Allow`` header names them
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(app: Any, scope: Scope) -> list[str]:
    """The methods some route of ``app`` serves at the request's path (``METHODS`` order). A 405's
    ``Allow`` (RFC 9110 15.5.6): Starlette's routing answers 405 from the first route whose path
    matches and names that route's methods alone, so a path served by several routes -- ``GET``
    and ``POST /v1/admin/policies`` -- said ``Allow: GET``. Asked of every route the same way
    routing asks (``BaseRoute.matches``), one method at a time, on a scope of the path alone."""
    probe = {"type": "http", "path": scope["path"], "root_path": scope.get("root_path", ""), "headers": [],
             "query_string": b""}
    return [method for method in METHODS
            if any(route.matches({**probe, "method": method})[0] is Match.FULL for route in app.router.routes)]


def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's answer to a body its JSON parsing raised on with anything but a JSONDecodeError
        # (a bare 400, raised ``from`` the error): bytes that are not UTF-8, nesting too deep for
        # the parser. The same 422 on ``body`` as every other body that is not JSON.
        cause = exc.__cause__
        error = (_not_utf8_error(cause) if isinstance(cause, UnicodeDecodeError) else
                 {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "input": None,
                  "ctx": {"error": "nested too deeply" if isinstance(cause, RecursionError)
                          else f"{type(cause).__name__}: {cause}"[:200]}})
        return _validation(request, RequestValidationError([error]))
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    headers = dict(exc.headers or {})
    if exc.status_code == 405:  # every route's methods at this path, not only the first route's
        headers["Allow"] = ", ".join(allowed_methods(request.app, request.scope))
    return JSONResponse(error_body(CODES.get(exc.status_code, "error"), detail), status_code=exc.status_code,
                        headers=headers)


def _route_failure(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RouteFailure)
    svc = getattr(request.app, "services", None)
    if svc is not None:  # (by route and code; a quota's tenant and limit)
        route: Any = request.scope.get("route")
        quota = exc.extra.get("limit") if exc.error == "quota_exceeded" else None
        svc.metrics.refused(getattr(route, "path", None) or "unmatched", exc.error, quota)
    return route_failure_response(exc)


def route_failure_response(exc: RouteFailure) -> JSONResponse:
    return JSONResponse(error_body(exc.error, exc.message, exc.fields, **exc.extra), status_code=exc.status,
                        headers=exc.headers)


def _store_closed(request: Request, exc: Exception) -> JSONResponse:
    return store_closed_response(exc)


def store_closed_response(exc: Exception) -> JSONResponse:
    LOG.error("decision log unavailable", extra={"fields": {"error": str(exc)}})
    return JSONResponse(error_body("unavailable", "the decision log cannot record decisions right now"),
                        status_code=503, headers={"Retry-After": "5"})


def _state_unavailable(request: Request, exc: Exception) -> JSONResponse:
    return state_unavailable_response(exc)


_last_state_error = [0.0]


def state_unavailable_response(exc: Exception) -> JSONResponse:
    """The shared state cannot be reached (fail closed): 503 naming it, ``Retry-After: 1`` (logged
    at most once a second: an outage under load would otherwise log every request). Or it came back
    empty and is being restored (:class:`StateRestoring`: a keyed request, or one a tenant quota counts):
    503 ``state_restoring``, its message saying which."""
    if isinstance(exc, StateRestoring):
        return JSONResponse(error_body("state_restoring", f"{exc}; retry shortly"), status_code=503,
                            headers={"Retry-After": "1"})
    now = time.monotonic()
    if now - _last_state_error[0] >= 1.0:
        _last_state_error[0] = now
        LOG.error("shared state unavailable", extra={"fields": {"error": str(exc)}})
    return JSONResponse(error_body("state_unavailable", f"the shared router state cannot be reached, so no "
                                   f"capacity can be reserved ({exc}); retry shortly"),
                        status_code=503, headers={"Retry-After": "1"})


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    return unexpected_response(request.url.path, exc)


def unexpected_response(path: str, exc: BaseException) -> JSONResponse:
    LOG.log(logging.ERROR, "unhandled error", exc_info=exc, extra={"fields": {"path": path}})
    return JSONResponse(error_body("internal_error", "internal error (logged with this request id)"), status_code=500)


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(RouteFailure, _route_failure)
    app.add_exception_handler(StoreClosed, _store_closed)
    app.add_exception_handler(StateUnavailable, _state_unavailable)
    app.add_exception_handler(Exception, _unexpected)
