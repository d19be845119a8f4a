"""The route pipeline every entry point shares -- ``POST /v1/route``, the gateway's attempts and the
migrator's placements: claim the idempotency key, look the prefix and session up, rank
(``RoutingEngine.rank``), admit (reserve a pool, the tenant's quotas and the prefix's record in the
shared state), record the decision durably, answer; on any failure give back what was taken.

Contract: a decision is acknowledged only once its row is durable (or, for the gateway, before any
byte reaches its client); a failure after a reservation releases it; a keyed request whose commit
is in doubt keeps its key pending until the log says whether it committed (:func:`settle`)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException

from router.core.logs import LOG, new_sorted_id
from router.decision.engine import RouteFailure
from router.state.base import RouterState
from router.state.embedded import EmbeddedState
from router.state.ledger import QuotaVerdict
from router.store.sqlite import CommitInDoubt, StoreClosed
from xroute.schema.decision import RouteRequest


def end_route(svc: Any, offering_id: str, pinfo: dict[str, Any], t0: float) -> None:
    """The metrics of a decision whose row is durable."""
    m = svc.metrics
    m.decided(offering_id, pinfo["kind"], pinfo["reason"])
    m.route_seconds.observe(time.perf_counter() - t0)


async def route_decision(svc: Any, body: RouteRequest, who: Any, state: Any, idempotency: str | None = None,
                         durable: list[Any] | None = None, reserve_quota: bool = True) -> bytes:
    """Decide, reserve, record the decision durably (group commit), then return the answer's JSON.

    ``durable`` (a list, without an idempotency key; the gateway's): the decision-log write is not
    awaited but appended to it -- the caller forwards the request while the commit runs and awaits
    it before anything reaches its client, releasing the reservation if it fails.

    With an ``Idempotency-Key`` (``idempotency``), the key is claimed first: a key already
    answered returns that answer's bytes and books nothing (a different body under the same key is
    a 422), a key being decided by another request is a 409. The ranked offerings are reserved in
    the shared state (the first with room; none: 429) and the tenant's quotas, with the expected
    cost of the policy's choice (``RouterState.quota_reserve``; over a limit: 429
    ``quota_exceeded``, and the pool's reservation is given back) -- on a shared server in one round
    trip; a failure after that -- the log cannot record (503),
    an unexpected error, the request cancelled -- releases the reservations and the key, so a retry
    decides anew. ``state`` gets ``decision_id`` (for the access log); raises what
    ``RoutingEngine.rank``, the shared state and the decision log raise (``router.http.errors``
    renders them). ``state`` also gets ``quota``: the tokens and USD the tenant's quotas reserved
    for the decision (None: no quota applied).

    ``reserve_quota=False`` (the gateway's retry of a request on another offering): the request
    holds its tenant's quotas already -- its first attempt's reservation counts it, once -- so
    this decision checks and counts nothing in them, and its row records no quota (a rebuild of
    the counters from the log counts the request once)."""
    t0 = time.perf_counter()
    decision_id = "d_" + new_sorted_id()
    state["decision_id"] = decision_id
    shared, engine = svc.state, svc.engine
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
    reserved = False
    quota = None
    try:
        affinity = hashes = None
        if engine.wants_affinity(body):  # the shared prefix index: where these blocks and this session went
            engine.check_prefix(body)
            hashes = engine.prefix_array(body)
            affinity = await state_call(shared, "prefix_lookup", hashes, engine.session_key(who, body),
                                        engine.prefix_ttl_s)
        r = engine.rank(body, who, decision_id, time.time(), request_json, key, affinity, hashes)
        hold = engine.hold_s(r)
        cands = engine.candidates(r)
        # the tenant's quotas, with the expected cost of the policy's choice: checked and counted at
        # once in the shared state -- on a server, in the same round trip as the pool's reservation
        charge = engine.quota_charge(r) if reserve_quota else None
        pool: str | None
        verdict: QuotaVerdict | None = None
        if isinstance(shared, EmbeddedState):  # in process: no await between ranking and admitting
            pool = shared.reserve_now(cands, decision_id, hold)
            if charge is not None and pool is not None:
                verdict = shared.quota_reserve_now(decision_id, charge[0], charge[1], charge[2], hold)
            if pool is not None and r.prefix is not None and (verdict is None or verdict.ok):
                shared.prefix_record_now(decision_id, pool, r.prefix)
        elif charge is None and r.prefix is not None:  # the reservation and the prefix's record in one round trip
            pool = await shared.reserve_recording(cands, decision_id, hold, r.prefix)
        elif charge is None:
            pool = await shared.reserve(cands, decision_id, hold)
        else:
            got_pool, got_quota = await shared.reserve_with_quota(cands, decision_id, hold, *charge)
            if isinstance(got_quota, QuotaVerdict) and got_quota.ok:
                quota = (charge[1], charge[2])  # (given back below if the pool's reservation failed)
            if isinstance(got_pool, str):
                reserved = True
            for e in (got_pool, got_quota):
                if isinstance(e, BaseException):
                    raise e
            assert not isinstance(got_pool, BaseException) and isinstance(got_quota, QuotaVerdict)
            pool, verdict = got_pool, got_quota
            if pool is not None and r.prefix is not None and verdict.ok:  # (the affinity is a hint: best effort)
                await best_effort(shared, "prefix_record", (decision_id, pool, r.prefix), "prefix affinity not "
                                  "recorded", decision=decision_id)
        if pool is None:
            raise engine.shared_full(r)
        reserved = True
        if verdict is not None and charge is not None:
            if not verdict.ok:
                raise engine.quota_exceeded(charge[0], verdict)
            quota = (charge[1], charge[2])
            if not isinstance(shared, EmbeddedState):
                engine.quota_view.add_own(charge[0], charge[1], charge[2])
        k = engine.candidate_of(r, pool)
        state["quota"] = quota  # (what the tenant's quotas reserved: the gateway's feedback settles it)
        payload, row, offering_id, pinfo = engine.admit(r, k, hold, key, quota)
        svc.metrics.decision_seconds.observe(time.perf_counter() - t0)
        if durable is None:
            await svc.store.record_decision(row)
        else:
            assert key is None, "a deferred commit cannot complete an idempotency key"
            durable.append(svc.store.record_decision(row))
    except CommitInDoubt:
        if key is not None:  # the key (and the reservation) wait for the log to say whether it committed
            assert digest is not None
            settle(svc, key, decision_id, digest + payload)
        elif reserved:
            await release(svc, decision_id)
        raise
    except BaseException:
        if reserved:
            await release(svc, decision_id)
        if quota is not None:
            await best_effort(shared, "quota_release", (decision_id,), "quota reservation not released (its "
                              "concurrency slot frees when its hold passes)", reservation=decision_id)
        if key is not None:
            await abandon(shared, key)
        raise
    if key is not None:
        assert digest is not None
        await remember(shared, key, digest + payload, svc.settings.idempotency_ttl_s)
    end_route(svc, offering_id, pinfo, t0)
    return payload


# ---------------------------------------------------------------------------------------- commits in doubt
#: the settling tasks (kept referenced until they end)
_settling: set[asyncio.Task[None]] = set()


#: how often a settling task asks the log
SETTLE_EVERY_S = 0.5


def settle(svc: Any, key: str, decision_id: str, stored: bytes | None,
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
            store = svc.store
            if store.error is not None and not store.closed:  # down: wait for the readiness probe to see
                continue  # it back (not one connection attempt per request in doubt); a closed SQLite log reads
            try:
                if found is None:
                    answer = stored if await svc.store.lookup(decision_id) is not None else None
                else:
                    answer = await found()
            except StoreClosed:
                continue
            except Exception as e:  # (logged; asked again)
                LOG.warning("commit in doubt not settled yet", extra={"fields": {"error": str(e)[:300]}})
                continue
            if answer is not None:
                await remember(svc.state, key, answer, svc.settings.idempotency_ttl_s)
                if then is not None:
                    await then()
            else:
                if found is None:
                    await release(svc, decision_id)
                await abandon(svc.state, key)
            LOG.info("commit in doubt settled", extra={"fields": {"decision_id": decision_id,
                                                                  "committed": answer is not None}})
            return

    task = asyncio.get_running_loop().create_task(run(), name=f"settle-{decision_id}")
    _settling.add(task)
    task.add_done_callback(_settling.discard)


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


async def state_call(shared: RouterState, op: str, *args: Any) -> Any:
    """``shared.<op>(*args)``; the embedded backend's in-process ``<op>_now``, without an await."""
    if isinstance(shared, EmbeddedState):
        return getattr(shared, f"{op}_now")(*args)
    return await getattr(shared, op)(*args)


async def best_effort(shared: RouterState, op: str, args: tuple[Any, ...], failed: str, **fields: Any) -> None:
    """:func:`state_call`, logging (``failed``) instead of raising: for what a request does after
    its outcome is decided (its own error, or its answer, is the one to report)."""
    try:
        await state_call(shared, op, *args)
    except Exception as e:
        LOG.warning(failed, extra={"fields": {**fields, "error": str(e)}})


async def claim(shared: RouterState, key: str, ttl_s: float) -> bytes | None:
    """Claim ``key``: None when it is this request's now; the stored first answer when one exists;
    a 409 while another request holds it."""
    got = await state_call(shared, "claim", key, ttl_s)
    if got.status == "pending":
        raise HTTPException(409, "a request with this Idempotency-Key is being processed; retry when it has answered")
    return got.answer if got.status == "done" else None  # type: ignore[no-any-return]


async def remember(shared: RouterState, key: str, stored: bytes, ttl_s: float) -> None:
    """Store the answer under ``key``. The answer is durable already: if the state cannot be
    reached, the key stays pending until its TTL (retries get 409, never a second booking)."""
    await best_effort(shared, "complete", (key, stored, ttl_s), "idempotency key not stored (its retries get 409 "
                      "until it expires)")


async def abandon(shared: RouterState, key: str) -> None:
    """Drop a claim whose request failed, so a retry decides anew (an unreachable state lets it expire)."""
    await best_effort(shared, "abandon", (key,), "idempotency claim not dropped (it expires with its TTL)")


async def release(svc: Any, reservation_id: str) -> None:
    """Free a reservation: this process's view and own count, then the shared state (an unreachable
    state releases it when its hold passes, counted as expired)."""
    svc.engine.release_local(reservation_id, time.time())
    await best_effort(svc.state, "release", (reservation_id,), "reservation not released (it is released when "
                      "its hold passes)", reservation=reservation_id)
