"""One decision pipeline (``router.decision.stages``): ``POST /v1/route``, ``POST /v1/explain``, the
policy dry run and the migration's rules sweep run the same stages, so what they say cannot drift.

Over a real router behind a real HTTP server, for random routing policies (applied through the admin
API), random permissions (a role's grants), random pool events, random tenant budgets
(``usd_per_day``) and random requests:

* the route's exclusion counts by reason (its answer's ``excluded.by_reason``, or its 4xx's
  ``excluded``) equal what ``/v1/explain`` says of each offering, counted the same way;
* a decision the dry run judges under the set in force is judged as a replayed route decides:
  ``refused`` exactly when the route answers 422 ``no_offering``, and otherwise the offering it went
  to is allowed by the rules (``/v1/explain`` names no rule that excludes it).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from router.app.factory import create_app
from router.control.keys import add_key
from tests.policy_cases import random_policy_set
from tests.servers import ServerThread
from tests.test_router_support import make_setup

pytestmark = pytest.mark.slow
#: request constraints drawn from (a deny, an allow, a preference that leaves some offerings out)
CONSTRAINTS = [{"deny": [{"pricing_modes": ["spot"]}]}, {"allow": [{"providers": ["aws", "gcp"]}]},
               {"prefer": [{"pricing_modes": ["on_demand"]}]}, {"prefer": [{"providers": ["azure"]}],
                                                               "deny": [{"instance_types": ["NC4as_T4_v3"]}]}]
#: the stages' reasons that are the rules (the dry run and the sweep judge only these)
RULES = ("tenant:", "request:", "policy:")


class Router:
    """One router for every example (an app start per example would take most of the test)."""

    def __init__(self, root: Path):
        b = {"constraints": {"deny": [{"instance_types": ["NC4as_T4_v3"]}], "prefer": [{"pricing_modes": ["spot"]}]}}
        self.setup = make_setup(root, tenants={"a": {}, "b": b}, alternatives=3, replay_speed=1e-6,
                                env={"serving_config": str(root / "serving.yaml"), "queue_timeout_s": 0.5})
        self.keys = dict(self.setup.keys)
        self.keys["limited"] = add_key(self.setup.settings.keys_file, "a", role="limited")
        self.server = ServerThread(create_app(self.setup.settings))
        self.url = self.server.__enter__()
        self.http = httpx.Client(base_url=self.url, timeout=30)
        self.admin = {"Authorization": f"Bearer {self.keys['admin']}"}
        offerings = self.http.get("/v1/offerings", headers=self.auth("a")).json()
        self.origins: list[str] = offerings["origins"]
        self.ids = [o["offering"]["offering_id"] for o in offerings["offerings"]]
        self.regions = sorted({o["offering"]["region"] for o in offerings["offerings"]})
        self.policies: list[str] = []
        self.events: list[str] = []

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}

    def close(self) -> None:
        self.http.close()
        self.server.__exit__(None, None, None)

    def ok(self, r: httpx.Response) -> httpx.Response:
        assert r.status_code < 300, (r.request.method, r.request.url, r.status_code, r.text)
        return r

    def install(self, rng: np.random.Generator, engine_catalog: Any) -> None:
        """A random world: policies, the ``limited`` role's regions, pool events, tenant budgets."""
        for name in self.policies:
            self.ok(self.http.delete(f"/v1/admin/policies/{name}", headers=self.admin))
        for ev in self.events:
            self.ok(self.http.post(f"/v1/events/{ev}/end", json={"reason": "next example"}, headers=self.admin))
        ps = random_policy_set(rng, engine_catalog, ["a", "b"], ["llama-2-7b"], self.origins)
        self.policies = []
        for p in ps.policies:  # (region sets and SLO tiers are the set's, not a policy's: left out here)
            body = p.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
            name = body.pop("name")
            body.pop("version", None)
            body.get("constraints", {}).pop("region_sets", None)
            r = self.http.put(f"/v1/admin/policies/{name}", json=body, headers=self.admin)
            assert r.status_code in (200, 201, 422), r.text  # (a class no tier defines: refused, named)
            if r.status_code < 300:
                self.policies.append(name)
        grants = [f"model:inference:*:{r}" for r in self.regions if rng.random() < 0.6]
        self.ok(self.http.put("/v1/admin/roles/limited", json={"grants": grants or ["model:inference:*:nowhere"]},
                              headers=self.admin))
        self.events = []
        for _ in range(int(rng.integers(0, 3))):
            ev = f"ev-{rng.integers(1 << 40)}"
            pool = str(rng.choice(self.ids))
            self.ok(self.http.post("/v1/events", json={"event_id": ev, "kind": str(rng.choice(["degraded", "drained"])),
                                                       "pool": pool}, headers=self.admin))
            self.events.append(ev)
        usd = rng.choice([None, 0.0005, 0.002, 1.0])
        quotas = {} if usd is None else {"usd_per_day": float(usd)}
        self.ok(self.http.put("/v1/admin/quotas/a", json=quotas, headers=self.admin))


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Any:
    r = Router(tmp_path_factory.mktemp("stages"))
    yield r
    r.close()


def _explained(explain: dict[str, Any]) -> Counter[str]:
    return Counter(o["excluded_by"] for o in explain["offerings"] if o["excluded_by"] is not None)


def _routed(r: httpx.Response) -> Counter[str]:
    body = r.json()
    got = body["excluded"]["by_reason"] if r.status_code == 200 else body.get("excluded")
    return Counter(got or {})


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None,
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(seed=st.integers(0, 1_000_000))
def test_route_explain_and_dry_run_agree(router: Router, seed: int) -> None:
    rng = np.random.default_rng(seed)
    catalog = _catalog(router)
    router.install(rng, catalog)
    routed: list[tuple[str, dict[str, Any], httpx.Response]] = []
    for _ in range(6):
        who = str(rng.choice(["a", "b", "limited"]))
        body: dict[str, Any] = {"origin": str(rng.choice(router.origins)), "input_tokens": int(rng.integers(10, 4000)),
                                "max_output_tokens": int(rng.integers(10, 800)),
                                "ttft_ms": float(rng.choice([300, 1500, 2500])), "tpot_ms": 100}
        if rng.random() < 0.3:
            body["request_class"] = str(rng.choice(["gold", "batch", "fast"]))
        if rng.random() < 0.4:
            body["constraints"] = CONSTRAINTS[int(rng.integers(len(CONSTRAINTS)))]
        explain = router.http.post("/v1/explain", json=body, headers=router.auth(who))
        route = router.http.post("/v1/route", json=body, headers=router.auth(who))
        assert explain.status_code == 200 or explain.status_code == route.status_code, (explain.text, route.text)
        if explain.status_code != 200:  # a request the validation refuses: the same error from both
            assert explain.json()["error"] == route.json()["error"]
            continue
        if route.status_code == 403:  # nothing permitted: the explanation says so of every allowed offering
            assert set(_explained(explain.json())) <= {"permission", *(r for r in _explained(explain.json())
                                                                       if r.startswith(RULES))}
            continue
        assert route.status_code in (200, 422, 429), route.text
        explained = _explained(explain.json())
        if route.status_code == 429 and "capacity in the shared state" in route.json()["message"]:
            # (the admission after the stages: every candidate the stages ranked -- the chosen and up to
            # three alternatives of the eligible -- was full in the shared state, counted as queue_full)
            eligible = explain.json()["eligible"]
            explained["queue_full"] += min(eligible, 4)
        assert _routed(route) == explained, (route.text, explained)
        routed.append((who, body, route))
    _dry_run_agrees(router, routed)


def _catalog(router: Router) -> list[Any]:
    from xroute.bundle import load_bundle

    return load_bundle(router.setup.settings.telemetry).catalog()


def _dry_run_agrees(router: Router, routed: list[tuple[str, dict[str, Any], httpx.Response]]) -> None:
    """The dry run of the set in force over the decisions just made: each ``unchanged`` (their
    offering is allowed by the rules now), and its ``now`` count of ``refused`` is 0 (a logged
    decision was placed, so the rules allowed something)."""
    made = [r for _, _, r in routed if r.status_code == 200]
    if not made:
        return
    got = router.ok(router.http.post("/v1/admin/policies/dry-run", json={"last": len(made)},
                                     headers=router.admin)).json()
    assert got["now"]["refused"] == 0 and got["now"]["excluded"] == 0, got
    assert got["changed"] == 0, got
