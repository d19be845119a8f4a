"""FastAPI dependencies: the app's services and the caller's identity (API key)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from router.engine import RoutingEngine
from router.keys import KeyStore, Principal
from router.metrics import Metrics
from router.settings import RouterSettings
from router.store import DecisionStore


@dataclass
class Services:
    """Everything the routes use, built once by the lifespan (``app.state.services``)."""

    settings: RouterSettings
    engine: RoutingEngine
    store: DecisionStore
    keys: KeyStore
    metrics: Metrics
    models: object  # router.app.ModelManager (kept loose to avoid an import cycle)


def get_services(request: Request) -> Services:
    svc = getattr(request.app.state, "services", None)
    if svc is None:
        raise HTTPException(503, "the router is starting")
    return svc  # type: ignore[no-any-return]


ServicesDep = Annotated[Services, Depends(get_services)]

_bearer = HTTPBearer(auto_error=False, description="API key as a bearer token: Authorization: Bearer xr_...")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="API key (alternative to the bearer token)")


def authenticate(request: Request,
                 bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
                 header: Annotated[str | None, Security(_header)]) -> Principal:
    """The caller, from ``Authorization: Bearer <key>`` or ``X-API-Key``; 401 otherwise."""
    key = bearer.credentials if bearer is not None else header
    if not key:
        raise HTTPException(401, "missing API key (Authorization: Bearer <key> or X-API-Key)",
                            headers={"WWW-Authenticate": "Bearer"})
    svc = get_services(request)
    who = svc.keys.verify(key.strip())
    if who is None:
        raise HTTPException(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
    request.state.tenant = who.tenant
    return who


def require_admin(who: Annotated[Principal, Depends(authenticate)]) -> Principal:
    if not who.is_admin:
        raise HTTPException(403, "this route needs an admin key")
    return who


TenantDep = Annotated[Principal, Depends(authenticate)]
AdminDep = Annotated[Principal, Depends(require_admin)]
