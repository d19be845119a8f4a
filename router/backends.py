"""Which backend: the factories that open the router's shared state and its decision log, and the
readers that pick SQLite or PostgreSQL by the target's form.

The interfaces (``router.state``, ``router.store``) know nothing of the backends that implement
them; this module sits above both and their backends (``router.state_redis``, ``router.store_pg``),
so imports flow one way (``docs/architecture.md``, "Layers").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from router import store
from router.logs import id_floor
from router.quota_ledger import RECORD_S
from router.state import (
    STATS_ALPHA,
    EmbeddedState,
    FailOpenState,
    Released,
    Reserved,
    RouterState,
    hold_for,
    pool_key,
)

# (the Redis and PostgreSQL clients are imported where a backend that needs them is opened: the
# embedded default does not pay for them)


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
    upto = "" if before is None else " AND d.created_at < {p}"
    dsql = ("SELECT decision_id, created_at, model, offering_id, expected_latency_ms, pool, hold_until FROM decisions d "
            "WHERE decision_id >= {p} AND created_at >= {p}" + upto + " ORDER BY created_at, decision_id")
    fsql = ("SELECT f.decision_id, MIN(f.received_at) FROM feedback f JOIN decisions d "
            "ON d.decision_id = f.decision_id WHERE d.decision_id >= {p} AND d.created_at >= {p}" + upto
            + " GROUP BY f.decision_id")
    args: tuple[Any, ...] = (id_floor(since), since) if before is None else (id_floor(since), since, before)
    if store.is_postgres_url(target):
        import psycopg  # (the PostgreSQL client only where a PostgreSQL log is read)

        with psycopg.connect(target, connect_timeout=10) as conn:
            drows = conn.execute(dsql.format(p="%s"), args).fetchall()  # type: ignore[arg-type]
            frows = conn.execute(fsql.format(p="%s"), args).fetchall()  # type: ignore[arg-type]
    else:
        conn3 = store.connect(Path(target), readonly=True)
        try:
            drows = conn3.execute(dsql.format(p="?"), args).fetchall()
            frows = conn3.execute(fsql.format(p="?"), args).fetchall()
        finally:
            conn3.close()
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


@dataclass
class StateSettings:
    """What :func:`open_state` needs (``router.settings.RouterSettings`` has these fields)."""

    backend: Literal["embedded", "redis"] = "embedded"
    url: str | None = None
    fail_open: bool = False
    timeout_s: float = 0.5
    prefix: str = "xroute"
    alpha: float = STATS_ALPHA
    #: how long after its hold a tenant quota reservation's record waits for its feedback
    record_ttl_s: float = RECORD_S
    restore_window_s: float = 1.0


def open_state(cfg: StateSettings, on_failover: Callable[[str], None] | None = None) -> RouterState:
    """The backend ``cfg`` names (a Redis one wrapped in :class:`FailOpenState` with ``fail_open``)."""
    if cfg.backend == "embedded":
        return EmbeddedState(cfg.alpha, record_ttl_s=cfg.record_ttl_s)
    from router.state_redis import RedisState

    if not cfg.url:
        raise ValueError("the redis state backend needs a URL (state_url)")
    shared = RedisState(cfg.url, prefix=cfg.prefix, timeout_s=cfg.timeout_s, alpha=cfg.alpha,
                        record_ttl_s=cfg.record_ttl_s, restore_window_s=cfg.restore_window_s)
    return (FailOpenState(shared, EmbeddedState(cfg.alpha, record_ttl_s=cfg.record_ttl_s), on_failover=on_failover)
            if cfg.fail_open else shared)



def iter_decisions(target: Path | str, tenant: str | None = None, since: float | None = None,
                   until: float | None = None, ope: bool = False) -> Iterator[dict[str, Any]]:
    """Every decision (oldest first) with its latest feedback, read-only (for export), from a
    SQLite file or a ``postgresql://`` URL; ``since``/``until``: wall-time bounds on when it was
    made; ``ope``: with the OPE columns (``router.store.export_columns``)."""
    if store.is_postgres_url(target):
        from router import store_pg

        yield from store_pg.iter_decisions(str(target), tenant, since, until, ope)
    else:
        yield from store.iter_sqlite_decisions(Path(target), tenant, since, until, ope)
