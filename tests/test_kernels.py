"""The compiled kernels (``envs/kernels.py``, ``router/decision/kernels.py``) against plain-numpy
transcriptions of the same formulas, the torch prior against the one expected-reward definition,
and the router's fused decisions against the kernels they fuse."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats

from envs import features as fz
from envs import kernels
from envs.kernels import BUSY, COST, LAT, PVIOL, RISK, SERVICE, TPOT, TTFT, WAIT
from router.decision import kernels as rkernels

REPO = Path(__file__).resolve().parent.parent


def _inputs(rng: np.random.Generator, n: int, deadline: bool, shared: bool = False) -> dict[str, object]:
    slots = rng.integers(0, 9, n)
    return {
        "est_min": np.where(rng.random(n) < 0.3, -np.inf, rng.normal(100.0, 2.0, n)),
        "inflight": rng.integers(0, 12, n).astype(np.int64),
        "inv_replicas": 1.0 / rng.integers(1, 4, n),
        "conc_m1": rng.integers(0, 8, n).astype(float),
        "ext_util_conc": rng.random(n) * 3,
        "inv_prefill": 1.0 / rng.uniform(1e3, 2e4, n),
        "tpot_s": rng.uniform(0.005, 0.05, n),
        "tpot_growth_s": rng.uniform(0.0, 0.01, n),
        "sigma": np.where(rng.random(n) < 0.2, 0.0, rng.uniform(0.02, 0.3, n)),
        "rtt": rng.uniform(1.0, 300.0, n),
        "cost_rate": rng.uniform(1e-5, 1e-3, n),
        "static_ok": rng.random(n) < 0.8,
        "hazard": np.where(rng.random(n) < 0.5, rng.uniform(0, 1e-3, n), 0.0),
        "slots": slots.astype(np.int64),
        "t": 100.0,
        "r_in": float(rng.integers(1, 4000)),
        "est_out": float(rng.uniform(1, 500)),
        "max_out": float(rng.choice([1.0, 512.0])),
        "ttft_ms": float(rng.uniform(200, 3000)),
        "tpot_ms": float(rng.uniform(10, 120)),
        "deadline_ms": float(rng.uniform(2000, 30000)) if deadline else np.nan,
        "queue_timeout_s": 2.0,
        "unseen_s": float(rng.uniform(0, 10)),
        # other routers' work on each pool (router.state.base), with its observed duration or none
        "others": np.where(rng.random(n) < 0.5, rng.integers(0, 30, n), 0).astype(np.int64) if shared
        else np.zeros(n, dtype=np.int64),
        "others_service_s": np.where(rng.random(n) < 0.5, rng.uniform(0.1, 20.0, n), 0.0),
        # the requests running + waiting the pools' inference servers report (-1: none)
        "server_busy": np.where(rng.random(n) < 0.5, rng.uniform(0.0, 40.0, n), -1.0) if shared
        else np.full(n, -1.0),
        # the prompt tokens the router's view expects each pool to hold (envs.prefix), and the session's pool
        "cached": np.zeros(n),
        "session": np.zeros(n),
    }


def _numpy_outcomes(d: dict[str, object]) -> tuple[np.ndarray, np.ndarray, float, float]:
    """The candidate outcomes written in numpy (and scipy's lognormal for the SLO miss)."""
    g = d.__getitem__
    own = g("inflight").astype(np.float64)
    reported = g("server_busy") >= 0
    busy = np.where(reported, np.maximum(own + g("others"), g("server_busy")), own + g("others"))
    k = np.minimum(busy * g("inv_replicas"), g("conc_m1")) + np.where(reported, 0.0, g("ext_util_conc"))
    pf = (g("r_in") - g("cached")) * g("inv_prefill")
    tp = g("tpot_s") + g("tpot_growth_s") * k
    service = pf + g("est_out") * tp
    wait = np.maximum(g("est_min") - g("t"), 0.0)
    # the shared queue of other routers' work: max(0, b - slots + 1) x S / slots, S observed or this service
    slots = g("slots").astype(np.float64)
    s_obs = np.where(g("others_service_s") > 0, g("others_service_s"), service)
    with np.errstate(divide="ignore", invalid="ignore"):
        queue = (busy - slots + 1.0) * s_obs / slots
    wait = np.where((busy >= slots) & (slots > 0), np.maximum(wait, queue), wait)
    ttft = (wait + pf + tp) * 1000.0 + g("rtt")
    lat = (wait + service) * 1000.0 + g("rtt")
    slack = (g("ttft_ms") - g("rtt") - 1000 * wait) / ((pf + tp) * 1000.0)
    if g("max_out") > 1:
        slack = np.minimum(slack, g("tpot_ms") / (tp * 1000.0))
    if np.isfinite(g("deadline_ms")):
        slack = np.minimum(slack, (g("deadline_ms") - g("rtt") - 1000 * wait) / (service * 1000.0))
    sig = g("sigma")
    with np.errstate(divide="ignore", invalid="ignore"):
        p = stats.lognorm.sf(np.maximum(slack, 1e-300), s=np.where(sig > 0, sig, 1.0), scale=np.exp(-0.5 * sig ** 2))
    p = np.where(slack <= 0, 1.0, np.where(sig > 0, p, (slack < 1.0).astype(float)))
    C = np.zeros((kernels.N_OUT, len(wait)))
    C[WAIT], C[BUSY], C[SERVICE], C[TTFT], C[LAT] = wait, busy, service, ttft, lat
    C[TPOT], C[COST] = tp * 1000.0, g("cost_rate") * service
    with np.errstate(invalid="ignore"):
        C[RISK] = np.where(g("hazard") > 0, -np.expm1(-g("hazard") * (g("unseen_s") + wait + service)), 0.0)
    C[PVIOL] = p
    C[kernels.CACHED] = g("cached") / g("r_in")
    C[kernels.SESSION] = g("session")
    mask = g("static_ok") & (wait <= g("queue_timeout_s"))
    bv = np.minimum(busy, g("slots"))
    return C, mask, float(bv @ mask), float(g("slots") @ mask)


def _outcomes(d: dict[str, object]) -> tuple[np.ndarray, np.ndarray, float, float]:
    n = len(d["est_min"])  # type: ignore[arg-type]
    C, mask = np.zeros((kernels.N_OUT, n)), np.zeros(n, dtype=bool)
    bv, sv = kernels.candidate_outcomes_into(C, mask, *d.values())
    return C, mask, bv, sv


@pytest.mark.parametrize("seed", range(8))
def test_candidate_outcomes_equal_numpy(seed: int) -> None:
    """Seeds 4-7 add other routers' work (``others``) and the servers' reported load (``server_busy``)
    on half the pools each: the queue's wait, the batch without the utilization term."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 130))
    d = _inputs(rng, n, deadline=seed % 2 == 1, shared=seed >= 4)
    if seed % 3 == 0:  # some prefix cached on some pools: less prefill there
        d["cached"] = np.where(rng.random(n) < 0.5, rng.uniform(0, d["r_in"], n), 0.0)  # type: ignore[arg-type]
        d["session"] = (rng.random(n) < 0.1).astype(float)
    C, mask, bv, sv = _outcomes(d)
    C2, mask2, bv2, sv2 = _numpy_outcomes(d)
    for row, name in enumerate(("wait", "busy", "service", "ttft", "lat", "tpot", "cost", "risk", "", "cached",
                                "session")):
        if not name:
            continue
        np.testing.assert_allclose(C[row], C2[row], rtol=1e-13, atol=0, err_msg=name)
    np.testing.assert_allclose(C[PVIOL], C2[PVIOL], rtol=1e-9, atol=1e-12, err_msg="pviol")
    # (reported loads are fractional: the kernel's running sum and numpy's dot may differ in the last bit)
    assert mask.tolist() == mask2.tolist() and bv == pytest.approx(bv2, rel=1e-12) and sv == sv2
    if seed >= 4:  # the shared queue did lengthen some waits (so the comparison above covers it)
        assert (C[WAIT] > np.maximum(d["est_min"] - d["t"], 0.0)).any()  # type: ignore[operator]


def test_the_violation_probability_is_the_lognormal_tail() -> None:
    """P(f > c) for f lognormal with mean 1: at c = 1 a bit under one half (the median is below
    the mean), monotone in c, 1 for c <= 0, an indicator for sigma 0."""
    p = [kernels.violation_probability(c, 0.1) for c in (0.5, 0.9, 1.0, 1.1, 2.0)]
    assert p == sorted(p, reverse=True) and 0.45 < p[2] < 0.5 and p[0] > 0.999 and p[-1] < 1e-6
    assert kernels.violation_probability(-1.0, 0.1) == 1.0
    assert (kernels.violation_probability(0.99, 0.0), kernels.violation_probability(1.01, 0.0)) == (1.0, 0.0)
    f = np.exp(np.random.default_rng(0).normal(-0.5 * 0.1 ** 2, 0.1, 400_000))
    assert f.mean() == pytest.approx(1.0, abs=1e-3)
    assert (f > 1.05).mean() == pytest.approx(kernels.violation_probability(1.05, 0.1), abs=3e-3)


def _numpy_expected(cost_n, lat_n, pviol, risk, retry_n, cw, lw, sp, cc, lc):  # type: ignore[no-untyped-def]
    c = np.minimum(cost_n, cc)
    ok = -(cw * c + lw * np.minimum(lat_n, lc)) - sp * pviol
    bad = -(1.5 * cw * c + lw * np.minimum(1.5 * lat_n + retry_n, lc)) - sp
    return (1 - risk) * ok + risk * bad


@pytest.mark.parametrize("seed", range(5))
def test_expected_rewards_equal_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = _inputs(rng, 50, deadline=False)
    C, mask, _, _ = _outcomes(d)
    ref_cost, budget, retry = float(rng.uniform(1e-6, 1e-3)), float(rng.uniform(500, 20000)), 1500.0
    w = (0.6, 0.4, 2.0, 5.0, 3.0)
    got = kernels.expected_rewards(C, mask, ref_cost, budget, retry, *w)
    want = _numpy_expected(C[COST] / ref_cost, C[LAT] / budget, C[PVIOL], C[RISK], retry / budget, *w)
    np.testing.assert_allclose(got[mask], want[mask], rtol=1e-13)
    assert np.all(got[~mask] == -np.inf)


def test_the_torch_prior_is_the_expected_reward() -> None:
    """``models.qnet.SharedScorer.prior_scores`` is a transcription of ``envs.kernels.expected_reward``:
    pinned on random feature rows."""
    import torch as th

    from models.policy import RewardPrior
    from models.qnet import SharedScorer

    rng = np.random.default_rng(3)
    prior = RewardPrior(0.6, 0.4, 2.0, 5.0, 3.0, 1500.0)
    rows = rng.uniform(0, 1, (4, 30, fz.N_OFFERING_FEATURES)).astype(np.float32)
    rows[..., fz.F["exp_cost"]] *= 6  # beyond the cap sometimes
    rows[..., fz.F["exp_latency"]] *= 3
    req = rng.uniform(0.3, 1.2, (4, fz.N_REQUEST_FEATURES)).astype(np.float32)
    torch_s = SharedScorer([8], 0, prior).prior_scores(th.tensor(rows), th.tensor(req)).numpy()
    np_s = prior.scores(rows, req)
    budget = np.maximum(np.expm1(req[:, fz.R["budget"]].astype(np.float64) * 12.0), 1.0)[:, None]
    F = fz.F
    want = _numpy_expected(rows[..., F["exp_cost"]].astype(float), rows[..., F["exp_latency"]].astype(float),
                           rows[..., F["exp_violation"]], rows[..., F["preempt_risk"]], 1500.0 / budget, 0.6, 0.4, 2.0,
                           5.0, 3.0)
    np.testing.assert_allclose(np_s, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(torch_s, np_s, rtol=1e-5, atol=1e-5)


def test_greedy_is_the_prior_on_the_features(shipped_bundle) -> None:  # type: ignore[no-untyped-def]
    """Greedy ranks by ``expected_rewards`` on the raw expectations, the learned router's prior by
    the same function on the (clipped, float32) features: they choose the same offering."""
    from envs.cloud_route import CloudRouteEnv
    from models.policy import RewardPrior

    env = CloudRouteEnv(shipped_bundle, episode_requests=300, rate_scale=4.0)
    prior = RewardPrior.from_env_config(env.cfg)
    obs, info = env.reset(seed=1)
    same = 0
    for _ in range(300):
        r = env.expected_rewards()
        idx = np.flatnonzero(info["action_mask"])
        rows = fz.offering_matrix(obs)[idx]
        p = prior.scores(rows[None], obs["request"][None])[0]
        np.testing.assert_allclose(p, r[idx], rtol=2e-4, atol=2e-4)
        same += int(idx[int(np.argmax(p))] == int(np.argmax(r)))
        obs, _, _, done, info = env.step(int(np.argmax(r)))
        if done:
            break
    assert same >= 295  # float32 rounding may flip a near-tie


@pytest.mark.parametrize("seed", range(5))
def test_realized_reward_equals_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(50):
        cost, ref, lat, budget = rng.uniform(0, 1e-3), rng.uniform(1e-5, 1e-3), rng.uniform(0, 1e5), rng.uniform(1, 1e4)
        viol, failed = bool(rng.random() < 0.3), bool(rng.random() < 0.2)
        got = kernels.realized_reward(cost, ref, lat, budget, viol, failed, 0.6, 0.4, 2.0, 5.0, 3.0, 3.0)
        c = min(cost / ref, 5.0)
        want = -(0.6 * c + 0.4 * 3.0) - 2.0 if failed else -(0.6 * c + 0.4 * min(lat / budget, 3.0)) - 2.0 * viol
        assert got == pytest.approx(want, rel=1e-13)


def test_offering_rows_equal_numpy() -> None:
    rng = np.random.default_rng(0)
    d = _inputs(rng, 40, deadline=False)
    d["cached"] = np.where(rng.random(40) < 0.5, rng.uniform(0, d["r_in"], 40), 0.0)  # type: ignore[arg-type]
    d["session"] = (rng.random(40) < 0.2).astype(float)
    C, mask, _, _ = _outcomes(d)
    n, nf = 40, fz.N_OFFERING_FEATURES
    static = rng.uniform(-1, 1, (n, nf))
    inv_slots = 1.0 / np.maximum(d["slots"], 1)  # type: ignore[call-overload]
    rtt = d["rtt"]
    ttft, tpot, budget, ref = 1500.0, 40.0, 4000.0, 2e-4
    idx = np.sort(rng.choice(n, 25, replace=False)).astype(np.int64)
    out = np.zeros((idx.size, nf), dtype=np.float32)
    kernels.offering_rows(out, idx, static, mask, rtt, C, inv_slots, ttft, tpot, budget, ref)
    m = static.copy()
    F = fz.F
    m[:, F["valid"]] = mask
    m[:, F["rtt"]] = np.minimum(rtt / 300.0, 3.0)  # type: ignore[operator]
    m[:, F["busy"]] = np.minimum(C[BUSY] * inv_slots, 1.0)
    m[:, F["wait"]] = np.minimum(C[WAIT] * 1000.0 / ttft, 3.0)
    m[:, F["preempt_risk"]] = C[RISK]
    m[:, F["exp_latency"]] = np.minimum(C[LAT] / budget, 3.0)
    m[:, F["exp_ttft"]] = np.minimum(C[TTFT] / ttft, 3.0)
    m[:, F["exp_tpot"]] = np.minimum(C[TPOT] / tpot, 3.0)
    m[:, F["exp_cost"]] = np.minimum(C[COST] / ref, 5.0)
    m[:, F["exp_violation"]] = C[PVIOL]
    m[:, F["exp_cached"]] = d["cached"] / d["r_in"]  # type: ignore[operator]
    m[:, F["session_here"]] = d["session"]
    np.testing.assert_allclose(out, m[idx].astype(np.float32), rtol=1e-6)
    assert out[:, F["exp_cached"]].any() and out[:, F["session_here"]].any()


@pytest.mark.parametrize("seed", range(10))
def test_rank_is_a_stable_descending_sort_of_the_valid(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    scores = rng.integers(0, 6, n).astype(float)  # many ties: the lower index must come first
    valid = rng.random(n) < 0.6
    k = int(rng.integers(0, 6))
    best, alts = kernels.rank(scores, valid, k)
    idx = np.flatnonzero(valid)
    order = idx[np.argsort(-scores[idx], kind="stable")]
    if idx.size == 0:
        assert best == -1 and alts.size == 0
    else:
        assert best == int(idx[np.argmax(scores[idx])]) == order[0]
        assert alts.tolist() == order[1:k + 1].tolist()


@pytest.mark.parametrize("seed", range(10))
def test_combine_masks_and_counts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 50
    env_mask, allowed, preferred = rng.random(n) < 0.6, rng.random(n) < 0.7, rng.random(n) < [0.3, 0.0][seed % 2]
    code = rng.integers(0, 4, n).astype(np.int64)
    valid, n_valid, n_not_pref, counts = rkernels.combine(env_mask, allowed, preferred, True, code)
    ok = env_mask & allowed
    pv = ok & preferred
    want = pv if pv.any() else ok
    assert valid.tolist() == want.tolist() and n_valid == int(want.sum())
    assert n_not_pref == (int((ok & ~preferred).sum()) if pv.any() else 0)
    assert counts.tolist() == np.bincount(code[allowed & ~env_mask], minlength=4).tolist()
    v2, n2, np2, _ = rkernels.combine(env_mask, allowed, preferred, False, code)  # no prefer rule
    assert v2.tolist() == ok.tolist() and n2 == int(ok.sum()) and np2 == 0


@pytest.mark.parametrize("seed", range(20))
def test_the_router_view_moves_a_slot_chain_by_each_completion_error(seed: int) -> None:
    """``view_admit`` / ``view_complete``: a request takes the slot expected to free first and
    holds it its expected time; when it completes, everything expected after it on that slot moves
    by its error; the in-flight count follows. Completed in admission order, each used slot ends
    expected free exactly at its last request's real end, whatever the errors were."""
    rng = np.random.default_rng(seed)
    n, smax = 3, 4
    est = np.full((n, smax), -np.inf)
    est[:, 3] = np.inf  # padding: a pool with 3 slots
    est_min, inflight, shift = est.min(axis=1), np.zeros(n, dtype=np.int64), np.zeros((n, smax))
    admitted = []
    t = 0.0
    for _ in range(30):
        t += float(rng.uniform(0, 2))
        a, service = int(rng.integers(0, n)), float(rng.uniform(0.5, 5))
        free = est[a].copy()
        j, end, s0 = kernels.view_admit(est, est_min, inflight, shift, a, t, service)
        assert j == int(np.argmin(free)) and end == max(t, free[j]) + service
        admitted.append((a, j, end, s0, end + float(rng.normal(0, 1))))
    assert inflight.tolist() == np.bincount([x[0] for x in admitted], minlength=n).tolist()
    last: dict[tuple[int, int], float] = {}
    for a, j, end, s0, real in admitted:
        kernels.view_complete(est, est_min, inflight, shift, a, j, real, end, s0)
        last[(a, j)] = real
    assert inflight.sum() == 0
    for a in range(n):
        for j in range(smax):
            want = last.get((a, j), np.inf if j == 3 else -np.inf)
            assert est[a, j] == pytest.approx(want, abs=1e-9), (a, j)
    np.testing.assert_array_equal(est_min, est.min(axis=1))


@pytest.mark.parametrize("seed", range(20))
def test_greedy_decide_is_combine_rewards_and_rank(seed: int) -> None:
    """The router's one-call greedy ranking against the kernels it fuses, called one by one as
    the engine's general path calls them: same choice, alternatives, counts and numbers."""
    rng = np.random.default_rng(seed)
    d = _inputs(rng, int(rng.integers(1, 60)), deadline=False, shared=seed % 2 == 1)
    C, env_mask, _, _ = _outcomes(d)
    n = env_mask.shape[0]
    allowed, preferred = rng.random(n) < [0.8, 0.0][seed % 4 == 3], rng.random(n) < 0.4
    code = rng.integers(0, 4, n).astype(np.int64)
    w = (float(rng.uniform(1e-6, 1e-3)), float(rng.uniform(500, 9000)), 1500.0, 0.6, 0.4, 2.0, 5.0, 3.0)
    k = int(rng.integers(0, 5))
    ints, floats = np.full(7 + k + 2, 99, dtype=np.int64), np.full(3 + 3 * k + 2, 99.0)  # larger than needed
    use_bias = seed % 3 == 0  # the routing policies' prefer weights (envs.policies) added to the rewards
    bias = rng.normal(0.0, 0.2, n) if use_bias else np.zeros(n)
    m = rkernels.greedy_decide(env_mask, allowed, preferred, True, code, C, bias, use_bias, *w, k, ints, floats)
    ints, floats = ints[: 7 + m], floats[: 3 + 3 * m]
    valid, n_valid, n_np, counts = rkernels.combine(env_mask, allowed, preferred, True, code)
    r = kernels.expected_rewards(C, valid, *w) + np.where(valid, bias, 0.0)
    best, alt = kernels.rank(r, valid, k)
    assert ints[:7].tolist() == [best, n_valid, n_np, *counts.tolist()]
    if best < 0:
        assert m == 0
        return
    assert ints[7:].tolist() == alt.tolist()
    chosen = [best, *alt.tolist()]
    assert floats.tolist() == np.column_stack([r[chosen], C[LAT, chosen], C[COST, chosen]]).ravel().tolist()


@pytest.mark.parametrize("seed", range(10))
def test_rank_scored_maps_the_ranking_to_offerings_and_refuses_non_finite_scores(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    idx = np.sort(rng.choice(100, n, replace=False)).astype(np.int64)
    scores = rng.integers(0, 5, n).astype(np.float32)  # ties: the lower offering first
    k = int(rng.integers(0, 5))
    picked, vals = rkernels.rank_scored(scores, idx, k)
    order = np.argsort(-scores, kind="stable")[: k + 1]
    assert picked.tolist() == idx[order].tolist() and vals.tolist() == scores[order].tolist()
    scores[int(rng.integers(0, n))] = [np.nan, np.inf, -np.inf][seed % 3]
    picked, vals = rkernels.rank_scored(scores, idx, k)
    assert picked.size == 0 and vals.size == 0


_CACHED_DECISION = """
import json
import numpy as np
from router.decision import kernels as k
ok = np.ones(3, dtype=np.bool_)
C = np.ones((k.env_kernels.N_OUT, 3))
C[k.env_kernels.COST] = [3e-4, 1e-4, 2e-4]
ints, floats = np.zeros(9, dtype=np.int64), np.zeros(8)
k.greedy_decide(ok, ok, ok, True, np.zeros(3, dtype=np.int64), C, np.zeros(3), False, 1e-4, 1000.0, 1500.0, 0.6, 0.4,
                2.0, 5.0, 3.0, 1, ints, floats)
s = k.greedy_decide.stats
print(json.dumps({"file": k.__file__, "chosen": int(ints[0]), "score": float(floats[0]),
                  "hits": sum(s.cache_hits.values()), "misses": sum(s.cache_misses.values())}))
"""


@pytest.mark.slow
def test_a_router_kernel_is_cached_and_an_edit_of_the_env_kernels_it_compiles_in_recompiles_it(
        tmp_path: Path) -> None:
    """``router.decision.kernels.greedy_decide`` compiles ``envs.kernels``' functions into itself. It is
    cached on disk (before, it was compiled at every start: seconds of each router's start), and
    numba only notices an edit of its own file: so it is keyed by ``envs.kernels.DIGEST`` as well.
    In a copy of the packages, in fresh processes: the second start loads it from the cache with the
    same answer; after an edit of the copy's ``envs/kernels.py`` (every expected reward one less),
    the next start compiles it anew and decides with the edit -- not the stale cached formula."""
    for pkg in ("envs", "xroute"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "router" / "decision").mkdir(parents=True)
    for name in ("__init__.py", "decision/__init__.py", "decision/kernels.py"):
        shutil.copy(REPO / "router" / name, tmp_path / "router" / name)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("NUMBA_CACHE_DIR", None)  # (numba's cache beside the copy's files)

    def start() -> dict[str, Any]:
        r = subprocess.run([sys.executable, "-c", _CACHED_DECISION], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert Path(out["file"]).resolve() == (tmp_path / "router" / "decision" / "kernels.py").resolve()  # the copy's code
        return out

    first, second = start(), start()
    assert (first["misses"], first["hits"]) == (1, 0)
    assert (second["misses"], second["hits"]) == (0, 1)  # loaded, not compiled
    assert (second["chosen"], second["score"]) == (first["chosen"], first["score"])
    source = tmp_path / "envs" / "kernels.py"
    text = source.read_text()
    assert text.count("        out[i] = r\n") == 1
    source.write_text(text.replace("        out[i] = r\n", "        out[i] = r - 1.0\n"))
    edited, again = start(), start()
    assert (edited["misses"], edited["hits"]) == (1, 0)  # compiled anew
    assert edited["chosen"] == first["chosen"] and edited["score"] == pytest.approx(first["score"] - 1.0, abs=1e-12)
    assert (again["misses"], again["hits"]) == (0, 1) and again["score"] == edited["score"]
