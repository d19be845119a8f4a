"""The pool events and the migrations, on the decision log's backend (the same SQLite file; the
same PostgreSQL database for many routers): tables ``pool_events``, ``migrations`` and
``migration_transitions`` (``docs/migration.md``).

Durable before acknowledged: every write goes through :meth:`MigrationStore.submit`, which groups
the writes of one event-loop iteration into one transaction (one fsync; SQLite ``synchronous=FULL``,
PostgreSQL's synchronous commit), committed in a thread, and resolves each write's future only once
that transaction has committed. A transition is a compare-and-set on the migration's ``version``
(``UPDATE ... WHERE migration_id = ? AND version = ?``) with its row in ``migration_transitions``
(primary key ``(migration_id, version)``) in the same transaction: two routers -- or a router and
its own restarted self -- cannot both move one migration from one state, and the transitions table
is the migration's history, each step once.

The decision log's own rows say where each session went (``decisions.session_id``,
``offering_id``); this module adds two partial indexes to that table -- ``decisions_session`` (rows
with a session) to find the sessions on a pool and a session's placement, ``decisions_key`` (rows
with an idempotency key) to find a migration's target decision by its key after a crash -- which
cost the decisions that have a session or a key one more index entry each.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.store import audit
from router.store.dialect import Database
from xroute.schema.migration import TERMINAL, MigrationRecord, MigrationState, allowed

_TABLES = """
CREATE TABLE IF NOT EXISTS pool_events (
    event_id TEXT PRIMARY KEY,
    body_sha256 TEXT NOT NULL,
    kind TEXT NOT NULL,
    pool TEXT NOT NULL,
    region TEXT,
    received_at {real} NOT NULL,
    deadline {real},
    masked_until {real} NOT NULL,
    deprioritize_until {real},
    principal TEXT NOT NULL,
    body TEXT NOT NULL,
    ended_at {real},
    ended_by TEXT,
    end_reason TEXT
);
CREATE TABLE IF NOT EXISTS migrations (
    migration_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    terminal_kind INTEGER NOT NULL,
    source TEXT NOT NULL,
    target TEXT,
    target_decision TEXT,
    state TEXT NOT NULL,
    version {bigint} NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    last_ack_seq {bigint},
    sha256 TEXT,
    uri TEXT,
    tried TEXT NOT NULL DEFAULT '[]',
    deadline {real},
    recomputed INTEGER NOT NULL DEFAULT 0,
    missed_window INTEGER NOT NULL DEFAULT 0,
    reason TEXT,
    request_json TEXT NOT NULL,
    created_at {real} NOT NULL,
    updated_at {real} NOT NULL,
    UNIQUE (tenant, session_id, event_id)
);
CREATE UNIQUE INDEX IF NOT EXISTS migrations_open ON migrations (tenant, session_id)
    WHERE state NOT IN ('committed', 'aborted', 'rolled_back');
CREATE INDEX IF NOT EXISTS migrations_state ON migrations (state);
CREATE INDEX IF NOT EXISTS migrations_session ON migrations (tenant, session_id, updated_at);
CREATE INDEX IF NOT EXISTS migrations_event ON migrations (event_id, migration_id);
CREATE TABLE IF NOT EXISTS migration_transitions (
    migration_id TEXT NOT NULL,
    version {bigint} NOT NULL,
    state TEXT NOT NULL,
    at {real} NOT NULL,
    detail TEXT,
    PRIMARY KEY (migration_id, version)
);
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    delivery_id TEXT PRIMARY KEY,
    migration_id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    body TEXT NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at {real} NOT NULL,
    claimed_until {real},
    last_status INTEGER,
    last_error TEXT,
    created_at {real} NOT NULL,
    updated_at {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS webhooks_due ON webhook_deliveries (next_at) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS decisions_session ON decisions (tenant, session_id, created_at)
    WHERE session_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS decisions_key ON decisions (idempotency_key) WHERE idempotency_key IS NOT NULL;
"""
#: columns added since the tables were first created: per table, (name, SQLite type)
_ADDED = (("pool_events", (("ended_at", "REAL"), ("ended_by", "TEXT"), ("end_reason", "TEXT"))),)
_PG_LOCK = 0x78726F756D67  # "xroumg": the schema's creation across routers
#: an idempotency key of a migration's target decision (``decisions.idempotency_key`` holds
#: ``<tenant>:route:<key>``): such decisions are not a session's placement until committed
MIGRATION_KEY_PREFIX = "mig-"

_COLUMNS = ("migration_id", "tenant", "session_id", "event_id", "terminal_kind", "source", "target",
            "target_decision", "state", "version", "attempt", "last_ack_seq", "sha256", "uri", "tried", "deadline",
            "recomputed", "missed_window", "reason", "request_json", "created_at", "updated_at")
#: a migration with whether its event was ended (``POST /v1/events/{id}/end``): ``m.`` names its columns
_SELECT = ("SELECT " + ", ".join(f"m.{c}" for c in _COLUMNS) + ", e.ended_at FROM migrations m "
           "LEFT JOIN pool_events e ON e.event_id = m.event_id")
_OPEN = tuple(s.value for s in MigrationState if s not in TERMINAL)


class MigrationStoreError(Exception):
    """The store cannot be read or written (the backend is down): a 503."""


class Conflict(Exception):
    """A transition from a state (or version) the migration is no longer in."""


class Row:
    """One ``migrations`` row: the record as answered, plus what the router keeps with it."""

    __slots__ = ("attempt", "ended", "record", "request_json", "terminal_kind")

    def __init__(self, t: tuple[Any, ...]):
        d = dict(zip(_COLUMNS, t))
        #: its event was ended early: the pool stays (no cold commit, no abort at the deadline)
        self.ended = len(t) > len(_COLUMNS) and t[len(_COLUMNS)] is not None
        self.attempt = int(d.pop("attempt"))
        self.request_json = str(d.pop("request_json"))
        self.terminal_kind = bool(d.pop("terminal_kind"))
        d["tried"] = json.loads(d["tried"])
        d["recomputed"], d["missed_window"] = bool(d["recomputed"]), bool(d["missed_window"])
        self.record = MigrationRecord(**d)

    @property
    def id(self) -> str:
        return self.record.migration_id


Op = Callable[[Callable[..., Any]], Any]


class MigrationStore:
    """The tables above on SQLite (a path) or PostgreSQL (a URL); blocking calls run in a thread,
    one connection, one call at a time. Open it after the decision log (the index is on its table)."""

    def __init__(self, target: Path | str, batch_max: int = 512):
        self.target = target
        self.db = Database(target, lambda d: d.ddl(_TABLES), lock=_PG_LOCK, application="xroute-migrations",
                           error=MigrationStoreError, label="migration store", added=_ADDED)
        #: "sqlite" or "postgresql"
        self.dialect = self.db.dialect.name
        self.batch_max = batch_max
        self._pending: list[tuple[Op, asyncio.Future[Any]]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self.db.query(sql, args)

    def _tx(self, ops: list[Op]) -> list[Any]:
        """Run ``ops`` in one transaction; each gets ``execute(sql, args) -> cursor``. An op that
        raises :class:`Conflict` returns it (its writes so far are kept: ops check before writing)."""
        try:
            with self.db.transaction(lock=False) as execute:
                out: list[Any] = []
                for op in ops:
                    try:
                        out.append(op(execute))
                    except Conflict as c:
                        out.append(c)
                return out
        except MigrationStoreError:
            raise
        except Exception as e:  # (an op's own failure fails its batch alike)
            raise self.db.fail(e) from None

    # ------------------------------------------------------------------ group commit
    async def submit(self, op: Op) -> Any:
        """Run ``op`` in the next group commit; returns once it is durable (raises what it raised:
        :class:`Conflict`, or :class:`MigrationStoreError` for the whole batch)."""
        loop = asyncio.get_running_loop()
        if self._wake is None:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._writer(), name="migration-commit")
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((op, fut))
        self._wake.set()
        got = await fut
        if isinstance(got, Conflict):
            raise got
        return got

    async def _writer(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # the rest of this loop iteration's writes join the batch
            while self._pending:
                batch, self._pending = self._pending[: self.batch_max], self._pending[self.batch_max:]
                try:
                    results = await asyncio.to_thread(self._tx, [op for op, _ in batch])
                except Exception as e:
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(e if isinstance(e, MigrationStoreError) else MigrationStoreError(str(e)))
                    continue
                for (_, f), r in zip(batch, results):
                    if not f.done():
                        f.set_result(r)

    async def close(self) -> None:
        if self._task is not None:
            while self._pending:
                await asyncio.sleep(0.01)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.db.close()

    # ------------------------------------------------------------------ writes (ops)
    @staticmethod
    def insert_event(row: dict[str, Any]) -> Op:
        """Insert the event unless its id exists; returns the stored ``(body_sha256, masked_until,
        deprioritize_until)`` and whether this op inserted it."""
        cols = ("event_id", "body_sha256", "kind", "pool", "region", "received_at", "deadline", "masked_until",
                "deprioritize_until", "principal", "body")

        def op(execute: Callable[..., Any]) -> tuple[tuple[Any, ...], bool]:
            got = execute("SELECT body_sha256, masked_until, deprioritize_until, received_at FROM pool_events "
                          "WHERE event_id = ?", (row["event_id"],)).fetchone()
            if got is not None:
                return tuple(got), False
            execute(f"INSERT INTO pool_events ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                    tuple(row[c] for c in cols))
            return (row["body_sha256"], row["masked_until"], row["deprioritize_until"], row["received_at"]), True

        return op

    @staticmethod
    def create_migrations(rows: list[dict[str, Any]], now: float) -> Op:
        """Insert ``requested`` migrations, skipping a session that has an open migration or one for
        the same event already; returns the ids inserted."""

        def op(execute: Callable[..., Any]) -> list[str]:
            made = []
            for r in rows:
                cur = execute(
                    "INSERT INTO migrations (migration_id, tenant, session_id, event_id, terminal_kind, source, state, "
                    "version, deadline, request_json, created_at, updated_at, tried) "
                    "VALUES (?, ?, ?, ?, ?, ?, 'requested', ?, ?, ?, ?, ?, '[]') ON CONFLICT DO NOTHING",
                    (r["migration_id"], r["tenant"], r["session_id"], r["event_id"], int(r["terminal_kind"]),
                     r["source"], r["version"], r["deadline"], r["request_json"], now, now))
                if cur.rowcount == 1:
                    execute("INSERT INTO migration_transitions (migration_id, version, state, at, detail) "
                            "VALUES (?, ?, 'requested', ?, ?)", (r["migration_id"], r["version"], now,
                                                                 f"event {r['event_id']}"))
                    made.append(r["migration_id"])
            return made

        return op

    @staticmethod
    def transition(migration_id: str, version: int, src: MigrationState, dst: MigrationState, now: float,
                   detail: str, notify: dict[str, Any] | None = None, **fields: Any) -> Op:
        """Move ``migration_id`` from ``src`` at ``version`` to ``dst`` at ``version + 1``, setting
        ``fields``; raises :class:`Conflict` when it is no longer there. ``notify``: a webhook
        delivery (``router.service.webhooks``) queued in the same transaction -- the notice exists exactly
        when the transition does."""
        if not allowed(src, dst):
            raise ValueError(f"{src} -> {dst} is not a transition of the migration state machine")
        sets = ["state = ?", "version = ?", "updated_at = ?"] + [f"{k} = ?" for k in fields]
        vals: list[Any] = [dst.value, version + 1, now]
        for v in fields.values():
            vals.append(json.dumps(v) if isinstance(v, list) else int(v) if isinstance(v, bool) else v)

        def op(execute: Callable[..., Any]) -> int:
            cur = execute(f"UPDATE migrations SET {', '.join(sets)} WHERE migration_id = ? AND version = ? "
                          "AND state = ?", (*vals, migration_id, version, src.value))
            if cur.rowcount != 1:
                raise Conflict(f"migration {migration_id} is no longer {src.value} at version {version}")
            execute("INSERT INTO migration_transitions (migration_id, version, state, at, detail) VALUES (?, ?, ?, ?, ?)",
                    (migration_id, version + 1, dst.value, now, detail[:500]))
            if notify is not None:
                execute("INSERT INTO webhook_deliveries (delivery_id, migration_id, tenant, session_id, body, status, "
                        "attempts, next_at, created_at, updated_at) VALUES (?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?) "
                        "ON CONFLICT DO NOTHING", (notify["delivery_id"], migration_id, notify["tenant"],
                                                   notify["session_id"], notify["body"], now, now, now))
            return version + 1

        return op

    @staticmethod
    def end_event(event_id: str, now: float, principal: str, reason: str | None) -> Op:
        """End the event early: its mask and region bias end ``now`` (``events_active`` no longer
        lists it, so every router unmasks the pool at its next read), who and why are kept with it,
        and the change is audited (``router.store.audit``, kind ``pool_event``, action ``end``) in the same
        transaction. Returns None for an unknown event, else the event as ended -- ``already_ended``
        when it was before (nothing written) -- with the count of its migrations still open."""

        def op(execute: Callable[..., Any]) -> dict[str, Any] | None:
            got = execute("SELECT kind, pool, deadline, masked_until, deprioritize_until, ended_at, ended_by, "
                          "end_reason FROM pool_events WHERE event_id = ?", (event_id,)).fetchone()
            if got is None:
                return None
            kind, pool, deadline, masked, depri, ended_at, ended_by, why = got
            n_open = int(execute(f"SELECT COUNT(*) FROM migrations WHERE event_id = ? AND state IN "
                                 f"({', '.join('?' for _ in _OPEN)})", (event_id, *_OPEN)).fetchone()[0])
            out = {"event_id": event_id, "kind": kind, "pool": pool, "open_migrations": n_open}
            if ended_at is not None:
                return {**out, "ended_at": float(ended_at), "ended_by": ended_by, "reason": why,
                        "already_ended": True, "masked_until": float(masked)}
            new_masked = min(float(masked), now)
            new_depri = None if depri is None else min(float(depri), now)
            execute("UPDATE pool_events SET ended_at = ?, ended_by = ?, end_reason = ?, masked_until = ?, "
                    "deprioritize_until = ? WHERE event_id = ? AND ended_at IS NULL",
                    (now, principal, reason, new_masked, new_depri, event_id))
            before = {"kind": kind, "pool": pool, "deadline": deadline, "masked_until": masked,
                      "deprioritize_until": depri}
            audit.append(execute, principal, [audit.Change(
                "end", "pool_event", event_id, before, {**before, "masked_until": new_masked,
                                                        "deprioritize_until": new_depri, "ended_at": now,
                                                        "reason": reason, "open_migrations": n_open})], None, at=now)
            return {**out, "ended_at": now, "ended_by": principal, "reason": reason, "already_ended": False,
                    "masked_until": new_masked}

        return op

    # ------------------------------------------------------------------ webhook deliveries
    def due_webhooks(self, now: float, limit: int) -> list[tuple[str, str, str, str, int]]:
        """(delivery id, tenant, session id, body, attempts so far) of the pending deliveries due by
        ``now`` that no router holds, oldest first."""
        return self.query("SELECT delivery_id, tenant, session_id, body, attempts FROM webhook_deliveries WHERE "
                          "status = 'pending' AND next_at <= ? AND (claimed_until IS NULL OR claimed_until < ?) "
                          "ORDER BY next_at LIMIT ?", (now, now, limit))  # type: ignore[return-value]

    @staticmethod
    def claim_webhook(delivery_id: str, now: float, until: float) -> Op:
        """Hold a pending delivery until ``until`` (one router sends it at a time); :class:`Conflict`
        when it is delivered, failed or held by another."""
        def op(execute: Callable[..., Any]) -> None:
            cur = execute("UPDATE webhook_deliveries SET claimed_until = ? WHERE delivery_id = ? AND status = 'pending' "
                          "AND (claimed_until IS NULL OR claimed_until < ?)", (until, delivery_id, now))
            if cur.rowcount != 1:
                raise Conflict(f"webhook delivery {delivery_id} is not pending or is held")
        return op

    @staticmethod
    def webhook_attempted(delivery_id: str, status: str, attempts: int, next_at: float, http_status: int | None,
                          error: str | None, now: float) -> Op:
        """Record an attempt's outcome: ``status`` delivered, pending (retried at ``next_at``) or failed."""
        def op(execute: Callable[..., Any]) -> None:
            execute("UPDATE webhook_deliveries SET status = ?, attempts = ?, next_at = ?, claimed_until = NULL, "
                    "last_status = ?, last_error = ?, updated_at = ? WHERE delivery_id = ?",
                    (status, attempts, next_at, http_status, None if error is None else error[:300], now, delivery_id))
        return op

    # ------------------------------------------------------------------ reads
    def events_active(self, now: float) -> list[tuple[Any, ...]]:
        """(event_id, kind, pool, region, deadline, masked_until, deprioritize_until, received_at) of
        the events still masking or de-prioritizing."""
        return self.query("SELECT event_id, kind, pool, region, deadline, masked_until, deprioritize_until, "
                          "received_at FROM pool_events WHERE masked_until > ? OR deprioritize_until > ?", (now, now))

    def migration(self, migration_id: str) -> Row | None:
        rows = self.query(_SELECT + " WHERE m.migration_id = ?", (migration_id,))
        return Row(rows[0]) if rows else None

    def migrations(self, ids: list[str]) -> dict[str, Row]:
        """The rows of ``ids`` (those that exist), in one read."""
        out: dict[str, Row] = {}
        for k in range(0, len(ids), 500):
            part = ids[k:k + 500]
            for t in self.query(_SELECT + f" WHERE m.migration_id IN ({', '.join('?' for _ in part)})", tuple(part)):
                row = Row(t)
                out[row.id] = row
        return out

    def event_migrations(self, event_id: str, after: str, state: str | None, limit: int) -> list[Row]:
        """A page of ``event_id``'s migrations (in ``state``, if given), by id after ``after``."""
        where, args = "m.event_id = ? AND m.migration_id > ?", [event_id, after]
        if state is not None:
            where += " AND m.state = ?"
            args.append(state)
        return [Row(t) for t in self.query(_SELECT + f" WHERE {where} ORDER BY m.migration_id LIMIT ?",
                                           (*args, limit))]

    def open_migrations(self) -> list[Row]:
        return [Row(t) for t in self.query(_SELECT + f" WHERE m.state IN ({', '.join('?' for _ in _OPEN)}) "
                                           "ORDER BY m.created_at", _OPEN)]

    def due_migrations(self, now: float, grace_s: float, timeout_s: float, masked: list[str]) -> list[Row]:
        """The open migrations the router has something to do with now (``Migrator.drive``): to
        choose a target for (``requested``), to commit (``verified``), out of time -- a pool that goes
        away (terminal kind, a deadline, its event not ended): ``target_chosen`` past the deadline,
        ``snapshot_announced`` past it plus ``grace_s``; otherwise older than ``timeout_s`` -- or
        whose target a pool event masks (``masked``). Not the others, which wait for the serving side:
        the loop reads these every ``migration_poll_s``, and a storm leaves thousands waiting."""
        going = "m.terminal_kind = 1 AND m.deadline IS NOT NULL AND e.ended_at IS NULL"
        where = (f"m.state IN ('requested', 'verified') OR (m.state IN ('target_chosen', 'snapshot_announced') AND ("
                 f"({going} AND ((m.state = 'target_chosen' AND m.deadline <= ?) OR m.deadline <= ?)) "
                 f"OR (NOT ({going}) AND m.created_at <= ?)")
        args: list[Any] = [now, now - grace_s, now - timeout_s]
        if masked:
            where += f" OR m.target IN ({', '.join('?' for _ in masked)})"
            args += masked
        return [Row(t) for t in self.query(_SELECT + f" WHERE {where})) ORDER BY m.created_at", tuple(args))]

    def latest_migration(self, tenant: str, session_id: str) -> Row | None:
        rows = self.query(_SELECT + " WHERE m.tenant = ? AND m.session_id = ? ORDER BY m.updated_at DESC, "
                          "m.version DESC LIMIT 1", (tenant, session_id))
        return Row(rows[0]) if rows else None

    def tenant_migrations(self, tenant: str, limit: int) -> list[Row]:
        """A tenant's latest ``limit`` migrations (``migrations_session``: the tenant's range), newest first."""
        return [Row(t) for t in self.query(_SELECT + " WHERE m.tenant = ? ORDER BY m.updated_at DESC LIMIT ?",
                                           (tenant, limit))]

    def history(self, ids: list[str]) -> dict[str, list[tuple[int, str, float, str | None]]]:
        """Each migration's state history (version, state, at, detail), oldest first, in one read of the
        primary key (at most 100 ids: the console's page)."""
        out: dict[str, list[tuple[int, str, float, str | None]]] = {i: [] for i in ids[:100]}
        if not out:
            return out
        marks = ", ".join("?" for _ in out)
        for mid, version, state, at, detail in self.query(
                "SELECT migration_id, version, state, at, detail FROM migration_transitions "
                f"WHERE migration_id IN ({marks}) ORDER BY migration_id, version LIMIT 5000", tuple(out)):
            out[mid].append((int(version), str(state), float(at), detail))
        return out

    def transitions(self) -> list[tuple[Any, ...]]:
        return self.query("SELECT migration_id, version, state, at, detail FROM migration_transitions "
                          "ORDER BY migration_id, version")

    def placements(self, since: float, tenant: str | None = None, session_id: str | None = None,
                   migrations_since: float | None = None) -> dict[tuple[str, str], tuple[str, float, int, str]]:
        """Where each session is: (tenant, session) -> (offering, since when, version, the request
        to re-route it with) -- the later of its last ordinary decision since ``since`` (a migration's
        own target decisions excluded) and its last migration committed (its target) or rolled back
        (its source) since ``migrations_since`` (default: ``since``). Only the sessions with a decision or a commit since then: a sweep
        after the first reads what came since the one before."""
        where = "session_id IS NOT NULL AND created_at > ?"
        args: list[Any] = [since]
        if tenant is not None:
            where += " AND tenant = ? AND session_id = ?"
            args += [tenant, session_id]
        like = f"%:route:{MIGRATION_KEY_PREFIX}%"
        out: dict[tuple[str, str], tuple[str, float, int, str]] = {}
        for t, s, off, at, req in self.query(
                f"SELECT tenant, session_id, offering_id, created_at, request_json FROM decisions WHERE {where} AND "
                f"(idempotency_key IS NULL OR idempotency_key NOT LIKE ?) ORDER BY created_at", (*args, like)):
            out[(t, s)] = (off, float(at), 0, req)
        mwhere = "state IN ('committed', 'rolled_back') AND updated_at > ?"
        margs: list[Any] = [since if migrations_since is None else migrations_since]
        if tenant is not None:
            mwhere += " AND tenant = ? AND session_id = ?"
            margs += [tenant, session_id]
        for t, s, state, source, target, at, version, req in self.query(
                f"SELECT tenant, session_id, state, source, target, updated_at, version, request_json FROM migrations "
                f"WHERE {mwhere} ORDER BY updated_at", tuple(margs)):
            # a committed migration puts the session on its target; one rolled back leaves it on its source,
            # as of then (a later event's sweep on that pool finds it again)
            target = target if state == "committed" else source
            cur = out.get((t, s))
            if cur is None or float(at) >= cur[1]:
                out[(t, s)] = (target, float(at), int(version), req)
            else:
                out[(t, s)] = (cur[0], cur[1], int(version), cur[3])
        return out

    def decision_by_key(self, idempotency_key: str) -> tuple[str, str] | None:
        """(offering, decision id) of the decision logged under ``idempotency_key``, if any."""
        rows = self.query("SELECT offering_id, decision_id FROM decisions WHERE idempotency_key = ?", (idempotency_key,))
        return (str(rows[0][0]), str(rows[0][1])) if rows else None

    def session_versions(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """The highest version of each session's migrations (0: none)."""
        out = {(t, s): int(v) for t, s, v in
               self.query("SELECT tenant, session_id, MAX(version) FROM migrations GROUP BY tenant, session_id")}
        return {k: out.get(k, 0) for k in keys}
