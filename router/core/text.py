"""How the router shows what went wrong and where: an error as one line, a server's URL without its
credentials. Every store, the shared state's backends and the commands use these two, so a
message never spans lines and a password never reaches a log, an answer or ``/v1/admin/status``."""

from __future__ import annotations

from urllib.parse import urlsplit

#: the longest :func:`one_line` answers
ONE_LINE_MAX = 300


def one_line(e: BaseException) -> str:
    """``e`` as one line: its class and its message with every run of whitespace one space (the
    class alone when it has no message), at most :data:`ONE_LINE_MAX` characters. The drivers'
    messages name a server's host and port, never its password (psycopg, redis-py, sqlite3)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:ONE_LINE_MAX] if text else type(e).__name__


def redact(url: str) -> str:
    """``url`` as it may be shown or logged: scheme, host, port and path -- never a password, nor a
    query (where libpq also takes ``password=`` and ``passfile=``) or a fragment.

    A PostgreSQL URL is read by libpq's own parser (psycopg's ``conninfo_to_dict``: every form libpq
    accepts, several hosts included) and keeps its user, which is part of *which* log it names
    (``router.service.recovery.log_identity`` hashes this form): ``postgresql://user@host:port/db``.
    Other URLs (Redis/Valkey) show no user: ``redis://host:port/db``."""
    if url.startswith(("postgresql://", "postgres://")):
        import psycopg  # (the PostgreSQL client only where a PostgreSQL URL is shown)
        from psycopg.conninfo import conninfo_to_dict

        try:
            info = conninfo_to_dict(url)
        except psycopg.ProgrammingError:
            return "postgresql://(unparsable URL)"
        user = f"{info['user']}@" if info.get("user") else ""
        port = f":{info['port']}" if info.get("port") else ""
        return f"postgresql://{user}{info.get('host') or ''}{port}/{info.get('dbname') or ''}"
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme.replace("+", "").isalnum():  # not a URL: nothing of it is shown
        return "(unparsable URL)"
    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = f":{u.port}" if u.port else ""
    except ValueError:
        return f"{scheme}://(unparsable URL)"
    return f"{u.scheme}://{host}{port}{u.path}"
