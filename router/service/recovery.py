"""The shared state and the decision log kept consistent (:class:`SharedStateSync`, on the
``Recovery`` protocol of ``router.service.ports``): a state in this process rebuilt from the log at
start, a Redis state that lost its data restored from every router's log once per epoch; and the
loop that reads the shared view -- in-flight work, durations, quota usage: one ``view`` -- into the
engine (:func:`refresh_shared_view`).

Contract: a reservation, quota booking or idempotency answer the log holds is put back exactly
once per epoch and log; a restore never books what the state already holds (``router.state``)."""

from __future__ import annotations

import asyncio
import hashlib
import math
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

from router.core.logs import LOG, iso
from router.core.settings import RouterSettings
from router.core.text import one_line, redact
from router.decision.engine import RoutingEngine
from router.decision.quotas import quota_events
from router.service.ports import DecisionState, Ejections, LogEvent, Recovery
from router.state.base import StateUnavailable
from router.store.readers import decision_events
from router.store.sqlite import GroupCommitLog
from xroute.schema.quota import DAY_S, day_index


async def logged_answers(store: GroupCommitLog, settings: RouterSettings, now: float,
                          before: float | None = None) -> list[tuple[str, bytes, float]]:
    """The idempotency keys the decision log holds that are still within their TTL at ``now``,
    with their answers -- the same bytes -- and until when (wall clock); ``before``: only those
    answered before that wall time."""
    from router.service.admission import idempotency_digest
    from router.service.outcomes import feedback_answer
    from xroute.schema.decision import FeedbackRequest

    ttl = settings.idempotency_ttl_s
    cut = math.inf if before is None else before
    decisions, feedback = await store.keyed_since(now - ttl)
    answers = [(key, idempotency_digest(request_json) + answer.encode(), created + ttl)
               for key, request_json, answer, created in decisions if created < cut]
    for key, fid, did, at, latency, ttft, cost, out, failed, error in feedback:
        if at >= cut:
            continue
        body = FeedbackRequest(decision_id=did, latency_ms=latency, ttft_ms=ttft, cost_usd=cost, output_tokens=out,
                               failed=bool(failed), error=error)
        answers.append((key, idempotency_digest(body.model_dump_json()) + feedback_answer(fid, did, at), at + ttl))
    return answers


async def logged_quota_events(engine: RoutingEngine, settings: RouterSettings, now: float,
                              before: float | None = None) -> list[Any]:
    """The tenant quota reservations (and settles) of the decision log that still count at
    ``now``: those of the current UTC day, and of the last ``state_hold_max_s`` (a concurrency
    slot or a window may reach back past midnight); none when no tenant has quotas
    (``router.decision.quotas.quota_events``)."""
    plan = engine.quota_plan
    if not plan:
        return []
    since = min(now - settings.state_hold_max_s, day_index(now) * DAY_S)
    target = settings.log_target
    return await asyncio.to_thread(lambda: list(quota_events(
        target, since, lambda tenant, model: [b.key for b in plan.buckets(tenant, model)], before)))


def log_identity(settings: RouterSettings) -> str:
    """Which decision log this router writes, as the shared state's restore claims it: a
    PostgreSQL log by its server and database (every router writing it restores it once), a
    SQLite file by this host and its path (each router its own)."""
    if settings.db_url is not None:
        who = "postgresql:" + redact(settings.db_url.get_secret_value())
    else:
        who = f"sqlite:{socket.gethostname()}:{settings.db_path.resolve()}"
    return hashlib.blake2b(who.encode(), digest_size=8).hexdigest()


class SharedView(DecisionState, Ejections, Protocol):
    """What the shared view's loop reads: the decision path's state and the ejections."""


class SharedStateSync:
    """At start (:meth:`start`), a state in this process (it has no epoch) gets back what the log
    knows: the reservations whose hold has not passed and whose feedback has not come
    (``router.store.readers.decision_events``), the tenant quota counters (``logged_quota_events``),
    and the idempotency keys still within their TTL with their answers, the same bytes.

    On a shared server, it notices a state that lost its data (a new :class:`router.state.base.Epoch`)
    and restores this router's decision log into it (``Recovery.restore``: the reservations made
    before the epoch began whose hold has not passed and whose feedback has not come, the quota
    events, and the idempotency keys within their TTL). Run at start and with every refresh of the
    shared view (``state_view_refresh_s``); a restore that fails is tried again a second later.

    The restore is announced (``Recovery.begin_restore``) before the log is read and this
    router's part is marked done after (``end_restore``): until every router that noticed the
    epoch has put its log back -- and for ``state_restore_window_s`` after the epoch began, in
    which every live router notices -- a keyed request whose key the state lacks is answered 503
    ``state_restoring`` instead of being decided anew, and so is a request that counts against a
    tenant quota (the counters are not whole until then; ``router.state.redis``, "A keyed request
    after a loss"). A router starting on a server whose epoch is that young (a server new to the
    routers looks exactly like one that lost its data) waits the rest of the window before it
    serves (:meth:`settle_start`), so its first requests are not refused."""

    #: after a restore failed (the log unreadable), the next try waits this long (seconds)
    RETRY_S = 1.0

    def __init__(self, state: Recovery, store: GroupCommitLog, settings: RouterSettings,
                 engine: RoutingEngine | None = None):
        self.state, self.store, self.settings, self.engine = state, store, settings, engine
        self.known: str | None = None
        self.log_id = log_identity(settings)
        self._retry_at = 0.0
        self._started: float | None = None  # (the known epoch's start, server wall seconds)

    async def start(self) -> None:
        """Before the first decision: a state in this process rebuilt from the log; a shared one's
        epoch checked (:meth:`check`: restored when new), then :meth:`settle_start`. Raises
        ``StateUnavailable`` when the server does not answer (the shared view's loop tries again)."""
        if await self.state.epoch() is None:
            now = time.time()
            events, answers = await self._logged(now, None)
            counts = await self.state.restore(None, self.log_id, events, answers, now)
            LOG.info("shared state rebuilt from the decision log", extra={"fields": counts})
            return
        await self.check()
        await self.settle_start()

    async def _logged(self, now: float, before: float | None) -> tuple[list[LogEvent], list[tuple[str, bytes, float]]]:
        """What the log holds that a state may lack at ``now``: the events of the decisions of the
        last ``state_hold_max_s`` (and of the quota days) and the idempotency answers within their
        TTL; ``before``: only those made before that wall time (an epoch's start)."""
        target = self.settings.log_target
        events: list[LogEvent] = await asyncio.to_thread(lambda: list(decision_events(
            target, since=now - self.settings.state_hold_max_s, before=before)))
        if self.engine is not None:
            events += await logged_quota_events(self.engine, self.settings, now, before=before)
        return events, await logged_answers(self.store, self.settings, now, before=before)

    async def settle_start(self) -> None:
        """At start, after :meth:`check`: wait until the epoch is older than
        ``state_restore_window_s`` (at most that long), so the first requests are decided."""
        if self._started is not None:
            left = min(self._started + self.settings.state_restore_window_s - time.time(),
                       self.settings.state_restore_window_s)
            if left > 0:
                await asyncio.sleep(left)

    async def check(self) -> None:
        epoch = await self.state.epoch()
        if epoch is None or epoch.id == self.known or time.monotonic() < self._retry_at:
            return
        now = time.time()
        if epoch.started <= now - max(self.settings.state_hold_max_s, self.settings.idempotency_ttl_s):
            # (the usual case at start: a server up for longer than any hold or key lost nothing a
            # log could give back -- skip reading it)
            await self.state.end_restore(epoch, self.log_id, True)
            self.known, self._started = epoch.id, epoch.started
            return
        # announced before the log is read, so no router decides a keyed request anew meanwhile
        await self.state.begin_restore(epoch, self.log_id)
        restored = False
        try:
            events, answers = await self._logged(now, epoch.started)
            counts = await self.state.restore(epoch, self.log_id, events, answers, now)
            restored = True
        except BaseException:
            self._retry_at = time.monotonic() + self.RETRY_S
            raise
        finally:
            try:
                await self.state.end_restore(epoch, self.log_id, restored)
            except StateUnavailable:
                if restored:
                    raise
        self.known, self._started = epoch.id, epoch.started
        if counts is not None:
            LOG.info("shared state restored from the decision log", extra={"fields": {
                **counts, "epoch": epoch.id, "epoch_began": iso(epoch.started)}})


async def refresh_shared_view(engine: RoutingEngine, state: SharedView, every: float,
                               sync: SharedStateSync | None = None,
                               freed: Callable[[], None] | None = None) -> None:
    """Read the shared state's in-flight work and the tenant quotas' usage (every ``every`` s) and
    the observed durations (about once a second) into the engine's view
    (``RoutingEngine.apply_shared_view``, ``QuotaView.apply``), and the outlier ejections into
    ``RoutingEngine.ejection`` (claiming the probes of the half-open targets this process's gateway
    may probe: ``router.decision.ejections``): one ``view`` and one ``ejections`` a tick, one
    pipeline on Redis. While the state
    cannot be read the last view stays (logged once per outage). ``sync``: checked every time
    (:class:`SharedStateSync`: the epoch is one short script), so a state that lost its data is
    noticed within ``every`` -- well inside ``state_restore_window_s``. ``freed``: called when a
    view shows a pool with less in-flight work than the last one read (another router's release, a
    hold that passed): the admission queue's pass (``AdmissionQueue.kick``), so capacity another
    router frees is tried as soon as this process sees it, not at its next re-check."""
    durations: dict[str, float] = {}
    last: dict[str, int] = {}
    tick, down, failing = 0, False, False
    durations_every = max(1, round(1.0 / every))
    while True:
        try:
            if sync is not None:  # (one short script: a loss is noticed within a tick)
                await sync.check()
            quota_keys = engine.quota_plan.keys()  # (the plan changes with the access store: router.control.access_store)
            asked = tick % durations_every == 0
            ej = engine.ejection
            ej.reading()
            # the ejections with the view: one pipeline on Redis (both queued in this iteration)
            view, ejections = await asyncio.gather(state.view(quota_keys, durations=asked),
                                                   state.ejections(ej.probe_targets, ej.lease_s))
            ej.apply(ejections)
            if asked:
                durations = view.durations
            engine.apply_shared_view(view.in_flight, durations)
            if freed is not None and any(view.in_flight.get(pool, 0) < n for pool, n in last.items()):
                freed()
            last = dict(view.in_flight)
            if quota_keys:  # the tenant quotas' usage, for the decisions' budgets (router.decision.quotas.QuotaView)
                engine.quota_view.apply(view.quotas)
            down = failing = False
        except StateUnavailable as e:
            if not down:
                LOG.warning("shared state unreadable; the decisions keep its last view", extra={"fields": {
                    "error": str(e)}})
            down = True
        except Exception as e:  # e.g. the log unreadable during a restore: tried again next time
            if not failing:  # (logged once until a refresh succeeds)
                LOG.warning("shared view not refreshed (or the state not restored); trying again", extra={"fields": {
                    "error": one_line(e)}})
            failing = True
        tick += 1
        await asyncio.sleep(every)
