"""``POST /v1/feedback``: what really happened to a routed request (stored durably for retraining; a
completed request's output length also feeds the router's output-length estimator)."""

from __future__ import annotations

import time

from fastapi import APIRouter, HTTPException

from router.deps import CallerDep
from router.logs import iso
from xroute.schema.decision import ErrorResponse, FeedbackRequest, FeedbackResponse

router = APIRouter(prefix="/v1", tags=["feedback"])


@router.post("/feedback", response_model=FeedbackResponse, status_code=201,
             responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse},  # type: ignore[dict-item]
                        422: {"model": ErrorResponse}}, summary="Report the observed outcome of a decision")
async def feedback(body: FeedbackRequest, caller: CallerDep) -> dict[str, object]:
    who, svc = caller.who, caller.svc
    if await svc.store.owner(body.decision_id) != who.tenant:
        raise HTTPException(404, f"no decision '{body.decision_id}' for tenant '{who.tenant}'")
    now = time.time()
    fid = await svc.store.record_feedback((body.decision_id, who.tenant, now, body.latency_ms, body.cost_usd,
                                           body.output_tokens, int(body.failed), body.error))
    if body.output_tokens is not None and not body.failed:  # a completed output's length teaches the estimator
        d = await svc.store.get_decision(body.decision_id, who.tenant)
        model = (d or {}).get("request", {}).get("model")
        if model is None or model in svc.engine.models:
            svc.engine.env.observe_output(model, who.tenant, body.output_tokens)
    return {"feedback_id": fid, "decision_id": body.decision_id, "received_at": iso(now)}
