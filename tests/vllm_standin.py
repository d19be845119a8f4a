"""A stand-in for an OpenAI-compatible inference server that behaves like vLLM's, for the gateway's
tests and benchmark (``router/gateway``, ``benchmarks/bench_gateway.py``).

What it does as vLLM does: ``POST /v1/chat/completions`` and ``/v1/completions``, streamed as
Server-Sent Events (a first chunk with the role, one chunk per token, a last chunk with the
finish reason, ``usage`` in a chunk of its own with empty ``choices`` when
``stream_options.include_usage`` is set, then ``data: [DONE]``) and not streamed (one JSON answer
with ``usage``); ``prompt_tokens_details.cached_tokens`` from a prefix cache (the longest prefix,
in words, the prompt shares with the last prompts it saw); ``GET /v1/models``; ``GET /metrics`` in
vLLM's metric names (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, token and request counters); at most ``max_num_seqs`` requests
generating at once, the rest waiting; a client that disconnects stops its generation (counted in
``cancelled``). Its timing is configurable: ``ttft_s`` before the first token, ``tpot_s`` between
tokens, and ``linger_s`` between a stream's ``data: [DONE]`` and the end of its response. Tokens
are the words ``tok0``, ``tok1``, ...; prompt tokens are counted as words.

Faults, injected per request (``faults``, consumed in order, or ``POST /admin/faults`` for a
stand-in in another process): an HTTP error status (429 with ``Retry-After``, 5xx), a hang (no
answer until the client goes away), a dropped connection before or after some tokens, and an
error event in the stream, an answer of given bytes.

Run it in a thread (``tests.servers.ServerThread(StandIn(...))``) or as a process:
``python -m tests.vllm_standin --port 8001 --ttft-ms 50 --tpot-ms 10``."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


@dataclass
class Fault:
    """``status``: answer ``status`` (with ``retry_after``) instead; ``hang``: answer nothing until
    the client leaves; ``drop``: send the headers and ``after_tokens`` tokens, then drop the
    connection; ``error_event``: after ``after_tokens`` tokens, an error event and the end;
    ``body``: answer ``status`` with ``body`` (JSON bytes, as they are) instead."""

    kind: Literal["status", "hang", "drop", "error_event", "body"]
    status: int = 503
    after_tokens: int = 0
    retry_after: str | None = None
    body: bytes | str | None = None


@dataclass
class StandInConfig:
    model: str = "llama-2-7b"
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    #: tokens generated: this many when set, else the request's max_tokens, else ``default_tokens``
    output_tokens: int | None = None
    default_tokens: int = 16
    max_num_seqs: int = 256
    #: the key clients must send (``Authorization: Bearer``); None: none needed
    api_key: str | None = None
    #: a stream's response ends this long after its ``data: [DONE]`` (a server that lingers)
    linger_s: float = 0.0
    #: answer every request this HTTP status (a server that keeps failing) when no fault is queued; None: serve
    fail_status: int | None = None


class _Drop(Exception):
    """Raised after the headers: the server drops the connection (uvicorn closes it)."""


def _words(body: dict[str, Any]) -> list[str]:
    if "messages" in body:
        out: list[str] = []
        for m in body.get("messages") or []:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                out += c.split()
            elif isinstance(c, list):
                out += [w for p in c if isinstance(p, dict) for w in str(p.get("text", "")).split()]
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.split()
    if isinstance(prompt, list):
        return [str(x) for x in prompt]
    return []


class StandIn:
    """The ASGI app (module docstring)."""

    def __init__(self, config: StandInConfig | None = None):
        self.config = config or StandInConfig()
        self.faults: collections.deque[Fault] = collections.deque()
        self.running = 0
        self.waiting = 0
        self.completed = 0
        self.cancelled = 0
        self.requests: list[dict[str, Any]] = []
        #: the request bodies, as they came (parsed)
        self.bodies: list[dict[str, Any]] = []
        self._prefixes: collections.deque[list[str]] = collections.deque(maxlen=32)
        self._slots: asyncio.Semaphore | None = None
        r = self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._g_running = Gauge("vllm:num_requests_running", "Requests generating", labels, registry=r)
        self._g_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", labels, registry=r)
        self._g_kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1", labels, registry=r)
        self._c_prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed", labels, registry=r)
        self._c_gen = Counter("vllm:generation_tokens", "Generation tokens processed", labels, registry=r)
        self._c_ok = Counter("vllm:request_success", "Requests finished", labels, registry=r)

    # ------------------------------------------------------------------------------ ASGI
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if method == "GET" and path == "/metrics":
            await self._metrics(send)
        elif method == "GET" and path == "/v1/models":
            await _json(send, 200, {"object": "list", "data": [{"id": self.config.model, "object": "model",
                                                                "owned_by": "vllm"}]})
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            if self.config.api_key is not None and _header(scope, b"authorization") != f"Bearer {self.config.api_key}":
                await _json(send, 401, {"error": {"message": "bad key", "type": "authentication_error", "code": 401}})
                return
            await self._generate(scope, receive, send, path.endswith("chat/completions"), json.loads(body))
        elif method == "POST" and path == "/admin/faults":
            self.faults.extend(Fault(**f) for f in json.loads(body))
            await _json(send, 200, {"faults": len(self.faults)})
        elif method == "POST" and path == "/admin/config":
            for k, v in json.loads(body).items():
                setattr(self.config, k, v)
            self._slots = None
            await _json(send, 200, asdict(self.config))
        elif method == "GET" and path == "/admin/stats":
            await _json(send, 200, {"completed": self.completed, "cancelled": self.cancelled, "running": self.running,
                                    "waiting": self.waiting, "requests": len(self.requests)})
        else:
            await _json(send, 404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})

    async def _metrics(self, send: Any) -> None:
        m = self.config.model
        self._g_running.labels(m).set(self.running)
        self._g_waiting.labels(m).set(self.waiting)
        self._g_kv.labels(m).set(min(1.0, self.running / max(1, self.config.max_num_seqs)))
        await _send(send, 200, generate_latest(self.registry), b"text/plain; version=0.0.4")

    # ------------------------------------------------------------------------------ generation
    def _cached(self, words: list[str]) -> int:
        best = 0
        for p in self._prefixes:
            n = 0
            for a, b in zip(p, words):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self._prefixes.append(words)
        return best

    async def _generate(self, scope: dict[str, Any], receive: Any, send: Any, chat: bool, body: dict[str, Any]) -> None:
        cfg = self.config
        self.requests.append({"path": scope["path"], "model": body.get("model"), "stream": body.get("stream", False),
                              "stream_options": body.get("stream_options"), "max_tokens": body.get("max_tokens"),
                              "authorization": _header(scope, b"authorization"),
                              "traceparent": _header(scope, b"traceparent")})
        self.bodies.append(body)
        fault = self.faults.popleft() if self.faults else None
        if fault is None and cfg.fail_status is not None:
            fault = Fault("status", cfg.fail_status)
        if fault is not None and fault.kind == "body":
            raw = fault.body.encode() if isinstance(fault.body, str) else fault.body or b""
            await _send(send, fault.status, raw, b"application/json")
            return
        if fault is not None and fault.kind == "status":
            headers = [(b"retry-after", fault.retry_after.encode())] if fault.retry_after else []
            await _json(send, fault.status, {"error": {"message": f"stand-in fault {fault.status}", "type": "error",
                                                       "code": fault.status}}, headers)
            return
        words = _words(body)
        cached = self._cached(words)
        budget = body.get("max_completion_tokens") or body.get("max_tokens")
        n_out = cfg.output_tokens if cfg.output_tokens is not None else int(budget or cfg.default_tokens)
        stream = bool(body.get("stream"))
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        task = asyncio.current_task()
        assert task is not None
        gone = asyncio.Event()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    task.cancel()
                    return

        watcher = asyncio.get_running_loop().create_task(watch())
        if self._slots is None:
            self._slots = asyncio.Semaphore(cfg.max_num_seqs)
        self.waiting += 1
        admitted = False
        try:
            async with self._slots:
                self.waiting -= 1
                admitted = True
                self.running += 1
                try:
                    if fault is not None and fault.kind == "hang":
                        await asyncio.Event().wait()  # until the client goes away
                    self._c_prompt.labels(cfg.model).inc(len(words))
                    rid = f"{'chatcmpl' if chat else 'cmpl'}-{id(task):x}"
                    usage = {"prompt_tokens": len(words), "completion_tokens": n_out,
                             "total_tokens": len(words) + n_out, "prompt_tokens_details": {"cached_tokens": cached}}
                    if stream:
                        await self._stream(send, chat, rid, n_out, usage if usage_wanted else None, fault)
                    else:
                        await asyncio.sleep(cfg.ttft_s + cfg.tpot_s * max(0, n_out - 1))
                        text = " ".join(f"tok{i}" for i in range(n_out))
                        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                                   "logprobs": None, "finish_reason": "length"} if chat else
                                                  {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
                        await _json(send, 200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                                "created": int(time.time()), "model": cfg.model, "choices": [choice],
                                                "usage": usage})
                        self._c_gen.labels(cfg.model).inc(n_out)
                    self.completed += 1
                    self._c_ok.labels(cfg.model).inc()
                finally:
                    self.running -= 1
        except asyncio.CancelledError:
            if not gone.is_set():
                raise
            self.cancelled += 1
        finally:
            if not admitted:
                self.waiting -= 1
            watcher.cancel()

    async def _stream(self, send: Any, chat: bool, rid: str, n_out: int, usage: dict[str, Any] | None,
                      fault: Fault | None) -> None:
        cfg = self.config
        created = int(time.time())
        head = json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": cfg.model}, separators=(",", ":"))[:-1]
        if chat:
            piece = head + ',"choices":[{"index":0,"delta":{"content":%s},"logprobs":null,"finish_reason":null}]}'
        else:
            piece = head + ',"choices":[{"index":0,"text":%s,"logprobs":null,"finish_reason":null}]}'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})

        async def event(data: str) -> None:
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        if chat:
            await event(head + ',"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                               '"finish_reason":null}]}')
        if cfg.ttft_s > 0:
            await asyncio.sleep(cfg.ttft_s)
        for i in range(n_out):
            if fault is not None and fault.after_tokens == i:
                if fault.kind == "drop":
                    raise _Drop("the stand-in drops the connection")
                if fault.kind == "error_event":
                    await event(json.dumps({"error": {"object": "error", "message": "stand-in error event",
                                                      "type": "InternalServerError", "code": 500}}))
                    await event("[DONE]")
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
            if i and cfg.tpot_s > 0:
                await asyncio.sleep(cfg.tpot_s)
            await event(piece % json.dumps(f" tok{i}" if i else "tok0"))
            self._c_gen.labels(cfg.model).inc()
        if fault is not None and fault.kind == "drop" and fault.after_tokens >= n_out:
            raise _Drop("the stand-in drops the connection")
        finish = (',"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]}' if chat else
                  ',"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}')
        await event(head + finish)
        if usage is not None:
            await event(head + ',"choices":[],"usage":' + json.dumps(usage, separators=(",", ":")) + "}")
        await event("[DONE]")
        if cfg.linger_s > 0:
            await asyncio.sleep(cfg.linger_s)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return str(v.decode("latin-1"))
    return None


async def _send(send: Any, status: int, body: bytes, content_type: bytes,
                headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Any, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await _send(send, status, json.dumps(obj, separators=(",", ":")).encode(), b"application/json", headers)


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--tpot-ms", type=float, default=0.0)
    p.add_argument("--tokens", type=int, default=None, help="tokens per answer (default: the request's max_tokens)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    a = p.parse_args()
    app = StandIn(StandInConfig(model=a.model, ttft_s=a.ttft_ms / 1000.0, tpot_s=a.tpot_ms / 1000.0,
                                output_tokens=a.tokens, max_num_seqs=a.max_num_seqs))
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
