"""Issue 34's fault drill of the OpenAI-compatible gateway (``router/gateway``), one test per finding,
against real servers: the router's app on a real uvicorn server, the official ``openai`` client (or
httpx where the bytes matter), stand-ins that behave like vLLM (``tests/vllm_standin.py``) and
ports nobody listens on, all on loopback.

2. a body nested too deeply for the JSON parser is a 422 naming ``body`` on every JSON route, the
   gateway's as ``/v1/route``'s, never a 500;
3. a stream whose ``data: [DONE]`` reached the client is completed -- measured, scored and learnt
   -- even when the client closes before the server's response has ended (the ``openai`` client
   closes at ``[DONE]``; a server that lingers after it);
4. the body fields the gateway reads take their JSON Schema types only (``"12"``, ``true`` or
   ``12.5`` for an integer, ``"yes"`` for a boolean are 422s naming the field), and the fields it
   does not read still go to the server as sent;
5. a server of a pool that refuses connections sends the request to the pool's other server (same
   decision), and a request retried on other offerings counts once in its tenant's quotas.

One router (module fixture) with four pools: ``X`` -- a port nobody listens on, listed first, then
the live stand-in ``a``; ``Y`` -- the live stand-in ``b``; ``Z`` -- only a dead port; ``W`` -- the
stand-in ``c``, given ``503`` faults where a test wants a failing pool. ``upstream_down_s: 0``: a
server that refused a connection is not skipped by later requests (each request meets it again).
Telemetry replays at 1e-6 s per s: nothing ends by itself."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from router.app.factory import create_app
from router.control.keys import add_key
from tests.servers import ServerThread, free_port
from tests.state_support import core_stats
from tests.test_router_support import RouterSetup, make_setup
from tests.vllm_standin import Fault, StandIn, StandInConfig

X, Y = "aws:us-east-1:g5.xlarge:on_demand", "aws:us-east-1:g5.xlarge:spot"
Z, W = "gcp:europe-west4:g2-standard-4:on_demand", "gcp:europe-west4:g2-standard-4:spot"
MODEL = "llama-2-7b"
QUOTA_N = 3  # requests_per_day of the quota tenants
CHAT = [{"role": "user", "content": "hello there, how are you"}]


@dataclass
class Drill:
    url: str
    setup: RouterSetup
    a: StandIn
    b: StandIn
    c: StandIn
    srv: ServerThread

    def client(self, who: str = "a") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.setup.keys[who], max_retries=0)

    @property
    def services(self) -> Any:
        app = self.srv.config.loaded_app
        while not hasattr(app, "services"):
            app = app.app
        return app.services

    def rows(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        con = sqlite3.connect(f"file:{self.setup.root / 'decisions.db'}?mode=ro", uri=True)
        con.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in con.execute(sql, args)]
        finally:
            con.close()

    def attempts(self, request_id: str, n: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
        """A gateway request's attempts (decision + feedback), oldest first, once ``n`` have feedback."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.rows("SELECT d.decision_id, d.offering_id, d.quota_tokens, d.input_tokens, f.failed, f.error, "
                             "f.output_tokens, f.ttft_ms, f.latency_ms, f.reward, f.attempt FROM feedback f JOIN "
                             "decisions d ON d.decision_id = f.decision_id WHERE f.request_id = ? ORDER BY f.attempt",
                             request_id)
            if len(rows) >= n or time.monotonic() > deadline:
                return rows

    def settle(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.services.state.core.view().in_flight and time.monotonic() < deadline:
            time.sleep(0.02)

    def metric(self, line_start: str) -> float:
        page = httpx.get(f"{self.url}/metrics", headers=self.setup.auth("admin"), timeout=10).text
        return sum(float(x.rsplit(" ", 1)[1]) for x in page.splitlines() if x.startswith(line_start))


def _setup(tmp: Path, a_url: str, b_url: str, c_url: str) -> RouterSetup:
    dead1, dead2 = f"http://127.0.0.1:{free_port()}/v1", f"http://127.0.0.1:{free_port()}/v1"
    quota = {"requests_per_day": QUOTA_N, "tokens_per_minute": 10**9, "usd_per_day": 1000.0, "max_concurrent": 10}
    setup = make_setup(
        tmp, replay_speed=1e-6,
        upstreams=[{"offering_id": X, "base_urls": [dead1, f"{a_url}/v1"]},
                   {"offering_id": Y, "base_urls": [f"{b_url}/v1"]},
                   {"offering_id": Z, "base_urls": [dead2]},
                   {"offering_id": W, "base_urls": [f"{c_url}/v1"]}],
        gateway={"origin": "aws:us-east-1", "first_token_timeout_s": 2.0, "idle_timeout_s": 2.0,
                 "response_timeout_s": 5.0, "connect_timeout_s": 1.0, "upstream_down_s": 0.0, "ttft_ms": 5000,
                 # (each request's retries are what these tests watch: no ejection, no budget --
                 # tests/test_gateway_ejection.py tests those)
                 "ejection": {"enabled": False}, "retry_budget": {"enabled": False}},
        tenants={"p": {"constraints": {"prefer": [{"offering_ids": [X]}]}},
                 "y": {"constraints": {"prefer": [{"offering_ids": [Y]}]}},
                 "qz": {"constraints": {"prefer": [{"offering_ids": [Z]}]}, "quotas": quota},
                 "qw": {"constraints": {"prefer": [{"offering_ids": [W]}]}, "quotas": quota},
                 "qf": {"quotas": {**quota, "requests_per_day": 100}}})
    for who in ("p", "y", "qz", "qw", "qf"):
        setup.keys[who] = add_key(tmp / "keys.json", who)
    return setup


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Drill]:
    tmp = tmp_path_factory.mktemp("gateway-drill")
    a, b, c = StandIn(), StandIn(), StandIn()
    with ServerThread(a) as a_url, ServerThread(b) as b_url, ServerThread(c) as c_url:
        setup = _setup(tmp, a_url, b_url, c_url)
        srv = ServerThread(create_app(setup.settings))
        with srv as url:
            yield Drill(url, setup, a, b, c, srv)


@pytest.fixture(autouse=True)
def _fresh(drill: Drill) -> Iterator[None]:
    for s in (drill.a, drill.b, drill.c):
        s.config = StandInConfig(ttft_s=0.02, tpot_s=0.005)
        s._slots = None
        s.faults.clear()
    drill.settle()
    yield
    drill.c.faults.clear()


def _rid(tag: str) -> str:
    return f"t-{tag}-{time.monotonic_ns()}"


# ------------------------------------------------------------------------------------------------ 2
def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/route", "/v1/feedback"])
def test_a_body_nested_too_deeply_is_a_422_naming_the_body(drill: Drill, path: str) -> None:
    """``{"model": ..., "messages": [[[[...]]]]}`` 15,000 deep (~30 KB): 422 on ``body`` saying
    what is wrong, as ``/v1/route`` answers (and ``/v1/feedback``, whose body FastAPI parses), never
    a 500."""
    field = {"/v1/chat/completions": b"messages", "/v1/completions": b"prompt", "/v1/route": b"constraints",
             "/v1/feedback": b"decision_id"}[path]
    raw = b'{"model":"' + MODEL.encode() + b'","' + field + b'":' + _nested(15_000) + b"}"
    r = httpx.post(f"{drill.url}{path}", content=raw, timeout=30,
                   headers={**drill.setup.auth("a"), "content-type": "application/json"})
    assert r.status_code == 422, r.text[:500]
    body = r.json()
    if path in ("/v1/route", "/v1/feedback"):
        fields, message = body["fields"], body["message"]
    else:  # (OpenAI's error shape, the router's fields inside)
        assert body["error"]["param"] == "body" and body["error"]["code"] == "invalid_request"
        fields, message = body["error"]["fields"], body["error"]["message"]
    why = "nested too deeply" if path == "/v1/feedback" else "recursion limit exceeded"  # (Python's parser, pydantic's)
    assert fields[0]["field"] == "body" and f"invalid JSON: {why}" in fields[0]["message"], fields
    assert "body: invalid JSON" in message
    # the same body a little less deep is read (the limit is the parser's, as /v1/route's)
    if path == "/v1/chat/completions":
        ok = {"model": MODEL, "max_tokens": 2, "messages": CHAT, "response_format": {"type": "json_schema",
              "json_schema": {"name": "deep", "schema": json.loads(_nested(50))}}}
        got = httpx.post(f"{drill.url}{path}", json=ok, headers=drill.setup.auth("a"), timeout=30)
        assert got.status_code == 200, got.text


def test_a_server_answer_nested_too_deeply_is_relayed_not_a_500(drill: Drill) -> None:
    """The server's own JSON (its answer, its events) is read with the same parser: one nested too
    deeply for it goes back to the client as the server sent it, not a 500."""
    drill.b.faults.append(Fault("body", 200, body=b'{"choices":' + _nested(5_000) + b"}"))
    r = httpx.post(f"{drill.url}/v1/chat/completions", headers={**drill.setup.auth("y"), "X-Request-ID": _rid("deep")},
                   json={"model": MODEL, "messages": CHAT, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.content.startswith(b'{"choices":[[[['), r.text[:200]


# ------------------------------------------------------------------------------------------------ 3
def test_a_stream_whose_done_reached_the_client_is_completed(drill: Drill) -> None:
    """The server ends its response 200 ms after ``data: [DONE]``; the ``openai`` client closes
    its connection as soon as it has read ``[DONE]``. Every such stream is logged completed, with
    its output, TTFT and reward, and feeds the pool's statistics -- and the server's response is
    read to its end rather than cut (its connection goes back to the pool)."""
    drill.b.config = StandInConfig(ttft_s=0.02, tpot_s=0.005, linger_s=0.2)
    engine = drill.services.engine
    pool = engine.pool_key_of(Y, MODEL)
    outcomes = core_stats(drill.services.state, pool).outcomes
    cancelled = drill.b.cancelled
    rids = []
    for i in range(10):
        rid = _rid(f"done{i}")
        rids.append(rid)
        stream = drill.client("y").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, stream=True,
                                                           extra_headers={"X-Request-ID": rid})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == "tok0 tok1 tok2 tok3 tok4 tok5"
    for rid in rids:
        (att,) = drill.attempts(rid)
        assert att["offering_id"] == Y
        assert (att["failed"], att["error"]) == (0, None), att
        assert att["output_tokens"] == 6 and att["ttft_ms"] is not None and att["reward"] is not None
    drill.settle()
    time.sleep(0.3)  # (the last server response's 200 ms)
    assert core_stats(drill.services.state, pool).outcomes == outcomes + 10
    assert drill.b.cancelled == cancelled  # read to the end, not cut off


# ------------------------------------------------------------------------------------------------ 4
def _published(drill: Drill, name: str) -> jsonschema.Draft202012Validator:
    spec = httpx.get(f"{drill.url}/openapi.json", timeout=10).json()
    return jsonschema.Draft202012Validator({**spec["components"]["schemas"][name], "components": spec["components"]})


@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "max_tokens", "12"), ("/v1/chat/completions", "max_tokens", True),
    ("/v1/chat/completions", "max_tokens", 12.5), ("/v1/chat/completions", "max_completion_tokens", "12"),
    ("/v1/chat/completions", "n", "2"), ("/v1/chat/completions", "n", True),
    ("/v1/chat/completions", "stream", "yes"), ("/v1/chat/completions", "stream", 1),
    ("/v1/chat/completions", "stream_options", {"include_usage": "yes"}),
    ("/v1/completions", "max_tokens", "12"), ("/v1/completions", "n", "2"), ("/v1/completions", "stream", "yes"),
    ("/v1/completions", "prompt", [1, True]), ("/v1/completions", "prompt", [[1, "2"]]),
])
def test_the_fields_the_gateway_reads_take_their_json_types_only(drill: Drill, path: str, field: str,
                                                                  value: Any) -> None:
    """Each of these values is refused by the served OpenAPI document's schema for the body (JSON
    Schema 2020-12) and by the gateway, which names the field and forwards nothing."""
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "once upon a time"})
    schema = _published(drill, "ChatBody" if path.endswith("chat/completions") else "CompletionBody")
    assert schema.is_valid(base) and not schema.is_valid({**base, field: value})
    sent = len(drill.a.requests) + len(drill.b.requests) + len(drill.c.requests)
    r = httpx.post(f"{drill.url}{path}", json={**base, field: value}, headers=drill.setup.auth("y"), timeout=30)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and err["param"].startswith(f"body.{field}"), err
    assert len(drill.a.requests) + len(drill.b.requests) + len(drill.c.requests) == sent  # nothing forwarded


def test_json_integers_and_nulls_pass_and_fields_the_gateway_does_not_read_go_as_sent(drill: Drill) -> None:
    """What the published schema calls an integer (``12.0`` too) and OpenAI's nulls are taken;
    fields the gateway does not read go to the server as the client sent them."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3.0, "n": None, "stream": None, "stream_options": None,
            "temperature": 0.2, "logit_bias": {"50256": -100}, "user": "u-1", "vendor_extension": {"x": [1, 2]}}
    assert _published(drill, "ChatBody").is_valid(body)
    r = httpx.post(f"{drill.url}/v1/chat/completions", json=body, headers=drill.setup.auth("y"), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
    got = drill.b.bodies[-1]
    assert {k: got[k] for k in ("temperature", "logit_bias", "user", "vendor_extension", "max_tokens")} == {
        "temperature": 0.2, "logit_bias": {"50256": -100}, "user": "u-1", "vendor_extension": {"x": [1, 2]},
        "max_tokens": 3.0}
    rows = drill.rows("SELECT max_output_tokens FROM decisions WHERE decision_id = ?",
                      r.headers["x-xroute-decision-id"])
    assert rows == [{"max_output_tokens": 3}]


# ------------------------------------------------------------------------------------------------ 5
@pytest.mark.parametrize("stream", [False, True])
def test_a_server_that_refuses_connections_sends_the_request_to_its_pools_other_server(drill: Drill,
                                                                                      stream: bool) -> None:
    """``X``'s first server refuses connections: each request that meets it goes to ``X``'s live
    server -- one attempt, one decision -- never to another offering."""
    retries = drill.metric('xroute_gateway_server_retries_total{offering_id="' + X)
    for i in range(4):  # (servers are taken in turn: half of these meet the dead one first)
        rid = _rid(f"pool{i}")
        c = drill.client("p")
        if stream:
            with c.chat.completions.with_streaming_response.create(
                    model=MODEL, messages=CHAT, max_tokens=3, stream=True, extra_headers={"X-Request-ID": rid}) as raw:
                headers = raw.headers
                text = "".join(x.choices[0].delta.content or "" for x in raw.parse() if x.choices)
        else:
            got = c.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_tokens=3,
                                                              extra_headers={"X-Request-ID": rid})
            headers, text = got.headers, got.parse().choices[0].message.content
        assert text == "tok0 tok1 tok2"
        assert (headers["x-xroute-offering"], headers["x-xroute-attempts"]) == (X, "1"), dict(headers)
        (att,) = drill.attempts(rid)
        assert (att["offering_id"], att["failed"], att["attempt"]) == (X, 0, 1)
        time.sleep(0.2)
        assert len(drill.attempts(rid, 2, timeout=0.0)) == 1  # one decision, however many servers it took
    assert drill.metric('xroute_gateway_server_retries_total{offering_id="' + X) >= retries + 2


def _usage(drill: Drill, who: str) -> dict[str, Any]:
    got = httpx.get(f"{drill.url}/v1/quotas", headers=drill.setup.auth(who), timeout=10).json()["buckets"]
    return dict(got[0])


@pytest.mark.parametrize("who", ["qz", "qw"])
def test_a_request_retried_on_other_offerings_counts_once_in_its_tenants_quotas(drill: Drill, who: str) -> None:
    """A tenant with ``requests_per_day: 3`` whose preferred pool fails every request before its
    first token (``qz``: its only server refuses connections; ``qw``: its server answers 503): each
    request takes two attempts or more, yet three requests are served, the fourth is refused 429
    naming ``requests_per_day``, and ``GET /v1/quotas`` says three requests -- their tokens counted
    once, their concurrency slots freed. In the decision log one decision of each request holds its
    quota (a rebuild counts each request once)."""
    if who == "qw":
        drill.c.faults.extend([Fault("status", 503)] * 20)
    rids = []
    for i in range(QUOTA_N):
        rid = _rid(f"{who}{i}")
        rids.append(rid)
        got = drill.client(who).chat.completions.with_raw_response.create(
            model=MODEL, messages=CHAT, max_tokens=4, extra_headers={"X-Request-ID": rid})
        assert got.parse().choices[0].message.content == "tok0 tok1 tok2 tok3"
        assert int(got.headers["x-xroute-attempts"]) >= 2
    with pytest.raises(openai.RateLimitError) as e:
        drill.client(who).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert e.value.code == "quota_exceeded" and e.value.body["limit"]["name"] == "requests_per_day"  # type: ignore[index]
    drill.settle()
    per_request = []
    for rid in rids:
        rows = drill.attempts(rid, 2)
        assert len(rows) >= 2 and rows[0]["failed"] == 1 and rows[-1]["failed"] == 0
        assert [r["quota_tokens"] is not None for r in rows] == [True] + [False] * (len(rows) - 1)
        per_request.append(rows[0]["input_tokens"] + 4)
    deadline = time.monotonic() + 5
    while _usage(drill, who)["concurrent"] and time.monotonic() < deadline:
        time.sleep(0.02)
    usage = _usage(drill, who)
    assert (usage["requests_day"], usage["concurrent"]) == (QUOTA_N, 0), usage
    assert usage["tokens_window"] == sum(per_request), usage  # the prompt and the output, once a request


def test_a_request_no_offering_serves_counts_once_with_its_prompt(drill: Drill) -> None:
    """Every offering fails before its first token: the client gets the last failure with every
    attempt, and its tenant's quotas count one request -- its prompt's tokens, no slot held."""
    for s in (drill.a, drill.b, drill.c):
        s.faults.extend([Fault("status", 503)] * 5)
    before = _usage(drill, "qf")
    rid = _rid("allfail")
    with pytest.raises(openai.APIStatusError) as e:
        drill.client("qf").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                                   extra_headers={"X-Request-ID": rid})
    assert e.value.status_code == 502 and len(e.value.body["attempts"]) == 3  # type: ignore[index]
    rows = drill.attempts(rid, 3)
    assert [r["failed"] for r in rows] == [1, 1, 1]
    drill.settle()
    deadline = time.monotonic() + 5
    while _usage(drill, "qf")["concurrent"] and time.monotonic() < deadline:
        time.sleep(0.02)
    after = _usage(drill, "qf")
    assert after["requests_day"] - before["requests_day"] == 1 and after["concurrent"] == 0, (before, after)
    assert after["tokens_window"] - before["tokens_window"] == rows[0]["input_tokens"]
