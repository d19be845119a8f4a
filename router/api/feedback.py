"""``POST /v1/feedback``: what really happened to a routed request -- parsed here, recorded by the
service (``router.service.outcomes.record_feedback``): stored durably with its realized reward
(``RoutingEngine.feedback_reward``: what off-policy evaluation learns from) for retraining, then the
closed loop: the decision's reservation is released, the pool's observed statistics learn the
outcome, the tenant's quota reservation is reconciled, the cached tokens the server reported
correct the pool's prefix affinity (its retention), and a completed request's output length feeds
the router's output-length estimator."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from router.api.route import IDEMPOTENCY_HEADER, idempotency_key
from router.http.deps import InferenceDep
from router.service.outcomes import record_feedback
from xroute.schema.decision import ErrorResponse, FeedbackRequest, FeedbackResponse

router = APIRouter(prefix="/v1", tags=["feedback"])


@router.post("/feedback", response_model=FeedbackResponse, status_code=201,
             responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}, 404: {"model": ErrorResponse},  # type: ignore[dict-item]
                        409: {"model": ErrorResponse},
                        422: {"model": ErrorResponse, "description": "the body is not JSON (not UTF-8, does not "
                              "parse, or sent without a JSON content type: `fields` names `body`), a field is "
                              "invalid (named in `fields`), no observation given, `idempotency_key_reused`, or "
                              "`invalid_cached_tokens`: more cached_tokens than the decision's input_tokens"},
                        503: {"model": ErrorResponse, "description": "`unavailable`: the decision log cannot "
                              "record; `state_unavailable` (keyed) or `state_restoring` (keyed, the shared state came "
                              "back empty and is being restored); see Retry-After"}},
             openapi_extra={"parameters": [IDEMPOTENCY_HEADER]}, summary="Report the observed outcome of a decision")
async def feedback(body: FeedbackRequest, caller: InferenceDep) -> Response:
    answer = await record_feedback(caller.svc, body, caller.who, idempotency_key(caller.request))
    return Response(answer, status_code=201, media_type="application/json")
