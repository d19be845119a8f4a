"""The decision log: SQLite in WAL mode, written by one thread with *group commit*.

Durable before acknowledged: a request hands its row to the writer thread and awaits a future;
the writer takes every row waiting (up to ``batch_max``), writes them in one transaction, commits,
and only then resolves the futures of that batch — so no decision is answered before the commit
that holds it has returned. Under load, one commit (one fsync) covers many decisions.

``synchronous=FULL`` (the default) fsyncs the WAL at every commit, so an acknowledged decision
survives a power loss or kernel crash, not only a killed process. ``NORMAL`` in WAL mode skips that
fsync: still safe against ``kill -9`` (the bytes are in the OS page cache) but a power loss may drop
the last commits; it is offered for hosts whose disk cache makes fsync very slow, not as default.

Reads (``GET /v1/decisions/{id}``, export) use a separate connection; WAL lets them run while
the writer writes, and they only ever see committed transactions.
"""

from __future__ import annotations

import asyncio
import json
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS decisions (
    decision_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    telemetry_ts REAL NOT NULL,
    origin TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    max_output_tokens INTEGER NOT NULL,
    sla_ms REAL NOT NULL,
    session_id TEXT,
    offering_id TEXT NOT NULL,
    expected_latency_ms REAL NOT NULL,
    expected_cost_usd REAL NOT NULL,
    policy TEXT NOT NULL,
    policy_kind TEXT NOT NULL,
    policy_version TEXT,
    bundle_hash TEXT NOT NULL,
    request_json TEXT NOT NULL,
    response_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS decisions_tenant_time ON decisions (tenant, created_at);
CREATE TABLE IF NOT EXISTS feedback (
    feedback_id INTEGER PRIMARY KEY AUTOINCREMENT,
    decision_id TEXT NOT NULL REFERENCES decisions(decision_id),
    tenant TEXT NOT NULL,
    received_at REAL NOT NULL,
    latency_ms REAL,
    cost_usd REAL,
    output_tokens INTEGER,
    failed INTEGER NOT NULL,
    error TEXT
);
CREATE INDEX IF NOT EXISTS feedback_decision ON feedback (decision_id);
"""

DECISION_COLUMNS = ("decision_id", "tenant", "created_at", "telemetry_ts", "origin", "input_tokens",
                    "max_output_tokens", "sla_ms", "session_id", "offering_id", "expected_latency_ms",
                    "expected_cost_usd", "policy", "policy_kind", "policy_version", "bundle_hash",
                    "request_json", "response_json")
FEEDBACK_COLUMNS = ("decision_id", "tenant", "received_at", "latency_ms", "cost_usd", "output_tokens", "failed",
                    "error")
_INSERT_DECISION = (f"INSERT INTO decisions ({', '.join(DECISION_COLUMNS)}) "
                    f"VALUES ({', '.join('?' * len(DECISION_COLUMNS))})")
_INSERT_FEEDBACK = (f"INSERT INTO feedback ({', '.join(FEEDBACK_COLUMNS)}) "
                    f"VALUES ({', '.join('?' * len(FEEDBACK_COLUMNS))})")


class StoreClosed(RuntimeError):
    """The writer is stopped (shutting down) or has failed; nothing more can be recorded."""


def connect(path: Path, synchronous: str = "FULL", readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False, isolation_level=None)
    else:
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


class DecisionStore:
    """Append-only decision and feedback log with a group-committing writer thread.

    ``record_*`` must be awaited from the event loop that created the store; they resolve once the
    row is committed (or raise :class:`StoreClosed`/``sqlite3.Error``).
    """

    def __init__(self, path: Path, synchronous: str = "FULL", batch_max: int = 512,
                 on_commit: Callable[[int, float], None] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.synchronous = synchronous
        self.batch_max = batch_max
        self.on_commit = on_commit
        init = connect(self.path, synchronous)
        init.executescript(SCHEMA)
        init.close()
        self._reader = connect(self.path, synchronous)
        self._q: queue.SimpleQueue[tuple[str, tuple[Any, ...], asyncio.Future[int]] | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.closed = False
        self.commits = 0
        self.rows = 0

    # ------------------------------------------------------------------ writer
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="decision-log-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn = connect(self.path, self.synchronous)
        loop = self._loop
        assert loop is not None
        stop = False
        while not stop:
            item = self._q.get()
            if item is None:
                break
            batch = [item]
            while len(batch) < self.batch_max:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            t0 = time.perf_counter()
            results: list[int] | BaseException
            try:
                conn.execute("BEGIN IMMEDIATE")
                results = []
                for kind, row, _ in batch:
                    cur = conn.execute(_INSERT_DECISION if kind == "decision" else _INSERT_FEEDBACK, row)
                    results.append(cur.lastrowid or 0)
                conn.execute("COMMIT")
                self.commits += 1
                self.rows += len(batch)
            except BaseException as e:  # a failed commit fails every request of the batch, nothing else
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                results = e
            if self.on_commit is not None and not isinstance(results, BaseException):
                self.on_commit(len(batch), time.perf_counter() - t0)
            try:
                loop.call_soon_threadsafe(_resolve, batch, results)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                break
        conn.close()

    async def _submit(self, kind: str, row: tuple[Any, ...]) -> int:
        if self.closed or self._thread is None or not self._thread.is_alive():
            raise StoreClosed("the decision log is not accepting writes")
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._q.put((kind, row, fut))
        return await fut

    async def record_decision(self, row: tuple[Any, ...]) -> None:
        await self._submit("decision", row)

    async def record_feedback(self, row: tuple[Any, ...]) -> int:
        return await self._submit("feedback", row)

    def close(self) -> None:
        """Stop accepting writes, let the writer finish what it has, then close."""
        if self.closed:
            return
        self.closed = True
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=30)
        self._reader.close()

    # ------------------------------------------------------------------ reads
    def get_decision(self, decision_id: str, tenant: str | None) -> dict[str, Any] | None:
        """The stored decision with its request and feedback; ``None`` if absent or (when
        ``tenant`` is given) owned by another tenant — callers cannot tell the two apart."""
        if tenant is None:
            row = self._reader.execute("SELECT response_json, request_json FROM decisions WHERE decision_id = ?",
                                       (decision_id,)).fetchone()
        else:
            row = self._reader.execute(
                "SELECT response_json, request_json FROM decisions WHERE decision_id = ? AND tenant = ?",
                (decision_id, tenant)).fetchone()
        if row is None:
            return None
        out: dict[str, Any] = json.loads(row[0])
        out["request"] = json.loads(row[1])
        out["feedback"] = [
            {"feedback_id": r[0], "received_at": _iso(r[1]), "latency_ms": r[2], "cost_usd": r[3],
             "output_tokens": r[4], "failed": bool(r[5]), "error": r[6]}
            for r in self._reader.execute(
                "SELECT feedback_id, received_at, latency_ms, cost_usd, output_tokens, failed, error "
                "FROM feedback WHERE decision_id = ? ORDER BY feedback_id", (decision_id,))]
        return out

    def owner(self, decision_id: str) -> str | None:
        row = self._reader.execute("SELECT tenant FROM decisions WHERE decision_id = ?", (decision_id,)).fetchone()
        return None if row is None else str(row[0])


def _resolve(batch: list[tuple[str, tuple[Any, ...], asyncio.Future[int]]], results: list[int] | BaseException) -> None:
    for k, (_, _, fut) in enumerate(batch):
        if fut.done():  # the request was cancelled (client went away); its row is committed anyway
            continue
        if isinstance(results, BaseException):
            fut.set_exception(StoreClosed(f"decision log write failed: {type(results).__name__}: {results}"))
        else:
            fut.set_result(results[k])


def _iso(t: float) -> str:
    from router.telemetry import iso

    return iso(t)


def iter_decisions(path: Path, tenant: str | None = None) -> Iterator[dict[str, Any]]:
    """Every decision (oldest first) with its latest feedback, read-only (for export)."""
    conn = connect(Path(path), readonly=True)
    try:
        sql = (f"SELECT {', '.join('d.' + c for c in DECISION_COLUMNS if c != 'response_json')}, "
               "f.latency_ms, f.cost_usd, f.output_tokens, f.failed, f.error, f.received_at "
               "FROM decisions d LEFT JOIN feedback f ON f.feedback_id = "
               "(SELECT MAX(feedback_id) FROM feedback WHERE decision_id = d.decision_id)")
        params: tuple[Any, ...] = ()
        if tenant is not None:
            sql += " WHERE d.tenant = ?"
            params = (tenant,)
        sql += " ORDER BY d.created_at, d.decision_id"
        cols = [c for c in DECISION_COLUMNS if c != "response_json"] + [
            "observed_latency_ms", "observed_cost_usd", "observed_output_tokens", "failed", "error", "feedback_at"]
        for row in conn.execute(sql, params):
            yield dict(zip(cols, row))
    finally:
        conn.close()
