"""The policies page: the set in force, its stored versions, a structured diff between any two, a
dry run of a draft against the latest decisions (``POST /v1/admin/policies/dry-run``'s own code:
``router.api.policies.dry_run_route``), and the canary section (``canary.py``)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import ValidationError

from router.api import policies as policy_routes
from router.console import canary
from router.console.auth import PREFIX, ConsoleCaller, check_csrf
from router.console.pages import bad, draft_data, require
from router.console.render import render
from router.decision.engine import RouteFailure
from router.http.deps import Caller
from router.store.policies import PolicyChangeError, PolicyStoreError

router = APIRouter(prefix=PREFIX, include_in_schema=False)

#: versions listed
VERSIONS_SHOWN = 50
_MISSING = object()


def _flat(value: Any, path: str = "") -> dict[str, Any]:
    """A JSON value as ``{dotted.path[i]: leaf}``."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{path}.{k}" if path else str(k)))
        return out or {path: {}}
    if isinstance(value, list) and value and any(isinstance(v, dict | list) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flat(v, f"{path}[{i}]"))
        return out
    return {path: value}


def _changes(a: Any, b: Any) -> list[dict[str, Any]]:
    fa, fb = _flat(a), _flat(b)
    out = []
    for key in sorted(set(fa) | set(fb)):
        va, vb = fa.get(key, _MISSING), fb.get(key, _MISSING)
        if va != vb:
            out.append({"field": key, "old": None if va is _MISSING else json.dumps(va),
                        "new": None if vb is _MISSING else json.dumps(vb),
                        "kind": "added" if va is _MISSING else "removed" if vb is _MISSING else "changed"})
    return out


def diff_sets(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The structured diff of two policy sets' JSON (``PolicySet.model_dump``): per policy by name --
    added, removed, or changed with each field's old and new value (its own ``version`` left out) --
    and the set's named region sets, SLO tiers and prefer mode."""
    pa = {p["name"]: p for p in a.get("policies", [])}
    pb = {p["name"]: p for p in b.get("policies", [])}
    policies = []
    for name in sorted(set(pa) | set(pb)):
        if name not in pa:
            policies.append({"name": name, "status": "added", "changes": _changes({}, _body(pb[name]))})
        elif name not in pb:
            policies.append({"name": name, "status": "removed", "changes": _changes(_body(pa[name]), {})})
        else:
            ch = _changes(_body(pa[name]), _body(pb[name]))
            if ch:
                policies.append({"name": name, "status": "changed", "changes": ch})
    sections = {s: _changes(a.get(s, {}), b.get(s, {})) for s in ("region_sets", "slo_tiers")}
    sections["prefer_mode"] = _changes(a.get("prefer_mode"), b.get("prefer_mode"))
    return {"policies": policies, "sections": {k: v for k, v in sections.items() if v},
            "unchanged": sorted(n for n in set(pa) & set(pb) if _body(pa[n]) == _body(pb[n]))}


def _body(p: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in p.items() if k not in ("version", "name")}


def _sync(caller: Caller) -> Any:
    sync = caller.svc.policies
    if sync is None:
        raise RouteFailure(503, "unavailable", "the policy store is not open")
    return sync


Version = Annotated[int | None, Query(ge=0, le=2**53)]


@router.get("/policies", response_class=HTMLResponse)
async def policies(request: Request, caller: ConsoleCaller, a: Version = None, b: Version = None) -> Response:
    """The set in force, the versions (``PolicyStore.versions``), and -- with ``a`` and ``b`` -- their diff."""
    return await _page(request, caller, a, b, None, None)


async def _page(request: Request, caller: Caller, a: int | None, b: int | None, draft: str | None,
                dry: dict[str, Any] | None, status_code: int = 200) -> Response:
    require(caller, "read", "policies")
    store = _sync(caller).store
    current = caller.svc.engine.policies.set
    try:
        versions = await asyncio.to_thread(store.versions, VERSIONS_SHOWN)
        diff = None
        if a is not None or b is not None:
            if a is None or b is None:
                raise bad("query.a" if a is None else "query.b", "give both versions to compare")
            sa, sb = await asyncio.gather(asyncio.to_thread(store.at, a), asyncio.to_thread(store.at, b))
            diff = diff_sets(sa.model_dump(mode="json", exclude_none=True), sb.model_dump(mode="json", exclude_none=True))
    except PolicyChangeError as e:  # (a version that does not exist)
        raise bad("query.a" if str(a) in e.message else "query.b", e.message) from None
    except PolicyStoreError as e:
        raise RouteFailure(503, "unavailable", f"the policy store cannot be read ({e})",
                           headers={"Retry-After": "5"}) from None
    head = versions[0]["version"] if versions else 0
    perms = caller.svc.engine.access.permissions(caller.who)
    return render(request, "policies.html", {**await canary.section(caller),
        "can_write_policies": perms.allows("admin:write:policies"),
        "current": current.model_dump(mode="json", exclude_none=True), "versions": versions, "a": a, "b": b,
        "diff": diff, "head": head, "draft": draft or "", "dry": dry,
        "can_dry_run": caller.svc.engine.access.permissions(caller.who).allows("admin:read:decisions")},
        caller, status_code=status_code)


def _draft_body(draft: str, last: int) -> policy_routes.DryRunBody:
    """The dry run's body from the draft -- 422 naming ``body.draft`` and the field inside it."""
    try:
        return policy_routes.DryRunBody.model_validate({**draft_data(draft), "last": last})
    except ValidationError as e:
        err = e.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        raise bad(f"body.draft.{where}" if where else "body.draft", str(err["msg"])) from None


@router.post("/policies/dry-run", response_class=HTMLResponse)
async def dry_run(request: Request, caller: ConsoleCaller,
                  draft: Annotated[str, Form(min_length=1, max_length=200_000)],
                  csrf: Annotated[str, Form(max_length=128)] = "",
                  last: Annotated[int, Form(ge=1, le=5000)] = 200) -> Response:
    """The draft judged against the last ``last`` decisions; nothing is applied (an auditor may)."""
    check_csrf(request, csrf)
    require(caller, "read", "policies")
    body = _draft_body(draft, last)
    try:
        result = await policy_routes.dry_run_route(body, caller)
    except RouteFailure as e:
        if e.status != 422:
            raise
        fields = [{**f, "field": "body.draft." + str(f.get("field", "")).removeprefix("body.")} for f in e.fields]
        raise RouteFailure(422, e.error, e.message.replace("'body.", "'body.draft."), fields) from None
    return await _page(request, caller, None, None, draft, result)
