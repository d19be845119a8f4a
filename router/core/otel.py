"""The OpenTelemetry SDK behind ``router.core.tracing`` -- imported only when tracing is enabled
(``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http``: ``pip install 'xroute[otel]'``).

The router keeps its own ``TracerProvider`` (not the process's global one: several apps in a
process -- the tests -- each export to their own endpoint); spans go out in batches over OTLP/HTTP
(protobuf). The current span lives in OpenTelemetry's context (a context variable), so it follows
the request through its awaits; ``router.core.logs.trace_id_var`` follows the server span."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.core.logs import trace_id_var

_PROPAGATOR = TraceContextTextMapPropagator()
#: how long finished spans wait before their batch is sent
SCHEDULE_DELAY_MS = 1000


def traceparent_of(sp: Any) -> str:
    """The W3C ``traceparent`` naming ``sp`` as the parent."""
    c = sp.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


class Tracing:
    def __init__(self, cfg: Any):
        self.provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint),
                                                            schedule_delay_millis=SCHEDULE_DELAY_MS))
        self.tracer = self.provider.get_tracer("xroute.router")

    def shutdown(self) -> None:
        self.provider.shutdown()  # (sends what is buffered)

    def asgi(self, app: Callable[..., Awaitable[None]], traceparent: bytes | None) -> Callable[..., Awaitable[None]]:
        parent = _PROPAGATOR.extract({"traceparent": traceparent.decode()}) if traceparent is not None else None

        async def traced(scope: Any, receive: Any, send: Any) -> None:
            method, path = scope["method"], scope["path"]
            with self.tracer.start_as_current_span(f"{method} {path}", context=parent, kind=SpanKind.SERVER,
                                                   attributes={"http.request.method": method, "url.path": path},
                                                   record_exception=False) as sp:
                ctx = sp.get_span_context()
                token = trace_id_var.set(f"{ctx.trace_id:032x}") if ctx.is_valid else None
                status = 0

                async def sending(message: Any) -> None:
                    nonlocal status
                    if message["type"] == "http.response.start":
                        status = message["status"]
                    await send(message)

                try:
                    await app(scope, receive, sending)
                finally:
                    route = getattr(scope.get("route"), "path", None)
                    if route:
                        sp.update_name(f"{method} {route}")
                        sp.set_attribute("http.route", route)
                    sp.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        sp.set_status(Status(StatusCode.ERROR))
                    if token is not None:
                        trace_id_var.reset(token)

        return traced

    @contextmanager
    def span(self, name: str, attributes: dict[str, Any] | None) -> Iterator[Any]:
        with self.tracer.start_as_current_span(name, attributes=attributes) as sp:
            yield sp

    def until(self, name: str, fut: Any, attributes: dict[str, Any] | None) -> Any:
        sp = self.tracer.start_span(name, attributes=attributes)

        def done(f: Any) -> None:
            if f.cancelled() or f.exception() is not None:
                sp.set_status(Status(StatusCode.ERROR, "cancelled" if f.cancelled() else str(f.exception())[:200]))
            sp.end()

        fut.add_done_callback(done)
        return fut

    def stage_timer(self, inner: Callable[[str, float], None] | None) -> Callable[[str, float], None]:
        tracer = self.tracer

        def timed(name: str, seconds: float) -> None:
            end = time.time_ns()
            tracer.start_span("xroute.stage." + name, start_time=end - int(seconds * 1e9),
                              attributes={"xroute.stage": name}).end(end_time=end)
            if inner is not None:
                inner(name, seconds)

        return timed

    def client_span(self, name: str, attributes: dict[str, Any]) -> tuple[Any, str]:
        sp = self.tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
        return sp, traceparent_of(sp)

    def end_client(self, sp: Any, attributes: dict[str, Any], error: str | None) -> None:
        sp.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if error is not None:
            sp.set_attribute("error.type", error)
            sp.set_status(Status(StatusCode.ERROR, error))
        sp.end()
