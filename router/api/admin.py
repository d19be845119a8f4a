"""Admin routes (admin key): router status, a forced model check, the watchdog's reset."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Body
from pydantic import BaseModel, ConfigDict, Field

from router.decision.stages import RouteFailure
from router.http.deps import ReadStatus, WriteModel
from router.http.errors import BODY_NOT_JSON_422
from router.service import watchdog_sync
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


class WatchdogReset(BaseModel):
    """``POST /v1/admin/watchdog/reset``'s body (optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str | None = Field(None, min_length=1, max_length=500, description="kept in the audit log")


@router.post("/watchdog/reset", summary="The champion decides again: the watchdog's confidence sequence starts anew (audited)",
             responses={422: {"model": ErrorResponse, "description": BODY_NOT_JSON_422 + ", or `reason` is "
                              "invalid (named in `fields`)"},
                        503: {"model": ErrorResponse}})  # type: ignore[dict-item]
async def reset_watchdog(caller: WriteModel,
                         body: Annotated[WatchdogReset | None, Body()] = None) -> dict[str, object]:
    """An operator's word against the watchdog (``router.decision.watchdog``): the audit entry (kind
    ``watchdog``, action ``reset``, the state before and after, the reason) is durable before the
    reset; then this process's confidence sequence starts again and the champion decides -- on the other router
    processes within ``watchdog.sync_s`` (``router.service.watchdog_sync``)."""
    svc = caller.svc
    wd = svc.engine.watchdog
    who = f"key:{caller.who.key_id}"
    reason = None if body is None else body.reason
    before = wd.describe()
    after = {**before, "state": "watching" if before["state"] in ("tripped", "ok") else before["state"], "n": 0,
             "estimate": None, "interval": None, "reason": reason}
    try:
        await watchdog_sync.record(svc, "reset", who, before, after)
    except Exception as e:
        raise RouteFailure(503, "unavailable", f"the audit log cannot record the reset ({e})",
                           headers={"Retry-After": "5"}) from None
    return wd.reset(who)
