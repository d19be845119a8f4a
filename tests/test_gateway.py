"""The OpenAI-compatible gateway (``router/gateway``), end to end: the official ``openai`` client
against the router on a real uvicorn server, forwarding to stand-ins that behave like vLLM
(``tests/vllm_standin.py``) on loopback -- streamed and not, chat and legacy completions, the
measured outcome in the decision log and the closed loop, retries on the next offering before the
first token (a 503, a 429, a dead server, a hang), an error event after it (a dropped connection,
the server's error event, a silent server), a client that goes away, a slow server, bad input,
keys, and prompts kept only for a tenant that opted in.

One router serves most tests (module fixture): four pools -- two live stand-ins, A
(``X``, on-demand) and B (``Y``, spot), sharing one fault queue (the next request to either gets
the next fault), one server that refuses connections (``Z``), and ``W`` on A again -- and tenants
whose constraints make the first choice known: ``p`` prefers ``X``, ``d`` prefers the dead ``Z``,
``s`` keeps its transcripts. Telemetry replays at 1e-6 s per s: nothing ends by itself."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from router.app.factory import create_app
from router.control.keys import add_key
from router.core.settings import load_settings
from router.gateway.openai_api import has_token
from router.gateway.tokens import PromptCounter, chat_texts, estimate
from router.service.scrape import parse_metrics
from tests.servers import ServerThread, free_port
from tests.state_support import core_stats
from tests.test_router_support import LogCapture, RouterSetup, make_setup
from tests.vllm_standin import Fault, StandIn, StandInConfig
from xroute.errors import ConfigError

X, Y = "aws:us-east-1:g5.xlarge:on_demand", "aws:us-east-1:g5.xlarge:spot"
Z, W = "gcp:europe-west4:g2-standard-4:on_demand", "gcp:europe-west4:g2-standard-4:spot"
MODEL = "llama-2-7b"
MARKER = "purple-elephant-7731"  # a prompt's words that must never reach a log


@dataclass
class Gw:
    url: str
    setup: RouterSetup
    a: StandIn
    b: StandIn
    srv: ServerThread
    logs: LogCapture

    def client(self, who: str = "a", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.setup.keys[who], max_retries=0, **kw)

    @property
    def services(self) -> Any:
        app = self.srv.config.loaded_app
        while not hasattr(app, "services"):
            app = app.app
        return app.services

    def attempts(self, request_id: str, n: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The decision log's attempts of one gateway request (decision + its feedback), oldest first,
        once ``n`` of them have their feedback (recorded after the answer)."""
        deadline = time.monotonic() + timeout
        while True:
            con = sqlite3.connect(f"file:{self.setup.root / 'decisions.db'}?mode=ro", uri=True)
            con.row_factory = sqlite3.Row
            rows = [dict(r) for r in con.execute(
                "SELECT d.decision_id, d.offering_id, d.ttft_ms AS slo_ttft_ms, d.input_tokens, d.max_output_tokens, "
                "d.request_json, f.latency_ms, f.ttft_ms, f.tpot_ms, f.output_tokens, f.prompt_tokens, "
                "f.cached_tokens, f.failed, f.error, f.reward, f.sla_violation, f.attempt, f.request_id "
                "FROM feedback f JOIN decisions d ON d.decision_id = f.decision_id WHERE f.request_id = ? "
                "ORDER BY f.attempt", (request_id,))]
            con.close()
            if len(rows) >= n or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)

    def in_flight(self) -> dict[str, int]:
        return dict(self.services.state.core.view().in_flight)

    def settle(self, timeout: float = 5.0) -> None:
        """Wait until no reservation is held (the loops close after the answers)."""
        deadline = time.monotonic() + timeout
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)


def _gateway_setup(tmp: Path, a_url: str, b_url: str, dead_url: str, **gateway: Any) -> RouterSetup:
    setup = make_setup(
        tmp, replay_speed=1e-6,
        upstreams=[{"offering_id": X, "base_urls": [f"{a_url}/v1"]},
                   {"offering_id": Y, "base_urls": [f"{b_url}/v1"]},
                   {"offering_id": Z, "base_urls": [f"{dead_url}/v1"]},
                   {"offering_id": W, "base_urls": [f"{a_url}/v1"]}],
        gateway={"origin": "aws:us-east-1", "first_token_timeout_s": 1.0, "idle_timeout_s": 1.0,
                 "response_timeout_s": 2.0, "connect_timeout_s": 1.0, "transcripts_path": str(tmp / "transcripts.db"),
                 # (each request's retries are what these tests watch: no ejection, no budget --
                 # tests/test_gateway_ejection.py tests those)
                 "ejection": {"enabled": False}, "retry_budget": {"enabled": False}, **gateway},
        tenants={"p": {"constraints": {"prefer": [{"offering_ids": [X]}]}},
                 "d": {"constraints": {"prefer": [{"offering_ids": [Z]}]}},
                 "s": {"gateway": {"store_prompts": True}},
                 "q": {"constraints": {"prefer": [{"offering_ids": [X]}]},
                       "quotas": {"max_concurrent": 4, "tokens_per_minute": 10**9, "requests_per_day": 1000}}})
    keys_file = tmp / "keys.json"
    for who in ("p", "d", "s", "q"):
        setup.keys[who] = add_key(keys_file, who)
    return setup


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gw]:
    tmp = tmp_path_factory.mktemp("gateway")
    a, b = StandIn(), StandIn()
    b.faults = a.faults  # one queue: the next request to either server gets the next fault
    logs = LogCapture().attach()
    try:
        with ServerThread(a) as a_url, ServerThread(b) as b_url:
            setup = _gateway_setup(tmp, a_url, b_url, f"http://127.0.0.1:{free_port()}")
            srv = ServerThread(create_app(setup.settings))
            with srv as url:
                yield Gw(url, setup, a, b, srv, logs)
    finally:
        logs.detach()


@pytest.fixture(autouse=True)
def _fresh(request: pytest.FixtureRequest) -> Iterator[None]:
    if "gw" in request.fixturenames:
        g: Gw = request.getfixturevalue("gw")
        for s in (g.a, g.b):
            s.config = StandInConfig(ttft_s=0.02, tpot_s=0.005)
            s._slots = None
        g.a.faults.clear()
        g.settle()
    yield


def _chat(content: str = "hello there, how are you") -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]


def _rid(tag: str) -> str:
    return f"t-{tag}-{time.monotonic_ns()}"


# ------------------------------------------------------------------------------------------------ serving
def test_models_are_the_configured_ones_with_servers_and_need_a_key(gw: Gw) -> None:
    models = gw.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert sorted(models.data[0].model_extra["offerings"]) == sorted([X, Y, Z, W])  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{gw.url}/v1", api_key="nope", max_retries=0).models.list()
    assert e.value.code == "unauthorized"


def test_a_streamed_chat_is_relayed_measured_and_closes_the_loop(gw: Gw) -> None:
    for s in (gw.a, gw.b):
        s.config = StandInConfig(ttft_s=0.15, tpot_s=0.02)
    engine = gw.services.engine
    est_before = float(engine.env.est_n.sum())
    rid = _rid("stream")
    t0 = time.perf_counter()
    with gw.client().chat.completions.with_streaming_response.create(
            model=MODEL, messages=_chat(), max_tokens=8, stream=True, stream_options={"include_usage": True},
            extra_headers={"X-Request-ID": rid}) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        decision_id, offering = raw.headers["x-xroute-decision-id"], raw.headers["x-xroute-offering"]
        headers_ms = (time.perf_counter() - t0) * 1000.0  # the client's wait for the answer's headers
        overhead_ms = float(raw.headers["x-xroute-overhead-ms"])  # what the gateway added, the server's 150 ms not
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " ".join(f"tok{i}" for i in range(8))
    assert all(c.model == MODEL for c in chunks)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 8 and not chunks[-1].choices
    (att,) = gw.attempts(rid)
    assert att["decision_id"] == decision_id and att["offering_id"] == offering and att["attempt"] == 1
    assert att["failed"] == 0 and att["error"] is None and att["output_tokens"] == 8
    assert 150.0 <= att["ttft_ms"] < 10_000.0  # the stand-in's 150 ms, measured by the gateway
    # the overhead leaves the server's time out: at most the client's wait less the stand-in's 150 ms (how
    # large it is -- a decision, a log commit -- is a benchmark's question: benchmarks/bench_gateway.py)
    assert 0.0 < overhead_ms <= headers_ms - 150.0
    assert att["latency_ms"] >= att["ttft_ms"] + 7 * 20.0
    assert 15.0 <= att["tpot_ms"] < 200.0
    words = sum(len(m["content"].split()) for m in _chat())
    assert att["prompt_tokens"] == words and att["cached_tokens"] is not None
    # the routed request: the prompt estimated (chars/4 + 4 per message + 3), the budget from max_tokens
    texts, fixed = chat_texts({"messages": _chat()})
    assert att["input_tokens"] == fixed + sum(estimate(t) for t in texts) and att["max_output_tokens"] == 8
    assert att["reward"] is not None and att["sla_violation"] == 0  # scored for off-policy evaluation
    # the closed loop, as POST /v1/feedback closes it: released, the pool's statistics, the estimator
    gw.settle()
    assert gw.in_flight() == {}
    st = core_stats(gw.services.state, engine.pool_key_of(offering, MODEL))
    assert st.outcomes >= 1 and st.ttft_ms_mean is not None
    assert float(engine.env.est_n.sum()) > est_before
    # the decision, with the measured outcome, over the API
    rec = httpx.get(f"{gw.url}/v1/decisions/{decision_id}", headers=gw.setup.auth("a")).json()
    (fb,) = rec["feedback"]
    assert fb["request_id"] == rid and fb["output_tokens"] == 8 and fb["tpot_ms"] == pytest.approx(att["tpot_ms"])
    assert rec["request"]["constraints"]["allow"][0]["offering_ids"] == sorted([X, Y, Z, W])


def test_the_usage_chunk_goes_only_to_a_client_that_asked_but_is_always_measured(gw: Gw) -> None:
    rid = _rid("nousage")
    stream = gw.client().chat.completions.create(model=MODEL, messages=_chat(), max_tokens=5, stream=True,
                                                 extra_headers={"X-Request-ID": rid})
    chunks = list(stream)
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "tok0 tok1 tok2 tok3 tok4"
    sent = [r for s in (gw.a, gw.b) for r in s.requests][-1]
    assert sent["stream_options"] == {"include_usage": True}  # asked of the server all the same
    (att,) = gw.attempts(rid)
    assert att["output_tokens"] == 5 and att["prompt_tokens"] is not None


def test_not_streamed_chat_and_legacy_completions(gw: Gw) -> None:
    c = gw.client()
    rid = _rid("plain")
    got = c.chat.completions.with_raw_response.create(model=MODEL, messages=_chat(), max_tokens=6,
                                                      extra_headers={"X-Request-ID": rid, "X-Session-Id": "conv-42",
                                                                     "X-Xroute-Deadline-Ms": "30000"})
    answer = got.parse()
    assert answer.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4 tok5"
    assert answer.usage is not None and answer.usage.completion_tokens == 6 and answer.model == MODEL
    (att,) = gw.attempts(rid)
    assert att["decision_id"] == got.headers["x-xroute-decision-id"]
    assert att["ttft_ms"] is None and att["latency_ms"] > 0 and att["output_tokens"] == 6  # no TTFT unstreamed
    assert att["reward"] is None and att["failed"] == 0  # nothing to score the TTFT SLO on
    rec = httpx.get(f"{gw.url}/v1/decisions/{att['decision_id']}", headers=gw.setup.auth("a")).json()
    assert rec["session_id"] == "conv-42" and 29_000 < rec["request"]["deadline_ms"] <= 30_000
    comp = c.completions.create(model=MODEL, prompt="once upon a time", max_tokens=3)
    assert comp.choices[0].text == "tok0 tok1 tok2"
    streamed = c.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=4, stream=True)
    assert "".join(x.choices[0].text for x in streamed if x.choices) == "tok0 tok1 tok2 tok3"
    gw.settle()
    assert gw.in_flight() == {}
    page = httpx.get(f"{gw.url}/metrics", headers=gw.setup.auth("admin")).text
    assert 'xroute_gateway_requests_total{kind="chat",outcome="ok"}' in page
    assert 'xroute_gateway_requests_total{kind="completion",outcome="ok"}' in page
    assert "xroute_gateway_open_streams 0.0" in page and "xroute_gateway_overhead_seconds_count" in page


# ------------------------------------------------------------------------------------------------ retries
@pytest.mark.parametrize("stream", [True, False])
def test_a_5xx_before_the_first_token_is_retried_on_the_next_offering(gw: Gw, stream: bool) -> None:
    gw.a.faults.append(Fault("status", 503))
    rid = _rid("retry")
    c = gw.client("p")  # prefers X: the first attempt goes there
    if stream:
        with c.chat.completions.with_streaming_response.create(
                model=MODEL, messages=_chat(), max_tokens=4, stream=True, extra_headers={"X-Request-ID": rid}) as raw:
            headers = raw.headers
            text = "".join(x.choices[0].delta.content or "" for x in raw.parse() if x.choices)
    else:
        got = c.chat.completions.with_raw_response.create(model=MODEL, messages=_chat(), max_tokens=4,
                                                          extra_headers={"X-Request-ID": rid})
        headers, text = got.headers, got.parse().choices[0].message.content
    assert text == "tok0 tok1 tok2 tok3"
    assert headers["x-xroute-attempts"] == "2" and headers["x-xroute-offering"] != X
    first, second = gw.attempts(rid, 2)
    assert (first["offering_id"], first["failed"], first["error"]) == (X, 1, "upstream_503")
    assert second["offering_id"] == headers["x-xroute-offering"] and second["failed"] == 0
    assert second["decision_id"] == headers["x-xroute-decision-id"]
    # the retry was decided with what was left of the TTFT budget, the tried offering denied
    assert second["slo_ttft_ms"] < first["slo_ttft_ms"]
    assert json.loads(second["request_json"])["constraints"]["deny"] == [{"offering_ids": [X]}]
    gw.settle()
    assert gw.in_flight() == {}


def test_when_every_offering_refuses_the_client_gets_the_429_with_each_attempt(gw: Gw) -> None:
    gw.a.faults.extend([Fault("status", 429, retry_after="7")] * 3)
    rid = _rid("429")
    with pytest.raises(openai.RateLimitError) as e:
        gw.client("p").chat.completions.create(model=MODEL, messages=_chat(), max_tokens=4,
                                               extra_headers={"X-Request-ID": rid})
    err = e.value
    assert err.code == "upstream_rate_limited" and err.response.headers["retry-after"] == "7"
    tried = err.body["attempts"]  # type: ignore[index]
    # X, Y and W (on A) refused; Z (dead) may be among them: every offering at most once
    assert len(tried) == 3 and len({t["offering_id"] for t in tried}) == 3 and tried[0]["offering_id"] == X
    rows = gw.attempts(rid, 3)
    assert [r["attempt"] for r in rows] == [1, 2, 3] and all(r["failed"] == 1 for r in rows)
    assert [r["decision_id"] for r in rows] == [t["decision_id"] for t in tried]
    gw.settle()
    assert gw.in_flight() == {}


def test_the_gateways_attempts_count_in_their_tenants_quotas_and_settle_with_what_they_used(gw: Gw) -> None:
    """The request's first attempt is a decision of the route (``route_decision``): it counts the
    request in its tenant's quotas. A retry on another offering reserves nothing (the request is
    counted already), and the one reservation is settled when the request ends -- the concurrency
    slot freed, the tokens the real ones (the prompt's estimate + the output measured, once): a
    retried request is one request of the day (``docs/quotas.md``)."""
    def usage() -> dict[str, Any]:
        got = httpx.get(f"{gw.url}/v1/quotas", headers=gw.setup.auth("q"), timeout=10).json()["buckets"]
        return {k: v for k, v in got[0].items() if k in ("concurrent", "tokens_window", "requests_day")}

    before = usage()
    rid = _rid("quota")
    gw.a.faults.append(Fault("status", 503))  # the first attempt (X) fails before its first token
    got = gw.client("q").chat.completions.with_raw_response.create(model=MODEL, messages=_chat(), max_tokens=4,
                                                                    extra_headers={"X-Request-ID": rid})
    assert got.parse().choices[0].message.content == "tok0 tok1 tok2 tok3" and got.headers["x-xroute-attempts"] == "2"
    first, second = gw.attempts(rid, 2)
    gw.settle()
    deadline = time.monotonic() + 5
    while usage()["concurrent"] != before["concurrent"] and time.monotonic() < deadline:
        time.sleep(0.02)
    after = usage()
    assert after["concurrent"] == before["concurrent"] and after["requests_day"] == before["requests_day"] + 1
    assert after["tokens_window"] - before["tokens_window"] == first["input_tokens"] + 4
    assert first["input_tokens"] == second["input_tokens"]  # (the same prompt)


def test_a_dead_server_is_skipped_for_the_next_offering(gw: Gw) -> None:
    rid = _rid("dead")
    got = gw.client("d").chat.completions.with_raw_response.create(  # prefers Z, whose server is down
        model=MODEL, messages=_chat(), max_tokens=3, extra_headers={"X-Request-ID": rid})
    assert got.parse().choices[0].message.content == "tok0 tok1 tok2"
    first, second = gw.attempts(rid, 2)
    assert (first["offering_id"], first["error"], first["failed"]) == (Z, "connect_error", 1)
    assert second["offering_id"] != Z and second["failed"] == 0


def test_a_hung_server_times_out_before_its_first_token_and_the_request_moves(gw: Gw) -> None:
    gw.a.faults.append(Fault("hang"))
    rid = _rid("hang")
    t0 = time.monotonic()
    stream = gw.client("p").chat.completions.create(
        model=MODEL, messages=_chat(), max_tokens=3, stream=True,
        extra_headers={"X-Request-ID": rid, "X-Xroute-TTFT-Ms": "5000"})
    assert "".join(x.choices[0].delta.content or "" for x in stream if x.choices) == "tok0 tok1 tok2"
    assert 1.0 <= time.monotonic() - t0 < 4.0  # first_token_timeout_s = 1
    first, second = gw.attempts(rid, 2)
    assert (first["offering_id"], first["error"]) == (X, "first_token_timeout") and second["failed"] == 0
    deadline = time.monotonic() + 5
    while gw.a.cancelled + gw.b.cancelled < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.a.cancelled + gw.b.cancelled == 1  # the hung request was closed: the server stopped it


def test_no_retry_once_the_ttft_budget_is_spent(gw: Gw) -> None:
    for s in (gw.a, gw.b):
        s.config = StandInConfig(ttft_s=0.05)
    gw.a.faults.append(Fault("status", 503))
    rid = _rid("budget")
    with pytest.raises(openai.APIStatusError) as e:  # a 1 ms budget is gone once the first server has answered
        gw.client("p").chat.completions.create(model=MODEL, messages=_chat(), max_tokens=3,
                                               extra_headers={"X-Request-ID": rid, "X-Xroute-TTFT-Ms": "1"})
    assert e.value.status_code == 502 and e.value.code == "upstream_unavailable"
    assert [t["offering_id"] for t in e.value.body["attempts"]] == [X]  # type: ignore[index]
    assert len(gw.attempts(rid, 1)) == 1


# ------------------------------------------------------------------------------------------------ after the first token
@pytest.mark.parametrize("fault,code", [(Fault("drop", after_tokens=3), "upstream_disconnected"),
                                        (Fault("error_event", after_tokens=3), "upstream_error_event")])
def test_a_stream_that_breaks_after_its_first_token_ends_with_an_error_event(gw: Gw, fault: Fault, code: str) -> None:
    gw.a.faults.append(fault)
    rid = _rid("broken")
    got: list[str] = []
    with pytest.raises(openai.APIError):
        for chunk in gw.client("p").chat.completions.create(model=MODEL, messages=_chat(), max_tokens=10,
                                                            stream=True, extra_headers={"X-Request-ID": rid}):
            if chunk.choices:
                got.append(chunk.choices[0].delta.content or "")
    assert "".join(got) == "tok0 tok1 tok2"  # what came, then the error -- never a silent truncation
    (att,) = gw.attempts(rid)  # not retried: tokens had been sent
    assert (att["offering_id"], att["failed"], att["error"]) == (X, 1, code)
    gw.settle()
    assert gw.in_flight() == {}


def test_a_server_that_falls_silent_mid_stream_ends_it_with_an_idle_timeout_event(gw: Gw) -> None:
    for s in (gw.a, gw.b):
        s.config = StandInConfig(ttft_s=0.01, tpot_s=3.0)
    rid = _rid("idle")
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", headers={**gw.setup.auth("p"), "X-Request-ID": rid},
                      json={"model": MODEL, "messages": _chat(), "max_tokens": 5, "stream": True}, timeout=10) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert "tok0" in events[1] and len(events) == 3  # the role, the first token, then the error
    err = json.loads(events[-1][6:])["error"]
    assert err["code"] == "idle_timeout" and "[DONE]" not in events[-1]
    (att,) = gw.attempts(rid)
    assert att["error"] == "idle_timeout" and att["failed"] == 1


# ------------------------------------------------------------------------------------------------ the client goes away
def _cancelled_when_quiet(gw: Gw) -> int:
    """The servers' cancellations once nothing runs on them: an earlier test's stream the gateway
    gave up on (an idle timeout) is cancelled on the server a moment later, and counting it here
    would be counting someone else's cancellation."""
    deadline = time.monotonic() + 10
    while gw.a.running + gw.b.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.a.running + gw.b.running == 0
    return gw.a.cancelled + gw.b.cancelled


def test_a_client_that_leaves_a_stream_cancels_the_server_and_releases(gw: Gw) -> None:
    for s in (gw.a, gw.b):
        s.config = StandInConfig(ttft_s=0.01, tpot_s=0.1)
    before = _cancelled_when_quiet(gw)
    rid = _rid("leave")
    stream = gw.client("p").chat.completions.create(model=MODEL, messages=_chat(), max_tokens=100, stream=True,
                                                    extra_headers={"X-Request-ID": rid})
    it = iter(stream)
    next(it), next(it)
    stream.close()
    (att,) = gw.attempts(rid)
    assert (att["error"], att["failed"]) == ("client_disconnected", 1) and att["reward"] is None
    gw.settle()
    assert gw.in_flight() == {}
    deadline = time.monotonic() + 5
    while gw.a.cancelled + gw.b.cancelled == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.a.cancelled + gw.b.cancelled == before + 1


def test_a_client_that_leaves_before_the_answer_cancels_the_server_and_releases(gw: Gw) -> None:
    for s in (gw.a, gw.b):
        s.config = StandInConfig(ttft_s=1.5)
    before = _cancelled_when_quiet(gw)
    rid = _rid("leave-plain")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gw.url}/v1/chat/completions", headers={**gw.setup.auth("p"), "X-Request-ID": rid},
                   json={"model": MODEL, "messages": _chat(), "max_tokens": 5}, timeout=0.4)
    (att,) = gw.attempts(rid)
    assert att["error"] == "client_disconnected" and att["latency_ms"] < 1400
    gw.settle()
    assert gw.in_flight() == {}
    deadline = time.monotonic() + 5
    while gw.a.cancelled + gw.b.cancelled == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.a.cancelled + gw.b.cancelled == before + 1


def test_a_slow_server_is_served_and_scored_against_the_slo(gw: Gw) -> None:
    for s in (gw.a, gw.b):
        s.config = StandInConfig(ttft_s=0.4, tpot_s=0.01)
    rid = _rid("slow")
    stream = gw.client("p").chat.completions.create(
        model=MODEL, messages=_chat(), max_tokens=3, stream=True,
        extra_headers={"X-Request-ID": rid, "X-Xroute-TTFT-Ms": "100", "X-Xroute-TPOT-Ms": "50"})
    assert "".join(x.choices[0].delta.content or "" for x in stream if x.choices) == "tok0 tok1 tok2"
    (att,) = gw.attempts(rid)
    # the decision's TTFT: what was left of the 100 ms when it was made (the gateway's reading and counting spent)
    assert 90.0 < att["slo_ttft_ms"] <= 100.0 and att["ttft_ms"] >= 400.0 and att["failed"] == 0
    assert att["sla_violation"] == 1 and att["reward"] is not None  # served late: the reward says so


# ------------------------------------------------------------------------------------------------ input, keys, privacy
def test_bad_input_is_a_4xx_naming_the_field_in_openais_shape(gw: Gw) -> None:
    c = gw.client()
    with pytest.raises(openai.UnprocessableEntityError) as e:
        c.chat.completions.create(model=MODEL, messages=[], max_tokens=3)
    assert e.value.code == "invalid_request" and e.value.param == "body.messages"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        c.chat.completions.create(model=MODEL, messages=_chat(), extra_headers={"X-Xroute-TTFT-Ms": "soon"})
    assert e.value.param == "header.X-Xroute-TTFT-Ms"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        c.chat.completions.create(model=MODEL, messages=_chat(), extra_headers={"X-Xroute-Origin": "mars:1"})
    assert e.value.param == "header.X-Xroute-Origin"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        c.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=-1)
    assert e.value.param == "body.max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="llama-2-70b", messages=_chat())
    assert e.value.code == "model_not_found" and e.value.param == "body.model"
    r = httpx.post(f"{gw.url}/v1/chat/completions", headers={**gw.setup.auth("a"), "content-type": "application/json"},
                   content=b"{not json", timeout=10)
    assert r.status_code == 422 and "invalid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{gw.url}/v1/chat/completions", headers=gw.setup.auth("a"), content=b"{}", timeout=10)
    assert r.status_code == 422 and "Content-Type: application/json" in r.json()["error"]["message"]
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 200_000}], "max_tokens": 1}
    assert httpx.post(f"{gw.url}/v1/chat/completions", headers=gw.setup.auth("a"), json=big,
                      timeout=30).status_code == 200  # above max_body_bytes (64 KiB) but within the gateway's own
    assert httpx.post(f"{gw.url}/v1/route", headers=gw.setup.auth("a"), json=big, timeout=30).status_code == 413
    gw.settle()
    assert gw.in_flight() == {}


def test_prompts_and_completions_are_kept_only_for_a_tenant_that_opted_in(gw: Gw) -> None:
    ask = _chat(f"tell me about the {MARKER}")
    for who in ("a", "s"):
        gw.client(who).chat.completions.create(model=MODEL, messages=ask, max_tokens=2)
        list(gw.client(who).chat.completions.create(model=MODEL, messages=ask, max_tokens=2, stream=True))
    gw.a.faults.append(Fault("status", 400))  # an error answer (passed to the client, never logged)
    with pytest.raises(openai.BadRequestError):
        gw.client("p").chat.completions.create(model=MODEL, messages=ask, max_tokens=2)
    gw.settle()
    time.sleep(0.3)
    root = gw.setup.root
    for f in ("decisions.db", "decisions.db-wal"):
        if (root / f).exists():
            assert MARKER.encode() not in (root / f).read_bytes()
    assert not any(MARKER in line for line in gw.logs.lines)
    con = sqlite3.connect(root / "transcripts.db")
    rows = con.execute("SELECT tenant, request, completion FROM transcripts").fetchall()
    con.close()
    assert {r[0] for r in rows} == {"s"} and len(rows) == 2
    assert all(MARKER in r[1] and json.loads(r[2]) == ["tok0 tok1"] for r in rows)


def test_the_servers_key_comes_from_the_environment_and_is_never_logged(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "sk-test-" + os.urandom(8).hex()
    monkeypatch.setenv("XROUTE_TEST_UPSTREAM_KEY", secret)
    keyfile = tmp_path / "upstream.key"
    keyfile.write_text(secret + "\n")
    standin = StandIn(StandInConfig(api_key=secret))
    logs = LogCapture().attach()
    try:
        with ServerThread(standin) as s_url:
            for source in ({"api_key_env": "XROUTE_TEST_UPSTREAM_KEY"}, {"api_key_file": str(keyfile)}):
                setup = make_setup(tmp_path / next(iter(source)), replay_speed=1e-6, gateway={"origin": "aws:us-east-1"},
                                   upstreams=[{"offering_id": X, "base_urls": [f"{s_url}/v1"], **source}],
                                   log_level="DEBUG")
                with ServerThread(create_app(setup.settings)) as url:
                    c = openai.OpenAI(base_url=f"{url}/v1", api_key=setup.keys["a"], max_retries=0)
                    got = c.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=2)
                    assert got.choices[0].message.content == "tok0 tok1"
                assert standin.requests[-1]["authorization"] == f"Bearer {secret}"
    finally:
        logs.detach()
    assert logs.lines and not any(secret in line for line in logs.lines)
    assert secret not in (tmp_path / "api_key_env" / "decisions.db").read_bytes().decode("latin-1")


def test_gateway_settings_are_checked_naming_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from router.decision.engine import RoutingEngine
    from router.gateway.service import check_settings

    monkeypatch.delenv("XROUTE_NO_SUCH_KEY", raising=False)
    engine = RoutingEngine(make_setup(tmp_path, replay_speed=1e-6).settings)
    n = iter(range(100))

    def check(**kw: Any) -> str:
        with pytest.raises(ConfigError) as e:
            check_settings(make_setup(tmp_path / f"c{next(n)}", replay_speed=1e-6, **kw).settings, engine)
        return str(e.value)

    assert "upstreams[0].offering_id': unknown offering 'aws:us-east-1:g5.xlarge:on_demnd'" in check(
        upstreams=[{"offering_id": "aws:us-east-1:g5.xlarge:on_demnd", "base_urls": ["http://127.0.0.1:1/v1"]}])
    assert "upstreams[0].model': unknown model 'gpt-9'" in check(
        upstreams=[{"offering_id": X, "model": "gpt-9", "base_urls": ["http://127.0.0.1:1/v1"]}])
    msg = check(upstreams=[{"offering_id": X, "base_urls": ["http://127.0.0.1:1/v1"],
                            "api_key_env": "XROUTE_NO_SUCH_KEY"}])
    assert "upstreams[0].api_key_env': the environment variable 'XROUTE_NO_SUCH_KEY' is not set" in msg
    assert "gateway.origin': unknown origin 'mars:1'" in check(gateway={"origin": "mars:1"})
    assert "gateway.tokenizers.llama-2-7b': 'nowhere.json' is not a file" in check(
        gateway={"tokenizers": {MODEL: "nowhere.json"}})
    cfg = tmp_path / "r.yaml"
    cfg.write_text("{}\n")
    with pytest.raises(ConfigError, match=r"upstreams\.0\.base_urls': Value error, 'ftp://x' is not an http"):
        load_settings(cfg, upstreams=[{"offering_id": X, "base_urls": ["ftp://x"]}])


# ------------------------------------------------------------------------------------------------ counting, metrics
def test_prompt_tokens_with_a_local_tokenizer_and_the_documented_estimate(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello there how are you be brief"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    counter = PromptCounter({MODEL: path}, [MODEL, "other"])
    texts, fixed = chat_texts({"messages": _chat()})
    assert fixed == 2 * 4 + 3
    assert counter.count(MODEL, texts, fixed) == fixed + 2 + 6  # "be brief" + "hello there , how are you"
    assert counter.method("other") == "estimate" and counter.count("other", ["x" * 9], 0) == 3  # ceil(9 / 4)
    assert estimate("") == 0 and estimate("abcd") == 1 and estimate("abcde") == 2


def test_has_token_sees_text_reasoning_and_tool_calls_but_not_the_role() -> None:
    assert not has_token({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert has_token({"choices": [{"delta": {"content": "a"}}]})
    assert has_token({"choices": [{"delta": {"reasoning_content": "hm"}}]})
    assert has_token({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})
    assert has_token({"choices": [{"text": "a"}]}) and not has_token({"choices": []})


def test_the_standin_metrics_page_reads_as_vllms(gw: Gw) -> None:
    for s in (gw.a, gw.b):
        s.config = StandInConfig(ttft_s=0.01, tpot_s=0.2)
    stream = gw.client().chat.completions.create(model=MODEL, messages=_chat(), max_tokens=20, stream=True)
    next(iter(stream))
    urls = {u.removesuffix("/v1") + "/metrics" for up in gw.setup.settings.upstreams for u in up.base_urls
            if up.offering_id in (X, Y)}
    loads = [parse_metrics(httpx.get(u, timeout=5).text, "vllm:num_requests_running", "vllm:num_requests_waiting",
                           "vllm:kv_cache_usage_perc") for u in urls]
    assert all(ld is not None for ld in loads)
    assert sum(ld.running for ld in loads if ld is not None) == 1  # the stream being generated
    stream.close()
