"""The append-only audit log: who changed what, with the value before and after, and when -- on the
decision log's backends (the same SQLite file, or the same PostgreSQL database).

Generic over what changed: an entry names a ``kind`` (``policy``, ``policy_set``; later ``quota``,
``tenant``, ``role_binding``) and a ``resource`` (the changed object's name), the ``action``
(``create``, ``update``, ``delete``, ``apply``), the ``principal`` that made it (``key:<key id>``
for an API key, ``cli:<user>`` for the command line, ``config:<files>`` for the router's policy
files), the version of the versioned store the change produced, and the object ``before`` and
``after`` as JSON (null when it did not exist). Entries are written with :func:`append` inside the
caller's transaction, so a change and its audit entry commit together or not at all, and are
durable (synchronous commit) before the change is acknowledged.

Append-only is enforced by the database, not by convention: triggers refuse any ``UPDATE`` or
``DELETE`` of the table on both backends (``tests/test_policy_store.py`` tries both).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from router.core.logs import iso, trace_id_var
from router.store.dialect import Dialect

#: the PostgreSQL advisory lock key under which the table and its triggers are created (by the policy
#: store and the capacity journal alike, so two never race)
PG_LOCK = 0x78726F757470  # "xroutp"

#: the table, written once for both dialects (``router.store.dialect``) ...
TABLE = """
CREATE TABLE IF NOT EXISTS audit_log (
    audit_id {serial},
    at {real} NOT NULL,
    principal TEXT NOT NULL,
    action TEXT NOT NULL,
    kind TEXT NOT NULL,
    resource TEXT NOT NULL,
    version {bigint},
    before_json TEXT,
    after_json TEXT,
    request_id TEXT,
    trace_id TEXT
);
CREATE INDEX IF NOT EXISTS audit_resource ON audit_log (kind, resource, audit_id);
"""
#: ... and its append-only triggers, which each backend spells its own way
TRIGGERS = {"sqlite": """
CREATE TRIGGER IF NOT EXISTS audit_log_no_update BEFORE UPDATE ON audit_log
BEGIN SELECT RAISE(ABORT, 'audit_log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_log_no_delete BEFORE DELETE ON audit_log
BEGIN SELECT RAISE(ABORT, 'audit_log is append-only'); END;
""", "postgresql": """
CREATE OR REPLACE FUNCTION xroute_audit_append_only() RETURNS trigger AS $$
BEGIN RAISE EXCEPTION 'audit_log is append-only'; END; $$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS audit_log_append_only ON audit_log;
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log
FOR EACH ROW EXECUTE FUNCTION xroute_audit_append_only();
"""}


def schema(dialect: Dialect) -> str:
    """The audit log's table and triggers in ``dialect``."""
    return dialect.ddl(TABLE) + TRIGGERS[dialect.name]


#: the columns added since the table was first created (``router.store.dialect.Database``'s ``added``):
#: the W3C trace id of the request that made the change (``router.core.tracing``; NULL: none)
ADDED = ("audit_log", (("trace_id", "TEXT"),))

COLUMNS = ("audit_id", "at", "principal", "action", "kind", "resource", "version", "before_json", "after_json",
           "request_id", "trace_id")
_INSERT = ("INSERT INTO audit_log (at, principal, action, kind, resource, version, before_json, after_json, "
           "request_id, trace_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


@dataclass(frozen=True)
class Change:
    """One audited change: ``before``/``after`` are the object as JSON-able values (None: absent)."""

    action: str
    kind: str
    resource: str
    before: Any = None
    after: Any = None


def _json(v: Any) -> str | None:
    return None if v is None else json.dumps(v, sort_keys=True, separators=(",", ":"))


def append(execute: Any, principal: str, changes: list[Change], version: int | None, request_id: str | None = None,
           at: float | None = None) -> None:
    """Write ``changes`` through ``execute(sql, params)`` -- the caller's open transaction (``?``
    placeholders: ``router.store.dialect.Database.transaction``'s ``execute`` spells them for its backend).
    Each entry carries the current trace id (``router.core.logs.trace_id_var``: the request's)."""
    now = time.time() if at is None else at
    trace_id = trace_id_var.get()
    for c in changes:
        execute(_INSERT, (now, principal, c.action, c.kind, c.resource, version, _json(c.before), _json(c.after),
                          request_id, trace_id))


def read_sql(kind: str | None, resource: str | None, after: int, limit: int) -> tuple[str, tuple[Any, ...]]:
    """The query (``?`` placeholders) for :func:`entry` rows: oldest first, after ``after``."""
    where: list[str] = ["audit_id > ?"]
    args: list[Any] = [after]
    if kind is not None:
        where.append("kind = ?")
        args.append(kind)
    if resource is not None:
        where.append("resource = ?")
        args.append(resource)
    return (f"SELECT {', '.join(COLUMNS)} FROM audit_log WHERE {' AND '.join(where)} ORDER BY audit_id LIMIT ?",
            (*args, limit))


def entry(row: tuple[Any, ...]) -> dict[str, Any]:
    """A row of ``audit_log`` as the audit API answers it."""
    d = dict(zip(COLUMNS, row))
    return {"audit_id": int(d["audit_id"]), "at": iso(float(d["at"])), "principal": d["principal"],
            "action": d["action"], "kind": d["kind"], "resource": d["resource"],
            "version": None if d["version"] is None else int(d["version"]),
            "before": None if d["before_json"] is None else json.loads(d["before_json"]),
            "after": None if d["after_json"] is None else json.loads(d["after_json"]),
            "request_id": d["request_id"], "trace_id": d["trace_id"]}


def export_sql(since: float | None, until: float | None) -> tuple[str, tuple[Any, ...]]:
    """The export's query (``?`` placeholders; :func:`entry` rows, oldest first, ``at`` in
    [``since``, ``until``): ``xroute audit export``)."""
    where, args = ["1 = 1"], []
    if since is not None:
        where.append("at >= ?")
        args.append(since)
    if until is not None:
        where.append("at < ?")
        args.append(until)
    return f"SELECT {', '.join(COLUMNS)} FROM audit_log WHERE {' AND '.join(where)} ORDER BY audit_id", tuple(args)
