"""Moving sessions off preempted or degraded pools (``docs/migration.md``).

:class:`Migrator` takes a pool event (``POST /v1/events``; :class:`xroute.schema.migration.PoolEvent`),
stores it (durable before it is acknowledged, idempotent by id), masks the pool for new decisions
until ``migration_mask_s`` after its deadline and, for an interruption, de-prioritizes the pool's
region for ``migration_deprioritize_s`` (``RoutingEngine.events_keep`` / ``events_bias``), then
starts a migration for every session placed on the pool (``MigrationStore.placements``: the later
of the session's last decision and its last committed migration).

Each migration is then driven through the state machine (``xroute.schema.migration.TRANSITIONS``),
every transition a compare-and-set committed before it is acted on or answered:

* ``requested`` -> ``target_chosen``: the live decision path (``router.service.admission.route_decision``)
  re-routes the session's last request under its tenant's constraints, routing policies and quotas,
  with the source and any refused target denied; the decision carries the idempotency key
  ``mig-<migration>-<attempt>``, so a router that crashed after the decision committed and before
  the transition did gets the same decision back (nothing is booked twice);
* ``target_chosen`` -> ``snapshot_announced``: the serving side posts the session's snapshot
  (version, last acknowledged request, SHA-256, URI);
* ``snapshot_announced`` -> ``verified`` -> ``committed``: the target posts the hash it read; a
  mismatch sends the migration back to ``target_chosen`` on another target;
* out of time: past the deadline (plus ``migration_grace_s`` for a snapshot being verified) on a
  pool that goes away, the migration commits to its target with ``recomputed`` (the work restarts
  there); with no target, it is ``aborted``; on a pool that stays (rebalance, degraded), after
  ``migration_timeout_s``, it is ``rolled_back`` (the session stays).

After a restart the loop finds the unfinished migrations in the store and resumes them from the
state they were committed in (or times them out as above): nothing is lost, nothing done twice.
Each round reads only the migrations it has something to do with (``MigrationStore.due_migrations``),
not those waiting for the serving side.

An event's deadline lies within ``migration_max_deadline_s`` of its receipt (else a 422
``deadline_too_far``). :meth:`Migrator.end_event` ends an event early: durable and audited, its
pool unmasked on every router at its next read; its migrations still ``requested`` roll back, those
with a target go on as off a pool that stays (committed when verified, else rolled back after
``migration_timeout_s``: never committed cold). A commit marks the session's entry in the shared
state (``router.decision.engine.migrated_entry``): its next turn goes to the target when it can take it.
:meth:`Migrator.many` does a batch of the serving side's snapshots or verifications at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from typing import Any

import numpy as np
from fastapi import HTTPException

from router.core.logs import LOG
from router.core.text import one_line
from router.decision.engine import RouteFailure, migrated_entry
from router.service.admission import give_back, route_decision
from router.service.ports import Sessions
from router.store.migrations import MIGRATION_KEY_PREFIX, Conflict, MigrationStore, Row
from xroute import migration_rules as rules
from xroute.schema.access import Principal
from xroute.schema.decision import RouteRequest
from xroute.schema.migration import (
    TERMINAL_KINDS,
    EventAccepted,
    EventEnded,
    ItemResult,
    MigrationRecord,
    MigrationState,
    PoolEvent,
    SessionView,
    Snapshot,
    Verification,
)
from xroute.schema.policy_ir import Constraints, Rule

S = MigrationState


async def woken_or_timeout(wake: asyncio.Event, timeout_s: float) -> None:
    """Wait until ``wake`` is set or ``timeout_s`` passes, then clear it (the migration loop's and
    the webhook sender's rhythm: act at once when told, else poll)."""
    try:
        await asyncio.wait_for(wake.wait(), timeout_s)
    except TimeoutError:
        pass
    wake.clear()


def body_digest(body: Any) -> str:
    """The SHA-256 of a JSON body, canonical (sorted keys, no spaces): a duplicate event id is
    told apart from a retry by it."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Migrator:
    """Pool events and the migrations they start, for one router (any number of routers may share
    the store: every transition is a compare-and-set)."""

    CONCURRENT_DECISIONS = 16
    #: a target decision's idempotency key still claimed (409) this long after first seen, with no
    #: decision under it in the log, was claimed by a router that died mid-decision: the next key
    PENDING_GRACE_S = 5.0
    #: a later sweep of an event re-reads this much before the previous one began
    SWEEP_OVERLAP_S = 10.0

    def __init__(self, svc: Any, store: MigrationStore):
        """``svc``: the services (``router.service.services.Services``): a target is decided by
        the live decision path (``router.service.admission.route_decision``), a committed target
        written as the session's entry in the shared state (``router.service.ports.Sessions``)."""
        self.svc, self.store = svc, store
        self.settings = svc.settings
        self.engine = svc.engine
        self._busy: set[str] = set()
        self._swept: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._pending_since: dict[str, float] = {}
        #: when each event's last sweep that completed began (its next reads only what came since)
        self._last_sweep: dict[str, float] = {}
        #: events being swept now: the loop does not start a second sweep of one beside it (a sweep
        #: of 10,000 sessions outlasts the loop's resweep interval; the second would take part of
        #: the first's sessions, and ``POST /v1/events`` would answer fewer migrations than it started)
        self._sweeping: set[str] = set()
        #: the (routing policies, tenants and access) versions whose placements were last checked
        self._rules_checked: tuple[int, int] | None = None
        #: target choices at once (each a decision: a shared state's connections are a pool)
        self._deciding = asyncio.Semaphore(self.CONCURRENT_DECISIONS)
        #: the events still masking or de-prioritizing, as last read (``MigrationStore.events_active``'s rows): what
        #: the masks in force come from (the web console's pools page shows them without a read of its own)
        self.active_events: list[tuple[Any, ...]] = []
        self.counters = {"events": 0, "migrations_started": 0, "committed": 0, "recomputed": 0,
                         "missed_window": 0, "aborted": 0, "rolled_back": 0, "hash_mismatches": 0}

    def _count(self, outcome: str, n: int) -> None:
        if n:
            self.counters[outcome] += n
            metrics = getattr(self.svc, "metrics", None)
            if metrics is not None:
                metrics.migrations.labels(outcome).inc(n)

    # ------------------------------------------------------------------ events and masks
    def offering_index(self, pool: str) -> int | None:
        try:
            return self.engine.offering_ids.index(pool)
        except ValueError:
            return None

    def apply_masks(self, rows: list[tuple[Any, ...]], now: float) -> None:
        """The active events' masks and region biases into the engine (a new array each time:
        decisions read them without a lock). The region bias is the rule the simulator applies too
        (``xroute.migration_rules.region_bias``)."""
        n = self.engine.n
        keep = np.ones(n, dtype=bool)
        depri: list[tuple[str, float]] = []
        for _eid, _kind, pool, region, _deadline, masked_until, depri_until, _at in rows:
            a = self.offering_index(pool)
            if a is not None and masked_until > now:
                keep[a] = False
            if region and depri_until is not None:
                depri.append((region, depri_until))
        bias = rules.region_bias([ref["location"] for ref in self.engine.refs], depri, now,
                                 self.settings.migration_region_penalty)
        self.engine.events_keep = None if keep.all() else keep
        self.engine.events_bias = None if not bias.any() else bias

    async def reload_events(self) -> list[tuple[Any, ...]]:
        now = time.time()
        rows = await asyncio.to_thread(self.store.events_active, now)
        self.apply_masks(rows, now)
        self.active_events = rows
        return rows

    def check_event(self, ev: PoolEvent, now: float) -> None:
        """422 naming the field for an event the router cannot act on (nothing stored)."""
        if self.offering_index(ev.pool) is None:
            import difflib

            close = difflib.get_close_matches(ev.pool, self.engine.offering_ids, n=5, cutoff=0.4)
            raise RouteFailure(422, "unknown_pool", f"unknown pool '{ev.pool}'",
                               [{"field": "body.pool", "message": "not an offering of the served catalog "
                                 "(GET /v1/offerings)", "suggestions": close}])
        if ev.deadline is not None and ev.deadline.timestamp() <= now:
            raise RouteFailure(422, "deadline_passed", f"the event's deadline {ev.deadline.isoformat()} has passed",
                               [{"field": "body.deadline", "message": "is in the past: the pool's instances have "
                                 "stopped already", "suggestions": []}])
        horizon = self.settings.migration_max_deadline_s
        if ev.deadline is not None and ev.deadline.timestamp() > now + horizon:
            raise RouteFailure(422, "deadline_too_far", f"the event's deadline {ev.deadline.isoformat()} is more than "
                               f"{horizon:g} s ahead", [{"field": "body.deadline", "message": f"is more than "
                                                         f"migration_max_deadline_s ({horizon:g} s) ahead: not a "
                                                         "plausible notice (a pool would stay masked until then)",
                                                         "suggestions": []}])

    async def on_event(self, ev: PoolEvent, digest: str, principal: str, body: dict[str, Any]) -> EventAccepted:
        now = time.time()
        if self.offering_index(ev.pool) is None:
            self.check_event(ev, now)
        existing = await asyncio.to_thread(self.store.query, "SELECT body_sha256 FROM pool_events WHERE event_id = ?",
                                           (ev.event_id,))
        if existing and existing[0][0] != digest:
            raise self._reused(ev.event_id)
        if not existing:
            self.check_event(ev, now)
        deadline = ev.deadline.timestamp() if ev.deadline is not None else None
        region = self.engine.refs[self.offering_index(ev.pool) or 0]["location"] if ev.kind == "interruption" else None
        row = {"event_id": ev.event_id, "body_sha256": digest, "kind": ev.kind, "pool": ev.pool, "region": region,
               "received_at": now, "deadline": deadline,
               "masked_until": (deadline or now) + self.settings.migration_mask_s,
               "deprioritize_until": rules.deprioritize_until(now, self.settings.migration_deprioritize_s)
               if region else None,
               "principal": principal, "body": json.dumps(body, sort_keys=True)}
        self._swept.setdefault(ev.event_id, now)  # (this call sweeps it: not the loop meanwhile)
        (sha, masked_until, depri_until, _), inserted = await self.store.submit(self.store.insert_event(row))
        if sha != digest:
            raise self._reused(ev.event_id)
        await self.reload_events()
        made = 0
        if inserted:
            self._count("events", 1)
            made = await self.sweep(ev.event_id, ev.kind, ev.pool, deadline)
            LOG.info("pool event", extra={"fields": {"event_id": ev.event_id, "kind": ev.kind, "pool": ev.pool,
                                                     "migrations": made}})
            self._wake.set()
        return EventAccepted(event_id=ev.event_id, kind=ev.kind, pool=ev.pool, deadline=deadline,
                             duplicate=not inserted, masked_until=masked_until,
                             deprioritized_region=region if depri_until else None, migrations=made)

    async def end_event(self, event_id: str, principal: str, reason: str | None) -> EventEnded:
        """End an event early (``POST /v1/events/{id}/end``): durable and audited before the answer
        (``MigrationStore.end_event``), the pool unmasked here at once and on the other routers at
        their next read of the events (``migration_poll_s``). No migration of it starts after; one
        still ``requested`` rolls back; one with a target goes on -- committed when its target
        verifies, else rolled back after ``migration_timeout_s`` (never committed cold or aborted at
        the deadline: the pool stays). Ending it again answers the same, ``already_ended``."""
        got = await self.store.submit(self.store.end_event(event_id, time.time(), principal, reason))
        if got is None:
            raise RouteFailure(404, "not_found", f"no pool event '{event_id}'",
                               [{"field": "path.event_id", "message": "no event was posted with this id",
                                 "suggestions": []}])
        await self.reload_events()
        if not got["already_ended"]:
            LOG.info("pool event ended", extra={"fields": {"event_id": event_id, "pool": got["pool"],
                                                           "by": principal, "open_migrations": got["open_migrations"]}})
            self._wake.set()
        return EventEnded(**got)

    @staticmethod
    def _reused(event_id: str) -> RouteFailure:
        return RouteFailure(409, "event_id_reused", f"event '{event_id}' was received with another body",
                            [{"field": "body.event_id", "message": "already used with a different body",
                              "suggestions": []}])

    async def sweep(self, event_id: str, kind: str, pool: str, deadline: float | None) -> int:
        """Start a migration for every session placed on ``pool`` that has none for this event and
        none open (idempotent). The first sweep of an event in this process reads the sessions of
        the last ``prefix_ttl_s``; a later one only those routed or moved since the one before
        (less a margin of ``SWEEP_OVERLAP_S`` for commits in flight)."""
        now = time.time()
        last = self._last_sweep.get(event_id)
        self._swept[event_id] = now
        self._sweeping.add(event_id)
        try:
            return await self._sweep(event_id, kind, pool, deadline, now, last)
        finally:
            self._sweeping.discard(event_id)

    async def _sweep(self, event_id: str, kind: str, pool: str, deadline: float | None, now: float,
                     last: float | None) -> int:
        since = now - self.settings.prefix_ttl_s if last is None else max(last - self.SWEEP_OVERLAP_S,
                                                                             now - self.settings.prefix_ttl_s)
        places = await asyncio.to_thread(self.store.placements, since)
        on = [(k, v) for k, v in places.items() if v[0] == pool]
        if not on:
            self._last_sweep[event_id] = now
            return 0
        versions = await asyncio.to_thread(self.store.session_versions, [k for k, _ in on])
        rows = [{"migration_id": "m_" + uuid.uuid4().hex, "tenant": t, "session_id": s, "event_id": event_id,
                 "terminal_kind": kind in TERMINAL_KINDS, "source": pool, "version": versions[(t, s)] + 1,
                 "deadline": deadline, "request_json": req} for (t, s), (_, _, _, req) in on]
        made = await self.store.submit(self.store.create_migrations(rows, now))
        self._last_sweep[event_id] = now
        self._count("migrations_started", len(made))
        return len(made)

    def _rules_version(self) -> tuple[int, int]:
        access = getattr(self.svc, "access", None)
        return int(self.engine.policy_version), int(getattr(access, "version", 0) or 0)

    async def rules_sweep(self) -> int:
        """When the routing policies or the tenants changed (on this router or through another's
        admin API): a migration for every session whose placement its tenant's constraints or a
        policy no longer allow. One per session and version pair (``rules-p<policies>.t<tenants>``,
        the same id on every router: a unique key makes it once); not terminal -- its pool stays,
        so with no target or no snapshot in time it rolls back (the session's next turns obey the
        rules anyway: they are new decisions)."""
        ver = self._rules_version()
        if ver == self._rules_checked:
            return 0
        event_id = f"rules-p{ver[0]}.t{ver[1]}"
        now = time.time()
        places = await asyncio.to_thread(self.store.placements, now - self.settings.prefix_ttl_s)
        out = []
        for n, ((tenant, session), (pool, _at, _v, req)) in enumerate(places.items()):
            a = self.offering_index(pool)
            if a is None or self.masked(pool):  # (a pool event's own sweep moves those)
                continue
            why = self.engine.rule_exclusion(RouteRequest.model_validate_json(req), tenant, now, a)
            if why is not None:
                out.append(((tenant, session), pool, req, why))
            if n % 64 == 63:
                await asyncio.sleep(0)  # (the checks run on the event loop: decisions go on between them)
        made: list[str] = []
        if out:
            versions = await asyncio.to_thread(self.store.session_versions, [k for k, _, _, _ in out])
            rows = [{"migration_id": "m_" + uuid.uuid4().hex, "tenant": t, "session_id": s, "event_id": event_id,
                     "terminal_kind": False, "source": pool, "version": versions[(t, s)] + 1, "deadline": None,
                     "request_json": req} for (t, s), pool, req, _ in out]
            made = await self.store.submit(self.store.create_migrations(rows, now))
            self._count("migrations_started", len(made))
            LOG.info("placements the rules no longer allow", extra={"fields": {
                "event_id": event_id, "sessions": len(out), "migrations": len(made),
                "why": sorted({w for _, _, _, w in out})[:10]}})
        self._rules_checked = ver
        return len(made)

    # ------------------------------------------------------------------ the loop
    async def start(self) -> None:
        """At start: the active events' masks, and a sweep of each (sessions placed on a pool after
        its event, or an event stored by a router that died before its sweep)."""
        for eid, kind, pool, _region, deadline, masked_until, _d, _at in await self.reload_events():
            if masked_until > time.time():
                await self.sweep(eid, kind, pool, deadline)

    async def run(self) -> None:
        poll = self.settings.migration_poll_s
        resweep = max(1.0, 5 * poll)
        while True:
            await woken_or_timeout(self._wake, poll)
            try:
                rows = await self.reload_events()
                now = time.time()
                for eid, kind, pool, _region, deadline, masked_until, _d, _at in rows:
                    if (masked_until > now and now - self._swept.get(eid, 0.0) >= resweep
                            and eid not in self._sweeping):
                        await self.sweep(eid, kind, pool, deadline)
                await self.rules_sweep()
                await self.drive_all()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # (the store down: logged, tried again)
                LOG.warning("migrations not driven", extra={"fields": {"error": str(e)[:300]}})

    async def drive_all(self) -> None:
        keep = self.engine.events_keep
        masked = [] if keep is None else [self.engine.offering_ids[a] for a in np.flatnonzero(~keep).tolist()]
        now = time.time()
        st = self.settings
        rows = await asyncio.to_thread(self.store.due_migrations, now, st.migration_grace_s, st.migration_timeout_s,
                                       masked)
        todo = [r for r in rows if r.id not in self._busy and (
            r.record.state in (S.requested, S.verified) or self._out_of_time(r, now, grace=False)
            or self.masked(r.record.target))]
        if todo:
            await asyncio.gather(*(self.drive(r) for r in todo))

    def masked(self, pool: str | None) -> bool:
        """Whether a pool event masks ``pool`` now."""
        keep = self.engine.events_keep
        a = None if pool is None or keep is None else self.offering_index(pool)
        return a is not None and not bool(keep[a])

    @staticmethod
    def _going(row: Row) -> bool:
        """Whether ``row``'s pool is going away: an event of a terminal kind, not ended since (a
        migration of an ended event is one off a pool that stays: it rolls back rather than
        committing cold or aborting)."""
        return row.terminal_kind and not row.ended

    def _out_of_time(self, row: Row, now: float, grace: bool) -> bool:
        rec = row.record
        if self._going(row) and rec.deadline is not None:  # (the notice window: the simulator's rule too)
            return rules.past_window(now, rec.deadline, self.settings.migration_grace_s if grace else 0.0)
        return rules.past_window(now, rec.created_at, self.settings.migration_timeout_s)

    async def drive(self, row: Row) -> None:
        if row.id in self._busy:
            return
        self._busy.add(row.id)
        try:
            rec, now = row.record, time.time()
            if rec.state == S.requested:
                if row.ended:  # its event was ended before a target was chosen: nothing to move
                    await self._give_up(row, f"its event {rec.event_id} was ended (POST /v1/events/{{id}}/end)")
                elif self._out_of_time(row, now, grace=False):
                    await self._give_up(row, "no target before the deadline")
                else:
                    await self._choose(row)
            elif rec.state in (S.target_chosen, S.snapshot_announced) and self.masked(rec.target) and not (
                    self._out_of_time(row, now, grace=False)):
                await self._retarget(row, f"the target {rec.target} got a pool event")
            elif rec.state == S.target_chosen and self._out_of_time(row, now, grace=False):
                if self._going(row):
                    await self._commit(row, recomputed=True)
                else:
                    await self._give_up(row, "no snapshot within migration_timeout_s")
            elif rec.state == S.snapshot_announced and self._out_of_time(row, now, grace=True):
                if self._going(row):
                    await self._commit(row, recomputed=True)
                else:
                    await self._give_up(row, "snapshot not verified within migration_timeout_s")
            elif rec.state == S.verified:
                await self._commit(row, recomputed=False)
        except Conflict:
            pass  # another router (or request) moved it first: the next round reads it again
        finally:
            self._busy.discard(row.id)

    async def _target(self, row: Row, attempt: int, refused: list[str]) -> tuple[str, str] | RouteFailure:
        """A new target for the session by the live decision path: (offering, decision id), or why not."""
        rec = row.record
        req = RouteRequest.model_validate_json(row.request_json)
        deny = Rule(offering_ids=sorted({rec.source, *refused}))
        cons = req.constraints
        cons = Constraints(deny=[deny]) if cons is None else cons.model_copy(update={"deny": [*cons.deny, deny]})
        body = req.model_copy(update={"constraints": cons, "session_id": rec.session_id})
        who = Principal(tenant=rec.tenant, role="tenant", key_id="migration")
        base = f"{MIGRATION_KEY_PREFIX}{rec.migration_id}-{attempt}"
        k = 0
        while True:
            key = base if k == 0 else f"{base}.{k}"
            try:
                # the log first: a decision under this key committed before a crash (or whose key the shared
                # state lost or never stored) is this attempt's target -- never decided a second time
                got = await asyncio.to_thread(self.store.decision_by_key, f"{rec.tenant}:route:{key}")
                if got is not None:
                    self._pending_since.pop(key, None)
                    return got
                async with self._deciding:
                    payload = await route_decision(self.svc, body, who, {}, key)
            except RouteFailure as e:
                return e
            except HTTPException as e:
                if e.status_code != 409:
                    return RouteFailure(503, "unavailable", str(e.detail)[:300])
                # the key is claimed and nothing is logged under it: a decision in flight on some router, or a
                # router that died holding the claim (on a shared state it outlives the router until its TTL)
                first = self._pending_since.setdefault(key, time.monotonic())
                if time.monotonic() - first < self.PENDING_GRACE_S:
                    return RouteFailure(503, "unavailable", f"target decision {key} pending")
                k += 1
                continue
            except Exception as e:  # (state or log down: tried again next round)
                return RouteFailure(503, "unavailable", one_line(e))
            self._pending_since.pop(key, None)
            break
        ans = json.loads(payload)
        return ans["offering"]["offering_id"], ans["decision_id"]

    async def _choose(self, row: Row) -> None:
        rec = row.record
        got = await self._target(row, row.attempt, rec.tried)
        if isinstance(got, RouteFailure):
            if got.status == 422:  # nothing the tenant may use: no later round changes that
                await self._give_up(row, f"{got.error}: {got.message}")
            return
        target, decision = got
        await self.store.submit(self.store.transition(rec.migration_id, rec.version, S.requested, S.target_chosen,
                                                      time.time(), f"target {target} by {decision}", target=target,
                                                      target_decision=decision))

    async def _retarget(self, row: Row, why: str, final: bool = False) -> None:
        """Refuse the migration's target and choose another (``target_chosen`` again, a new version:
        the snapshot is announced anew). No other target: given up when ``final`` or when nothing the
        tenant may use is left (422), else tried again next round."""
        rec = row.record
        refused = [*rec.tried, rec.target or ""]
        got = await self._target(row, row.attempt + 1, refused)
        if isinstance(got, RouteFailure):
            if final or got.status == 422:
                dst = S.aborted if self._going(row) else S.rolled_back
                text = f"{why}; no other target: {got.error}"
                now = time.time()
                ends = {"reason": text[:300], "tried": refused, "missed_window": self._going(row)}
                await self.store.submit(self.store.transition(rec.migration_id, rec.version, rec.state, dst, now, text,
                                                              notify=self._notice(rec, dst, now, ends), **ends))
                self._ended()
                await self._release(rec.target_decision)
                self._count(dst.value, 1)
            return
        target, decision = got
        await self.store.submit(self.store.transition(
            rec.migration_id, rec.version, rec.state, S.target_chosen, time.time(),
            f"{why}; target {target} by {decision}", target=target, target_decision=decision, tried=refused,
            attempt=row.attempt + 1, sha256=None, uri=None, last_ack_seq=None))
        await self._release(rec.target_decision)

    async def _release(self, decision_id: str | None) -> None:
        if decision_id:
            await give_back(self.svc, decision_id)

    async def _give_up(self, row: Row, why: str) -> None:
        rec = row.record
        dst = S.aborted if self._going(row) else S.rolled_back
        now = time.time()
        ends = {"reason": why[:300], "missed_window": self._going(row)}
        await self.store.submit(self.store.transition(rec.migration_id, rec.version, rec.state, dst, now, why,
                                                      notify=self._notice(rec, dst, now, ends), **ends))
        self._ended()
        await self._release(rec.target_decision)
        self._count(dst.value, 1)

    def _notice(self, rec: MigrationRecord, dst: MigrationState, now: float, ends: dict[str, Any]
                ) -> dict[str, Any] | None:
        """The webhook delivery (``router.service.webhooks``) of ``rec`` ending in ``dst``, written with that
        transition; None when its tenant has no webhook (or no sender runs)."""
        sender = getattr(self.svc, "webhooks", None)
        if sender is None:
            return None
        return sender.notice(rec.model_copy(update={"state": dst, "version": rec.version + 1, "updated_at": now,
                                                    **ends}), now)  # type: ignore[no-any-return]

    def _ended(self) -> None:
        sender = getattr(self.svc, "webhooks", None)
        if sender is not None:
            sender.wake()

    async def _commit(self, row: Row, recomputed: bool, before: Any = None) -> MigrationRecord:
        """Commit ``row``'s migration (from its state); ``before``: a transition into that state to
        write in the same transaction (verify's ``verified``: one commit for both, each still its
        own row and version)."""
        rec = row.record
        now = time.time()
        missed = rec.deadline is not None and now > rec.deadline
        how = "cold: the work restarts at the target" if recomputed else "snapshot verified"
        ends = {"recomputed": recomputed, "missed_window": missed}
        op = self.store.transition(rec.migration_id, rec.version, rec.state, S.committed, now, how,
                                   notify=self._notice(rec, S.committed, now, ends), **ends)
        if before is not None:
            first, then = before, op

            def op(execute: Any) -> Any:
                first(execute)  # (raises Conflict before writing anything when it no longer applies)
                return then(execute)
        v = await self.store.submit(op)
        self._ended()
        self._count("committed", 1)
        self._count("recomputed", int(recomputed))
        self._count("missed_window", int(missed))
        # the session's next turn goes to the new placement (``RoutingEngine.rank`` reads the mark) when
        # it can take it; best effort: without the entry the turn is decided as any other
        if rec.target is not None:
            req = RouteRequest.model_validate_json(row.request_json)
            pool = self.engine.pool_key_of(rec.target, req.model)
            sessions: Sessions = self.svc.state
            try:
                await sessions.put_session(f"{rec.tenant}:{rec.session_id}", migrated_entry(pool),
                                           self.settings.prefix_ttl_s)
            except Exception as e:
                LOG.warning("session placement not updated in the shared state", extra={"fields": {
                    "migration": rec.migration_id, "error": str(e)}})
        return rec.model_copy(update={"state": S.committed, "version": v, "recomputed": recomputed,
                                      "missed_window": missed, "updated_at": now})

    # ------------------------------------------------------------------ the serving side's calls
    async def _get(self, tenant: str | None, session_id: str, migration_id: str,
                   read: dict[str, Row] | None = None) -> Row:
        """The migration, checked to be the session's (404 else); ``read``: rows read already (a batch's)."""
        row = read.get(migration_id) if read is not None else await asyncio.to_thread(self.store.migration,
                                                                                        migration_id)
        if row is None or row.record.session_id != session_id or (tenant is not None and row.record.tenant != tenant):
            raise RouteFailure(404, "not_found", f"no migration '{migration_id}' of session '{session_id}'",
                               [{"field": "body.migration_id", "message": "unknown for this session",
                                 "suggestions": []}])
        return row

    @staticmethod
    def _wrong_state(row: Row, want: MigrationState) -> RouteFailure:
        return RouteFailure(409, "invalid_transition", f"migration {row.id} is {row.record.state.value}, not "
                            f"{want.value}", [{"field": "body.migration_id", "message": f"is "
                                               f"{row.record.state.value}", "suggestions": []}],
                            extra={"migration": row.record.model_dump(mode="json")})

    async def snapshot(self, tenant: str | None, session_id: str, body: Snapshot,
                       read: dict[str, Row] | None = None) -> MigrationRecord:
        row = await self._get(tenant, session_id, body.migration_id, read)
        rec = row.record
        if rec.state != S.target_chosen:
            raise self._wrong_state(row, S.target_chosen)
        if body.version != rec.version:
            raise RouteFailure(409, "stale_version", f"the snapshot's version {body.version} is not the migration's "
                               f"{rec.version}", [{"field": "body.version", "message": f"must be {rec.version}",
                                                   "suggestions": []}])
        now = time.time()
        try:
            v = await self.store.submit(self.store.transition(
                rec.migration_id, rec.version, S.target_chosen, S.snapshot_announced, now, f"snapshot {body.uri}",
                last_ack_seq=body.last_ack_seq, sha256=body.sha256, uri=body.uri))
        except Conflict:
            raise self._wrong_state(await self._get(tenant, session_id, body.migration_id), S.target_chosen) from None
        return rec.model_copy(update={"state": S.snapshot_announced, "version": v, "last_ack_seq": body.last_ack_seq,
                                      "sha256": body.sha256, "uri": body.uri, "updated_at": now})

    async def verify(self, tenant: str | None, session_id: str, body: Verification,
                     read: dict[str, Row] | None = None) -> MigrationRecord:
        row = await self._get(tenant, session_id, body.migration_id, read)
        rec = row.record
        if rec.state != S.snapshot_announced:
            raise self._wrong_state(row, S.snapshot_announced)
        if body.target != rec.target:
            raise RouteFailure(422, "wrong_target", f"the migration's target is {rec.target}",
                               [{"field": "body.target", "message": f"must be {rec.target}", "suggestions": []}])
        if row.id in self._busy:
            raise RouteFailure(409, "conflict", f"migration {row.id} is being moved; retry",
                               headers={"Retry-After": "1"})
        self._busy.add(row.id)
        try:
            if body.sha256 == rec.sha256:
                verified = self.store.transition(rec.migration_id, rec.version, S.snapshot_announced, S.verified,
                                                 time.time(), f"hash verified by {body.target}")
                row.record = rec.model_copy(update={"state": S.verified, "version": rec.version + 1})
                try:  # verified and committed in one transaction (two rows, two versions)
                    return await self._commit(row, recomputed=False, before=verified)
                except Conflict:
                    raise self._wrong_state(await self._get(tenant, session_id, body.migration_id),
                                            S.snapshot_announced) from None
            # a mismatch: this target is refused, another chosen (the snapshot is announced again for it)
            self._count("hash_mismatches", 1)
            try:
                await self._retarget(row, f"hash mismatch at {rec.target}", final=True)
            except Conflict:
                pass
            now_row = await self._get(tenant, session_id, body.migration_id)
            raise RouteFailure(409, "hash_mismatch", "the target read other bytes than the snapshot announced: the "
                               "target is refused and the migration goes on elsewhere",
                               [{"field": "body.sha256", "message": "differs from the announced sha256",
                                 "suggestions": []}], extra={"migration": now_row.record.model_dump(mode="json")})
        finally:
            self._busy.discard(row.id)

    async def many(self, items: list[tuple[str | RouteFailure, Any]], verify: bool) -> list[ItemResult]:
        """A batch of snapshots (or, ``verify``, verifications): each item as its single call
        (``snapshot``, ``verify``), all read in one query and their transitions in the same group
        commits; ``items``: (the session's tenant, or why the caller may not name it; the item)."""
        read = await asyncio.to_thread(self.store.migrations, sorted({it.migration_id for _, it in items}))

        async def one(tenant: str | RouteFailure, it: Any) -> ItemResult:
            try:
                if isinstance(tenant, RouteFailure):
                    raise tenant
                rec = await (self.verify if verify else self.snapshot)(tenant, it.session_id, it, read)
                return ItemResult(session_id=it.session_id, status=200, migration=rec)
            except RouteFailure as e:
                got = e.extra.get("migration")
                return ItemResult(session_id=it.session_id, status=e.status, error=e.error, message=e.message,
                                  fields=e.fields, migration=None if got is None else MigrationRecord(**got))

        return list(await asyncio.gather(*(one(t, it) for t, it in items)))

    async def page(self, event_id: str, after: str, state: MigrationState | None, limit: int
                   ) -> tuple[list[MigrationRecord], str | None]:
        """A page of an event's migrations (``GET /v1/events/{id}/migrations``); 404 for an unknown event."""
        def read() -> tuple[bool, list[Row]]:
            known = bool(self.store.query("SELECT 1 FROM pool_events WHERE event_id = ?", (event_id,)))
            return known, self.store.event_migrations(event_id, after, None if state is None else state.value, limit)

        known, rows = await asyncio.to_thread(read)
        if not known and not rows:
            raise RouteFailure(404, "not_found", f"no pool event '{event_id}'",
                               [{"field": "path.event_id", "message": "no event was posted with this id",
                                 "suggestions": []}])
        return [r.record for r in rows], (rows[-1].id if len(rows) == limit else None)

    # ------------------------------------------------------------------ reads
    async def view(self, tenant: str, session_id: str) -> SessionView | None:
        since = time.time() - self.settings.prefix_ttl_s

        def read() -> tuple[Any, Row | None]:
            places = self.store.placements(since, tenant, session_id, migrations_since=0.0)
            return places.get((tenant, session_id)), self.store.latest_migration(tenant, session_id)

        place, latest = await asyncio.to_thread(read)
        if place is None and latest is None:
            return None
        rec = latest.record if latest is not None else None
        migrating = rec is not None and rec.state not in (S.committed, S.aborted, S.rolled_back)
        placement = place[0] if place is not None else None
        if rec is not None and rec.state == S.aborted and (place is None or place[0] == rec.source):
            placement = None  # its pool went away and no target took it: the client routes it anew
        replay = (rec.last_ack_seq + 1 if rec is not None and rec.state == S.committed and not rec.recomputed
                  and rec.last_ack_seq is not None else None)
        return SessionView(session_id=session_id, tenant=tenant, placement=placement,
                           version=rec.version if rec is not None else 0, migrating=migrating, migration=rec,
                           replay_from=replay)
