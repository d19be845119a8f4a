"""The clouds' preemption and rebalance notices, read into xroute's schema
(:class:`xroute.schema.migration.CloudNotice`).

The shapes, as each cloud emits them (recorded examples in ``tests/fixtures/cloud/events/``):

* **AWS**, an EventBridge event from ``aws.ec2``: ``detail-type`` ``"EC2 Spot Instance
  Interruption Warning"`` (``detail.instance-id``, ``detail.instance-action``; the instance stops
  two minutes after ``time``) or ``"EC2 Instance Rebalance Recommendation"`` (no deadline). The
  region is the event's ``region``.
* **Azure**, the Scheduled Events document of the instance metadata service
  (``DocumentIncarnation``, ``Events``): the event whose ``EventType`` is ``"Preempt"``; the
  instance stops at its ``NotBefore`` (an RFC 1123 date, about 30 s ahead). The document names no
  region.
* **GCP**, the Cloud Audit Logs system event of a preemption: ``protoPayload.methodName``
  ``"compute.instances.preempted"``, the zone in ``resource.labels.zone``; the instance gets about
  30 s from the entry's ``timestamp`` (its ACPI soft-off grace).

:func:`parse_notice` tells them apart by their shape (no caller names a provider) and raises
:class:`NoticeError` naming the field of a payload it cannot read.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

from xroute.schema.migration import CloudNotice

#: the notice each cloud gives before a spot/preemptible instance stops (seconds)
AWS_NOTICE_S = 120.0
GCP_NOTICE_S = 30.0
#: Azure's Scheduled Events post a ``Preempt`` event with a ``NotBefore`` at least 30 s ahead (the
#: document itself carries the deadline; this is what a bundle records for an Azure spot offering)
AZURE_NOTICE_S = 30.0
#: per provider id, the notice its spot offerings get (``offerings.notice_s`` of a bundle; the bundle
#: builder writes it from here: the environment never names a provider)
SPOT_NOTICE_S: dict[str, float] = {"aws": AWS_NOTICE_S, "azure": AZURE_NOTICE_S, "gcp": GCP_NOTICE_S}


def spot_notice_s(provider: str) -> float | None:
    """The notice (seconds) a spot instance of ``provider`` gets before it stops; None for a
    provider this module does not know."""
    return SPOT_NOTICE_S.get(provider)

AWS_SPOT = "EC2 Spot Instance Interruption Warning"
AWS_REBALANCE = "EC2 Instance Rebalance Recommendation"
GCP_PREEMPTED = "compute.instances.preempted"


class NoticeError(ValueError):
    """A payload that is not a notice this module reads: ``field`` (a dotted path under the
    payload) and what is wrong with it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def _get(obj: Any, path: str) -> Any:
    cur = obj
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise NoticeError(path, "missing")
        cur = cur[part]
    return cur


def _text(obj: Any, path: str) -> str:
    v = _get(obj, path)
    if not isinstance(v, str) or not v.strip():
        raise NoticeError(path, "must be a non-empty string")
    return v


def _iso(obj: Any, path: str) -> datetime:
    raw = _text(obj, path)
    try:
        t = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise NoticeError(path, f"not an ISO 8601 time: {raw[:40]!r}") from None
    if t.tzinfo is None:
        raise NoticeError(path, "has no time zone")
    return t


def _aws(p: dict[str, Any]) -> CloudNotice:
    kind_text = _text(p, "detail-type")
    if kind_text not in (AWS_SPOT, AWS_REBALANCE):
        raise NoticeError("detail-type", f"not a spot interruption warning or rebalance recommendation: {kind_text[:80]!r}")
    if _text(p, "source") != "aws.ec2":
        raise NoticeError("source", "must be 'aws.ec2'")
    at = _iso(p, "time")
    instance = _text(p, "detail.instance-id")
    if kind_text == AWS_SPOT:
        action = _text(p, "detail.instance-action")
        if action not in ("terminate", "stop", "hibernate"):
            raise NoticeError("detail.instance-action", "must be terminate, stop or hibernate")
    return CloudNotice(event_id=_text(p, "id"), kind="interruption" if kind_text == AWS_SPOT else "rebalance",
                       location=f"aws:{_text(p, 'region')}", instance=instance, issued_at=at,
                       deadline=at + timedelta(seconds=AWS_NOTICE_S) if kind_text == AWS_SPOT else None)


def _azure(p: dict[str, Any], now: datetime) -> CloudNotice:
    events = p["Events"]
    if not isinstance(events, list):
        raise NoticeError("Events", "must be a list")
    preempts = [(i, e) for i, e in enumerate(events) if isinstance(e, dict) and e.get("EventType") == "Preempt"]
    if len(preempts) != 1:
        raise NoticeError("Events", f"must hold exactly one event of EventType 'Preempt' (holds {len(preempts)})")
    i, e = preempts[0]
    base = f"Events.{i}"
    eid = e.get("EventId")
    if not isinstance(eid, str) or not eid:
        raise NoticeError(f"{base}.EventId", "must be a non-empty string")
    res = e.get("Resources")
    if not isinstance(res, list) or not res or not all(isinstance(r, str) for r in res):
        raise NoticeError(f"{base}.Resources", "must be a non-empty list of instance names")
    nb = e.get("NotBefore")
    if not isinstance(nb, str) or not nb:
        raise NoticeError(f"{base}.NotBefore", "must be an RFC 1123 date")
    try:
        deadline = parsedate_to_datetime(nb)
    except (TypeError, ValueError):
        raise NoticeError(f"{base}.NotBefore", f"not an RFC 1123 date: {nb[:40]!r}") from None
    if deadline.tzinfo is None:
        deadline = deadline.replace(tzinfo=UTC)
    return CloudNotice(event_id=eid, kind="interruption", location=None, instance=res[0], issued_at=now,
                       deadline=deadline)


def _gcp(p: dict[str, Any]) -> CloudNotice:
    if _text(p, "protoPayload.methodName") != GCP_PREEMPTED:
        raise NoticeError("protoPayload.methodName", f"must be '{GCP_PREEMPTED}'")
    zone = _text(p, "resource.labels.zone")
    region = zone.rsplit("-", 1)[0] if zone.count("-") >= 2 else zone
    at = _iso(p, "timestamp")
    instance = _text(p, "protoPayload.resourceName").rsplit("/", 1)[-1]
    return CloudNotice(event_id=_text(p, "insertId"), kind="interruption", location=f"gcp:{region}",
                       instance=instance, issued_at=at, deadline=at + timedelta(seconds=GCP_NOTICE_S))


def parse_notice(payload: Any, now: datetime | None = None) -> CloudNotice:
    """The notice in ``payload`` (a cloud's event as it emitted it); ``now``: when it was received
    (a payload without its own issue time)."""
    now = now or datetime.now(UTC)
    if not isinstance(payload, dict):
        raise NoticeError("", "must be a JSON object")
    if "detail-type" in payload:
        return _aws(payload)
    if "Events" in payload and "DocumentIncarnation" in payload:
        return _azure(payload, now)
    if "protoPayload" in payload:
        return _gcp(payload)
    raise NoticeError("", "not a known cloud notice (an event bus 'detail-type', a Scheduled Events document, "
                          "or an audit log 'protoPayload')")
