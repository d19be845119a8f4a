"""Pool events and session migrations (``router.service.migration``, ``docs/migration.md``):
``POST /v1/events`` and ``POST /v1/events/{event_id}/end`` (admin or events key), ``GET /v1/sessions/{session_id}`` (the session's
tenant; admin or events keys with ``?tenant=``), and the serving side's
``POST /v1/sessions/{session_id}/snapshot`` and ``/verify`` (admin or events key, ``?tenant=``)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Query
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from cloud_adapters.events import NoticeError, parse_notice
from router.decision.access import admin_denied
from router.decision.engine import RouteFailure
from router.http.deps import CallerDep, WriteEvents
from router.http.errors import BODY_NOT_JSON_422
from router.service.migration import Migrator, body_digest
from router.service.services import Services
from router.store.migrations import MigrationStoreError
from xroute.schema.access import admin_resource
from xroute.schema.decision import ErrorResponse
from xroute.schema.migration import (
    ID_PATTERN,
    BatchResults,
    CloudEventEnvelope,
    EventAccepted,
    EventEnd,
    EventEnded,
    MigrationPage,
    MigrationRecord,
    MigrationState,
    PoolEvent,
    SessionView,
    Snapshot,
    SnapshotBatch,
    Verification,
    VerificationBatch,
)

router = APIRouter(prefix="/v1", tags=["migration"])

_AUTH: dict[int | str, dict[str, Any]] = {401: {"model": ErrorResponse, "description": "missing or invalid API key"},
         403: {"model": ErrorResponse, "description": "the key's role may not call this route"},
         413: {"model": ErrorResponse, "description": "request body too large"},
         503: {"model": ErrorResponse, "description": "`unavailable`: the migration log cannot be read or written"}}
_EVENT_ERRORS: dict[int | str, dict[str, Any]] = {
    **_AUTH,
    409: {"model": ErrorResponse, "description": "`event_id_reused`: the event id came before with another body"},
    422: {"model": ErrorResponse, "description": BODY_NOT_JSON_422 + "; a field is invalid (named in `fields`): "
          "`unknown_pool` (close "
          "matches in `suggestions`), `deadline_passed`, `invalid_cloud_event` (the cloud payload's field named), "
          "`location_mismatch` (the payload's region is not the pool's), `deadline_too_far` (more than "
          "`migration_max_deadline_s` ahead); nothing is stored"}}
_SESSION_ERRORS: dict[int | str, dict[str, Any]] = {
    **_AUTH,
    404: {"model": ErrorResponse, "description": "`not_found`: no such session (or migration) for the tenant"},
    409: {"model": ErrorResponse, "description": "`invalid_transition`: the migration is not in the state the call "
          "needs; `stale_version`: the snapshot's version is not the migration's; `hash_mismatch`: the target read "
          "other bytes (the migration goes on to another target, `migration` says which); `conflict`: being moved"},
    422: {"model": ErrorResponse, "description": BODY_NOT_JSON_422 + "; a field is invalid (named in `fields`); "
          "`wrong_target`"}}

_EVENT_BODY = {"required": True, "content": {"application/json": {"schema": {"oneOf": [
    {"$ref": "#/components/schemas/PoolEvent"}, {"$ref": "#/components/schemas/CloudEventEnvelope"}]}}}}


def _migrator(svc: Services) -> Migrator:
    m = svc.migrator
    if m is None:
        raise RouteFailure(503, "unavailable", "migrations are not running on this router", headers={"Retry-After": "5"})
    return m


def _invalid(errors: list[Any], prefix: tuple[str, ...] = ("body",)) -> RequestValidationError:
    return RequestValidationError([{**e, "loc": (*prefix, *e["loc"])} for e in errors])


def parse_event(body: Any, now: datetime) -> PoolEvent:
    """The body as a :class:`PoolEvent`: xroute's own, or a cloud's payload in a
    :class:`CloudEventEnvelope` read by ``cloud_adapters.events`` (422s naming the field)."""
    if not isinstance(body, dict):
        raise RequestValidationError([{"type": "dict_type", "loc": ("body",), "msg": "must be a JSON object",
                                       "input": None}])
    if "cloud" not in body:
        try:
            return PoolEvent.model_validate(body)
        except ValidationError as e:
            raise _invalid(e.errors()) from None
    try:
        env = CloudEventEnvelope.model_validate(body)
    except ValidationError as e:
        raise _invalid(e.errors()) from None
    try:
        notice = parse_notice(env.cloud, now)
    except NoticeError as e:
        field = "body.cloud" + (f".{e.field}" if e.field else "")
        raise RouteFailure(422, "invalid_cloud_event", f"the cloud payload cannot be read: {e}",
                           [{"field": field, "message": e.message, "suggestions": []}]) from None
    try:
        return PoolEvent(event_id=env.event_id or notice.event_id[:128], kind=notice.kind, pool=env.pool,
                         deadline=notice.deadline, issued_at=notice.issued_at, detail=notice.instance)
    except ValidationError as e:
        raise _invalid(e.errors(), ("body", "cloud")) from None


@router.post("/events", response_model=EventAccepted, responses=_EVENT_ERRORS,  # type: ignore[arg-type]
             openapi_extra={"requestBody": _EVENT_BODY}, summary="A pool event: preemption notice, rebalance, "
             "degraded, drained (admin or events key)")
async def post_event(caller: WriteEvents, body: Annotated[Any, Body()]) -> EventAccepted:
    """Store the event (durable before the answer; the same id and body again is answered as the
    first, ``duplicate: true``), mask its pool for new decisions, de-prioritize the region of an
    interruption, and start a migration for every session placed on the pool. Nothing is stored
    for an event that gets a 4xx."""
    svc = caller.svc
    mig = _migrator(svc)
    ev = parse_event(body, datetime.now(UTC))
    if isinstance(body, dict) and "cloud" in body:
        notice_loc = _location(body)
        a = mig.offering_index(ev.pool)
        if a is not None and notice_loc is not None and svc.engine.refs[a]["location"] != notice_loc:
            raise RouteFailure(422, "location_mismatch", f"the cloud payload is from {notice_loc}, the pool "
                               f"'{ev.pool}' is in {svc.engine.refs[a]['location']}",
                               [{"field": "body.pool", "message": f"not in {notice_loc}", "suggestions": []}])
    try:
        return await mig.on_event(ev, body_digest(body), caller.who.key_id, body)
    except MigrationStoreError as e:
        raise RouteFailure(503, "unavailable", f"the migration log cannot record the event ({e})",
                           headers={"Retry-After": "5"}) from None


EventIdPath = Annotated[str, Path(pattern=ID_PATTERN, description="the event's id, as it was posted")]


@router.post("/events/{event_id}/end", response_model=EventEnded, responses={  # type: ignore[arg-type]
    **_AUTH, 404: {"model": ErrorResponse, "description": "`not_found`: no event was posted with this id"},
    422: {"model": ErrorResponse, "description": BODY_NOT_JSON_422 + "; a field is invalid (named in `fields`)"}},
             summary="End a pool event early: its pool unmasked on every router (admin or events key)")
async def end_event(caller: WriteEvents, event_id: EventIdPath,
                    body: Annotated[EventEnd | None, Body()] = None) -> EventEnded:
    """End (withdraw) an event: durable and audited (kind ``pool_event``, action ``end``) before
    the answer; its pool unmasked and its region no longer de-prioritized on this router at once,
    on the others within ``migration_poll_s``. No migration of it starts after; one still choosing
    a target rolls back; one with a target goes on -- committed when its target verifies, else rolled
    back after ``migration_timeout_s`` (never committed cold at the deadline: the pool stays). The
    event stays stored: the same id posted again is a duplicate and masks nothing. Ending it again
    answers the same with ``already_ended: true``."""
    mig = _migrator(caller.svc)
    try:
        return await mig.end_event(event_id, f"key:{caller.who.key_id}", None if body is None else body.reason)
    except MigrationStoreError as e:
        raise RouteFailure(503, "unavailable", f"the migration log cannot record the end ({e})",
                           headers={"Retry-After": "5"}) from None


@router.get("/events/{event_id}/migrations", response_model=MigrationPage, responses={  # type: ignore[arg-type]
    **_AUTH, 404: {"model": ErrorResponse, "description": "`not_found`: no event was posted with this id"},
    422: {"model": ErrorResponse, "description": "a query parameter is invalid (named in `fields`)"}},
            summary="An event's migrations, a page at a time (admin or events key with admin:read:sessions)")
async def event_migrations(caller: WriteEvents, event_id: EventIdPath,
                           state: Annotated[MigrationState | None, Query(description="only those in this state")] = None,
                           after: Annotated[str, Query(max_length=128, description="the page after this migration "
                                                       "id (`next_after`)")] = "",
                           limit: Annotated[int, Query(ge=1, le=1000)] = 1000) -> MigrationPage:
    """What a serving side moving a pool's sessions reads instead of one ``GET /v1/sessions/{id}``
    per session: the event's migrations (every tenant's), by id."""
    _may_read_sessions(caller)  # (every tenant's sessions)
    try:
        got, nxt = await _migrator(caller.svc).page(event_id, after, state, limit)
    except MigrationStoreError as e:
        raise RouteFailure(503, "unavailable", f"the migration log cannot be read ({e})",
                           headers={"Retry-After": "5"}) from None
    return MigrationPage(migrations=got, next_after=nxt)


def _location(body: dict[str, Any]) -> str | None:
    try:
        return parse_notice(body["cloud"]).location
    except NoticeError:
        return None


def _may_read_sessions(caller: Any) -> None:
    """A 403 naming ``admin:read:sessions`` unless the key's roles grant it (admin, events)."""
    who = caller.who
    if not caller.svc.engine.access.permissions(who).allows(admin_resource("read", "sessions")):
        raise RouteFailure(**admin_denied(who, "read", "sessions"))


def _tenant_of(caller: Any, tenant: str | None) -> str:
    """The session's tenant: the key's own, or ``tenant`` for a key whose roles grant
    ``admin:read:sessions`` (admin, events) -- else a 403 naming that permission."""
    who = caller.who
    if tenant is None or tenant == who.tenant:
        return str(who.tenant)
    _may_read_sessions(caller)
    return tenant


SessionId = Annotated[str, Path(pattern=ID_PATTERN, description="the session id the client sent with its requests")]
TenantQ = Annotated[str | None, Query(min_length=1, max_length=64, description="admin and events keys: the "
                                                                                "session's tenant (default: the key's)")]


@router.get("/sessions/{session_id}", response_model=SessionView, responses=_SESSION_ERRORS,  # type: ignore[arg-type]
            summary="Where a session is placed, and its migration")
async def get_session(caller: CallerDep, session_id: SessionId, tenant: TenantQ = None,
                      wait: Annotated[float, Query(ge=0, le=30, description="long-poll: answer when the session's "
                                                   "version differs from `version`, or after this many seconds")] = 0,
                      version: Annotated[int | None, Query(ge=0, le=2**53, description="the version the client "
                                                           "knows (with `wait`)")] = None) -> SessionView:
    """The session's placement (the offering its last request or its last committed migration
    went to), its Lamport version, and its latest migration with its state."""
    mig = _migrator(caller.svc)
    t = _tenant_of(caller, tenant)
    end = time.monotonic() + wait
    while True:
        try:
            view = await mig.view(t, session_id)
        except MigrationStoreError as e:
            raise RouteFailure(503, "unavailable", f"the migration log cannot be read ({e})",
                               headers={"Retry-After": "5"}) from None
        if view is None:
            raise RouteFailure(404, "not_found", f"no session '{session_id}' of tenant '{t}' (sessions are "
                               "forgotten prefix_ttl_s after their last request)")
        if wait <= 0 or version is None or view.version != version or time.monotonic() >= end:
            return view
        await asyncio.sleep(min(0.1, max(0.0, end - time.monotonic())))


@router.post("/sessions/{session_id}/snapshot", response_model=MigrationRecord,  # type: ignore[arg-type]
             responses=_SESSION_ERRORS, summary="The serving side announces a migrating session's snapshot")
async def post_snapshot(caller: WriteEvents, session_id: SessionId, body: Snapshot,
                        tenant: TenantQ = None) -> MigrationRecord:
    """``target_chosen`` -> ``snapshot_announced``, durable before the answer."""
    mig = _migrator(caller.svc)
    try:
        return await mig.snapshot(_tenant_of(caller, tenant), session_id, body)
    except MigrationStoreError as e:
        raise RouteFailure(503, "unavailable", f"the migration log cannot record it ({e})",
                           headers={"Retry-After": "5"}) from None


@router.post("/sessions/{session_id}/verify", response_model=MigrationRecord,  # type: ignore[arg-type]
             responses=_SESSION_ERRORS, summary="The target confirms the snapshot's hash")
async def post_verify(caller: WriteEvents, session_id: SessionId, body: Verification,
                      tenant: TenantQ = None) -> MigrationRecord:
    """The same hash: ``verified`` -> ``committed`` (the session's placement is the target), both
    durable before the answer. Another hash: 409 ``hash_mismatch``; the target is refused and
    another chosen (``target_chosen`` again, a new version: the snapshot is announced anew)."""
    mig = _migrator(caller.svc)
    try:
        return await mig.verify(_tenant_of(caller, tenant), session_id, body)
    except MigrationStoreError as e:
        raise RouteFailure(503, "unavailable", f"the migration log cannot record it ({e})",
                           headers={"Retry-After": "5"}) from None


def _tenants(caller: Any, items: list[Any]) -> list[tuple[str | RouteFailure, Any]]:
    out: list[tuple[str | RouteFailure, Any]] = []
    for it in items:
        try:
            out.append((_tenant_of(caller, it.tenant), it))
        except RouteFailure as e:
            out.append((e, it))
    return out


@router.post("/sessions/snapshots", response_model=BatchResults, responses=_SESSION_ERRORS,  # type: ignore[arg-type]
             summary="The serving side announces many migrating sessions' snapshots at once")
async def post_snapshots(caller: WriteEvents, body: SnapshotBatch) -> BatchResults:
    """Each item as ``POST /v1/sessions/{session_id}/snapshot`` (up to 1,000, read in one query,
    their transitions in the same group commits), each durable before the answer; each item's
    outcome is in ``results`` (its ``status``: what the single call would have answered)."""
    return await _batch(caller, body.items, verify=False)


@router.post("/sessions/verifications", response_model=BatchResults,  # type: ignore[arg-type]
             responses=_SESSION_ERRORS, summary="The targets confirm many snapshots' hashes at once")
async def post_verifications(caller: WriteEvents, body: VerificationBatch) -> BatchResults:
    """Each item as ``POST /v1/sessions/{session_id}/verify`` (up to 1,000, read in one query,
    their transitions in the same group commits), each durable before the answer; each item's
    outcome is in ``results`` (its ``status``: what the single call would have answered)."""
    return await _batch(caller, body.items, verify=True)


async def _batch(caller: Any, items: list[Any], verify: bool) -> BatchResults:
    """A batch of snapshots (``verify`` False) or verifications, each item as its single call would
    be answered; 503 when the migration log cannot record them."""
    try:
        return BatchResults(results=await _migrator(caller.svc).many(_tenants(caller, items), verify=verify))
    except MigrationStoreError as e:
        raise RouteFailure(503, "unavailable", f"the migration log cannot record them ({e})",
                           headers={"Retry-After": "5"}) from None
