"""``POST /v1/feedback``: what really happened to a routed request -- stored durably with its realized
reward (``RoutingEngine.feedback_reward``: what off-policy evaluation learns from) for retraining,
then the closed loop: the decision's reservation is released, the pool's observed statistics
learn the outcome (``router.state``), the cached tokens the server reported correct the pool's
prefix affinity (its retention), and a completed request's output length feeds the router's
output-length estimator."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

from router.deps import InferenceDep
from router.engine import RouteFailure
from router.logs import iso
from router.routes.route import (
    IDEMPOTENCY_HEADER,
    abandon,
    best_effort,
    claim,
    idempotency_digest,
    idempotency_key,
    release,
    remember,
    replayed,
    settle,
)
from router.state import EmbeddedState
from router.store import CommitInDoubt, DecisionRef
from xroute.schema.decision import ErrorResponse, FeedbackRequest, FeedbackResponse
from xroute.schema.quota import settled_amounts

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
        if key is not None:  # stored or not? the key waits for the log to say (router.routes.route.settle)
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


def feedback_row(body: FeedbackRequest, tenant: str, received_at: float, key: str | None, reward: float | None,
                 missed: bool | None, measured: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    """The decision log's feedback row (``router.store.FEEDBACK_COLUMNS``) of an outcome: what a
    report says, its idempotency key, its realized reward and SLO verdict, then ``measured``, what
    the gateway measured itself (tpot_ms, prompt_tokens, cached_tokens, request_id, attempt; absent
    for a client's report)."""
    return (body.decision_id, tenant, received_at, body.latency_ms, body.cost_usd, body.output_tokens, int(body.failed),
            body.error, body.ttft_ms, key, reward, None if missed is None else int(missed), *measured)


async def settle_quota(svc: Any, body: FeedbackRequest, ref: DecisionRef) -> None:
    """Reconcile the decision's tenant quota reservation with what ``body`` reports
    (``xroute.schema.quota.settled_amounts``), when one applied; logged, not raised, when the state
    cannot be reached (it then counts what was reserved)."""
    if ref.quota_tokens is None or ref.quota_usd is None:
        return
    tokens, usd = settled_amounts(ref.quota_tokens, ref.quota_usd, ref.input_tokens, body.output_tokens,
                                  body.cost_usd, body.failed)
    await best_effort(svc.state, "quota_settle", (body.decision_id, tokens, usd), "quota not reconciled with the "
                      "feedback (it counts what was reserved)", decision=body.decision_id)


def settle_feedback(svc: Any, key: str, digest: bytes, body: FeedbackRequest, ref: DecisionRef, at: float) -> None:
    """A keyed feedback whose commit is in doubt: found in the log (by its key, received at ``at``),
    the key gets the answer the client missed and the loop closes; else the key is dropped."""

    async def found() -> bytes | None:
        _, rows = await svc.store.keyed_since(at - 1.0)
        for row in rows:
            if row[0] == key and row[2] == body.decision_id:
                return digest + feedback_answer(int(row[1]), body.decision_id, float(row[3]))
        return None

    async def then() -> None:
        await close_the_loop(svc, body, ref)

    settle(svc, key, body.decision_id, None, found, then)


def feedback_answer(feedback_id: int, decision_id: str, received_at: float) -> bytes:
    """The answer to a stored feedback (built again from its row when idempotency keys are
    restored after a restart: the same bytes)."""
    return json.dumps({"feedback_id": int(feedback_id), "decision_id": decision_id, "received_at": iso(received_at)},
                      separators=(",", ":")).encode()


async def close_the_loop(svc: Any, body: FeedbackRequest, ref: DecisionRef) -> None:
    """After the feedback is durable: release the decision's reservation (this process's view and
    the shared state), fold the outcome into its pool's statistics (the decision's first feedback
    only, so a repeated report does not count twice), and teach the output-length estimator. The
    feedback is stored whatever happens here: an unreachable shared state leaves the reservation
    to its hold and the statistics without this outcome (logged). The decision's tenant quota
    reservation (when one applied) is reconciled with what the feedback reports
    (``xroute.schema.quota.settled_amounts``): its concurrency slot is freed, its tokens and USD
    become the real ones."""
    await release(svc, body.decision_id)
    if ref.feedback == 0:
        calls = [best_effort(svc.state, "observe", (ref.pool, body.ttft_ms, body.latency_ms, body.failed),
                             "outcome not added to the pool's statistics", pool=ref.pool)]
        if ref.quota_tokens is not None and ref.quota_usd is not None:  # its tenant's quotas: what it really used
            calls.append(settle_quota(svc, body, ref))
        if len(calls) > 1 and not isinstance(svc.state, EmbeddedState):  # (a server: one round trip for both)
            await asyncio.gather(*calls)
        else:
            for call in calls:
                await call
    if body.cached_tokens is not None:  # the server's cached prefix corrects the pool's prefix affinity
        await best_effort(svc.state, "prefix_feedback", (body.decision_id, body.cached_tokens,
                                                         svc.settings.prefix_retention_alpha),
                          "cached tokens not added to the pool's prefix retention", pool=ref.pool)
    engine = svc.engine
    if body.output_tokens is not None and not body.failed and ref.model in engine.models:
        engine.env.observe_output(ref.model, ref.tenant, body.output_tokens)
