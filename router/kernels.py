"""The router's per-request mask arithmetic, compiled with numba (see ``envs/kernels.py`` for why
one compiled pass beats a dozen numpy calls on arrays of ~100 offerings)."""

from __future__ import annotations

import numpy as np
from numba import njit

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


def warm_up() -> None:
    """Compile (or load from the cache) now rather than on the first request."""
    ok = np.ones(2, dtype=np.bool_)
    combine(ok, ok, ok, True, np.zeros(2, dtype=np.int64))
