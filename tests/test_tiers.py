"""Serving tiers (``EnvConfig.tiers``, ``xroute.catalog_tools.split_tiers``; docs/env.md "Serving
tiers"): a part of a pool split off as its own offering, held at a smaller batch, and the policy IR
saying which requests may use it."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np
import pytest

from envs import policies as pol
from envs.cloud_route import CloudRouteEnv
from tests.tinybundle import SERVING_YAML, write_tiny_bundle
from xroute.bundle import load_bundle
from xroute.config import EnvConfig, parse_config
from xroute.errors import ConfigError
from xroute.schema.offering import parent_offering_id, tier_offering_id
from xroute.schema.policy_ir import PolicySet


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str, str]:
    """The tiny bundle, a serving profile without service noise (a request's TPOT is its pool's
    ``tpot(k)`` exactly), and its A10G on-demand pool (2 replicas x 7 slots)."""
    root = tmp_path_factory.mktemp("tiers")
    b = load_bundle(write_tiny_bundle(root / "bundle", n_requests=300, preempt=False))
    serving = root / "serving.yaml"
    serving.write_text(SERVING_YAML.replace("max_concurrency: 7, noise_sigma: 0.07}",
                                            "max_concurrency: 7, noise_sigma: 0.0}"))
    pool = next(o.offering_id for o in b.catalog() if o.accelerator == "A10G" and not o.is_spot)
    return b, str(serving), pool


def _env(b: Any, serving: str, **cfg: Any) -> CloudRouteEnv:
    return CloudRouteEnv(b, parse_config(EnvConfig, {"serving_config": serving, "episode_requests": None, **cfg}))


@pytest.mark.parametrize(("tier", "field", "says"), [
    ({"offering": "nowhere:x:y:on_demand"}, "tiers[0].offering", "is not an offering"),
    ({"replicas": 3}, "tiers[0].replicas", "more than the 2 replicas"),
    ({"max_batch": 8}, "tiers[0].max_batch", "more than the serving profile's 7 slots"),
])
def test_a_bad_tier_names_the_field(tiny: tuple[Any, str, str], tier: dict[str, Any], field: str, says: str) -> None:
    b, serving, pool = tiny
    with pytest.raises(ConfigError, match=rf"field '{re.escape(field)}'.*{re.escape(says)}"):
        _env(b, serving, tiers=[{"offering": pool, "name": "hot", "replicas": 1, "max_batch": 2, **tier}])


def test_a_tier_setting_out_of_range_or_twice_names_the_field(tiny: tuple[Any, str, str]) -> None:
    b, serving, pool = tiny
    with pytest.raises(ConfigError, match=r"tiers\.0\.max_batch"):
        _env(b, serving, tiers=[{"offering": pool, "name": "hot", "replicas": 1, "max_batch": 0}])
    with pytest.raises(ConfigError, match=r"tiers\.0\.name"):
        _env(b, serving, tiers=[{"offering": pool, "name": "a#b", "replicas": 1, "max_batch": 2}])
    twice = {"offering": pool, "name": "hot", "replicas": 1, "max_batch": 2}
    with pytest.raises(ConfigError, match=r"field 'tiers\[1\]\.name'.*a tier of"):
        _env(b, serving, tiers=[twice, twice])
    with pytest.raises(ConfigError, match=r"field 'tiers\[1\]\.replicas'.*more than the 1 replicas"):
        _env(b, serving, tiers=[twice, {**twice, "name": "warm", "replicas": 2}])


def test_the_split_gives_the_tier_its_replicas_and_batch_and_the_parent_the_rest(tiny: tuple[Any, str, str]) -> None:
    b, serving, pool = tiny
    whole = _env(b, serving)
    env = _env(b, serving, tiers=[{"offering": pool, "name": "hot", "replicas": 1, "max_batch": 2}])
    ids = [o.offering_id for o in env.catalog]
    hot, cold = ids.index(tier_offering_id(pool, "hot")), ids.index(pool)
    assert hot == cold + 1 and env.n == whole.n + 1
    o = env.catalog[hot]
    assert (o.tier, o.max_batch, o.parent_id, parent_offering_id(o.offering_id)) == ("hot", 2, pool, pool)
    assert (o.accelerator, o.instance_type, o.pricing_mode) == (env.catalog[cold].accelerator,
                                                                env.catalog[cold].instance_type, "on_demand")
    assert (env.replicas[0, hot], env.conc[0, hot], env.replicas[0, cold], env.conc[0, cold]) == (1, 2, 1, 7)
    pr = env.bundle.prices.set_index("offering_id")["usd_per_hour"]  # (its parent's price telemetry)
    assert pr.loc[[ids[hot]]].tolist() == pr.loc[[pool]].tolist() and len(pr.loc[[pool]])
    # no tiers: the catalog and its pools exactly as before
    assert [o.offering_id for o in whole.catalog] == [i for i in ids if i != ids[hot]]
    assert whole.replicas[0, cold] == 2 and whole.conc[0, cold] == 7


def test_a_tiers_requests_see_its_own_batch(tiny: tuple[Any, str, str]) -> None:
    """Fill the pool's full-batch part, then place on its tier: without noise a request's TPOT is its
    pool's tpot(k) exactly, k the requests per replica of *its* pool -- 0 on the idle tier, however
    full the parent."""
    b, serving, pool = tiny
    env = _env(b, serving, rate_scale=200.0, tiers=[{"offering": pool, "name": "hot", "replicas": 1, "max_batch": 2}],
               admission={"enabled": False})
    ids = [o.offering_id for o in env.catalog]
    hot, cold = ids.index(tier_offering_id(pool, "hot")), ids.index(pool)
    base_ms = 1000.0 * float(env.tpot_s[0, cold])
    env.reset(seed=0)
    on_cold: list[float] = []
    on_hot: list[float] = []
    while len(on_hot) < 1:
        m = env.c_mask
        if len(on_cold) < 5:
            if not m[cold]:
                pytest.fail("the parent's slots ran out before 5 requests were in flight")
            _, _, _, _, info = env.step(cold)
            on_cold.append(float(info["tpot_ms"]))
            continue
        assert env.inflight[0, hot] == 0 and env.inflight[0, cold] >= 4
        _, _, _, _, info = env.step(hot)
        on_hot.append(float(info["tpot_ms"]))
    assert on_hot[0] == pytest.approx(base_ms)  # k = 0: the tier's own batch, empty
    assert on_cold[-1] > base_ms * 1.1  # (4 and more already on the parent's one replica)


def test_the_policy_keeps_relaxed_requests_off_the_tier_and_lets_tight_ones_on(tiny: tuple[Any, str, str]) -> None:
    b, serving, pool = tiny
    w = b.workload.copy()
    tight = 40.0
    w.loc[w.index % 3 == 0, "tpot_ms"] = tight  # (a third of the requests ask a tight TPOT)
    b = dataclasses.replace(b, workload=w)
    ps = PolicySet.model_validate({
        "slo_tiers": {"tight": {"max_tpot_ms": tight}, "relaxed": {}},
        "policies": [{"name": "hot-tier-tight-only", "target": {"classes": ["relaxed"]}, "effect": "deny",
                      "constraints": {"offering_ids": ["*#hot"]}}]})
    env = _env(b, serving, policies=ps, tiers=[{"offering": pool, "name": "hot", "replicas": 1, "max_batch": 2}])
    hot = [o.offering_id for o in env.catalog].index(tier_offering_id(pool, "hot"))
    compiled = pol.CompiledPolicies(ps, env.catalog)
    for cls, allowed in (("tight", True), ("relaxed", False)):
        ctx = compiled.context("a", env.model_names[0], cls, "")
        out = compiled.outcome_buffers()
        mask = np.ones(env.n, dtype=bool)
        compiled.apply(ctx, mask.copy(), np.ones(env.n), np.zeros(env.n), np.zeros(env.n), np.full(env.n, 7.0),
                       mask, out)
        assert bool(mask[hot]) == allowed and bool(out.allowed[hot]) == allowed
        assert mask.sum() == env.n - (0 if allowed else 1)
    # the world applies it request by request: the action mask never offers the tier to a relaxed request
    env.reset(seed=0)
    seen = {True: 0, False: 0}
    for _ in range(200):
        is_tight = bool(env.r_tpot <= tight)
        if not is_tight:
            assert not env.c_mask[hot]
        seen[is_tight] += 1
        valid = np.flatnonzero(env.c_mask)
        _, _, _, done, _ = env.step(int(valid[0]) if len(valid) else 0)
        if done:
            break
    assert seen[True] and seen[False]


def test_a_live_router_serves_the_same_split_and_holds_tight_requests_to_the_tier(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The router (a real HTTP server on loopback) built from settings whose ``env`` names a tier and
    the policies that use it: ``/v1/offerings`` lists the tier with its own slots, a tight request is
    routed to the tier, a relaxed one never is."""
    import httpx

    from router.app.factory import create_app
    from tests.servers import ServerThread
    from tests.test_router_support import ROUTE, make_setup

    tmp = tmp_path_factory.mktemp("tiers-router")
    first = make_setup(tmp)  # (writes the tiny bundle and serving profile)
    pool = next(o.offering_id for o in load_bundle(tmp / "bundle").catalog() if o.accelerator == "A10G" and not o.is_spot)
    hot = tier_offering_id(pool, "hot")
    env = {**first.settings.env, "tiers": [{"offering": pool, "name": "hot", "replicas": 1, "max_batch": 2}]}
    policies = tmp / "tiers.yaml"  # (a router's policies come from its policy files or store, not its env)
    # ("wide" after "tight" in name order too: the router's policy store keeps its documents with sorted keys,
    # so its slo_tiers are tried in name order, not the file's -- a catch-all named "relaxed" would come first)
    policies.write_text(json.dumps({
        "slo_tiers": {"tight": {"max_tpot_ms": 40}, "wide": {}},
        "policies": [{"name": "hot-tier-tight-only", "target": {"classes": ["wide"]}, "effect": "deny",
                      "constraints": {"offering_ids": ["*#hot"]}},
                     {"name": "tight-on-hot", "target": {"classes": ["tight"]}, "effect": "allow",
                      "constraints": {"offering_ids": ["*#hot"]}}]}))
    setup = make_setup(tmp, env=env, policy_files=[policies])
    with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=10.0) as c:
        rows = {r["offering"]["offering_id"]: r for r in c.get("/v1/offerings", headers=setup.auth("a")).json()["offerings"]}
        assert hot in rows and pool in rows and len(rows) == 7
        assert rows[hot]["slots"] == 2 and rows[pool]["slots"] == 7
        tight = c.post("/v1/route", json={**ROUTE, "tpot_ms": 40}, headers=setup.auth("a"))
        assert tight.status_code == 200, tight.text
        assert tight.json()["offering"]["offering_id"] == hot
        for _ in range(5):
            r = c.post("/v1/route", json=ROUTE, headers=setup.auth("a"))
            assert r.status_code == 200 and r.json()["offering"]["offering_id"] != hot
