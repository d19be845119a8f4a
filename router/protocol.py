"""``POST /v1/route`` answered inside uvicorn's HTTP protocol, below ASGI, when it succeeds.

Why: with the decision compiled, what was left of a routed request's cost was mostly the server's
per-request machinery -- an asyncio task, the ASGI scope and message dicts, the ``receive`` and
``send`` awaitables, header validation and two socket writes. Answering in the protocol object
itself cut the server's CPU ~30 us a request (of ~130; measured with ``wrk`` side by side,
docs/results.md "Router").

How: :func:`http_protocol` makes a subclass of uvicorn's ``HttpToolsProtocol`` (the ``http``
class uvicorn's ``auto`` picks when httptools is installed) bound to one :class:`RouterApp`.
``xroute serve``, the test server (``router.testing.ServerThread``) and the benchmark pass it as
uvicorn's ``http`` option. Per request:

- At the end of the headers it takes over only ``POST /v1/route`` with a JSON ``Content-Type``,
  a ``Content-Length`` within ``max_body_bytes``, a valid API key, no ``Expect``,
  ``Transfer-Encoding`` or upgrade, and no other request of the connection still being answered.
  Everything else goes on to uvicorn's own code at once, exactly as without this class.
- At the end of the body: a body that does not validate as :class:`RouteRequest` is handed to
  uvicorn's ASGI cycle with the body replayed, so its 422 is FastAPI's. A valid one is decided
  (``router.fastpath.begin_route``, the same call the ASGI paths make), and the answer is written
  (one socket write) when the decision's row is durable. The errors of the decision itself
  (unknown origin, no offering, no capacity, the log down, an unexpected exception) are rendered
  by the same ``router.errors`` functions as on the ASGI paths.
- Request id, ``traceparent``, the access line and the error counters are the ones
  ``router.middleware.RequestContext`` gives every other request, from the same helpers.
- While an answer waits for its commit, the request stands in as the connection's current
  cycle (``_Answer``), so uvicorn queues a pipelined request behind it, and a graceful shutdown
  closes the connection once it is answered. ``tests/test_router_protocol.py`` checks that the
  answers are the ASGI path's, byte for byte apart from ids and times.

The subclass overrides three of uvicorn's parser callbacks and reads attributes of
``HttpToolsProtocol`` and its cycle that are not a documented API. :func:`http_protocol` checks
they exist and otherwise returns uvicorn's ``"auto"``; the router then answers on the ASGI fast
path (``router.fastpath``). ``http_fast_path: false`` in the router settings turns it off.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response

from router import errors
from router.engine import RouteFailure
from router.fastpath import ROUTE_PATH, begin_route, end_route, is_json, route_headers
from router.logs import access, new_id, new_sorted_id, request_id_var
from router.middleware import request_id_of, traceparent_of
from router.store import StoreClosed
from xroute.schema.decision import RouteRequest

try:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # no httptools: uvicorn runs h11, and the router its ASGI fast path
    HttpToolsProtocol = None  # type: ignore[misc,assignment]

#: the methods of uvicorn's class the subclass overrides or calls (checked by :func:`http_protocol`);
#: it also reads the attributes ``parser``, ``url``, ``headers``, ``cycle``, ``transport``,
#: ``server_state``, ``root_path``, ``limit_concurrency`` and ``expect_100_continue``
_HOOKS = ("on_headers_complete", "on_body", "on_message_complete", "on_response_complete", "shutdown")
_ROUTE_URL = ROUTE_PATH.encode()


class _NoEvent:
    """What uvicorn's ``connection_lost`` sets on the current cycle; nothing waits on it here."""

    def set(self) -> None:
        pass


class _Answer:
    """One fast-path request, from the end of its headers to its answer. While it waits for its
    commit it is the protocol's ``cycle``: uvicorn reads ``response_complete``, ``keep_alive``,
    ``disconnected`` and ``message_event`` of the current cycle."""

    __slots__ = (
        "body",
        "decision_id",
        "disconnected",
        "keep_alive",
        "response_complete",
        "rid",
        "svc",
        "t0",
        "trace",
        "who",
    )
    message_event = _NoEvent()

    def __init__(self, t0: float, who: Any, svc: Any, rid: str, trace: bytes | None, keep_alive: bool):
        self.t0, self.who, self.svc, self.rid, self.trace, self.keep_alive = t0, who, svc, rid, trace, keep_alive
        self.body = b""
        self.decision_id: str | None = None
        self.response_complete = False
        self.disconnected = False


def http_protocol(app: Any) -> Any:
    """uvicorn's ``http`` option for serving the router ``app``: the protocol class answering
    ``POST /v1/route`` below ASGI, or ``"auto"`` when that cannot be used (no httptools, a uvicorn
    whose class lacks what it relies on, or ``http_fast_path`` off in ``app``'s settings)."""
    if HttpToolsProtocol is None or not getattr(app, "http_fast_path", True):
        return "auto"
    if not all(name in HttpToolsProtocol.__dict__ for name in _HOOKS):
        return "auto"
    return type("RouteProtocol", (RouteProtocol,), {"router_app": app})


if HttpToolsProtocol is not None:

    class RouteProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        """uvicorn's httptools protocol, plus ``POST /v1/route`` answered in place (module doc)."""

        router_app: Any = None  # set by http_protocol's subclass
        _answer: _Answer | None = None  # the fast-path request whose body is being read

        def on_headers_complete(self) -> None:
            answer = None
            if self.url == _ROUTE_URL and self.parser.get_method() == b"POST":
                answer = self._take_over()
            self._answer = answer
            if answer is None:
                super().on_headers_complete()
            else:  # the connection's current cycle from now on: a pipelined request queues behind it
                self.cycle = answer  # type: ignore[assignment]

        def _take_over(self) -> _Answer | None:
            """An :class:`_Answer` when this request is the fast path's to answer, else None."""
            svc = self.router_app.services
            cycle = self.cycle
            if (svc is None or self.root_path or self.limit_concurrency is not None or self.expect_100_continue
                    or (cycle is not None and not cycle.response_complete) or self.parser.should_upgrade()):
                return None
            key, length, ctype, rid, trace, chunked = route_headers(self.headers)  # (uvicorn lower-cases names)
            if (chunked or key is None or length is None or ctype is None or not length.isdigit()
                    or int(length) > svc.settings.max_body_bytes or not is_json(ctype)):
                return None
            who = svc.keys.verify(key)
            if who is None:
                return None
            keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
            rid = None if rid is None else request_id_of(rid)
            return _Answer(time.perf_counter(), who, svc, rid.decode() if rid is not None else new_id(64),
                           None if trace is None else traceparent_of(trace), keep_alive)

        def on_body(self, body: bytes) -> None:
            answer = self._answer
            if answer is None:
                super().on_body(body)
            else:
                answer.body += body

        def on_message_complete(self) -> None:
            answer = self._answer
            if answer is None:
                super().on_message_complete()
                return
            self._answer = None
            body = None
            if answer.body:
                try:  # pydantic's JSON mode, as router.fastpath
                    body = RouteRequest.model_validate_json(answer.body)
                except (ValueError, ValidationError):
                    body = None
            if body is None:  # FastAPI's route answers it, with its own 422
                self._hand_over(answer)
                return
            svc = answer.svc
            token = request_id_var.set(answer.rid)
            try:
                t0 = time.perf_counter()  # the metrics' start, as route_decision's
                answer.decision_id = decision_id = "d_" + new_sorted_id()
                payload, committed, offering_id, pinfo = begin_route(svc, body, answer.who, decision_id, t0)
            except RouteFailure as e:
                self._respond(answer, errors.route_failure_response(e))
                return
            except StoreClosed as e:
                self._respond(answer, errors.store_closed_response(e))
                return
            except Exception as e:
                self._respond(answer, errors.unexpected_response(ROUTE_PATH, e))
                return
            finally:
                request_id_var.reset(token)
            committed.add_done_callback(lambda f: self._committed(f, answer, payload, offering_id, pinfo, t0))

        def _committed(self, fut: asyncio.Future[int], answer: _Answer, payload: bytes, offering_id: str,
                       pinfo: dict[str, Any], t0: float) -> None:
            exc = StoreClosed("the decision log was closed") if fut.cancelled() else fut.exception()
            if exc is None:
                try:
                    end_route(answer.svc, offering_id, pinfo, t0)
                    self._write(answer, 200, b"content-type: application/json\r\ncontent-length: %d\r\n"
                                % len(payload), payload)
                    return
                except Exception as e:  # never leave the client (and the connection's next requests) waiting
                    if answer.response_complete:
                        raise
                    exc = e
            token = request_id_var.set(answer.rid)
            try:
                if isinstance(exc, StoreClosed):
                    self._respond(answer, errors.store_closed_response(exc))
                else:
                    self._respond(answer, errors.unexpected_response(ROUTE_PATH, exc))
            finally:
                request_id_var.reset(token)

        def _respond(self, answer: _Answer, response: Response) -> None:
            """Write a ``router.errors`` response (its status, headers and body)."""
            head = b"".join(b"%s: %s\r\n" % kv for kv in response.raw_headers)
            self._write(answer, response.status_code, head, bytes(response.body))

        def _write(self, answer: _Answer, status: int, head: bytes, body: bytes) -> None:
            """The answer in one write (status line, uvicorn's default headers, ``head``, request id,
            trace, connection), then the access line and uvicorn's end of a response."""
            parts = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                parts += (name, b": ", value, b"\r\n")
            parts += (head, b"x-request-id: ", answer.rid.encode(), b"\r\n")
            if answer.trace is not None:
                parts += (b"traceparent: ", answer.trace, b"\r\n")
            if not answer.keep_alive:
                parts.append(b"connection: close\r\n")
            parts += (b"\r\n", body)
            transport = self.transport
            if not transport.is_closing():
                transport.write(b"".join(parts))
                if not answer.keep_alive:
                    transport.close()
            answer.response_complete = True
            svc = answer.svc
            if status >= 400:
                svc.metrics.error(ROUTE_PATH, status)
            if svc.settings.access_log:
                access(answer.rid, "POST", ROUTE_PATH, status, round((time.perf_counter() - answer.t0) * 1000.0, 3),
                       answer.who.tenant, answer.decision_id,
                       answer.trace[3:35].decode() if answer.trace is not None else None)
            if self.cycle is answer:
                self.cycle = None  # type: ignore[assignment]
            self.on_response_complete()

        def _hand_over(self, answer: _Answer) -> None:
            """The request goes to uvicorn's ASGI cycle after all, its body replayed."""
            self.cycle = None  # type: ignore[assignment]  # (the previous one was complete: _take_over)
            super().on_headers_complete()
            if self.cycle is not None:
                self.cycle.body += answer.body
            super().on_message_complete()

else:  # pragma: no cover
    RouteProtocol = None  # type: ignore[assignment,misc]
