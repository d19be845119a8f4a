"""The console's pages: pools, decisions (search, one decision), tenants, model. Policies are in
``policies.py``. Each reads through what the JSON API route it mirrors reads (named per page)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Annotated, Any

import yaml
from fastapi import APIRouter, Form, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from router.api import admin as admin_routes
from router.api import migration as migration_routes
from router.api import quotas as quota_routes
from router.api.decisions import DecisionId
from router.console import model_info
from router.console.auth import PREFIX, ConsoleCaller, check_csrf
from router.console.render import render
from router.decision.access import admin_denied
from router.decision.engine import RouteFailure
from router.http.deps import Caller
from router.state.base import StateUnavailable
from router.store.readers import search_decisions, tenant_sessions, tenant_usage
from xroute.schema.access import NAME_PATTERN, admin_resource
from xroute.schema.migration import ID_PATTERN, EventEnd

router = APIRouter(prefix=PREFIX, include_in_schema=False)

#: decisions a search page shows at most
PAGE_MAX = 200
#: how far back the tenants page looks (decisions per hour, sessions)
TENANT_WINDOW_S = 24 * 3600.0


def allows(caller: Caller, verb: str, kind: str) -> bool:
    return caller.svc.engine.access.permissions(caller.who).allows(admin_resource(verb, kind))


def require(caller: Caller, verb: str, kind: str) -> None:
    """403 naming ``admin:<verb>:<kind>`` unless the key's roles grant it (as the API's ``admin_dep``)."""
    if not allows(caller, verb, kind):
        raise RouteFailure(**admin_denied(caller.who, verb, kind))


def bad(field: str, problem: str) -> RouteFailure:
    return RouteFailure(422, "invalid_request", f"field '{field}': {problem}",
                        [{"field": field, "message": problem, "suggestions": []}])


def draft_data(draft: str) -> dict[str, Any]:
    """The draft (YAML or JSON) as a change's body: one policy, a list of them, or ``{put, delete,
    policy_set}`` -- 422 naming ``body.draft`` when it is none of those."""
    try:
        data = yaml.safe_load(draft)
    except yaml.YAMLError as e:
        raise bad("body.draft", f"not YAML or JSON: {str(e).splitlines()[0][:200]}") from None
    if isinstance(data, dict) and "name" in data:
        data = {"put": [data]}
    elif isinstance(data, list):
        data = {"put": data}
    if not isinstance(data, dict):
        raise bad("body.draft", "a policy, a list of policies, or {put, delete, policy_set}")
    return data


@router.get("", include_in_schema=False)
async def home() -> Response:
    return RedirectResponse(f"{PREFIX}/pools", status_code=303)


# ---------------------------------------------------------------------------------------------- pools
@router.get("/pools", response_class=HTMLResponse)
async def pools(request: Request, caller: ConsoleCaller) -> Response:
    """``GET /v1/offerings`` (the engine's offerings state with the shared state's reservations), the
    active pool events (as ``Migrator.reload_events`` last read them: no read of its own), the ejections, and the tenant quota buckets
    at a limit (``GET /v1/quotas`` / ``/v1/admin/quotas``)."""
    svc = caller.svc
    try:
        reserved: dict[str, int] | None = (await svc.state.view()).in_flight
    except StateUnavailable:
        reserved = None
    now = time.time()
    state = svc.engine.offerings_state(now, reserved)
    events: list[dict[str, Any]] = []
    if svc.migrator is not None:  # (the events behind the masks in force, as the migrator last read them)
        events = [{"event_id": e, "kind": k, "pool": p, "region": r, "deadline": d, "masked_until": m,
                   "deprioritize_until": dp, "received_at": at}
                  for e, k, p, r, d, m, dp, at in svc.migrator.active_events[:500]
                  if (m is not None and m > now) or (dp is not None and dp > now)]
    masked_by: dict[str, list[str]] = {}
    for ev in events:
        if ev["masked_until"] is not None and ev["masked_until"] > now:
            masked_by.setdefault(ev["pool"], []).append(f"pool event {ev['kind']} ({ev['event_id']})")
    offerings = []
    for o in state["offerings"]:
        oid = o["offering"]["offering_id"]
        reasons = list(masked_by.get(oid, []))
        if o["ejected"]:
            reasons.append(f"upstream ejected ({o['ejected_for_s']} s left)")
        if not o["available"]:
            reasons.append("unavailable (spot capacity out)")
        elif not o["valid"]:
            reasons.append("no capacity or queue full")
        if o["usd_per_hour"] is None:
            reasons.append("no price")
        offerings.append({**o, "reasons": reasons})
    grid: dict[str, list[dict[str, Any]]] = {}
    for o in offerings:
        grid.setdefault(o["offering"]["location"], []).append(o)
    tenants = sorted(svc.engine.quota_plan.quotas) if allows(caller, "read", "quotas") else [caller.who.tenant]
    buckets = (await quota_routes._buckets(svc, tenants)).buckets
    at_limit = [b for b in buckets if _at_limit(b)]
    return render(request, "pools.html", {
        "telemetry": state["telemetry"], "offerings": offerings, "grid": sorted(grid.items()),
        "ejections": state["ejections"], "events": events, "at_limit": at_limit,
        "can_end_events": allows(caller, "write", "events")}, caller)


def _at_limit(b: Any) -> list[str]:
    """The limits a quota bucket has reached."""
    lim = b.limits
    out = []
    for name, used in (("max_concurrent", b.concurrent), ("tokens_per_minute", b.tokens_window),
                       ("requests_per_day", b.requests_day), ("usd_per_day", b.usd_day)):
        if lim.get(name) is not None and used >= lim[name]:
            out.append(name)
    return out


@router.post("/pools/events/{event_id}/end")
async def end_event(request: Request, caller: ConsoleCaller,
                    event_id: Annotated[str, PathParam(pattern=ID_PATTERN)],
                    csrf: Annotated[str, Form(max_length=128)] = "",
                    reason: Annotated[str | None, Form(max_length=500)] = None) -> Response:
    """``POST /v1/events/{id}/end`` from the pools page: the same permission (``admin:write:events``),
    the same call, audited the same."""
    check_csrf(request, csrf)
    require(caller, "write", "events")
    await migration_routes.end_event(caller, event_id, EventEnd(reason=reason or "ended from the console"))
    return RedirectResponse(f"{PREFIX}/pools", status_code=303)


# ------------------------------------------------------------------------------------------ decisions
def _when_param(field: str, value: str | None) -> float | None:
    """An ISO-8601 time (no zone: UTC) as epoch seconds; 422 naming ``field`` otherwise."""
    if value is None or value.strip() == "":
        return None
    try:
        dt = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise bad(field, "not an ISO-8601 time (2026-12-05T14:00:00Z)") from None
    return (dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)).timestamp()


def _cursor(value: str | None) -> tuple[float, str] | None:
    if not value:
        return None
    t, sep, did = value.partition("_d_")
    try:
        at = float(t)
    except ValueError:
        at = -1.0
    if not sep or at < 0 or not did or len(did) > 128:
        raise bad("query.before", "not a page cursor (use the 'older' link)")
    return at, "d_" + did


Text = Annotated[str | None, Query(max_length=128, pattern=r"^[A-Za-z0-9._:@/+=-]*$")]


@router.get("/decisions", response_class=HTMLResponse)
async def decisions(request: Request, caller: ConsoleCaller,
                    id: Text = None, tenant: Annotated[str | None, Query(max_length=64)] = None,
                    session: Text = None, since: Annotated[str | None, Query(max_length=40)] = None,
                    until: Annotated[str | None, Query(max_length=40)] = None,
                    before: Annotated[str | None, Query(max_length=200)] = None,
                    limit: Annotated[int, Query(ge=1, le=PAGE_MAX)] = 50) -> Response:
    """Search (``router.store.readers.search_decisions``: keyset pages) -- a tenant key always in its own
    tenant; ``id`` goes to the decision's page (``GET /v1/decisions/{id}``'s read)."""
    if id:
        return RedirectResponse(f"{PREFIX}/decisions/{id}", status_code=303)
    admin = allows(caller, "read", "decisions")
    if tenant == "":
        tenant = None
    if not admin:
        if tenant is not None and tenant != caller.who.tenant:
            raise RouteFailure(**admin_denied(caller.who, "read", "decisions"))
        tenant = caller.who.tenant
    t0, t1 = _when_param("query.since", since), _when_param("query.until", until)
    if t0 is not None and t1 is not None and t1 <= t0:
        raise bad("query.until", "must be after since")
    if session and tenant is None:
        raise bad("query.session", "a session is searched within a tenant: give tenant too")
    cursor = _cursor(before)
    rows = await asyncio.to_thread(search_decisions, caller.svc.settings.log_target, tenant=tenant,
                                   session=session or None, since=t0, until=t1, before=cursor, limit=limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    nxt = f"{rows[-1]['created_at']!r}_{rows[-1]['decision_id']}" if more and rows else None
    query = {k: v for k, v in (("tenant", tenant if admin else None), ("session", session), ("since", since),
                               ("until", until), ("limit", str(limit))) if v}
    return render(request, "decisions.html", {"rows": rows, "next": nxt, "query": query, "admin": admin,
                                              "tenant": tenant or ""}, caller)


@router.get("/decisions/{decision_id}", response_class=HTMLResponse)
async def decision(request: Request, caller: ConsoleCaller, decision_id: DecisionId) -> Response:
    """One decision as ``GET /v1/decisions/{id}`` (own tenant) or ``/v1/admin/decisions/{id}`` reads it:
    alternatives, exclusions by reason, deciding policy and model version, the routing policies, the
    request, the outcome."""
    scope = None if allows(caller, "read", "decisions") else caller.who.tenant
    rec = await caller.svc.store.get_decision(decision_id, scope)
    if rec is None:
        raise RouteFailure(404, "not_found", f"no decision '{decision_id}'" + (f" for tenant '{scope}'" if scope else ""))
    return render(request, "decision.html", {"d": rec}, caller)


# -------------------------------------------------------------------------------------------- tenants
@router.get("/tenants", response_class=HTMLResponse)
async def tenants(request: Request, caller: ConsoleCaller,
                  tenant: Annotated[str | None, Query(max_length=64, pattern=NAME_PATTERN)] = None) -> Response:
    """The quota buckets with their limits and use now (``GET /v1/quotas`` / ``/v1/admin/quotas``), the
    tenant's decisions per hour over the last day and its quotas' reservations per minute over the last
    hour (``router.store.readers.tenant_usage``), its sessions and migrations with their state
    histories (``MigrationStore``)."""
    svc = caller.svc
    admin = allows(caller, "read", "quotas")
    known = sorted(svc.engine.tenant_names)[:500] if admin else [caller.who.tenant]
    if tenant is None:
        tenant = caller.who.tenant if caller.who.tenant in known or not known else known[0]
    if not admin and tenant != caller.who.tenant:
        raise RouteFailure(**admin_denied(caller.who, "read", "quotas"))
    buckets = (await quota_routes._buckets(svc, [tenant])).buckets
    now = time.time()
    target = svc.settings.log_target
    usage, sessions = await asyncio.gather(asyncio.to_thread(tenant_usage, target, tenant, now),
                                           asyncio.to_thread(tenant_sessions, target, tenant, now - TENANT_WINDOW_S))
    migrations: list[Any] = []
    history: dict[str, Any] = {}
    if svc.migrator is not None:
        store = svc.migrator.store

        def read() -> tuple[list[Any], dict[str, Any]]:
            rows = store.tenant_migrations(tenant, 50)
            return [r.record for r in rows], store.history([r.id for r in rows])

        migrations, history = await asyncio.to_thread(read)
    peak = max((u["requests"] for u in usage["hours"]), default=0)
    tpm = max((u["quota_tokens"] for u in usage["minutes"]), default=0)
    return render(request, "tenants.html", {"tenant": tenant, "known": known, "admin": admin, "buckets": buckets,
                                            "usage": usage, "peak": peak, "tpm": tpm, "sessions": sessions,
                                            "migrations": migrations, "history": history}, caller)


# ---------------------------------------------------------------------------------------------- model
@router.get("/model", response_class=HTMLResponse)
async def model(request: Request, caller: ConsoleCaller) -> Response:
    """``GET /v1/admin/status``'s policy and model fields, and -- for a registered model -- its champion
    and challenger versions with the gate's verdict and a link to each version's MLflow run
    (``model_info``)."""
    require(caller, "read", "status")
    svc = caller.svc
    eng = svc.engine
    now = time.time()
    _, info = eng.slot.current(eng.freshness.age(now) > eng.max_age)
    registry = await asyncio.to_thread(model_info.registry_view, svc.settings.model_uri)
    state = await admin_routes.state_status(svc.state)
    return render(request, "model.html", {
        "policy": info, "model_uri": svc.settings.model_uri, "loaded": eng.slot.loaded_version,
        "error": eng.slot.last_error, "swaps": eng.slot.swaps, "registry": registry, "state": state,
        "decisions_since_start": eng.decisions}, caller)
