"""The decision log: SQLite in WAL mode with *group commit*, written by a writer process.

Durable before acknowledged: a request appends its row to the pending batch and awaits a future.
The first request of an event-loop iteration schedules one flush for the end of that iteration;
the flush hands every pending row (up to ``batch_max``) to the backend as one transaction, and the
futures resolve only once that transaction has committed -- so no decision is answered before the
commit holding it has returned, and under load one commit (one fsync) covers every decision made
in the same loop iteration. :class:`GroupCommitLog` is that machinery and the interface every
backend implements (record, read, describe, close); :class:`DecisionStore` is the SQLite backend
(the embedded default) and ``router.store.postgres.PostgresLog`` the PostgreSQL one.

SQLite's commits run in a writer *process* (spawned, so nothing of the server is forked): it gets
each batch over a pipe, compresses, inserts, commits, and answers over the pipe; the event loop
reads the answer like any socket. Up to two batches are at the writer at once
(``PROCESS_BATCHES_IN_FLIGHT``), each its own transaction, committed and answered in order: the
writer starts the next commit when one ends rather than after the server has read the answer and
sent what queued meanwhile. Nothing it does competes with the event loop for the GIL. It exits when
the server closes the pipe or dies (tested: no orphan after ``kill -9``); if it dies, every waiting
and later request fails with :class:`StoreClosed` (503) and ``/readyz`` says so. The writer says
when it has its connection (the first message on the pipe), and :meth:`DecisionStore.started`
waits for that: a router serves once its log can commit, so its first decisions do not wait out
an interpreter's start (seconds on a loaded machine). It is the only
writer: a writer thread and commits on the event loop were measured against it and dropped
(``docs/results.md``, "Figures behind the code", decision log).

WAL checkpoints: a checkpointer thread in the writer process copies the WAL into the database every
``checkpoint_s / 4`` seconds, concurrently with the commits (the copy and its fsync never sit
inside a request's commit). On its own it never *finishes* under a steady stream of commits, and
SQLite only rewinds a fully checkpointed WAL, so the WAL would grow without bound under load. So
once ``checkpoint_rows`` rows or ``checkpoint_s`` seconds have gone by, the writer itself runs a
checkpoint right after a batch is acknowledged: with no other writer it completes (copying only
what arrived since the checkpointer's last pass), and the next commit rewinds the WAL, which stays
a few MB (``journal_size_limit`` trims it after a burst).

Those checkpoints pause the commits (the batches behind one wait for it), so they are small and
frequent: every 500 rows or 0.25 s by default (larger ones held the commits for much longer once
the disk slowed down: the figures are in ``docs/results.md``). Their durations are the metric
``xroute_router_log_checkpoint_seconds`` (``on_checkpoint``).

``synchronous=FULL`` (the default) fsyncs the WAL at every commit, so an acknowledged decision
survives a power loss or kernel crash, not only a killed process. ``NORMAL`` in WAL mode skips that
fsync: still safe against ``kill -9`` (the bytes are in the OS page cache once the commit returns)
but a power loss may drop the last commits.

The answer sent for each decision is stored as it was sent, compressed by the writer with
Zstandard against a raw-content dictionary (:meth:`DecisionStore.use_dictionary`: the catalog's
offering objects and the response's constant parts, kept in table ``zdicts`` with its codec so old
rows stay readable after the catalog changes), so a row fits a B-tree page several times over
instead of taking one to itself; the OPE record (``features``) is compressed too, without a
dictionary. Zstandard rather than the standard library's deflate: it costs the writer a fraction of
deflate's CPU a row for a few bytes more (``docs/results.md``). Rows written by older versions
hold the JSON text (no dictionary) or deflate against a ``zlib`` dictionary; both stay readable.

Reads (``GET /v1/decisions/{id}``, export) use a separate connection; WAL lets them run while a
transaction is open, and they only ever see committed transactions.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import multiprocessing
import pickle
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zstandard

from router.core.logs import configure_logging, id_floor
from router.core.settings import CHECKPOINT_ROWS, CHECKPOINT_S
from router.store.dialect import SQLITE, add_columns, connect_sqlite, reading
from router.store.rows import (
    ADDED_COLUMNS,
    ADDED_INDEXES,
    CATALOGS_SQL,
    DECISION_COLUMNS,
    FEEDBACK_COLUMNS,
    GET_DECISION_SQL,
    GET_TENANT_DECISION_SQL,
    KEYED_DECISIONS_SQL,
    KEYED_FEEDBACK_COLUMNS,
    LOOKUP_SQL,
    OWNER_SQL,
    RECORD_FEEDBACK_SQL,
    REGISTER_CATALOG_SQL,
    TABLES,
    DecisionRef,
    DecisionRow,
    decision_record,
    decision_ref,
)
from xroute.errors import ConfigError

#: SQLite's own table: the dictionaries the answers are compressed against
ZDICTS = """
CREATE TABLE IF NOT EXISTS zdicts (
    zdict_id INTEGER PRIMARY KEY,
    sha256 TEXT NOT NULL UNIQUE,
    data BLOB NOT NULL,
    codec TEXT NOT NULL DEFAULT 'zlib'
);
"""
SCHEMA = SQLITE.ddl(TABLES, answer="BLOB", answer_dictionary=",\n    response_zdict INTEGER REFERENCES zdicts(zdict_id)"
                    ) + ZDICTS
#: columns added since the first release of each table (``rows.ADDED_COLUMNS``, and SQLite's own)
_ADDED = {**ADDED_COLUMNS, "decisions": (*ADDED_COLUMNS["decisions"],
                                         ("response_zdict", "INTEGER REFERENCES zdicts(zdict_id)")),
          "zdicts": (("codec", "TEXT NOT NULL DEFAULT 'zlib'"),)}
#: where a decision row holds its OPE record (compressed by the SQLite writer)
_FEATURES = DECISION_COLUMNS.index("features")
#: ... and its answer (compressed against the dictionary)
_ANSWER = DECISION_COLUMNS.index("response_json")
_INSERT_DECISION = SQLITE.insert("decisions", (*DECISION_COLUMNS, "response_zdict"))
_INSERT_FEEDBACK = SQLITE.insert("feedback", FEEDBACK_COLUMNS)
_GET_DECISION = GET_DECISION_SQL.format(z=", response_zdict")
_GET_TENANT_DECISION = GET_TENANT_DECISION_SQL.format(z=", response_zdict")
_KEYED_DECISIONS = KEYED_DECISIONS_SQL.format(z=", response_zdict")
#: the dictionary size kept (deflate's window, the most older logs' ``zlib`` dictionaries use)
ZDICT_MAX = 32768
#: Zstandard level for the answers (the levels' sizes and costs: ``docs/results.md``, "Figures behind the code")
ZSTD_LEVEL = 3
#: ... and for the decisions' OPE records (``router.decision.ope_log``; float32 rows: no dictionary, the fastest level)
FEATURES_ZSTD_LEVEL = 1

#: batches sent to the writer process before the first is acknowledged. Two, so the
#: writer starts the next commit as soon as one ends instead of waiting for the server to read the
#: acknowledgement and send what queued meanwhile
PROCESS_BATCHES_IN_FLIGHT = 2


def _dumps(obj: Any) -> bytes:
    """What goes over the writer process's pipe: plain pickle (``Connection.send`` builds a
    ``ForkingPickler`` per message, ~3x the cost for a batch of rows)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class StoreFormatError(ConfigError):
    """The decision log on disk has a format this version does not write."""


class StoreClosed(RuntimeError):
    """The writer is stopped (shutting down) or has failed; nothing more can be recorded."""


class CommitInDoubt(StoreClosed):
    """The log went away while a batch's transaction was under way: its ``COMMIT`` may have been
    applied with the answer lost (PostgreSQL stopped mid-commit, the SQLite writer process killed
    after its ``COMMIT``). Answered 503 like :class:`StoreClosed`; a keyed request's key stays
    pending -- its retries get 409, never a second decision -- until the log, readable again, says
    whether the row is there (``router.service.admission.settle``)."""


Item = tuple[str, tuple[Any, ...], "asyncio.Future[int]"]
#: what a backend answers for each row of a batch: the row's id (a feedback row's; 0 for a decision)
#: or the exception its request gets
Result = int | BaseException


class GroupCommitLog:
    """The decision log's interface and its group commit on the event loop (module docstring).

    ``record_*`` must be called on the event loop that called :meth:`start`; the future they return
    resolves once the row is committed (or raises :class:`StoreClosed`). A backend implements
    :meth:`_send` (hand a batch to its writer; :meth:`_done` answers it, on the loop), the reads,
    :meth:`describe` and :meth:`_shutdown`."""

    #: "sqlite" or "postgresql"
    backend = ""
    #: batches handed to the backend before the first is acknowledged
    max_in_flight = 2

    def __init__(self, batch_max: int = 512, on_commit: Callable[[int, float], None] | None = None):
        self.batch_max = batch_max
        self.on_commit = on_commit
        self._pending: list[Item] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        #: the batches handed to the backend and not yet acknowledged, oldest first
        self._in_flight_batches: collections.deque[list[Item]] = collections.deque()
        self._draining = False  # close(): no new rows, but what is pending still goes out
        self.error: str | None = None
        self.closed = False
        self.commits = 0
        self.rows = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def started(self) -> None:
        """After :meth:`start`: once the log can commit (a backend with a writer to wait for says so)."""

    # ------------------------------------------------------------------ writes
    # Plain functions returning the future rather than coroutines: ``await store.record_decision(row)``
    # reads the same, and the request's task resumes through two fewer coroutine frames.
    def _submit(self, kind: str, row: tuple[Any, ...]) -> asyncio.Future[int]:
        loop = self._loop
        if self.closed or self._draining or loop is None:
            raise StoreClosed("the decision log is not accepting writes")
        fut: asyncio.Future[int] = loop.create_future()
        self._pending.append((kind, row, fut))
        if not self._scheduled and len(self._in_flight_batches) < self.max_in_flight:
            self._scheduled = True
            loop.call_soon(self._flush)  # after every request of this loop iteration has queued its row
        return fut

    def record_decision(self, row: DecisionRow) -> asyncio.Future[int]:
        """Queue ``row`` for the next group commit; await the result to know it is durable. Raises
        :class:`StoreClosed` at once when the log accepts no writes. (The row goes to the backend
        as a plain tuple in ``DECISION_COLUMNS``' order, built here once.)"""
        return self._submit("decision", row.astuple())

    def record_feedback(self, row: tuple[Any, ...]) -> asyncio.Future[int]:
        """As :meth:`record_decision`; the awaited result is the feedback row's id. ``row`` follows
        ``FEEDBACK_COLUMNS``; a shorter one (a client's report) gets NULL for the columns it lacks."""
        if len(row) < len(FEEDBACK_COLUMNS):
            row = (*row, *(None,) * (len(FEEDBACK_COLUMNS) - len(row)))
        return self._submit("feedback", row)

    def _flush(self) -> None:
        self._scheduled = False
        while self._pending and len(self._in_flight_batches) < self.max_in_flight and not self.closed:
            batch, self._pending = self._pending[: self.batch_max], self._pending[self.batch_max:]
            self._in_flight_batches.append(batch)
            self._send(batch)

    def _send(self, batch: list[Item]) -> None:
        """Hand ``batch`` (already in ``_in_flight_batches``) to the backend's writer, which
        commits it as one transaction; :meth:`_done` is called on the loop with its results."""
        raise NotImplementedError

    def _done(self, batch: list[Item], results: list[Result]) -> None:
        """On the loop: answer the batch's requests, then hand over what queued meanwhile."""
        for i, b in enumerate(self._in_flight_batches):
            if b is batch:
                del self._in_flight_batches[i]
                break
        for (_, _, fut), r in zip(batch, results):
            if fut.done():  # cancelled (the client went away); its row is committed anyway
                continue
            if isinstance(r, BaseException):
                fut.set_exception(r)
            else:
                fut.set_result(r)
        if self._pending and not self._scheduled:
            self._flush()

    def _fail_all(self, why: str) -> None:
        """The writer is gone for good: nothing more can be recorded; every waiting request fails
        (those whose batch was at the writer in doubt: it may have committed them)."""
        self.error = why
        self.closed = True
        sent = [fut for batch in self._in_flight_batches for _, _, fut in batch]
        unsent = [fut for _, _, fut in self._pending]
        self._in_flight_batches.clear()
        self._pending = []
        for futs, err in ((sent, CommitInDoubt(why)), (unsent, StoreClosed(why))):
            for fut in futs:
                if not fut.done():
                    fut.set_exception(err)

    async def close(self, timeout: float = 30.0) -> None:
        """Commit what is pending and in flight (waiting up to ``timeout``), stop the writer, close."""
        if self.closed:
            await self._shutdown()
            return
        self._draining = True
        waiting = [fut for batch in self._in_flight_batches for _, _, fut in batch]
        waiting += [fut for _, _, fut in self._pending]
        if self._loop is not None and waiting:
            self._flush()
            await asyncio.wait(waiting, timeout=timeout)
        self.closed = True
        await self._shutdown()

    async def _shutdown(self) -> None:
        """Stop the writer and close the connections (once everything in flight is answered)."""

    # ------------------------------------------------------------------ reads
    async def get_decision(self, decision_id: str, tenant: str | None) -> dict[str, Any] | None:
        """The stored decision with its request and feedback; ``None`` if absent or (when
        ``tenant`` is given) owned by another tenant — callers cannot tell the two apart."""
        raise NotImplementedError

    async def owner(self, decision_id: str) -> str | None:
        """The tenant of a stored decision (None when there is none)."""
        raise NotImplementedError

    async def lookup(self, decision_id: str) -> DecisionRef | None:
        """What feedback needs of a stored decision (None when there is none)."""
        raise NotImplementedError

    async def keyed_since(self, since: float) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """The decisions and feedback made from wall time ``since`` on under an idempotency key (to
        restore the keys after a restart): ``(key, request_json, answer JSON text, created_at)`` and
        ``(key, feedback_id, decision_id, received_at, latency_ms, ttft_ms, cost_usd, output_tokens,
        failed, error)``."""
        raise NotImplementedError

    async def register_catalog(self, key: str, offering_ids: list[str]) -> None:
        """Keep the catalog's offering ids under ``key`` (``router.decision.ope_log.catalog_key``: the
        decisions' OPE records refer to offerings by their index in it), once per catalog."""
        raise NotImplementedError

    async def healthy(self) -> bool:
        """Whether the log can record now (``/readyz``)."""
        return self.error is None and not self.closed

    def describe(self) -> dict[str, Any]:
        """What ``/v1/admin/status`` shows of the log (never a credential)."""
        return {"backend": self.backend, "commits": self.commits, "rows": self.rows, "error": self.error}


def _zstd_dictionary(conn: sqlite3.Connection, data: bytes) -> tuple[int, Callable[[bytes], bytes]]:
    """Store dictionary ``data`` once (its ``sha256`` is of the codec's name, a NUL and the data;
    a ``zlib`` row's, of the data) and return its id and a compressor prepared with it."""
    sha = hashlib.sha256(b"zstd\0" + data).hexdigest()
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("INSERT OR IGNORE INTO zdicts (sha256, data, codec) VALUES (?, ?, 'zstd')", (sha, data))
        zid = int(conn.execute("SELECT zdict_id FROM zdicts WHERE sha256 = ?", (sha,)).fetchone()[0])
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    zdict = zstandard.ZstdCompressionDict(data, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    zdict.precompute_compress(level=ZSTD_LEVEL)  # once, not per row
    return zid, zstandard.ZstdCompressor(level=ZSTD_LEVEL, dict_data=zdict, write_checksum=True).compress


class DecisionStore(GroupCommitLog):
    """The SQLite decision log (the embedded default): WAL, group commit, the writer process
    (module docstring). Reads run on a separate connection in the server."""

    backend = "sqlite"
    max_in_flight = PROCESS_BATCHES_IN_FLIGHT

    def __init__(self, path: Path, synchronous: str = "FULL", batch_max: int = 512,
                 on_commit: Callable[[int, float], None] | None = None,
                 checkpoint_rows: int = CHECKPOINT_ROWS, checkpoint_s: float = CHECKPOINT_S,
                 on_checkpoint: Callable[[float], None] | None = None):
        super().__init__(batch_max, on_commit)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.synchronous = synchronous
        #: called on the loop with the seconds of each checkpoint the writer ran between commits
        #: (one acknowledgement late)
        self.on_checkpoint = on_checkpoint
        self.checkpoint_s = checkpoint_s
        self.checkpoint_rows = checkpoint_rows
        conn = self._conn = connect_sqlite(self.path, synchronous)
        conn.executescript(SCHEMA)
        cols = {r[1] for r in conn.execute("PRAGMA table_info(decisions)")}
        if "sla_ms" in cols and "ttft_ms" not in cols:  # before requests carried a TTFT/TPOT objective
            conn.close()
            raise StoreFormatError(f"{self.path}: this decision log was written by an earlier xroute (requests with "
                                   "sla_ms, not ttft_ms/tpot_ms); keep it for its records and start the router on a "
                                   "new --db path")
        for table, added in _ADDED.items():  # (a log written by an earlier version)
            add_columns(conn.execute, SQLITE, table, added)
        for stmt in ADDED_INDEXES:
            conn.execute(stmt)
        self._zdict: bytes | None = None
        self._decoders: dict[int, Callable[[bytes], bytes]] = {}
        self._reader = connect_sqlite(self.path, synchronous)
        self._proc: Any = None
        #: the writer process's first message (it has its connection): :meth:`started`
        self._ready: asyncio.Future[None] | None = None
        self._pipe: Any = None  # the writer's acknowledgements (read on the loop)
        self._batches: Any = None  # the batches (written blocking; never polled)
        self.checkpoints = 0

    def use_dictionary(self, data: bytes) -> int:
        """Compress the responses recorded from now on against ``data`` (its last ``ZDICT_MAX``
        bytes; put the most common strings last); call before :meth:`start`. Stored once per
        distinct dictionary; returns its id."""
        data = bytes(data[-ZDICT_MAX:])
        self._zdict = data
        return _zstd_dictionary(self._conn, data)[0]

    def _unpack(self, blob: bytes | str, zid: int | None) -> str:
        if zid is None:
            return blob if isinstance(blob, str) else bytes(blob).decode()
        decode = self._decoders.get(zid)
        if decode is None:
            found = self._reader.execute("SELECT data, codec FROM zdicts WHERE zdict_id = ?", (zid,)).fetchone()
            if found is None:
                raise sqlite3.DatabaseError(f"decision log: compression dictionary {zid} is missing")
            decode = self._decoders[zid] = _decoder(bytes(found[0]), str(found[1]))
        return decode(blob.encode() if isinstance(blob, str) else bytes(blob)).decode()

    def start(self) -> None:
        super().start()
        assert self._loop is not None
        self._conn.close()  # from now on the writer process writes
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the server is forked
        # two connections, one per direction: the loop polls the acknowledgements' (which makes that
        # socket non-blocking), while the batches go out on one that stays blocking -- a batch larger
        # than the socket's buffer (a few hundred decisions with their OPE records) is then written
        # whole, waiting for the writer to read on, instead of failing with EAGAIN half-written
        self._pipe, child = ctx.Pipe()
        self._batches, child_batches = ctx.Pipe()
        self._proc = ctx.Process(target=_writer_process, name="decision-log-writer", daemon=True,
                                 args=(child_batches, child, str(self.path), self.synchronous, self._zdict,
                                       self.checkpoint_rows, self.checkpoint_s))
        self._ready = self._loop.create_future()
        self._proc.start()
        child.close()
        child_batches.close()
        self._loop.add_reader(self._pipe.fileno(), self._on_ack)

    async def started(self) -> None:
        """Once the writer process has its connection (its first message); :class:`StoreClosed` when
        it exited first."""
        if self._ready is not None:
            await self._ready

    def _send(self, batch: list[Item]) -> None:
        try:
            self._batches.send_bytes(_dumps([(kind, row) for kind, row, _ in batch]))
        except (OSError, ValueError) as e:
            self._writer_gone(f"{type(e).__name__}: {e}")

    def _on_ack(self) -> None:
        """On the loop: the writer process's answer for the oldest batch in flight."""
        try:
            msg = pickle.loads(self._pipe.recv_bytes())
        except (EOFError, OSError) as e:
            self._writer_gone(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            return
        if self._ready is not None and not self._ready.done():  # (the writer's first message: it is up)
            self._ready.set_result(None)
            return
        results: list[Result] = [StoreClosed(f"decision log write failed: {r}") if isinstance(r, str) else r
                                 for r in msg["results"]]
        self.error = msg["error"]
        self.commits, self.rows, self.checkpoints = msg["commits"], msg["rows"], msg["checkpoints"]
        if self.on_commit is not None and msg["seconds"] is not None:
            self.on_commit(len(results), msg["seconds"])
        if self.on_checkpoint is not None:
            for seconds in msg["checkpoint_seconds"]:
                self.on_checkpoint(seconds)
        if self._in_flight_batches:
            self._done(self._in_flight_batches[0], results)

    def _writer_gone(self, why: str) -> None:
        """The writer process died: nothing more can be recorded; every waiting request fails."""
        if self._loop is not None and self._pipe is not None:
            try:
                self._loop.remove_reader(self._pipe.fileno())
            except (OSError, ValueError):
                pass
        self._fail_all(f"decision log writer process exited ({why})")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(StoreClosed(self.error or why))

    async def _shutdown(self) -> None:
        if self._proc is not None:
            proc, self._proc = self._proc, None
            try:
                if self._loop is not None:
                    self._loop.remove_reader(self._pipe.fileno())
                self._batches.send_bytes(_dumps(None))
            except (OSError, ValueError):
                pass
            await asyncio.to_thread(proc.join, 30)
            self._pipe.close()
            self._batches.close()
        else:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
        self._reader.close()

    # ------------------------------------------------------------------ reads
    async def get_decision(self, decision_id: str, tenant: str | None) -> dict[str, Any] | None:
        # (a local file: the read is short enough to run on the loop)
        if tenant is None:
            row = self._reader.execute(_GET_DECISION, (decision_id,)).fetchone()
        else:
            row = self._reader.execute(_GET_TENANT_DECISION, (decision_id, tenant)).fetchone()
        if row is None:
            return None
        feedback = self._reader.execute(RECORD_FEEDBACK_SQL, (decision_id,)).fetchall()
        return decision_record(json.loads(self._unpack(row[0], row[2])), row[1], feedback)

    async def owner(self, decision_id: str) -> str | None:
        row = self._reader.execute(OWNER_SQL, (decision_id,)).fetchone()
        return None if row is None else str(row[0])

    async def register_catalog(self, key: str, offering_ids: list[str]) -> None:
        self._reader.execute(REGISTER_CATALOG_SQL, (key, json.dumps(offering_ids)))

    async def lookup(self, decision_id: str) -> DecisionRef | None:
        return decision_ref(self._reader.execute(LOOKUP_SQL, (decision_id,)).fetchone())

    async def keyed_since(self, since: float) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        args = (id_floor(since), since)
        rows = self._reader.execute(_KEYED_DECISIONS, args).fetchall()
        decisions = [(k, rj, self._unpack(blob, zid), at) for k, rj, blob, zid, at in rows]
        # feedback from the newest back (its key is the row id: no scan of older rows)
        feedback = []
        for row in self._reader.execute(f"SELECT {KEYED_FEEDBACK_COLUMNS} FROM feedback ORDER BY feedback_id DESC"):
            if row[3] < since - 60.0:
                break
            if row[0] is not None and row[3] >= since:
                feedback.append(tuple(row))
        return decisions, feedback[::-1]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": str(self.path), "synchronous": self.synchronous,
                "checkpoints": self.checkpoints}


class _SqliteWriter:
    """The writer process's side of the SQLite log: one connection, the inserts and commits of
    each batch, and the WAL checkpoints between them (module docstring)."""

    def __init__(self, path: Path, synchronous: str, zdict: bytes | None, checkpoint_rows: int,
                 checkpoint_s: float, on_checkpoint: Callable[[float], None]):
        self.path, self.synchronous = path, synchronous
        self.conn = connect_sqlite(path, synchronous)
        # checkpoints (copying the WAL into the database, with an fsync even under NORMAL) run
        # between batches, never inside a request's commit
        self.conn.execute("PRAGMA wal_autocheckpoint=0")
        self.conn.execute(f"PRAGMA journal_size_limit={64 * 2**20}")
        self.zdict = None if zdict is None else _zstd_dictionary(self.conn, zdict)
        self._compress_features = zstandard.ZstdCompressor(level=FEATURES_ZSTD_LEVEL).compress
        self.checkpoint_rows, self.checkpoint_s, self.on_checkpoint = checkpoint_rows, checkpoint_s, on_checkpoint
        self._since_checkpoint = 0
        self._last_checkpoint = time.monotonic()
        self._checkpoint_stop = threading.Event()
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="decision-log-checkpoint",
                                              daemon=True)
        self._checkpointer.start()
        self.error: str | None = None
        self.commits = self.rows = self.checkpoints = 0

    def _pack(self, row: tuple[Any, ...]) -> tuple[Any, ...]:
        """A decision row as stored: with compression on (a dictionary is set), the OPE record
        compressed and the response (JSON text) compressed against the dictionary,
        plus the dictionary id."""
        zd = self.zdict
        if zd is None:
            return (*row, None)
        f = row[_FEATURES]
        return (*row[:_FEATURES], None if f is None else self._compress_features(f), *row[_FEATURES + 1:_ANSWER],
                zd[1](row[_ANSWER].encode()), *row[_ANSWER + 1:], zd[0])

    def write(self, batch: list[tuple[str, tuple[Any, ...]]]) -> list[int | str]:
        """Insert and commit ``batch`` in one transaction: each row's id, or the error (text) its
        request gets. A duplicate decision id fails alone, not the rows committed with it."""
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            if all(kind == "decision" for kind, _ in batch):
                conn.executemany(_INSERT_DECISION, [self._pack(row) for _, row in batch])
                ids = [0] * len(batch)
            else:
                ids = [conn.execute(*((_INSERT_DECISION, self._pack(row)) if kind == "decision"
                                      else (_INSERT_FEEDBACK, row))).lastrowid or 0
                       for kind, row in batch]
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if isinstance(e, sqlite3.IntegrityError) and len(batch) > 1:
                return [r for item in batch for r in self.write([item])]
            self.error = f"{type(e).__name__}: {e}"
            return [self.error] * len(batch)
        self.error = None
        self.commits += 1
        self.rows += len(batch)
        self._since_checkpoint += len(batch)
        return list(ids)

    def _checkpoint_loop(self) -> None:
        conn = connect_sqlite(self.path, self.synchronous)
        try:
            while not self._checkpoint_stop.wait(self.checkpoint_s / 4.0):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error:
                    pass  # busy or failing disk: the next round retries; commits are unaffected
        finally:
            conn.close()

    def maybe_checkpoint(self) -> None:
        """Checkpoint the WAL (after the batch was acknowledged) once enough rows or time have gone
        by since the last one."""
        if self._since_checkpoint == 0:
            return
        now = time.monotonic()
        if self._since_checkpoint < self.checkpoint_rows and now - self._last_checkpoint < self.checkpoint_s:
            return
        try:
            busy, frames, copied = self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error:
            return  # a failing disk: the next batch retries; commits are unaffected
        if busy or copied < frames:
            # the checkpointer thread held the checkpoint (a slow fsync on a busy disk): only a
            # complete checkpoint lets the next commit rewind the WAL, so the next batch retries
            return
        self._since_checkpoint = 0
        self._last_checkpoint = now
        self.checkpoints += 1
        self.on_checkpoint(time.monotonic() - now)

    def close(self) -> None:
        self._checkpoint_stop.set()
        self._checkpointer.join(timeout=30)
        try:
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass
        self.conn.close()


def read_catalogs(target: Path | str) -> dict[str, list[str]]:
    """The catalogs the log keeps (:meth:`GroupCommitLog.register_catalog`): key -> offering ids."""
    with reading(target) as query:
        try:
            rows = query(CATALOGS_SQL)
        except sqlite3.OperationalError:  # a log from before the table: no catalog kept
            rows = []
    return {str(k): list(json.loads(ids)) for k, ids in rows}


def _decoder(data: bytes, codec: str) -> Callable[[bytes], bytes]:
    """Decompression of the rows stored against dictionary ``data`` with ``codec``. (A Zstandard
    decompressor is not thread-safe: the reads run on the event loop only, ``async`` routes.)"""
    if codec == "zstd":
        d = zstandard.ZstdDecompressor(
            dict_data=zstandard.ZstdCompressionDict(data, dict_type=zstandard.DICT_TYPE_RAWCONTENT))
        return d.decompress  # type: ignore[no-any-return]
    if codec == "zlib":  # logs written before the Zstandard dictionaries

        def inflate(raw: bytes) -> bytes:
            d = zlib.decompressobj(zdict=data)
            return d.decompress(raw) + d.flush()

        return inflate
    raise sqlite3.DatabaseError(f"decision log: unknown compression codec {codec!r}")


def _writer_process(batches: Any, pipe: Any, path: str, synchronous: str, zdict: bytes | None,
                    checkpoint_rows: int, checkpoint_s: float) -> None:  # pragma: no cover - runs in the child (covered via the server tests)
    """Commit the batches the server sends, answer each after its COMMIT (module docstring).

    A separate interpreter, so the compression, the inserts and the commit never compete with the
    server's event loop for the GIL. Reads the batches on ``batches``, answers on ``pipe``. Exits
    when the server closes the pipe (or dies)."""
    configure_logging("WARNING")  # whatever this process says on stderr, as JSON lines
    checkpoint_seconds: list[float] = []  # since the last acknowledgement (each ran after one)
    writer = _SqliteWriter(Path(path), synchronous, zdict, checkpoint_rows, checkpoint_s, checkpoint_seconds.append)
    pipe.send_bytes(_dumps({"ready": True}))  # (DecisionStore.started: the server may serve now)
    try:
        while True:
            try:
                msg = pickle.loads(batches.recv_bytes())
            except (EOFError, OSError):
                break
            if msg is None:
                break
            t0 = time.perf_counter()
            results = writer.write(msg)
            ok = writer.error is None
            pipe.send_bytes(_dumps({"results": results, "error": writer.error, "commits": writer.commits,
                                    "rows": writer.rows, "checkpoints": writer.checkpoints,
                                    "checkpoint_seconds": checkpoint_seconds,
                                    "seconds": time.perf_counter() - t0 if ok else None}))
            checkpoint_seconds.clear()  # (already pickled into the acknowledgement)
            writer.maybe_checkpoint()
    finally:
        writer.close()
