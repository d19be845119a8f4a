"""The decision log read by URL or path: SQLite file or PostgreSQL, picked by the target's form --
the decisions of a window (:func:`iter_decisions`, for exports and the dry run) and the
reservation events a restart or a restore replays (:func:`decision_events`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from router.core.logs import id_floor
from router.state.base import Released, Reserved, hold_for, pool_key
from router.store.dialect import reading, stream
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
