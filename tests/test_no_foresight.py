"""No policy but the hindsight oracle sees the future.

Two environments replay the same stream with the same seed; in the second, the realized outcome
of the current request and of every later one -- its output length, its service-time draw, when a
later spot preemption really happens (one whose notice is not yet delivered) -- is permuted (and, in a stronger variant, the requests
still in flight at the current step run twice as long). A policy that decides only on what a
router knows must take exactly the same decisions up to and including the current step. The
oracle, which plans with hindsight, is checked to *change* its decisions: the test can tell.

The routing policies (``envs.policies``) are decision-time state too: with a policy set whose
numeric constraints read the price, the RTT and the pools' headroom, and whose prefer weights bias
every score, the decisions still depend on nothing realized.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from envs.cloud_route import _COMPLETE, CloudRouteEnv
from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES
from models.baselines import make_baseline
from models.policy import LearnedPolicy, RewardPrior, RouterWeights
from xroute.config import EnvConfig, EvaluateConfig
from xroute.schema.policy_ir import PolicySet

START, LENGTH = 3000, 320
STEPS = (60, 200, 319)
POLICIES = ("static", "cheapest", "lowest-latency", "least-loaded", "greedy", "budget-pacing", "round-robin", "random",
            "learned")
#: tenant budgets that bind within the checked steps (``envs.budget``): the budget left, the time left in
#: the period and the tokens left in the window are decision-time state every policy reads; a request's
#: end (its real tokens and cost) reaches them only when it has ended
BUDGETS = {"budget_period_s": 60.0, "tenants": {"code": {"usd_per_day": 0.00008}, "conv": {"tokens_per_minute": 250000}}}


def _learned() -> LearnedPolicy:
    rng = np.random.default_rng(11)
    nf, nr, ctx = N_OFFERING_FEATURES, N_REQUEST_FEATURES, 8
    dims = [nf + nr + ctx, 32, 1]
    layers = [(rng.normal(0, 0.3, (a, b)).astype(np.float32), rng.normal(0, 0.1, b).astype(np.float32))
              for a, b in itertools.pairwise(dims)]
    c = (rng.normal(0, 0.3, (nf + nr, ctx)).astype(np.float32), rng.normal(0, 0.1, ctx).astype(np.float32))
    return LearnedPolicy(RouterWeights(layers=layers, ctx=c, prior=RewardPrior.from_env_config(EnvConfig())))


def _policy(name: str) -> Any:
    return _learned() if name == "learned" else make_baseline(name, EvaluateConfig())


#: routing policies that read decision-time numbers: price, RTT from the origin, headroom in the router's view
ROUTING = PolicySet.model_validate({"policies": [
    {"name": "ceiling", "effect": "deny", "constraints": {"max_usd_per_hour": 6.0}},
    {"name": "near", "effect": "deny", "target": {"tenants": ["code"]}, "constraints": {"max_rtt_ms": 150.0}},
    {"name": "roomy", "effect": "prefer", "weight": 0.05, "constraints": {"min_headroom": 0.5}},
    {"name": "no-spot-full", "effect": "deny", "constraints": {"pricing_modes": ["spot"], "min_headroom": 0.25}}]})


def _env(bundle: Any, world: str = "plain") -> CloudRouteEnv:
    """``world``: "plain", "budgets" (tenant budgets binding), or "routed" (routing policies)."""
    return CloudRouteEnv(bundle, episode_requests=None, rate_scale=6.0, **(BUDGETS if world == "budgets" else {}),
                         policies=ROUTING if world == "routed" else None)


def _future_changed(env: CloudRouteEnv, k: int, rng: np.random.Generator, in_flight: set[int]) -> None:
    """Permute the realized outcome of request k and every later one; stretch ``in_flight``."""
    i0 = START + k
    idx = np.arange(i0, START + LENGTH)
    env.req_out = env.req_out.copy()  # never the shared stream array of another env
    env.req_out[idx] = env.req_out[rng.permutation(idx)]
    for i in in_flight:  # not seen complete at step k: longer still, so not seen complete either
        env.req_out[i] = min(2 * env.req_out[i] + 1, env.req_max_out[i])
    env.z = env.z.copy()
    env.z[k:] = rng.permutation(env.z[k:])
    t_k = env.arrival[i0]
    for i, d in enumerate(env.replay.down_times):  # when later preemptions really happen
        # (those whose notice a router has by t_k are known then: the true time is at most
        # spot_lag_s before the recorded one, its notice notice_s before that)
        later = d - env.cfg.spot_lag_s - env.notice_s[i] > t_k
        if later.any():
            td = env._true_down[i].copy()
            td[later] = d[later] - rng.random(int(later.sum())) * env.cfg.spot_lag_s
            env._true_down[i] = td


def _run(env: CloudRouteEnv, policy: Any, steps: int, change_at: int | None = None,
         in_flight: set[int] | None = None) -> tuple[list[int], set[int]]:
    obs, info = env.reset(seed=4, options={"start": START, "end": START + LENGTH})
    if change_at is not None:
        _future_changed(env, change_at, np.random.default_rng(change_at), in_flight or set())
    policy.reset(env, 4)
    actions, pending = [], set()
    for s in range(steps + 1):
        if s == steps:  # the requests still in flight when step ``steps`` is decided
            pending = {int(d[-1]) for (_, _, kind, d) in env._events if kind == _COMPLETE and d[-1] >= 0}
        a = int(policy.act(obs, info))
        actions.append(a)
        obs, _, _, done, info = env.step(a)
        if done:
            break
    return actions, pending


@pytest.fixture(scope="module")
def bundle(shipped_bundle: Any) -> Any:
    return shipped_bundle


@pytest.mark.parametrize("world", ["plain", "budgets", "routed"],
                         ids=["plain", "budgets", "routing-policies"])
@pytest.mark.parametrize("name", POLICIES)
def test_no_decision_depends_on_the_realized_future(bundle: Any, name: str, world: str) -> None:
    for k in STEPS:
        base, pending = _run(_env(bundle, world), _policy(name), k)
        changed, _ = _run(_env(bundle, world), _policy(name), k, change_at=k, in_flight=pending)
        assert changed == base, (name, k, next(i for i, (a, b) in enumerate(zip(base, changed)) if a != b))
        assert pending, "some requests are in flight at each checked step (the test stretches them)"


def test_the_budgets_bind_within_the_checked_steps(bundle: Any) -> None:
    """The budget variant above is not vacuous: budgets mask offerings and refuse requests, and
    the budget features move, before the last checked step."""
    env = _env(bundle, "budgets")
    obs, info = env.reset(seed=4, options={"start": START, "end": START + LENGTH})
    policy = _policy("greedy")
    policy.reset(env, 4)
    feats = []
    for _ in range(STEPS[-1]):
        feats.append(obs["request"][-3:].copy())
        obs, _, _, _, info = env.step(int(policy.act(obs, info)))
    f = np.array(feats)
    assert env.stats["refused_budget"] > 0 and env.stats["refused_rate_limit"] > 0 and env.stats["excluded_budget"] > 0
    assert f[:, 0].min() < 0.1 and f[:, 1].min() < 1.0 and f[:, 2].min() < 0.1


def test_the_future_does_change_the_outcomes_and_the_oracle(bundle: Any) -> None:
    """The perturbation is not a no-op: the realized rewards change, and the hindsight oracle --
    which plans on the realized future, and is documented as such -- changes its decisions."""
    env_a, env_b = _env(bundle), _env(bundle)
    k = 100
    env_a.reset(seed=4, options={"start": START, "end": START + LENGTH})
    env_b.reset(seed=4, options={"start": START, "end": START + LENGTH})
    _future_changed(env_b, k, np.random.default_rng(k), set())
    assert not np.array_equal(env_a.req_out[START + k:START + LENGTH], env_b.req_out[START + k:START + LENGTH])
    cfg = EvaluateConfig().model_copy(update={"oracle": EvaluateConfig().oracle.model_copy(update={"horizon": 4})})
    a, _ = _run(env_a, make_baseline("oracle", cfg), LENGTH - 1)
    b, _ = _run(env_b, make_baseline("oracle", cfg), LENGTH - 1, change_at=k)
    assert a != b


# ------------------------------------------------------------------------------ with prefix caching
P_START, P_LENGTH = 600, 260
P_STEPS = (40, 150, 259)
P_POLICIES = ("greedy", "cache-aware", "session-sticky", "cheapest", "least-loaded", "learned")


@pytest.fixture(scope="module")
def prefix_bundle() -> Any:
    from xroute.bundle import load_bundle

    b = load_bundle("mooncake")
    assert b.has_prefixes
    return b


def _prefix_env(bundle: Any) -> CloudRouteEnv:
    return CloudRouteEnv(bundle, episode_requests=None, rate_scale=4.0)


def _run_p(env: CloudRouteEnv, policy: Any, steps: int, change_at: int | None = None,
           in_flight: set[int] | None = None) -> tuple[list[int], set[int], list[float]]:
    """As ``_run`` on the prefix bundle; at ``change_at`` the servers' real caches are also lost
    (every pool's replicas restarted empty) -- what no router can see when it decides."""
    obs, info = env.reset(seed=4, options={"start": P_START, "end": P_START + P_LENGTH})
    policy.reset(env, 4)
    actions, pending, cached = [], set(), []
    for s in range(steps + 1):
        if s == change_at:
            rng = np.random.default_rng(s)
            i0 = P_START + s
            idx = np.arange(i0, P_START + P_LENGTH)
            env.req_out = env.req_out.copy()
            env.req_out[idx] = env.req_out[rng.permutation(idx)]
            for i in in_flight or set():
                env.req_out[i] = min(2 * env.req_out[i] + 1, env.req_max_out[i])
            env.z = env.z.copy()
            env.z[s:] = rng.permutation(env.z[s:])
            env._kv = {}  # the truth: every cache empty from now on
        if s == steps:
            pending = {int(d[-1]) for (_, _, kind, d) in env._events if kind == _COMPLETE and d[-1] >= 0}
        a = int(policy.act(obs, info))
        actions.append(a)
        obs, _, _, done, info = env.step(a)
        cached.append(info["cached_tokens"])
        if done:
            break
    return actions, pending, cached


@pytest.mark.parametrize("name", P_POLICIES)
def test_no_decision_depends_on_the_servers_real_caches(prefix_bundle: Any, name: str) -> None:
    """With prefix caching: what the servers really hold (their caches, lost at step k here) and the
    realized future reach a router only through completions after step k, so no decision up to
    step k changes. The router's own view (what it sent where) does change decisions: the
    cache-aware policies follow it (checked below)."""
    for k in P_STEPS:
        base, pending, _ = _run_p(_prefix_env(prefix_bundle), _policy(name), k)
        changed, _, cached = _run_p(_prefix_env(prefix_bundle), _policy(name), k, change_at=k, in_flight=pending)
        assert changed == base, (name, k, next(i for i, (a, b) in enumerate(zip(base, changed)) if a != b))
        assert cached[k] == 0.0  # the perturbation bit: request k found every cache empty


def test_the_servers_caches_do_change_outcomes_and_the_oracle(prefix_bundle: Any) -> None:
    """The caches matter: the base run serves cached prefixes, and the hindsight oracle -- which
    plans on the servers' real caches -- changes its plan when they are lost."""
    _, _, cached = _run_p(_prefix_env(prefix_bundle), _policy("greedy"), P_LENGTH - 1)
    assert sum(cached) > 0
    cfg = EvaluateConfig().model_copy(update={"oracle": EvaluateConfig().oracle.model_copy(update={"horizon": 4})})
    env_a, env_b = _prefix_env(prefix_bundle), _prefix_env(prefix_bundle)
    for env in (env_a, env_b):
        env.reset(seed=4, options={"start": P_START, "end": P_START + P_LENGTH})
    # the first request after step 60 whose prefix some pool's servers hold (the oracle sees it)
    warm = _prefix_env(prefix_bundle)
    obs, info = warm.reset(seed=4, options={"start": P_START, "end": P_START + P_LENGTH})
    pol = _policy("greedy")
    pol.reset(warm, 4)
    k = 0
    while k < 60 or not warm.true_cached().any():
        obs, _, _, _, info = warm.step(int(pol.act(obs, info)))
        k += 1
    snap = warm.save_state()
    env_a.restore_state(snap)
    env_b.restore_state(snap)
    env_b._kv = {}
    ra, rb = env_a.exact_rewards(), env_b.exact_rewards()
    assert (ra > rb + 1e-9).any() and not (ra < rb - 1e-9).any()  # a cached prefix only ever helps
    oa, ob = make_baseline("oracle", cfg), make_baseline("oracle", cfg)
    oa.reset(env_a, 4)
    ob.reset(env_b, 4)
    assert oa.total > ob.total  # the oracle plans on the real caches (its planned outcome is better with them)


# ------------------------------------------------------------------------------ capacity planners
# The provisioning world (envs.provisioning): a planner decides every epoch from its PlanView. Two worlds
# replay the shipped stream's validation window with the same seed; in the second, after epoch k, the future
# is changed -- the later requests' sizes and noise, the outputs of the requests still in flight at k (longer
# still), when later spot notices and preemptions come, where later launches find capacity. A planner of the
# past plans the same up to and including epoch k; the hindsight oracle, which plans on the whole window, does not.
PLANNERS = ("static-ondemand", "autoscaler", "spothedge", "melange", "learned")
EPOCHS = (3, 7)


def _make_planner(name: str) -> Any:
    """A planner by name; ``learned``: the learned planner with a random network reaching every feature
    (``tests.test_planner_learned.random_weights``) and every knob that reads the past in use -- the
    stabilization window, the hazard and risk prices, the hedge, the cooldown."""
    from models.planner_policy import LearnedPlanner
    from models.planners import make_planner

    if name == "learned":
        from tests.test_planner_learned import random_weights

        return LearnedPlanner(None, random_weights(4, margin=0.05, beta=1.0, risk_price=1.0, hazard_price=0.3,
                                                   hedge=0.3, stabilization_s=180.0, cooldown=2))
    return make_planner(name)


def _planner_world(bundle: Any) -> Any:
    from envs.provisioning import ProvisionWorld
    from models.config import load_train_config
    from models.scenarios import split_bundle

    sp = split_bundle(bundle, load_train_config(None).split)
    return ProvisionWorld(sp.bundles["validation"], history=sp.history("validation"), rate_scale=1.5)


def _world_future_changed(w: Any, k: int, rng: np.random.Generator, ends: np.ndarray) -> None:
    from envs import provision_kernels as pk

    t_k = w.T0 + k * w.dt
    qf = w.QF
    ik = int(np.searchsorted(qf[pk.QF_T], t_k))
    idx = np.arange(ik, w.N)
    qf[pk.QF_OUT, idx] = np.minimum(3 * qf[pk.QF_OUT, rng.permutation(idx)] + 1, qf[pk.QF_MAXOUT, idx])
    qf[pk.QF_IN, idx] = qf[pk.QF_IN, rng.permutation(idx)]
    qf[pk.QF_Z, idx] = qf[pk.QF_Z, rng.permutation(idx)]
    flying = np.flatnonzero((np.arange(w.N) < ik) & (ends > t_k))
    qf[pk.QF_OUT, flying] = np.minimum(2 * qf[pk.QF_OUT, flying] + 1, qf[pk.QF_MAXOUT, flying])
    w._events = [(tn + 40.0, kind, i, td + 40.0) if tn >= t_k else (tn, kind, i, td) for tn, kind, i, td in w._events]
    later = w.g_launchable[k + 1:]
    w.g_launchable[k + 1:] = (rng.random(later.shape) < 0.5) | ~w.pools.is_spot[None, :]


def _plan_run(w: Any, name: str, change_at: int | None = None, ends: np.ndarray | None = None
              ) -> tuple[list[list[int]], np.ndarray, dict[str, Any]]:
    from envs import provision_kernels as pk

    planner = _make_planner(name)
    ctx = w.reset(seed=5)
    if change_at is not None:
        assert ends is not None
        _world_future_changed(w, change_at, np.random.default_rng(change_at), ends)
    if name == "oracle":
        planner.bind(w)
    planner.reset(ctx)
    plans = []
    while True:
        tg = planner.plan(w.view())
        plans.append([int(x) for x in tg])
        if w.step(tg).done:
            break
    return plans, w.QF[pk.QF_END].copy(), w.metrics()


@pytest.fixture(scope="module")
def planner_world(bundle: Any) -> Any:
    return _planner_world(bundle)


@pytest.mark.parametrize("name", PLANNERS)
def test_no_plan_depends_on_the_realized_future(planner_world: Any, name: str) -> None:
    base, ends, m_base = _plan_run(planner_world, name)
    assert len({tuple(p) for p in base}) > 1 or name == "static-ondemand", "the planner changes its plan"
    for k in EPOCHS:
        changed, _, m_changed = _plan_run(planner_world, name, change_at=k, ends=ends)
        assert changed[:k + 1] == base[:k + 1], (name, k)
        assert m_changed != m_base  # the future really changed


def test_the_future_does_change_the_oracles_plan(planner_world: Any) -> None:
    base, ends, _ = _plan_run(planner_world, "oracle")
    k = EPOCHS[-1]
    changed, _, _ = _plan_run(planner_world, "oracle", change_at=k, ends=ends)
    assert changed[:k + 1] != base[:k + 1]
