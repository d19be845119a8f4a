"""Routing policies: the schema and its YAML files, the compiled form against the plain reference
(``tests/policy_cases.py``), and the policies applied in the environment, the baselines, the
learned policy and ``xroute evaluate`` (docs/policies.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from envs import policies as pol
from envs.cloud_route import CloudRouteEnv
from envs.features import F, offering_matrix
from envs.kernels import BUSY
from models.baselines import BASELINES
from models.policy import LearnedPolicy, RewardPrior, RouterWeights
from tests.policy_cases import random_policy_set, reference
from xroute.bundle import load_bundle
from xroute.config import CONFIG_DIR, EnvConfig, EvaluateConfig, load_policies
from xroute.errors import ConfigError
from xroute.schema.policy_ir import (
    ConstraintError,
    PolicyCatalog,
    PolicySet,
    check_policy_set,
)

EU = """
region_sets:
  eu: [aws:eu-west-1, azure:westeurope, gcp:europe-west4]
slo_tiers:
  latency: {max_tpot_ms: 50}
  standard: {}
policies:
  - name: eu-residency
    target: {origins: ["*:eu-*", "azure:uksouth"]}
    effect: allow
    constraints: {region_sets: [eu]}
  - name: no-spot-latency
    target: {classes: [latency]}
    effect: deny
    constraints: {pricing_modes: [spot]}
"""


@pytest.fixture(scope="module")
def bundle():  # type: ignore[no-untyped-def]
    return load_bundle(None)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------- schema and files
def test_policy_files_load_merge_and_name_the_field_of_every_error(tmp_path: Path) -> None:
    d = tmp_path / "policies"
    write(d / "a.yaml", EU)
    write(d / "b.yaml", "policies:\n  - {name: ceiling, effect: deny, constraints: {max_usd_per_hour: 5}}\n")
    ps = load_policies(d)
    assert [p.name for p in ps.policies] == ["eu-residency", "no-spot-latency", "ceiling"]
    assert ps.region_sets["eu"][0] == "aws:eu-west-1" and list(ps.slo_tiers) == ["latency", "standard"]
    # a region set used in one file and defined in another (any order)
    write(tmp_path / "c" / "0-uses.yaml", "policies:\n  - {name: x, effect: allow, constraints: {region_sets: [eu]}}\n")
    write(tmp_path / "c" / "1-defines.yaml", "region_sets: {eu: [aws:eu-west-1]}\n")
    assert load_policies(tmp_path / "c").policies[0].constraints.region_sets == ["eu"]

    cases = {
        "policies:\n  - {name: a, effect: deny, constraintz: {}}\n": "field 'policies[0].constraintz': unknown key",
        "policies:\n  - {name: a, effect: prefer}\n": "field 'policies[0].weight': a prefer policy needs a weight",
        "policies:\n  - {name: a, effect: deny, weight: 1}\n": "field 'policies[0].weight': only a prefer policy",
        "policies:\n  - {name: a, effect: block}\n": "field 'policies[0].effect'",
        "policies:\n  - {name: a, effect: deny, constraints: {region_sets: [eu]}}\n":
            "field 'policies[0].constraints.region_sets[0]': unknown region set 'eu'",
        "policies:\n  - {name: a, effect: deny, target: {tenants: null}}\n":
            "field 'policies[0].target.tenants': must not be null",
        "policies:\n  - {name: a, effect: deny, constraints: {min_headroom: 2}}\n":
            "field 'policies[0].constraints.min_headroom'",
        "policies:\n  - {name: a, effect: deny}\n  - {name: a, effect: allow}\n": "'a' is defined twice",
        "polices: []\n": "field 'polices': unknown key",
    }
    for text, want in cases.items():
        f = write(tmp_path / "bad" / "p.yaml", text)
        with pytest.raises(ConfigError, match=r".*") as e:
            load_policies(f)
        assert str(f) in str(e.value) and want in str(e.value), (text, str(e.value))
    write(tmp_path / "dup" / "a.yaml", "policies:\n  - {name: same, effect: deny}\n")
    write(tmp_path / "dup" / "b.yaml", "policies:\n  - {name: same, effect: deny}\n")
    with pytest.raises(ConfigError, match=r"b\.yaml: field 'policies\[0\]\.name': policy 'same' is already defined in .*a\.yaml"):
        load_policies(tmp_path / "dup")
    with pytest.raises(ConfigError, match="not found"):
        load_policies(tmp_path / "missing.yaml")


def test_shipped_example_policies_load_and_check_against_the_shipped_catalog(bundle) -> None:  # type: ignore[no-untyped-def]
    ps = load_policies(CONFIG_DIR / "policies")
    assert {p.effect for p in ps.policies} == {"allow", "deny", "prefer"} and "eu" in ps.region_sets
    env = CloudRouteEnv(bundle, EnvConfig(episode_requests=10))
    check_policy_set(ps, PolicyCatalog(env.catalog, env.model_names, env.origins))


def test_values_the_catalog_lacks_are_errors_with_close_matches(bundle) -> None:  # type: ignore[no-untyped-def]
    cat = PolicyCatalog(bundle.catalog(), ["llama3-8b"], ["aws:us-east-2"])
    ok = PolicySet.model_validate({"policies": [{"name": "g", "effect": "deny",
                                                 "constraints": {"instance_types": ["g5.*"], "regions": ["eu-*"]}}]})
    check_policy_set(ok, cat)
    cases = [({"constraints": {"providers": ["awz"]}}, "policies[0].constraints.providers[0]", "aws"),
             ({"constraints": {"regions": ["us-east-1", "eu-west-9"]}}, "policies[0].constraints.regions[1]", "eu-west-1"),
             ({"constraints": {"instance_types": ["zz*"]}}, "policies[0].constraints.instance_types[0]", None),
             ({"target": {"models": ["llama3-8"]}}, "policies[0].target.models[0]", "llama3-8b")]
    for extra, field, close in cases:
        ps = PolicySet.model_validate({"policies": [{"name": "x", "effect": "deny", **extra}]})
        with pytest.raises(ConstraintError) as e:
            check_policy_set(ps, cat)
        assert e.value.field == field, (extra, e.value)
        assert close is None or close in e.value.suggestions, e.value.suggestions


# ---------------------------------------------------------------------------------------- compiled == reference
def test_compiled_masks_and_biases_agree_with_the_reference_on_random_cases(bundle) -> None:  # type: ignore[no-untyped-def]
    """3,000 random (policy set, catalog, request, numbers) cases: the compiled form's allowed
    mask, excluding policy and bias are the plain reference's, offering by offering."""
    rng = np.random.default_rng(0)
    full = bundle.catalog()
    tenants, models, origins = ["acme", "beta", "conv"], ["llama3-8b", "mixtral"], ["aws:us-east-2", "gcp:us-west4"]
    checked = 0
    for _ in range(150):
        catalog = [full[int(k)] for k in sorted(rng.choice(len(full), int(rng.integers(1, 40)), replace=False))]
        ps = random_policy_set(rng, catalog, tenants, models, origins)
        compiled = pol.CompiledPolicies(ps, catalog)
        out = compiled.outcome_buffers()
        n = len(catalog)
        for _ in range(20):
            tenant, model, origin = (str(rng.choice(v)) for v in (tenants, models, origins))
            cls = ps.request_class(str(rng.choice(["", "", "gold"])), float(rng.choice([400, 1800, 2500])), 50.0, None)
            usd = rng.choice([0.3, 0.9, 1.5, 4.0, 12.0, 40.0, np.nan], n)
            rtt = rng.choice([1.0, 30.0, 100.0, 200.0, 300.0], n)
            slots = rng.integers(0, 8, n)
            busy = np.minimum(rng.integers(0, 9, n), slots).astype(float)
            head = np.array([pol.headroom(b, s) for b, s in zip(busy, slots)])
            mask = rng.random(n) < 0.8
            before = mask.copy()
            ctx = compiled.context(tenant, model, cls, origin)
            compiled.apply(ctx, np.ones(n, dtype=bool), usd, rtt, busy, slots, mask, out)
            want = reference(ps, catalog, tenant, model, cls, origin, usd, rtt, head)
            got_reason = [None if r < 0 else compiled.names[r] for r in out.reason.tolist()]
            assert out.allowed.tolist() == [v.allowed for v in want]
            assert got_reason == [v.excluded_by for v in want]
            np.testing.assert_allclose(out.bias, [v.bias for v in want], atol=1e-12)
            if compiled.lexicographic and ctx.has_prefer:  # keeps only the valid offerings of the top weight
                ok = before & out.allowed
                if ok.any():
                    assert (mask == (ok & (out.bias >= out.bias[ok].max()))).all()
            else:
                assert (mask == (before & out.allowed)).all()
            assert out.excluded == sum(not v.allowed for v in want)
            assert sorted(compiled.counts_dict(out).items()) == sorted(
                {f"policy:{k}": sum(v.excluded_by == k for v in want) for k in {v.excluded_by for v in want} - {None}}.items())
            checked += 1
    assert checked == 3000


def test_deny_wins_over_allow_and_the_first_policy_by_priority_is_the_reason(bundle) -> None:  # type: ignore[no-untyped-def]
    catalog = bundle.catalog()
    ps = PolicySet.model_validate({"policies": [
        {"name": "allow-aws", "effect": "allow", "constraints": {"providers": ["aws"]}},
        {"name": "z-no-spot", "effect": "deny", "priority": 5, "constraints": {"pricing_modes": ["spot"]}},
        {"name": "a-no-t4", "effect": "deny", "constraints": {"accelerators": ["T4"]}},
    ]})
    c = pol.CompiledPolicies(ps, catalog)
    assert c.names == ["z-no-spot", "a-no-t4", "allow-aws"]
    out = c.outcome_buffers()
    n = len(catalog)
    c.apply(c.context("t", "m", "", "o"), np.ones(n, bool), np.ones(n), np.ones(n), np.zeros(n), np.ones(n, np.int64),
            np.ones(n, bool), out)
    for i, o in enumerate(catalog):
        why = None if out.reason[i] < 0 else c.names[out.reason[i]]
        if o.is_spot:
            assert why == "z-no-spot"  # the higher priority of two denies, and deny before allow
        elif o.accelerator == "T4":
            assert why == "a-no-t4"
        elif o.provider != "aws":
            assert why == "allow-aws"
        else:
            assert why is None


# ---------------------------------------------------------------------------------------- the environment
def _env(bundle, ps: PolicySet | None, **kw) -> CloudRouteEnv:  # type: ignore[no-untyped-def]
    return CloudRouteEnv(bundle, EnvConfig(episode_requests=kw.pop("episode_requests", 300), policies=ps, **kw))


def test_env_mask_and_bias_follow_the_request_context_of_the_stream(bundle) -> None:  # type: ignore[no-untyped-def]
    """The workload's tenant, class (its SLO tier here) and origin select the policies: the mask
    of every request is the env's own validity AND what the policies allow, and r_bias the prefer
    weights -- request by request, against the reference."""
    ps = PolicySet.model_validate({
        "region_sets": {"eu": ["aws:eu-west-1", "azure:westeurope", "gcp:europe-west4"]},
        "slo_tiers": {"latency": {"max_tpot_ms": 50}},
        "policies": [
            {"name": "eu", "target": {"origins": ["*:eu-*", "azure:uksouth"]}, "effect": "allow",
             "constraints": {"region_sets": ["eu"]}},
            {"name": "no-spot-latency", "target": {"classes": ["latency"]}, "effect": "deny",
             "constraints": {"pricing_modes": ["spot"]}},
            {"name": "conv-ceiling", "target": {"tenants": ["conv"]}, "effect": "deny",
             "constraints": {"max_usd_per_hour": 5.0}},
            {"name": "gcp", "effect": "prefer", "weight": 0.3, "constraints": {"providers": ["gcp"],
                                                                                "min_headroom": 0.2}}]})
    base = _env(bundle, None)
    env = _env(bundle, ps)
    _, info_b = base.reset(seed=1)
    _, info = env.reset(seed=1)
    seen_classes, seen_excluders, biased = set(), set(), 0
    for _ in range(300):
        i = env._pos
        tenant, origin = str(env.req_tenant[i]), env.origins[int(env.req_origin[i])]
        cls = "latency" if env.req_tpot[i] <= 50 else ""
        seen_classes.add(cls)
        head = np.array([pol.headroom(b, s) for b, s in zip(env.C[BUSY], env.slots[env.r_m])])
        want = reference(ps, env.catalog, tenant, env.model_names[env.r_m], cls, origin, env.usd_h, env.c_rtt, head)
        allowed = np.array([v.allowed for v in want])
        assert (info["action_mask"][: env.n] == (info_b["action_mask"][: env.n] & allowed)).all()
        # (r_bias also carries a spot notice's de-prioritized region: envs.cloud_route._notices)
        np.testing.assert_allclose(env.r_bias - env.region_bias, [v.bias for v in want], atol=1e-12)
        assert ("policy_bias" in info) and env.r_has_bias  # a prefer policy applies to every request here
        biased += any(v.bias for v in want)
        seen_excluders |= {v.excluded_by for v in want}
        valid = info["action_mask"][: env.n]
        if not valid.any():
            break
        # an action valid in both (the policies' mask is within the other's while their pools agree)
        a = int(np.argmax(np.where(valid, env.expected_rewards(), -np.inf)))
        _, _, _, done, info_b = base.step(a)
        _, _, _, _, info = env.step(a)
        if done:
            break
    assert biased > 100
    assert seen_classes == {"latency", ""}
    assert {"eu", "no-spot-latency", "conv-ceiling"} <= seen_excluders


def test_an_explicit_request_class_column_selects_the_target(tmp_path: Path) -> None:
    from tests.tinybundle import write_serving_yaml, write_tiny_bundle

    root = write_tiny_bundle(tmp_path / "b")
    w = (root / "workload.csv").read_text().splitlines()
    w = [w[0] + ",request_class"] + [line + ("," + ("gold" if k % 2 else "")) for k, line in enumerate(w[1:])]
    (root / "workload.csv").write_text("\n".join(w) + "\n")
    serving = write_serving_yaml(tmp_path / "serving.yaml")
    ps = PolicySet.model_validate({"policies": [{"name": "gold-no-spot", "target": {"classes": ["gold"]},
                                                 "effect": "deny", "constraints": {"pricing_modes": ["spot"]}}]})
    env = CloudRouteEnv(load_bundle(root), EnvConfig(episode_requests=None, serving_config=str(serving), policies=ps))
    _, info = env.reset(seed=0)
    spot = np.array([o.is_spot for o in env.catalog])
    golds = 0
    for _ in range(60):
        gold = env.req_class[env._pos] == "gold"
        golds += gold
        assert not (gold and (info["action_mask"][: env.n] & spot).any())
        assert (env.r_policy.excluded == spot.sum()) == gold
        _, _, _, _, info = env.step(int(np.flatnonzero(info["action_mask"])[0]) if info["action_mask"].any() else 0)
    assert 20 < golds < 40


def test_lexicographic_mode_keeps_only_the_top_weight_and_scores_carry_no_bias(bundle) -> None:  # type: ignore[no-untyped-def]
    ps = PolicySet.model_validate({"prefer_mode": "lexicographic", "policies": [
        {"name": "gcp", "effect": "prefer", "weight": 1.0, "constraints": {"providers": ["gcp"]}},
        {"name": "od", "effect": "prefer", "weight": 0.5, "constraints": {"pricing_modes": ["on_demand"]}}]})
    env, base = _env(bundle, ps), _env(bundle, None)
    _, info = env.reset(seed=0)
    _, info_b = base.reset(seed=0)
    gcp_od = np.array([o.provider == "gcp" and not o.is_spot for o in env.catalog])
    for _ in range(50):
        valid_b = info_b["action_mask"][: env.n]
        if (valid_b & gcp_od).any():
            assert (info["action_mask"][: env.n] == (valid_b & gcp_od)).all()
            assert env.r_policy.not_preferred == int(valid_b.sum() - (valid_b & gcp_od).sum())
        # (no prefer weight in the scores; a region a spot notice de-prioritized is, as in the router)
        assert not (env.r_bias - env.region_bias).any()
        assert ("policy_bias" in info) == bool(env.region_bias.any())
        a = int(np.flatnonzero(info["action_mask"])[0])
        _, _, _, _, info = env.step(a)
        _, _, _, _, info_b = base.step(a)


def test_every_baseline_and_the_learned_policy_add_the_bias_to_their_score(bundle) -> None:  # type: ignore[no-untyped-def]
    """A prefer policy with a large weight on one offering moves every scoring policy onto it
    whenever it is valid; the same policies without it mostly go elsewhere."""
    env = _env(bundle, None, episode_requests=200)
    env.reset(seed=0)
    target = env.catalog[int(np.argmax([o.provider == "azure" and not o.is_spot and o.accelerator == "T4"
                                        for o in env.catalog]))].offering_id
    ps = PolicySet.model_validate({"policies": [{"name": "pin", "effect": "prefer", "weight": 50.0,
                                                 "constraints": {"offering_ids": [target]}}]})
    cfg = EvaluateConfig()
    learned = LearnedPolicy(_random_weights(np.random.default_rng(0)), "learned")
    for name in ("greedy", "cheapest", "lowest-latency", "least-loaded", "round-robin", "random", "cache-aware",
                 "session-sticky", "budget-pacing", "learned"):
        p = learned if name == "learned" else BASELINES[name](cfg)
        for ps_, expect in ((ps, True), (None, False)):
            e = _env(bundle, ps_, episode_requests=200)
            obs, info = e.reset(seed=0)
            p.reset(e, 0)
            k = e.offering_index(target)
            on, valid_n = 0, 0
            for _ in range(200):
                a = p.act(obs, info)
                x = offering_matrix(obs)[: e.n]
                feasible = info["action_mask"][: e.n] & (x[:, F["exp_violation"]] < 0.5)
                # (cheapest and cache-aware keep their SLO filter: the bias trades within the offerings
                # likely to meet it)
                if info["action_mask"][k] and (name not in ("cheapest", "cache-aware") or feasible[k]
                                               or not feasible.any()):
                    valid_n += 1
                    on += a == k
                obs, _, _, done, info = e.step(a)
                if done:
                    break
            assert valid_n > 20, (name, valid_n)  # (it fills up: everything goes there while it can)
            if expect:
                assert on == valid_n, (name, on, valid_n)
            else:
                assert on < valid_n, (name, on, valid_n)


def _random_weights(rng: np.random.Generator) -> RouterWeights:
    from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES

    d = N_OFFERING_FEATURES + N_REQUEST_FEATURES
    layers = [(rng.normal(0, 0.3, (d, 16)).astype(np.float32), np.zeros(16, np.float32)),
              (rng.normal(0, 0.3, (16, 1)).astype(np.float32), np.zeros(1, np.float32))]
    return RouterWeights(layers=layers, prior=RewardPrior(0.6, 0.4, 2.0, 5.0, 3.0, 1500.0))


def test_static_routes_as_cheapest_when_a_policy_forbids_its_deployment(bundle) -> None:  # type: ignore[no-untyped-def]
    cfg = EvaluateConfig()
    static = BASELINES["static"](cfg)
    e = _env(bundle, None, episode_requests=50)
    e.reset(seed=0)
    static.reset(e, 0)
    pinned = e.catalog[static.idx].offering_id  # type: ignore[attr-defined]
    ps = PolicySet.model_validate({"policies": [{"name": "no-pin", "effect": "deny",
                                                 "constraints": {"offering_ids": [pinned]}}]})
    e = _env(bundle, ps, episode_requests=50)
    obs, info = e.reset(seed=0)
    static.reset(e, 0)
    cheapest = BASELINES["cheapest"](cfg)
    cheapest.reset(e, 0)
    for _ in range(50):
        a = static.act(obs, info)
        assert a != static.idx and a == cheapest.act(obs, info) and info["action_mask"][a]  # type: ignore[attr-defined]
        obs, _, _, done, info = e.step(a)
        if done:
            break


def test_evaluate_reports_what_each_policy_excluded(bundle, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "pol"
    write(d / "eu.yaml", EU)
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "xroute_app", "evaluate", "--policy", "greedy", "--policy", "random",
                        "--sample", "400", "--seeds", "1", "--policies", str(d), "--output", str(out), "--no-plot",
                        "--quiet"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "routing policies: exclusions" in r.stdout and "eu-residency" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["routing_policies"]["names"] == ["eu-residency", "no-spot-latency"]
    for name in ("greedy", "random"):
        m = rep["policies"][name]
        assert m["policy_excluded[eu-residency]"] > 0 and 0 < m["policy_affected[eu-residency]"] < 1
        assert m["policy_excluded[no-spot-latency]"] > 0
    # the exclusions come from the requests, not the routing policy's choices: equal for both here
    assert rep["policies"]["greedy"]["policy_affected[eu-residency]"] == rep["policies"]["random"]["policy_affected[eu-residency]"]
    bad = write(tmp_path / "bad.yaml", "policies:\n  - {name: a, effect: nope}\n")
    r = subprocess.run([sys.executable, "-m", "xroute_app", "evaluate", "--policy", "greedy", "--policies", str(bad)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and "field 'policies[0].effect'" in r.stderr and "Traceback" not in r.stderr
