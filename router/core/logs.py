"""Structured logs: one JSON object per line, with the request id of the request being served.

Nothing here ever logs a header, a body or a key: the access log names the route, status,
duration, tenant and the ids (request id, W3C trace id), and errors name their class and message.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import os
import random
import sys
import threading
import time
from datetime import UTC, datetime

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
#: the request's W3C trace id (from its ``traceparent``; set by ``router.http.middleware``), for log lines that name it
trace_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("trace_id", default=None)

#: ids come from a PRNG seeded once from the OS: os.urandom is a system call, slow on some VMs, and
#: ids need uniqueness (128 bits), not secrecy (a decision is readable only with its tenant's key)
_ids = random.Random(os.urandom(32))


def new_id(bits: int = 128) -> str:
    return f"{_ids.getrandbits(bits):0{bits // 4}x}"


def new_sorted_id() -> str:
    """32 hex digits: milliseconds since the epoch (12), then 80 random bits. Ids made later sort
    later (to the millisecond), so the decision log's primary-key index grows at its right edge —
    one B-tree page per commit instead of one random page per row."""
    return f"{int(time.time() * 1000.0) & 0xFFFFFFFFFFFF:012x}{_ids.getrandbits(80):020x}"


ACCESS = logging.getLogger("xroute.router.access")
LOG = logging.getLogger("xroute.router")


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", "request_id", ...fields}``; ``extra={"fields": {...}}`` adds keys."""

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, object] = {
            "ts": iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id_var.get()
        if rid is not None:
            d["request_id"] = rid
        fields = getattr(record, "fields", None)
        if fields:
            d.update(fields)
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str, separators=(",", ":"))


class BufferedStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to a block-buffered stream and flushes at most every ``flush_s`` (and at once for
    warnings and errors): one ``write`` syscall per request was a tenth of the request's cost.
    The app's lifespan also flushes periodically and at shutdown; a ``kill -9`` can lose the last
    ``flush_s`` of access lines, never a decision (those are in the decision log)."""

    def __init__(self, fd: int = 2, flush_s: float = 0.25):
        super().__init__(open(fd, "w", buffering=1 << 16, closefd=False, encoding="utf-8"))
        self.flush_s = flush_s
        self._last = time.monotonic()

    def flush(self) -> None:
        now = time.monotonic()
        if now - self._last >= self.flush_s:
            self.force_flush(now)

    def force_flush(self, now: float | None = None) -> None:
        self._last = time.monotonic() if now is None else now
        super().flush()

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if record.levelno >= logging.WARNING:
            self.force_flush()


_handler: BufferedStreamHandler | None = None


def flush_logs() -> None:
    if _handler is not None:
        _handler.force_flush()


_XROUTE = logging.getLogger("xroute")
_ROUTER = LOG
_dumps = json.JSONEncoder(default=str, separators=(",", ":")).encode


def access(rid: str, method: str, route: str, status: int, ms: float, tenant: str | None = None,
           decision_id: str | None = None, trace_id: str | None = None) -> None:
    """The access line of one request: ``ACCESS.info("request", extra={"fields": {...}})`` with the
    request id, method, route, status, ms and, when known, tenant, decision id and trace id.

    When the only destination is the router's own handler, the same JSON line is written without
    the logging machinery (record, caller lookup, handler chain) and without a JSON encoder (the
    fixed keys are literals; the strings that can need escaping -- method, route, tenant -- are
    encoded once each and remembered): the same bytes for a fraction of the CPU
    (``docs/results.md``, "Figures behind the code"). Through ``logging`` otherwise (a test's
    capture, a custom handler)."""
    h = _handler
    if (h is None or ACCESS.disabled or ACCESS.handlers or ACCESS.filters or _ROUTER.handlers or _ROUTER.filters
            or _XROUTE.handlers != [h] or _XROUTE.filters or h.filters or _XROUTE.propagate
            or not ACCESS.isEnabledFor(logging.INFO) or h.level > logging.INFO):
        # the request id explicitly (the caller passes it; it may log outside the request's context)
        fields: dict[str, object] = {"request_id": rid, "method": method, "route": route, "status": status, "ms": ms}
        if tenant is not None:
            fields["tenant"] = tenant
        if decision_id is not None:
            fields["decision_id"] = decision_id
        if trace_id is not None:
            fields["trace_id"] = trace_id
        ACCESS.info("request", extra={"fields": fields})
        return
    # request_id, decision_id and trace_id are [A-Za-z0-9._:-] by construction (generated, or
    # checked by router.http.middleware); everything else goes through json_str
    line = (f'{{"ts":"{iso(time.time())}","level":"info","logger":"xroute.router.access","msg":"request",'
            f'"request_id":"{rid}","method":{json_str(method)},"route":{json_str(route)},"status":{status},"ms":{ms!r}')
    if tenant is not None:
        line += f',"tenant":{json_str(tenant)}'
    if decision_id is not None:
        line += f',"decision_id":"{decision_id}"'
    if trace_id is not None:
        line += f',"trace_id":"{trace_id}"'
    h.acquire()
    try:
        h.stream.write(line + "}" + h.terminator)
        h.flush()
    except (OSError, ValueError):  # a closed or broken stderr: dropped, as logging's handleError would
        pass
    finally:
        h.release()


_JSTR: dict[str, str] = {}


def json_str(s: str) -> str:
    """``s`` as a JSON string, remembered (methods, routes and tenants are few; at most 4096 kept)."""
    j = _JSTR.get(s)
    if j is None:
        j = _dumps(s)
        if len(_JSTR) < 4096:
            _JSTR[s] = j
    return j


def iso(t: float) -> str:
    """Seconds since the epoch as ISO-8601 UTC with milliseconds (``2024-01-01T00:00:00.123Z``).
    Log lines and answers use it (a routed request formats three): the part up to the second is cached."""
    frac, whole = math.modf(t)  # rounded to the microsecond first, as datetime.fromtimestamp does
    us = round(frac * 1e6)
    sec = int(whole)
    if us >= 1_000_000:
        sec, us = sec + 1, us - 1_000_000
    elif us < 0:
        sec, us = sec - 1, us + 1_000_000
    ms = us // 1000
    head = _iso_heads.get(sec)
    if head is None:
        if len(_iso_heads) > 64:
            _iso_heads.clear()
        head = _iso_heads[sec] = datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S.")
    return f"{head}{ms:03d}Z"


_iso_heads: dict[int, str] = {}  # the part up to the second, per second


def configure_logging(level: str = "INFO") -> None:
    """JSON lines on stderr for the router's and uvicorn's loggers, and for everything else that
    would write to stderr in this process (idempotent): the libraries' own loggers (psycopg's
    "error ignored ..." during an outage, asyncio's "Task exception was never retrieved", redis)
    through the root logger -- without a handler there, ``logging`` writes them as plain text --,
    Python warnings (``logging.captureWarnings``), exceptions no one could catch
    (``sys.unraisablehook``: "Exception ignored in ...") and those ending a thread
    (``threading.excepthook``)."""
    global _handler
    if _handler is None:
        _handler = BufferedStreamHandler()
        _handler.setFormatter(JsonFormatter())
    handler = _handler
    for name in ("xroute", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers = [handler]
        lg.setLevel(level.upper())
        lg.propagate = False
    logging.getLogger("uvicorn.access").disabled = True  # the router writes its own access log
    root = logging.getLogger()
    if handler not in root.handlers:  # (added, not replacing: a host application's handlers stay)
        root.addHandler(handler)
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger -> the root's handlers
    if sys.unraisablehook is sys.__unraisablehook__:  # (a host's own hooks, e.g. pytest's, are kept)
        sys.unraisablehook = _unraisable
    if threading.excepthook is threading.__excepthook__:
        threading.excepthook = _thread_exception


_LIBS = logging.getLogger("xroute.router.runtime")


def _unraisable(u: sys.UnraisableHookArgs) -> None:
    """``sys.unraisablehook``: an exception raised where nothing could catch it (a destructor, a
    callback at shutdown), logged as JSON instead of printed."""
    exc = u.exc_value if u.exc_value is not None else u.exc_type()
    _LIBS.warning(f"{u.err_msg or 'Exception ignored in'}: {u.object!r}"[:500],
                  exc_info=(u.exc_type, exc, u.exc_traceback))


def _thread_exception(a: threading.ExceptHookArgs) -> None:
    """``threading.excepthook``: a thread ended by an exception, logged as JSON."""
    if a.exc_type is SystemExit:
        return
    name = a.thread.name if a.thread is not None else "?"
    _LIBS.error(f"exception in thread {name}", exc_info=(a.exc_type, a.exc_value, a.exc_traceback))  # type: ignore[arg-type]


def id_floor(since: float) -> str:
    """The smallest decision id made at wall time ``since`` or later, less a minute (ids are
    ``d_`` + 12 hex digits of milliseconds + random bits: :func:`new_sorted_id`)."""
    return f"d_{max(0, int((since - 60.0) * 1000.0)):012x}"
