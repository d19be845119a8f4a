"""Baselines and the oracle on real telemetry: sanity relations that must hold on any stream."""

from __future__ import annotations

import numpy as np
import pytest

from envs.cloud_route import CloudRouteEnv
from models.baselines import BASELINES, make_baseline
from models.evaluate import run_policy
from xroute.config import EvaluateConfig
from xroute.errors import ConfigError

NAMES = [n for n in BASELINES if n != "oracle"]


@pytest.fixture(scope="module", params=[1.0, 4.0], ids=["rate1", "rate4"])
def results(request, shipped_bundle):
    cfg = EvaluateConfig()
    bundle = shipped_bundle.window(end=shipped_bundle.workload["ts"].iloc[1500])
    env = CloudRouteEnv(bundle, cfg.env.model_copy(update={"rate_scale": request.param}))
    return {name: run_policy(env, make_baseline(name, cfg), seed=3).metrics for name in [*NAMES, "oracle"]}


@pytest.mark.slow
def test_oracle_never_scores_below_any_baseline(results):
    for name in NAMES:
        assert results["oracle"]["mean_reward"] >= results[name]["mean_reward"] - 1e-12, name


@pytest.mark.slow
def test_cheapest_is_no_dearer_than_static_and_greedy_beats_random(results):
    assert results["cheapest"]["cost_usd"] <= results["static"]["cost_usd"]
    assert results["greedy"]["mean_reward"] > results["random"]["mean_reward"]
    assert results["greedy"]["mean_reward"] > results["round-robin"]["mean_reward"]
    assert results["lowest-latency"]["latency_p50_ms"] <= results["random"]["latency_p50_ms"]


def test_policies_never_pick_a_masked_offering_when_one_is_valid(shipped_bundle):
    cfg = EvaluateConfig()
    bundle = shipped_bundle.window(end=shipped_bundle.workload["ts"].iloc[400])
    env = CloudRouteEnv(bundle, cfg.env.model_copy(update={"rate_scale": 8.0}))
    for name in NAMES:
        pol = make_baseline(name, cfg)
        obs, info = env.reset(seed=1)
        pol.reset(env, 1)
        done = False
        while not done:
            a = pol.act(obs, info)
            if name != "static" and info["action_mask"].any():
                assert info["action_mask"][a], name
            obs, _, _, done, info = env.step(a)


def test_static_finds_the_reference_offering_and_can_be_pinned(shipped_bundle):
    cfg = EvaluateConfig()
    env = CloudRouteEnv(shipped_bundle, cfg.env.model_copy(update={"episode_requests": 10}))
    env.reset(seed=0)
    pol = make_baseline("static", cfg)
    pol.reset(env, 0)
    o = env.catalog[pol.idx]
    assert (o.location, o.accelerator, o.pricing_mode) == (cfg.static_location, cfg.static_accelerator, "on_demand")
    other = env.catalog[-1].offering_id
    pinned = make_baseline(f"static:{other}", cfg)
    pinned.reset(env, 0)
    assert pinned.idx == len(env.catalog) - 1
    with pytest.raises(ConfigError, match="no such offering_id"):
        make_baseline("static:nope", cfg).reset(env, 0)
    with pytest.raises(ConfigError, match="did you mean greedy"):
        make_baseline("greedyy", cfg)


def test_oracle_replays_exactly_what_it_planned(tiny_bundle_dir):
    cfg = EvaluateConfig()
    env = CloudRouteEnv(str(tiny_bundle_dir), cfg.env)
    first = run_policy(env, make_baseline("oracle", cfg), seed=0).metrics
    again = run_policy(env, make_baseline("oracle", cfg), seed=0).metrics
    assert first == again
    assert np.isfinite(first["mean_reward"])


def test_oracle_reports_progress_while_it_plans(tiny_bundle_dir):
    cfg = EvaluateConfig()
    env = CloudRouteEnv(str(tiny_bundle_dir), cfg.env)
    oracle = make_baseline("oracle", cfg)
    seen = []
    oracle.on_progress = lambda name, p, n, done, total: seen.append((name, p, n, done, total))
    env.reset(seed=0)
    oracle.reset(env, 0)
    assert seen and {s[0] for s in seen} >= {"hindsight-rollout", "greedy"}
    assert all(s[3] <= s[4] == 400 and 1 <= s[1] <= s[2] for s in seen)
