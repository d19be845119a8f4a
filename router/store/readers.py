"""The decision log read by URL or path: SQLite file or PostgreSQL, picked by the target's form --
the decisions of a window (:func:`iter_decisions`, for exports and the dry run) and the
reservation events a restart or a restore replays (:func:`decision_events`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from router.core.logs import id_floor
from router.state.base import Released, Reserved, hold_for, pool_key
from router.store.dialect import is_postgres_url, reading, stream
from router.store.rows import export_columns, export_params


def decision_events(target: Path | str, since: float, hold_s: Callable[[dict[str, Any]], float] | None = None,
                    pool_of: Callable[[dict[str, Any]], str] | None = None,
                    before: float | None = None) -> Iterator[Reserved | Released]:
    """The reservation and release events the decision log implies from wall time ``since`` on,
    oldest first (for :meth:`EmbeddedState.rebuild` after a restart): each decision reserved one
    slot of its pool until its hold passed, each feedback released it. The pool and the hold's end
    are the row's ``pool`` and ``hold_until``; rows written before those columns existed get
    ``pool_of(row)`` (default :func:`pool_key` of its model and offering) and ``created_at +
    hold_s(row)`` (default :func:`hold_for` of its expected latency). ``target``: a SQLite file or
    a ``postgresql://`` URL. Rows are found by the decision id's time prefix (the primary key), so a
    long log is not scanned. ``before``: only the decisions made before that wall time (and their
    releases) -- what a shared state that began then lost (``RouterState.restore``)."""
    pool = pool_of or (lambda row: pool_key(str(row["model"]), str(row["offering_id"])))
    hold = hold_s or (lambda row: hold_for(float(row["expected_latency_ms"]) / 1000.0))
    upto = "" if before is None else " AND d.created_at < ?"
    dsql = ("SELECT decision_id, created_at, model, offering_id, expected_latency_ms, pool, hold_until FROM decisions d "
            "WHERE decision_id >= ? AND created_at >= ?" + upto + " ORDER BY created_at, decision_id")
    fsql = ("SELECT f.decision_id, MIN(f.received_at) FROM feedback f JOIN decisions d "
            "ON d.decision_id = f.decision_id WHERE d.decision_id >= ? AND d.created_at >= ?" + upto
            + " GROUP BY f.decision_id")
    args: tuple[Any, ...] = (id_floor(since), since) if before is None else (id_floor(since), since, before)
    with reading(target) as query:
        drows, frows = query(dsql, args), query(fsql, args)
    timeline: list[tuple[float, int, Reserved | Released]] = []
    for did, created, model, offering, expected_ms, pool_col, hold_until in drows:
        row = {"decision_id": did, "created_at": created, "model": model, "offering_id": offering,
               "expected_latency_ms": expected_ms}
        until = float(hold_until) if hold_until is not None else float(created) + hold(row)
        timeline.append((float(created), 0, Reserved(str(did), str(pool_col) if pool_col else pool(row), until)))
    timeline += [(float(at), 1, Released(str(did))) for did, at in frows]
    timeline.sort(key=lambda t: (t[0], t[1]))
    for _, _, ev in timeline:
        yield ev


def iter_decisions(target: Path | str, tenant: str | None = None, since: float | None = None,
                   until: float | None = None, ope: bool = False) -> Iterator[dict[str, Any]]:
    """Every decision (oldest first) with its latest feedback, read-only (for export), from a
    SQLite file or a ``postgresql://`` URL; ``since``/``until``: wall-time bounds on when it was
    made; ``ope``: with the OPE columns (``router.store.rows.export_columns``). Read as consumed
    (``router.store.dialect.stream``: on PostgreSQL in pages)."""
    sql, cols = export_columns(tenant is not None, ope, since is not None, until is not None)
    for row in stream(target, sql, export_params(tenant, since, until)):
        yield dict(zip(cols, row))


#: what the web console lists of a decision (``router.console``): no answer, no request, no OPE record
SEARCH_COLUMNS = ("decision_id", "tenant", "created_at", "model", "session_id", "origin", "offering_id", "policy",
                  "policy_kind", "policy_version", "expected_latency_ms", "expected_cost_usd", "trace_id")


def _id_at(t: float) -> str:
    """The smallest decision id made at wall time ``t`` (``router.core.logs.new_sorted_id``, ``d_`` + 12 hex
    digits of milliseconds)."""
    return f"d_{max(0, int(t * 1000.0)):012x}"


def search_sql(tenant: str | None = None, session: str | None = None, since: float | None = None,
               until: float | None = None, before: tuple[float, str] | None = None, limit: int = 50
               ) -> tuple[str, tuple[Any, ...]]:
    """:func:`search_decisions`' query and its parameters (``?`` placeholders)."""
    where: list[str] = []
    args: list[Any] = []
    if tenant is not None:
        where.append("tenant = ?")
        args.append(tenant)
        if session is not None:
            where.append("session_id = ?")
            args.append(session)
        if before is not None:
            where.append("(created_at < ? OR (created_at = ? AND decision_id < ?))")
            args += [before[0], before[0], before[1]]
        order = "created_at DESC, decision_id DESC"
    else:
        if session is not None:
            raise ValueError("session needs tenant")
        if since is not None:  # (ids before a decision's own millisecond are older: the key bounds the scan)
            where.append("decision_id >= ?")
            args.append(_id_at(since - 1.0))
        if until is not None:
            where.append("decision_id < ?")
            args.append(_id_at(until + 1.0))
        if before is not None:
            where.append("decision_id < ?")
            args.append(before[1])
        order = "decision_id DESC"
    if since is not None:
        where.append("created_at >= ?")
        args.append(since)
    if until is not None:
        where.append("created_at < ?")
        args.append(until)
    sql = (f"SELECT {', '.join(SEARCH_COLUMNS)} FROM decisions" + (" WHERE " + " AND ".join(where) if where else "")
           + f" ORDER BY {order} LIMIT ?")
    return sql, (*args, limit)


def search_decisions(target: Path | str, *, tenant: str | None = None, session: str | None = None,
                     since: float | None = None, until: float | None = None,
                     before: tuple[float, str] | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """A page of at most ``limit`` decisions, newest first (keyset paging: ``before`` is the
    (``created_at``, ``decision_id``) of the last row of the page before; nothing is skipped, nothing
    counted). Each query walks an index from its start: a tenant's (and session's) by
    ``decisions_tenant_time`` (``decisions_session`` with a session), every tenant's by the primary
    key -- decision ids are time-sorted, so ``since``/``until`` and the cursor bound the key itself.
    ``session`` needs ``tenant`` (the index's order)."""
    sql, args = search_sql(tenant, session, since, until, before, limit)
    with reading(target) as query:
        rows = query(sql, args)
    return [dict(zip(SEARCH_COLUMNS, r)) for r in rows]


#: :func:`tenant_usage`'s decisions per bucket (bucket width, tenant, since, limit): the tenant's range of
#: ``decisions_tenant_time`` alone (a covering index: no row is read)
REQUESTS_SQL = ("SELECT CAST(created_at / ? AS INTEGER) AS b, COUNT(*) FROM decisions WHERE tenant = ? AND "
                "created_at >= ? GROUP BY b ORDER BY b LIMIT ?")
#: ... and what its quotas reserved per bucket -- tokens and USD (the same parameters; reads the rows: a short window)
RESERVED_SQL = ("SELECT CAST(created_at / ? AS INTEGER) AS b, COUNT(*), SUM(quota_tokens), SUM(quota_usd) FROM "
                "decisions WHERE tenant = ? AND created_at >= ? GROUP BY b ORDER BY b LIMIT ?")
#: :func:`tenant_sessions`' query: tenant, since, limit
SESSIONS_SQL = ("SELECT session_id, COUNT(*), MAX(created_at) FROM decisions WHERE tenant = ? AND session_id IS NOT "
                "NULL AND created_at >= ? GROUP BY session_id ORDER BY 3 DESC LIMIT ?")


def _floored(sql: str) -> str:
    """PostgreSQL's spelling of the bucket: its ``CAST(... AS INTEGER)`` rounds where SQLite's truncates."""
    return sql.replace("CAST(created_at / ? AS INTEGER)", "FLOOR(created_at / ?)")


def tenant_usage(target: Path | str, tenant: str, now: float) -> dict[str, list[dict[str, Any]]]:
    """A tenant's use over time, from its decisions: ``hours`` -- decisions per hour over the last day
    (against ``requests_per_day``; an index-only count) -- and ``minutes`` -- decisions, tokens and USD
    its quotas reserved per minute over the last hour (against ``tokens_per_minute``, ``usd_per_day``).
    Oldest first; at most 25 and 61 buckets."""
    hours_sql, minutes_sql = (_floored(REQUESTS_SQL), _floored(RESERVED_SQL)) if is_postgres_url(target) else \
        (REQUESTS_SQL, RESERVED_SQL)
    with reading(target) as query:
        hours = query(hours_sql, (3600, tenant, now - 86_400.0, 25))
        minutes = query(minutes_sql, (60, tenant, now - 3600.0, 61))
    return {"hours": [{"start": float(b) * 3600, "requests": int(n)} for b, n in hours],
            "minutes": [{"start": float(b) * 60, "requests": int(n), "quota_tokens": int(tok or 0),
                         "quota_usd": float(usd or 0.0)} for b, n, tok, usd in minutes]}


def tenant_sessions(target: Path | str, tenant: str, since: float, limit: int = 50) -> list[dict[str, Any]]:
    """A tenant's sessions with a decision since ``since``, the latest first (at most ``limit``): its
    decisions, the last one's time and offering. One range of ``decisions_session``."""
    with reading(target) as query:
        rows = query(SESSIONS_SQL, (tenant, since, limit))
    return [{"session_id": s, "decisions": int(n), "last_at": float(at)} for s, n, at in rows]
