"""What happens when an outcome arrives (``POST /v1/feedback``, or the gateway's own measurement):
the feedback row, and the closed loop -- one ``settle`` of the shared state
(``router.service.ports``): the reservation released, the pool's statistics, the quota reservation
reconciled (tokens and USD) and the prefix retention updated -- and the output-length estimator
fed. Contract: only a decision's first feedback counts in the statistics and the quotas."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import HTTPException

from router.core.logs import LOG, iso
from router.decision.engine import RouteFailure
from router.decision.watchdog import Observation
from router.service import watchdog_sync
from router.service.admission import abandon, claim, idempotency_digest, remember, replayed, settle_in_doubt
from router.service.services import Services
from router.state.base import PoolOutcome, QuotaSettle, Settlement
from router.store.sqlite import CommitInDoubt, DecisionRef
from xroute import admission_rules
from xroute.schema.access import Principal
from xroute.schema.decision import FeedbackRequest
from xroute.schema.quota import settled_amounts


def feedback_row(body: FeedbackRequest, tenant: str, received_at: float, key: str | None, reward: float | None,
                 missed: bool | None, measured: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    """The decision log's feedback row (``router.store.sqlite.FEEDBACK_COLUMNS``) of an outcome: what a
    report says, its idempotency key, its realized reward and SLO verdict, then ``measured``, what
    the gateway measured itself (tpot_ms, prompt_tokens, cached_tokens, request_id, attempt; absent
    for a client's report)."""
    return (body.decision_id, tenant, received_at, body.latency_ms, body.cost_usd, body.output_tokens, int(body.failed),
            body.error, body.ttft_ms, key, reward, None if missed is None else int(missed), *measured)


def quota_settle(body: FeedbackRequest, ref: DecisionRef) -> QuotaSettle | None:
    """The decision's tenant quota reservation reconciled with what ``body`` reports
    (``xroute.schema.quota.settled_amounts``); None when no quota applied."""
    if ref.quota_tokens is None or ref.quota_usd is None:
        return None
    tokens, usd = settled_amounts(ref.quota_tokens, ref.quota_usd, ref.input_tokens, body.output_tokens,
                                  body.cost_usd, body.failed)
    return QuotaSettle(tokens, usd)


async def settle(svc: Services, s: Settlement) -> None:
    """This process's side of a release (with ``s.release``: ``RoutingEngine.release_local``), then
    the shared state's ``settle``. The outcome is stored already: an unreachable state leaves the
    reservation to its hold, the quotas counting what was reserved, the statistics without this
    outcome (logged, not raised)."""
    if s.release:
        svc.engine.release_local(s.reservation_id, time.time())
    try:
        await svc.state.settle(s)
    except Exception as e:
        LOG.warning("outcome not settled in the shared state (the reservation is released when its hold passes; "
                    "the quotas count what was reserved)", extra={"fields": {
                        "decision": s.reservation_id, "error": str(e)}})
    if s.release and svc.admission is not None:  # a slot freed: the queue's next may fit
        svc.admission.kick()


async def settle_quota(svc: Services, body: FeedbackRequest, ref: DecisionRef, release: bool = False) -> None:
    """Reconcile the decision's tenant quota reservation with what ``body`` reports, when one
    applied (and, with ``release``, free its reservation: a request whose client went away)."""
    q = quota_settle(body, ref)
    if q is not None or release:
        await settle(svc, Settlement(body.decision_id, release=release, quota=q))


def settle_feedback(svc: Services, key: str, digest: bytes, body: FeedbackRequest, ref: DecisionRef,
                    at: float) -> None:
    """A keyed feedback whose commit is in doubt: found in the log (by its key, received at ``at``),
    the key gets the answer the client missed and the loop closes; else the key is dropped."""

    async def found() -> bytes | None:
        _, rows = await svc.store.keyed_since(at - 1.0)
        for row in rows:
            if row[0] == key and row[2] == body.decision_id:
                return digest + feedback_answer(int(row[1]), body.decision_id, float(row[3]))
        return None

    async def then() -> None:
        await close_the_loop(svc, body, ref, svc.engine.feedback_reward(ref, body)[1])

    settle_in_doubt(svc, key, body.decision_id, None, found, then)


def feedback_answer(feedback_id: int, decision_id: str, received_at: float) -> bytes:
    """The answer to a stored feedback (built again from its row when idempotency keys are
    restored after a restart: the same bytes)."""
    return json.dumps({"feedback_id": int(feedback_id), "decision_id": decision_id, "received_at": iso(received_at)},
                      separators=(",", ":")).encode()


async def close_the_loop(svc: Services, body: FeedbackRequest, ref: DecisionRef, missed: bool | None) -> None:
    """After the feedback is durable, one settlement (:func:`settle`): release the decision's
    reservation (this process's view and the shared state); on the decision's first feedback only
    (a repeated report does not count twice) fold the outcome into its pool's statistics and
    reconcile its tenant quota reservation, when one applied, with what the feedback reports
    (``xroute.schema.quota.settled_amounts``: its concurrency slot freed, its tokens and USD the real
    ones); the cached tokens a server reported correct the pool's prefix retention. Then the
    output-length estimator learns the output; the first outcome is counted in the metrics
    (``Metrics.outcome``: its SLO verdict ``missed``, TTFT and cost, under the tenant's default band).
    The feedback is stored whatever happens here."""
    first = ref.feedback == 0
    engine = svc.engine
    if first:
        cost = body.cost_usd if body.cost_usd is not None else (0.0 if body.failed else ref.expected_cost_usd)
        svc.metrics.outcome(ref.tenant, engine.default_band(ref.tenant), missed, body.ttft_ms, cost)
    fair = None  # (admission on: the tenant's fairness counter learns the output the request really had)
    if first and engine.admission_on and body.output_tokens is not None:
        fair = (ref.tenant, admission_rules.correction(ref.max_output_tokens, body.output_tokens,
                                                       engine.weight_of(ref.tenant)))
    await settle(svc, Settlement(
        body.decision_id, outcome=PoolOutcome(ref.pool, body.ttft_ms, body.latency_ms, body.failed) if first else None,
        quota=quota_settle(body, ref) if first else None, cached_tokens=body.cached_tokens,
        retention_alpha=svc.settings.prefix_retention_alpha, fair=fair))
    if body.output_tokens is not None and not body.failed and ref.model in engine.models:
        engine.env.observe_output(ref.model, ref.tenant, body.output_tokens)


async def watch(svc: Services, ref: DecisionRef, reward: float | None, decision_id: str | None = None) -> None:
    """The champion's watchdog learns a decision's first outcome (``router.decision.watchdog``); a
    trip it makes is shared with the other routers (``router.service.watchdog_sync``). A failure
    here is logged, never the outcome's."""
    try:
        now = svc.engine.watchdog.observe(Observation(ref.policy_kind, ref.policy_version, ref.features,
                                                      ref.propensity, ref.greedy_offering_id, reward, decision_id))
    except Exception as e:
        LOG.warning("the watchdog could not read a decision's outcome", extra={"fields": {
            "error": f"{type(e).__name__}: {e}"}})
        return
    if now:
        await watchdog_sync.tripped(svc)


async def record_feedback(svc: Services, body: FeedbackRequest, who: Principal, idempotency: str | None = None
                          ) -> bytes:
    """``POST /v1/feedback``'s pipeline: claim the key (its first answer again, or 409), find the
    decision (the caller's tenant's: 404 else), check the cached tokens against its prompt (422),
    store the feedback row with its realized reward (durable before the answer), then close the
    loop (:func:`close_the_loop`) and complete the key. A commit in doubt keeps the key pending
    until the log says (``settle_in_doubt``); any other failure drops the claim."""
    key = digest = ref = None
    if idempotency is not None:
        digest = idempotency_digest(body.model_dump_json())
        key = f"{who.tenant}:feedback:{idempotency}"
        first = await claim(svc.state, key, svc.settings.idempotency_ttl_s)
        if first is not None:
            return replayed(first, digest)
    now = 0.0
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
        if key is not None:  # stored or not? the key waits for the log to say
            assert digest is not None and ref is not None
            settle_feedback(svc, key, digest, body, ref, now)
        raise
    except BaseException:
        if key is not None:
            await abandon(svc.state, key)
        raise
    answer = feedback_answer(fid, body.decision_id, now)
    await close_the_loop(svc, body, ref, missed)
    if ref.feedback == 0:  # (a decision's first outcome only, as the statistics count it)
        await watch(svc, ref, reward, body.decision_id)
    if key is not None:
        assert digest is not None
        await remember(svc.state, key, digest + answer, svc.settings.idempotency_ttl_s)
    return answer
