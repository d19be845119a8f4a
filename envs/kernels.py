"""The per-request arithmetic of :class:`envs.cloud_route.CloudRouteEnv`, compiled with numba —
and the one definition of the reward and of its one-step expectation.

Each function here is one loop over the offerings doing what would be 15-25 separate numpy calls
on (n,) arrays; at n ~ 100 every numpy call costs ~1 us of dispatch for well under a microsecond
of arithmetic. The environment (training, evaluation) and the router (one call per routed
request) both run these, so the formulas exist once:

* :func:`candidate_outcomes_into` -- what a router can expect of each offering for the current
  request, from what it knows: its own view of each pool (requests in flight, expected slot
  release times), the telemetry, and the request as the client sent it, with the output length
  *estimated* (``envs.estimator``). It is never given a realized outcome.
* :func:`expected_reward` -- the one-step expected reward (greedy's score, the learned router's
  prior, the warm start's baseline); :func:`realized_reward` -- the reward of what happened.
* :func:`exact_outcomes` -- the hindsight oracle's view (realized output, noise, true queues).

Compiled on first use and cached on disk beside this file (``cache=True``).

numba invalidates a cached function when its own file changes, not when a function it calls from
another file does (nor a global constant it read, such as ``envs.features``' layout). So a compiled
function elsewhere that calls these -- ``router.decision.kernels``, ``models.policy`` -- is a closure over
:data:`DIGEST`, the digest of this file and ``envs/features.py``: numba's cache key hashes a
function's closure variables, so an edit here makes a new entry there instead of a stale load
(``tests/test_kernels.py`` edits a copy of this file and checks).
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np
from numba import njit

from envs import features as fz


def source_digest(*files: str | os.PathLike[str]) -> str:
    """A digest of the files' bytes (or, when one cannot be read, a fresh random one: nothing
    cached under it is ever found again, so nothing stale is loaded)."""
    h = hashlib.blake2b(digest_size=16)
    try:
        for f in files:
            h.update(Path(f).read_bytes())
    except OSError:
        return os.urandom(16).hex()
    return h.hexdigest()


#: what a compiled function calling these kernels compiles into itself, as a digest (module docstring)
DIGEST = source_digest(__file__, fz.__file__)

_VALID, _RTT, _BUSY, _WAIT = fz.F["valid"], fz.F["rtt"], fz.F["busy"], fz.F["wait"]
_RISK, _LAT, _COST, _VIOL = fz.F["preempt_risk"], fz.F["exp_latency"], fz.F["exp_cost"], fz.F["exp_violation"]
_TTFT, _TPOT = fz.F["exp_ttft"], fz.F["exp_tpot"]
_CACHED, _SESSION = fz.F["exp_cached"], fz.F["session_here"]
_MAXF = np.finfo(np.float64).max

#: rows of the candidate-outcome matrix ``C`` (float64, (N_OUT, n)); the mask is a separate bool array.
#: CACHED: the expected share of the prompt cached there; SESSION: 1 where the session's last request went
WAIT, BUSY, SERVICE, TTFT, LAT, TPOT, COST, RISK, PVIOL, CACHED, SESSION = range(11)
N_OUT = 11
_SQRT2 = math.sqrt(2.0)


@njit(cache=True)
def violation_probability(c, sigma):  # pragma: no cover
    """P(f > c) for the service-time factor f ~ lognormal with mean 1 and log-sd ``sigma``: the
    request misses its SLO when its service runs more than ``c`` times slower than expected."""
    if c <= 0.0:
        return 1.0
    if sigma <= 0.0:
        return 1.0 if c < 1.0 else 0.0
    return 0.5 * math.erfc((math.log(c) + 0.5 * sigma * sigma) / (sigma * _SQRT2))


@njit(cache=True)
def candidate_outcomes_into(C, mask, est_min, inflight, inv_replicas, conc_m1, ext_util_conc, inv_prefill, tpot_s,
                            tpot_growth_s, sigma, rtt, cost_rate, static_ok, hazard, slots, t, r_in, est_out,
                            max_out, ttft_ms, tpot_ms, deadline_ms, queue_timeout_s, unseen_s, others,
                            others_service_s, server_busy, cached, session):  # pragma: no cover
    """Expected outcome of the current request on every offering, from the router's view, into
    ``C`` (rows ``WAIT`` .. ``PVIOL``) and ``mask``. The arrays are the request's model's pools.

    * in flight: ``b`` = this router's requests not yet seen complete (``inflight``) + ``others``,
      the work other routers (or this one before a restart) hold on the pool in the shared state
      (``router.state.base``); where the pool's inference servers report their load (``server_busy``
      >= 0: requests running + waiting there, ``router.service.scrape``), ``b`` is at least that. Training
      and evaluation pass zeros and -1: ``b`` is the router's own view;
    * wait: until the earliest expected slot release (``est_min``), 0 when one is free; when
      ``b`` fills the pool's slots, at least the queue's ``(b - slots + 1) x S / slots`` -- the
      time for the work ahead to drain at the pool's completion rate ``slots / S`` --, ``S`` the
      pool's observed mean service time (``others_service_s``: a live router's shared state, the
      environment's own completions in training and evaluation; this request's expected service
      where none is observed yet). The expected slot releases alone under-predict a saturated
      pool: a request running past its expected end leaves its slot looking free until its
      completion is seen, and the expected service chains the estimated, not the real, lengths
      (``docs/env.md``, "Admission under load": about 2.5x under before this term applied to the
      router's own work too);
    * batch: ``k`` = requests in flight per replica (at most the other slots) + external load
      (utilization x slots per replica; not where the servers report their load, which includes
      it); time per output token ``tpot(k)``; service = (input - cached)/prefill + est_out x
      tpot(k), ``cached`` the prompt tokens the router's view expects the pool to hold
      (``envs.prefix``; zeros without prefix information), ``session`` 1 where the request's
      session last went (rows ``CACHED``: cached / input, and ``SESSION``);
    * TTFT = RTT + wait + prefill + one token; latency = RTT + wait + service;
    * SLO miss: the service-time factor f (lognormal, mean 1, sigma) exceeds the least slack of
      TTFT, TPOT (requests allowed more than one token) and the deadline (when given);
    * spot preemption: a Poisson ``hazard`` over the wait, the service and ``unseen_s`` -- the
      mean time a preemption goes unseen by the telemetry, during which the pool looks alive.

    Returns (requests in flight on the valid offerings, their slots)."""
    n = est_min.shape[0]
    busy_valid = 0.0
    slots_valid = 0.0
    for i in range(n):
        b = float(inflight[i] + others[i])
        ext = ext_util_conc[i]
        if server_busy[i] >= 0.0:
            ext = 0.0
            if server_busy[i] > b:
                b = server_busy[i]
        k = b * inv_replicas[i]
        if k > conc_m1[i]:
            k = conc_m1[i]
        k += ext
        pf = (r_in - cached[i]) * inv_prefill[i]
        tp = tpot_s[i] + tpot_growth_s[i] * k
        s = pf + est_out * tp
        w = est_min[i] - t
        if w < 0.0:
            w = 0.0
        if b >= slots[i] and slots[i] > 0:
            sv = others_service_s[i] if others_service_s[i] > 0.0 else s
            q = (b - slots[i] + 1.0) * sv / slots[i]
            if q > w:
                w = q
        ttft = (w + pf + tp) * 1000.0 + rtt[i]
        lat = (w + s) * 1000.0 + rtt[i]
        C[WAIT, i] = w
        C[BUSY, i] = b
        C[SERVICE, i] = s
        C[TTFT, i] = ttft
        C[LAT, i] = lat
        C[TPOT, i] = tp * 1000.0
        C[COST, i] = cost_rate[i] * s
        # (no hazard, no risk: 0, also where the wait is infinite -- a pool the model does not fit)
        C[RISK, i] = -np.expm1(-hazard[i] * (unseen_s + w + s)) if hazard[i] > 0.0 else 0.0
        c = (ttft_ms - rtt[i] - w * 1000.0) / ((pf + tp) * 1000.0)
        if max_out > 1.0:
            c2 = tpot_ms / (tp * 1000.0)
            if c2 < c:
                c = c2
        if deadline_ms == deadline_ms:  # given (not NaN)
            c3 = (deadline_ms - rtt[i] - w * 1000.0) / (s * 1000.0)
            if c3 < c:
                c = c3
        C[PVIOL, i] = violation_probability(c, sigma[i])
        C[CACHED, i] = cached[i] / r_in if r_in > 0.0 else 0.0
        C[SESSION, i] = session[i]
        ok = static_ok[i] and w <= queue_timeout_s
        mask[i] = ok
        if ok:
            bb = b if b < slots[i] else float(slots[i])
            busy_valid += bb
            slots_valid += slots[i]
    return busy_valid, slots_valid


@njit(cache=True)
def expected_reward(cost_n, lat_n, pviol, risk, retry_n, cost_weight, latency_weight, sla_penalty, cost_cap,
                    latency_cap):  # pragma: no cover
    """THE one-step expected reward of an offering -- greedy's score, the learned router's prior,
    the warm start's baseline (``models.qnet`` has its torch transcription, pinned to this one by
    ``tests/test_kernels.py``). Inputs are normalized as the reward normalizes them: expected cost
    / the request's reference cost, expected latency / its latency budget, P(SLO miss), P(spot
    preemption during service), retry overhead / budget::

        ok  = -(cost_weight*min(cost_n, cap) + latency_weight*min(lat_n, cap)) - sla_penalty*pviol
        bad = -(1.5*cost_weight*min(cost_n, cap) + latency_weight*min(1.5*lat_n + retry_n, cap)) - sla_penalty
        r   = (1 - risk)*ok + risk*bad

    ``bad`` is a preempted request: on average half its service is lost and paid for, it waits
    the retry overhead, runs again elsewhere, and misses its SLO."""
    c = cost_n if cost_n < cost_cap else cost_cap
    lt = lat_n if lat_n < latency_cap else latency_cap
    ok = -(cost_weight * c + latency_weight * lt) - sla_penalty * pviol
    bl = 1.5 * lat_n + retry_n
    if bl > latency_cap:
        bl = latency_cap
    bad = -(1.5 * cost_weight * c + latency_weight * bl) - sla_penalty
    return (1.0 - risk) * ok + risk * bad


@njit(cache=True)
def expected_rewards(C, mask, ref_cost, budget_ms, retry_ms, cost_weight, latency_weight, sla_penalty, cost_cap,
                     latency_cap):  # pragma: no cover
    """:func:`expected_reward` of every offering from the candidate outcomes; ``-inf`` where
    invalid (NaN -> -1e9 and +-inf -> +-max float, as ``np.nan_to_num``)."""
    n = mask.shape[0]
    out = np.empty(n)
    inv_ref = 1.0 / ref_cost
    inv_b = 1.0 / budget_ms
    retry_n = retry_ms * inv_b
    for i in range(n):
        if not mask[i]:
            out[i] = -np.inf
            continue
        r = expected_reward(C[COST, i] * inv_ref, C[LAT, i] * inv_b, C[PVIOL, i], C[RISK, i], retry_n, cost_weight,
                            latency_weight, sla_penalty, cost_cap, latency_cap)
        if r != r:
            r = -1e9
        elif r == np.inf:
            r = _MAXF
        elif r == -np.inf:
            r = -_MAXF
        out[i] = r
    return out


@njit(cache=True)
def realized_reward(cost, ref_cost, latency_ms, budget_ms, violated, failed, cost_weight, latency_weight, sla_penalty,
                    cost_cap, latency_cap, failure_latency_norm):  # pragma: no cover
    """THE reward of what happened to a request: ``-(cost_weight*min(cost/ref_cost, cap) +
    latency_weight*min(latency/budget, cap)) - sla_penalty*violated``; a failed request is
    charged ``failure_latency_norm`` as its latency term and counts as a violation."""
    c = cost / ref_cost
    if c > cost_cap:
        c = cost_cap
    if failed:
        return -(cost_weight * c + latency_weight * failure_latency_norm) - sla_penalty
    lt = latency_ms / budget_ms
    if lt > latency_cap:
        lt = latency_cap
    return -(cost_weight * c + latency_weight * lt) - (sla_penalty if violated else 0.0)


@njit(cache=True)
def exact_outcomes(free_min, tbusy, inv_replicas, conc_m1, ext_util_conc, inv_prefill, tpot_s, tpot_growth_s, sigma,
                   rtt, cost_rate, mask, t, r_in, r_out, z, ttft_ms, tpot_ms, deadline_ms, ref_cost, budget_ms,
                   cost_weight, latency_weight, sla_penalty, cost_cap, latency_cap, cached):  # pragma: no cover
    """Hindsight (the oracle only): the realized reward of the current request on every valid
    offering, from the true queues (``free_min``: each pool's true earliest slot release,
    ``tbusy``: its true busy slots), the realized output, the noise draw ``z`` and the prompt
    tokens each pool's servers really hold (``cached``, ``envs.prefix.PoolKV``) -- ignoring
    preemptions, which the caller plays out. Also returns the true service end of each."""
    n = free_min.shape[0]
    out = np.full(n, -np.inf)
    end = np.full(n, np.inf)
    for i in range(n):
        if not mask[i]:
            continue
        start = free_min[i] if free_min[i] > t else t
        k = float(tbusy[i]) * inv_replicas[i]
        if k > conc_m1[i]:
            k = conc_m1[i]
        k += ext_util_conc[i]
        f = math.exp(sigma[i] * z - 0.5 * sigma[i] * sigma[i])
        pf = (r_in - cached[i]) * inv_prefill[i] * f
        tp = (tpot_s[i] + tpot_growth_s[i] * k) * f
        s = pf + r_out * tp
        e = start + s
        lat = rtt[i] + 1000.0 * (e - t)
        ttft = rtt[i] + 1000.0 * (start - t + pf + (tp if r_out >= 1.0 else 0.0))
        viol = ttft > ttft_ms or (r_out > 1.0 and tp * 1000.0 > tpot_ms) or \
            (deadline_ms == deadline_ms and lat > deadline_ms)
        out[i] = realized_reward(cost_rate[i] * s, ref_cost, lat, budget_ms, viol, False, cost_weight,
                                 latency_weight, sla_penalty, cost_cap, latency_cap, 0.0)
        end[i] = e
    return out, end


@njit(cache=True)
def offering_rows(out, idx, static_feats, mask, rtt, C, inv_slots, ttft_ms, tpot_ms, budget_ms,
                  ref_cost):  # pragma: no cover
    """Write the observation's offering features of offerings ``idx`` into the rows of ``out``
    (float32, (len(idx), F)): the static block (``static_feats``, the request's model's), then the
    per-request columns from the candidate outcomes ``C``."""
    inv_b = 1.0 / budget_ms
    w_scale = 1000.0 / ttft_ms
    inv_ttft = 1.0 / ttft_ms
    inv_tpot = 1.0 / tpot_ms
    inv_ref = 1.0 / ref_cost
    nf = static_feats.shape[1]
    for r in range(idx.shape[0]):
        i = idx[r]
        for f in range(nf):
            out[r, f] = static_feats[i, f]
        out[r, _VALID] = 1.0 if mask[i] else 0.0
        out[r, _RTT] = min(rtt[i] * (1.0 / 300.0), 3.0)
        out[r, _BUSY] = min(C[BUSY, i] * inv_slots[i], 1.0)
        out[r, _WAIT] = min(C[WAIT, i] * w_scale, 3.0)
        out[r, _RISK] = C[RISK, i]
        out[r, _LAT] = min(C[LAT, i] * inv_b, 3.0)
        out[r, _TTFT] = min(C[TTFT, i] * inv_ttft, 3.0)
        out[r, _TPOT] = min(C[TPOT, i] * inv_tpot, 3.0)
        out[r, _COST] = min(C[COST, i] * inv_ref, 5.0)
        out[r, _VIOL] = C[PVIOL, i]
        out[r, _CACHED] = C[CACHED, i]
        out[r, _SESSION] = C[SESSION, i]


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


# ---------------------------------------------------------------------------------- pool bookkeeping
@njit(cache=True)
def _row_min(row):  # pragma: no cover
    m = row[0]
    for k in range(1, row.shape[0]):
        if row[k] < m:
            m = row[k]
    return m


@njit(cache=True)
def occupy_slot(free_at, row_min, busy, a, j, t, end):  # pragma: no cover
    """The true queue: slot ``j`` of pool ``a`` is taken until ``end``; the pool's busy count grows
    when the slot was free at ``t``, its earliest release is recomputed. In place."""
    row = free_at[a]
    if row[j] <= t:
        busy[a] += 1
    row[j] = end
    row_min[a] = _row_min(row)


@njit(cache=True)
def earliest_slot(free_at, a):  # pragma: no cover
    """The slot of pool ``a`` that frees first (the first such on ties, as ``np.argmin``)."""
    row = free_at[a]
    j = 0
    for k in range(1, row.shape[0]):
        if row[k] < row[j]:
            j = k
    return j


@njit(cache=True)
def view_admit(est_free, est_min, inflight, shift, a, t, service):  # pragma: no cover
    """The router's view: a request sent to pool ``a`` at ``t`` is expected to take the slot it
    expects to free first and hold it ``service`` seconds (its expected service time). Returns
    (that slot, the expected release, the slot's cumulative correction now -- hand both back to
    :func:`view_complete`)."""
    j = earliest_slot(est_free, a)
    row = est_free[a]
    start = row[j] if row[j] > t else t
    end = start + service
    row[j] = end
    est_min[a] = _row_min(row)
    inflight[a] += 1
    return j, end, shift[a, j]


@njit(cache=True)
def view_complete(est_free, est_min, inflight, shift, a, j, now, expected_end, shift0):  # pragma: no cover
    """The router learns that a request admitted by :func:`view_admit` (slot ``j``, expected to end
    at ``expected_end`` when the slot's correction was ``shift0``) completed at ``now``: everything
    expected on that slot after it moves by the error, and the pool has one request less."""
    delta = now - (expected_end + shift[a, j] - shift0)
    est_free[a, j] += delta
    shift[a, j] += delta
    est_min[a] = _row_min(est_free[a])
    inflight[a] -= 1


def warm_up() -> None:
    """Compile (or load from the cache) every kernel now rather than on the first request."""
    n = 2
    f = np.ones(n)
    b = np.zeros(n, dtype=np.int64)
    ok = np.ones(n, dtype=np.bool_)
    C = np.zeros((N_OUT, n))
    mask = np.zeros(n, dtype=np.bool_)
    candidate_outcomes_into(C, mask, f, b, f, f, f, f, f, f, f, f, f, ok, f, b, 0.0, 1.0, 1.0, 2.0, 1.0, 1.0,
                            np.nan, 1.0, 0.0, b, f, -f, 0 * f, 0 * f)
    expected_rewards(C, mask, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    expected_reward(1.0, 1.0, 0.5, 0.1, 0.1, 1.0, 1.0, 1.0, 5.0, 3.0)
    expected_reward(np.float32(1.0), np.float32(1.0), np.float32(0.5), np.float32(0.1), np.float32(0.1),
                    1.0, 1.0, 1.0, 5.0, 3.0)
    realized_reward(1.0, 1.0, 1.0, 1.0, False, False, 1.0, 1.0, 1.0, 5.0, 3.0, 3.0)
    exact_outcomes(f, b, f, f, f, f, f, f, f, f, f, ok, 0.0, 1.0, 2.0, 0.0, 1.0, 1.0, np.nan, 1.0, 1.0, 1.0, 1.0,
                   1.0, 5.0, 3.0, 0 * f)
    out = np.zeros((n, fz.N_OFFERING_FEATURES), dtype=np.float32)
    offering_rows(out, np.arange(n), np.zeros((n, fz.N_OFFERING_FEATURES)), mask, f, C, f, 1.0, 1.0, 1.0, 1.0)
    rank(f, ok, 1)
    rank(f.astype(np.float32), ok, 1)  # a learned scorer's scores
    fa, rm, bz = np.zeros((n, 2)), np.zeros(n), np.zeros(n, dtype=np.int64)
    occupy_slot(fa, rm, bz, 0, 1, 0.0, 1.0)
    earliest_slot(fa, 0)
    j, e, s0 = view_admit(fa, rm, bz, np.zeros((n, 2)), 0, 0.0, 1.0)
    view_complete(fa, rm, bz, np.zeros((n, 2)), 0, j, 1.0, e, s0)
