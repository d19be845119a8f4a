"""The per-request arithmetic of the provisioning world (:mod:`envs.provisioning`), compiled with numba.

The world holds *instances* (rows) per pool; each instance carries ``per_inst`` replicas of its pool's
model with ``conc`` request slots each. This module places the requests of a replayed stream on the
instances that exist, one request at a time, in arrival order:

* **the router** (what a router knows when it decides): per pool, the instances that accept work
  (ready, not draining, no spot notice), the requests it sent there and has not seen complete, the
  request as the client sent it and its output length *estimated* from past completions. It scores
  every pool with the routing environment's own one-step expectation
  (``envs.kernels.expected_reward``, ``envs.kernels.violation_probability``: the same arithmetic as
  ``envs.kernels.candidate_outcomes_into``'s wait, batch, TTFT, TPOT and P(miss)) with the cost term
  at zero -- a held instance costs the same whether a request runs on it or not -- and the spot
  pools' decision-time preemption risk; greedy takes the best (:func:`route`);
* **the truth** (what happens): inside the chosen pool the request takes the slot that frees first
  on the instance whose slot frees first (the pool's own load balancer); its service is
  ``prefill/prefill_tok_s + output x tpot(k)`` with ``k`` the requests already on that instance's
  replicas, times its lognormal noise draw -- the routing environment's service model
  (``docs/env.md``, "Pools, batching, queueing").

A pool whose expected wait (the router's view) is longer than ``queue_timeout_s`` is full, as in
``xroute/CloudRoute-v0``; a request that finds every pool of its model full, or none taking work,
waits in the router's queue (first come, first served) and is placed as soon as a completion or a
new instance makes room: none is ever dropped. A completion becomes known to the router at its true end (a
heap of ends), which is when the output estimator learns its length.

Layout: pools, instances (rows), slots and requests live in a few float64 / int64 matrices whose row
indices are the module's ``PF_*``, ``PI_*``, ``RF_*``, ``RI_*``, ``QF_*``, ``QI_*`` constants (a
handful of arguments per call rather than fifty). ``S`` holds every slot's release time; a row's
``per_inst x conc`` slots are kept sorted (ascending) in a ring that starts at its ``RI_HEAD``: the slot
that frees first is the head, a placement moves the head on and inserts its end among the few
releases after it -- the same releases as a scan over the slots, without the scan (a placement
reads and writes slots only through the ring, and no other code reads ``S``). Every function that compiles the routing
environment's kernels into itself is a closure over ``envs.kernels.DIGEST`` (``router/kernels.py``
explains why): an edit of ``envs/kernels.py`` is a new cache entry here, not a stale load.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

from envs import kernels as env_kernels

# pool float rows (PF_WORK: the integral over time of the router's requests in flight there -- sent, not seen
# complete --, up to PF_LAST: what an autoscaler's concurrency metric averages)
# (PF_SURE: the slack above which a miss is certain not to happen -- P(miss) below 1e-30 -- so the router skips its erfc)
PF_INV_PREFILL, PF_TPOT, PF_GROWTH, PF_SIGMA, PF_HAZARD, PF_PER_INST, PF_CONC, PF_WORK, PF_LAST, PF_SURE = range(10)
N_PF = 10
# pool int rows: model, first row, rows that ever held an instance in the window (from the first: rows are taken
# lowest first), slots per instance, instances accepting work, requests in flight (router's)
PI_MODEL, PI_ROW0, PI_NROWS, PI_SLOTS, PI_READY, PI_INFLIGHT = range(6)
N_PI = 6
# row (instance) float rows: launched (billed from), ready at, terminated at (inf: alive), earliest slot release,
# busy until (some request running), busy seconds (union of its requests' service)
RF_LAUNCH, RF_READY, RF_END, RF_MIN, RF_BUSY_UNTIL, RF_BUSY_S = range(6)
N_RF = 6
# row int rows: pool, state, first slot, requests served, the head of its slots' ring (below)
RI_POOL, RI_STATE, RI_SLOT0, RI_SERVED, RI_HEAD = range(5)
N_RI = 5
#: instance states
EMPTY, LAUNCHING, READY, DRAINING, NOTICED = 0, 1, 2, 3, 4
# request float rows: arrival, input, realized output, SLO ttft/tpot/deadline (ms), noise draw, max output, RTT of
# its origin to the pool it ran on last (ms), first token at, end at, start at (current attempt), prefill s and time
# per token of the current attempt, estimated output when it was placed
(QF_T, QF_IN, QF_OUT, QF_TTFT, QF_TPOT, QF_DEADLINE, QF_Z, QF_MAXOUT, QF_RTT, QF_FIRST, QF_END, QF_START, QF_PF,
 QF_TP, QF_EST) = range(15)
N_QF = 15
# request int rows: origin, estimator key, model, pool, row, state, migrations
QI_ORIGIN, QI_KEY, QI_MODEL, QI_POOL, QI_ROW, QI_STATE, QI_MIGR = range(7)
N_QI = 7
#: request states
Q_PENDING, Q_RUNNING, Q_DONE, Q_BACKLOG = 0, 1, 2, 3
# counters (int64): next arrival, heap size, the router's queue (head, tail), requests in the window, requests
# that ever waited in the router's queue
C_NEXT, C_HEAP, C_BHEAD, C_BTAIL, C_N, C_QUEUED = range(6)
N_C = 6
# parameters (float64): reward weights and caps, retry overhead, the estimator's decay, shrinkage, prior fraction
# (P_QTIMEOUT: a pool whose expected wait is longer is full: the request waits in the router's queue instead)
(P_COST_W, P_LAT_W, P_SLA_PEN, P_COST_CAP, P_LAT_CAP, P_RETRY_MS, P_DECAY, P_SHRINK, P_PRIOR, P_QTIMEOUT) = range(10)
N_P = 10


@njit(cache=True, inline='always')
def _heap_push(ht, hi, ctr, t, i):  # pragma: no cover
    n = ctr[C_HEAP]
    ht[n] = t
    hi[n] = i
    ctr[C_HEAP] = n + 1
    while n > 0:
        parent = (n - 1) >> 1
        if ht[parent] <= ht[n]:
            break
        ht[parent], ht[n] = ht[n], ht[parent]
        hi[parent], hi[n] = hi[n], hi[parent]
        n = parent


@njit(cache=True, inline='always')
def _heap_pop(ht, hi, ctr):  # pragma: no cover
    n = ctr[C_HEAP] - 1
    t, i = ht[0], hi[0]
    ht[0], hi[0] = ht[n], hi[n]
    ctr[C_HEAP] = n
    k = 0
    while True:
        a = 2 * k + 1
        if a >= n:
            break
        b = a + 1
        c = b if b < n and ht[b] < ht[a] else a
        if ht[k] <= ht[c]:
            break
        ht[k], ht[c] = ht[c], ht[k]
        hi[k], hi[c] = hi[c], hi[k]
        k = c
    return t, i


@njit(cache=True, inline='always')
def in_flight_changes(PF, PI, p, now):  # pragma: no cover
    """Integrate pool ``p``'s requests in flight up to ``now``, before the count changes."""
    last = PF[PF_LAST, p]
    if now > last:
        PF[PF_WORK, p] += PI[PI_INFLIGHT, p] * (now - last)
        PF[PF_LAST, p] = now


@njit(cache=True, inline='always')
def _estimate(est, key, parent, cap, shrink, prior_fraction):  # pragma: no cover
    """The output estimate of a request: its key's decayed mean of completed outputs, shrunk toward
    its model's (``shrink`` pseudo-observations), itself shrunk toward ``prior_fraction x cap``
    (``envs.estimator``'s shrinkage, on decayed means)."""
    prior = prior_fraction * cap
    wp = est[0, parent]
    e_parent = (est[1, parent] + shrink * prior) / (wp + shrink) if wp + shrink > 0.0 else prior
    wk = est[0, key]
    e = (est[1, key] + shrink * e_parent) / (wk + shrink) if wk + shrink > 0.0 else e_parent
    return e if e < cap else cap


@njit(cache=True, inline='always')
def slo_missed(QF, i):  # pragma: no cover
    """1.0 when request ``i`` (placed) misses its SLO: TTFT above ``ttft_ms``, the time per output
    token after the first above ``tpot_ms`` (vLLM's definition: (latency - TTFT) / (output - 1)), or
    latency above its deadline; both times count the RTT of its origin to the pool it ended on."""
    t0 = QF[QF_T, i]
    ttft = QF[QF_RTT, i] + (QF[QF_FIRST, i] - t0) * 1000.0
    lat = QF[QF_RTT, i] + (QF[QF_END, i] - t0) * 1000.0
    out = QF[QF_OUT, i]
    if ttft > QF[QF_TTFT, i]:
        return 1.0
    if out > 1.0 and (lat - ttft) / (out - 1.0) > QF[QF_TPOT, i]:
        return 1.0
    dl = QF[QF_DEADLINE, i]
    if dl == dl and lat > dl:
        return 1.0
    return 0.0


def _against(digest: str) -> tuple[Any, ...]:
    """The kernels that compile ``envs.kernels``' functions into themselves (module docstring)."""

    @njit(cache=True, inline='always')
    def route(i, t, QF, QI, PF, PI, active, m, n_pools, rtt, est, prm):  # pragma: no cover
        """The router's choice for request ``i`` at ``t`` among the ``n_pools`` pools in ``active[m]``
        (its model's: the row is read in place, not taken as a view, which would count a reference per
        request): the best one-step expected reward of those with an instance accepting work and
        an expected wait within the queue timeout (module docstring); -1 when none. Writes the
        estimate into ``QF[QF_EST, i]``."""
        digest  # noqa: B018 (a closure variable, which numba's cache key hashes: module docstring)
        est_out = _estimate(est, QI[QI_KEY, i], QI[QI_MODEL, i], QF[QF_MAXOUT, i], prm[P_SHRINK], prm[P_PRIOR])
        QF[QF_EST, i] = est_out
        r_in = QF[QF_IN, i]
        ttft_ms, tpot_ms, dl = QF[QF_TTFT, i], QF[QF_TPOT, i], QF[QF_DEADLINE, i]
        budget = dl if dl == dl else ttft_ms + tpot_ms * max(est_out - 1.0, 0.0)
        if budget < 1.0:
            budget = 1.0
        retry_n = prm[P_RETRY_MS] / budget
        org = QI[QI_ORIGIN, i]
        best, best_s = -1, -np.inf
        for q in range(n_pools):
            p = active[m, q]
            nr = PI[PI_READY, p]
            if nr <= 0:
                continue
            b = float(PI[PI_INFLIGHT, p])
            reps = nr * PF[PF_PER_INST, p]
            slots = nr * PI[PI_SLOTS, p]
            k = b / reps
            if k > PF[PF_CONC, p] - 1.0:
                k = PF[PF_CONC, p] - 1.0
            tp = PF[PF_TPOT, p] + PF[PF_GROWTH, p] * k
            pf = r_in * PF[PF_INV_PREFILL, p]
            s = pf + est_out * tp
            w = (b - slots + 1.0) * s / slots if b >= slots else 0.0
            if w > prm[P_QTIMEOUT]:
                continue  # full: its next slot is expected further away than the queue timeout
            rt = rtt[org, p]
            lat = (w + s) * 1000.0 + rt
            c = (ttft_ms - rt - w * 1000.0) / ((pf + tp) * 1000.0)
            if QF[QF_MAXOUT, i] > 1.0:
                c2 = tpot_ms / (tp * 1000.0)
                if c2 < c:
                    c = c2
            if dl == dl:
                c3 = (dl - rt - w * 1000.0) / (s * 1000.0)
                if c3 < c:
                    c = c3
            pv = 0.0 if c >= PF[PF_SURE, p] else env_kernels.violation_probability(c, PF[PF_SIGMA, p])
            hz = PF[PF_HAZARD, p]
            risk = -math.expm1(-hz * (w + s)) if hz > 0.0 else 0.0
            sc = env_kernels.expected_reward(0.0, lat / budget, pv, risk, retry_n, prm[P_COST_W], prm[P_LAT_W],
                                             prm[P_SLA_PEN], prm[P_COST_CAP], prm[P_LAT_CAP])
            if sc > best_s:
                best, best_s = p, sc
        return best

    @njit(cache=True, inline='always')
    def place(i, p, t, now, prefill_tokens, decode_tokens, keep_first, QF, QI, PF, PI, RF, RI, S, rtt, ht, hi,
              ctr):  # pragma: no cover
        """Run request ``i`` on pool ``p`` from ``t`` (the truth, module docstring): ``prefill_tokens``
        to prefill, ``decode_tokens`` to decode; its first token is this attempt's unless
        ``keep_first`` (a migrated request whose first token came before its notice). ``now``: when
        the router sends it (``t``, or a migration's notice). Returns its row."""
        digest  # noqa: B018
        r0, nrows = PI[PI_ROW0, p], PI[PI_NROWS, p]  # (the rows past nrows have never held an instance)
        r = -1
        for x in range(r0, r0 + nrows):
            if RI[RI_STATE, x] == READY and (r < 0 or RF[RF_MIN, x] < RF[RF_MIN, r]):
                r = x
        s0 = RI[RI_SLOT0, r]
        ns = PI[PI_SLOTS, p]
        # the row's slot releases, sorted (ascending) in a ring from its head: the one that frees first (m1) at
        # the head h0; the earliest release among the other slots next to it (m1 itself when several release at m1)
        end_ = s0 + ns
        h0 = s0 + RI[RI_HEAD, r]
        h1 = h0 + 1 if h0 + 1 < end_ else s0
        m1 = S[h0]
        mn = S[h1] if ns > 1 else np.inf
        if m1 < t:  # it starts now: the others busy past t (counted from the top: few are)
            start = t
            busy = 0
            x = h0 - 1 if h0 > s0 else end_ - 1
            while busy < ns and S[x] > t:
                busy += 1
                x = x - 1 if x > s0 else end_ - 1
        else:  # it starts when slot h0 frees: the others busy past then (all but those releasing at m1)
            start = m1
            n_eq = 1
            x = h1
            while n_eq < ns and S[x] == m1:
                n_eq += 1
                x = x + 1 if x + 1 < end_ else s0
            busy = ns - n_eq
        k = busy / PF[PF_PER_INST, p]
        if k > PF[PF_CONC, p] - 1.0:
            k = PF[PF_CONC, p] - 1.0
        sg = PF[PF_SIGMA, p]
        f = math.exp(sg * QF[QF_Z, i] - 0.5 * sg * sg)
        pf = prefill_tokens * PF[PF_INV_PREFILL, p] * f
        tp = (PF[PF_TPOT, p] + PF[PF_GROWTH, p] * k) * f
        end = start + pf + decode_tokens * tp
        if not keep_first:
            QF[QF_FIRST, i] = start + pf + (tp if decode_tokens >= 1.0 else 0.0)
        # slot h0 now releases at ``end``: the head moves to h1, h0 becomes the ring's last place, and the
        # releases after ``end`` move up one place
        j = h0
        moved = 1
        while moved < ns:
            q = j - 1 if j > s0 else end_ - 1
            if S[q] <= end:
                break
            S[j] = S[q]
            j = q
            moved += 1
        S[j] = end
        RI[RI_HEAD, r] = h1 - s0
        RF[RF_MIN, r] = end if end < mn else mn
        bu = RF[RF_BUSY_UNTIL, r]
        if end > bu:
            RF[RF_BUSY_S, r] += end - (start if start > bu else bu)
            RF[RF_BUSY_UNTIL, r] = end
        RI[RI_SERVED, r] += 1
        in_flight_changes(PF, PI, p, now)
        QF[QF_START, i], QF[QF_PF, i], QF[QF_TP, i], QF[QF_END, i] = start, pf, tp, end
        QF[QF_RTT, i] = rtt[QI[QI_ORIGIN, i], p]
        QI[QI_POOL, i], QI[QI_ROW, i], QI[QI_STATE, i] = p, r, Q_RUNNING
        PI[PI_INFLIGHT, p] += 1
        _heap_push(ht, hi, ctr, end, i)
        return r

    @njit(cache=True, inline='always')
    def advance(t, QF, QI, PF, PI, est, prm, ht, hi, ctr, acc):  # pragma: no cover
        """Every completion up to ``t`` becomes known: the router's in-flight count drops, the
        estimator learns the output (stale heap entries -- a request moved since -- are skipped);
        ``acc`` counts the completions and their SLO misses (:func:`slo_missed`)."""
        digest  # noqa: B018
        decay = prm[P_DECAY]
        while ctr[C_HEAP] > 0 and ht[0] <= t:
            te, i = _heap_pop(ht, hi, ctr)
            if QI[QI_STATE, i] != Q_RUNNING or QF[QF_END, i] != te:
                continue
            QI[QI_STATE, i] = Q_DONE
            in_flight_changes(PF, PI, QI[QI_POOL, i], te)
            PI[PI_INFLIGHT, QI[QI_POOL, i]] -= 1
            x = QF[QF_OUT, i]
            for key in (QI[QI_KEY, i], QI[QI_MODEL, i]):
                est[0, key] = est[0, key] * decay + 1.0
                est[1, key] = est[1, key] * decay + x
            acc[0] += 1.0
            acc[1] += slo_missed(QF, i)

    @njit(cache=True)
    def serve_until(t_stop, QF, QI, PF, PI, RF, RI, S, rtt, est, prm, ht, hi, ctr, backlog, active, n_active,
                    acc):  # pragma: no cover
        """Place every request that arrives before ``t_stop`` (greedy, :func:`route` among its model's
        pools with an instance taking work, ``active[m, :n_active[m]]``; the backlog when there is
        none), then learn the completions up to ``t_stop``. Returns the number placed."""
        digest  # noqa: B018
        n = ctr[C_N]
        placed = 0
        while ctr[C_NEXT] < n and QF[QF_T, ctr[C_NEXT]] < t_stop:
            i = ctr[C_NEXT]
            t = QF[QF_T, i]
            settle(t, QF, QI, PF, PI, RF, RI, S, rtt, est, prm, ht, hi, ctr, backlog, active, n_active, acc)
            m = QI[QI_MODEL, i]
            # behind the router's queue when it holds requests still (first come, first served)
            p = -1 if ctr[C_BTAIL] > ctr[C_BHEAD] else route(i, t, QF, QI, PF, PI, active, m, n_active[m], rtt, est,
                                                               prm)
            if p < 0:
                backlog[ctr[C_BTAIL]] = i
                ctr[C_BTAIL] += 1
                ctr[C_QUEUED] += 1
                QI[QI_STATE, i] = Q_BACKLOG
            else:
                place(i, p, t, t, QF[QF_IN, i], QF[QF_OUT, i], False, QF, QI, PF, PI, RF, RI, S, rtt, ht, hi, ctr)
                placed += 1
            ctr[C_NEXT] = i + 1
        settle(t_stop, QF, QI, PF, PI, RF, RI, S, rtt, est, prm, ht, hi, ctr, backlog, active, n_active, acc)
        return placed

    @njit(cache=True, inline='always')
    def settle(t, QF, QI, PF, PI, RF, RI, S, rtt, est, prm, ht, hi, ctr, backlog, active, n_active,
               acc):  # pragma: no cover
        """The completions up to ``t`` (:func:`advance`), each followed by the router's queue taking
        the room it freed (:func:`drain_backlog`)."""
        digest  # noqa: B018
        while ctr[C_HEAP] > 0 and ht[0] <= t:
            te = ht[0]
            advance(te, QF, QI, PF, PI, est, prm, ht, hi, ctr, acc)
            if ctr[C_BTAIL] > ctr[C_BHEAD]:
                drain_backlog(te, QF, QI, PF, PI, RF, RI, S, rtt, est, prm, ht, hi, ctr, backlog, active, n_active, acc)

    @njit(cache=True, inline='always')
    def drain_backlog(t, QF, QI, PF, PI, RF, RI, S, rtt, est, prm, ht, hi, ctr, backlog, active, n_active,
                      acc):  # pragma: no cover
        """Place the router's queued requests, oldest first, at ``t``: each where :func:`route` finds
        room; once one of a model finds none, the later ones of that model keep their place too
        (first come, first served). Returns the number placed."""
        digest  # noqa: B018
        head, tail = ctr[C_BHEAD], ctr[C_BTAIL]
        w = head
        placed = 0
        blocked = np.zeros(active.shape[0], dtype=np.bool_)
        for x in range(head, tail):
            i = backlog[x]
            m = QI[QI_MODEL, i]
            p = -1 if blocked[m] else route(i, t, QF, QI, PF, PI, active, m, n_active[m], rtt, est, prm)
            if p < 0:
                blocked[m] = True
                backlog[w] = i
                w += 1
            else:
                place(i, p, t, t, QF[QF_IN, i], QF[QF_OUT, i], False, QF, QI, PF, PI, RF, RI, S, rtt, ht, hi, ctr)
                placed += 1
        ctr[C_BTAIL] = w
        return placed

    return route, place, advance, serve_until, settle, drain_backlog


route, place, advance, serve_until, settle, drain_backlog = _against(env_kernels.DIGEST)


@njit(cache=True)
def bill(RF, row_pool, price_s, T, T1):  # pragma: no cover
    """Held instance-seconds within ``[T, T1)`` x each row's pool's price per second."""
    tot = 0.0
    for r in range(row_pool.shape[0]):
        lo = RF[RF_LAUNCH, r]
        if lo < T:
            lo = T
        hi = RF[RF_END, r]
        if hi > T1:
            hi = T1
        if hi > lo:
            tot += (hi - lo) * price_s[row_pool[r]]
    return tot


@njit(cache=True)
def integrate_in_flight(PF, PI, t):  # pragma: no cover
    """Every pool's requests in flight integrated up to ``t`` (:func:`in_flight_changes` for all)."""
    for p in range(PF.shape[1]):
        last = PF[PF_LAST, p]
        d = t - last
        if d < 0.0:
            d = 0.0
        PF[PF_WORK, p] += PI[PI_INFLIGHT, p] * d
        if t > last:
            PF[PF_LAST, p] = t


@njit(cache=True)
def within(a, hi):  # pragma: no cover
    """Every entry of the int array ``a`` in ``0..hi``."""
    for x in a:
        if x < 0 or x > hi:
            return False
    return True


@njit(cache=True)
def requests_on_row(r, t, QI, QF, ht, hi, ctr):  # pragma: no cover
    """The requests running or queued on row ``r`` that end after ``t`` (each request's one valid
    heap entry: the one whose time is its current end)."""
    out = np.empty(ctr[C_HEAP], dtype=np.int64)
    k = 0
    for x in range(ctr[C_HEAP]):
        i = hi[x]
        if QI[QI_STATE, i] == Q_RUNNING and QI[QI_ROW, i] == r and QF[QF_END, i] == ht[x] and ht[x] > t:
            out[k] = i
            k += 1
    return out[:k]
