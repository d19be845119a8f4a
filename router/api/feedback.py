"""``POST /v1/feedback``: what really happened to a routed request -- stored durably with its realized
reward (``RoutingEngine.feedback_reward``: what off-policy evaluation learns from) for retraining,
then the closed loop: the decision's reservation is released, the pool's observed statistics
learn the outcome (``router.state.base``), the cached tokens the server reported correct the pool's
prefix affinity (its retention), and a completed request's output length feeds the router's
output-length estimator."""

from __future__ import annotations

import time

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

from router.api.route import IDEMPOTENCY_HEADER, idempotency_key
from router.decision.engine import RouteFailure
from router.http.deps import InferenceDep
from router.service.admission import (
    abandon,
    claim,
    idempotency_digest,
    remember,
    replayed,
)
from router.service.outcomes import close_the_loop, feedback_answer, feedback_row, settle_feedback
from router.store.sqlite import CommitInDoubt
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
    who, svc = caller.who, caller.svc
    idem = idempotency_key(caller.request)
    key = digest = None
    if idem is not None:
        digest = idempotency_digest(body.model_dump_json())
        key = f"{who.tenant}:feedback:{idem}"
        first = await claim(svc.state, key, svc.settings.idempotency_ttl_s)
        if first is not None:
            return Response(replayed(first, digest), status_code=201, media_type="application/json")
    try:
        ref = await svc.store.lookup(body.decision_id)
        if ref is None or ref.tenant != who.tenant:
            raise HTTPException(404, f"no decision '{body.decision_id}' for tenant '{who.tenant}'")
        if body.cached_tokens is not None and body.cached_tokens > ref.input_tokens:
            msg = (f"{body.cached_tokens} cached tokens for a request of {ref.input_tokens} input tokens: at most its "
                   "input_tokens")
            raise RouteFailure(422, "invalid_cached_tokens", msg, [{"field": "body.cached_tokens", "message": msg,
                                                                     "suggestions": []}])
        now = time.time()
        reward, missed = svc.engine.feedback_reward(ref, body)
        # a client's report of cached_tokens goes where the gateway writes what it measured (its column)
        fid = await svc.store.record_feedback(feedback_row(body, who.tenant, now, key, reward, missed,
                                                           (None, None, body.cached_tokens)))
    except CommitInDoubt:
        if key is not None:  # stored or not? the key waits for the log to say (router.service.admission.settle)
            assert digest is not None and ref is not None
            settle_feedback(svc, key, digest, body, ref, now)
        raise
    except BaseException:
        if key is not None:
            await abandon(svc.state, key)
        raise
    answer = feedback_answer(fid, body.decision_id, now)
    await close_the_loop(svc, body, ref)
    if key is not None:
        assert digest is not None
        await remember(svc.state, key, digest + answer, svc.settings.idempotency_ttl_s)
    return Response(answer, status_code=201, media_type="application/json")
