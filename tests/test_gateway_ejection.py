"""A gateway that learns which pools are failing (``router/gateway/health.py``; docs/gateway.md,
"Outlier ejection" and "The retry budget"), end to end on real parts: the official ``openai``
client against the router on uvicorn, forwarding to vLLM-like stand-ins on loopback
(``tests/vllm_standin.py``), and a real redis-server shared by two routers.

Three pools of the default model: ``D`` -- two servers on ports nobody listens on (connections
refused), ``F`` -- a stand-in answering ``503``, ``H`` -- a healthy stand-in. Tenant ``f`` prefers
``D`` and ``F``, so every decision picks a failing pool while one is allowed: before ejection
existed, every request spent an attempt (or two) on them."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from router.app.factory import create_app
from router.control.keys import add_key
from router.core.settings import load_settings
from tests.servers import ServerThread, free_port
from tests.test_router_support import ROUTE, RouterSetup, make_setup
from tests.vllm_standin import StandIn, StandInConfig
from xroute.errors import ConfigError

H, F, D = "aws:us-east-1:g5.xlarge:on_demand", "aws:us-east-1:g5.xlarge:spot", "gcp:europe-west4:g2-standard-4:on_demand"
MODEL = "llama-2-7b"


def _setup(tmp: Path, f_url: str, h_url: str, dead: list[str], ejection: dict[str, Any] | None = None,
           retry_budget: dict[str, Any] | None = None, prefer: tuple[str, ...] = (D, F), **overrides: Any
           ) -> RouterSetup:
    setup = make_setup(
        tmp, replay_speed=1e-6,
        upstreams=[{"offering_id": D, "base_urls": dead}, {"offering_id": F, "base_urls": [f"{f_url}/v1"]},
                   {"offering_id": H, "base_urls": [f"{h_url}/v1"]}],
        gateway={"origin": "aws:us-east-1", "first_token_timeout_s": 2.0, "response_timeout_s": 5.0,
                 "connect_timeout_s": 1.0, "ttft_ms": 10_000, "ejection": ejection or {},
                 "retry_budget": retry_budget or {"enabled": False}},
        tenants={"f": {"constraints": {"prefer": [{"offering_ids": list(prefer)}]}}}, **overrides)
    setup.keys["f"] = add_key(tmp / "keys.json", "f")
    return setup


def _dead() -> list[str]:
    return [f"http://127.0.0.1:{free_port()}/v1", f"http://127.0.0.1:{free_port()}/v1"]


class Router:
    def __init__(self, url: str, setup: RouterSetup):
        self.url, self.setup = url, setup

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.setup.keys["f"], max_retries=0)

    def chat(self, i: int) -> str:
        c = self.client()
        if i % 2:
            text = "".join(x.choices[0].delta.content or "" for x in c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=3, stream=True)
                if x.choices)
        else:
            text = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"hello {i}"}],
                                             max_tokens=3).choices[0].message.content or ""
        return text

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", headers=self.setup.auth("admin")).text

    def attempts(self, offering: str) -> int:
        """The gateway's attempts on ``offering`` (``xroute_gateway_attempts_total``)."""
        page = self.metrics()
        return sum(int(float(v)) for v in re.findall(
            r'xroute_gateway_attempts_total\{offering_id="' + re.escape(offering) + r'",outcome="[^"]*"\} (\S+)', page))

    def offerings(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/v1/offerings", headers=self.setup.auth("f")).json()  # type: ignore[no-any-return]

    def explain(self) -> dict[str, str | None]:
        got = httpx.post(f"{self.url}/v1/explain", json=ROUTE, headers=self.setup.auth("f")).json()
        return {r["offering"]["offering_id"]: r["excluded_by"] for r in got["offerings"]}


def _many(router: Router, n: int, concurrency: int, start: int = 0) -> list[str]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(router.chat, range(start, start + n)))


def _wait(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def servers() -> Iterator[tuple[StandIn, StandIn, str, str]]:
    f, h = StandIn(StandInConfig(ttft_s=0.005, fail_status=503)), StandIn(StandInConfig(ttft_s=0.005))
    with ServerThread(f) as f_url, ServerThread(h) as h_url:
        yield f, h, f_url, h_url


def test_failing_pools_are_ejected_after_a_few_attempts_and_not_tried_while_ejected(
        tmp_path: Path, servers: tuple[StandIn, StandIn, str, str]) -> None:
    """One pool refusing connections, one answering 503, one healthy; three clients at a time:
    at most 5 attempts on each failing pool (the threshold, 3, plus the attempts already on their
    way), none after; every request served; the ejection in /v1/offerings, /v1/explain, the
    route's exclusion counts and /metrics."""
    f, h, f_url, h_url = servers
    dead = _dead()
    setup = _setup(tmp_path, f_url, h_url, dead, ejection={"base_s": 120, "max_s": 600})
    with ServerThread(create_app(setup.settings)) as url:
        r = Router(url, setup)
        assert all(t == "tok0 tok1 tok2" for t in _many(r, 60, 3))
        on_f, on_d = len(f.requests), r.attempts(D)
        assert 3 <= on_f <= 5 and 3 <= on_d <= 5, (on_f, on_d)
        assert all(t == "tok0 tok1 tok2" for t in _many(r, 30, 3, start=60))
        assert (len(f.requests), r.attempts(D)) == (on_f, on_d)  # none while ejected
        assert len(h.requests) == 90
        rows = {row["offering"]["offering_id"]: row for row in r.offerings()["offerings"]}
        assert rows[D]["ejected"] and rows[F]["ejected"] and not rows[H]["ejected"]
        assert 100 < rows[F]["ejected_for_s"] <= 120
        targets = {e["target"]: e for e in r.offerings()["ejections"]}
        assert {f"pool:{MODEL}|{D}", f"pool:{MODEL}|{F}", f"server:{f_url}/v1", *(f"server:{u}" for u in dead)} <= set(
            targets)
        assert targets[f"pool:{MODEL}|{F}"]["ejections"] == 1
        why = r.explain()
        assert why[D] == why[F] == "upstream_ejected" and why[H] is None
        got = httpx.post(f"{url}/v1/route", json=ROUTE, headers=setup.auth("f")).json()
        assert got["offering"]["offering_id"] not in (D, F) and got["excluded"]["by_reason"]["upstream_ejected"] == 2
        page = r.metrics()
        assert f'xroute_gateway_server_ejected{{base_url="{f_url}/v1"}} 1.0' in page
        for u in dead:  # (a server marked down locally is skipped while its pool has another: fewer failures)
            ejected = re.search(r'xroute_gateway_server_ejected\{base_url="' + re.escape(u) + r'"\} (\S+)', page)
            failing = re.search(r'xroute_gateway_server_consecutive_failures\{base_url="' + re.escape(u) + r'"\} (\S+)',
                                page)
            assert ejected and failing and (float(ejected[1]) == 1.0 or float(failing[1]) >= 1.0)
        assert f'xroute_gateway_server_ejected{{base_url="{h_url}/v1"}} 0.0' in page
        assert f'xroute_gateway_server_ejections_total{{base_url="{f_url}/v1"}} 1.0' in page
        assert f'xroute_gateway_pool_ejected{{model="{MODEL}",offering_id="{D}"}} 1.0' in page
        assert f'xroute_gateway_pool_ejections_total{{model="{MODEL}",offering_id="{F}"}} 1.0' in page


def test_a_half_open_probe_brings_a_recovered_pool_back_and_a_failed_one_doubles_its_ejection(
        tmp_path: Path, servers: tuple[StandIn, StandIn, str, str]) -> None:
    f, h, f_url, h_url = servers
    setup = _setup(tmp_path, f_url, h_url, _dead(), ejection={"base_s": 1.0, "max_s": 8.0})
    with ServerThread(create_app(setup.settings)) as url:
        r = Router(url, setup)
        _many(r, 8, 1)
        assert len(f.requests) == 3  # ejected after its third 503
        time.sleep(1.2)  # half-open
        _many(r, 12, 4, start=8)  # one probe among them: it fails, the ejection doubles
        assert len(f.requests) == 4
        f_row = {e["target"]: e for e in r.offerings()["ejections"]}[f"pool:{MODEL}|{F}"]
        assert f_row["ejections"] == 2 and 1.0 < f_row["ejected_for_s"] <= 2.0
        f.config.fail_status = None  # the server recovers
        time.sleep(f_row["ejected_for_s"] + 0.3)
        _many(r, 12, 4, start=20)  # one probe: it succeeds, the pool is back
        assert len(f.requests) >= 5
        _wait(lambda: not {row["offering"]["offering_id"]: row for row in r.offerings()["offerings"]}[F]["ejected"])
        before = len(f.requests)
        _many(r, 6, 1, start=40)
        assert len(f.requests) == before + 6  # preferred again: every request goes there
        assert r.explain()[F] is None


def test_two_routers_sharing_one_redis_see_one_ejection(tmp_path: Path, redis_server: Any,
                                                        servers: tuple[StandIn, StandIn, str, str]) -> None:
    f, h, f_url, h_url = servers
    dead = _dead()
    shared = {"state_backend": "redis", "state_url": redis_server.url, "state_prefix": f"ej{time.time_ns()}"}
    one = _setup(tmp_path / "one", f_url, h_url, dead, ejection={"base_s": 120, "max_s": 600}, **shared)
    two = _setup(tmp_path / "two", f_url, h_url, dead, ejection={"base_s": 120, "max_s": 600}, **shared)
    with ExitStack() as stack:
        r1 = Router(stack.enter_context(ServerThread(create_app(one.settings))), one)
        r2 = Router(stack.enter_context(ServerThread(create_app(two.settings))), two)
        _many(r1, 10, 1)
        assert len(f.requests) == 3 and r1.attempts(D) == 3
        _wait(lambda: r2.explain()[F] == "upstream_ejected" and r2.explain()[D] == "upstream_ejected")
        rows = {row["offering"]["offering_id"]: row for row in r2.offerings()["offerings"]}
        assert rows[D]["ejected"] and rows[F]["ejected"]
        assert all(t == "tok0 tok1 tok2" for t in _many(r2, 20, 3))
        assert len(f.requests) == 3 and r2.attempts(D) == 0 and r2.attempts(H) == 20  # the second router never tried them


def test_the_retry_budget_caps_retries_and_answers_the_last_attempts_error(
        tmp_path: Path, servers: tuple[StandIn, StandIn, str, str]) -> None:
    """No ejection; retries at most 10 % of the requests, at least 2 in a minute: of 20 requests
    whose first attempt meets a 503, two are retried (and served), the rest get the 503's error."""
    f, h, f_url, h_url = servers
    setup = _setup(tmp_path, f_url, h_url, _dead(), ejection={"enabled": False},
                   retry_budget={"ratio": 0.1, "min_retries": 2, "window_s": 60}, prefer=(F,))
    with ServerThread(create_app(setup.settings)) as url:
        r = Router(url, setup)
        served, refused = 0, []
        for i in range(20):
            try:
                r.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"x {i}"}],
                                                   max_tokens=3)
                served += 1
            except openai.APIStatusError as e:
                refused.append(e)
        assert served == 2 and len(refused) == 18
        for e in refused:
            assert e.status_code == 502 and e.code == "upstream_unavailable"
            attempts = e.body["attempts"]  # type: ignore[index]
            assert len(attempts) == 1 and attempts[0]["error"] == "upstream_503"
        assert len(h.requests) == 2 and r.attempts(F) == len(f.requests) == 20
        assert 'xroute_gateway_retry_budget_exhausted_total{kind="chat"} 18.0' in r.metrics()


@pytest.mark.parametrize(("section", "values", "field", "says"), [
    ("ejection", {"consecutive_failures": 0}, "gateway.ejection.consecutive_failures", "greater than or equal to 1"),
    ("ejection", {"base_s": 60, "max_s": 30}, "gateway.ejection.max_s", "at least base_s"),
    ("ejection", {"base_s": -1}, "gateway.ejection.base_s", "greater than 0"),
    ("ejection", {"after": 3}, "gateway.ejection.after", "Extra inputs are not permitted"),
    ("retry_budget", {"ratio": -0.5}, "gateway.retry_budget.ratio", "greater than or equal to 0"),
    ("retry_budget", {"window_s": 0}, "gateway.retry_budget.window_s", "greater than 0"),
    ("retry_budget", {"min_retries": "many"}, "gateway.retry_budget.min_retries", "valid integer"),
])
def test_bad_ejection_and_retry_budget_settings_are_config_errors_naming_the_field(
        tmp_path: Path, section: str, values: dict[str, Any], field: str, says: str) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text("{}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(cfg, gateway={section: values})
    assert f"field '{field}'" in str(e.value) and says in str(e.value)

