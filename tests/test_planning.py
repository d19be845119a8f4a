"""The hindsight oracle's planning (``models.planning``): the incremental lookahead takes exactly the
decisions of ``HindsightRollout`` request by request; the parallel, segmented plan is a valid plan
whose replayed total is exact; the oracle follows the best plan it knows, so it scores at least
every heuristic, and it plans with its lookahead on streams of any length unless told otherwise.
Real environments on real (shipped) telemetry; real forked worker processes."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from envs.cloud_route import CloudRouteEnv
from models import planning
from models.baselines import BASELINES, HindsightRollout, Oracle, make_baseline
from models.evaluate import run_policy
from xroute.config import EvaluateConfig

HEURISTICS = [b for b in BASELINES if b != "oracle"]


def _cfg(**oracle: object) -> EvaluateConfig:
    c = EvaluateConfig()
    return c.model_copy(update={"oracle": c.oracle.model_copy(update=oracle)})


def _env(bundle, start: int, n: int, rate: float) -> CloudRouteEnv:
    env = CloudRouteEnv(bundle.select(np.arange(start, start + n)), EvaluateConfig().env.model_copy(
        update={"rate_scale": rate}))
    env.reset(seed=2)
    return env


def test_step_outcome_advances_the_environment_like_step(shipped_bundle) -> None:
    a, b = _env(shipped_bundle, 500, 300, 4.0), _env(shipped_bundle, 500, 300, 4.0)
    rng = np.random.default_rng(0)
    done = False
    while not done:
        valid = np.flatnonzero(a.action_mask())
        act = int(rng.choice(valid)) if rng.random() < 0.3 else int(np.argmax(a.expected_rewards()))
        _, r, _, done, info = a.step(act)
        out, done_b = b.step_outcome(act)
        assert done_b == done and out["reward"] == r and out["cost_usd"] == info["cost_usd"]
        if not done:
            assert np.array_equal(a.C, b.C) and np.array_equal(a.c_mask, b.c_mask) and a.steps_left == b.steps_left
    assert b.steps_left == 0


@pytest.mark.parametrize(("start", "rate", "top_k", "horizon", "max_regret"),
                         [(2000, 4.0, 3, 6, None), (9000, 1.0, 2, 4, None), (5000, 2.0, 4, 5, 0.004)])
def test_the_incremental_lookahead_decides_exactly_as_hindsight_rollout(shipped_bundle, start: int, rate: float,
                                                                      top_k: int, horizon: int,
                                                                      max_regret: float | None) -> None:
    _lookahead_is_hindsight_rollout(_env(shipped_bundle, start, 250, rate), top_k, horizon, max_regret)


@pytest.mark.parametrize(("start", "rate"), [(500, 1.0), (1500, 2.0)])
def test_with_prefix_caches_the_lookahead_decides_exactly_as_hindsight_rollout(start: int, rate: float) -> None:
    """The Mooncake bundle (the servers' prefix caches, the router's prefix view and sessions in
    play): the lookahead's snapshots share the environment's arrays (``save_state(share=True)``) and
    its spares are restored in place, ``HindsightRollout`` restores copied snapshots into itself --
    both take the decisions of the same rule played out on deep copies (no snapshot at all)."""
    from xroute.bundle import load_bundle

    env = _env(load_bundle("mooncake"), start, 150, rate)
    assert env.has_prefix
    _lookahead_is_hindsight_rollout(env, 3, 12, 0.008)
    got = planning.lookahead(copy.deepcopy(env), 3, 12, max_regret=0.008)
    assert got == _rollout_on_deep_copies(env, 3, 12, 0.008)
    # and the copying path (before issue 39; benchmarks/bench_oracle.py --ab times the two) decides the same
    assert got == planning.lookahead(copy.deepcopy(env), 3, 12, max_regret=0.008, share_snapshots=False)


def _rollout_on_deep_copies(env: CloudRouteEnv, top_k: int, horizon: int, max_regret: float | None) -> list[int]:
    """``HindsightRollout``'s decisions with every play-out on a deep copy of the environment."""
    env = copy.deepcopy(env)
    actions, done = [], env.steps_left <= 0
    while not done:
        cand = planning.candidates(planning.exact_scores(env), top_k, max_regret)
        best = int(cand[0]) if cand.size else 0
        if cand.size > 1:
            best_total = -np.inf
            for a in cand:
                sim = copy.deepcopy(env)
                out, over = sim.step_outcome(int(a))
                total = float(out["reward"])
                for _ in range(horizon):
                    if over:
                        break
                    out, over = sim.step_outcome(planning.hindsight_greedy_action(sim))
                    total += float(out["reward"])
                if total > best_total:
                    best, best_total = int(a), total
        actions.append(best)
        _, done = env.step_outcome(best)
    return actions


def _lookahead_is_hindsight_rollout(env: CloudRouteEnv, top_k: int, horizon: int, max_regret: float | None) -> None:
    ref_env = copy.deepcopy(env)
    pol = HindsightRollout(top_k, horizon, max_regret)
    pol.reset(ref_env, 2)
    obs, info = ref_env.observation(), ref_env._info()
    expected, done = [], False
    while not done:
        a = pol.act(obs, info)
        expected.append(a)
        obs, _, _, done, info = ref_env.step(a)
    got = planning.lookahead(copy.deepcopy(env), top_k, horizon, max_regret=max_regret)
    assert got == expected
    # the lookahead does differ from hindsight-greedy somewhere (else the test could not tell)
    assert got != planning.greedy_plan(copy.deepcopy(env))[0]


@pytest.mark.slow
def test_segmented_parallel_plan_is_replayed_exactly_and_the_oracle_dominates(shipped_bundle) -> None:
    """Forked workers, the lookahead cut in 3 segments: the stitched plan's total is the total the
    environment gives it; the oracle follows the best plan and scores at least every heuristic."""
    bundle = shipped_bundle.select(np.arange(4000, 4600))
    cfg = _cfg(workers=2, segment_requests=200, burn_in_requests=60, horizon=6)
    env = CloudRouteEnv(bundle, cfg.env.model_copy(update={"rate_scale": 4.0}))
    heur = {name: run_policy(env, make_baseline(name, cfg), seed=5).metrics["mean_reward"] for name in HEURISTICS}
    oracle = Oracle(cfg)
    seen: list[tuple[str, int, int, int, int]] = []
    oracle.on_progress = lambda *a: seen.append(a)
    got = run_policy(env, oracle, seed=5).metrics["mean_reward"]
    p = oracle.planned
    assert oracle.display_name == "oracle" and p.segments == 3
    assert set(p.totals) == {"hindsight-rollout", "hindsight-greedy", *HEURISTICS}
    assert p.totals[p.name] == max(p.totals.values())
    # every heuristic's plan scored what the heuristic scores when it routes the stream itself
    for name in HEURISTICS:
        assert p.totals[name] / 600 == pytest.approx(heur[name], abs=1e-6), name
    # the oracle replays exactly what it planned, and scores at least every heuristic
    assert got == pytest.approx(p.total / 600, abs=1e-6)
    assert all(got >= v - 1e-12 for v in heur.values())
    # the stitched lookahead is a real plan: its total is what the environment gives its decisions
    sim = copy.deepcopy(env)
    sim.reset(seed=5)
    taken, total, replaced = planning.replay(sim, planning.best_plan(
        copy.deepcopy(sim), 5, [], 3, 6, True, workers=2, segment_requests=200, burn_in_requests=60).actions)
    assert len(taken) == 600 and replaced == 0
    assert {s[0] for s in seen} >= {"hindsight-rollout", "hindsight-greedy", "greedy"}
    # the same plan again (forked workers and all): deterministic
    again = Oracle(cfg)
    assert run_policy(env, again, seed=5).metrics["mean_reward"] == got and again.plan == oracle.plan


@pytest.mark.slow
def test_the_lookahead_runs_on_long_streams_unless_a_limit_is_set(tiny_bundle_dir) -> None:
    env = CloudRouteEnv(str(tiny_bundle_dir), EvaluateConfig().env)
    assert EvaluateConfig().oracle.lookahead_max_requests is None
    full = Oracle(_cfg(workers=1))
    run_policy(env, full, seed=0)
    assert full.display_name == "oracle" and "hindsight-rollout" in full.planned.totals
    capped = Oracle(_cfg(workers=1, lookahead_max_requests=100))
    run_policy(env, capped, seed=0)
    assert capped.display_name == "oracle[no lookahead]" and "hindsight-rollout" not in capped.planned.totals


def test_candidates_beyond_the_two_best_are_played_only_within_max_regret() -> None:
    r = np.array([-0.10, -np.inf, -0.095, -0.12, -0.099, -0.2])
    assert planning.candidates(r, 3).tolist() == [2, 4, 0]
    assert planning.candidates(r, 5, max_regret=0.006).tolist() == [2, 4, 0]  # -0.12, -0.2 are further than that
    assert planning.candidates(r, 5, max_regret=0.0).tolist() == [2, 4]  # the two best always
    assert planning.candidates(np.full(3, -np.inf), 3).size == 0


@pytest.mark.slow
def test_evaluate_hands_the_oracle_the_baselines_it_ran_and_the_result_is_the_same(shipped_bundle) -> None:
    from models import evaluate as ev

    bundle = shipped_bundle.select(np.arange(7000, 7300))
    cfg = _cfg(workers=1, horizon=4)
    with_known = ev.evaluate(bundle, [*HEURISTICS, "oracle"], cfg, show_progress=False, seeds=2)
    alone = ev.evaluate(bundle, ["oracle"], cfg, show_progress=False, seeds=2)
    o1 = next(r for r in with_known if r.name == "oracle")
    assert [r.metrics for r in o1.runs] == [r.metrics for r in alone[0].runs]
    assert all(o1.metrics["mean_reward"] >= r.metrics["mean_reward"] for r in with_known)
    # what evaluate hands over is each baseline's decisions and its exact summed reward
    runs = [r.runs[0] for r in with_known if r.name != "oracle"]
    known = ev.known_plans(runs)
    assert set(known) == set(HEURISTICS)
    env = CloudRouteEnv(bundle, cfg.env)
    env.reset(seed=cfg.seed)
    for name, (actions, total) in known.items():
        assert planning.replay(copy.deepcopy(env), actions)[1] == pytest.approx(total, abs=1e-9), name


def test_under_admission_queueing_the_plans_count_decisions_not_stream_positions(tmp_path) -> None:
    """A stream where the admission queues requests (a queued request's decision comes after later
    arrivals'): the lookahead cut after k decisions is the whole lookahead's first k, the segmented
    parallel plan has one decision per request and replays to its total, and the oracle replays its plan."""
    from tests.tinybundle import write_serving_yaml, write_tiny_bundle
    from xroute.bundle import load_bundle
    from xroute.config import EnvConfig, parse_config

    bundle = load_bundle(write_tiny_bundle(tmp_path / "bundle", n_requests=300, preempt=False))
    env_cfg = parse_config(EnvConfig, {"serving_config": str(write_serving_yaml(tmp_path / "serving.yaml")),
                                       "episode_requests": None, "rate_scale": 40.0, "queue_timeout_s": 0.5,
                                       "admission": {"tenants": {"a": {"band": "critical"}, "b": {"band": "standard"}}}})
    env = CloudRouteEnv(bundle, env_cfg)
    env.reset(seed=2)
    g = copy.deepcopy(env)
    planning.greedy_plan(g)
    assert g.stats["queued"] > 20, "the stream must queue for this test to tell anything"
    full = planning.lookahead(copy.deepcopy(env), 3, 4)
    assert len(full) == 300
    assert planning.lookahead(copy.deepcopy(env), 3, 4, 100) == full[:100]
    plan = planning.best_plan(copy.deepcopy(env), 2, [], 3, 4, True, workers=2, segment_requests=100,
                              burn_in_requests=30)
    assert plan.segments == 3 and len(plan.actions) == 300
    taken, total, replaced = planning.replay(copy.deepcopy(env), plan.actions)
    assert len(taken) == 300 and total == pytest.approx(plan.total, abs=1e-9)
    oracle = Oracle(_cfg(workers=2, segment_requests=100, burn_in_requests=30, horizon=4))
    got = run_policy(env, oracle, seed=2)
    assert got.total_reward == pytest.approx(oracle.total, abs=1e-9) and len(oracle.plan) == 300


def test_a_stream_with_prefix_blocks_is_planned_in_one_segment(shipped_bundle) -> None:
    """The lookahead is cut into parallel segments only where the stream has no KV-prefix blocks:
    on the Mooncake bundle the pools' caches outlive any burn-in, so a segment started from
    hindsight-greedy's caches plans for caches the stitched plan does not have (measured on the 96k
    stream: stitched below hindsight-greedy, one segment above it). The default bundle (no prefix
    blocks) with the same settings is still cut in 3."""
    from xroute.bundle import load_bundle

    moon, plain = _env(load_bundle("mooncake"), 0, 300, 4.0), _env(shipped_bundle, 500, 300, 4.0)
    assert moon.has_prefix and not plain.has_prefix
    one = planning.best_plan(copy.deepcopy(moon), 2, [], 3, 4, True, workers=2, segment_requests=100,
                             burn_in_requests=30)
    assert one.segments == 1 and len(one.actions) == 300
    assert one.actions == planning.best_plan(copy.deepcopy(moon), 2, [], 3, 4, True, workers=1).actions
    assert planning.best_plan(copy.deepcopy(plain), 2, [], 3, 4, True, workers=2, segment_requests=100,
                              burn_in_requests=30).segments == 3
