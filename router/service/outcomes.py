"""What happens when an outcome arrives (``POST /v1/feedback``, or the gateway's own measurement):
the feedback row, and the closed loop -- one ``settle`` of the shared state
(``router.service.ports``): the reservation released, the pool's statistics, the quota reservation
reconciled (tokens and USD) and the prefix retention updated -- and the output-length estimator
fed. Contract: only a decision's first feedback counts in the statistics and the quotas."""

from __future__ import annotations

import json
import time
from typing import Any

from router.core.logs import LOG, iso
from router.service.admission import settle_in_doubt
from router.service.services import Services
from router.state.base import PoolOutcome, QuotaSettle, Settlement
from router.store.sqlite import DecisionRef
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
        await close_the_loop(svc, body, ref)

    settle_in_doubt(svc, key, body.decision_id, None, found, then)


def feedback_answer(feedback_id: int, decision_id: str, received_at: float) -> bytes:
    """The answer to a stored feedback (built again from its row when idempotency keys are
    restored after a restart: the same bytes)."""
    return json.dumps({"feedback_id": int(feedback_id), "decision_id": decision_id, "received_at": iso(received_at)},
                      separators=(",", ":")).encode()


async def close_the_loop(svc: Services, body: FeedbackRequest, ref: DecisionRef) -> None:
    """After the feedback is durable, one settlement (:func:`settle`): release the decision's
    reservation (this process's view and the shared state); on the decision's first feedback only
    (a repeated report does not count twice) fold the outcome into its pool's statistics and
    reconcile its tenant quota reservation, when one applied, with what the feedback reports
    (``xroute.schema.quota.settled_amounts``: its concurrency slot freed, its tokens and USD the real
    ones); the cached tokens a server reported correct the pool's prefix retention. Then the
    output-length estimator learns the output. The feedback is stored whatever happens here."""
    first = ref.feedback == 0
    await settle(svc, Settlement(
        body.decision_id, outcome=PoolOutcome(ref.pool, body.ttft_ms, body.latency_ms, body.failed) if first else None,
        quota=quota_settle(body, ref) if first else None, cached_tokens=body.cached_tokens,
        retention_alpha=svc.settings.prefix_retention_alpha))
    engine = svc.engine
    if body.output_tokens is not None and not body.failed and ref.model in engine.models:
        engine.env.observe_output(ref.model, ref.tenant, body.output_tokens)
