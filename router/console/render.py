"""The templates (``templates/``, autoescaped) and the helpers every page renders with."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from router.http.deps import Caller

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))


def _when(t: float | None) -> str:
    if t is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(t))) + "Z"


def _num(v: Any, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


TEMPLATES.env.filters["when"] = _when
TEMPLATES.env.filters["num"] = _num

#: the pages in the navigation bar, and the permission each needs beyond a valid key (None: any key)
PAGES = (("pools", "Pools", None), ("decisions", "Decisions", None), ("policies", "Policies", "admin:read:policies"),
         ("tenants", "Tenants", None), ("model", "Model", "admin:read:status"))

#: the navigation entry a template belongs to (else its own name)
_ACTIVE = {"decision.html": "decisions"}


def render(request: Request, template: str, context: dict[str, Any], caller: Caller | None,
           status_code: int = 200) -> HTMLResponse:
    """``template`` with ``context``, the navigation the caller may use, who it is and its form token."""
    nav: list[tuple[str, str]] = []
    who = None
    if caller is not None:
        perms = caller.svc.engine.access.permissions(caller.who)
        nav = [(path, label) for path, label, need in PAGES if need is None or perms.allows(need)]
        who = {"tenant": caller.who.tenant, "role": caller.who.role, "key_id": caller.who.key_id}
    active = _ACTIVE.get(template, template.removesuffix(".html"))
    ctx = {"nav": nav, "who": who, "csrf": getattr(request.state, "csrf", ""), "active": active, **context}
    return TEMPLATES.TemplateResponse(request, template, ctx, status_code=status_code)
