"""FastAPI dependencies: the caller (API key -> tenant) together with the app's services.

One dependency per route, ``async``: FastAPI runs plain ``def`` dependencies in a thread pool (a
thread hop per call, and the environment must only be touched from the event-loop thread), and
every extra dependency costs ~10-20 us of resolution per request, a sizeable share of a ~250 us
decision. The security schemes are therefore declared in the OpenAPI document by the app
(``router.app``) rather than through ``Security(HTTPBearer())`` sub-dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request

from router.engine import RoutingEngine
from router.keys import KeyStore, Principal
from router.metrics import Metrics
from router.settings import RouterSettings
from router.state import RouterState
from router.store import GroupCommitLog


@dataclass
class Services:
    """Everything the routes use, built once by the lifespan (``RouterApp.services``)."""

    settings: RouterSettings
    engine: RoutingEngine
    store: GroupCommitLog
    keys: KeyStore
    metrics: Metrics
    models: object  # router.app.ModelManager (kept loose to avoid an import cycle)
    #: in-flight work, outcome statistics, idempotency keys (router.state)
    state: RouterState
    #: the pools' inference servers' own metrics (router.scrape.InferenceScraper), when configured
    scraper: object | None = None
    #: the OpenAI-compatible gateway (router.gateway.service.Gateway), set once built
    gateway: object | None = None
    #: the routing policies' store and its sync (router.policy_sync.PolicySync)
    policies: Any = None
    #: what /readyz answers, probed in the background (router.readiness.Readiness)
    readiness: object | None = None
    #: pool events and session migrations (router.migration.Migrator), set once built
    migrator: Any = None


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
    """401 unless the request carries a valid key."""
    svc = services_of(request)
    key = api_key(request)
    if key is None:
        raise HTTPException(401, "missing API key (Authorization: Bearer <key> or X-API-Key)",
                            headers={"WWW-Authenticate": "Bearer"})
    who = svc.keys.verify(key)
    if who is None:
        raise HTTPException(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
    request.state.tenant = who.tenant
    if who.role == "tenant" and not svc.engine.tenant_known(who.tenant):  # fail closed (docs/policies.md)
        raise svc.engine.unknown_tenant(who.tenant)
    return Caller(who, svc, request)


async def authenticate_admin(request: Request) -> Caller:
    """401 without a valid key, 403 unless it is an admin key."""
    caller = await authenticate(request)
    if not caller.who.is_admin:
        raise HTTPException(403, "this route needs an admin key")
    return caller


async def authenticate_events(request: Request) -> Caller:
    """401 without a valid key, 403 unless it is an admin key or an events key (pool events, the
    serving side's migration calls: docs/migration.md)."""
    caller = await authenticate(request)
    if caller.who.role not in ("admin", "events"):
        raise HTTPException(403, "this route needs an admin or events key")
    return caller


CallerDep = Annotated[Caller, Depends(authenticate)]
EventsDep = Annotated[Caller, Depends(authenticate_events)]
AdminDep = Annotated[Caller, Depends(authenticate_admin)]
