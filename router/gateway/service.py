"""The gateway's request path: an OpenAI request becomes a routing request, is decided by the
router's own decision path, forwarded to the chosen pool's server, retried on the next offering
when that fails before the first token, relayed to the client, and its measured outcome closes the
loop.

Each attempt is one decision of ``router.service.admission.route_decision`` -- the same ranking,
admission, reservation and durable decision-log row as ``POST /v1/route``, with the tenant's
constraints and policies -- for a routing request whose constraints allow only the offerings that
have servers for the model (``upstreams``) and deny the ones already tried, and whose TTFT (and
deadline) is what is left of the request's. Its outcome closes the loop as ``POST /v1/feedback``
does (``router.api.feedback``): the reservation is released, the pool's statistics and the
output-length estimator learn it, and its feedback row -- with its realized reward and SLO verdict
for off-policy evaluation, and what the gateway measured (TTFT, TPOT, output, prompt and cached
tokens, the request id and the attempt's number) -- goes to the decision log. A failure that is
the client's (it went away; the server refused its request as invalid) releases the reservation
and is recorded, but teaches the pool nothing.

A server of the chosen pool that refuses the connection (nothing was sent) is followed by the
pool's other servers within the same attempt and decision (``Gateway._exchange``); only a pool none
of whose servers takes the connection fails the attempt.

The tenant's quotas count the client's request once, however many attempts it takes: the first
attempt's decision reserves it; the others are decided with ``reserve_quota=False`` (nothing
checked or counted, no quota in their rows); the one reservation is settled when the request ends,
with its last attempt's outcome -- by that attempt's own feedback when it is the first, else under
the first decision's id (``Gateway._settle_quota``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import Gauge
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from router.core import tracing
from router.core.logs import LOG, request_id_var
from router.core.metrics import LoopCounter, LoopHistogram
from router.core.text import one_line
from router.decision.engine import RouteFailure
from router.gateway.exchange import Exchange, Outcome
from router.gateway.health import GatewayHealth
from router.gateway.openai_api import Kind, openai_error, parse_body
from router.gateway.tokens import LONG_PROMPT_CHARS, PromptCounter, chat_texts, prompt_chars, prompt_parts
from router.gateway.transcripts import TranscriptStore
from router.gateway.upstream import Endpoint, Guard, Upstreams, upstream_pools, watch_disconnect
from router.service.admission import route_decision
from router.service.outcomes import close_the_loop, feedback_row, settle_quota, watch
from router.service.services import Services
from router.state.base import pool_key
from router.store.sqlite import DecisionRef, StoreClosed
from xroute.errors import ConfigError
from xroute.schema.decision import FeedbackRequest, RouteRequest
from xroute.schema.policy_ir import Constraints, Rule

#: SLO headers: routing field -> header
SLO_HEADERS = {"ttft_ms": b"x-xroute-ttft-ms", "tpot_ms": b"x-xroute-tpot-ms", "deadline_ms": b"x-xroute-deadline-ms"}
ORIGIN_HEADER = b"x-xroute-origin"
SESSION_HEADER = b"x-session-id"
#: the request's priority band (``RouteRequest.priority``; absent: its tenant's default)
PRIORITY_HEADER = b"x-priority"
#: the request headers the gateway reads (one pass over the raw headers)
READ_HEADERS = frozenset({*SLO_HEADERS.values(), ORIGIN_HEADER, SESSION_HEADER, PRIORITY_HEADER, b"content-type"})
_HEADER_NAMES = {"ttft_ms": "X-Xroute-TTFT-Ms", "tpot_ms": "X-Xroute-TPOT-Ms", "deadline_ms": "X-Xroute-Deadline-Ms",
                 "origin": "X-Xroute-Origin", "session_id": "X-Session-Id", "priority": "X-Priority"}
_TTFT_BUCKETS = (1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_OVERHEAD_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)


def _invalid(field_name: str, message: str) -> RequestValidationError:
    loc = ("header", _HEADER_NAMES[field_name]) if field_name in _HEADER_NAMES else ("body", field_name)
    return RequestValidationError([{"type": "value_error", "loc": loc, "msg": message, "input": None}])


@dataclass(slots=True)
class Call:
    """One client request, read: what is routed and what is forwarded."""

    kind: Kind
    raw: bytes
    data: dict[str, Any]
    client_model: str
    model: str
    stream: bool
    want_usage: bool
    tenant: str
    route: dict[str, Any]
    #: the routing request as validated (the first attempt's, its TTFT set when it is made)
    first: RouteRequest
    store: bool
    request_id: str | None
    arrived: float
    bodies: dict[str, bytes] = field(default_factory=dict)

    def body_for(self, served_model: str) -> bytes:
        """What a server that knows the model as ``served_model`` is sent: the client's body with
        that name and, streamed, ``stream_options.include_usage`` (the client's bytes when they
        already say so)."""
        body = self.bodies.get(served_model)
        if body is None:
            opts = self.data.get("stream_options")
            asked = isinstance(opts, dict) and opts.get("include_usage") is True
            if served_model == self.client_model and (not self.stream or asked):
                body = self.raw
            else:
                d = dict(self.data)
                d["model"] = served_model
                if self.stream:
                    d["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
                body = json.dumps(d, separators=(",", ":"), ensure_ascii=False).encode()
            self.bodies[served_model] = body
        return body


@dataclass(slots=True)
class Attempt:
    """One decision of a call and where it went."""

    number: int
    decision_id: str
    offering_id: str
    ref: DecisionRef
    exchange: Exchange | None = None
    #: its pool's ejection target; whether it is the pool's half-open probe
    pool: str = ""
    probe: bool = False
    #: the servers it reached before the last one (each refused the connection), with their outcomes
    refused: list[tuple[str, Outcome]] = field(default_factory=list)


class GatewayMetrics:
    def __init__(self, registry: Any):
        self.requests = LoopCounter("xroute_gateway_requests_total", "Gateway requests by route and answer (ok, or "
                                    "the error code)", ("kind", "outcome"), registry)
        self.attempts = LoopCounter("xroute_gateway_attempts_total", "Attempts on an offering's servers by outcome "
                                    "(ok, or the failure)", ("offering_id", "outcome"), registry)
        self.ttft = LoopHistogram("xroute_gateway_ttft_seconds", "Streams: from the request's arrival to its first "
                                  "token, as the client sees it", _TTFT_BUCKETS, registry)
        self.overhead = LoopHistogram("xroute_gateway_overhead_seconds", "What the gateway added before the first "
                                      "token (streams) or the answer: from the request's arrival to its start, less "
                                      "the server's own time from the request sent to the first token (or answer) "
                                      "received -- reading, counting, deciding, logging, relaying (and failed "
                                      "attempts)", _OVERHEAD_BUCKETS, registry)
        self.server_retries = LoopCounter("xroute_gateway_server_retries_total", "Requests sent on to another server "
                                          "of the same pool (the same decision) after one refused the connection",
                                          ("offering_id",), registry)
        self.budget_exhausted = LoopCounter("xroute_gateway_retry_budget_exhausted_total", "Failed attempts not "
                                            "retried because the retry budget was spent (the failure was the answer)",
                                            ("kind",), registry)
        self.open_streams = 0
        Gauge("xroute_gateway_open_streams", "Streams being relayed now", registry=registry).set_function(
            lambda: self.open_streams)


class RelayResponse(StreamingResponse):
    """A relayed stream: however it ends -- completed, or cancelled because the client went away
    -- its exchange is closed and its attempt finished."""

    def __init__(self, exchange: Exchange, idle_s: float, headers: dict[str, str], metrics: GatewayMetrics):
        super().__init__(exchange.relay(idle_s), media_type="text/event-stream", headers=headers)
        self.exchange = exchange
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.open_streams += 1
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.metrics.open_streams -= 1
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()  # a stream the client left at a yield: its finally runs now (no await in it)
            self.exchange.end()


def check_settings(settings: Any, engine: Any) -> PromptCounter:
    """The gateway's settings against the served catalog and models -- the upstreams, their keys,
    the tokenizers, the origins -- as ``xroute serve`` checks them before listening (a
    ``ConfigError`` names the field)."""
    upstream_pools(settings, engine.offering_ids, engine.models)
    counter = PromptCounter(settings.gateway.tokenizers, engine.models)
    origins = [("gateway.origin", settings.gateway.origin)]
    origins += [(f"tenants.{name}.gateway.origin", t.gateway.origin) for name, t in settings.tenants.items()]
    for where, origin in origins:
        if origin is not None and origin not in engine.origin_set:
            raise ConfigError(f"router settings: field '{where}': unknown origin '{origin}' (GET /v1/offerings lists "
                              "them)")
    return counter


class Gateway:
    """Built by the app's lifespan (``Services.gateway``); closed at shutdown."""

    def __init__(self, svc: Services):
        settings = svc.settings
        self.svc = svc
        self.cfg = cfg = settings.gateway
        engine = svc.engine
        self.counter = check_settings(settings, engine)
        self.upstreams = Upstreams(settings, engine.offering_ids, engine.models, engine.ejection)
        self.tenant_cfg = {name: t.gateway for name, t in settings.tenants.items()}
        self.transcripts = (TranscriptStore(cfg.transcripts_path)
                            if any(t.store_prompts for t in self.tenant_cfg.values()) else None)
        # each model's offerings with servers, as an allow rule (none when that is every offering: the
        # rule would only lengthen each decision's logged request)
        self.allow = {m: Rule(offering_ids=sorted(offs)) if len(set(offs)) < engine.n else None
                      for m, offs in self.upstreams.offerings.items()}
        self.metrics = GatewayMetrics(svc.metrics.registry)
        #: outlier ejection and the retry budget (router.gateway.health)
        self.health = GatewayHealth(svc.state, engine.ejection, cfg, self.upstreams.pools, svc.metrics.registry)
        self.started = int(time.time())
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------------------ reading a request
    def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models``: the models of ``configs/models.yaml`` that some pool serves."""
        return [{"id": m, "object": "model", "created": self.started, "owned_by": "xroute",
                 "offerings": sorted(self.upstreams.offerings[m])}
                for m in self.svc.engine.models if m in self.upstreams.offerings]

    async def read(self, raw: bytes, raw_headers: list[tuple[bytes, bytes]], tenant: str, kind: Kind,
                   arrived: float) -> Call:
        """The call a request makes (raises the router's 4xx errors, naming the field)."""
        headers = {k: v.decode("latin-1") for k, v in raw_headers if k in READ_HEADERS}
        data, view = parse_body(raw, headers.get(b"content-type"), kind)
        engine = self.svc.engine
        model = view.model
        if model not in self.upstreams.offerings:
            known = [m for m in engine.models if m in self.upstreams.offerings]
            why = (f"no inference server is configured for model '{model}'" if model in engine.models
                   else f"unknown model '{model}'")
            raise RouteFailure(404, "model_not_found", f"{why}; GET /v1/models lists the models served",
                               [{"field": "body.model", "message": why, "suggestions": known}])
        tcfg = self.tenant_cfg.get(tenant)
        cfg = self.cfg
        route: dict[str, Any] = {"model": model}
        for name, header in SLO_HEADERS.items():
            value = headers.get(header)
            if value is not None:
                try:
                    x = float(value)
                except ValueError:
                    raise _invalid(name, "must be a number of milliseconds") from None
                if not math.isfinite(x):
                    raise _invalid(name, "must be a finite number of milliseconds")
                route[name] = x
            else:
                own = getattr(tcfg, name, None) if tcfg is not None else None
                route[name] = own if own is not None else getattr(cfg, name)
        origin = headers.get(ORIGIN_HEADER) or (tcfg.origin if tcfg is not None else None) or cfg.origin
        if origin is None:
            raise _invalid("origin", "no origin: send this header, or set gateway.origin (or the tenant's) in the "
                                     "router settings")
        if origin not in engine.origin_set:
            raise _invalid("origin", f"unknown origin '{origin}'; known origins: GET /v1/offerings")
        route["origin"] = origin
        session = headers.get(SESSION_HEADER)
        if session is not None:
            route["session_id"] = session
        priority = headers.get(PRIORITY_HEADER)
        if priority is not None:
            route["priority"] = priority
        if kind == "chat":
            texts, fixed = chat_texts(data)
            budget = getattr(view, "max_completion_tokens", None) or view.max_tokens
        else:
            texts, fixed = prompt_parts(data.get("prompt"))
            budget = view.max_tokens
        counter = self.counter
        if counter.method(model) == "tokenizer" and prompt_chars(texts) > LONG_PROMPT_CHARS:
            n_in = await asyncio.to_thread(counter.count, model, texts, fixed)
        else:
            n_in = counter.count(model, texts, fixed)
        route["input_tokens"] = min(n_in, 2_000_000)
        route["max_output_tokens"] = min((budget or cfg.default_max_tokens) * (view.n or 1), 1_000_000)
        try:
            first = RouteRequest.model_validate(route)  # every field checked once, named as the client gave it
        except ValidationError as e:
            err = e.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else "body"
            if name == "max_output_tokens":
                name = "max_tokens"
            raise _invalid(name, str(err["msg"])) from None
        opts = view.stream_options
        return Call(kind, raw, data, model, model, bool(view.stream), bool(opts and opts.include_usage), tenant, route,
                    first, bool(tcfg is not None and tcfg.store_prompts), request_id_var.get(), arrived)

    def routing_request(self, call: Call, elapsed_ms: float, tried: list[str]) -> RouteRequest:
        """The routing request of the next attempt: what is left of the TTFT budget (and deadline),
        only the offerings with servers for the model, none tried already."""
        ttft = max(1.0, call.route["ttft_ms"] - elapsed_ms)
        deadline = call.route.get("deadline_ms")
        if deadline is not None:
            deadline = max(1.0, deadline - elapsed_ms)
        allow = self.allow[call.model]
        if not tried and allow is None:  # the request as validated (no constraints of the gateway's own)
            first = call.first
            first.ttft_ms, first.deadline_ms = ttft, deadline
            return first
        fields = dict(call.route)
        fields["ttft_ms"], fields["deadline_ms"] = ttft, deadline
        deny = [Rule(offering_ids=list(tried))] if tried else []
        fields["constraints"] = Constraints(allow=[allow] if allow is not None else [], deny=deny) if (
            allow is not None or deny) else None
        values: dict[str, Any] = {k: fields.get(k) for k in RouteRequest.model_fields}
        return RouteRequest.model_construct(**values)

    # ------------------------------------------------------------------------------ serving
    async def serve(self, call: Call, caller: Any, receive: Receive, scope_state: dict[str, Any]) -> Response:
        """Decide, forward, retry, answer (module docstring)."""
        guard = Guard()
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(receive, guard))
        try:
            return await self._attempts(call, caller, guard, scope_state)
        finally:
            watcher.cancel()

    async def _attempts(self, call: Call, caller: Any, guard: Guard, scope_state: dict[str, Any]) -> Response:
        svc, who, cfg = self.svc, caller.who, self.cfg
        t0 = call.arrived
        tried: list[str] = []
        failed: list[Attempt] = []
        last: Outcome | None = None
        # the request's tenant quota reservation: its first decision's, which counts the request once
        # however many attempts it takes (the others reserve none); settled once, when the request ends
        admitted = False
        holder: Attempt | None = None
        budget = self.health.budget
        if budget is not None:
            budget.request()
        try:
            while not guard.disconnected:
                elapsed_ms = (time.perf_counter() - t0) * 1000.0
                if tried and (len(tried) >= cfg.max_attempts or elapsed_ms >= call.route["ttft_ms"] - 1.0
                              or len(tried) >= len(self.upstreams.offerings[call.model])):
                    break
                if tried and budget is not None and not budget.allow():  # (the last failure is the answer)
                    self.metrics.budget_exhausted.inc(call.kind)
                    break
                body = self.routing_request(call, elapsed_ms, tried)
                started = time.perf_counter()
                commit: list[asyncio.Future[int]] = []
                try:
                    # the decision-log write runs while the request goes to its server: awaited before any
                    # answer reaches the client (the decision is durable before it is acknowledged)
                    payload = await route_decision(svc, body, who, scope_state, durable=commit,
                                                   reserve_quota=not admitted, left=guard.left)
                except RouteFailure:
                    if not tried:
                        raise
                    break  # no other offering may take it now: the last failure is the answer
                answer = json.loads(payload)
                offering_id = answer["offering"]["offering_id"]
                tried.append(offering_id)
                admitted = True
                quota = scope_state.get("quota")  # (what the tenant's quotas reserved: settled with the request)
                ref = DecisionRef(who.tenant, call.model, svc.engine.pool_key_of(offering_id, call.model), 0,
                                  body.input_tokens, body.max_output_tokens, body.ttft_ms, body.tpot_ms,
                                  body.deadline_ms, float(answer["expected_cost_usd"]),
                                  quota_tokens=None if quota is None else quota[0],
                                  quota_usd=None if quota is None else quota[1],
                                  policy_kind=str(answer["policy"]["kind"]), policy_version=answer["policy"]["version"])
                att = self._attempt(len(tried), answer["decision_id"], offering_id, ref, call.model)
                if quota is not None:
                    holder = att
                ok = False
                try:
                    ok = await self._exchange(call, att, guard, started)
                    await commit[0]  # (StoreClosed: the log cannot record; the client gets its 503)
                except BaseException as e:  # cancelled, the log failed, or a failure of ours: the loop still closes
                    self._abandon(call, att, commit[0], e, ok, holder)
                    holder = None
                    raise
                ex = att.exchange
                assert ex is not None
                reached = att.refused if ex.outcome.error == "servers_ejected" else [
                    *att.refused, (ex.ep.target, ex.outcome)]
                learnt = self.health.outcomes(att.pool, reached, ex.outcome)
                if ok:
                    if learnt:  # (a success on a target failing or ejected: after the answer)
                        self._spawn(self.health.report(learnt))
                    settles, holder = holder, None
                    return self._served(call, att, settles)
                if learnt:  # (a failure: known before the retry is decided)
                    await self.health.report(learnt)
                self.finish(call, att, None)  # (the request's quota, if it holds it, is settled when the request ends)
                failed.append(att)
                last = ex.outcome
                if not last.retryable:
                    break
            return self.failed(call, failed, last)
        finally:
            if holder is not None:  # no attempt served it: the reservation counts its last outcome
                self._spawn(self._settle_quota(holder, last))

    def _attempt(self, number: int, decision_id: str, offering_id: str, ref: DecisionRef, model: str) -> Attempt:
        """An attempt decided: its pool's target, and whether it is the pool's probe (a decision
        offered the probe went there: ``router.decision.ejections``)."""
        att = Attempt(number, decision_id, offering_id, ref, pool="pool:" + pool_key(model, offering_id))
        view = self.svc.engine.ejection
        if view.tokens:
            att.probe = view.placed(decision_id, att.pool)
        return att

    def _abandon(self, call: Call, att: Attempt, commit: asyncio.Future[int], e: BaseException, ok: bool,
                 holder: Attempt | None) -> None:
        """An attempt ended by ``e`` -- cancelled, the log failed, or a failure of ours: its exchange
        abandoned, its outcome named (the client's fault: no server is blamed), its log write no
        longer awaited, and the loop closed as for any attempt (``holder``: the request's quota
        reservation, settled with it)."""
        ex = att.exchange
        assert ex is not None
        ex.abandon()
        if ex.outcome.error is None or ok:
            ex.outcome.error = ("cancelled" if isinstance(e, asyncio.CancelledError) else
                                "decision_log_unavailable" if isinstance(e, StoreClosed) else "gateway_error")
            ex.outcome.client_fault = True
        if not commit.done():
            commit.cancel()  # (the row goes on to the log; nobody waits for it)
        elif not commit.cancelled():
            commit.exception()  # (retrieved: the log's failure is the client's 503)
        self.finish(call, att, holder)

    def _served(self, call: Call, att: Attempt, settles: Attempt | None) -> Response:
        """The answer of the attempt a server took: the relayed stream (its loop closed when the
        stream ends) or the whole body, with the gateway's headers; ``settles``: the request's quota
        reservation, settled when it ends."""
        ex = att.exchange
        assert ex is not None
        now = time.perf_counter()
        overhead = now - call.arrived - (ex.received - ex.sent)
        self.metrics.overhead.observe(overhead)
        headers = {"x-xroute-decision-id": att.decision_id, "x-xroute-offering": att.offering_id,
                   "x-xroute-attempts": str(att.number), "x-xroute-overhead-ms": f"{overhead * 1000.0:.3f}"}
        self.metrics.requests.inc(call.kind, "ok")
        if call.stream:
            if ex.first:
                self.metrics.ttft.observe(now - call.arrived)
            ex.on_end = lambda: self.finish(call, att, settles)
            return RelayResponse(ex, self.cfg.idle_timeout_s,
                                 {**headers, "cache-control": "no-cache", "x-accel-buffering": "no"}, self.metrics)
        self.finish(call, att, settles)
        assert ex.answer is not None
        return Response(ex.answer, media_type="application/json", headers=headers)

    def _exchange(self, call: Call, att: Attempt, guard: Guard, started: float) -> Awaitable[bool]:
        """:meth:`_exchanges`, in a span ``xroute.gateway.attempt`` when tracing is on."""
        run = self._exchanges(call, att, guard, started)
        if not tracing.ON:
            return run
        return tracing.traced("xroute.gateway.attempt", run, {  # type: ignore[no-any-return]
            "xroute.attempt": att.number, "xroute.decision_id": att.decision_id,
            "xroute.offering_id": att.offering_id, "gen_ai.request.model": call.client_model})

    async def _exchanges(self, call: Call, att: Attempt, guard: Guard, started: float) -> bool:
        """Send the attempt's request to a server of its pool and read until its first token (or,
        not streamed, its answer); True when that came. A server that refuses the connection (nothing
        was sent) is followed by the pool's other servers, while the TTFT budget lasts -- the same
        decision: the pool was chosen, and one dead server of it is not the pool's failure."""
        cfg, ups = self.cfg, self.upstreams
        tried: list[Endpoint] = []
        ep = ups.pick(call.model, att.offering_id, att.probe)
        if ep is None:  # every server of the pool is ejected: the attempt fails at once, nothing sent
            ex = att.exchange = Exchange(ups, ups.pools[(call.model, att.offering_id)][0], call.kind, b"",
                                         call.client_model, call.want_usage, guard, started)
            ex.outcome.error, ex.outcome.retryable, ex.outcome.latency_s = "servers_ejected", True, 0.0
            return False
        while True:
            ex = att.exchange = Exchange(ups, ep, call.kind, call.body_for(ep.served_model), call.client_model,
                                         call.want_usage, guard, started, keep_text=call.store)
            if call.stream:
                ok = await ex.open_stream(cfg.first_token_timeout_s)
            else:
                ok = await ex.complete(cfg.response_timeout_s)
            if ok or ex.outcome.error != "connect_error" or guard.disconnected:
                return ok
            tried.append(ep)
            other = ups.other(call.model, att.offering_id, tried)
            if other is None or (time.perf_counter() - call.arrived) * 1000.0 >= call.route["ttft_ms"] - 1.0:
                return ok
            att.refused.append((ep.target, ex.outcome))
            ex.trace_end()
            self.metrics.server_retries.inc(att.offering_id)
            ep = other

    def failed(self, call: Call, attempts: list[Attempt], last: Outcome | None) -> Response:
        """The answer when no attempt succeeded: the server's own answer when the request was the
        client's fault, else an error naming the failure, with every attempt."""
        tried = [{"decision_id": a.decision_id, "offering_id": a.offering_id,
                  "error": a.exchange.outcome.error if a.exchange is not None else None} for a in attempts]
        headers = {"x-xroute-attempts": str(len(attempts))}
        if attempts:
            headers["x-xroute-decision-id"] = attempts[-1].decision_id
        if last is None or last.error == "client_disconnected":
            self.metrics.requests.inc(call.kind, "client_disconnected")
            return openai_error(499, "client_disconnected", "the client closed the request", attempts=tried,
                                headers=headers)
        if last.client_fault and last.answer_status is not None:
            self.metrics.requests.inc(call.kind, f"upstream_{last.answer_status}")
            return Response(last.answer_body or b"", status_code=last.answer_status, media_type="application/json",
                            headers=headers)
        error = last.error or "upstream_error"
        if error == "upstream_429":
            status, code = 429, "upstream_rate_limited"
            headers["retry-after"] = last.retry_after or "1"
        elif error.endswith("_timeout") and error != "pool_timeout":
            status, code = 504, "upstream_timeout"
        else:
            status, code = 502, "upstream_unavailable"
        self.metrics.requests.inc(call.kind, code)
        n = len(attempts)
        return openai_error(status, code, f"no inference server answered the request ({n} attempt{'s' * (n != 1)}; "
                            f"the last: {error})", attempts=tried, headers=headers)

    # ------------------------------------------------------------------------------ closing the loop
    def finish(self, call: Call, att: Attempt, settles: Attempt | None) -> None:
        """The attempt is over: close its loop in a task of its own (after the answer, and safe from
        the request's cancellation). ``settles``: the attempt holding the request's tenant quota
        reservation when this is the request's last attempt (it settles it with its outcome)."""
        self._spawn(self._close_loop(call, att, settles))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _close_loop(self, call: Call, att: Attempt, settles: Attempt | None) -> None:
        svc = self.svc
        ex = att.exchange
        assert ex is not None
        ex.finish_counts()
        ex.trace_end()
        o = ex.outcome
        # the request's quota reservation is settled once, with its last attempt's outcome: by this
        # attempt's own feedback when it holds it, else below; an attempt that holds it but is not the
        # last leaves it alone
        ref = att.ref if settles is att or att.ref.quota_tokens is None else dataclasses.replace(
            att.ref, quota_tokens=None, quota_usd=None)
        self.metrics.attempts.inc(att.offering_id, o.error or "ok")
        failed = o.error is not None
        latency_ms = None if o.latency_s is None else min(o.latency_s * 1000.0, 86_400_000.0)
        ttft_ms = None if o.ttft_s is None else min(o.ttft_s * 1000.0, 86_400_000.0)
        out = None if o.output_tokens is None else min(o.output_tokens, 1_000_000)
        # the server's cached prompt tokens also correct the pool's prefix affinity (close_the_loop)
        cached = None if o.cached_tokens is None else max(0, min(int(o.cached_tokens), int(att.ref.input_tokens)))
        fb = FeedbackRequest.model_construct(decision_id=att.decision_id, latency_ms=latency_ms, ttft_ms=ttft_ms,
                                             cost_usd=None, output_tokens=out, failed=failed, error=o.error,
                                             cached_tokens=cached)
        reward = missed = None
        try:
            if o.client_fault:  # released, with what it used of its tenant's quotas until the client left
                await settle_quota(svc, fb, ref, release=True)
            else:
                reward, missed = svc.engine.feedback_reward(ref, fb)
                await close_the_loop(svc, fb, ref, missed)
                if ref.policy_kind == "model" and svc.engine.watchdog.wants(ref.policy_version):
                    # (the champion's decision: the watchdog reads its logged record, durable by now)
                    logged = await svc.store.lookup(att.decision_id)
                    if logged is not None:
                        await watch(svc, logged, reward, att.decision_id)
            if settles is not None and settles is not att:
                await self._settle_quota(settles, o)
            measured = (o.tpot_ms, o.prompt_tokens, o.cached_tokens, call.request_id, att.number)
            await svc.store.record_feedback(feedback_row(fb, call.tenant, time.time(), None, reward, missed, measured))
            if call.store and self.transcripts is not None:
                await self.transcripts.put(att.decision_id, call.request_id, call.tenant, time.time(), call.kind,
                                           call.raw, ex.texts)
        except Exception as e:  # the answer has gone: say what was not recorded (never a body)
            LOG.warning("gateway outcome not recorded", extra={"fields": {
                "decision_id": att.decision_id, "error": one_line(e)}})

    async def _settle_quota(self, holder: Attempt, o: Outcome | None) -> None:
        """Settle the request's tenant quota reservation (held by ``holder``'s decision) with the
        outcome of its last attempt ``o`` (None: it has none) -- ``settled_amounts``: the prompt
        plus the output measured, the reserved USD (the expected cost of the first attempt's
        offering: what the decision log's rebuild of the counters also counts)."""
        out = None if o is None or o.output_tokens is None else min(o.output_tokens, 1_000_000)
        fb = FeedbackRequest.model_construct(decision_id=holder.decision_id, output_tokens=out, cost_usd=None,
                                             failed=o is None or o.error is not None)
        try:
            await settle_quota(self.svc, fb, holder.ref)
        except Exception as e:  # (logged by settle_quota when the state cannot be reached; anything else here)
            LOG.warning("gateway quota not settled", extra={"fields": {
                "decision_id": holder.decision_id, "error": one_line(e)}})

    async def close(self, timeout_s: float = 10.0) -> None:
        """At shutdown: the loops still closing get ``timeout_s`` to finish (before the decision
        log closes), then the connections and the transcript store close."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        await self.upstreams.close()
        if self.transcripts is not None:
            await asyncio.to_thread(self.transcripts.close)

