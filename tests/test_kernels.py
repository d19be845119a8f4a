"""The compiled kernels (``envs/kernels.py``, ``router/kernels.py``) against plain-numpy
transcriptions of the same formulas (the environment's implementation before it was compiled)."""

from __future__ import annotations

import numpy as np
import pytest

from envs import features as fz
from envs import kernels
from router import kernels as rkernels


def _inputs(rng: np.random.Generator, n: int) -> dict[str, object]:
    slots = rng.integers(0, 9, n)
    return {
        "row_min": np.where(rng.random(n) < 0.3, -np.inf, rng.normal(100.0, 2.0, n)),
        "busy_i": rng.integers(0, 9, n).astype(np.int64),
        "inv_replicas": 1.0 / rng.integers(1, 4, n),
        "conc_m1": rng.integers(0, 8, n).astype(float),
        "ext_util_conc": rng.random(n) * 3,
        "inv_prefill": 1.0 / rng.uniform(1e3, 2e4, n),
        "tpot_s": rng.uniform(0.005, 0.05, n),
        "tpot_growth_s": rng.uniform(0.0, 0.01, n),
        "rtt": rng.uniform(1.0, 300.0, n),
        "cost_rate": rng.uniform(1e-5, 1e-3, n),
        "static_ok": rng.random(n) < 0.8,
        "hazard": np.where(rng.random(n) < 0.5, rng.uniform(0, 1e-3, n), 0.0),
        "slots": slots.astype(np.int64),
        "t": 100.0,
        "r_in": float(rng.integers(1, 4000)),
        "r_out": float(rng.integers(1, 500)),
        "queue_timeout_s": 2.0,
    }


def _numpy_outcomes(d: dict[str, object]) -> tuple[np.ndarray, ...]:
    """``CloudRouteEnv._set_request`` as it was written in numpy."""
    g = d.__getitem__
    wait = np.maximum(g("row_min") - g("t"), 0.0)
    busy = g("busy_i").astype(np.float64)
    k = np.minimum(busy * g("inv_replicas"), g("conc_m1")) + g("ext_util_conc")
    service = g("r_in") * g("inv_prefill") + g("r_out") * (g("tpot_s") + g("tpot_growth_s") * k)
    lat = (wait + service) * 1000.0 + g("rtt")
    cost = g("cost_rate") * service
    mask = g("static_ok") & (wait <= g("queue_timeout_s"))
    risk = -np.expm1(-g("hazard") * (wait + service))
    return wait, busy, service, lat, cost, mask, risk, float(busy @ mask), float(g("slots") @ mask)


@pytest.mark.parametrize("seed", range(5))
def test_candidate_outcomes_equal_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = _inputs(rng, int(rng.integers(1, 130)))
    got = kernels.candidate_outcomes(*d.values())
    want = _numpy_outcomes(d)
    for name, a, b in zip(("wait", "busy", "service", "lat", "cost", "mask", "risk", "busy_valid", "slots_valid"),
                          got, want):
        np.testing.assert_allclose(a, b, rtol=1e-15, atol=0, err_msg=name)


def _numpy_rewards(lat, cost, service, risk, mask, sla, ref_cost, cw, lw, sp, cc, lc, retry):  # type: ignore[no-untyped-def]
    """``CloudRouteEnv.expected_rewards`` as it was written in numpy."""
    cost_n = np.minimum(cost / ref_cost, cc)
    lat_n = np.minimum(lat / sla, lc)
    ok = -(cw * cost_n + lw * lat_n) - sp * (lat > sla)
    bad_lat = np.minimum((lat + retry + 500.0 * service) / sla, lc)
    bad = -(cw * 1.5 * cost_n + lw * bad_lat) - sp
    r = (1.0 - risk) * ok + risk * bad
    return np.where(mask, np.nan_to_num(r, nan=-1e9), -np.inf)


@pytest.mark.parametrize("seed", range(5))
def test_expected_rewards_equal_numpy(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 130))
    lat = rng.uniform(10, 20000, n)
    lat[0] = np.nan  # a NaN expectation becomes -1e9, as np.nan_to_num
    args = (lat, rng.uniform(0, 1e-3, n), rng.uniform(0.01, 30, n), rng.random(n), rng.random(n) < 0.7,
            float(rng.uniform(500, 8000)), 1e-4, 1.0, 1.0, 2.0, 10.0, 3.0, 1000.0)
    got = kernels.expected_rewards(*args)
    want = _numpy_rewards(*args)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)


def test_offering_rows_equal_numpy() -> None:
    rng = np.random.default_rng(3)
    n, nf = 40, fz.N_OFFERING_FEATURES
    static = rng.random((n, nf))
    mask = rng.random(n) < 0.6
    rtt, busy, inv_slots = rng.uniform(1, 1200, n), rng.integers(0, 8, n).astype(float), 1.0 / rng.integers(1, 9, n)
    wait, risk, lat, cost = rng.uniform(0, 30, n), rng.random(n), rng.uniform(10, 30000, n), rng.uniform(0, 1e-2, n)
    sla, ref_cost = 4000.0, 1e-4
    idx = np.flatnonzero(mask)
    out = np.full((idx.size, nf), -7.0, dtype=np.float32)
    kernels.offering_rows(out, idx, static, mask, rtt, busy, inv_slots, wait, risk, lat, cost, sla, ref_cost)
    m = static.astype(np.float32)  # the environment's _obs, column by column
    m[:, fz.F["valid"]] = mask
    m[:, fz.F["rtt"]] = np.minimum(rtt * (1.0 / 300.0), 3.0)
    m[:, fz.F["busy"]] = busy * inv_slots
    m[:, fz.F["wait"]] = np.minimum(wait * (1000.0 * (1.0 / sla)), 3.0)
    m[:, fz.F["preempt_risk"]] = risk
    m[:, fz.F["exp_latency"]] = np.minimum(lat * (1.0 / sla), 3.0)
    m[:, fz.F["exp_cost"]] = np.minimum(cost * (1.0 / ref_cost), 5.0)
    m[:, fz.F["exp_violation"]] = lat > sla
    np.testing.assert_array_equal(out, m[idx])


@pytest.mark.parametrize("seed", range(20))
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
def test_occupy_takes_the_earliest_free_slot_as_the_numpy_version(seed: int) -> None:
    """``occupy`` against ``commit_live`` as written in numpy: ``np.argmin`` of the pool's slots
    (first on ties), start at max(now, that slot's release), busy +1 only for a slot free now, the
    pool's earliest release recomputed."""
    rng = np.random.default_rng(seed)
    n, smax = 6, 5
    free_at = np.where(rng.random((n, smax)) < 0.3, -np.inf, np.round(rng.normal(100.0, 2.0, (n, smax))))
    free_at[:, 4] = np.inf  # a pool with fewer slots than the widest
    t = 100.0
    busy = (free_at > t).sum(axis=1) - 1
    row_min = free_at.min(axis=1)
    a, service = int(rng.integers(0, n)), float(rng.uniform(0.1, 5.0))
    fa, b = free_at.copy(), busy.copy()
    j = int(np.argmin(fa[a]))
    end = max(t, fa[a, j]) + service
    if fa[a, j] <= t:
        b[a] += 1
    fa[a, j] = end
    got_j, got_end = kernels.occupy(free_at, row_min, busy, a, t, service)
    assert (got_j, got_end) == (j, end)
    np.testing.assert_array_equal(free_at, fa)
    np.testing.assert_array_equal(busy, b)
    np.testing.assert_array_equal(row_min, fa.min(axis=1))


@pytest.mark.parametrize("seed", range(20))
def test_greedy_decide_is_combine_rewards_rank_and_occupy(seed: int) -> None:
    """The router's one-call greedy decision against the kernels it fuses, called one by one as
    the engine's general path calls them: same choice, alternatives, counts and numbers, and the
    same slot taken (nothing taken when no offering is valid)."""
    rng = np.random.default_rng(seed)
    d = _inputs(rng, int(rng.integers(1, 60)))
    wait, busy, service, lat, cost, env_mask, risk, _, _ = kernels.candidate_outcomes(*d.values())
    n = lat.shape[0]
    allowed, preferred = rng.random(n) < [0.8, 0.0][seed % 4 == 3], rng.random(n) < 0.4
    code = rng.integers(0, 4, n).astype(np.int64)
    rw = (float(rng.uniform(1e-6, 1e-3)), 1.0, 0.5, 5.0, 3.0, 2.0, 500.0)  # sla_ms after ref_cost
    sla = float(rng.uniform(100.0, 5000.0))
    k = int(rng.integers(0, 5))
    smax = 4
    free_at = np.where(rng.random((n, smax)) < 0.5, -np.inf, rng.normal(100.0, 2.0, (n, smax)))
    row_min, busy_i = free_at.min(axis=1), (free_at > 100.0).sum(axis=1).astype(np.int64)
    fa, rm, bi = free_at.copy(), row_min.copy(), busy_i.copy()
    ints, floats = np.full(8 + k + 2, 99, dtype=np.int64), np.full(4 + 3 * k + 2, 99.0)  # larger than needed
    m = rkernels.greedy_decide(env_mask, allowed, preferred, True, code, lat, cost, service, risk, sla,
                               rw[0], *rw[1:], k, free_at, row_min, busy_i, 100.0, ints, floats)
    ints, floats = ints[: 8 + m], floats[: 4 + 3 * m]
    valid, n_valid, n_np, counts = rkernels.combine(env_mask, allowed, preferred, True, code)
    r = kernels.expected_rewards(lat, cost, service, risk, env_mask, sla, *rw)
    best, alt = kernels.rank(r, valid, k)
    assert ints[:7].tolist() == [best, n_valid, n_np, *counts.tolist()]
    if best < 0:
        assert ints[7] == -1 and ints[8:].size == 0
        assert np.array_equal(free_at, fa) and np.array_equal(busy_i, bi)
        return
    j, end = kernels.occupy(fa, rm, bi, best, 100.0, service[best])
    assert (ints[7], floats[0]) == (j, end) and ints[8:].tolist() == alt.tolist()
    chosen = [best, *alt.tolist()]
    assert floats[1:].tolist() == np.column_stack([r[chosen], lat[chosen], cost[chosen]]).ravel().tolist()
    for got, want in ((free_at, fa), (row_min, rm), (busy_i, bi)):
        np.testing.assert_array_equal(got, want)


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
