"""The OpenAI API as the gateway reads and answers it: the request bodies, errors in OpenAI's
shape, and Server-Sent Events.

A body is read by the parser ``POST /v1/route`` reads its body with (``router.http.errors.json_body``:
JSON nested too deeply, or not UTF-8, is the same 422 on ``body``). The fields the gateway reads
(``model``, ``messages``' roles and contents, ``prompt``, ``max_tokens``,
``max_completion_tokens``, ``n``, ``stream``, ``stream_options.include_usage``) are checked with
the types of OpenAI's published schema, as strictly as ``/v1/route`` checks its own
(``xroute.schema.decision``: an integer is a JSON number without a fraction -- never ``"12"`` or
``true`` --, a boolean ``true`` or ``false``; ``null`` where OpenAI's schema allows it, meaning the
default); a bad one is a 422 naming it (``body.max_tokens``). Every other field goes to the
inference server as the client sent it (clients send many optional fields; the server checks
them, and its 4xx goes back to the client as it gave it).

Errors: the router's error (``router.http.errors``: a code, a message, the fields at fault) inside the
object OpenAI's clients read -- ``{"error": {"message", "type", "param", "code", "fields",
"request_id", ...}}`` -- so ``openai.APIStatusError.code`` is the router's code (``no_capacity``,
``upstream_unavailable``, ...) and ``.param`` the first field named."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictStr, ValidationError

from router.http.errors import NOT_JSON, error_body, is_json, json_body
from xroute.schema.decision import JsonBool, JsonInt, json_integer

#: an output budget (``max_tokens``, ``max_completion_tokens``), a number of choices: JsonInt with bounds
Budget = Annotated[int, Field(ge=1, le=1_000_000), BeforeValidator(json_integer)]
Choices = Annotated[int, Field(ge=1, le=128), BeforeValidator(json_integer)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: JsonBool | None = None


class _Body(BaseModel):
    """The fields of a request body the gateway reads, with OpenAI's types, strictly (module
    docstring); others pass through unchecked."""

    model_config = ConfigDict(extra="allow")

    model: Annotated[StrictStr, Field(min_length=1, max_length=256, description="a model of GET /v1/models")]
    stream: JsonBool | None = Field(None, description="stream the answer as Server-Sent Events (null: false)")
    stream_options: StreamOptions | None = None
    max_tokens: Budget | None = None
    n: Choices | None = Field(None, description="choices to generate (null: 1)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Annotated[StrictStr, Field(min_length=1)]
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Budget | None = None


class CompletionBody(_Body):
    """``POST /v1/completions``."""

    prompt: StrictStr | list[StrictStr] | list[JsonInt] | list[list[JsonInt]]


Kind = Literal["chat", "completion"]
BODIES: dict[str, type[_Body]] = {"chat": ChatBody, "completion": CompletionBody}


def parse_body(raw: bytes, content_type: str | None, kind: Kind) -> tuple[dict[str, Any], _Body]:
    """The body as a dict (what is forwarded) and its checked view; anything else raises FastAPI's
    ``RequestValidationError`` with every error under ``body`` (the router's 422)."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    if not is_json(content_type):
        raise RequestValidationError([{"type": "content_type", "loc": ("body",), "input": None, "msg": NOT_JSON}])
    data = json_body(raw)
    if not isinstance(data, dict):
        raise RequestValidationError([{"type": "model_type", "loc": ("body",), "input": None,
                                       "msg": "Input should be a JSON object"}])
    try:
        view = BODIES[kind].model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
    return data, view


# ------------------------------------------------------------------------------------------------ errors
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status."""
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def openai_error(status: int, code: str, message: str, fields: list[dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    """An error answered in OpenAI's shape, with the router's details inside."""
    return JSONResponse(reshape(error_body(code, message, fields, **extra), status), status_code=status,
                        headers=headers)


def reshape(body: dict[str, Any], status: int) -> dict[str, Any]:
    """The router's error body (``router.http.errors.error_body``) as OpenAI's error object."""
    inner = dict(body)
    code = inner.pop("error", "error")
    message = inner.pop("message", "")
    fields = inner.get("fields") or []
    param = fields[0].get("field") if fields and isinstance(fields[0], dict) else None
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code, **inner}}


def reshape_response(response: Any) -> JSONResponse:
    """A response the router's exception handlers rendered, in OpenAI's shape (a body that is no
    router error is kept as it is)."""
    try:
        body = json.loads(bytes(response.body))
    except (ValueError, AttributeError):
        return response  # type: ignore[no-any-return]
    if not isinstance(body, dict) or not isinstance(body.get("error"), str):
        return response  # type: ignore[no-any-return]
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(reshape(body, response.status_code), status_code=response.status_code, headers=headers)


def sse_error(code: str, message: str, **extra: Any) -> bytes:
    """An SSE event carrying an error, as OpenAI's clients read one mid-stream (``data:`` with an
    ``error`` object; the ``openai`` client raises ``APIError`` on it)."""
    err = {"message": message, "type": "api_error", "param": None, "code": code, **extra}
    return b"data: " + json.dumps({"error": err}, separators=(",", ":")).encode() + b"\n\n"


def has_token(chunk: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries generated output (text, reasoning, a tool call): the
    first such chunk is the first token."""
    for c in chunk.get("choices") or ():
        if not isinstance(c, dict):
            continue
        delta = c.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                                        or delta.get("tool_calls") or delta.get("function_call")):
            return True
        if c.get("text"):
            return True
    return False


def chunk_texts(chunk: dict[str, Any], into: dict[int, list[str]]) -> None:
    """Append a streamed chunk's generated text, per choice index, to ``into`` (the transcript)."""
    for c in chunk.get("choices") or ():
        if not isinstance(c, dict):
            continue
        i = c.get("index", 0)
        delta = c.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else c.get("text")
        if isinstance(text, str) and text:
            into.setdefault(i if isinstance(i, int) else 0, []).append(text)
