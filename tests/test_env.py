"""The environment: both checkers, determinism, dynamics (queueing, preemption, invalid actions)."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest

import envs
from envs import kernels
from envs.cloud_route import CloudRouteEnv
from envs.features import F, offering_matrix


def _rollout(env: gym.Env, seed: int, steps: int, action_seed: int = 1):
    rng = np.random.default_rng(action_seed)
    obs, info = env.reset(seed=seed)
    traj = []
    for _ in range(steps):
        valid = np.flatnonzero(info["action_mask"])
        a = int(rng.choice(valid)) if valid.size else 0
        obs, r, term, trunc, info = env.step(a)
        traj.append((a, r, obs["offerings"].copy(), info["latency_ms"], info["cost_usd"]))
        if term or trunc:
            break
    return traj


def test_registered_and_builds_on_the_shipped_bundle_by_default():
    env = gym.make(envs.ENV_ID, episode_requests=64)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert info["action_mask"].dtype == bool and info["action_mask"].any()
    assert env.unwrapped.n == len(env.unwrapped.bundle.offerings)


def test_gymnasium_and_sb3_checkers_pass_without_warnings(shipped_bundle):
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    env = CloudRouteEnv(shipped_bundle, episode_requests=256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gym_check(env, skip_render_check=True)
        sb3_check(env, warn=True)


def test_same_seed_same_trajectory_and_other_seed_differs(shipped_bundle):
    a = _rollout(CloudRouteEnv(shipped_bundle, episode_requests=300), seed=5, steps=300)
    b = _rollout(CloudRouteEnv(shipped_bundle, episode_requests=300), seed=5, steps=300)
    c = _rollout(CloudRouteEnv(shipped_bundle, episode_requests=300), seed=6, steps=300)
    assert len(a) == len(b) == 300
    for x, y in zip(a, b):
        assert x[0] == y[0] and x[1] == y[1] and np.array_equal(x[2], y[2])
    assert any(x[1] != y[1] for x, y in zip(a, c))


def test_observations_stay_inside_the_space_on_a_whole_stream(tiny_bundle_dir):
    env = CloudRouteEnv(str(tiny_bundle_dir), episode_requests=None, rate_scale=4.0)
    rng = np.random.default_rng(0)
    obs, info = env.reset(seed=0)
    done = False
    while not done:
        assert env.observation_space.contains(obs)
        valid = np.flatnonzero(info["action_mask"])
        obs, _, _, done, info = env.step(int(rng.choice(valid)) if valid.size else 0)


def test_invalid_action_fails_the_request_with_the_penalty(tiny_bundle_dir):
    env = CloudRouteEnv(str(tiny_bundle_dir), max_offerings=16, episode_requests=10)
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step(15)  # padding: no such offering
    rw = env.cfg.reward
    assert info["failed"] and info["sla_violation"] and info["cost_usd"] == 0.0
    assert r == pytest.approx(-(rw.latency_weight * rw.failure_latency_norm) - rw.sla_penalty)
    assert not term


def test_queueing_raises_wait_and_busy_features(tiny_bundle_dir):
    env = CloudRouteEnv(str(tiny_bundle_dir), episode_requests=None, rate_scale=50.0)
    obs, info = env.reset(seed=0)
    a = env.offering_index("aws:us-east-1:g5.xlarge:on_demand")
    first_wait = offering_matrix(obs)[a, F["wait"]]
    busy_seen = []
    for _ in range(40):
        if not info["action_mask"][a]:
            break
        obs, _, _, _, info = env.step(a)
        busy_seen.append(offering_matrix(obs)[a, F["busy"]])
    assert first_wait == 0.0
    assert max(busy_seen) == pytest.approx(1.0)  # every slot taken under 50x load
    assert offering_matrix(obs)[a, F["wait"]] > 0.0 or not info["action_mask"][a]


def test_spot_preemption_retries_on_demand_and_costs_latency(tiny_bundle_dir):
    """A pool that dies unannounced (no notice: ``migration.notice`` off); the notice and the
    migration it starts: ``tests/test_env_migration.py``."""
    env = CloudRouteEnv(str(tiny_bundle_dir), episode_requests=None, migration={"notice": False})
    obs, info = env.reset(seed=0)
    spot = env.offering_index("aws:us-east-1:g5.xlarge:spot")
    down = env.replay.down_times[spot][0]
    preempted = []
    done = False
    while not done and env.t < down:
        a = spot if info["action_mask"][spot] else int(np.flatnonzero(info["action_mask"])[0])
        obs, r, _, done, info = env.step(a)
        if info["preempted"]:
            preempted.append(info)
    assert preempted, "a request in flight across the replayed preemption must be preempted"
    p = preempted[0]
    assert p["migrated_to"] is not None and not env.catalog[p["migrated_to"]].is_spot
    assert p["latency_ms"] >= env.cfg.retry_overhead_ms
    # while the pool is down it is masked
    while not done and env.t < down + 1.0:
        obs, r, _, done, info = env.step(int(np.flatnonzero(info["action_mask"])[0]))
    assert not info["action_mask"][spot]


def test_rate_scale_compresses_arrivals(tiny_bundle_dir):
    e1 = CloudRouteEnv(str(tiny_bundle_dir), episode_requests=None)
    e4 = CloudRouteEnv(str(tiny_bundle_dir), episode_requests=None, rate_scale=4.0)
    span1 = e1.arrival[-1] - e1.arrival[0]
    span4 = e4.arrival[-1] - e4.arrival[0]
    assert span4 == pytest.approx(span1 / 4.0)


def test_live_requests_see_the_load_of_earlier_decisions(tiny_bundle_dir):
    env = CloudRouteEnv(str(tiny_bundle_dir), episode_requests=None)
    t = env.arrival[0]
    obs, info = env.observe_live(t, "gcp:europe-west4", 500, 100, 2500.0, 100.0)
    a = env.offering_index("gcp:europe-west4:g2-standard-4:on_demand")
    before = offering_matrix(obs)[a, F["busy"]]
    env.commit_live(a)
    obs, _ = env.observe_live(t + 0.01, "gcp:europe-west4", 500, 100, 2500.0, 100.0)
    assert offering_matrix(obs)[a, F["busy"]] > before
    with pytest.raises(KeyError):
        env.observe_live(t, "nowhere:moon-1", 1, 1, 1000.0, 50.0)
    with pytest.raises(ValueError):
        env.observe_live(t, "gcp:europe-west4", 1, 1, 1000.0, 50.0, model="no-such-model")


def test_snapshots_survive_later_requests(tiny_bundle_dir):
    """The candidate outcomes are rewritten in place request after request; a ``save_state`` taken
    before later requests still restores the expectations it saw."""
    env = CloudRouteEnv(str(tiny_bundle_dir), episode_requests=None)
    t = env.arrival[0]
    snap = None
    for i in range(40):
        origin = env.origins[i % len(env.origins)]
        mask = env.set_live(t + 0.05 * i, origin, 100 + 37 * i, 5 + 11 * i, 3000.0 + 100 * i, 80.0)
        if i == 20:
            snap, seen = env.save_state(), env.c_lat.copy()
        if mask.any():
            env.commit_live(int(np.flatnonzero(mask)[0]))
    assert snap is not None and not np.array_equal(env.c_lat, seen)
    env.restore_state(snap)
    assert np.array_equal(env.c_lat, seen)
    env.set_live(t + 10.0, env.origins[0], 100, 5, 3000.0, 80.0)  # rewrites the env's arrays, not the snapshot
    assert np.array_equal(snap["C"][kernels.LAT], seen)


def test_too_many_offerings_for_max_offerings_is_a_config_error(tiny_bundle_dir):
    from xroute.errors import ConfigError

    with pytest.raises(ConfigError, match="max_offerings"):
        CloudRouteEnv(str(tiny_bundle_dir), max_offerings=3)
    with pytest.raises(ConfigError, match="unknown key"):
        CloudRouteEnv(str(tiny_bundle_dir), no_such_knob=1)


def test_step_functions_hold_the_last_row_and_start_with_the_first(tiny_bundle_dir):
    from envs.replay import Series
    from xroute.bundle import load_bundle, to_seconds

    b = load_bundle(tiny_bundle_dir)
    ids = b.offering_ids
    s = Series.from_table(b.availability, ids, "available")
    av = b.availability.assign(t=to_seconds(b.availability["ts"]))
    for t in (0.0, *sorted(av["t"]), float(av["t"].max()) + 5.0, *(av["t"] + 0.5)):
        got = s.values_at(float(t), default=1.0)
        for i, oid in enumerate(ids):
            rows = av[av["offering_id"] == oid]
            if rows.empty:
                assert got[i] == 1.0
                continue
            before = rows[rows["t"] <= t]
            expect = (before if len(before) else rows.iloc[:1])["available"].iloc[-1]
            assert got[i] == expect, (oid, t)


def test_the_reward_of_an_observed_outcome_is_the_simulations_reward(tiny_bundle_dir):
    """``outcome_reward`` (what the router computes from feedback) given what a step observed --
    the realized output, cost, latency, TTFT, failure -- is exactly the step's reward and SLO
    verdict: one computation for simulated and observed outcomes."""
    env = CloudRouteEnv(str(tiny_bundle_dir), rate_scale=8.0)
    obs, info = env.reset(seed=3)
    rng = np.random.default_rng(0)
    seen = {"failed": 0, "missed": 0, "met": 0}
    for _ in range(300):
        valid = np.flatnonzero(info["action_mask"])
        a = int(rng.choice(valid)) if valid.size and rng.random() < 0.9 else env.n  # some invalid: failed
        req = (env.r_in, float(env.req_out[env._pos]), env.r_ttft, env.r_tpot,
               None if env.r_deadline != env.r_deadline else env.r_deadline)
        obs, r, _, done, info = env.step(a)
        if info.get("admission") == "shed":  # refused before placing (the router's 429): no outcome to observe
            assert r == -env.cfg.admission.shed_cost and not info["failed"]
        else:
            got, missed = env.outcome_reward(*req, info["cost_usd"], None if info["failed"] else info["latency_ms"],
                                             None if info["failed"] else info["ttft_ms"], info["failed"])
            assert got == r and missed == info["sla_violation"]
            seen["failed" if info["failed"] else "missed" if missed else "met"] += 1
        if done:
            break
    assert min(seen.values()) > 0, seen  # every kind of outcome was compared
    with pytest.raises(ValueError, match="observed latency and TTFT"):
        env.outcome_reward(100, 10, 1000.0, 50.0, None, 0.0, None, 10.0, False)
