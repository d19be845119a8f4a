"""Pool events and session migrations -- defined here only (``docs/migration.md``).

A **pool event** says that a pool (an offering: provider x region x instance type x pricing mode)
is going away or getting worse:

* ``interruption`` -- a spot interruption notice: the pool's instances stop at ``deadline``;
* ``rebalance`` -- a rebalance recommendation: an elevated risk of interruption, no deadline;
* ``degraded`` -- the pool still serves, worse (errors, slowness); no deadline;
* ``drained`` -- the pool is being emptied by its operator (``deadline``: when it must be empty,
  optional).

:class:`PoolEvent` is xroute's own form. The clouds' own shapes (a spot interruption warning or a
rebalance recommendation from an event bus, a scheduled ``Preempt`` event from an instance metadata
service, a preemption entry from an audit log) are parsed into it by ``cloud_adapters.events``;
they arrive wrapped in a :class:`CloudEventEnvelope` naming the pool the instance belonged to.

A **migration** moves one session's running work and placement off the pool: the state machine
:data:`TRANSITIONS` (``requested`` -> ``target_chosen`` -> ``snapshot_announced`` -> ``verified``
-> ``committed``, or ``aborted`` / ``rolled_back``), each transition durable before it is
acknowledged. The serving side announces the session's state as a :class:`Snapshot` (the session
id, a Lamport ``version``, the last acknowledged request sequence, the payload's SHA-256 and the
URI it put it at); the target confirms the hash (:class:`Verification`).
"""

from __future__ import annotations

import itertools
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator

#: the kinds of pool events
EventKind = Literal["interruption", "rebalance", "degraded", "drained"]
#: kinds after which the pool's running work is lost (at the deadline): a migration that cannot
#: finish in time restarts the work on its target from scratch instead of rolling back
TERMINAL_KINDS: frozenset[str] = frozenset({"interruption", "drained"})
#: an id as the API takes it (event ids, session ids): 1-128 visible ASCII characters
ID_PATTERN = r"^[\x21-\x7e]{1,128}$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"


def _event_json_schema(schema: dict[str, Any]) -> None:
    """The deadline rule (below) in the published schema too, so a client (or a fuzzer) sees it."""
    schema["allOf"] = [
        {"if": {"properties": {"kind": {"const": "interruption"}}, "required": ["kind"]},
         "then": {"required": ["deadline"], "properties": {"deadline": {"type": "string", "format": "date-time"}}}},
        {"if": {"properties": {"kind": {"enum": ["rebalance", "degraded"]}}, "required": ["kind"]},
         "then": {"properties": {"deadline": {"type": "null"}}}},
    ]


class PoolEvent(BaseModel):
    """One event about one pool, in xroute's own schema."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_event_json_schema)

    event_id: str = Field(pattern=ID_PATTERN, description="unique id; a second POST with the same id and body is "
                                                          "answered as the first, with another body it is a 409")
    kind: EventKind = Field(description="interruption | rebalance | degraded | drained")
    pool: str = Field(min_length=1, max_length=256, description="the offering id of the pool (GET /v1/offerings)")
    deadline: AwareDatetime | None = Field(None, description="when the pool's instances stop (required for an "
                                                             "interruption; optional for drained; none otherwise)")
    issued_at: AwareDatetime | None = Field(None, description="when the cloud issued the notice (default: received)")
    detail: str | None = Field(None, max_length=500, description="free text kept with the event")

    @model_validator(mode="after")
    def _deadline(self) -> PoolEvent:
        if self.kind == "interruption" and self.deadline is None:
            raise ValueError("deadline: an interruption needs its deadline")
        if self.kind in ("rebalance", "degraded") and self.deadline is not None:
            raise ValueError(f"deadline: a {self.kind} event has no deadline")
        return self


class CloudEventEnvelope(BaseModel):
    """A cloud's own event payload (``cloud``), and the pool whose instance it names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: str = Field(min_length=1, max_length=256, description="the offering id of the pool the instance is in")
    cloud: dict[str, Any] = Field(description="the payload as the cloud emitted it (event bus event, scheduled "
                                              "events document, audit log entry); docs/migration.md lists them")
    event_id: str | None = Field(None, pattern=ID_PATTERN, description="default: the payload's own id")


class CloudNotice(BaseModel):
    """What ``cloud_adapters.events`` reads from a cloud's payload: provider-neutral."""

    model_config = ConfigDict(frozen=True)

    event_id: str
    kind: EventKind
    location: str | None = Field(None, description="'<provider>:<region>' when the payload names it")
    instance: str | None = None
    issued_at: datetime
    deadline: datetime | None = None


class MigrationState(StrEnum):
    requested = "requested"
    target_chosen = "target_chosen"
    snapshot_announced = "snapshot_announced"
    verified = "verified"
    committed = "committed"
    aborted = "aborted"
    rolled_back = "rolled_back"


S = MigrationState
#: the states a migration ends in
TERMINAL: frozenset[MigrationState] = frozenset({S.committed, S.aborted, S.rolled_back})
#: every allowed transition. ``target_chosen -> target_chosen`` and ``snapshot_announced ->
#: target_chosen``: the target refused (a hash mismatch, or its own pool got an event) and another
#: is chosen; ``target_chosen -> committed``: the notice window ran out before a snapshot was
#: verified on a pool that is going away -- the work restarts at the target (``recomputed``)
TRANSITIONS: dict[MigrationState, frozenset[MigrationState]] = {
    S.requested: frozenset({S.target_chosen, S.aborted, S.rolled_back}),
    S.target_chosen: frozenset({S.snapshot_announced, S.target_chosen, S.committed, S.aborted, S.rolled_back}),
    S.snapshot_announced: frozenset({S.verified, S.target_chosen, S.committed, S.aborted, S.rolled_back}),
    S.verified: frozenset({S.committed}),
    S.committed: frozenset(),
    S.aborted: frozenset(),
    S.rolled_back: frozenset(),
}


def allowed(src: MigrationState | str, dst: MigrationState | str) -> bool:
    return MigrationState(dst) in TRANSITIONS[MigrationState(src)]


def valid_path(states: list[str]) -> bool:
    """Whether ``states`` (a migration's transitions in order) is a path of the machine from
    ``requested``."""
    if not states or states[0] != S.requested:
        return False
    return all(allowed(a, b) for a, b in itertools.pairwise(states))


class Snapshot(BaseModel):
    """The serving side's announcement of a session's state, put at ``uri``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    migration_id: str = Field(pattern=ID_PATTERN, description="the migration (GET /v1/sessions/{id})")
    version: int = Field(ge=0, le=2**53, description="the session's Lamport version the snapshot was taken at: the "
                                                     "migration's version (a stale one is a 409)")
    last_ack_seq: int = Field(ge=0, le=2**53, description="the last request sequence number the client was answered "
                                                          "for; later ones are replayed at the target, once")
    sha256: str = Field(pattern=SHA256_PATTERN, description="SHA-256 of the snapshot's bytes, lowercase hex")
    uri: str = Field(min_length=3, max_length=2048, pattern=r"^[a-z][a-z0-9+.-]*://[!-~]+$",
                     description="where the serving side put the state (s3://, gs://, https://, file://, ...)")


class Verification(BaseModel):
    """The target's check of the snapshot it fetched."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    migration_id: str = Field(pattern=ID_PATTERN)
    target: str = Field(min_length=1, max_length=256, description="the offering id verifying: the migration's target")
    sha256: str = Field(pattern=SHA256_PATTERN, description="SHA-256 of the bytes the target read at the URI")


class MigrationRecord(BaseModel):
    """One migration as the router stores and answers it."""

    migration_id: str
    tenant: str
    session_id: str
    event_id: str
    source: str = Field(description="the offering the session was on")
    target: str | None = Field(None, description="the offering chosen (None before one is)")
    target_decision: str | None = Field(None, description="the decision that reserved the target")
    state: MigrationState
    version: int = Field(description="the session's Lamport version: raised by every transition")
    last_ack_seq: int | None = None
    sha256: str | None = None
    uri: str | None = None
    tried: list[str] = Field(default_factory=list, description="targets refused so far (hash mismatch, pool event)")
    deadline: float | None = Field(None, description="when the source stops (epoch seconds), if it does")
    recomputed: bool = Field(False, description="committed without a verified snapshot: the work restarts")
    missed_window: bool = Field(False, description="not committed by the deadline")
    reason: str | None = None
    created_at: float
    updated_at: float


class SessionView(BaseModel):
    """``GET /v1/sessions/{id}``: where a session is and its migration, if any."""

    session_id: str
    tenant: str
    placement: str | None = Field(description="the offering the session is on (None: unknown or lost)")
    version: int = Field(description="the placement's Lamport version")
    migrating: bool
    migration: MigrationRecord | None = Field(None, description="the latest migration of the session")
    replay_from: int | None = Field(None, description="after a committed migration with a snapshot: the first "
                                                      "request sequence to replay at the new placement")


class EventAccepted(BaseModel):
    """``POST /v1/events``' answer."""

    event_id: str
    kind: EventKind
    pool: str
    deadline: float | None
    duplicate: bool = Field(description="the same event was received before: nothing new was done")
    masked_until: float
    deprioritized_region: str | None
    migrations: int = Field(description="migrations the event started")


#: the most items one batch of snapshots or verifications may carry
BATCH_MAX = 1000


class SnapshotItem(Snapshot):
    """One session's snapshot in a batch (``POST /v1/sessions/snapshots``)."""

    session_id: str = Field(pattern=ID_PATTERN)
    tenant: str | None = Field(None, min_length=1, max_length=64, description="the session's tenant (default: the "
                                                                             "key's; another needs admin:read:sessions)")


class VerificationItem(Verification):
    """One session's verification in a batch (``POST /v1/sessions/verifications``)."""

    session_id: str = Field(pattern=ID_PATTERN)
    tenant: str | None = Field(None, min_length=1, max_length=64, description="the session's tenant (default: the "
                                                                             "key's; another needs admin:read:sessions)")


class SnapshotBatch(BaseModel):
    """Many sessions' snapshots at once: a serving side moving a whole pool's sessions off one notice."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    items: list[SnapshotItem] = Field(min_length=1, max_length=BATCH_MAX)


class VerificationBatch(BaseModel):
    """Many sessions' verifications at once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    items: list[VerificationItem] = Field(min_length=1, max_length=BATCH_MAX)


class ItemResult(BaseModel):
    """One item's outcome in a batch: ``status`` is what the single call would have answered, with
    the migration as it is now (200, or a 409 that carries it) or the error (``error``,
    ``message``, ``fields``: the single call's error body)."""

    session_id: str
    status: int
    migration: MigrationRecord | None = None
    error: str | None = None
    message: str | None = None
    fields: list[dict[str, Any]] = Field(default_factory=list)


class BatchResults(BaseModel):
    """A batch's answer: one result per item, in the items' order (each durable before the answer)."""

    results: list[ItemResult]


class MigrationPage(BaseModel):
    """``GET /v1/events/{event_id}/migrations``: a page of the event's migrations, by id."""

    migrations: list[MigrationRecord]
    next_after: str | None = Field(description="pass as `after` for the next page (None: no more)")


class EventEnd(BaseModel):
    """``POST /v1/events/{event_id}/end``'s body (optional): why the event is ended early."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str | None = Field(None, max_length=500, description="kept with the event and in the audit log")


class EventEnded(BaseModel):
    """``POST /v1/events/{event_id}/end``'s answer: the event as ended (now, or before)."""

    event_id: str
    kind: EventKind
    pool: str
    ended_at: float = Field(description="when it was ended (epoch seconds)")
    ended_by: str = Field(description="who ended it (key:<key id>)")
    reason: str | None
    already_ended: bool = Field(description="it was ended before: nothing new was done")
    masked_until: float = Field(description="the pool's mask ends here (the end, or earlier if it had lapsed)")
    open_migrations: int = Field(description="its migrations not ended yet: those with a target go on to their end "
                                             "(committed when verified, else rolled back), the others roll back")


# ---------------------------------------------------------------------------------------- webhooks
#: the header carrying a webhook's signature: ``t=<unix seconds>,v1=<hex HMAC-SHA256>``
SIGNATURE_HEADER = "X-Xroute-Signature"
#: the header naming a delivery (the same on every retry of it: a receiver deduplicates by it)
DELIVERY_HEADER = "X-Xroute-Delivery"


class MigrationNotice(BaseModel):
    """The body of a webhook a tenant registers (``tenants.<t>.webhook``): a migration of one of
    its sessions ended, and where the session is now. Delivered at least once (``delivery_id``
    is the same on every attempt), signed with the tenant's secret (:func:`sign_webhook`)."""

    type: Literal["session.migration.committed", "session.migration.aborted", "session.migration.rolled_back"]
    delivery_id: str
    at: float = Field(description="when the migration ended (epoch seconds)")
    session: SessionView


def sign_webhook(secret: bytes, body: bytes, at: int) -> str:
    """The :data:`SIGNATURE_HEADER` value for ``body`` sent at ``at`` (unix seconds): the HMAC-SHA256
    of ``b"<at>." + body`` under ``secret``, as ``t=<at>,v1=<hex>``."""
    import hashlib
    import hmac

    mac = hmac.new(secret, str(int(at)).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={int(at)},v1={mac}"


def verify_webhook(secret: bytes, body: bytes, header: str, now: float, tolerance_s: float = 300.0) -> bool:
    """What a receiver runs on a webhook: whether ``header`` (the :data:`SIGNATURE_HEADER` value) signs
    ``body`` under ``secret`` and was made within ``tolerance_s`` of ``now`` (a replayed old
    request fails). Constant-time comparison."""
    import hmac

    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        at = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs(now - at) > tolerance_s or "v1" not in parts:
        return False
    return hmac.compare_digest(sign_webhook(secret, body, at), f"t={at},v1={parts['v1']}")
