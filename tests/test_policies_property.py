"""The property the routing policies promise (docs/policies.md): over random policy sets, random
catalogs and random request streams, no decision of any policy -- every baseline, the hindsight
oracle, a learned router, and the router's engine on each of its decision paths -- lands on an
offering a deny excludes or that no applicable allow admits.

Each decision is checked against the plain reference (``tests/policy_cases.py``, which shares no
code with the compiled form but the schema), computed from what the policies read at that moment:
the request's tenant, model, class and origin, and the offerings' price, RTT and headroom."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from envs import policies as pol
from envs.cloud_route import CloudRouteEnv
from envs.kernels import BUSY
from models.baselines import BASELINES
from models.policy import LearnedPolicy, RewardPrior, RouterWeights
from tests.policy_cases import random_policy_set, reference
from tests.state_support import decide
from xroute.bundle import Bundle, load_bundle
from xroute.catalog_tools import perturb_catalog
from xroute.config import EnvConfig, EvaluateConfig

pytestmark = pytest.mark.slow
#: a failing example is reported as drawn (shrinking one of these takes minutes)
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


@pytest.fixture(scope="module")
def stream() -> Bundle:
    """The shipped bundle's telemetry with 400 of its requests (both tenants, every origin)."""
    return load_bundle(None).select(np.arange(6000, 6400))


def _learned(seed: int) -> LearnedPolicy:
    from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES

    rng = np.random.default_rng(seed)
    d = N_OFFERING_FEATURES + N_REQUEST_FEATURES
    w = RouterWeights(layers=[(rng.normal(0, 0.5, (d, 8)).astype(np.float32), np.zeros(8, np.float32)),
                              (rng.normal(0, 0.5, (8, 1)).astype(np.float32), np.zeros(1, np.float32))],
                      ctx=(rng.normal(0, 0.5, (d, 4)).astype(np.float32), np.zeros(4, np.float32)),
                      prior=RewardPrior(0.6, 0.4, 2.0, 5.0, 3.0, 1500.0))
    # (the context layer widens the first layer's input)
    w.layers[0] = (rng.normal(0, 0.5, (d + 4, 8)).astype(np.float32), np.zeros(8, np.float32))
    return LearnedPolicy(w, "learned")


def _verdicts(env: CloudRouteEnv) -> list[Any]:
    """The reference's verdicts on the current request, from what the policies read now."""
    ps = env.policies.set  # type: ignore[union-attr]
    i = env._pos
    dl = float(env.req_deadline[i])
    cls = ps.request_class(str(env.req_class[i]), float(env.req_ttft[i]), float(env.req_tpot[i]),
                           None if dl != dl else dl)
    head = np.array([pol.headroom(b, s) for b, s in zip(env.C[BUSY], env.slots[env.r_m])])
    return reference(ps, env.catalog, str(env.req_tenant[i]), env.model_names[env.r_m], cls,
                     env.origins[int(env.req_origin[i])], env.usd_h, env.c_rtt, head)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None,
          phases=NO_SHRINK)
@given(catalog_seed=st.integers(0, 10_000), policy_seed=st.integers(0, 10_000), drop=st.floats(0.0, 0.7),
       rate=st.sampled_from([1.0, 8.0, 40.0]), start=st.integers(0, 300))
def test_no_decision_of_any_policy_lands_outside_the_policies(stream: Bundle, catalog_seed: int, policy_seed: int,
                                                              drop: float, rate: float, start: int) -> None:
    bundle = perturb_catalog(stream, drop_frac=drop, add=int(catalog_seed % 5), seed=catalog_seed)
    rng = np.random.default_rng(policy_seed)
    probe = CloudRouteEnv(bundle, EnvConfig(episode_requests=None))
    ps = random_policy_set(rng, probe.catalog, ["conv", "code", "acme"], list(probe.model_names), probe.origins)
    pinned = next(o for o in probe.catalog if not o.is_spot)  # the static baseline's deployment
    cfg = EvaluateConfig(env=EnvConfig(episode_requests=None), static_location=pinned.location,
                         static_accelerator=pinned.accelerator)
    policies: list[Any] = [BASELINES[k](cfg) for k in BASELINES if k != "oracle"]
    policies += [_learned(policy_seed), BASELINES["oracle"](cfg.model_copy(update={"oracle": cfg.oracle.model_copy(
        update={"horizon": 3})}))]
    for p in policies:
        env = CloudRouteEnv(bundle, EnvConfig(episode_requests=None, rate_scale=rate, policies=ps))
        obs, info = env.reset(seed=policy_seed, options={"start": start, "end": start + 30})
        p.reset(env, policy_seed)
        steps = 0
        while True:
            steps += 1
            want = _verdicts(env)
            allowed = np.array([v.allowed for v in want])
            valid = info["action_mask"][: env.n]
            assert not (valid & ~allowed).any()  # the action mask never offers what the policies exclude
            a = int(p.act(obs, info))
            if valid.any():
                assert 0 <= a < env.n and allowed[a], (p.name, a, want[a] if 0 <= a < env.n else None)
                if p.name != "static":  # (static pins one offering, and fails when its pool cannot take more)
                    assert valid[a], (p.name, a)
            obs, _, _, done, info = env.step(a)
            if not valid.any():  # no valid offering: refused -- or shed by the admission (docs/env.md) when the
                # policies allow offerings that cannot serve it in time --, never served outside the policies
                assert info["failed"] or info.get("admission") == "shed", info
            if done:
                break
        assert steps == 30


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from router.decision.engine import RoutingEngine
    from tests.test_router_support import make_setup

    setup = make_setup(tmp_path_factory.mktemp("prop"), tenants={"acme": {}}, alternatives=3)
    return RoutingEngine(setup.settings)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None,
          phases=NO_SHRINK)
@given(policy_seed=st.integers(0, 100_000), path=st.sampled_from(["fused-greedy", "greedy", "cheapest", "learned",
                                                                   "learned-general"]))
def test_no_decision_of_the_router_lands_outside_the_policies(engine: Any, policy_seed: int, path: str) -> None:
    """The router's engine (its fused greedy and learned paths and its general path), with a random
    policy set installed as a store version would be, and random requests (tenants, origins,
    constraints): every answer's offering and alternatives are allowed by the reference, every
    exclusion it reports is counted under the policy the reference names."""
    from models.baselines import make_baseline
    from router.decision.engine import RouteFailure
    from router.decision.model_slot import ActivePolicy
    from xroute.schema.access import Principal
    from xroute.schema.decision import RouteRequest

    rng = np.random.default_rng(policy_seed)
    env = engine.env
    ps = random_policy_set(rng, env.catalog, ["a", "b", "acme"], list(env.model_names), env.origins)
    ps = ps.model_copy(update={"version": policy_seed + 1})
    engine.install_policies(engine.compile_policies(ps))
    engine.fused_greedy = path == "fused-greedy"
    engine.fused_learned = path == "learned"
    slot = engine.slot
    if path in ("learned", "learned-general"):
        slot.install(ActivePolicy.make(_learned(policy_seed), "learned", "model", "v1"))
    else:
        slot.model = None
        fb = make_baseline("greedy" if "greedy" in path else path, EvaluateConfig())
        fb.reset(env, 0)
        slot.fallback = ActivePolicy.make(fb, fb.name, "fallback")
    import json
    import time

    for k in range(25):
        tenant = str(rng.choice(["a", "b", "acme"]))
        body = {"origin": str(rng.choice(env.origins)), "input_tokens": int(rng.integers(10, 3000)),
                "max_output_tokens": 200, "ttft_ms": float(rng.choice([300, 1500, 2500])), "tpot_ms": 100}
        if rng.random() < 0.3:
            body["request_class"] = str(rng.choice(["gold", "batch", "fast"]))
        req = RouteRequest.model_validate(body)
        try:
            text, *_ = decide(engine, req, Principal(tenant, "tenant", "k"), f"d_{policy_seed}_{k}", time.time())
        except RouteFailure as e:
            assert e.status in (422, 429), e.message
            continue
        ans = json.loads(text)
        cls = ps.request_class(req.request_class, req.ttft_ms, req.tpot_ms, None)
        head = np.array([pol.headroom(b, s) for b, s in zip(env.C[BUSY], env.slots[env.r_m])])
        want = reference(ps, env.catalog, tenant, env.model_names[env.r_m], cls, req.origin, env.usd_h, env.c_rtt, head)
        ids = [o.offering_id for o in env.catalog]
        for chosen in [ans["offering"], *[a["offering"] for a in ans["alternatives"]]]:
            v = want[ids.index(chosen["offering_id"])]
            assert v.allowed, (path, chosen["offering_id"], v)
        assert ans["policies"]["version"] == ps.version
        for reason, count in ans["excluded"]["by_reason"].items():
            if reason.startswith("policy:"):
                assert count == sum(v.excluded_by == reason[len("policy:"):] for v in want)
    engine.fused_greedy = engine.fused_learned = True
