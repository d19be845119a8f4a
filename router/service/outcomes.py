"""What happens when an outcome arrives (``POST /v1/feedback``, or the gateway's own measurement):
the feedback row, the quota settle (tokens and USD reconciled once), and the closed loop -- the
reservation released, the pool's statistics and prefix retention updated, the output-length
estimator fed. Contract: only a decision's first feedback settles anything."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from router.core.logs import iso
from router.service.admission import (
    best_effort,
    release,
    settle,
)
from router.state.embedded import EmbeddedState
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
