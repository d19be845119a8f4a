"""Prompts and completions, kept only for the tenants that opt in (``tenants.<name>.gateway.
store_prompts``; off by default).

They go to a SQLite file of their own (``gateway.transcripts_path``), not to the decision log: the
decision log is exported for retraining and shared with the operators who read decisions, while
transcripts are the users' data, with their own retention and access (delete the file, or rows by
tenant, without touching a decision). No log line ever holds them. Writes happen on one thread of
their own, after the answer has been sent (WAL, ``synchronous=NORMAL``: a crash may lose the last
transcripts, never a decision)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from router.store.dialect import connect_sqlite

SCHEMA = """
CREATE TABLE IF NOT EXISTS transcripts (
    decision_id TEXT PRIMARY KEY,
    request_id TEXT,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    kind TEXT NOT NULL,
    request TEXT NOT NULL,
    completion TEXT
);
CREATE INDEX IF NOT EXISTS transcripts_tenant_time ON transcripts (tenant, created_at);
"""


class TranscriptStore:
    """One SQLite file, written from one thread."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transcripts")
        self._conn: sqlite3.Connection | None = None
        self._pool.submit(self._open).result()

    def _open(self) -> None:
        conn = connect_sqlite(self.path, synchronous="NORMAL")
        conn.executescript(SCHEMA)
        self._conn = conn

    def _insert(self, row: tuple[Any, ...]) -> None:
        assert self._conn is not None
        self._conn.execute("INSERT OR REPLACE INTO transcripts VALUES (?, ?, ?, ?, ?, ?, ?)", row)

    async def put(self, decision_id: str, request_id: str | None, tenant: str, created_at: float, kind: str,
                  request: bytes, texts: dict[int, list[str]] | None) -> None:
        """Keep one request (its body as the client sent it) and its completion (the generated text
        of each choice, in order; None when there was none)."""
        completion = None if not texts else json.dumps(["".join(texts[i]) for i in sorted(texts)])
        row = (decision_id, request_id, tenant, created_at, kind, request.decode("utf-8", "replace"), completion)
        await asyncio.get_running_loop().run_in_executor(self._pool, self._insert, row)

    def close(self) -> None:
        def _close() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        self._pool.submit(_close).result()
        self._pool.shutdown(wait=True)
