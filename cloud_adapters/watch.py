"""Watching an instance's own metadata service for a preemption notice, and telling the router
(``xroute events watch``; ``docs/migration.md``, "Watching the clouds").

A router learns of a notice by ``POST /v1/events``. Where nothing posts the clouds' events to it
(an event-bus rule, a log sink), a small watcher on each spot instance does: it polls the
instance's metadata service, and on a notice posts a pool event for the pool the instance serves
(``--pool``: the offering the deployer put it in) with the notice's deadline. What each cloud's
metadata service says (the recorded answers are in ``tests/fixtures/cloud/metadata/``):

* **AWS** (IMDSv2: a session token from ``PUT /latest/api/token`` first):
  ``GET /latest/meta-data/spot/instance-action`` is 404 until the interruption warning, then
  ``{"action": "terminate"|"stop"|"hibernate", "time": <when, ISO 8601>}``;
  ``/latest/meta-data/events/recommendations/rebalance`` is 404 until a rebalance recommendation,
  then ``{"noticeTime": ...}``; the instance id is ``/latest/meta-data/instance-id``.
* **Azure** (``Metadata: true``): ``GET /metadata/scheduledevents?api-version=2020-07-01``, the
  Scheduled Events document; a ``Preempt`` event's ``NotBefore`` is the deadline
  (``cloud_adapters.events`` reads it).
* **GCP** (``Metadata-Flavor: Google``): ``GET /computeMetadata/v1/instance/preempted`` is ``FALSE``
  until the instance is preempted, then ``TRUE``; the instance then has about 30 s
  (``events.GCP_NOTICE_S``); its name is ``/computeMetadata/v1/instance/name``.

The event id is derived from the instance and the notice (the same on every poll and retry), so the
router's idempotency by event id makes a repeated post harmless; a post is retried with backoff
(``tenacity``) until the router answers, and a 4xx is reported and not retried (the router named
the field at fault). The events key comes from an environment variable, never an option.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from tenacity import retry, retry_if_exception, stop_after_delay, wait_exponential, wait_random

from cloud_adapters.events import AWS_NOTICE_S, GCP_NOTICE_S, NoticeError, parse_notice
from xroute.errors import XrouteError

#: the metadata services' own addresses (each cloud documents its link-local endpoint)
METADATA_URLS = {"aws": "http://169.254.169.254", "azure": "http://169.254.169.254",
                 "gcp": "http://metadata.google.internal"}


class WatchError(XrouteError):
    """The watcher cannot do its job: one readable line (the CLI exits with it)."""


@dataclass(frozen=True)
class Notice:
    """A notice read from the metadata service: what the router's ``PoolEvent`` needs."""

    kind: str  # interruption | rebalance
    instance: str
    deadline: datetime | None
    key: str  # what identifies the notice on this instance (its time), for the event id
    #: the deadline is the time read plus the cloud's grace (GCP says only "preempted"): the notice
    #: is dated by the poll that first saw it (``watch`` keeps that first body)
    derived: bool = False


def _aws(c: httpx.Client, now: datetime) -> Notice | None:
    token = c.put("/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
    token.raise_for_status()
    h = {"X-aws-ec2-metadata-token": token.text}
    instance = c.get("/latest/meta-data/instance-id", headers=h)
    instance.raise_for_status()
    r = c.get("/latest/meta-data/spot/instance-action", headers=h)
    if r.status_code == 200:
        body = r.json()
        if body.get("action") not in ("terminate", "stop", "hibernate"):
            raise WatchError(f"spot/instance-action: unknown action {str(body.get('action'))[:40]!r}")
        try:
            at = datetime.fromisoformat(str(body["time"]).replace("Z", "+00:00"))
        except (KeyError, ValueError):
            raise WatchError(f"spot/instance-action: 'time' is not an ISO 8601 time: "
                             f"{str(body.get('time'))[:40]!r}") from None
        at = at if at.tzinfo else at.replace(tzinfo=UTC)
        return Notice("interruption", instance.text, at, at.isoformat())
    if r.status_code != 404:
        r.raise_for_status()
    r = c.get("/latest/meta-data/events/recommendations/rebalance", headers=h)
    if r.status_code == 200:
        return Notice("rebalance", instance.text, None, str(r.json().get("noticeTime", "")))
    if r.status_code != 404:
        r.raise_for_status()
    return None


def _azure(c: httpx.Client, now: datetime) -> Notice | None:
    r = c.get("/metadata/scheduledevents", params={"api-version": "2020-07-01"}, headers={"Metadata": "true"})
    r.raise_for_status()
    doc = r.json()
    if not any(isinstance(e, dict) and e.get("EventType") == "Preempt" for e in doc.get("Events") or []):
        return None
    try:
        n = parse_notice(doc, now)
    except NoticeError as e:
        raise WatchError(f"scheduled events: {e}") from None
    return Notice("interruption", n.instance or "", n.deadline, n.event_id)


def _gcp(c: httpx.Client, now: datetime) -> Notice | None:
    h = {"Metadata-Flavor": "Google"}
    r = c.get("/computeMetadata/v1/instance/preempted", headers=h)
    r.raise_for_status()
    if r.text.strip().upper() != "TRUE":
        return None
    name = c.get("/computeMetadata/v1/instance/name", headers=h)
    name.raise_for_status()
    return Notice("interruption", name.text.strip(), now + timedelta(seconds=GCP_NOTICE_S), "preempted", derived=True)


READERS: dict[str, Callable[[httpx.Client, datetime], Notice | None]] = {"aws": _aws, "azure": _azure, "gcp": _gcp}


def read_notice(cloud: str, metadata_url: str | None = None, now: datetime | None = None,
                timeout_s: float = 2.0) -> Notice | None:
    """One poll of the instance's metadata service: the notice it holds, or None."""
    if cloud not in READERS:
        raise WatchError(f"--cloud: unknown cloud {cloud!r} (known: {', '.join(sorted(READERS))})")
    url = metadata_url or METADATA_URLS[cloud]
    with httpx.Client(base_url=url, timeout=timeout_s, trust_env=False) as c:
        try:
            return READERS[cloud](c, now or datetime.now(UTC))
        except httpx.HTTPStatusError as e:
            raise WatchError(f"the metadata service at {url} answered {e.response.status_code} for "
                             f"{e.request.url.path}") from None
        except httpx.HTTPError as e:
            raise WatchError(f"the metadata service at {url} cannot be reached ({type(e).__name__})") from None


def event_body(notice: Notice, pool: str, now: datetime) -> dict[str, Any]:
    """The router's ``PoolEvent`` for ``notice`` on ``pool`` read at ``now``: the id is the same for
    every poll of a notice that dates itself (AWS, Azure); one whose deadline is derived (GCP) is
    dated by ``now`` -- ``watch`` builds its body once, at the first poll that saw it (an instance
    preempted again after a restart is another event)."""
    when = now.isoformat() if notice.derived else ""
    digest = hashlib.sha256(f"{pool}|{notice.instance}|{notice.kind}|{notice.key}|{when}".encode()).hexdigest()[:24]
    body: dict[str, Any] = {"event_id": f"watch-{digest}", "kind": notice.kind, "pool": pool}
    if notice.deadline is not None:
        # (a notice read late may carry a deadline already past: the router would refuse it, and
        # the pool is gone; the watcher posts a minimal one second ahead so the sessions still move)
        body["deadline"] = max(notice.deadline, now + timedelta(seconds=1)).isoformat()
    return body


class _Retry(Exception):
    pass


def post_event(router_url: str, key: str, body: dict[str, Any], within_s: float = AWS_NOTICE_S) -> dict[str, Any]:
    """POST ``body`` to the router's ``/v1/events``, retried with backoff (connection errors, 5xx,
    429) for at most ``within_s``; a 4xx other than 429 raises :class:`WatchError` with the
    router's message (the field at fault)."""

    @retry(retry=retry_if_exception(lambda e: isinstance(e, _Retry)), stop=stop_after_delay(within_s),
           wait=wait_exponential(multiplier=0.2, max=5.0) + wait_random(0, 0.2), reraise=True)
    def send() -> dict[str, Any]:
        try:
            r = httpx.post(f"{router_url.rstrip('/')}/v1/events", json=body, timeout=10.0, trust_env=False,
                           headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError as e:
            raise _Retry(f"{type(e).__name__}") from None
        if r.status_code >= 500 or r.status_code == 429:
            raise _Retry(f"HTTP {r.status_code}")
        if r.status_code >= 400:
            try:
                ans = r.json()
            except ValueError:
                ans = {"message": r.text[:200]}
            if r.status_code == 409 and ans.get("error") == "event_id_reused":
                # (the same notice posted by another watcher, dated by its own poll: the router has it)
                return {"event_id": body["event_id"], "duplicate": True, "migrations": 0}
            raise WatchError(f"the router refused the event ({r.status_code}): {ans.get('message', '')}")
        return r.json()  # type: ignore[no-any-return]

    try:
        return send()
    except _Retry as e:
        raise WatchError(f"the router at {router_url} did not take the event within {within_s:g} s ({e})") from None


def watch(cloud: str, pool: str, router_url: str, key: str, every_s: float = 5.0, once: bool = False,
          metadata_url: str | None = None, log: Callable[[str], None] = print,
          stop: Callable[[], bool] = lambda: False) -> int:
    """Poll every ``every_s`` and post each new notice (once per event id); ``once``: one poll.
    Returns the number of events posted."""
    posted: set[str] = set()
    first: dict[tuple[str, str, str], dict[str, Any]] = {}  # a notice's body as first built
    while True:
        now = datetime.now(UTC)
        notice = read_notice(cloud, metadata_url, now)
        if notice is not None:
            body = first.setdefault((notice.instance, notice.kind, notice.key), event_body(notice, pool, now))
            if body["event_id"] not in posted:
                ans = post_event(router_url, key, body)
                posted.add(body["event_id"])
                log(f"{notice.kind} notice for {notice.instance} (deadline {body.get('deadline', 'none')}): "
                    f"event {body['event_id']} posted, {ans.get('migrations', 0)} migrations"
                    + (" (a duplicate: known already)" if ans.get("duplicate") else ""))
        if once or stop():
            return len(posted)
        time.sleep(every_s)
