"""The policies page's canary section (issue 38 item 2; ``docs/policies.md``, "Canary rollouts"): the
canary running -- its key, share, what its draft changes -- with its arms side by side
(``GET /v1/admin/canary/compare``'s code, over each arm's latest :data:`WINDOW` decisions), and the
forms that start one, change its share, promote it or roll it back: each the admin API's own call
(``router.api.canary``), with its permission (``admin:write:policies``) and a CSRF token."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import ValidationError

from router.api import canary as canary_routes
from router.console.auth import PREFIX, ConsoleCaller, check_csrf
from router.console.pages import bad, draft_data, require
from router.decision.engine import RouteFailure
from router.http.deps import Caller

router = APIRouter(prefix=f"{PREFIX}/policies/canary", include_in_schema=False)

#: each arm's latest decisions the page compares (the API's default reads 100,000)
WINDOW = 10_000
_KEY = r"^(tenant|session|request)$"
_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


async def section(caller: Caller) -> dict[str, Any]:
    """What the template shows: ``canary`` (the API's view, or None) and ``compare`` (its arms)."""
    view = await canary_routes.get_canary(caller)
    out: dict[str, Any] = {"canary": view["canary"], "compare": None}
    if view["canary"] is not None:
        out["compare"] = await canary_routes.compare_arms(caller, None, WINDOW)
    return out


def _back() -> Response:
    return RedirectResponse(f"{PREFIX}/policies#canary", status_code=303)


def _body_field(e: RouteFailure, prefix: str) -> RouteFailure:
    """The API's 422 with its ``body.<field>`` named as this form's."""
    if e.status != 422:
        return e
    fields = [{**f, "field": prefix + str(f.get("field", "")).removeprefix("body").lstrip(".")} for f in e.fields]
    return RouteFailure(422, e.error, e.message.replace("'body.", "'" + prefix), fields)


@router.post("/start")
async def start(request: Request, caller: ConsoleCaller,
                draft: Annotated[str, Form(min_length=1, max_length=200_000)],
                key: Annotated[str, Form(pattern=_KEY)],
                share: Annotated[float, Form(gt=0, le=100)],
                csrf: Annotated[str, Form(max_length=128)] = "",
                description: Annotated[str, Form(max_length=1000)] = "") -> Response:
    check_csrf(request, csrf)
    require(caller, "write", "policies")
    try:
        body = canary_routes.CanaryStart.model_validate({**draft_data(draft), "key": key, "share": share,
                                                         "description": description})
    except ValidationError as e:
        err = e.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        raise bad(f"body.draft.{where}" if where else "body.draft", str(err["msg"])) from None
    try:
        await canary_routes.start(body, caller)
    except RouteFailure as e:
        raise _body_field(e, "body.draft.") from None
    return _back()


@router.post("/share")
async def share(request: Request, caller: ConsoleCaller, share: Annotated[float, Form(gt=0, le=100)],
                id: Annotated[str, Form(pattern=_ID)], csrf: Annotated[str, Form(max_length=128)] = "") -> Response:
    check_csrf(request, csrf)
    require(caller, "write", "policies")
    await canary_routes.share(canary_routes.CanaryShare(share=share, id=id), caller)
    return _back()


@router.post("/{action}")
async def end(request: Request, caller: ConsoleCaller, action: str, id: Annotated[str, Form(pattern=_ID)],
              csrf: Annotated[str, Form(max_length=128)] = "") -> Response:
    """``promote`` or ``rollback`` the canary ``id`` (409 if another one runs)."""
    if action not in ("promote", "rollback"):
        raise bad("path.action", "promote or rollback")
    check_csrf(request, csrf)
    require(caller, "write", "policies")
    call = canary_routes.promote if action == "promote" else canary_routes.rollback
    await call(caller, canary_routes.CanaryEnd(id=id))
    return _back()
