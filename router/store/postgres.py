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
:func:`redact`.
"""

from __future__ import annotations

import asyncio
import json
import select
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from router.core.logs import id_floor
from router.store.sqlite import (
    ADDED_COLUMNS,
    DECISION_COLUMNS,
    FEEDBACK_COLUMNS,
    KEYED_DECISIONS_SQL,
    KEYED_FEEDBACK_SQL,
    LOOKUP_SQL,
    RECORD_FEEDBACK_SQL,
    REGISTER_CATALOG_SQL,
    CommitInDoubt,
    DecisionRef,
    GroupCommitLog,
    Item,
    Result,
    StoreClosed,
    decision_record,
    decision_ref,
    export_columns,
    export_params,
)

#: PostgreSQL's names of the SQLite types ``ADDED_COLUMNS`` uses
_PG_TYPES = {"REAL": "DOUBLE PRECISION", "BLOB": "BYTEA"}
SCHEMA = """
CREATE TABLE IF NOT EXISTS decisions (
    decision_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    telemetry_ts DOUBLE PRECISION NOT NULL,
    origin TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    max_output_tokens INTEGER NOT NULL,
    ttft_ms DOUBLE PRECISION NOT NULL,
    tpot_ms DOUBLE PRECISION NOT NULL,
    deadline_ms DOUBLE PRECISION,
    model TEXT NOT NULL,
    session_id TEXT,
    offering_id TEXT NOT NULL,
    expected_latency_ms DOUBLE PRECISION NOT NULL,
    expected_cost_usd DOUBLE PRECISION NOT NULL,
    policy TEXT NOT NULL,
    policy_kind TEXT NOT NULL,
    policy_version TEXT,
    bundle_hash TEXT NOT NULL,
    request_json TEXT NOT NULL,
    response_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS decisions_tenant_time ON decisions (tenant, created_at);
CREATE TABLE IF NOT EXISTS feedback (
    feedback_id BIGSERIAL PRIMARY KEY,
    decision_id TEXT NOT NULL REFERENCES decisions(decision_id),
    tenant TEXT NOT NULL,
    received_at DOUBLE PRECISION NOT NULL,
    latency_ms DOUBLE PRECISION,
    cost_usd DOUBLE PRECISION,
    output_tokens INTEGER,
    failed INTEGER NOT NULL,
    error TEXT
);
CREATE INDEX IF NOT EXISTS feedback_decision ON feedback (decision_id);
CREATE TABLE IF NOT EXISTS catalogs (
    catalog_key TEXT PRIMARY KEY,
    offering_ids TEXT NOT NULL
);
""" + "".join(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name} {_PG_TYPES.get(kind, kind)};\n"
              for table, added in ADDED_COLUMNS.items() for name, kind in added)
#: the advisory lock key under which the schema is created (routers starting together)
_SCHEMA_LOCK = 0x78726F757465  # "xroute"

_INSERT_DECISION = (f"INSERT INTO decisions ({', '.join(DECISION_COLUMNS)}) "
                    f"VALUES ({', '.join(['%s'] * len(DECISION_COLUMNS))})")
_INSERT_FEEDBACK = (f"INSERT INTO feedback ({', '.join(FEEDBACK_COLUMNS)}) "
                    f"VALUES ({', '.join(['%s'] * len(FEEDBACK_COLUMNS))}) RETURNING feedback_id")


def redact(url: str) -> str:
    """``url`` as it may be shown or logged: user, host, port and database only (never a password,
    nor any other parameter)."""
    try:
        info = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unparsable URL)"
    user = f"{info['user']}@" if info.get("user") else ""
    port = f":{info['port']}" if info.get("port") else ""
    return f"postgresql://{user}{info.get('host') or ''}{port}/{info.get('dbname') or ''}"


def one_line(e: BaseException) -> str:
    """A connection or server error as one line, without the URL (psycopg's messages name host and
    port, never the password)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:300]


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
            rows = await self._read("SELECT response_json, request_json FROM decisions WHERE decision_id = %s",
                                    (decision_id,))
        else:
            rows = await self._read("SELECT response_json, request_json FROM decisions WHERE decision_id = %s "
                                    "AND tenant = %s", (decision_id, tenant))
        if not rows:
            return None
        feedback = await self._read(RECORD_FEEDBACK_SQL.format(p="%s"), (decision_id,))
        return decision_record(json.loads(rows[0][0]), rows[0][1], feedback)

    async def owner(self, decision_id: str) -> str | None:
        rows = await self._read("SELECT tenant FROM decisions WHERE decision_id = %s", (decision_id,))
        return None if not rows else str(rows[0][0])

    async def lookup(self, decision_id: str) -> DecisionRef | None:
        rows = await self._read(LOOKUP_SQL.format(p="%s"), (decision_id,))
        return decision_ref(rows[0] if rows else None)

    async def keyed_since(self, since: float) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:

        decisions = await self._read(KEYED_DECISIONS_SQL.format(p="%s", z=""), (id_floor(since), since))
        feedback = await self._read(KEYED_FEEDBACK_SQL.replace("{p}", "%s") + " ORDER BY feedback_id", (since,))
        return [tuple(r) for r in decisions], [tuple(r) for r in feedback]

    async def register_catalog(self, key: str, offering_ids: list[str]) -> None:
        await self._read(REGISTER_CATALOG_SQL.format(p="%s") + " RETURNING catalog_key", (key, json.dumps(offering_ids)))

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


def iter_decisions(url: str, tenant: str | None = None, since: float | None = None, until: float | None = None,
                   ope: bool = False) -> Iterator[dict[str, Any]]:
    """Every decision (oldest first) with its latest feedback (for export), read in pages
    (``router.store.readers.iter_decisions``)."""
    sql, cols = export_columns("%s", tenant is not None, ope, since is not None, until is not None)
    with psycopg.connect(url, connect_timeout=10) as conn, conn.cursor(name="xroute_export") as cur:
        cur.execute(sql, export_params(tenant, since, until))  # type: ignore[arg-type]
        for row in cur:
            yield dict(zip(cols, row))
