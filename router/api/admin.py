"""Admin routes (admin key): router status and a forced model check."""

from __future__ import annotations

import time

from fastapi import APIRouter

from router.http.deps import ReadStatus, WriteModel
from router.service.ports import SharedState
from router.state.base import StateUnavailable
from xroute.schema.decision import ErrorResponse

router = APIRouter(prefix="/v1/admin", tags=["admin"],
                   responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}})  # type: ignore[dict-item]


@router.get("/status", summary="Policy, model, telemetry and decision-log state")
async def status(caller: ReadStatus) -> dict[str, object]:
    svc = caller.svc
    eng, st = svc.engine, svc.store
    now = time.time()
    _, info = eng.slot.current(eng.freshness.age(now) > eng.max_age)
    return {
        "policy": info,
        "model_uri": svc.settings.model_uri,
        "model_version": eng.slot.loaded_version,
        "model_error": eng.slot.last_error,
        "model_swaps": eng.slot.swaps,
        "telemetry": {"source": eng.source_name, "clock": eng.clock, "age_s": round(eng.freshness.age(now), 3),
                      "error": eng.freshness.last_error},
        "decisions_since_start": eng.decisions,
        "decision_log": st.describe(),
        "state": await state_status(svc.state),
        "inference_servers": svc.scraper.describe() if svc.scraper is not None else None,
        "routing_policies": svc.policies.describe() if svc.policies is not None else None,
        "access": svc.access.describe() if svc.access is not None else None,
    }


async def state_status(state: SharedState) -> dict[str, object]:
    """The shared state's description, its in-flight work and expired reservations per pool (or
    the error that kept them from being read)."""
    out: dict[str, object] = dict(state.describe())
    try:
        view = await state.view()
        out["in_flight"] = view.in_flight
        out["expired"] = view.expired
    except StateUnavailable as e:
        out["error"] = str(e)
    return out


@router.post("/model/reload", summary="Check the model URI now; swap if it points to a new version")
async def reload_model(caller: WriteModel) -> dict[str, object]:
    svc = caller.svc
    outcome = await svc.models.check()
    return {"outcome": outcome, "model_version": svc.engine.slot.loaded_version,
            "model_error": svc.engine.slot.last_error}
