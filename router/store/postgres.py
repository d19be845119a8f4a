"""The decision log on PostgreSQL: many routers write one log (``db_url: postgresql://...``).

The same group commit as SQLite's (``router.store.sqlite.GroupCommitLog``): the rows of one event-loop
iteration go out as one transaction, and each request is answered only once the ``COMMIT`` holding
its row has returned -- with the server's default ``synchronous_commit = on``, once the commit is
flushed to the server's WAL. Two connections commit, so up to two batches are in flight, as with
SQLite's writer process; the inserts run in psycopg's pipeline mode (``executemany``), one round
trip for the batch. The commits are network I/O on the event loop (psycopg's async connections):
nothing competes with the loop for the GIL but the encoding of the rows.

Many routers may write one log: every row's key is a time-sorted random decision id, so routers
never contend on it, and the schema is created under an advisory lock, so routers starting
together do not race.

Answers are stored as their JSON text: the Zstandard dictionary compression of the SQLite log is
not carried over (a dictionary table shared by many writers is more machinery than one backend is
worth; PostgreSQL compresses large values itself).

When the server is down or unreachable, the batch's requests fail with :class:`StoreClosed` (the
API's 503 with ``Retry-After``) and ``/readyz`` reports the log down; the next batch reconnects, so
the router recovers by itself once the server is back (tested by stopping a real server). Nothing
that was not committed is ever acknowledged.

A connection the server closed while it sat idle (a restart) is not discovered by a request
failing on it: before a connection is used -- and by every readiness probe (:meth:`PostgresLog.healthy`,
run every ``ready_probe_s`` by the app) for the idle ones -- its socket is checked for what a
closed or terminated backend leaves there (end of file, or the server's termination notice: an
idle connection in good order has nothing to read), without a round trip, and such a connection is
replaced by a new one. A commit whose ``BEGIN`` fails on a connection error is retried once on a
new connection (nothing of it reached the server); one that fails later is not retried -- its
``COMMIT`` may have been applied with the answer lost, and a retried feedback row would be stored
twice -- and fails with :class:`router.store.sqlite.CommitInDoubt` (503; a keyed request's key stays
pending until the log says whether its row is there). Reads are retried once on a new connection.

Credentials never appear in code, configs or logs: the URL may name the user, host, port and
database; the password comes from libpq's usual places (``PGPASSWORD``, ``PGPASSFILE`` or
``~/.pgpass``, or a ``passfile=`` parameter), and whatever the URL holds is shown only through
:func:`router.core.text.redact`.
"""

from __future__ import annotations

import asyncio
import json
import select
import time
from collections.abc import Callable
from typing import Any

import psycopg

from router.core.logs import id_floor
from router.core.text import one_line, redact
from router.store.dialect import POSTGRESQL
from router.store.rows import (
    ADDED_COLUMNS,
    ADDED_INDEXES,
    DECISION_COLUMNS,
    FEEDBACK_COLUMNS,
    GET_DECISION_SQL,
    GET_TENANT_DECISION_SQL,
    KEYED_DECISIONS_SQL,
    KEYED_FEEDBACK_SQL,
    LOOKUP_SQL,
    OWNER_SQL,
    RECORD_FEEDBACK_SQL,
    REGISTER_CATALOG_SQL,
    TABLES,
    DecisionRef,
    decision_record,
    decision_ref,
)
from router.store.sqlite import CommitInDoubt, GroupCommitLog, Item, Result, StoreClosed

SCHEMA = POSTGRESQL.ddl(TABLES, answer="TEXT", answer_dictionary="") + "".join(
    f"{stmt};\n" for table, added in ADDED_COLUMNS.items() for stmt in POSTGRESQL.add_columns_sql(table, added)) + "".join(
    f"{stmt};\n" for stmt in ADDED_INDEXES)
#: the advisory lock key under which the schema is created (routers starting together)
_SCHEMA_LOCK = 0x78726F757465  # "xroute"

_INSERT_DECISION = POSTGRESQL.insert("decisions", DECISION_COLUMNS)
_INSERT_FEEDBACK = POSTGRESQL.insert("feedback", FEEDBACK_COLUMNS, " RETURNING feedback_id")
_GET_DECISION = POSTGRESQL.sql(GET_DECISION_SQL.format(z=""))
_GET_TENANT_DECISION = POSTGRESQL.sql(GET_TENANT_DECISION_SQL.format(z=""))
_OWNER = POSTGRESQL.sql(OWNER_SQL)
_RECORD_FEEDBACK = POSTGRESQL.sql(RECORD_FEEDBACK_SQL)
_LOOKUP = POSTGRESQL.sql(LOOKUP_SQL)
_KEYED_DECISIONS = POSTGRESQL.sql(KEYED_DECISIONS_SQL.format(z=""))
_KEYED_FEEDBACK = POSTGRESQL.sql(KEYED_FEEDBACK_SQL + " ORDER BY feedback_id")
_REGISTER_CATALOG = POSTGRESQL.sql(REGISTER_CATALOG_SQL + " RETURNING catalog_key")


def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """Raise :class:`xroute.errors.ConfigError` (one line, the URL redacted) unless a connection
    to ``url`` can be opened."""
    from xroute.errors import ConfigError

    try:
        psycopg.connect(url, connect_timeout=max(1, round(timeout_s))).close()
    except psycopg.Error as e:
        raise ConfigError(f"--db: cannot reach the decision log {redact(url)} ({one_line(e)})") from None


async def ensure_schema(conn: psycopg.AsyncConnection[Any]) -> None:
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
        await conn.execute(SCHEMA)  # type: ignore[arg-type]


def _stale(conn: psycopg.AsyncConnection[Any] | None) -> bool:
    """Whether an idle connection can no longer be used: closed, or its socket readable -- with no
    query out, that is the server's end of file or termination notice (module docstring)."""
    if conn is None or conn.closed:
        return True
    try:
        readable, _, _ = select.select([conn.pgconn.socket], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return True
    return bool(readable)


class _Unsent(Exception):
    """A connection error before the transaction began: nothing of the batch reached the server."""


class PostgresLog(GroupCommitLog):
    """The decision log on a PostgreSQL server (module docstring)."""

    backend = "postgresql"
    max_in_flight = 2

    def __init__(self, url: str, batch_max: int = 512, on_commit: Callable[[int, float], None] | None = None,
                 connect_timeout_s: float = 5.0):
        super().__init__(batch_max, on_commit)
        self._url = url
        self.where = redact(url)
        self.connect_timeout_s = connect_timeout_s
        #: how long a readiness probe waits for the server
        self.probe_timeout_s = min(2.0, connect_timeout_s)
        self._idle: list[psycopg.AsyncConnection[Any] | None] = []
        self._reader: psycopg.AsyncConnection[Any] | None = None
        self._reader_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _connect(self, autocommit: bool = False) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(self._url, autocommit=autocommit,
                                                     connect_timeout=max(1, round(self.connect_timeout_s)),
                                                     application_name="xroute-router")

    async def open(self) -> None:
        """Connect and create the schema (raises :class:`StoreClosed` when the server is not
        reachable: the router does not start on a log it cannot write)."""
        try:
            conn = await self._connect()
            await ensure_schema(conn)
            conns: list[psycopg.AsyncConnection[Any] | None] = [conn]
            conns += [await self._connect() for _ in range(self.max_in_flight - 1)]
            self._idle = conns
            self._reader = await self._connect(autocommit=True)
        except psycopg.Error as e:
            raise StoreClosed(f"decision log {self.where}: {one_line(e)}") from None

    def _send(self, batch: list[Item]) -> None:
        conn = self._idle.pop()
        task = asyncio.get_running_loop().create_task(self._commit(conn, batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fresh(self, conn: psycopg.AsyncConnection[Any] | None,
                     autocommit: bool = False) -> psycopg.AsyncConnection[Any]:
        """``conn``, or a new connection in place of a stale one (:func:`_stale`)."""
        if conn is not None and not _stale(conn):
            return conn
        if conn is not None and not conn.closed:
            await conn.close()
        return await self._connect(autocommit=autocommit)

    async def _commit(self, conn: psycopg.AsyncConnection[Any] | None, batch: list[Item]) -> None:
        t0 = time.perf_counter()
        results: list[Result]
        rows = [(kind, row) for kind, row, _ in batch]
        writing = False  # (a failure while the transaction is under way leaves its COMMIT in doubt)
        try:
            held, conn = conn, None
            try:
                conn = await self._fresh(held)
            except psycopg.Error as e:
                raise _Unsent() from e
            try:
                writing = True
                results = await self._write(conn, rows)
            except _Unsent:  # the connection broke before BEGIN went through: once more, on a new one
                writing = False
                await conn.close()
                conn = None
                try:
                    conn = await self._connect()
                except psycopg.Error as e:
                    raise _Unsent() from e
                writing = True
                results = await self._write(conn, rows)
        except Exception as e:  # psycopg's errors, and anything else: never leave a request waiting
            cause = e.__cause__ if isinstance(e, _Unsent) and e.__cause__ is not None else e
            self.error = f"decision log {self.where}: {one_line(cause)}"
            doubt = writing and not isinstance(e, _Unsent)
            results = [(CommitInDoubt if doubt else StoreClosed)(self.error)] * len(batch)
            if conn is not None and not conn.closed and isinstance(cause, psycopg.OperationalError):
                await conn.close()
        else:
            self.error = None
            self.commits += 1
            self.rows += sum(1 for r in results if not isinstance(r, BaseException))
            if self.on_commit is not None:
                self.on_commit(len(batch), time.perf_counter() - t0)
        finally:
            self._idle.append(conn)
        self._done(batch, results)

    async def _write(self, conn: psycopg.AsyncConnection[Any], batch: list[tuple[str, tuple[Any, ...]]]
                     ) -> list[Result]:
        """One transaction for ``batch``; a duplicate decision id fails alone, not its batch. Raises
        :class:`_Unsent` when the connection fails on ``BEGIN`` (before any row was sent)."""
        began = False
        try:
            async with conn.transaction():
                began = True
                async with conn.cursor() as cur:
                    if all(kind == "decision" for kind, _ in batch):
                        await cur.executemany(_INSERT_DECISION, [row for _, row in batch])
                        return [0] * len(batch)
                    ids: list[Result] = []
                    for kind, row in batch:
                        if kind == "decision":
                            await cur.execute(_INSERT_DECISION, row)
                            ids.append(0)
                        else:
                            await cur.execute(_INSERT_FEEDBACK, row)
                            found = await cur.fetchone()
                            ids.append(int(found[0]) if found else 0)
                    return ids
        except psycopg.OperationalError as e:
            if not began:
                raise _Unsent() from e
            raise
        except psycopg.IntegrityError as e:
            if len(batch) > 1:
                return [r for item in batch for r in await self._write(conn, [item])]
            return [StoreClosed(f"decision log write failed: {one_line(e)}")]

    async def _shutdown(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=30)
        for conn in [*self._idle, self._reader]:
            if conn is not None and not conn.closed:
                await conn.close()
        self._idle = []
        self._reader = None

    # ------------------------------------------------------------------ reads
    async def _read(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """A query on the reader connection (replaced when stale; on a connection error, once more
        on a new one: a read is safe to repeat)."""
        async with self._reader_lock:
            for attempt in (0, 1):
                try:
                    self._reader = await self._fresh(self._reader, autocommit=True)
                    cur = await self._reader.execute(sql, params)  # type: ignore[arg-type]
                    return await cur.fetchall()
                except psycopg.Error as e:
                    if self._reader is not None and isinstance(e, psycopg.OperationalError):
                        await self._reader.close()
                    if attempt == 1 or not isinstance(e, psycopg.OperationalError) or self._reader is None:
                        raise StoreClosed(f"decision log {self.where}: {one_line(e)}") from None
            raise AssertionError("unreachable")

    async def get_decision(self, decision_id: str, tenant: str | None) -> dict[str, Any] | None:
        if tenant is None:
            rows = await self._read(_GET_DECISION, (decision_id,))
        else:
            rows = await self._read(_GET_TENANT_DECISION, (decision_id, tenant))
        if not rows:
            return None
        feedback = await self._read(_RECORD_FEEDBACK, (decision_id,))
        return decision_record(json.loads(rows[0][0]), rows[0][1], feedback)

    async def owner(self, decision_id: str) -> str | None:
        rows = await self._read(_OWNER, (decision_id,))
        return None if not rows else str(rows[0][0])

    async def lookup(self, decision_id: str) -> DecisionRef | None:
        rows = await self._read(_LOOKUP, (decision_id,))
        return decision_ref(rows[0] if rows else None)

    async def keyed_since(self, since: float) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        decisions = await self._read(_KEYED_DECISIONS, (id_floor(since), since))
        feedback = await self._read(_KEYED_FEEDBACK, (since,))
        return [tuple(r) for r in decisions], [tuple(r) for r in feedback]

    async def register_catalog(self, key: str, offering_ids: list[str]) -> None:
        await self._read(_REGISTER_CATALOG, (key, json.dumps(offering_ids)))

    async def healthy(self) -> bool:
        """The readiness probe (run every ``ready_probe_s`` by the app, whatever the traffic): the
        server answers on the reader connection and is not a standby in recovery (it could not
        commit); idle writer connections the server closed are dropped, so the next commit opens
        a new one rather than failing on them. A success clears the last commit's error."""
        if self.closed:
            return False
        dead = []
        for i, conn in enumerate(self._idle):  # (no await in this loop: the list is the commits' too)
            if conn is not None and _stale(conn):
                self._idle[i] = None
                dead.append(conn)
        for conn in dead:
            if not conn.closed:
                await conn.close()
        try:
            rows = await asyncio.wait_for(self._read("SELECT pg_is_in_recovery()", ()), self.probe_timeout_s)
        except (StoreClosed, TimeoutError) as e:
            self.error = (f"decision log {self.where}: no answer within {self.probe_timeout_s:g} s"
                          if isinstance(e, TimeoutError) else str(e))
            return False
        if rows and rows[0][0]:
            self.error = f"decision log {self.where}: the server is in recovery (read-only)"
            return False
        self.error = None
        return True

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "url": self.where}

