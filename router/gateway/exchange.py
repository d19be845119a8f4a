"""One attempt's exchange with an inference server: the request sent, the answer read and relayed,
and what was measured -- the outcome the closed loop learns.

Streams are relayed as they arrive: each chunk read from the server is cut into its SSE events,
and the events go on to the client in one write. Until the first token, each event is parsed (to
see the first token: generated text, reasoning or a tool call); after it only the events that may
carry ``usage`` or an ``error`` are (a byte search first), so relaying costs a few microseconds
per chunk. ``stream_options.include_usage`` is always asked of the server (the usage is how the
gateway learns the output and cached tokens); the usage-only last chunk goes to the client only
when it asked for it. The model name the server answers under (``served_model``) is put back to
the one the client asked for.

Measured, per attempt, from the attempt's start (its decision): the time to the first token, the
end-to-end latency, the time per output token after the first ((latency - TTFT) / (output - 1)),
and from the server's ``usage`` the prompt, output (``completion_tokens``) and cached
(``prompt_tokens_details.cached_tokens``) tokens. A stream without usage counts one token per
chunk that carries output (what vLLM sends without speculative decoding). A request that is not
streamed has no TTFT (the server answers all at once)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from router.core import tracing
from router.gateway.openai_api import chunk_texts, has_token, sse_error
from router.gateway.upstream import Endpoint, Guard, Upstreams
from router.http.errors import loads_or_none

#: server answers that another offering may do better with, before the first token
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: the most of an error answer kept (it goes back to the client, never to a log)
ERROR_BODY_MAX = 65_536


@dataclass(slots=True)
class Outcome:
    """What one attempt came to."""

    #: None: it succeeded; else a short code (``upstream_503``, ``connect_error``,
    #: ``first_token_timeout``, ``idle_timeout``, ``upstream_disconnected``, ``upstream_error_event``,
    #: ``client_disconnected``, ``upstream_400``, ...) -- never the server's message
    error: str | None = None
    #: the server's HTTP status (None: no answer)
    status: int | None = None
    #: another offering may be tried (nothing was sent to the client yet)
    retryable: bool = False
    #: the failure is the client's (it went away, or the server refused its request as invalid):
    #: the pool's statistics do not count it
    client_fault: bool = False
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    #: a status / body / headers to answer the client with when the attempts end here
    answer_status: int | None = None
    answer_body: bytes | None = None
    retry_after: str | None = None

    @property
    def tpot_ms(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return max(0.0, (self.latency_s - self.ttft_s) * 1000.0 / (self.output_tokens - 1))


def _usage(outcome: Outcome, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    for name, attr in (("completion_tokens", "output_tokens"), ("prompt_tokens", "prompt_tokens")):
        v = usage.get(name)
        if isinstance(v, int) and v >= 0:
            setattr(outcome, attr, v)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        outcome.cached_tokens = details["cached_tokens"]


#: what the HTTP client raises when a server cannot be reached or breaks off (its connect timeout is a TimeoutError)
CLIENT_ERRORS = (aiohttp.ClientError, TimeoutError)


def _http_failure(outcome: Outcome, e: BaseException) -> None:
    """An exception of the HTTP client as the outcome's code."""
    if isinstance(e, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        outcome.error = "connect_error"  # (also: no pooled connection came free within the connect timeout)
    elif isinstance(e, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientOSError):
        outcome.error = "upstream_disconnected"
    else:
        outcome.error = "upstream_error"


class Exchange:
    """One attempt against one server (:class:`Endpoint`). ``body`` is what the server is sent;
    ``client_model`` the name the client used; ``want_usage`` whether the client asked for the
    usage chunk; ``keep_text`` whether the completion's text is kept (a tenant that stores its
    transcripts). ``on_end`` is called once, when a relayed stream has ended (completed, broken
    off, or the client went away)."""

    def __init__(self, upstreams: Upstreams, ep: Endpoint, kind: str, body: bytes, client_model: str,
                 want_usage: bool, guard: Guard, started: float, keep_text: bool = False):
        self.upstreams, self.ep, self.kind, self.body = upstreams, ep, kind, body
        self.guard, self.started = guard, started
        self.want_usage, self.keep_text = want_usage, keep_text
        self.outcome = Outcome()
        self.response: aiohttp.ClientResponse | None = None
        self._it: AsyncIterator[bytes] | None = None
        self._rest = b""
        self._out: list[bytes] = []
        self._held = False
        self.token_events = 0
        self.first = False  # the first token came
        self.done = False  # the server's [DONE] came
        self.ended = False  # nothing more goes to the client ([DONE], an error event)
        self.texts: dict[int, list[str]] = {}
        self.answer: bytes | None = None  # a request that was not streamed: the answer sent
        self.on_end: Callable[[], None] | None = None
        #: when the request went to the server, and when its first token (streamed) or answer came back
        self.sent = self.received = 0.0
        #: the upstream call's span (tracing on: ``router.core.tracing``), ended by :meth:`trace_end`
        self.span: Any = None
        self._rename: tuple[bytes, bytes] | None = None
        if ep.served_model != client_model:
            self._rename = (b'"model":' + json.dumps(ep.served_model).encode(),
                            b'"model":' + json.dumps(client_model).encode())

    # ---------------------------------------------------------------------------------- the request
    async def _post(self) -> aiohttp.ClientResponse:
        """Send the request; the response once its headers have come."""
        self.sent = time.perf_counter()
        headers = self.ep.headers
        if tracing.ON:  # (a client span; the server continues this trace)
            op = "chat" if self.kind == "chat" else "text_completion"
            self.span, parent = tracing.client_span(f"{op} {self.ep.served_model}", {
                "gen_ai.operation.name": op, "gen_ai.request.model": self.ep.served_model,
                "server.address": self.ep.base_url, "xroute.offering_id": self.ep.offering_id})
            headers = {**headers, "traceparent": parent}
        return await self.upstreams.session.post(self.ep.url(self.kind), data=self.body, headers=headers,
                                                 allow_redirects=False)

    def trace_end(self) -> None:
        """End the upstream call's span (tracing on) with its outcome: the GenAI usage and the TTFT."""
        sp, self.span = self.span, None
        if sp is not None:
            o = self.outcome
            tracing.end_client(sp, {"gen_ai.usage.input_tokens": o.prompt_tokens,
                                    "gen_ai.usage.output_tokens": o.output_tokens,
                                    "gen_ai.server.time_to_first_token": o.ttft_s,
                                    "xroute.latency_s": o.latency_s}, o.error)

    def _elapsed(self) -> float:
        return time.perf_counter() - self.started

    def _hold(self) -> None:
        self._held = True
        self.ep.in_flight += 1

    def _let_go(self) -> None:
        if self._held:
            self._held = False
            self.ep.in_flight -= 1

    async def _refused(self, response: aiohttp.ClientResponse) -> None:
        """A server answer that is no success: the outcome says what the client would get."""
        o = self.outcome
        o.status = response.status
        o.error = f"upstream_{response.status}"
        o.retryable = response.status in RETRYABLE_STATUS
        o.client_fault = not o.retryable and 400 <= response.status < 500
        o.retry_after = response.headers.get("retry-after")
        o.answer_status, o.answer_body = response.status, await response.content.read(ERROR_BODY_MAX)

    async def _failed(self, e: BaseException | None = None) -> bool:
        """End a failed attempt: its time, the server's connection closed, the server let go."""
        o = self.outcome
        if e is not None:
            _http_failure(o, e)
            o.retryable = True
            if o.error == "connect_error":
                self.upstreams.mark_down(self.ep)
        if o.latency_s is None:
            o.latency_s = self._elapsed()
        self.guard.stop()
        self._close()
        self._let_go()
        return False

    # ---------------------------------------------------------------------------------- not streamed
    async def complete(self, timeout_s: float) -> bool:
        """Send the request and read the whole answer (within ``timeout_s``); True when it succeeded
        (``answer`` holds it), else the outcome says why."""
        o = self.outcome
        self._hold()
        self.guard.arm(timeout_s, "response")
        try:
            self.response = response = await self._post()
            if response.status != 200:
                await self._refused(response)
                return await self._failed()
            body = await response.read()
            self.guard.stop()
            self.received = time.perf_counter()
            o.latency_s = self.received - self.started
            self._close()
            answer = loads_or_none(body)  # (not JSON it can read, nested too deeply included: relayed as it is)
            if isinstance(answer, dict):
                _usage(o, answer.get("usage"))
                if self.keep_text:
                    for c in answer.get("choices") or ():
                        if isinstance(c, dict):
                            msg = c.get("message")
                            text = msg.get("content") if isinstance(msg, dict) else c.get("text")
                            i = c.get("index", 0)
                            if isinstance(text, str):
                                self.texts.setdefault(i if isinstance(i, int) else 0, []).append(text)
            self.answer = body if self._rename is None else body.replace(*self._rename, 1)
            self.ended = self.done = True
            self._let_go()
            return True
        except asyncio.CancelledError:
            reason = self.guard.take()
            if reason is None:
                self._let_go()
                raise
            o.error = reason
            o.client_fault = reason == "client_disconnected"
            o.retryable = False  # the whole answer's time ran out, or the client left
            return await self._failed()
        except CLIENT_ERRORS as e:
            return await self._failed(e)
        finally:
            self.guard.stop()

    # ---------------------------------------------------------------------------------- streamed
    async def open_stream(self, first_token_s: float) -> bool:
        """Send the request and read until the first token (within ``first_token_s``) or the end of
        a stream that has none; True when that happened (what was read waits for :meth:`relay`),
        else the outcome says why (nothing has gone to the client: it may be retried)."""
        o = self.outcome
        self._hold()
        self.guard.arm(first_token_s, "first_token")
        try:
            self.response = response = await self._post()
            if response.status != 200:
                await self._refused(response)
                return await self._failed()
            it = self._it = response.content.iter_any().__aiter__()
            while not self.first and not self.ended:
                try:
                    chunk = await it.__anext__()
                except StopAsyncIteration:
                    self._it = None
                    break
                self._feed(chunk)
            self.guard.stop()
            if not self.received:  # (a stream that ended without a token: its end)
                self.received = time.perf_counter()
            if not self.first:
                if o.error == "upstream_error_event":  # the server failed before any token: retry elsewhere
                    o.retryable = True
                    return await self._failed()
                if not self.done:  # the stream ended before any token and without [DONE]: the server went away
                    o.error, o.retryable = "upstream_disconnected", True
                    return await self._failed()
            return True
        except asyncio.CancelledError:
            reason = self.guard.take()
            if reason is None:
                self._close()
                self._let_go()
                raise
            o.error = reason
            o.client_fault = reason == "client_disconnected"
            o.retryable = not o.client_fault
            return await self._failed()
        except CLIENT_ERRORS as e:
            return await self._failed(e)
        finally:
            self.guard.stop()

    async def relay(self, idle_s: float) -> AsyncIterator[bytes]:
        """The stream for the client: what :meth:`open_stream` read, then the rest as it comes. A
        server that falls silent for ``idle_s``, goes away, or ends without ``[DONE]`` ends the
        stream with an error event (never a silent truncation). Closed early (the client went
        away): the server's request is closed, which stops it.

        The stream is the client's until its ``data: [DONE]`` (or a server's error event) has been
        handed on: then it is over -- completed, measured as of ``[DONE]`` -- whatever the client's
        connection does next (the ``openai`` client closes it as soon as it has read ``[DONE]``),
        and the client's response ends there. What the server still sends after it (the end of its
        response) is read in the background (``Upstreams.drain``, within ``idle_s``), so its
        connection goes back to the pool rather than being cut."""
        o = self.outcome
        finished = False
        try:
            if self._out:
                yield b"".join(self._out)
                self._out.clear()
            it = self._it
            if it is not None and not self.ended:
                guard = self.guard
                guard.arm(idle_s, "idle")
                try:
                    while not self.ended:
                        try:
                            chunk = await it.__anext__()
                        except StopAsyncIteration:
                            break
                        guard.extend(idle_s)
                        self._feed(chunk)
                        if self._out:
                            data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
                            self._out.clear()
                            yield data  # ([DONE] handed on: no await from here to the end of the stream)
                except asyncio.CancelledError:
                    reason = guard.take()
                    if reason is None:
                        raise
                    o.error = reason
                    yield sse_error(reason, f"the inference server sent nothing for {idle_s:g} s; the stream "
                                            "is incomplete")
                except CLIENT_ERRORS as e:
                    _http_failure(o, e)
                    yield sse_error(o.error or "upstream_error", "the inference server's stream broke off; the "
                                                                 "stream is incomplete")
                finally:
                    guard.stop()
            if not self.ended and o.error is None:
                o.error = "upstream_disconnected"
                yield sse_error(o.error, "the inference server ended the stream early; the stream is incomplete")
            finished = True
            if o.latency_s is None:
                o.latency_s = self._elapsed()
        finally:
            if not finished:  # the client went away before the end (or the server is shutting down)
                if o.error is None:
                    o.error, o.client_fault = "client_disconnected", True
                self._close()
            elif self.ended:  # [DONE] or the server's error event: the rest of its response, read in the background
                self._put_back(idle_s)
            else:
                self._close()
            if o.latency_s is None:
                o.latency_s = self._elapsed()
            self.ended = True
            self._let_go()
            self.end()

    def abandon(self) -> None:
        """Give up a successful exchange that will not be answered (its decision could not be made
        durable, or the request was cancelled): the server's connection closed, the server let go."""
        self._close()
        self._let_go()
        if self.outcome.latency_s is None:
            self.outcome.latency_s = self._elapsed()

    def end(self) -> None:
        """Call ``on_end`` (once)."""
        callback, self.on_end = self.on_end, None
        if callback is not None:
            callback()

    # ---------------------------------------------------------------------------------- events
    def _feed(self, chunk: bytes) -> None:
        """Cut ``chunk`` (after what remained of the previous one) into SSE events and handle each."""
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        buf = self._rest + chunk if self._rest else chunk
        parts = buf.split(b"\n\n")
        self._rest = parts.pop()
        for ev in parts:
            if ev and not self.ended:
                self._event(ev)

    def _event(self, ev: bytes) -> None:
        o = self.outcome
        if not ev.startswith(b"data:"):
            self._out.append(ev + b"\n\n")  # a comment or another field: as it came
            return
        data = ev[5:].strip()
        if data == b"[DONE]":
            self.done = self.ended = True
            if o.latency_s is None:
                o.latency_s = self._elapsed()
            self._out.append(b"data: [DONE]\n\n")
            return
        drop = False
        if (not self.first or self.keep_text or b'"usage":{' in data or b'"usage": {' in data
                or b'"error"' in data):
            obj = loads_or_none(data)
            if isinstance(obj, dict):
                if "error" in obj and not obj.get("choices"):
                    o.error = "upstream_error_event"
                    self.ended = True
                    if o.latency_s is None:
                        o.latency_s = self._elapsed()
                    if not self.first:
                        return  # before the first token: retried, the client sees none of it
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    _usage(o, usage)
                    drop = not self.want_usage and not obj.get("choices")
                if not self.first and has_token(obj):
                    self.first = True
                    self.received = time.perf_counter()
                    o.ttft_s = self.received - self.started
                if self.keep_text:
                    chunk_texts(obj, self.texts)
        if self.first and not drop and b'"choices":[]' not in data:
            self.token_events += 1
        if drop:
            return
        if self._rename is not None:
            data = data.replace(*self._rename, 1)
        self._out.append(b"data: " + data + b"\n\n")

    # ---------------------------------------------------------------------------------- the end
    def finish_counts(self) -> None:
        """Fill what the server's usage did not say: the output tokens from the chunks."""
        o = self.outcome
        if o.output_tokens is None and (self.first or self.done) and o.answer_status is None:
            o.output_tokens = self.token_events

    def _put_back(self, within_s: float) -> None:
        """Done with a server's stream that said all it had to (``[DONE]``): its response goes back
        to the pool now if it has ended, else once the rest has been read (``Upstreams.drain``)."""
        response, self.response = self.response, None
        if response is not None:
            if response.content.at_eof():
                response.release()
            else:
                self.upstreams.drain(response, within_s)

    def _close(self) -> None:
        """Done with the server's response: read to its end, its connection goes back to the pool;
        not (an error, a timeout, the client left), the connection is closed -- which tells the
        server to stop generating."""
        response, self.response = self.response, None
        if response is not None:
            if response.content.at_eof():
                response.release()
            else:
                response.close()
