"""The route pipeline every entry point shares -- ``POST /v1/route``, the gateway's attempts and the
migrator's placements (:func:`route_decision`): claim the idempotency key, look the prefix and
session up, rank (``RoutingEngine.rank``), admit (the pool, the tenant's quotas and the prefix's
record: one ``admit`` of the shared state, ``router.service.ports``), record the decision durably,
answer; on any failure give back what was taken (one ``settle``).

Contract: a decision is acknowledged only once its row is durable (or, for the gateway, before any
byte reaches its client); a failure after an admission gives back its pool and its quotas; a keyed
request whose commit is in doubt keeps its key pending until the log says whether it committed
(:func:`settle_in_doubt`)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException

from router.core import tracing
from router.core.logs import LOG, new_sorted_id, trace_id_var
from router.decision.engine import RouteFailure, RoutingEngine
from router.service.admission_queue import judged
from router.service.ports import DecisionState, Idempotency
from router.service.services import Services
from router.state.base import QUOTA_UNDO, Admission, QuotaCharge, Settlement
from router.store.rows import DecisionRow
from router.store.sqlite import CommitInDoubt, StoreClosed
from xroute import admission_rules
from xroute.schema.access import Principal
from xroute.schema.decision import RouteRequest


@dataclass(slots=True)
class Decided:
    """A decision admitted in the shared state and in this process's view, not yet logged: the
    answer's JSON, the decision-log row, the offering, the policy's info, and what the tenant's
    quotas reserved (tokens, USD; None: no quota applied)."""

    payload: bytes
    row: DecisionRow
    offering_id: str
    pinfo: dict[str, Any]
    quota: tuple[int, float] | None
    #: what the tenant's fairness counter grew by (admission on), given back with the decision
    fair: tuple[str, float] | None = None


async def decide(engine: RoutingEngine, state: DecisionState, body: RouteRequest, who: Principal,
                 decision_id: str, wall: float, request_json: str | None = None, key: str | None = None,
                 reserve_quota: bool = True, waited_ms: float = 0.0) -> Decided:
    """Look up, rank, admit -- the decision itself, between the idempotency claim and the log.

    The prefix and session affinity (``lookup``) when the request carries them, the ranking, then
    one ``admit`` of the ranked pools with their capacity and hold, the tenant's quota charge (the
    expected cost of the policy's choice; none with ``reserve_quota=False``, the gateway's retry of
    a request counted already) and the prefix's record: all or nothing. Raises ``RouteFailure``
    with nothing held: 429 ``no_capacity`` (no pool has room), 429/422 ``quota_exceeded``/
    ``quota_too_small``, and whatever ranking raises (with admission on, the ``predict`` stage's
    429 ``slo_unattainable``; ``waited_ms``: how long the request waited in the admission queue).
    With admission on, the admission also counts the request's service in its tenant's fairness
    counter (``Admission.fair``: the same call). On a state in this process nothing suspends
    between ranking and admitting."""
    affinity = hashes = None
    if engine.wants_affinity(body):  # the shared prefix index: where these blocks and this session went
        engine.check_prefix(body)
        hashes = engine.prefix_array(body)
        looked = state.lookup(hashes, engine.session_key(who, body), engine.prefix_ttl_s)
        affinity = await (looked if not tracing.ON else tracing.traced("xroute.state.lookup", looked))
    r = engine.rank(body, who, decision_id, wall, request_json, key, affinity, hashes, waited_ms)
    hold = engine.hold_s(r)
    charge = engine.quota_charge(r) if reserve_quota else None
    fair = (who.tenant, admission_rules.service(body.input_tokens, body.max_output_tokens,
                                                engine.weight_of(who.tenant))) if engine.admission_on else None
    admitting = state.admit(Admission(decision_id, engine.candidates(r), hold,
                                      None if charge is None else QuotaCharge(*charge), r.prefix, fair=fair))
    got = await (admitting if not tracing.ON else tracing.traced("xroute.state.admit", admitting))
    if got.refused is not None:
        assert charge is not None
        raise engine.quota_exceeded(charge[0], got.refused)
    if got.pool is None:
        raise engine.shared_full(r)
    quota = None
    if charge is not None:
        quota = (charge[1], charge[2])
        if state.quota_reader is None:  # (the decisions read a shared view: this process's own since its last read)
            engine.quota_view.add_own(*charge)
    try:
        payload, row, offering_id, pinfo = engine.admit(r, engine.candidate_of(r, got.pool), hold, key, quota)
    except BaseException:
        await undo(engine, state, decision_id, quota is not None, fair)
        raise
    row.trace_id = trace_id_var.get()  # (the caller's or this router's trace: the row joins the trace)
    return Decided(payload, row, offering_id, pinfo, quota, fair)


def route_decision(svc: Services, body: RouteRequest, who: Principal, state: dict[str, Any],
                   idempotency: str | None = None, durable: list[Any] | None = None,
                   reserve_quota: bool = True, left: Callable[[], Awaitable[Any]] | None = None) -> Awaitable[bytes]:
    """:func:`decided_route`, in a span ``xroute.route`` when tracing is on (off: the coroutine itself,
    no frame more)."""
    run = decided_route(svc, body, who, state, idempotency, durable, reserve_quota, left)
    if not tracing.ON:
        return run
    return tracing.traced("xroute.route", run, {"xroute.tenant": who.tenant, "gen_ai.request.model": body.model})  # type: ignore[no-any-return]


async def decided_route(svc: Services, body: RouteRequest, who: Principal, state: dict[str, Any],
                        idempotency: str | None = None, durable: list[Any] | None = None,
                        reserve_quota: bool = True, left: Callable[[], Awaitable[Any]] | None = None) -> bytes:
    """Claim, decide (:func:`decide`), record the decision durably (group commit), then return the
    answer's JSON.

    ``durable`` (a list, without an idempotency key; the gateway's): the decision-log write is not
    awaited but appended to it -- the caller forwards the request while the commit runs and awaits
    it before anything reaches its client, releasing the reservation if it fails.

    With an ``Idempotency-Key`` (``idempotency``), the key is claimed first: a key already
    answered returns that answer's bytes and books nothing (a different body under the same key is
    a 422), a key being decided by another request is a 409. A failure after the admission -- the
    log cannot record (503), an unexpected error, the request cancelled -- gives back the pool and
    the quotas and drops the key, so a retry decides anew. ``state`` gets ``decision_id`` (for the
    access log) and ``quota``: the tokens and USD the tenant's quotas reserved for the decision
    (None: no quota applied). Raises what ``RoutingEngine.rank``, the shared state and the decision
    log raise (``router.http.errors`` renders them). With admission on, a request no pool can serve
    within its TTFT SLO is shed or waits (:func:`placed`); ``left`` returns when its client went away."""
    t0 = time.perf_counter()
    decision_id = "d_" + new_sorted_id()
    state["decision_id"] = decision_id
    shared = svc.state
    key = request_json = digest = None
    if idempotency is not None:
        request_json = body.model_dump_json(exclude_none=True)
        digest = idempotency_digest(request_json)
        key = f"{who.tenant}:route:{idempotency}"
        first = await claim(shared, key, svc.settings.idempotency_ttl_s)
        if first is not None:
            payload = replayed(first, digest)  # (a different body: the 422 names no decision)
            state["decision_id"] = payload[16:50].decode("ascii", "replace")  # '{"decision_id":"d_<32 hex>"'
            return payload
    decided = None
    try:
        decided = await placed(svc, body, who, decision_id, request_json, key, reserve_quota, left)
        state["quota"] = decided.quota  # (what the tenant's quotas reserved: the gateway's feedback settles it)
        svc.metrics.decision_seconds.observe(time.perf_counter() - t0)
        recording = svc.store.record_decision(decided.row)
        if tracing.ON:
            recording = tracing.until("xroute.decision_log.record", recording, {"xroute.decision_id": decision_id})
        if durable is None:
            await recording
        else:
            assert key is None, "a deferred commit cannot complete an idempotency key"
            durable.append(recording)
    except CommitInDoubt:
        assert decided is not None
        if key is not None:  # the key (and the reservation) wait for the log to say whether it committed
            assert digest is not None
            settle_in_doubt(svc, key, decision_id, digest + decided.payload)
        else:
            await give_back(svc, decision_id)
        raise
    except BaseException:
        if decided is not None:
            await give_back(svc, decision_id, decided.quota is not None, decided.fair)
        if key is not None:
            await abandon(shared, key)
        raise
    if key is not None:
        assert digest is not None
        await remember(shared, key, digest + decided.payload, svc.settings.idempotency_ttl_s)
    end_route(svc, decided.offering_id, decided.pinfo, t0)
    return decided.payload


async def placed(svc: Services, body: RouteRequest, who: Principal, decision_id: str, request_json: str | None,
                 key: str | None, reserve_quota: bool, left: Callable[[], Awaitable[Any]] | None) -> Decided:
    """:func:`decide`, through admission when it is on (``router.service.admission_queue``): a request
    no pool is predicted to serve within its TTFT SLO is refused at once (sheddable: 429
    ``slo_unattainable``) or waits in this process's queue and is decided again as capacity frees."""
    engine, shared = svc.engine, svc.state
    arrived = time.monotonic()
    q = svc.admission
    band = engine.band_of(body, who.tenant) if q is not None else ""
    if q is not None and q.ahead(band):  # requests the queue dispatches first wait: it does not overtake them
        slo = float(body.ttft_ms)
        v = admission_rules.verdict(band, float("inf"), slo, 0.0, ahead_waiting=True)
        refusal = engine.unattainable(v, band, float("inf"), slo)
        if v != admission_rules.QUEUE:
            svc.metrics.admission.labels(band, "shed").inc()
            raise refusal
    else:
        try:
            return await decide(engine, shared, body, who, decision_id, time.time(), request_json, key, reserve_quota)
        except RouteFailure as e:
            judged_as = None if q is None else judged(e, band, float(body.ttft_ms), 0.0, engine)
            if judged_as is None:
                raise
            if judged_as.verdict != admission_rules.QUEUE:
                svc.metrics.admission.labels(band, "shed").inc()
                raise judged_as from None
            refusal = judged_as
    assert q is not None

    async def attempt(waited_ms: float) -> Decided:
        return await decide(engine, shared, body, who, decision_id, time.time(), request_json, key, reserve_quota,
                            waited_ms)

    async def back(d: Decided) -> None:
        await give_back(svc, decision_id, d.quota is not None, d.fair)

    service = admission_rules.service(body.input_tokens, body.max_output_tokens, engine.weight_of(who.tenant))
    return await q.wait(q.waiter(band, who.tenant, float(body.ttft_ms), service, refusal, attempt, back, arrived),  # type: ignore[no-any-return]
                        left)


def end_route(svc: Services, offering_id: str, pinfo: dict[str, Any], t0: float) -> None:
    """The metrics of a decision whose row is durable."""
    m = svc.metrics
    m.decided(offering_id, pinfo["kind"], pinfo["reason"])
    m.route_seconds.observe(time.perf_counter() - t0)


async def give_back(svc: Services, decision_id: str, quota: bool = False,
                    fair: tuple[str, float] | None = None) -> None:
    """:func:`undo` with the services' engine and state; the admission queue's next may fit now."""
    await undo(svc.engine, svc.state, decision_id, quota, fair)
    if svc.admission is not None:
        svc.admission.kick()


async def undo(engine: RoutingEngine, state: DecisionState, decision_id: str, quota: bool = False,
               fair: tuple[str, float] | None = None) -> None:
    """Free a decision's reservation -- this process's view and own count, then the shared state
    -- and, with ``quota``, undo its tenant quota reservation (the request was not admitted after
    all). An unreachable state frees them when their hold passes (logged, not raised: the request's
    own error is the one to report)."""
    engine.release_local(decision_id, time.time())
    try:
        await state.settle(Settlement(decision_id, quota=QUOTA_UNDO if quota else None,
                                      fair=None if fair is None else (fair[0], -fair[1])))
    except Exception as e:
        LOG.warning("reservation not given back (it is released when its hold passes)", extra={"fields": {
            "reservation": decision_id, "quota": quota, "error": str(e)}})


# ---------------------------------------------------------------------------------------- commits in doubt
#: the settling tasks (kept referenced until they end)
_settling: set[asyncio.Task[None]] = set()


#: how often a settling task asks the log
SETTLE_EVERY_S = 0.5


def settle_in_doubt(svc: Services, key: str, decision_id: str, stored: bytes | None,
                    found: Callable[[], Awaitable[bytes | None]] | None = None,
                    then: Callable[[], Awaitable[None]] | None = None) -> None:
    """A keyed request whose commit is in doubt (``router.store.sqlite.CommitInDoubt``): its key stays
    pending -- retries get 409, never a second decision -- until the log can be read again, then
    (every ``SETTLE_EVERY_S``) the log says: the row is there -- the key gets the answer the client
    missed (``stored``, or what ``found`` builds from the row) and the work its reservation, and
    ``then`` runs (feedback: the loop closes as if answered) -- or it is not -- the reservation is
    released and the key dropped, so a retry decides anew. Gives up after the key's TTL (it lapses)."""

    async def run() -> None:
        give_up = time.monotonic() + svc.settings.idempotency_ttl_s
        while time.monotonic() < give_up:
            await asyncio.sleep(SETTLE_EVERY_S)
            answer = await _in_log(svc, decision_id, stored, found)
            if isinstance(answer, bool):  # (False: the log cannot tell yet)
                continue
            if answer is not None:
                await remember(svc.state, key, answer, svc.settings.idempotency_ttl_s)
                if then is not None:
                    await then()
            else:
                if found is None:
                    await give_back(svc, decision_id)
                await abandon(svc.state, key)
            LOG.info("commit in doubt settled", extra={"fields": {"decision_id": decision_id,
                                                                  "committed": answer is not None}})
            return

    task = asyncio.get_running_loop().create_task(run(), name=f"settle-{decision_id}")
    _settling.add(task)
    task.add_done_callback(_settling.discard)


async def _in_log(svc: Services, decision_id: str, stored: bytes | None,
                  found: Callable[[], Awaitable[bytes | None]] | None) -> bytes | bool | None:
    """What the log says of a commit in doubt: the answer (it committed), None (it did not), or
    False (it cannot tell yet: ask again)."""
    store = svc.store
    if store.error is not None and not store.closed:  # down: wait for the readiness probe to see
        return False  # it back (not one connection attempt per request in doubt); a closed SQLite log reads
    try:
        if found is None:
            return stored if await store.lookup(decision_id) is not None else None
        return await found()
    except StoreClosed:
        return False
    except Exception as e:  # (logged; asked again)
        LOG.warning("commit in doubt not settled yet", extra={"fields": {"error": str(e)[:300]}})
        return False


# ---------------------------------------------------------------------------------------- idempotency
def idempotency_digest(canonical: str) -> bytes:
    """16 bytes naming a request's content (its canonical JSON): stored before the answer, so a key
    reused with another body is told apart."""
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()


def replayed(stored: bytes, digest: bytes) -> bytes:
    """The first answer under a key (stored as digest + answer), if this request's body is the same."""
    if stored[:16] != digest:
        raise RouteFailure(422, "idempotency_key_reused", "this Idempotency-Key was used with a different request body",
                           [{"field": "header.Idempotency-Key", "message": "already used with a different body",
                             "suggestions": []}])
    return stored[16:]


async def claim(shared: Idempotency, key: str, ttl_s: float) -> bytes | None:
    """Claim ``key``: None when it is this request's now; the stored first answer when one exists;
    a 409 while another request holds it."""
    got = await shared.claim(key, ttl_s)
    if got.status == "pending":
        raise HTTPException(409, "a request with this Idempotency-Key is being processed; retry when it has answered")
    return got.answer if got.status == "done" else None


async def remember(shared: Idempotency, key: str, stored: bytes, ttl_s: float) -> None:
    """Store the answer under ``key``. The answer is durable already: if the state cannot be
    reached, the key stays pending until its TTL (retries get 409, never a second booking)."""
    try:
        await shared.complete(key, stored, ttl_s)
    except Exception as e:
        LOG.warning("idempotency key not stored (its retries get 409 until it expires)",
                    extra={"fields": {"error": str(e)}})


async def abandon(shared: Idempotency, key: str) -> None:
    """Drop a claim whose request failed, so a retry decides anew (an unreachable state lets it expire)."""
    try:
        await shared.abandon(key)
    except Exception as e:
        LOG.warning("idempotency claim not dropped (it expires with its TTL)", extra={"fields": {"error": str(e)}})
