"""The router's per-request mask arithmetic and decisions, compiled with numba (see
``envs/kernels.py`` for why one compiled pass beats a dozen numpy calls on arrays of ~100
offerings), every one cached on disk (``cache=True``).

:func:`greedy_decide`, :func:`valid_rows`, :func:`scored_decide` and :func:`rank_scored` call the
environment's kernels (``envs.kernels``) and compile them into themselves. numba invalidates a
cached function when its own file changes, not when a function it calls from another file does,
and a stale cache would decide with old formulas; so they are built by :func:`_deciders` and :func:`_rankers` as
closures over ``envs.kernels.DIGEST`` (the digest of the environment's kernels and of the feature
layout they read), which numba's cache key hashes: an edit there is a new cache entry here, and a
start with a warm cache compiles nothing (what that saves a start: ``docs/results.md``, "Router").

Where numba keeps its cache: ``__pycache__`` beside each file when that is writable, else the
user's cache directory; ``NUMBA_CACHE_DIR`` names another (numba's own setting)."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from envs import kernels as env_kernels
from envs.features import N_OFFERING_FEATURES

#: the environment's reasons for masking an allowed offering, in ``static_code`` order
ENV_REASONS = ("unavailable", "no_capacity", "no_price", "queue_full")


@njit(cache=True)
def combine(env_mask, allowed, preferred, use_preferred, static_code):  # pragma: no cover
    """Offerings a request may go to: valid in the environment and allowed by its constraints;
    when ``use_preferred`` and some of those are also preferred, only those.

    Returns (valid mask, number of valid offerings, allowed-and-valid offerings dropped for not
    being preferred, counts of allowed offerings the environment masks, by ``ENV_REASONS`` —
    ``static_code`` holds each offering's reason when masked for a static one, else 3, queue_full).
    """
    n = env_mask.shape[0]
    valid = np.empty(n, dtype=np.bool_)
    counts = np.zeros(4, dtype=np.int64)
    n_ok = 0
    n_pref = 0
    for i in range(n):
        if not allowed[i]:
            valid[i] = False
            continue
        if not env_mask[i]:
            valid[i] = False
            counts[static_code[i]] += 1
            continue
        valid[i] = True
        n_ok += 1
        if use_preferred and preferred[i]:
            n_pref += 1
    if use_preferred and n_pref > 0 and n_pref < n_ok:
        for i in range(n):
            if valid[i] and not preferred[i]:
                valid[i] = False
        return valid, n_pref, n_ok - n_pref, counts
    return valid, n_ok, 0, counts


@njit(cache=True)
def _finite(x):  # pragma: no cover
    """``x``, or 0.0 when it is NaN or infinite (an answer's numbers must be valid JSON)."""
    return x if np.isfinite(x) else 0.0


@njit(cache=True)
def _head(ints, chosen, n_valid, n_not_preferred, counts):  # pragma: no cover
    """The first seven outputs of :func:`greedy_decide` / :func:`valid_rows`."""
    ints[0] = chosen
    ints[1] = n_valid
    ints[2] = n_not_preferred
    for c in range(4):
        ints[3 + c] = counts[c]


def _deciders(digest: str) -> tuple[Any, ...]:
    """The kernels that compile ``envs.kernels``' functions into themselves, as closures over
    ``digest`` (``envs.kernels.DIGEST``; module docstring): the greedy decision and a learned
    scorer's inputs. They call one another by their names in this module, not as this function's
    locals: a closure over a compiled function would be hashed with its per-process id, and never
    found in the cache again."""

    @njit(cache=True)
    def greedy_decide(env_mask, allowed, preferred, use_preferred, static_code, C, bias, use_bias, ref_cost, budget_ms,
                      retry_ms, cost_weight, latency_weight, sla_penalty, cost_cap, latency_cap, k, ints,
                      floats):  # pragma: no cover
        """The greedy policy's whole ranking once the environment has computed the request's
        candidate outcomes ``C`` (``CloudRouteEnv.set_live``), in one compiled call: :func:`combine`,
        the expected rewards of the valid offerings (``envs.kernels.expected_rewards``) plus, with
        ``use_bias``, the routing policies' prefer weights ``bias`` (``envs.policies``), the best and
        the next ``k`` (``envs.kernels.rank``). The same kernels the engine's general path calls one
        by one, so the same floats. (The chosen pool is admitted in the router's view afterwards,
        once the shared state has reserved it: ``RoutingEngine.admit``.)

        Writes into ``ints`` (int64, at least 7 + k) [chosen offering (-1: none valid), valid count,
        not-preferred count, the four ``ENV_REASONS`` counts, then the alternatives' indices] and
        ``floats`` (float64, at least 3 + 3k) [(score, expected latency ms, expected cost USD) of the
        chosen offering and of each alternative, NaN/inf as 0.0], and returns the number of
        alternatives. (Output buffers rather than returned arrays: boxing each new array costs the call
        ~0.3 us.)"""
        digest  # noqa: B018 (a closure variable, which numba's cache key hashes: module docstring)
        valid, n_valid, n_not_preferred, counts = combine(env_mask, allowed, preferred, use_preferred, static_code)
        r = env_kernels.expected_rewards(C, valid, ref_cost, budget_ms, retry_ms, cost_weight, latency_weight, sla_penalty,
                                         cost_cap, latency_cap)
        if use_bias:
            for i in range(r.shape[0]):
                if valid[i]:
                    r[i] += bias[i]
        best, alt = env_kernels.rank(r, valid, k)
        m = alt.shape[0]
        _head(ints, best, n_valid, n_not_preferred, counts)
        if best < 0:
            return 0
        for q in range(m + 1):
            i = best if q == 0 else alt[q - 1]
            if q > 0:
                ints[6 + q] = i
            floats[3 * q] = _finite(r[i])
            floats[1 + 3 * q] = _finite(C[env_kernels.LAT, i])
            floats[2 + 3 * q] = _finite(C[env_kernels.COST, i])
        return m

    @njit(cache=True)
    def valid_rows(env_mask, allowed, preferred, use_preferred, static_code, static_feats, rtt, C, inv_slots, ttft_ms,
                   tpot_ms, budget_ms, ref_cost, rows, idx, ints):  # pragma: no cover
        """A learned scorer's inputs in one compiled call: :func:`combine`, then the valid offerings'
        indices (ascending) into ``idx`` and their observation rows into ``rows``
        (``envs.kernels.offering_rows``, as ``CloudRouteEnv.offering_features``). Returns how many;
        writes ``ints`` [-1, valid count, not-preferred count, the four ``ENV_REASONS`` counts], as
        :func:`greedy_decide`."""
        digest  # noqa: B018 (a closure variable, which numba's cache key hashes: module docstring)
        valid, n_valid, n_not_preferred, counts = combine(env_mask, allowed, preferred, use_preferred, static_code)
        _head(ints, -1, n_valid, n_not_preferred, counts)
        m = 0
        for i in range(valid.shape[0]):
            if valid[i]:
                idx[m] = i
                m += 1
        env_kernels.offering_rows(rows[:m], idx[:m], static_feats, env_mask, rtt, C, inv_slots, ttft_ms, tpot_ms,
                                  budget_ms, ref_cost)
        return m

    return greedy_decide, valid_rows


def _rankers(digest: str) -> tuple[Any, ...]:
    """The rankings of a learned scorer's scores (closures over ``digest``, as :func:`_deciders`)."""

    @njit(cache=True)
    def rank_finite(scores, k):  # pragma: no cover
        """A scorer's ranking (``envs.kernels.rank`` over all of ``scores``: the best, then the next
        ``k``), or best -1 when a score is NaN or infinite (the model failed)."""
        digest  # noqa: B018 (a closure variable, which numba's cache key hashes: module docstring)
        n = scores.shape[0]
        for i in range(n):
            if not np.isfinite(scores[i]):
                return -1, np.empty(0, dtype=np.int64)
        return env_kernels.rank(scores, np.ones(n, dtype=np.bool_), k)

    @njit(cache=True)
    def scored_decide(scores, idx, k, C, ints, floats):  # pragma: no cover
        """After :func:`valid_rows` and the scorer: the best of the ``scores`` of offerings ``idx``
        and the next ``k`` (:func:`rank_scored`'s ranking), and the same outputs as
        :func:`greedy_decide`. Returns the number of alternatives, or -1 when a score is NaN or
        infinite."""
        digest  # noqa: B018 (a closure variable, which numba's cache key hashes: module docstring)
        best, alt = _rank_finite(scores, k)
        if best < 0:
            return -1
        m = alt.shape[0]
        ints[0] = idx[best]
        for q in range(m + 1):
            r = best if q == 0 else alt[q - 1]
            i = idx[r]
            if q > 0:
                ints[6 + q] = i
            floats[3 * q] = scores[r]
            floats[1 + 3 * q] = _finite(C[env_kernels.LAT, i])
            floats[2 + 3 * q] = _finite(C[env_kernels.COST, i])
        return m

    @njit(cache=True)
    def rank_scored(scores, idx, k):  # pragma: no cover
        """A learned scorer's choice: ``scores`` of the offerings ``idx`` (the valid ones, ascending)
        -> (offerings: the best then the next ``k``; their scores), ranked as ``envs.kernels.rank``
        ranks (ties to the lower index). Offerings is empty when a score is NaN or infinite (the
        model failed: the caller falls back)."""
        digest  # noqa: B018 (a closure variable, which numba's cache key hashes: module docstring)
        best, alt = _rank_finite(scores, k)
        if best < 0:
            return np.empty(0, dtype=np.int64), np.empty(0)
        m = alt.shape[0]
        out = np.empty(m + 1, dtype=np.int64)
        vals = np.empty(m + 1)
        out[0] = idx[best]
        vals[0] = scores[best]
        for q in range(m):
            out[q + 1] = idx[alt[q]]
            vals[q + 1] = scores[alt[q]]
        return out, vals

    return rank_finite, scored_decide, rank_scored


greedy_decide, valid_rows = _deciders(env_kernels.DIGEST)
_rank_finite, scored_decide, rank_scored = _rankers(env_kernels.DIGEST)


def warm_up() -> None:
    """Compile (or load from the cache) now rather than on the first request."""
    ok = np.ones(2, dtype=np.bool_)
    code = np.zeros(2, dtype=np.int64)
    combine(ok, ok, ok, True, code)
    f = np.ones(2)
    C = np.ones((env_kernels.N_OUT, 2))
    ints, floats = np.zeros(9, dtype=np.int64), np.zeros(8)
    greedy_decide(ok, ok, ok, True, code, C, f, True, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0, 3.0, 1, ints, floats)
    rank_scored(np.ones(2, dtype=np.float32), np.arange(2), 1)  # a learned scorer's float32 scores
    rank_scored(np.ones(2), np.arange(2), 1)
    rows = np.zeros((2, N_OFFERING_FEATURES), dtype=np.float32)  # as CloudRouteEnv's arrays
    i2 = np.zeros(2, dtype=np.int64)
    valid_rows(ok, ok, ok, True, code, np.zeros((2, N_OFFERING_FEATURES)), f, C, f, 1.0, 1.0, 1.0, 1.0, rows, i2, ints)
    for scores in (np.ones(2, dtype=np.float32), np.ones(2)):
        scored_decide(scores, i2, 1, C, ints, floats)
