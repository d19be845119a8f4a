"""``GET /metrics``: Prometheus text format (admin key, unless ``metrics_public``)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.http.deps import require_admin, services_of
from xroute.schema.decision import ErrorResponse

router = APIRouter(tags=["metrics"])


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}, 401: {"model": ErrorResponse},  # type: ignore[dict-item]
                       403: {"model": ErrorResponse}})
async def metrics(request: Request) -> Response:
    svc = services_of(request)
    if not svc.settings.metrics_public:
        await require_admin(request, "read", "metrics")
    svc.metrics.telemetry_age.set(svc.engine.freshness.age(time.time()))
    return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)
