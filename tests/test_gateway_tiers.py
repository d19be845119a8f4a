"""The gateway with a serving tier (``env.tiers``, ``xroute.catalog_tools.split_tiers``; docs/gateway.md
"Serving tiers"), end to end on real parts: the official ``openai`` client against the router on
uvicorn, forwarding to vLLM-like stand-ins on loopback (``tests/vllm_standin.py``).

One pool ``P`` (the tiny bundle's A10G on-demand pool, 2 replicas) with a tier ``P#hot`` split off
(1 replica at batch 2); the tier's replica has its own server (stand-in ``hot``), the parent's its
own (stand-in ``cold``); no other offering has servers. The policies keep wide requests off the tier
and send tight ones (TPOT <= 40 ms) to it. The stand-in that answered says where a request went."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from router.app.factory import create_app
from tests.servers import ServerThread
from tests.test_router_support import ROUTE, RouterSetup, make_setup
from tests.vllm_standin import StandIn, StandInConfig
from xroute.bundle import load_bundle
from xroute.errors import ConfigError
from xroute.schema.offering import tier_offering_id

MODEL = "llama-2-7b"
TIGHT = {"X-Xroute-TPOT-Ms": "40"}  # (the slo_tiers' "tight" class: the tier's requests)
POLICIES = {
    "slo_tiers": {"tight": {"max_tpot_ms": 40}, "wide": {}},
    "policies": [{"name": "hot-tier-tight-only", "target": {"classes": ["wide"]}, "effect": "deny",
                  "constraints": {"offering_ids": ["*#hot"]}},
                 {"name": "tight-on-hot", "target": {"classes": ["tight"]}, "effect": "allow",
                  "constraints": {"offering_ids": ["*#hot"]}}]}


def _pool(tmp: Path) -> str:
    """The tiny bundle's A10G on-demand pool (written by ``make_setup``)."""
    make_setup(tmp)
    return next(o.offering_id for o in load_bundle(tmp / "bundle").catalog()
                if o.accelerator == "A10G" and not o.is_spot)


def _setup(tmp: Path, pool: str, upstreams: list[dict[str, Any]], tiers: bool = True, **overrides: Any
           ) -> RouterSetup:
    """A router whose env splits ``pool#hot`` off ``pool`` (unless not ``tiers``), with the policies
    above, ejection after 3 failures in a row for 120 s, no retry budget."""
    first = make_setup(tmp)
    env = dict(first.settings.env)
    if tiers:
        env["tiers"] = [{"offering": pool, "name": "hot", "replicas": 1, "max_batch": 2}]
    policies = tmp / "tiers.yaml"
    policies.write_text(json.dumps(POLICIES))
    return make_setup(tmp, env=env, policy_files=[policies], replay_speed=1e-6, upstreams=upstreams,
                      gateway={"origin": "aws:us-east-1", "first_token_timeout_s": 2.0, "response_timeout_s": 5.0,
                               "connect_timeout_s": 1.0, "ttft_ms": 10_000,
                               "ejection": {"base_s": 120, "max_s": 600}, "retry_budget": {"enabled": False}},
                      **overrides)


@dataclass
class Tiered:
    url: str
    setup: RouterSetup
    pool: str
    hot: StandIn
    cold: StandIn
    hot_url: str
    cold_url: str

    @property
    def tier(self) -> str:
        return tier_offering_id(self.pool, "hot")

    def chat(self, tight: bool, i: int = 0, stream: bool = False) -> tuple[str, str]:
        """One chat through the ``openai`` client: (its text, the offering the gateway says it used)."""
        c = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.setup.keys["a"], max_retries=0)
        kw: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}],
                              "max_tokens": 3, "extra_headers": TIGHT if tight else {}}
        if stream:
            raw = c.chat.completions.with_raw_response.create(stream=True, **kw)
            text = "".join(x.choices[0].delta.content or "" for x in raw.parse() if x.choices)
        else:
            raw = c.chat.completions.with_raw_response.create(**kw)
            text = raw.parse().choices[0].message.content or ""
        return text, raw.headers["x-xroute-offering"]

    def offerings(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/v1/offerings", headers=self.setup.auth("a")).json()  # type: ignore[no-any-return]

    def rows(self) -> dict[str, dict[str, Any]]:
        return {r["offering"]["offering_id"]: r for r in self.offerings()["offerings"]}

    def targets(self) -> dict[str, dict[str, Any]]:
        return {e["target"]: e for e in self.offerings()["ejections"]}

    def explain(self, tight: bool) -> dict[str, str | None]:
        body = {**ROUTE, "tpot_ms": 40} if tight else ROUTE
        got = httpx.post(f"{self.url}/v1/explain", json=body, headers=self.setup.auth("a")).json()
        return {r["offering"]["offering_id"]: r["excluded_by"] for r in got["offerings"]}


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[Tiered]:
    pool = _pool(tmp_path / "probe")
    hot, cold = StandIn(StandInConfig(ttft_s=0.005)), StandIn(StandInConfig(ttft_s=0.005))
    with ServerThread(hot) as hot_url, ServerThread(cold) as cold_url:
        setup = _setup(tmp_path / "router", pool, [
            {"offering_id": pool, "base_urls": [f"{cold_url}/v1"]},
            {"offering_id": tier_offering_id(pool, "hot"), "base_urls": [f"{hot_url}/v1"]}])
        with ServerThread(create_app(setup.settings)) as url:
            yield Tiered(url, setup, pool, hot, cold, hot_url, cold_url)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tight_request_goes_to_the_tiers_server_and_a_wide_one_to_the_parents(tiered: Tiered, stream: bool) -> None:
    t = tiered
    for i in range(4):
        assert t.chat(tight=True, i=i, stream=stream) == ("tok0 tok1 tok2", t.tier)
    assert (len(t.hot.requests), len(t.cold.requests)) == (4, 0)
    for i in range(6):
        assert t.chat(tight=False, i=i, stream=stream) == ("tok0 tok1 tok2", t.pool)
    assert (len(t.hot.requests), len(t.cold.requests)) == (4, 6)
    # each server got the model under its own name, and the tier's offering is listed for the model
    models = httpx.get(f"{t.url}/v1/models", headers=t.setup.auth("a")).json()["data"]
    assert [m["offerings"] for m in models if m["id"] == MODEL] == [sorted([t.pool, t.tier])]


def _eject(t: Tiered, tight: bool) -> None:
    """The server of the tier (``tight``) or of its parent answers 503: three requests sent there fail,
    which ejects that server and pool only -- ``/v1/offerings`` and ``/v1/explain`` show it on that
    offering and not on the other."""
    bad, good = (t.hot, t.cold) if tight else (t.cold, t.hot)
    bad_off, good_off = (t.tier, t.pool) if tight else (t.pool, t.tier)
    bad_url, good_url = (t.hot_url, t.cold_url) if tight else (t.cold_url, t.hot_url)
    bad.config.fail_status = 503
    for i in range(3):
        with pytest.raises(openai.APIStatusError) as e:
            t.chat(tight=tight, i=i)
        assert e.value.status_code == 502 and e.value.code == "upstream_unavailable"
    assert len(bad.requests) == 3 and not good.requests
    rows, targets = t.rows(), t.targets()
    assert rows[bad_off]["ejected"] and 100 < rows[bad_off]["ejected_for_s"] <= 120
    assert not rows[good_off]["ejected"] and rows[good_off]["ejected_for_s"] is None
    assert targets[f"pool:{MODEL}|{bad_off}"]["ejected"] and targets[f"server:{bad_url}/v1"]["ejected"]
    assert f"pool:{MODEL}|{good_off}" not in targets and f"server:{good_url}/v1" not in targets
    why = t.explain(tight=not tight)
    assert why[bad_off] == "upstream_ejected" and why[good_off] is None


def test_ejecting_the_tiers_server_masks_the_tier_only(tiered: Tiered) -> None:
    """The tier's server answers 503: three tight requests fail (nowhere else may take them), which
    ejects the tier's server and pool -- the tier is masked (``upstream_ejected``), its parent is not
    and keeps serving the wide requests; ``/v1/offerings`` shows it."""
    t = tiered
    _eject(t, tight=True)
    # a tight request is no longer sent to the tier: the only pool its policies allow is ejected, so it
    # is a 429 to retry after the ejection (not a 422: the request is valid); wide ones go on to the parent
    with pytest.raises(openai.APIStatusError) as e:
        t.chat(tight=True, i=9)
    assert e.value.status_code == 429 and e.value.code == "no_capacity" and "ejected" in e.value.message
    assert 100 < int(e.value.response.headers["retry-after"]) <= 120
    got = httpx.post(f"{t.url}/v1/route", json={**ROUTE, "tpot_ms": 40}, headers=t.setup.auth("a"))
    assert got.status_code == 429 and got.json()["error"] == "no_capacity", got.text
    assert got.json()["excluded"]["upstream_ejected"] == 1 and got.json()["excluded"]["policy:tight-on-hot"] >= 1
    assert len(t.hot.requests) == 3
    for i in range(5):
        assert t.chat(tight=False, i=i) == ("tok0 tok1 tok2", t.pool)
    assert len(t.cold.requests) == 5 and len(t.hot.requests) == 3


def test_a_pool_event_on_the_tier_leaves_its_requests_a_429_not_a_422(tiered: Tiered) -> None:
    """The other transient mask before the policies: a pool event (docs/migration.md) on the tier.
    The tight request's one allowed pool is masked for now -- 429 ``no_capacity`` naming the pool
    event, as when nothing else was allowed in the first place; the wide ones go on to the parent."""
    from router.control.keys import add_key

    t = tiered
    ops = add_key(t.setup.settings.keys_file, "ops", "events")
    r = httpx.post(f"{t.url}/v1/events", json={"event_id": "ev-hot", "kind": "degraded", "pool": t.tier},
                   headers={"Authorization": f"Bearer {ops}"})
    assert r.status_code == 200, r.text
    assert t.explain(tight=True)[t.tier] == "pool_event"
    with pytest.raises(openai.APIStatusError) as e:
        t.chat(tight=True)
    assert e.value.status_code == 429 and e.value.code == "no_capacity" and "pool event" in e.value.message
    got = httpx.post(f"{t.url}/v1/route", json={**ROUTE, "tpot_ms": 40}, headers=t.setup.auth("a"))
    assert got.status_code == 429 and got.json()["error"] == "no_capacity", got.text
    assert t.chat(tight=False) == ("tok0 tok1 tok2", t.pool)
    assert (len(t.hot.requests), len(t.cold.requests)) == (0, 1)


def test_ejecting_the_parents_server_masks_the_parent_only(tiered: Tiered) -> None:
    """The mirror: the parent's server fails, the parent alone is masked, the tight requests go on to
    the tier."""
    t = tiered
    _eject(t, tight=False)
    for i in range(5):
        assert t.chat(tight=True, i=i) == ("tok0 tok1 tok2", t.tier)
    assert len(t.hot.requests) == 5 and len(t.cold.requests) == 3


def test_upstreams_for_a_tier_are_checked_against_the_split_catalog(tmp_path: Path) -> None:
    """An upstream naming a tier the env does not split (another name; no tiers at all) is a config
    error naming the field; the tier the env splits is accepted."""
    from router.decision.engine import RoutingEngine
    from router.gateway.service import check_settings

    pool = _pool(tmp_path / "probe")
    base = ["http://127.0.0.1:1/v1"]
    ok = _setup(tmp_path / "ok", pool, [{"offering_id": tier_offering_id(pool, "hot"), "base_urls": base}])
    check_settings(ok.settings, RoutingEngine(ok.settings))
    for name, tiers, upstreams, says in [
        ("warm", True, [{"offering_id": pool, "base_urls": base},
                        {"offering_id": tier_offering_id(pool, "warm"), "base_urls": base}],
         f"field 'upstreams[1].offering_id': unknown offering '{tier_offering_id(pool, 'warm')}'"),
        ("untiered", False, [{"offering_id": tier_offering_id(pool, "hot"), "base_urls": base}],
         f"field 'upstreams[0].offering_id': unknown offering '{tier_offering_id(pool, 'hot')}'"),
    ]:
        setup = _setup(tmp_path / name, pool, upstreams, tiers=tiers)
        with pytest.raises(ConfigError) as e:
            check_settings(setup.settings, RoutingEngine(setup.settings))
        assert says in str(e.value), str(e.value)


def test_a_tier_sharing_a_server_with_its_parent_is_a_config_error(tmp_path: Path) -> None:
    """A tier's replicas are its own: a base URL that is also its parent's server is refused, naming
    the field (it would carry the parent's batch, and one ejection of it would take out both)."""
    from router.decision.engine import RoutingEngine
    from router.gateway.service import check_settings

    pool = _pool(tmp_path / "probe")
    tier = tier_offering_id(pool, "hot")
    shared = "http://127.0.0.1:1/v1"
    for name, upstreams, field in [
        ("parent-first", [{"offering_id": pool, "base_urls": [shared]},
                          {"offering_id": tier, "base_urls": ["http://127.0.0.1:2/v1", shared]}], "upstreams[1]"),
        ("tier-first", [{"offering_id": tier, "base_urls": [shared]},
                        {"offering_id": pool, "base_urls": [shared]}], "upstreams[1]"),
    ]:
        setup = _setup(tmp_path / name, pool, upstreams)
        with pytest.raises(ConfigError) as e:
            check_settings(setup.settings, RoutingEngine(setup.settings))
        assert f"field '{field}.base_urls': '{shared}' is a server of" in str(e.value), str(e.value)
        assert "a serving tier's replicas are its own" in str(e.value)
    # the same server for two offerings that are not a tier and its parent stays allowed (as before)
    other = next(o for o in RoutingEngine(_setup(tmp_path / "x", pool, []).settings).offering_ids
                 if o not in (pool, tier))
    ok = _setup(tmp_path / "ok", pool, [{"offering_id": tier, "base_urls": [shared]},
                                        {"offering_id": other, "base_urls": [shared]}])
    check_settings(ok.settings, RoutingEngine(ok.settings))


def test_a_tier_without_servers_is_never_chosen_by_the_gateway(tmp_path: Path) -> None:
    """As any offering without ``upstreams``: the gateway never places on it. A request the policies
    hold to the tier alone is refused (422 ``no_offering``: nothing the gateway may use is left to it);
    a wide one goes to the parent's server; ``/v1/route`` (whose caller forwards it itself) still
    places the tight one on the tier."""
    pool = _pool(tmp_path / "probe")
    cold = StandIn(StandInConfig(ttft_s=0.005))
    with ServerThread(cold) as cold_url:
        setup = _setup(tmp_path / "router", pool, [{"offering_id": pool, "base_urls": [f"{cold_url}/v1"]}])
        with ServerThread(create_app(setup.settings)) as url:
            t = Tiered(url, setup, pool, cold, cold, cold_url, cold_url)
            with pytest.raises(openai.APIStatusError) as e:
                t.chat(tight=True)
            assert e.value.status_code == 422 and e.value.code == "no_offering"
            assert len(cold.requests) == 0
            assert t.chat(tight=False) == ("tok0 tok1 tok2", pool)
            assert len(cold.requests) == 1
            models = httpx.get(f"{url}/v1/models", headers=setup.auth("a")).json()["data"]
            assert [m["offerings"] for m in models if m["id"] == MODEL] == [[pool]]
            got = httpx.post(f"{url}/v1/route", json={**ROUTE, "tpot_ms": 40}, headers=setup.auth("a"))
            assert got.status_code == 200 and got.json()["offering"]["offering_id"] == t.tier, got.text
