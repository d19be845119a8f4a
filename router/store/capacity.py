"""The capacity journal: each change ``xroute capacity apply`` makes to a cloud group, recorded in the
audit log (``router.store.audit``, kind ``capacity``) -- the decision log's SQLite file or PostgreSQL
database, the same log the policy and access changes are audited in.

One audit entry per state of a change (``cloud_adapters.actuate``'s journal): ``intended`` before
the cloud call, then ``applied`` or ``failed`` (or ``applied`` found on resume). The entry's
``resource`` is the change's stable id (the plan's time, the pool, the target), its ``action`` the
state, its ``after`` the :class:`~xroute.schema.capacity.CapacityChange` as JSON; ``version`` is
empty. Each entry is its own transaction, committed durably (SQLite ``synchronous=FULL``,
PostgreSQL's synchronous commit) before :meth:`CapacityJournal.record` returns -- so an intended
change is on disk before the call that makes it. The log is append-only (its triggers), so a
change's history is kept whole; its latest entry is its state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from router.store import audit
from router.store.dialect import Database
from xroute.schema.capacity import CapacityChange

KIND = "capacity"


class CapacityJournalError(Exception):
    """The capacity journal (the audit log) cannot be opened, read or written."""


class CapacityJournal:
    """:class:`cloud_adapters.actuate.Journal` on the audit log of ``target`` (a SQLite file or a
    ``postgresql://`` URL), entries written as ``principal``."""

    def __init__(self, target: Path | str, principal: str):
        self.principal = principal
        self.db = Database(target, audit.schema, lock=audit.PG_LOCK, application="xroute-capacity",
                           error=CapacityJournalError, label="capacity journal", added=(audit.ADDED,))

    def last(self, change_ids: list[str]) -> dict[str, CapacityChange]:
        """The latest recorded state of each of ``change_ids`` that has one."""
        out: dict[str, CapacityChange] = {}
        wanted = sorted(set(change_ids))
        for chunk in range(0, len(wanted), 500):
            ids = wanted[chunk:chunk + 500]
            rows = self.db.query(f"SELECT resource, after_json FROM audit_log WHERE kind = ? AND resource IN "
                                 f"({', '.join('?' * len(ids))}) ORDER BY audit_id", (KIND, *ids))
            for resource, after in rows:
                out[str(resource)] = CapacityChange.model_validate_json(after)
        return out

    def record(self, change: CapacityChange) -> None:
        """Append ``change`` (committed, durably, when this returns)."""
        with self.db.transaction(lock=False) as execute:
            audit.append(execute, self.principal, [audit.Change(change.state, KIND, change.change_id, None,
                                                                change.model_dump(mode="json"))], None)

    def entries(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The journal's audit entries, oldest first (``router.store.audit.entry``'s form)."""
        sql, args = audit.read_sql(KIND, None, 0, limit)
        return [audit.entry(r) for r in self.db.query(sql, args)]

    def close(self) -> None:
        self.db.close()
