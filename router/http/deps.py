"""FastAPI dependencies: the caller (API key -> tenant) together with the app's services.

One dependency per route, ``async``: FastAPI runs plain ``def`` dependencies in a thread pool (a
thread hop per call, and the environment must only be touched from the event-loop thread), and
every extra dependency's resolution is a sizeable share of a decision's CPU (``docs/results.md``,
"Figures behind the code"). The security schemes are therefore declared in the OpenAPI document by the app
(``router.app.factory``) rather than through ``Security(HTTPBearer())`` sub-dependencies.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from router.decision.access import admin_denied, denied
from router.decision.engine import RouteFailure
from router.service.services import Services
from xroute.schema.access import Principal, admin_resource


@dataclass(slots=True)
class Caller:
    """The authenticated caller, the services, and the request (for per-request log fields)."""

    who: Principal
    svc: Services
    request: Request


def services_of(request: Request) -> Services:
    svc = getattr(request.app, "services", None)
    if svc is None:
        raise HTTPException(503, "the router is starting")
    return svc  # type: ignore[no-any-return]


def bearer_of(value: bytes) -> str | None:
    """The key in an ``Authorization: Bearer <key>`` value (None for another scheme or no key)."""
    scheme, _, cred = value.decode("latin-1").partition(" ")
    return (cred.strip() or None) if scheme.lower() == "bearer" else None


def api_key(request: Request) -> str | None:
    """The key from ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``."""
    key = None
    for name, value in request.scope["headers"]:
        if name == b"authorization":
            bearer = bearer_of(value)
            if bearer is not None:
                return bearer
        elif name == b"x-api-key":
            key = value.decode("latin-1").strip() or None
    return key


async def authenticate(request: Request) -> Caller:
    """401 unless the request carries a valid key; 403 ``unknown_tenant`` for a key of a tenant the
    router does not serve, unless its roles reach an admin resource (it may administer, not route)."""
    return await authenticate_key(request, api_key(request))


async def authenticate_key(request: Request, key: str | None) -> Caller:
    """:func:`authenticate` with the key given (the web console's: a header's, else its cookie's)."""
    svc = services_of(request)
    if key is None:
        raise HTTPException(401, "missing API key (Authorization: Bearer <key> or X-API-Key)",
                            headers={"WWW-Authenticate": "Bearer"})
    who = svc.keys.verify(key)
    if who is None:
        raise HTTPException(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
    request.state.tenant = who.tenant
    engine = svc.engine
    if not engine.tenant_known(who.tenant) and not engine.access.permissions(who).any_admin:
        raise engine.unknown_tenant(who.tenant)  # fail closed (docs/policies.md)
    return Caller(who, svc, request)


async def authenticate_inference(request: Request) -> Caller:
    """:func:`authenticate`, and 403 unless the key's roles grant some ``model:inference`` resource
    (which model and region: checked per decision, ``RoutingEngine.rank``)."""
    caller = await authenticate(request)
    if not caller.svc.engine.access.permissions(caller.who).can_infer:
        raise RouteFailure(**denied(caller.who, "model:inference:*", "routing (and reporting feedback)"))
    return caller


def admin_dep(verb: str, kind: str) -> Callable[[Request], Awaitable[Caller]]:
    """The dependency of an admin route: :func:`authenticate`, and 403 naming the permission
    ``admin:<verb>:<kind>`` unless the key's roles grant it."""
    resource = admin_resource(verb, kind)

    async def dep(request: Request) -> Caller:
        caller = await authenticate(request)
        if not caller.svc.engine.access.permissions(caller.who).allows(resource):
            raise RouteFailure(**admin_denied(caller.who, verb, kind))
        return caller

    dep.__name__ = f"admin_{verb}_{kind}"
    return dep


async def require_admin(request: Request, verb: str, kind: str) -> Caller:
    """:func:`admin_dep` for a route that is not a FastAPI route (``/metrics``)."""
    return await admin_dep(verb, kind)(request)


CallerDep = Annotated[Caller, Depends(authenticate)]


InferenceDep = Annotated[Caller, Depends(authenticate_inference)]


ReadPolicies = Annotated[Caller, Depends(admin_dep("read", "policies"))]


WritePolicies = Annotated[Caller, Depends(admin_dep("write", "policies"))]


ReadAudit = Annotated[Caller, Depends(admin_dep("read", "audit"))]


ReadQuotas = Annotated[Caller, Depends(admin_dep("read", "quotas"))]


WriteQuotas = Annotated[Caller, Depends(admin_dep("write", "quotas"))]


ReadTenants = Annotated[Caller, Depends(admin_dep("read", "tenants"))]


WriteTenants = Annotated[Caller, Depends(admin_dep("write", "tenants"))]


ReadRoles = Annotated[Caller, Depends(admin_dep("read", "roles"))]


WriteRoles = Annotated[Caller, Depends(admin_dep("write", "roles"))]


ReadDecisions = Annotated[Caller, Depends(admin_dep("read", "decisions"))]


ReadStatus = Annotated[Caller, Depends(admin_dep("read", "status"))]

#: ``GET /v1/capacity/plan``
ReadCapacity = Annotated[Caller, Depends(admin_dep("read", "capacity"))]


WriteModel = Annotated[Caller, Depends(admin_dep("write", "model"))]


#: pool events and the serving side's migration calls (docs/migration.md; the built-in role ``events``)
WriteEvents = Annotated[Caller, Depends(admin_dep("write", "events"))]
