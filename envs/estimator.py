"""How long will the answer be? The output-length estimator every policy's expectations use.

A router does not know a request's output length when it decides; it knows ``max_output_tokens``
and the lengths of the requests that have *completed* so far. For each key (model, tenant) the
estimator keeps a histogram of past completions' output tokens on quarter-octave bins, with the
exact weighted sum of the values in each bin, both decayed so that an observation weighs half after
``half_life`` newer ones of the same key (bounded memory: ``BINS`` numbers per key, whatever the
traffic). The estimate for a request is the expected output *capped at its budget*,
``E[min(X, max_output_tokens)]`` (exact below the cap from the sums, the bin holding the cap
counted at the cap), shrunk toward the model's own estimate (all its tenants) with ``shrinkage``
pseudo-observations, which is itself shrunk toward ``prior_fraction`` x ``max_output_tokens``.

The simulator feeds it each request's realized output at the request's (simulated) completion
time, never earlier; the router feeds it from ``POST /v1/feedback``. ``tests/test_estimator.py``
checks it against the plain formulas.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from xroute.config import EstimatorConfig

#: quarter-octave bins of output tokens: bin b holds x with 4*log2(1+x) in [b, b+1); the last is open
BINS = 84
_UPPER = np.array([2.0 ** ((b + 1) / 4.0) - 1.0 for b in range(BINS)])
_UPPER[-1] = np.inf


@njit(cache=True)
def _bin(x):  # pragma: no cover
    b = int(4.0 * np.log2(1.0 + x))
    return b if b < BINS else BINS - 1


@njit(cache=True)
def observe(w, s, n, k, x, decay):  # pragma: no cover
    """One completion of ``x`` output tokens for key ``k``: every weight of the key times ``decay``,
    then ``x`` added with weight 1. ``w``/``s`` (K, BINS) weights and weighted sums, ``n`` (K,)
    total weights; in place."""
    for b in range(BINS):
        w[k, b] *= decay
        s[k, b] *= decay
    n[k] = n[k] * decay + 1.0
    b = _bin(x)
    w[k, b] += 1.0
    s[k, b] += x


@njit(cache=True)
def capped_mean(w, s, n, k, cap, upper):  # pragma: no cover
    """``E[min(X, cap)]`` under key ``k``'s histogram (0 when it is empty)."""
    if n[k] <= 0.0:
        return 0.0
    total = 0.0
    for b in range(BINS):
        wb = w[k, b]
        if wb <= 0.0:
            continue
        if upper[b] <= cap:
            total += s[k, b]
        else:
            mean_b = s[k, b] / wb
            total += wb * (mean_b if mean_b < cap else cap)
    return total / n[k]


@njit(cache=True)
def estimate(w, s, n, key, parent, cap, shrinkage, prior_fraction, upper):  # pragma: no cover
    """The shrunk estimate for a request with budget ``cap``: key's capped mean toward the
    parent's (the model's), toward ``prior_fraction * cap``."""
    prior = prior_fraction * cap
    np_ = n[parent]
    e_parent = (np_ * capped_mean(w, s, n, parent, cap, upper) + shrinkage * prior) / (np_ + shrinkage) \
        if np_ + shrinkage > 0.0 else prior
    if key == parent:
        return e_parent
    nk = n[key]
    if nk + shrinkage <= 0.0:
        return e_parent
    return (nk * capped_mean(w, s, n, key, cap, upper) + shrinkage * e_parent) / (nk + shrinkage)


def new_tables(keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty (weights, sums, totals) for ``keys`` keys."""
    return np.zeros((keys, BINS)), np.zeros((keys, BINS)), np.zeros(keys)


def decay_for(cfg: EstimatorConfig) -> float:
    """The per-observation decay that halves an observation's weight after ``half_life`` more."""
    return float(0.5 ** (1.0 / cfg.half_life))


UPPER = _UPPER


def reference_capped_mean(values: np.ndarray, weights: np.ndarray, cap: float) -> float:
    """``E[min(X, cap)]`` of weighted values, binned as :func:`capped_mean` bins them (for tests)."""
    if weights.sum() <= 0:
        return 0.0
    bins = np.minimum((4.0 * np.log2(1.0 + values)).astype(int), BINS - 1)
    total = 0.0
    for b in np.unique(bins):
        sel = bins == b
        wb, sb = weights[sel].sum(), (weights[sel] * values[sel]).sum()
        total += sb if _UPPER[b] <= cap else wb * min(sb / wb, cap)
    return float(total / weights.sum())


