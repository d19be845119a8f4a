"""Admission through the gateway (issue 36; ``docs/router.md``, "Admission, priority and
fairness"), end to end on real parts: the official ``openai`` client against the router on uvicorn,
forwarding to a vLLM-like stand-in on loopback (``tests/vllm_standin.py``) whose one pool has one
slot, so overload is exact -- the ``X-Priority`` header (a bad one named), a sheddable request shed
at once in OpenAI's error shape, a critical one waiting and served as the slot frees, and a queued
request whose client goes away leaving the queue at once."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from router.app.factory import create_app
from tests.servers import ServerThread
from tests.test_router_closed_loop import ONE_SLOT_SERVING
from tests.test_router_support import RouterSetup, make_setup
from tests.vllm_standin import StandIn, StandInConfig

H = "aws:us-east-1:g5.xlarge:on_demand"
MODEL = "llama-2-7b"
#: how long the stand-in takes to its first token while a test holds the one slot
BUSY_S = 2.0


class Gw:
    def __init__(self, url: str, setup: RouterSetup, server: StandIn):
        self.url, self.setup, self.server = url, setup, server

    def client(self, who: str = "a") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.setup.keys[who], max_retries=0, timeout=30)

    def chat(self, who: str = "a", priority: str | None = None) -> str:
        headers = {} if priority is None else {"X-Priority": priority}
        got = self.client(who).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=2, extra_headers=headers)
        return got.choices[0].message.content or ""

    def metric(self, name: str, **labels: str) -> float:
        page = httpx.get(f"{self.url}/metrics", headers=self.setup.auth("admin"), timeout=10).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in page.splitlines():
            m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
            if m and ",".join(sorted((m.group(1) or "").split(","))) == want:
                return float(m.group(2))
        return 0.0

    def until(self, cond: Any, within_s: float = 5.0, what: str = "") -> None:
        deadline = time.monotonic() + within_s
        while not cond():
            assert time.monotonic() < deadline, f"timed out: {what}"
            time.sleep(0.02)

    def busy(self, pool: ThreadPoolExecutor) -> list[Future[str]]:
        """Fill the pool: sheddable requests the stand-in answers after ``BUSY_S`` until one is shed
        (the pool is full; its slots are held ``BUSY_S``)."""
        self.server.config = StandInConfig(ttft_s=BUSY_S)
        held: list[Future[str]] = []
        while True:
            f = pool.submit(self.chat, "b")
            self.until(lambda f=f: f.done() or self.server.running == len(held) + 1,  # type: ignore[misc]
                       what="placed or shed")
            if f.done():
                with pytest.raises(openai.RateLimitError):
                    f.result()
                assert held
                return held
            held.append(f)
            assert len(held) < 8


@pytest.fixture
def gw(tmp_path: Path) -> Iterator[Gw]:
    server = StandIn(StandInConfig(ttft_s=0.005))
    with ServerThread(server) as s_url:
        setup = make_setup(
            tmp_path, replay_speed=1e-6, upstreams=[{"offering_id": H, "base_urls": [f"{s_url}/v1"]}],
            gateway={"origin": "aws:us-east-1", "first_token_timeout_s": 10.0, "response_timeout_s": 20.0,
                     "ttft_ms": 20_000, "retry_budget": {"enabled": False}},
            admission={"enabled": True, "recheck_s": 0.05},
            env={"serving_config": str(tmp_path / "serving.yaml"), "queue_timeout_s": 0.001},
            tenants={"b": {"priority": "sheddable"}})
        (tmp_path / "serving.yaml").write_text(ONE_SLOT_SERVING)  # (make_setup wrote the default one)
        with ServerThread(create_app(setup.settings)) as url:
            yield Gw(url, setup, server)


def test_a_bad_x_priority_header_is_a_422_naming_it(gw: Gw) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as e:
        gw.chat(priority="urgent")
    assert e.value.code == "invalid_request" and e.value.param == "header.X-Priority"
    assert gw.chat(priority="critical") == "tok0 tok1"  # (nothing was taken by the refused one)


def test_a_full_pool_sheds_a_sheddable_request_and_serves_a_critical_one_when_the_slot_frees(gw: Gw) -> None:
    """The one slot busy: a request sent ``X-Priority: sheddable`` gets 429 ``slo_unattainable`` at
    once, in OpenAI's error shape with ``Retry-After`` and the best predicted TTFT; tenant ``b``
    (sheddable by default) sending ``X-Priority: critical`` waits -- no answer while the slot is
    held -- and is served when it frees."""
    with ThreadPoolExecutor(10) as pool:
        held = gw.busy(pool)
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as e:
            gw.chat(priority="sheddable")
        assert time.monotonic() - t0 < BUSY_S / 2  # (refused at once, not after waiting)
        err = e.value.body
        assert isinstance(err, dict) and e.value.code == "slo_unattainable" and err["type"] == "rate_limit_error"
        assert err["priority"] == "sheddable" and "best_predicted_ttft_ms" in err and err["message"]
        assert int(e.value.response.headers["retry-after"]) >= 1
        critical = pool.submit(gw.chat, "b", "critical")
        gw.until(lambda: gw.metric("xroute_router_admission_queue_length") == 1, what="the critical one queued")
        assert not critical.done() and not any(h.done() for h in held)
        gw.server.config = StandInConfig(ttft_s=0.005)  # (the critical one is answered at once once placed)
        assert [h.result(10) for h in held] == ["tok0 tok1"] * len(held)
        assert critical.result(10) == "tok0 tok1"
    assert gw.metric("xroute_router_admission_total", band="sheddable", outcome="shed") == 2
    assert gw.metric("xroute_router_admission_total", band="critical", outcome="dispatched") == 1
    assert gw.metric("xroute_router_admission_queue_length") == 0


def test_a_queued_gateway_request_whose_client_goes_away_leaves_the_queue(gw: Gw) -> None:
    """A request waiting for the busy slot whose client gives up leaves the queue at once (not when
    the slot frees, nor when its 20 s budget runs out), and the freed slot goes to the next request,
    not to the abandoned one."""
    with ThreadPoolExecutor(10) as pool:
        held = gw.busy(pool)
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gw.url}/v1/chat/completions", headers=gw.setup.auth("a"), timeout=0.4,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        gw.until(lambda: gw.metric("xroute_router_admission_total", band="standard", outcome="left") == 1,
                 within_s=BUSY_S / 2, what="the abandoned request left the queue")
        assert gw.metric("xroute_router_admission_queue_length") == 0 and not any(h.done() for h in held)
        assert time.monotonic() - t0 < BUSY_S
        gw.server.config = StandInConfig(ttft_s=0.005)
        assert [h.result(10) for h in held] == ["tok0 tok1"] * len(held)
    assert gw.server.running == 0
    assert gw.chat() == "tok0 tok1"
    assert gw.metric("xroute_router_admission_total", band="standard", outcome="dispatched") == 0
