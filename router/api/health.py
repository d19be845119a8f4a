"""``/healthz`` (the process answers) and ``/readyz`` (it can decide and record); no key needed."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: environment loaded, decision log writable, shared state reachable",
            responses={503: {"description": "not ready (starting, the decision log is down, or the shared state "
                                            "cannot be reached and fails closed)"}})
async def readyz(request: Request) -> JSONResponse:
    svc = getattr(request.app, "services", None)
    if svc is None:
        return JSONResponse({"status": "starting"}, status_code=503)
    eng = svc.engine
    now = time.time()
    probed = svc.readiness  # router.service.readiness: the backends, probed every ready_probe_s whatever the traffic
    writer_ok = probed.decision_log_ok
    state_ok = probed.state_ok
    ready = writer_ok and state_ok
    active, info = eng.slot.current(eng.freshness.age(now) > eng.max_age)
    body = {
        "status": "ready" if ready else "not_ready",
        "decision_log": "ok" if writer_ok else "down",
        "state": "ok" if state_ok else "down",
        "policy": info,
        "model_error": eng.slot.last_error,
        "telemetry_age_s": round(eng.freshness.age(now), 3),
        "telemetry_error": eng.freshness.last_error,
        "offerings": eng.n,
    }
    return JSONResponse(body, status_code=200 if ready else 503)
