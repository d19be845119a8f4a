"""The output-length estimator (``envs.estimator``) against its plain formulas, and the environment
feeding it only what has completed."""

from __future__ import annotations

import numpy as np
import pytest

from envs import estimator as est
from envs.cloud_route import CloudRouteEnv


@pytest.mark.parametrize("seed", range(6))
def test_capped_mean_is_the_binned_expectation_of_the_capped_value(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = np.round(rng.lognormal(4, 1.5, 400))
    w, s, n = est.new_tables(1)
    for x in values:
        est.observe(w, s, n, 0, float(x), 1.0)
    weights = np.ones_like(values)
    for cap in (1.0, 7.0, 100.0, 333.0, 1e9):
        got = est.capped_mean(w, s, n, 0, cap, est.UPPER)
        assert got == pytest.approx(est.reference_capped_mean(values, weights, cap), rel=1e-12)
        exact = float(np.minimum(values, cap).mean())
        assert abs(got - exact) <= 0.2 * exact + 1e-9  # bins are a quarter octave wide
    assert est.capped_mean(w, s, n, 0, 1e9, est.UPPER) == pytest.approx(values.mean(), rel=1e-12)


def test_an_observation_weighs_half_after_half_life_newer_ones() -> None:
    from xroute.config import EstimatorConfig

    d = est.decay_for(EstimatorConfig(half_life=10))
    w, s, n = est.new_tables(1)
    est.observe(w, s, n, 0, 1000.0, d)
    for _ in range(10):
        est.observe(w, s, n, 0, 10.0, d)
    b_old = int(4 * np.log2(1001.0))
    assert w[0, b_old] == pytest.approx(0.5, rel=1e-12)
    assert n[0] == pytest.approx(sum(d ** k for k in range(11)), rel=1e-12)


def test_shrinkage_from_the_prior_to_the_model_to_the_tenant() -> None:
    w, s, n = est.new_tables(4)  # row 0: the model (all tenants), rows 1-3: tenants
    cap, k0, frac = 1000.0, 5.0, 0.25
    assert est.estimate(w, s, n, 1, 0, cap, k0, frac, est.UPPER) == pytest.approx(250.0)  # nothing known
    for _ in range(95):
        est.observe(w, s, n, 1, 40.0, 1.0)
        est.observe(w, s, n, 0, 40.0, 1.0)
    model = est.estimate(w, s, n, 0, 0, cap, k0, frac, est.UPPER)
    assert model == pytest.approx((95 * 40.0 + 5 * 250.0) / 100.0, rel=1e-9)
    assert est.estimate(w, s, n, 2, 0, cap, k0, frac, est.UPPER) == pytest.approx(model)  # an unseen tenant: the model's
    tenant = est.estimate(w, s, n, 1, 0, cap, k0, frac, est.UPPER)
    assert tenant == pytest.approx((95 * 40.0 + 5 * model) / 100.0, rel=1e-9)
    assert est.estimate(w, s, n, 1, 0, 10.0, k0, frac, est.UPPER) <= 10.0  # never above the budget


def test_the_environment_learns_an_output_only_once_its_request_completed(tiny_bundle_dir) -> None:
    """With no decay, the model row's total weight is exactly the number of requests the router
    has seen complete (plus the seeded history): never a request still in flight."""
    # (admission off: at x3 the tiny bundle's pools are overloaded, and with the admission that predicts
    # their queues most requests are shed, leaving too few in flight for the last check to bite)
    env = CloudRouteEnv(str(tiny_bundle_dir), episode_requests=None, rate_scale=3.0,
                        estimator={"half_life": 1e12, "history_lag_s": 0.0}, admission={"enabled": False})
    obs, info = env.reset(seed=0)
    ends: list[float] = []
    for _ in range(300):
        t = env.t
        done_by_t = sum(1 for e in ends if e <= t)
        assert env.est_n[env.default_model] == pytest.approx(done_by_t)
        a = int(np.argmax(env.expected_rewards()))
        before = {id(e) for e in env._events}
        obs, _, _, done, info = env.step(a)
        for e in env._events:  # the completion the step scheduled: at its true end (a retry's: later)
            if id(e) not in before:
                if e[2] == 0 and e[3][6] >= 0:
                    ends.append(e[0])
                elif e[2] == 1:
                    ends.append(e[3][3])
        if done:
            break
    assert ends and max(ends) > env.t  # some were still in flight at the end: the check had teeth


def test_an_episode_starts_from_the_outputs_it_could_know(tiny_bundle_dir) -> None:
    """``reset`` seeds the estimator with the stream's requests that arrived ``history_lag_s``
    before the episode (their outputs are known by then) and with ``history``; nothing later."""
    import pandas as pd

    env = CloudRouteEnv(str(tiny_bundle_dir), episode_requests=None, estimator={"half_life": 1e12,
                                                                                "history_lag_s": 5.0})
    env.reset(seed=0, options={"start": 200})
    known = int(np.searchsorted(env.arrival, env.arrival[200] - 5.0, side="right"))
    assert env.est_n[env.default_model] == pytest.approx(known)
    hist = pd.DataFrame({"output_tokens": [10, 20, 30], "tenant": ["a", "a", "b"]})
    env2 = CloudRouteEnv(str(tiny_bundle_dir), episode_requests=None, history=hist,
                         estimator={"half_life": 1e12})
    env2.reset(seed=0, options={"start": 0})
    assert env2.est_n[env2.default_model] == pytest.approx(3.0)
    assert env2.est_n[env2.estimator_key(env2.default_model, "a")] == pytest.approx(2.0)
