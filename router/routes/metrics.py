"""``GET /metrics``: Prometheus text format (admin key, unless ``metrics_public``)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Security
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.deps import ServicesDep, _bearer, _header, authenticate, get_services, require_admin
from xroute.schema.decision import ErrorResponse

router = APIRouter(tags=["metrics"])


def _guard(request: Request, bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
           header: Annotated[str | None, Security(_header)]) -> None:
    if get_services(request).settings.metrics_public:
        return
    require_admin(authenticate(request, bearer, header))


@router.get("/metrics", summary="Prometheus metrics", response_class=Response, dependencies=[Depends(_guard)],
            responses={200: {"content": {"text/plain": {}}}, 401: {"model": ErrorResponse},  # type: ignore[dict-item]
                       403: {"model": ErrorResponse}})
def metrics(svc: ServicesDep) -> Response:
    svc.metrics.telemetry_age.set(svc.engine.freshness.age(time.time()))
    return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)
