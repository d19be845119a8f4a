"""The per-request arithmetic of :class:`envs.cloud_route.CloudRouteEnv`, compiled with numba.

Each function here is one loop over the offerings doing what used to be 15-25 separate numpy
calls on (n,) arrays. At n ~ 100 every numpy call costs ~1 us of dispatch for well under a
microsecond of arithmetic, so one compiled pass is several times faster; the environment (training,
evaluation) and the router (one call per routed request) both run these, so the formulas exist
once. The loops keep numpy's operation order, so the results are the same floats numpy gave
(``tests/test_kernels.py`` checks them against a plain-numpy transcription of the formulas).

Compiled on first use and cached on disk beside this file (``cache=True``): the first process
after a change pays ~2 s of compilation, later ones load the machine code in milliseconds.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from envs import features as fz

_VALID, _RTT, _BUSY, _WAIT = fz.F["valid"], fz.F["rtt"], fz.F["busy"], fz.F["wait"]
_RISK, _LAT, _COST, _VIOL = fz.F["preempt_risk"], fz.F["exp_latency"], fz.F["exp_cost"], fz.F["exp_violation"]
_MAXF = np.finfo(np.float64).max


@njit(cache=True)
def candidate_outcomes(row_min, busy_i, inv_replicas, conc_m1, ext_util_conc, inv_prefill, tpot_s, tpot_growth_s,
                       rtt, cost_rate, static_ok, hazard, slots, t, r_in, r_out, queue_timeout_s):  # pragma: no cover
    """Expected outcome of the current request on every offering (``CloudRouteEnv._set_request``):
    (wait s, busy slots, service s, latency ms, cost USD, valid, preemption risk, busy slots of the
    valid offerings, slots of the valid offerings)."""
    n = row_min.shape[0]
    wait = np.empty(n)
    busy = np.empty(n)
    service = np.empty(n)
    lat = np.empty(n)
    cost = np.empty(n)
    mask = np.empty(n, dtype=np.bool_)
    risk = np.empty(n)
    busy_valid, slots_valid = candidate_outcomes_into(
        wait, busy, service, lat, cost, mask, risk, row_min, busy_i, inv_replicas, conc_m1, ext_util_conc,
        inv_prefill, tpot_s, tpot_growth_s, rtt, cost_rate, static_ok, hazard, slots, t, r_in, r_out, queue_timeout_s)
    return wait, busy, service, lat, cost, mask, risk, busy_valid, slots_valid


@njit(cache=True)
def candidate_outcomes_into(wait, busy, service, lat, cost, mask, risk, row_min, busy_i, inv_replicas, conc_m1,
                            ext_util_conc, inv_prefill, tpot_s, tpot_growth_s, rtt, cost_rate, static_ok, hazard,
                            slots, t, r_in, r_out, queue_timeout_s):  # pragma: no cover
    """:func:`candidate_outcomes` written into the seven given arrays (the router reuses one set:
    returning new arrays costs ~0.3 us each to box); returns (busy slots of the valid offerings,
    slots of the valid offerings)."""
    n = row_min.shape[0]
    busy_valid = 0.0
    slots_valid = 0.0
    for i in range(n):
        w = row_min[i] - t
        if w < 0.0:
            w = 0.0
        b = float(busy_i[i])
        k = b * inv_replicas[i]
        if k > conc_m1[i]:
            k = conc_m1[i]
        k += ext_util_conc[i]
        s = r_in * inv_prefill[i] + r_out * (tpot_s[i] + tpot_growth_s[i] * k)
        wait[i] = w
        busy[i] = b
        service[i] = s
        lat[i] = (w + s) * 1000.0 + rtt[i]
        cost[i] = cost_rate[i] * s
        ok = static_ok[i] and w <= queue_timeout_s
        mask[i] = ok
        risk[i] = -np.expm1(-hazard[i] * (w + s))
        if ok:
            busy_valid += b
            slots_valid += slots[i]
    return busy_valid, slots_valid


@njit(cache=True)
def expected_rewards(lat, cost, service, risk, mask, sla, ref_cost, cost_weight, latency_weight, sla_penalty,
                     cost_cap, latency_cap, retry_ms):  # pragma: no cover
    """``CloudRouteEnv.expected_rewards``: the one-step expected reward of each offering, ``-inf``
    where invalid (NaN -> -1e9 and +-inf -> +-max float, as ``np.nan_to_num``)."""
    n = lat.shape[0]
    out = np.empty(n)
    cw15 = cost_weight * 1.5
    for i in range(n):
        if not mask[i]:
            out[i] = -np.inf
            continue
        cost_n = cost[i] / ref_cost
        if cost_n > cost_cap:
            cost_n = cost_cap
        lat_n = lat[i] / sla
        if lat_n > latency_cap:
            lat_n = latency_cap
        ok = -(cost_weight * cost_n + latency_weight * lat_n) - (sla_penalty if lat[i] > sla else 0.0)
        bad_lat = (lat[i] + retry_ms + 500.0 * service[i]) / sla
        if bad_lat > latency_cap:
            bad_lat = latency_cap
        bad = -(cw15 * cost_n + latency_weight * bad_lat) - sla_penalty
        r = (1.0 - risk[i]) * ok + risk[i] * bad
        if r != r:
            r = -1e9
        elif r == np.inf:
            r = _MAXF
        elif r == -np.inf:
            r = -_MAXF
        out[i] = r
    return out


@njit(cache=True)
def offering_rows(out, idx, static_feats, mask, rtt, busy, inv_slots, wait, risk, lat, cost, sla,
                  ref_cost):  # pragma: no cover
    """Write the observation's offering features of offerings ``idx`` into the rows of ``out``
    (float32, (len(idx), F)): the static block, then the per-request columns."""
    inv_sla = 1.0 / sla
    w_scale = 1000.0 * inv_sla
    inv_ref = 1.0 / ref_cost
    nf = static_feats.shape[1]
    for r in range(idx.shape[0]):
        i = idx[r]
        for f in range(nf):
            out[r, f] = static_feats[i, f]
        out[r, _VALID] = 1.0 if mask[i] else 0.0
        out[r, _RTT] = min(rtt[i] * (1.0 / 300.0), 3.0)
        out[r, _BUSY] = busy[i] * inv_slots[i]
        out[r, _WAIT] = min(wait[i] * w_scale, 3.0)
        out[r, _RISK] = risk[i]
        out[r, _LAT] = min(lat[i] * inv_sla, 3.0)
        out[r, _COST] = min(cost[i] * inv_ref, 5.0)
        out[r, _VIOL] = 1.0 if lat[i] > sla else 0.0


@njit(cache=True)
def rank(scores, valid, k):  # pragma: no cover
    """The best valid offering and the next ``k`` (indices into ``scores``, best first; ties go to
    the lower index, as ``np.argmax`` and a stable sort). ``best`` is -1 when nothing is valid."""
    top = np.full(k + 1, -1, dtype=np.int64)
    m = 0
    for i in range(scores.shape[0]):
        if not valid[i]:
            continue
        s = scores[i]
        j = m
        while j > 0 and scores[top[j - 1]] < s:
            j -= 1
        if j <= k:
            last = m if m <= k else k
            while last > j:
                top[last] = top[last - 1]
                last -= 1
            top[j] = i
            if m <= k:
                m += 1
    return top[0], top[1:m].copy()


@njit(cache=True)
def occupy_slot(free_at, row_min, busy, a, j, t, end):  # pragma: no cover
    """Slot ``j`` of pool ``a`` is taken until ``end`` (``CloudRouteEnv._occupy``): the pool's busy
    count grows when the slot was free at ``t``, its earliest release is recomputed. In place."""
    row = free_at[a]
    if row[j] <= t:
        busy[a] += 1
    row[j] = end
    m = row[0]
    for k in range(1, row.shape[0]):
        if row[k] < m:
            m = row[k]
    row_min[a] = m


@njit(cache=True)
def occupy(free_at, row_min, busy, a, t, service):  # pragma: no cover
    """Send a request to offering ``a`` at time ``t`` for ``service`` seconds: it takes the slot
    that frees first (``CloudRouteEnv.commit_live``; the first such slot on ties, as ``np.argmin``)
    through :func:`occupy_slot`. Returns (slot, the time it ends)."""
    row = free_at[a]
    j = 0
    for k in range(1, row.shape[0]):
        if row[k] < row[j]:
            j = k
    end = (row[j] if row[j] > t else t) + service
    occupy_slot(free_at, row_min, busy, a, j, t, end)
    return j, end


def warm_up() -> None:
    """Compile (or load from the cache) every kernel now rather than on the first request."""
    n = 2
    f = np.ones(n)
    b = np.zeros(n, dtype=np.int64)
    ok = np.ones(n, dtype=np.bool_)
    wait, busy, service, lat, cost, mask, risk, _, _ = candidate_outcomes(
        f, b, f, f, f, f, f, f, f, f, ok, f, b, 0.0, 1.0, 1.0, 1.0)
    candidate_outcomes_into(wait, busy, service, lat, cost, mask, risk, f, b, f, f, f, f, f, f, f, f, ok, f, b, 0.0,
                            1.0, 1.0, 1.0)
    expected_rewards(lat, cost, service, risk, mask, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    out = np.zeros((n, fz.N_OFFERING_FEATURES), dtype=np.float32)
    offering_rows(out, np.arange(n), np.zeros((n, fz.N_OFFERING_FEATURES)), mask, f, busy, f, wait, risk, lat, cost,
                  1.0, 1.0)
    rank(f, ok, 1)
    rank(f.astype(np.float32), ok, 1)  # a learned scorer's scores
    occupy(np.zeros((n, 2)), np.zeros(n), np.zeros(n, dtype=np.int64), 0, 0.0, 1.0)
    occupy_slot(np.zeros((n, 2)), np.zeros(n), np.zeros(n, dtype=np.int64), 0, 1, 0.0, 1.0)
