"""Who is looking: the console's key (a header, else the login cookie), the CSRF token of its forms,
the login and logout routes.

The cookie holds the API key itself (the router keeps no sessions: any worker or router sharing the
keys file verifies it as it verifies a header), ``HttpOnly`` (no script reads it), ``SameSite=Strict``
(no other site's page sends it), ``Path=/console`` (the JSON API never takes it), ``Secure`` when the
request came over HTTPS. A form that changes something carries :func:`csrf_token` -- an HMAC of the
key, so another site cannot compute it and the router stores nothing -- and is refused (403
``csrf``) without it.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from router.console.render import render
from router.decision.engine import RouteFailure
from router.http.deps import Caller, api_key, authenticate_key

COOKIE = "xroute_console"
PREFIX = "/console"
_CSRF_LABEL = b"xroute-console-csrf-v1"

router = APIRouter(prefix=PREFIX, include_in_schema=False)


def presented_key(request: Request) -> str | None:
    """The key of a console request: ``Authorization``/``X-API-Key`` first, else the login cookie."""
    return api_key(request) or request.cookies.get(COOKIE) or None


def csrf_token(key: str) -> str:
    """The CSRF token of a key's forms (hex HMAC-SHA256 of the key under a fixed label)."""
    return hmac.new(key.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


async def console_caller(request: Request) -> Caller:
    """The caller of a console page: a browser with no (or a stale) cookie is sent to the login form
    (303); a request with a bad header key gets the API's 401."""
    key = presented_key(request)
    if key is None or (api_key(request) is None and request.app.services.keys.verify(key) is None):
        raise HTTPException(303, "log in first", headers={"Location": f"{PREFIX}/login"})
    caller = await authenticate_key(request, key)
    request.state.csrf = csrf_token(key)
    return caller


ConsoleCaller = Annotated[Caller, Depends(console_caller)]


def check_csrf(request: Request, token: str) -> None:
    """403 ``csrf`` unless ``token`` is the presented key's form token."""
    key = presented_key(request)
    if key is None or not hmac.compare_digest(token, csrf_token(key)):
        raise RouteFailure(403, "csrf", "field 'body.csrf': missing or wrong form token (reload the page)",
                           [{"field": "body.csrf", "message": "missing or wrong form token", "suggestions": []}])


@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request) -> Response:
    return render(request, "login.html", {"error": None}, caller=None)


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request, key: Annotated[str, Form(min_length=1, max_length=512)]) -> Response:
    """The key checked as the API checks it; on success the cookie and a redirect to the pools."""
    key = key.strip()
    if request.app.services.keys.verify(key) is None:
        return render(request, "login.html", {"error": "invalid API key"}, caller=None, status_code=401)
    resp = RedirectResponse(f"{PREFIX}/pools", status_code=303)
    resp.set_cookie(COOKIE, key, httponly=True, samesite="strict", path=PREFIX,
                    secure=request.url.scheme == "https")
    return resp


@router.post("/logout")
async def logout(request: Request, csrf: Annotated[str, Form(max_length=128)] = "") -> Response:
    check_csrf(request, csrf)
    resp = RedirectResponse(f"{PREFIX}/login", status_code=303)
    resp.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
    return resp
