"""The capacity plan: ``GET /v1/capacity/plan`` (permission ``admin:read:capacity``) -- the target
instances per pool now beside what runs, with the reasons (``xroute.schema.capacity.CapacityPlan``;
``router.service.capacity`` makes it; docs/capacity.md, "Planning in the service")."""

from __future__ import annotations

from fastapi import APIRouter

from router.decision.stages import RouteFailure
from router.http.deps import ReadCapacity
from router.service.capacity import PlanUnavailable
from xroute.schema.capacity import CapacityPlan
from xroute.schema.decision import ErrorResponse

router = APIRouter(prefix="/v1", tags=["capacity"])


@router.get("/capacity/plan", response_model=CapacityPlan, tags=["admin"],
            summary="The capacity plan now: target instances per pool, current, reasons (admin:read:capacity)",
            responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},  # type: ignore[dict-item]
                       503: {"model": ErrorResponse, "description": "`plan_unavailable`: the planner cannot plan "
                             "now (a model that is not registered, no request before the plan time)"}})
async def capacity_plan(caller: ReadCapacity) -> CapacityPlan:
    plans = caller.svc.capacity
    if plans is None:  # (the lifespan sets it before serving)
        raise RouteFailure(503, "plan_unavailable", "the capacity planner is not started yet")
    try:
        return await plans.current()
    except PlanUnavailable as e:
        raise RouteFailure(503, "plan_unavailable", str(e), headers={"Retry-After": "5"}) from None
