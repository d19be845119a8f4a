"""A bundle directory's tables, read (validated), and written back as one journaled step.

Every file is written to a temporary name in the same directory, flushed and fsynced; a journal
(``.commit.json``) listing the renames is fsynced; then the files are moved into place with
``os.replace`` (Ctrl-C deferred meanwhile) and the journal removed. A crash before the journal
leaves the old bundle; after it, :func:`recover` (which every run calls first) completes the
renames. No reader ever sees a half-written table.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from xroute.bundle import validate_table
from xroute.errors import BundleError
from xroute.schema.telemetry import TABLE_SUFFIXES, TABLES, Table

JOURNAL = ".commit.json"
TS_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


def table_file(root: Path, name: str) -> Path | None:
    found = [root / f"{name}{s}" for s in TABLE_SUFFIXES if (root / f"{name}{s}").is_file()]
    if len(found) > 1:
        raise BundleError(str(root), f"table '{name}' is given twice ({', '.join(p.name for p in found)}); keep one")
    return found[0] if found else None


def read_tables(root: Path) -> dict[str, pd.DataFrame]:
    """The bundle tables already in ``root`` (validated, typed); absent tables are left out."""
    out = {}
    for name, table in TABLES.items():
        f = table_file(root, name)
        if f is None:
            continue
        try:
            df = pd.read_parquet(f) if f.name.endswith(".parquet") else pd.read_csv(f, dtype=str, keep_default_na=False)
        except Exception as e:  # pandas raises many types for unreadable files
            raise BundleError(f.name, f"cannot be read as a table ({type(e).__name__}: {e})") from e
        out[name] = validate_table(df, table, f.name)
    return out


def _serialize(df: pd.DataFrame, table: Table) -> pd.DataFrame:
    df = df.copy()
    for col in table.columns:
        if col.name not in df.columns:
            continue
        if col.kind == "ts":
            df[col.name] = pd.to_datetime(df[col.name], utc=True).dt.strftime(TS_FORMAT)
        elif col.kind in ("int", "flag"):
            df[col.name] = pd.to_numeric(df[col.name]).round().astype("Int64")
    return df



def _write_file(path: Path, df: pd.DataFrame | None = None, data: bytes | None = None) -> None:
    if df is not None:
        if path.name.endswith(".parquet.pending"):
            df.to_parquet(path, index=False)
        else:
            df.to_csv(path, index=False, compression="gzip" if ".csv.gz" in path.name else None)
    else:
        assert data is not None
        path.write_bytes(data)
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(root: Path) -> None:
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C until the block ends (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[Any] = []
    old = signal.signal(signal.SIGINT, lambda *a: got.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got:
            raise KeyboardInterrupt


def recover(root: Path) -> list[str]:
    """Finish a commit that a crash interrupted (or discard one that never reached its journal).
    Returns the files moved into place."""
    journal = root / JOURNAL
    moved = []
    if journal.is_file():
        try:
            pending = json.loads(journal.read_text())["pending"]
        except (ValueError, KeyError, TypeError):
            pending = []
        for tmp, final in pending:
            if (root / tmp).is_file():
                os.replace(root / tmp, root / final)
                moved.append(final)
        _fsync_dir(root)
        journal.unlink()
    for stray in root.glob(".*.pending"):
        stray.unlink()
    _fsync_dir(root)
    return moved


def commit(root: Path, tables: dict[str, tuple[pd.DataFrame, str]], files: dict[str, bytes],
           _crash_after: int | None = None) -> None:
    """Write ``tables`` (name -> (frame, suffix)) and ``files`` (name -> bytes) into ``root`` as one
    journaled step. ``_crash_after`` (tests) stops after that many renames, as a crash would."""
    pending: list[tuple[str, str]] = []
    for name, (df, suffix) in tables.items():
        tmp = root / f".{name}{suffix}.pending"
        _write_file(tmp, df=_serialize(df, TABLES[name]))
        pending.append((tmp.name, f"{name}{suffix}"))
    for name, data in files.items():
        tmp = root / f".{name}.pending"
        _write_file(tmp, data=data)
        pending.append((tmp.name, name))
    jtmp = root / f"{JOURNAL}.tmp"
    _write_file(jtmp, data=json.dumps({"pending": pending}).encode())
    with _sigint_deferred():
        os.replace(jtmp, root / JOURNAL)
        _fsync_dir(root)
        for i, (tmp_name, final) in enumerate(pending):
            if _crash_after is not None and i >= _crash_after:
                return
            os.replace(root / tmp_name, root / final)
        _fsync_dir(root)
        (root / JOURNAL).unlink()
        _fsync_dir(root)
