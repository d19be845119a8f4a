"""One SQL dialect for every store on the decision log's backends -- SQLite (a file path) or
PostgreSQL (a ``postgresql://`` URL): the decision log (``router.store.sqlite``,
``router.store.postgres``), the policy and access documents (``router.store.policies``), the pool
events and migrations (``router.store.migrations``), the audit log (``router.store.audit``) and the
one-off reads of the log (restarts, exports, the dry run).

Contracts:

- SQL is written once, in SQLite's spelling: ``?`` placeholders, and in a schema the type fields
  ``{real}``, ``{bigint}``, ``{blob}`` and ``{serial}`` (:meth:`Dialect.ddl`). :meth:`Dialect.sql`
  gives a statement in the backend's spelling (PostgreSQL's ``%s``), so a statement never holds a
  literal ``?`` or ``%``: values are parameters. Upserts use the form both accept (``INSERT ... ON
  CONFLICT DO NOTHING``).
- The columns added to a table since it was first created are added when a store opens it
  (:func:`add_columns`; the old rows hold NULL there), on either backend.
- A SQLite connection (:func:`connect_sqlite`) runs in WAL mode with ``synchronous`` (``FULL`` by
  default: a commit is fsynced before it returns) and waits up to ``busy_s`` for another writer.
- :class:`Database` is the blocking connection of the small stores (policies, access documents,
  migrations), one call at a time: opened with its schema -- on PostgreSQL in a transaction under
  the store's advisory lock, so routers starting together do not race -- and reopened by the next
  call after a PostgreSQL connection failed. :meth:`Database.transaction` holds the backend's write
  lock (SQLite ``BEGIN IMMEDIATE``; PostgreSQL the store's transaction-scoped advisory lock, unless
  the store's writes need none) and has committed, durably, when it returns. A database error
  comes out as the store's own exception, one line, the URL redacted (``router.core.text``).
- :func:`reading` opens the log for one-off reads on either backend; :func:`stream` reads a long
  result in pages (a PostgreSQL server-side cursor).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from router.core.text import one_line, redact

#: ``execute(sql, args=())``: a statement (``?`` placeholders) run on a store's connection; returns the cursor
Execute = Callable[..., Any]
#: columns added since a table was first created: (name, SQLite type)
Columns = Sequence[tuple[str, str]]


def is_postgres_url(target: object) -> TypeGuard[str]:
    """Whether a store's target names PostgreSQL (else it is a SQLite file)."""
    return isinstance(target, str) and target.startswith(("postgresql://", "postgres://"))


@dataclass(frozen=True, eq=False)
class Dialect:
    """How one backend spells what the stores write once (module docstring)."""

    #: "sqlite" or "postgresql"
    name: str
    #: the parameter marker
    param: str
    #: what a schema's type fields become
    types: dict[str, str] = field(repr=False)
    #: the backend's names of SQLite's column types (those it spells differently)
    renames: dict[str, str] = field(repr=False)

    def sql(self, text: str) -> str:
        """``text`` (``?`` placeholders) in this backend's spelling."""
        return text if self.param == "?" else text.replace("?", self.param)

    def ddl(self, template: str, **names: str) -> str:
        """A schema with its ``{real}``, ``{bigint}``, ``{blob}`` and ``{serial}`` fields filled in
        (and any other field from ``names``: a table's name)."""
        return template.format(**self.types, **names)

    def type(self, sqlite_type: str) -> str:
        """This backend's name of a SQLite column type."""
        return self.renames.get(sqlite_type, sqlite_type)

    def insert(self, table: str, columns: Sequence[str], suffix: str = "") -> str:
        """``INSERT INTO table (columns) VALUES (...)``, one parameter per column, then ``suffix``."""
        return self.sql(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}){suffix}")

    def add_columns_sql(self, table: str, columns: Columns) -> list[str]:
        """PostgreSQL's statements adding ``columns`` to ``table`` where they are missing."""
        assert self is POSTGRESQL, "SQLite has no ADD COLUMN IF NOT EXISTS: use add_columns"
        return [f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name} {self.type(kind)}" for name, kind in columns]


SQLITE = Dialect("sqlite", "?", {"real": "REAL", "bigint": "INTEGER", "blob": "BLOB",
                                 "serial": "INTEGER PRIMARY KEY AUTOINCREMENT"}, {})
POSTGRESQL = Dialect("postgresql", "%s", {"real": "DOUBLE PRECISION", "bigint": "BIGINT", "blob": "BYTEA",
                                          "serial": "BIGSERIAL PRIMARY KEY"},
                     {"REAL": "DOUBLE PRECISION", "BLOB": "BYTEA"})


def dialect_of(target: Path | str) -> Dialect:
    return POSTGRESQL if is_postgres_url(target) else SQLITE


def add_columns(execute: Execute, dialect: Dialect, table: str, columns: Columns) -> None:
    """Add to ``table`` those of ``columns`` it lacks (a table created by an earlier version). On
    SQLite, ``execute`` must be an autocommit connection's (the check and the additions are one
    transaction under the write lock)."""
    if dialect is POSTGRESQL:
        for stmt in dialect.add_columns_sql(table, columns):
            execute(stmt)
        return
    # Under the write lock: another process opening the same file at once (two routers, a router and
    # its tools) must not read the old columns, wait for the lock and then add a column it has added.
    execute("BEGIN IMMEDIATE")
    try:
        have = {r[1] for r in execute(f"PRAGMA table_info({table})")}
        for name, kind in columns:
            if name not in have:
                execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
    except BaseException:
        execute("ROLLBACK")
        raise
    execute("COMMIT")


def connect_sqlite(path: Path, synchronous: str = "FULL", readonly: bool = False,
                   busy_s: float = 5.0) -> sqlite3.Connection:
    """A connection to the SQLite file ``path`` (module docstring); ``readonly`` opens an existing
    file for reads only. Statements autocommit unless inside an explicit ``BEGIN``."""
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False, isolation_level=None,
                               timeout=busy_s)
    else:
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=busy_s)
        conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute(f"PRAGMA busy_timeout={round(busy_s * 1000)}")
    return conn


@contextmanager
def reading(target: Path | str, timeout_s: float = 10.0) -> Iterator[Callable[..., list[Any]]]:
    """The decision log ``target`` opened for one-off reads: yields ``query(sql, args=()) -> rows``
    (``?`` placeholders). Raises the driver's errors (``sqlite3.Error``, ``psycopg.Error``)."""
    if is_postgres_url(target):
        import psycopg  # (the PostgreSQL client only where a PostgreSQL log is read)

        with psycopg.connect(target, connect_timeout=max(1, round(timeout_s))) as pg:
            yield lambda sql, args=(): pg.execute(POSTGRESQL.sql(sql), args).fetchall()
        return
    conn = connect_sqlite(Path(target), readonly=True)
    try:
        yield lambda sql, args=(): conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def stream(target: Path | str, sql: str, args: tuple[Any, ...] = (), timeout_s: float = 10.0
           ) -> Iterator[tuple[Any, ...]]:
    """The rows of one query (``?`` placeholders) on the log ``target``, read as they are consumed
    (PostgreSQL: a server-side cursor, in pages; SQLite: its cursor)."""
    if is_postgres_url(target):
        import psycopg

        with psycopg.connect(target, connect_timeout=max(1, round(timeout_s))) as pg, \
                pg.cursor(name="xroute_export") as cur:
            cur.execute(POSTGRESQL.sql(sql), args)  # type: ignore[arg-type]
            yield from cur
        return
    conn = connect_sqlite(Path(target), readonly=True)
    try:
        yield from conn.execute(sql, args)
    finally:
        conn.close()


class Database:
    """A store's blocking connection on SQLite or PostgreSQL (module docstring). ``schema(dialect)``:
    the store's tables; ``added``: per table, the columns added since it was first created;
    ``lock``: the PostgreSQL advisory lock key its schema is created (and, with
    :meth:`transaction`'s ``lock``, its writes are serialized) under; ``error``: its exception
    type, raised with ``label``, where it is and what failed, as one line."""

    def __init__(self, target: Path | str, schema: Callable[[Dialect], str], *, lock: int, application: str,
                 error: type[Exception], label: str, added: Sequence[tuple[str, Columns]] = ()):
        self.target = target
        self.dialect = dialect_of(target)
        self.where = redact(target) if is_postgres_url(target) else str(target)
        self._schema, self._added, self._lock_key = schema, added, lock
        self._application, self._error, self._label = application, error, label
        self._conn: Any = None
        self._lock = threading.Lock()
        with self._lock:
            self._connect()

    def fail(self, e: BaseException) -> Exception:
        """The store's exception for ``e``."""
        return self._error(f"{self._label} {self.where}: {one_line(e)}")

    def _connect(self) -> Any:
        if self._conn is not None and not (self.dialect is POSTGRESQL and self._conn.closed):
            return self._conn
        try:
            self._conn = self._open_sqlite() if self.dialect is SQLITE else self._open_postgres()
        except Exception as e:
            raise self.fail(e) from None
        return self._conn

    def _open_sqlite(self) -> sqlite3.Connection:
        path = Path(self.target)
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = connect_sqlite(path, busy_s=10.0)
        conn.executescript(self._schema(SQLITE))
        for table, columns in self._added:
            add_columns(conn.execute, SQLITE, table, columns)
        return conn

    def _open_postgres(self) -> Any:
        import psycopg  # (the PostgreSQL client only where a PostgreSQL store is opened)

        conn = psycopg.connect(str(self.target), autocommit=True, connect_timeout=5,
                               application_name=self._application)
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (self._lock_key,))
            conn.execute(self._schema(POSTGRESQL))  # type: ignore[arg-type]
            for table, columns in self._added:
                add_columns(conn.execute, POSTGRESQL, table, columns)
        return conn

    def _drop(self) -> None:
        """Forget a PostgreSQL connection that failed (the next call opens a new one)."""
        if self.dialect is POSTGRESQL and self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """The rows of one statement (``?`` placeholders), outside any transaction."""
        with self._lock:
            conn = self._connect()
            try:
                return list(conn.execute(self.dialect.sql(sql), args).fetchall())
            except Exception as e:
                self._drop()
                raise self.fail(e) from None

    @contextmanager
    def transaction(self, lock: bool = True) -> Iterator[Execute]:
        """A write transaction (module docstring): yields ``execute(sql, args=())``; committed when
        the block ends, rolled back when it raises (what it raised goes on; a database error as the
        store's exception). ``lock``: on PostgreSQL, under the store's advisory lock."""
        with self._lock:
            conn = self._connect()

            def execute(sql: str, args: tuple[Any, ...] = ()) -> Any:
                return conn.execute(self.dialect.sql(sql), args)

            if self.dialect is SQLITE:
                with self._sqlite_transaction(conn):
                    yield execute
                return
            import psycopg

            try:
                with conn.transaction():
                    if lock:
                        conn.execute("SELECT pg_advisory_xact_lock(%s)", (self._lock_key,))
                    yield execute
            except psycopg.Error as e:
                self._drop()
                raise self.fail(e) from None

    @contextmanager
    def _sqlite_transaction(self, conn: sqlite3.Connection) -> Iterator[None]:
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise self.fail(e) from None
        try:
            yield
        except BaseException as e:
            _rollback(conn)
            if isinstance(e, sqlite3.Error):
                raise self.fail(e) from None
            raise
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            _rollback(conn)
            raise self.fail(e) from None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _rollback(conn: sqlite3.Connection) -> None:
    try:
        conn.execute("ROLLBACK")
    except sqlite3.Error:  # SQLite rolled the transaction back itself (a full disk, an I/O error)
        pass
