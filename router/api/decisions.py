"""``GET /v1/decisions/{id}``: a recorded decision, its request and feedback (own tenant only)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException
from fastapi import Path as PathParam

from router.http.deps import CallerDep, ReadDecisions
from xroute.schema.decision import DecisionRecord, ErrorResponse

router = APIRouter(prefix="/v1", tags=["decisions"])

DecisionId = Annotated[str, PathParam(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@/+=-]+$")]
_ERRORS: dict[int | str, dict[str, Any]] = {401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}, 404: {"model": ErrorResponse, "description": "no such decision "
                                                                                      "(for this tenant)"}}


@router.get("/decisions/{decision_id}", response_model=DecisionRecord, responses=_ERRORS,
            summary="Read a decision of the caller's tenant")
async def get_decision(decision_id: DecisionId, caller: CallerDep) -> dict[str, object]:
    """Another tenant's decision is reported as not found, exactly like a missing one."""
    tenant = caller.who.tenant
    rec = await caller.svc.store.get_decision(decision_id, tenant)
    if rec is None:
        raise HTTPException(404, f"no decision '{decision_id}' for tenant '{tenant}'")
    return rec


admin_router = APIRouter(prefix="/v1/admin", tags=["admin"])


@admin_router.get("/decisions/{decision_id}", response_model=DecisionRecord,  # type: ignore[arg-type]
                  responses={**_ERRORS, 403: {"model": ErrorResponse, "description": "the key is not an admin key"}},
                  summary="Read any tenant's decision (admin)")
async def admin_get_decision(decision_id: DecisionId, caller: ReadDecisions) -> dict[str, object]:
    rec = await caller.svc.store.get_decision(decision_id, None)
    if rec is None:
        raise HTTPException(404, f"no decision '{decision_id}'")
    return rec
