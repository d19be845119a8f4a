"""Off-policy evaluation (``models/ope.py``, ``xroute/schema/ope.py``, ``xroute ope``,
``xroute promote --ope``): the estimators against logs whose true value is known -- a synthetic
contextual bandit (exact truth) and the simulator (the on-policy value of the target on the same
stream and seeds) -- the log format's reader, and the promotion rule."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES, F
from models import ope
from models.policy import RewardPrior, RouterWeights, save_router
from xroute.config import EvaluateConfig
from xroute.errors import ConfigError
from xroute.schema.ope import DecisionLog, LogError, LoggedDecision, LogHeader, read_log, write_log

REPO = Path(__file__).resolve().parent.parent
CFG = EvaluateConfig()
PRIOR = RewardPrior.from_env_config(CFG.env)
#: light load: one request every ~25 s, so one decision barely changes what the next one sees
LOW_LOAD = CFG.env.model_copy(update={"rate_scale": 0.01})


def target(name: str) -> Any:
    return ope.resolve_target(name, PRIOR, CFG)[0]


def covers(e: ope.Estimate, v: float) -> bool:
    return e.lo <= v <= e.hi


# ------------------------------------------------------------------------- the estimators
def test_estimator_formulas_on_a_hand_computed_log() -> None:
    w = np.array([2.0, 0.0, 0.5])
    r = np.array([-1.0, -2.0, -0.4])
    qc = np.array([-0.8, -1.5, -0.5])
    qt = np.array([-0.9, -1.0, -0.6])
    e = ope.estimates(w, r, qc, qt)
    assert e["ips"].value == pytest.approx((-2.0 + 0.0 - 0.2) / 3)
    assert e["snips"].value == pytest.approx(-2.2 / 2.5)
    assert e["dr"].value == pytest.approx(((-0.9 + 2 * -0.2) + -1.0 + (-0.6 + 0.5 * 0.1)) / 3)
    assert e["dm"].value == pytest.approx(-2.5 / 3)
    assert ope.effective_sample_size(w) == pytest.approx(2.5**2 / 4.25)
    # a target that never agrees with the log: SNIPS has nothing to normalize by, IPS says 0
    none = ope.estimates(np.zeros(3), r, qc, qt)
    assert np.isnan(none["snips"].value) and none["ips"].value == 0.0


def test_ips_snips_and_the_normal_interval_match_vowpal_wabbits_estimators() -> None:
    from estimators.bandits import gaussian, ips, snips  # vw-estimators (a dev dependency)

    rng = np.random.default_rng(3)
    p_log = rng.uniform(0.05, 1.0, 60)
    p_pred = (rng.random(60) < 0.4).astype(float)
    r = rng.normal(-1.0, 0.5, 60)
    vi, vs, vg = ips.Estimator(), snips.Estimator(), gaussian.Interval()
    for a, b, c in zip(p_log, r, p_pred):
        vi.add_example(a, b, c)
        vs.add_example(a, b, c)
        vg.add_example(a, b, c)
    e = ope.estimates(p_pred / p_log, r, np.zeros(60), np.zeros(60))
    assert e["ips"].value == pytest.approx(vi.get(), rel=1e-12)
    assert e["snips"].value == pytest.approx(vs.get(), rel=1e-12)
    lo, hi = vg.get(alpha=0.05)
    assert (e["ips"].lo, e["ips"].hi) == (pytest.approx(lo, rel=1e-9), pytest.approx(hi, rel=1e-9))
    # with q = 0, DR is IPS
    assert e["dr"].value == pytest.approx(e["ips"].value) and e["dr"].lo == pytest.approx(e["ips"].lo)


def test_set_argmax_and_padding_agree_with_a_plain_loop() -> None:
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 7, 50)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    scores = rng.integers(0, 4, int(offsets[-1])).astype(float)  # many ties: the first one wins
    want = [int(np.argmax(scores[offsets[i]:offsets[i + 1]])) for i in range(50)]
    assert ope.set_argmax(scores, offsets).tolist() == want
    rows = rng.normal(size=(int(offsets[-1]), 3)).astype(np.float32)
    x, mask, _ = ope.padded(rows, offsets, 10, 20)
    assert x.shape == (10, sizes[10:20].max(), 3) and mask.sum() == sizes[10:20].sum()
    assert np.array_equal(x[3, : sizes[13]], rows[offsets[13]:offsets[14]]) and not x[mask == 0].any()


@pytest.mark.slow
def test_on_a_synthetic_bandit_the_intervals_cover_the_exact_truth_at_their_nominal_rate() -> None:
    """200 logs of 2000 decisions (epsilon-greedy around the prior's argmax, epsilon 0.3) from a
    bandit whose value is exact: every estimator is unbiased, its 95 % interval covers the truth
    about 95 % of the time, and SNIPS and DR vary less than IPS."""
    world = ope.SyntheticBandit.make(PRIOR, seed=0)
    reps = 200
    for name in ("cheapest", "lowest-latency"):
        t = target(name)
        truth = world.value(t)
        est: dict[str, list[float]] = {k: [] for k in ope.ESTIMATORS}
        hit = dict.fromkeys(ope.ESTIMATORS, 0)
        for k in range(reps):
            lg = world.log(2000, 0.3, seed=1000 + k)
            r = ope.evaluate_target(lg, t, ope.q_hat(lg, PRIOR))
            for e in ope.ESTIMATORS:
                x = getattr(r, e)
                est[e].append(x.value)
                hit[e] += covers(x, truth)
        sd = {e: float(np.std(v)) for e, v in est.items()}
        for e, v in est.items():
            assert abs(np.mean(v) - truth) < 3 * sd[e] / np.sqrt(reps), (name, e, np.mean(v), truth)
            assert 0.90 <= hit[e] / reps <= 0.99, (name, e, hit[e] / reps)
        assert sd["snips"] < sd["ips"] and sd["dr"] < sd["ips"], (name, sd)
        assert r.agreement < 0.6  # the targets differ from the logging policy: the test weighs something


def test_dr_is_unbiased_with_a_useless_reward_model_and_better_with_the_prior() -> None:
    """Double robustness: with q = 0 DR is IPS (unbiased, noisy); with the calibrated prior it is
    as unbiased and tighter."""
    world = ope.SyntheticBandit.make(PRIOR, seed=1)
    t = target("lowest-latency")
    truth = world.value(t)
    zero, good = [], []
    for k in range(40):
        lg = world.log(2000, 0.3, seed=k)
        zero.append(ope.evaluate_target(lg, t, np.zeros(lg.rows.shape[0])).dr.value)
        good.append(ope.evaluate_target(lg, t, ope.q_hat(lg, PRIOR)).dr.value)
    assert abs(np.mean(zero) - truth) < 3 * np.std(zero) / np.sqrt(40)
    assert abs(np.mean(good) - truth) < 3 * np.std(good) / np.sqrt(40)
    assert np.std(good) < 0.5 * np.std(zero)


# ---------------------------------------------------------------------- the simulator log
@pytest.fixture(scope="module")
def low_load_log(tiny_bundle_dir: Path) -> ope.SimulatedLog:
    return ope.simulate_log(str(tiny_bundle_dir), LOW_LOAD, 0.3, range(10))


@pytest.mark.slow
def test_at_low_load_dr_and_snips_cover_the_on_policy_value(tiny_bundle_dir: Path,
                                                             low_load_log: ope.SimulatedLog) -> None:
    """The truth: each target run on-policy on the same stream and seeds (models.evaluate.run_policy)."""
    assert low_load_log.skipped == 0  # the log and the on-policy runs cover the same requests
    lg = low_load_log.log()
    assert lg.n == 4000
    q = ope.q_hat(lg, PRIOR)
    for name in ("greedy", "cheapest"):
        t = target(name)
        truth = ope.true_value(str(tiny_bundle_dir), LOW_LOAD, t, range(10))
        r = ope.evaluate_target(lg, t, q)
        assert covers(r.dr, truth) and covers(r.snips, truth), (name, truth, r)
        assert 0.7 < r.agreement < 0.8 and r.ess > 2500  # epsilon 0.3 over sets of 3-6 offerings
        # and the log is informative: the logging policy itself (30 % exploration) is far worse
        assert ope.logged_value(lg).hi < truth - 0.1


@pytest.mark.slow
def test_the_estimates_cover_the_targets_value_on_the_logged_states(low_load_log: ope.SimulatedLog) -> None:
    """What a target would really have got on each logged decision (hindsight, same state and
    noise): the quantity the estimators aim at, congestion or not."""
    lg = low_load_log.log()
    hs = np.array([h[r.chosen] for h, r in zip(low_load_log.hindsight, low_load_log.records)])
    assert np.array_equal(hs, lg.reward)  # the hindsight of the logged action is what happened
    q = ope.q_hat(lg, PRIOR)
    for name in ("greedy", "lowest-latency", "random"):
        t = target(name)
        v = low_load_log.value_on_log(t)
        r = ope.evaluate_target(lg, t, q)
        assert all(covers(getattr(r, e), v) for e in ope.ESTIMATORS), (name, v, r)


@pytest.mark.slow
def test_under_congestion_the_estimates_miss_the_on_policy_value(tiny_bundle_dir: Path) -> None:
    """The documented limit (docs/ope.md): at the bundle's own load, exploration relieves the
    pool greedy favours, so greedy looks better in the log than it is when it routes everything
    itself. The estimates still cover its value on the logged states."""
    cfg = CFG.env.model_copy(update={"rate_scale": 1.0})
    sim = ope.simulate_log(str(tiny_bundle_dir), cfg, 0.3, range(10))
    lg = sim.log()
    t = target("greedy")
    r = ope.evaluate_target(lg, t, ope.q_hat(lg, PRIOR))
    truth = ope.true_value(str(tiny_bundle_dir), cfg, t, range(10))
    assert covers(r.dr, sim.value_on_log(t))
    assert r.dr.lo - truth > r.dr.hi - r.dr.lo, (r.dr, truth)  # off by more than 3 half-widths


def test_a_target_identical_to_the_logging_policy_gets_exactly_the_logged_mean(tiny_bundle_dir: Path) -> None:
    sim = ope.simulate_log(str(tiny_bundle_dir), LOW_LOAD, 0.0, [0])
    lg = sim.log()
    assert (lg.propensity == 1.0).all()
    r = ope.evaluate_target(lg, target("greedy"), ope.q_hat(lg, PRIOR))
    mean = float(lg.reward.mean())
    assert r.ips.value == mean and r.snips.value == mean and r.dr.value == pytest.approx(mean, abs=1e-12)
    assert r.agreement == 1.0 and r.ess == pytest.approx(lg.n)


def test_a_target_exploring_as_the_logging_policy_did_weighs_every_decision_one(tiny_bundle_dir: Path) -> None:
    """``greedy:epsilon=EPS`` is the router's exploring policy: on a log written by exactly that
    policy every importance weight is 1 (so IPS is the logged mean); its probabilities over each
    set sum to 1; a bad epsilon is one line naming the policy."""
    eps = 0.3
    lg = ope.simulate_log(str(tiny_bundle_dir), LOW_LOAD, eps, [0]).log()
    explore = target(f"greedy:epsilon={eps}")
    pi = explore.probabilities(lg.rows, lg.request, lg.offsets)
    assert np.allclose(np.add.reduceat(pi, lg.offsets[:-1]), 1.0)
    assert np.allclose(pi[lg.chosen_flat], lg.propensity, rtol=0, atol=1e-12)
    r = ope.evaluate_target(lg, explore, ope.q_hat(lg, PRIOR))
    assert r.ips.value == pytest.approx(float(lg.reward.mean()), abs=1e-12) and r.ess == pytest.approx(lg.n)
    assert (lg.propensity < 1 - eps).any()  # the log explored: the weights of plain greedy are not all one
    assert ope.resolve_target("greedy:epsilon=0.3", PRIOR, CFG)[1] is None
    for bad in ("greedy:epsilon=1.5", "greedy:epsilon=x", "greedy:epsilon=nan"):
        with pytest.raises(ConfigError, match=f"--policy: '{bad}': epsilon must be a number from 0 to 1"):
            target(bad)


def test_the_offline_baselines_decide_as_the_baselines_do(tiny_bundle_dir: Path) -> None:
    """Scored from the logged rows, greedy (the argmax of the reward prior) and cheapest pick
    what the environment's baselines pick: their on-policy runs are identical."""
    from envs.cloud_route import CloudRouteEnv
    from models.baselines import make_baseline
    from models.evaluate import run_policy

    # (the offline targets score the logged rows and read no score bias -- no prefer weight, no region a
    # spot notice de-prioritized: docs/env.md -- so the world here has neither: no notices)
    env = CloudRouteEnv(str(tiny_bundle_dir), CFG.env.model_copy(update={"migration": CFG.env.migration.model_copy(
        update={"notice": False})}))
    for name in ("greedy", "cheapest", "lowest-latency"):
        a = run_policy(env, make_baseline(name, CFG), 0, compare_greedy=False).metrics
        b = run_policy(env, ope.OnPolicy(target(name)), 0, compare_greedy=False).metrics
        assert a == b, name


def test_a_learned_router_is_scored_as_it_routes(tmp_path: Path) -> None:
    from models.policy import LearnedPolicy, read_router

    rng = np.random.default_rng(0)
    d = N_OFFERING_FEATURES + N_REQUEST_FEATURES
    w = RouterWeights(layers=[(rng.normal(size=(d + 4, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)),
                              (rng.normal(size=(8, 1)).astype(np.float32), np.zeros(1, np.float32))],
                      ctx=(rng.normal(size=(d, 4)).astype(np.float32), np.zeros(4, np.float32)), prior=PRIOR)
    path = save_router(w, tmp_path / "router")
    t, model = ope.resolve_target(str(path), PRIOR, CFG)
    assert model is None
    lg = ope.SyntheticBandit.make(PRIOR, n_contexts=60, seed=2).log(300, 0.2, seed=0)
    pi = t.probabilities(lg.rows, lg.request, lg.offsets)
    pol = LearnedPolicy(read_router(path))
    pol.n = None
    for i in range(lg.n):
        k = int(lg.sizes[i])
        obs = {"offerings": lg.rows[lg.offsets[i]:lg.offsets[i + 1]].reshape(-1), "request": lg.request[i],
               "mask": np.ones(k, dtype=np.float32)}
        assert pi[lg.offsets[i] + pol.act(obs, {"action_mask": obs["mask"]})] == 1.0
    # a router that is its prior alone (a zero network) is greedy
    zero = RouterWeights(layers=[(np.zeros((d, 1), np.float32), np.zeros(1, np.float32))], prior=PRIOR)
    assert np.array_equal(ope.ScoreArgmax("z", zero.scores).probabilities(lg.rows, lg.request, lg.offsets),
                          target("greedy").probabilities(lg.rows, lg.request, lg.offsets))


def test_a_learned_router_is_scored_with_its_departure_rule(tmp_path: Path) -> None:
    """OPE scores the learned router as it serves (issue 39): where the network's advantage over
    greedy's choice is at most its margin, greedy's choice -- the decision
    ``LearnedPolicy.choose_among`` takes on the same rows with greedy's choice from the log."""
    from models.policy import LearnedPolicy, read_router

    rng = np.random.default_rng(3)
    d = N_OFFERING_FEATURES + N_REQUEST_FEATURES
    layers = [(rng.normal(size=(d, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)),
              (0.01 * rng.normal(size=(8, 1)).astype(np.float32), np.zeros(1, np.float32))]
    lg = ope.SyntheticBandit.make(PRIOR, n_contexts=60, seed=2).log(300, 0.2, seed=0)
    greedy_pi = target("greedy").probabilities(lg.rows, lg.request, lg.offsets)
    raw = RouterWeights(layers=layers, prior=PRIOR, margin=-math.inf)
    raw_pi = ope.ScoreArgmax("raw", raw.scores).probabilities(lg.rows, lg.request, lg.offsets)
    # the network's advantage of its argmax over greedy's choice, per decision
    s = ope.flat_scores(raw.scores, lg.rows, lg.request, lg.offsets)
    adv = np.array([s[lg.offsets[i]:lg.offsets[i + 1]].max()
                    - s[lg.offsets[i] + int(np.argmax(greedy_pi[lg.offsets[i]:lg.offsets[i + 1]]))]
                    for i in range(lg.n)])
    margin = float(np.median(adv[adv > 0]))
    seen = {}
    for m in (-math.inf, margin, math.inf):
        path = save_router(RouterWeights(layers=layers, prior=PRIOR, margin=m), tmp_path / f"r{m}")
        t, _ = ope.resolve_target(str(path), PRIOR, CFG)
        pi = t.probabilities(lg.rows, lg.request, lg.offsets)
        pol = LearnedPolicy(read_router(path))
        for i in range(lg.n):
            lo, hi = int(lg.offsets[i]), int(lg.offsets[i + 1])
            g = int(np.argmax(greedy_pi[lo:hi]))
            a = pol.choose_among(lg.rows[lo:hi], lg.request[i], np.arange(hi - lo), g)
            assert pi[lo + a] == 1.0, (m, i)
        seen[m] = pi
    assert np.array_equal(seen[-math.inf], raw_pi)
    assert np.array_equal(seen[math.inf], greedy_pi)
    # the calibrated margin departs on some decisions and keeps greedy's on others
    departs = (seen[margin] != greedy_pi).any() and (seen[margin] != raw_pi).any()
    assert departs, "the margin should split the decisions between the two"


def test_policies_a_log_cannot_score_are_refused_with_one_line() -> None:
    for name in ("round-robin", "static", "static:x", "oracle", "hindsight-greedy"):
        with pytest.raises(ConfigError, match="cannot be scored from a log") as e:
            target(name)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"unknown policy 'gredy'.*did you mean greedy"):
        target("gredy")


# ------------------------------------------------------------------------------ the log format
_SMALL: dict[str, ope.SimulatedLog] = {}


def _records(tmp_path: Path, tiny_bundle_dir: Path) -> ope.SimulatedLog:
    """The first 30 decisions of a simulated log (simulated once)."""
    key = str(tiny_bundle_dir)
    if key not in _SMALL:
        _SMALL[key] = ope.simulate_log(key, LOW_LOAD, 0.5, [0])
    b = _SMALL[key]
    return ope.SimulatedLog(b.header, b.records[:30], b.hindsight[:30], b.skipped)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".parquet"])
def test_the_log_round_trips_and_counts_pending_decisions(tmp_path: Path, tiny_bundle_dir: Path, suffix: str) -> None:
    sim = _records(tmp_path, tiny_bundle_dir)
    recs = list(sim.records)
    recs[4] = recs[4].model_copy(update={"reward": None, "feedback": None})  # no feedback yet
    path = write_log(tmp_path / f"log{suffix}", sim.header, recs)
    lg = read_log(path)
    want = DecisionLog.from_records(sim.header, recs)
    assert lg.n == 29 and lg.pending == 1 and want.pending == 1
    for f in ("decision_id", "tenant", "offsets", "action_ids", "rows", "request", "chosen", "propensity", "reward",
              "policy"):
        assert np.array_equal(getattr(lg, f), getattr(want, f)), f
    assert lg.rows.dtype == np.float32 and lg.header == sim.header
    ope.check_layout(lg)


def _bad(tmp_path: Path, tiny_bundle_dir: Path, suffix: str, edit: Any) -> str:
    sim = _records(tmp_path, tiny_bundle_dir)
    raw = [r.model_dump(mode="json") for r in sim.records]
    edit(raw)
    p = tmp_path / f"bad{suffix}"
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        from xroute.schema.ope import PARQUET_HEADER_KEY, _arrow_schema

        t = pa.Table.from_pylist(raw, schema=_arrow_schema())
        pq.write_table(t.replace_schema_metadata({PARQUET_HEADER_KEY: sim.header.model_dump_json().encode()}), p)
    else:
        p.write_text("\n".join([sim.header.model_dump_json(), *(json.dumps(r) for r in raw)]) + "\n")
    with pytest.raises(LogError) as e:
        read_log(p)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def _set(i: int, field: str, value: Any) -> Any:
    def edit(raw: list[dict[str, Any]]) -> None:
        raw[i][field] = value
    return edit


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_bad_decisions_give_one_line_naming_the_record_and_the_field(tmp_path: Path, tiny_bundle_dir: Path,
                                                                     suffix: str) -> None:
    msg = _bad(tmp_path, tiny_bundle_dir, suffix, _set(3, "propensity", 0.0))
    assert "'0:r00003'" in msg and "field 'propensity'" in msg
    msg = _bad(tmp_path, tiny_bundle_dir, suffix, _set(5, "chosen", 99))
    assert "'0:r00005'" in msg and "field 'chosen'" in msg and "past the end of action_set" in msg

    def short_row(raw: list[dict[str, Any]]) -> None:
        raw[2]["offering_features"][1] = raw[2]["offering_features"][1][:-1]
    msg = _bad(tmp_path, tiny_bundle_dir, suffix, short_row)
    assert "'0:r00002'" in msg and "field 'offering_features[1]'" in msg and f"the header names {len(F)}" in msg

    def extra_id(raw: list[dict[str, Any]]) -> None:
        raw[7]["action_set"] = [*raw[7]["action_set"], "x"]
    msg = _bad(tmp_path, tiny_bundle_dir, suffix, extra_id)
    assert "'0:r00007'" in msg and "field 'offering_features'" in msg and "rows for" in msg
    msg = _bad(tmp_path, tiny_bundle_dir, suffix, _set(9, "decision_id", "0:r00001"))
    assert "decision 10 ('0:r00001')" in msg and "field 'decision_id': repeats" in msg


def test_jsonl_type_errors_name_the_line_and_the_field(tmp_path: Path, tiny_bundle_dir: Path) -> None:
    msg = _bad(tmp_path, tiny_bundle_dir, ".jsonl", _set(0, "propensity", "high"))
    assert "line 2 ('0:r00000')" in msg and "field 'propensity'" in msg

    def drop(raw: list[dict[str, Any]]) -> None:
        del raw[1]["chosen"]
    assert "line 3" in (m := _bad(tmp_path, tiny_bundle_dir, ".jsonl", drop)) and "field 'chosen'" in m
    assert "field 'reward'" in _bad(tmp_path, tiny_bundle_dir, ".jsonl", _set(0, "reward", "NaN"))
    assert "field 'feedback.latency_ms'" in _bad(tmp_path, tiny_bundle_dir, ".jsonl", _set(0, "feedback",
                                                                                          {"latency_ms": -1}))
    p = tmp_path / "h.jsonl"
    p.write_text('{"decision_id": "a"}\n')
    with pytest.raises(LogError, match="line 1: field 'format': expected the header"):
        read_log(p)
    p.write_text("")
    with pytest.raises(LogError, match="empty: line 1 must be the header"):
        read_log(p)
    with pytest.raises(LogError, match=r"named \*.jsonl"):
        read_log(tmp_path / "log.csv")


def test_parquet_nulls_and_missing_columns_name_the_field(tmp_path: Path, tiny_bundle_dir: Path) -> None:
    import pyarrow.parquet as pq

    assert "field 'reward': must be a finite number" in _bad(tmp_path, tiny_bundle_dir, ".parquet",
                                                              _set(0, "reward", float("nan")))
    assert "decision 2 ('0:r00001'): field 'policy': missing" in _bad(tmp_path, tiny_bundle_dir, ".parquet",
                                                                       _set(1, "policy", None))
    sim = _records(tmp_path, tiny_bundle_dir)
    p = write_log(tmp_path / "ok.parquet", sim.header, sim.records)
    t = pq.read_table(p)
    pq.write_table(t.drop_columns(["propensity"]), tmp_path / "nocol.parquet")
    with pytest.raises(LogError, match="field 'propensity': column missing"):
        read_log(tmp_path / "nocol.parquet")
    pq.write_table(t.replace_schema_metadata({}), tmp_path / "nohead.parquet")
    with pytest.raises(LogError, match="field 'format': no 'xroute_ope_header'"):
        read_log(tmp_path / "nohead.parquet")


def test_parquet_columns_of_the_wrong_type_name_the_field(tmp_path: Path, tiny_bundle_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sim = _records(tmp_path, tiny_bundle_dir)
    t = pq.read_table(write_log(tmp_path / "ok.parquet", sim.header, sim.records))
    k = t.column_names.index("propensity")
    pq.write_table(t.set_column(k, "propensity", pa.array(["high"] * t.num_rows)), tmp_path / "str.parquet")
    with pytest.raises(LogError, match="field 'propensity': a column of string, expected double"):
        read_log(tmp_path / "str.parquet")
    # a narrower number type is fine (float32 propensities, int32 indices)
    k = t.column_names.index("chosen")
    pq.write_table(t.set_column(k, "chosen", t.column("chosen").cast(pa.int32())), tmp_path / "i32.parquet")
    assert read_log(tmp_path / "i32.parquet").chosen.tolist() == [r.chosen for r in sim.records]

def test_a_log_with_another_feature_layout_is_refused(tmp_path: Path, tiny_bundle_dir: Path) -> None:
    sim = _records(tmp_path, tiny_bundle_dir)
    names = list(sim.header.offering_features)
    names[2] = "price_slope"
    header = sim.header.model_copy(update={"offering_features": names})
    lg = read_log(write_log(tmp_path / "l.jsonl", header, sim.records))
    with pytest.raises(LogError, match=r"header: field 'offering_features': 'price_slope' where envs\.features has"):
        ope.check_layout(lg)


def test_the_record_model_documents_every_field() -> None:
    schema = LoggedDecision.model_json_schema()
    assert {"decision_id", "tenant", "action_set", "offering_features", "request_features", "chosen", "propensity",
            "policy", "policy_version", "reward", "feedback"} <= set(schema["properties"])
    assert schema["properties"]["propensity"]["exclusiveMinimum"] == 0
    assert LogHeader(offering_features=[], request_features=[]).format == "xroute-ope-log/1"


# ------------------------------------------------------------------------------ promotion rule
def _report(challenger: tuple[float, float] | None, champion: float | None, logged: float = -0.6,
            ch_version: str = "2", champ_version: str = "1", model: str = "m") -> dict[str, Any]:
    pol: dict[str, Any] = {}
    if challenger is not None:
        v, lo = challenger
        pol["models:/m@challenger"] = {"model": {"registered_model": model, "version": ch_version},
                                       **{e: {"value": v, "ci95": [lo, 2 * v - lo]} for e in ope.ESTIMATORS}}
    if champion is not None:
        pol["models:/m@champion"] = {"model": {"registered_model": model, "version": champ_version},
                                     **{e: {"value": champion, "ci95": [champion - 0.01, champion + 0.01]}
                                        for e in ope.ESTIMATORS}}
    pol["greedy"] = {"model": None, **{e: {"value": 0.0, "ci95": [0.0, 0.0]} for e in ope.ESTIMATORS}}
    return {"format": ope.REPORT_FORMAT, "log": {"decisions": 1000, "logged_mean": {"value": logged}},
            "policies": pol}


def test_the_promotion_rule() -> None:
    ok, why = ope.promotion_check(_report((-0.30, -0.32), -0.35), "m", "2", "1")
    assert ok and "challenger v2's DR lower bound -0.3200 > champion v1's DR estimate -0.3500" in why
    ok, why = ope.promotion_check(_report((-0.30, -0.36), -0.35), "m", "2", "1")
    assert not ok and "-0.3600 <= champion v1's DR estimate -0.3500" in why
    ok, why = ope.promotion_check(_report((-0.30, -0.36), -0.35), "m", "2", "1", estimator="ips")
    assert not ok and "IPS lower bound" in why
    # no champion in the report (or none at all): the logged mean is the bar
    ok, why = ope.promotion_check(_report((-0.30, -0.36), None, logged=-0.6), "m", "2", "1")
    assert ok and "the logged mean reward (champion v1 is not in the OPE report) -0.6000" in why
    ok, why = ope.promotion_check(_report((-0.30, -0.36), None, logged=-0.2), "m", "2", None)
    assert not ok and "(there is no champion) -0.2000" in why
    # the report must be about this challenger version
    ok, why = ope.promotion_check(_report((-0.30, -0.32), -0.35, ch_version="1"), "m", "2", "1")
    assert not ok and "no estimate of challenger v2 of m" in why and "--policy models:/m@challenger" in why
    ok, why = ope.promotion_check(_report((-0.30, float("nan")), -0.35), "m", "2", "1")
    assert not ok and "undefined" in why
    with pytest.raises(ConfigError, match="--ope-estimator: 'dm' is not one of ips, snips, dr"):
        ope.promotion_check(_report((-0.3, -0.3), None), "m", "2", None, estimator="dm")
    with pytest.raises(ConfigError, match="field 'format'"):
        ope.promotion_check({"policies": {}}, "m", "2", None)


@pytest.fixture()
def mlflow_uri(mlflow_store: str) -> Any:
    """The session's MLflow store as the process-wide tracking URI (conftest restores it after)."""
    import mlflow

    mlflow.set_tracking_uri(mlflow_store)
    return mlflow_store


def _register(uri: str, name: str, routers: list[Path]) -> Any:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    client.create_registered_model(name)
    for d in routers:
        mv = client.create_model_version(name, source=str(d))
        client.set_model_version_tag(name, mv.version, "gate_passed", "True")
        client.set_model_version_tag(name, mv.version, "gate_reason", "gate ok")
    client.set_registered_model_alias(name, "champion", "1")
    client.set_registered_model_alias(name, "challenger", str(len(routers)))
    return client


@pytest.mark.slow
def test_registry_promote_applies_the_ope_rule(mlflow_uri: str, tmp_path: Path) -> None:
    from models import registry

    d = save_router(RouterWeights(layers=[(np.zeros((N_OFFERING_FEATURES + N_REQUEST_FEATURES, 1), np.float32),
                                           np.zeros(1, np.float32))], prior=PRIOR), tmp_path / "r")
    client = _register(mlflow_uri, "ope-rule", [d, d])
    refused = registry.promote("ope-rule", ope=_report((-0.30, -0.36), -0.35, model="ope-rule"))
    assert not refused.promoted and "passed the gate but not the OPE check" in refused.reason
    assert "DR lower bound -0.3600 <= champion v1's DR estimate -0.3500" in refused.reason
    assert str(client.get_model_version_by_alias("ope-rule", "champion").version) == "1"
    done = registry.promote("ope-rule", ope=_report((-0.30, -0.32), -0.35, model="ope-rule"))
    assert done.promoted and "lower bound -0.3200 > champion v1's DR estimate" in done.reason
    assert str(client.get_model_version_by_alias("ope-rule", "champion").version) == "2"


# ------------------------------------------------------------------------------ the commands
def xroute(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xroute_app", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env=env)


def one_line_error(p: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.slow
def test_ope_and_promote_with_registered_routers(mlflow_store: str, tiny_bundle_dir: Path, tmp_path: Path) -> None:
    """A user's path: simulate a log, estimate the registered challenger and champion on it, and
    let promote --ope refuse a challenger that would route worse."""
    d = N_OFFERING_FEATURES + N_REQUEST_FEATURES
    greedy_like = save_router(RouterWeights(layers=[(np.zeros((d, 1), np.float32), np.zeros(1, np.float32))],
                                            prior=PRIOR), tmp_path / "champion")
    w = np.zeros((d, 1), np.float32)
    w[F["exp_latency"], 0] = 1.0  # prefers the slowest offering
    slow = save_router(RouterWeights(layers=[(w, np.zeros(1, np.float32))]), tmp_path / "challenger")
    _register(mlflow_store, "ope-cli", [greedy_like, slow])
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_store}
    log = tmp_path / "log.parquet"
    p = xroute("ope", "simulate", "--telemetry", str(tiny_bundle_dir), "--epsilon", "0.3", "--seeds", "2",
               "--rate-scale", "0.01", "--out", str(log), env=env)
    assert p.returncode == 0 and "wrote 800 decisions" in p.stdout, p.stderr
    out = tmp_path / "ope.json"
    p = xroute("ope", "--log", str(log), "--policy", "models:/ope-cli@challenger", "--policy",
               "models:/ope-cli@champion", "--policy", "greedy", "--policy", "cheapest", "--output", str(out), env=env)
    assert p.returncode == 0, p.stderr
    assert "SNIPS" in p.stdout and "models:/ope-cli@challenger (v2)" in p.stdout
    rep = json.loads(out.read_text())
    assert rep["log"]["decisions"] == 800 and rep["log"]["pending"] == 0
    pol = rep["policies"]
    assert pol["models:/ope-cli@challenger"]["model"] == {"registered_model": "ope-cli", "version": "2",
                                                          "uri": "models:/ope-cli@challenger"}
    assert pol["models:/ope-cli@champion"]["model"]["version"] == "1"
    for name in ("models:/ope-cli@champion", "greedy"):  # the zero network over the prior is greedy
        assert pol[name]["dr"] == pol["models:/ope-cli@champion"]["dr"]
    for r in pol.values():
        assert r["dr"]["ci95"][0] <= r["dr"]["value"] <= r["dr"]["ci95"][1] and 0 < r["ess"] <= 800
    msg = one_line_error(xroute("promote", "--model", "ope-cli", "--ope", str(out), env=env),
                         "promote refused", "not the OPE check", "challenger v2's DR lower bound")
    champ = pol["models:/ope-cli@champion"]["dr"]["value"]
    assert f"<= champion v1's DR estimate {champ:.4f}" in msg
    one_line_error(xroute("promote", "--model", "ope-cli", "--ope", str(out), "--ope-estimator", "mean", env=env),
                   "--ope-estimator: 'mean' is not one of ips, snips, dr")
    one_line_error(xroute("promote", "--model", "ope-cli", "--ope", str(tmp_path / "none.json"), env=env),
                   "--ope: cannot read")


def test_ope_command_errors_are_one_line(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    one_line_error(xroute("ope", "--policy", "greedy"), "--log: required")
    log = tmp_path / "l.jsonl"
    sim = _records(tmp_path, tiny_bundle_dir)
    write_log(log, sim.header, sim.records)
    one_line_error(xroute("ope", "--log", str(log)), "--policy: give at least one")
    one_line_error(xroute("ope", "--log", str(log), "--policy", "round-robin"), "'round-robin' cannot be scored")
    one_line_error(xroute("ope", "--log", str(tmp_path / "missing.parquet"), "--policy", "greedy"), "no such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(log.read_text().replace('"propensity":', '"propensity":-', 1))
    one_line_error(xroute("ope", "--log", str(bad), "--policy", "greedy"), "line 2", "field 'propensity'")
    one_line_error(xroute("ope", "simulate", "--out", str(tmp_path / "x.csv")), "--out", "*.parquet")
    one_line_error(xroute("ope", "simulate", "--telemetry", str(tiny_bundle_dir), "--epsilon", "2", "--out",
                          str(tmp_path / "x.parquet")), "--epsilon: must be in [0, 1]")

