"""OpenTelemetry traces, off by default (docs/observability.md).

Contract: with ``tracing.enabled`` false (the default) nothing here imports ``opentelemetry``
(the package is an optional extra, ``xroute[otel]``) and every call site costs one check of the
module flag :data:`ON` -- the hot path is unchanged. :func:`setup` with tracing enabled imports
``router.core.otel`` (the SDK, its OTLP/HTTP exporter) and turns :data:`ON` true; the helpers
below may then be called (they assume it: check :data:`ON` first).

Spans (names and attributes: docs/observability.md): the HTTP request (a server span continuing
the caller's W3C ``traceparent``), the route pipeline (``xroute.route``), each stage of the
decision (``xroute.stage.<name>``, from the engine's stage timer), the shared-state and
decision-log calls, the gateway's attempts and their upstream calls (GenAI semantic conventions;
the upstream request carries this trace's ``traceparent``). The current trace id is kept in
``router.core.logs.trace_id_var`` (the decision-log row and the audit entries store it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

#: tracing on (set by :func:`setup`; read at every call site)
ON = False
#: the running tracing (``router.core.otel.Tracing``) while :data:`ON`
_T: Any = None


def setup(cfg: Any) -> None:
    """Turn tracing on when ``cfg`` (``router.core.settings.TracingSettings``) enables it (once a
    process: a second call with tracing enabled keeps the first's exporter)."""
    global ON, _T
    if not cfg.enabled or _T is not None:
        return
    from router.core import otel  # (only here: with tracing off, opentelemetry is never imported)

    _T = otel.Tracing(cfg)
    ON = True


def shutdown() -> None:
    """Send what is buffered and stop (the router's shutdown)."""
    global ON, _T
    t, _T, ON = _T, None, False
    if t is not None:
        t.shutdown()


def asgi(app: Callable[..., Awaitable[None]], traceparent: bytes | None) -> Callable[..., Awaitable[None]]:
    """``app`` run inside a server span continuing ``traceparent`` (the caller's, validated)."""
    return _T.asgi(app, traceparent)  # type: ignore[no-any-return]


def span(name: str, attributes: dict[str, Any] | None = None) -> Any:
    """A context manager: an internal span, current while it is open."""
    return _T.span(name, attributes)


async def traced(name: str, aw: Awaitable[Any], attributes: dict[str, Any] | None = None) -> Any:
    """Await ``aw`` inside a span ``name``."""
    with _T.span(name, attributes):
        return await aw


def until(name: str, fut: Any, attributes: dict[str, Any] | None = None) -> Any:
    """A span from now until the future ``fut`` is done (the deferred decision-log commit); returns ``fut``."""
    return _T.until(name, fut, attributes)


def stage_timer(inner: Callable[[str, float], None] | None) -> Callable[[str, float], None]:
    """The engine's stage timer (``RoutingEngine.run_stages``): a span per stage, ending now and
    lasting the stage's seconds, and ``inner`` (the metrics' histogram) called as before."""
    return _T.stage_timer(inner)  # type: ignore[no-any-return]


def client_span(name: str, attributes: dict[str, Any]) -> tuple[Any, str]:
    """A client span for an upstream call (ended by :func:`end_client`) and the ``traceparent``
    header value the upstream request carries."""
    return _T.client_span(name, attributes)  # type: ignore[no-any-return]


def end_client(sp: Any, attributes: dict[str, Any], error: str | None) -> None:
    """End an upstream call's span with what it measured (``error``: the outcome's, None: ok)."""
    _T.end_client(sp, attributes, error)
