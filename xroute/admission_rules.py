"""The admission rules the router and the simulator share (issue 36; ``docs/router.md``, "Admission",
``docs/env.md``): who is served first under load, who waits and who is refused early.

One module, imported by the router's admission (a live request) and by the environment (a simulated
one), as ``xroute.migration_rules`` is, so the two apply one definition:

* **Priority bands** (:data:`BANDS`): ``critical`` > ``standard`` > ``sheddable``. A request names
  its band (``priority``); else its tenant's default; else :data:`DEFAULT_BAND`.
* **The verdict** (:func:`verdict`): before placing, the router predicts the TTFT each feasible
  pool would give the request (its queue and service model). When the best one is within the
  request's TTFT SLO -- less what it already waited -- it is placed now (:data:`ADMIT`). Else a
  ``sheddable`` request is refused at once (:data:`SHED`: 429 ``slo_unattainable`` with the best
  predicted TTFT), and a ``critical`` or ``standard`` one waits in the router's queue
  (:data:`QUEUE`) until capacity frees or its TTFT budget is spent, when it is refused the same way
  (a request that can no longer start within its SLO only takes capacity from one that can).
* **Where the waiting happens** (:func:`best_judged`): when every pool a request may use is full --
  each has a predicted queue wait -- the best is infinite: the request is not put in a pool's queue,
  which its servers run first come first served, but waits in the router's queue, where
  :func:`dispatch_order` puts the highest band and the least-served tenant first (sheddable: shed).
  A request dispatched from that queue (it has waited) is placed only where a slot is free (the
  placement masks every pool with a predicted wait). So under overload the pools hold what they
  run, and a quiet tenant's request goes ahead of a noisy one's rather than behind it.
* **Waiting cannot help** (:func:`soonest_ttft`): when even the soonest any pool could start the
  request -- its predicted TTFT less its queue wait, the TTFT of a free slot there -- is over what is
  left of its TTFT SLO, it is shed now, whatever its band: a wait only shrinks the budget (before,
  a critical or standard one waited its whole budget, at the head of the queue, holding back those
  behind it).
* **Fairness between tenants within a band**: the Virtual Token Counter (Sheng et al., "Fairness in
  Serving Large Language Models", OSDI'24). Each tenant has a counter of the service it received,
  weighted: a request's service is ``input_tokens x INPUT_WEIGHT + output_tokens x OUTPUT_WEIGHT``
  (VTC's w_p = 1, w_q = 2), divided by the tenant's weight (:func:`service`). The queue dispatches
  the highest band first and, within a band, the backlogged tenant with the lowest counter
  (:func:`dispatch_order`); a tenant that becomes backlogged after being idle has its counter lifted
  to the lowest counter of those backlogged (:func:`lift`), so idle time earns no credit to burst
  with. A request's service is counted when it is admitted (its expected output) and corrected when
  its outcome is known (:func:`correction`).
* **Jain's index** (:func:`jain`) of the normalized service of backlogged tenants: 1 is perfectly
  fair, ``1/n`` one tenant takes everything.

Pure functions and constants: no I/O, no clock. The counters live where each side keeps its state
(the router's shared state, the environment's arrays).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

#: the priority bands, highest first (a band's index is its rank: lower is served first)
BANDS: tuple[str, ...] = ("critical", "standard", "sheddable")
Band = Literal["critical", "standard", "sheddable"]
#: the band of a request that names none and whose tenant sets none
DEFAULT_BAND: Band = "standard"
#: the bands a request may wait in (the others are refused at once when no pool meets their SLO)
QUEUED_BANDS = frozenset({"critical", "standard"})

#: VTC's weights of a request's prompt and output tokens (w_p, w_q: an output token costs about
#: twice a prompt token's compute, the paper's setting)
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0

#: how much the predicted queue wait counts in the verdict and in the placement, per band (by band
#: index; :func:`judged_ttft`): a pool's queue wait is the uncertain part of its predicted TTFT (the
#: real lengths of the work ahead are unknown), so an admitted request must start in time even when
#: it waits that many times as long as predicted; RTT, prefill and the first token count once. The
#: lower bands count it more: they are admitted only while the pools' queues are shorter, which keeps
#: room for a critical request arriving after them (a pool's servers run FIFO: the router's priority
#: orders only the requests it holds back). No wait predicted: the prediction as is (so where a pool
#: is free the admission changes nothing).
WAIT_MARGINS: tuple[float, ...] = (2.0, 3.0, 4.0)

Verdict = Literal["admit", "queue", "shed"]
ADMIT: Verdict = "admit"
QUEUE: Verdict = "queue"
SHED: Verdict = "shed"


def band_index(band: str) -> int:
    """The rank of ``band`` (0 is served first); a ValueError naming the bands for another name."""
    try:
        return BANDS.index(band)
    except ValueError:
        raise ValueError(f"unknown priority {band!r}: one of {', '.join(BANDS)}") from None


def wait_margin(band: str) -> float:
    """The :data:`WAIT_MARGINS` of ``band`` (a ValueError naming the bands for another name)."""
    return WAIT_MARGINS[band_index(band)]


def judged_ttft(band: str, ttft_ms: float, wait_s: float) -> float:
    """The TTFT the admission judges a pool by for a request of ``band``: its predicted TTFT
    ``ttft_ms`` with its predicted queue wait ``wait_s`` (seconds, part of ``ttft_ms``) counted
    :func:`wait_margin` times (``envs.admission.best_ttft`` computes it compiled)."""
    return ttft_ms + (wait_margin(band) - 1.0) * 1000.0 * wait_s


def best_judged(judged_ms: Sequence[float], waits_s: Sequence[float]) -> float:
    """The best judged TTFT the verdict reads over the pools a request may use (``judged_ms``, each
    :func:`judged_ttft`; ``waits_s``, their predicted queue waits): the lowest, but infinite when
    every one is full -- a wait at each (module docstring, "Where the waiting happens") -- or none is
    given; NaN when one is NaN. ``envs.admission.best_ttft_of`` computes it compiled."""
    if any(x != x for x in judged_ms):
        return float("nan")
    if all(w > 0.0 for w in waits_s):
        return float("inf")
    return min(judged_ms, default=float("inf"))


def soonest_ttft(ttft_ms: Sequence[float], waits_s: Sequence[float]) -> float:
    """The soonest the pools a request may use -- whatever their state now: full, even past the
    queue timeout, or down -- could give it its first token: the lowest predicted TTFT less the
    queue wait in it (``ttft_ms``, ``waits_s`` in seconds), what a free slot there would give (NaN
    skipped); infinite for none (``envs.admission.soonest_ttft`` computes it compiled)."""
    return min((x for x in (t - 1000.0 * w for t, w in zip(ttft_ms, waits_s)) if x == x), default=float("inf"))


def verdict(band: str, best_ttft_ms: float, ttft_slo_ms: float, waited_ms: float = 0.0,
            ahead_waiting: bool = False, soonest_ttft_ms: float = -float("inf")) -> Verdict:
    """What happens to a request of ``band`` whose best judged TTFT over the feasible pools
    (:func:`best_judged`) is ``best_ttft_ms`` (``inf``: no pool can take it now, or every one is
    full), with a TTFT SLO of ``ttft_slo_ms``, after waiting ``waited_ms`` in the router's queue
    (module docstring). ``ahead_waiting``: an arriving request finds one of its band or a higher one
    waiting in the queue (:func:`waits_ahead`) -- then it is not placed before them: it joins the
    queue (and the dispatch order decides) or, sheddable, is shed. ``soonest_ttft_ms``
    (:func:`soonest_ttft`; not known: ``-inf``): over the budget, waiting cannot help -- shed now."""
    budget = ttft_slo_ms - waited_ms
    if soonest_ttft_ms > budget:
        return SHED
    if best_ttft_ms <= budget and not ahead_waiting:
        return ADMIT
    if band in QUEUED_BANDS and budget > 0.0:
        return QUEUE
    return SHED


def waits_ahead(band: str, waiting_per_band: Sequence[int]) -> bool:
    """Whether a request of ``band`` arriving now finds a request the queue dispatches before it
    (by :func:`dispatch_order`: any of a higher band, or of its own band -- its tenant may be the
    less served): ``waiting_per_band`` counts the waiting requests by band index."""
    return any(waiting_per_band[: band_index(band) + 1])


def service(input_tokens: float, output_tokens: float, weight: float) -> float:
    """The weighted service of one request to a tenant of ``weight`` (> 0): what its counter grows by."""
    if not weight > 0.0:
        raise ValueError(f"a tenant's weight must be > 0, not {weight!r}")
    return (input_tokens * INPUT_WEIGHT + output_tokens * OUTPUT_WEIGHT) / weight


def correction(expected_output: float, actual_output: float, weight: float) -> float:
    """What a tenant's counter changes by when a request admitted with ``expected_output`` tokens
    of output reports ``actual_output``: the difference of the two services (may be negative)."""
    return service(0.0, actual_output, weight) - service(0.0, expected_output, weight)


def lift(counter: float, backlogged: Iterable[float]) -> float:
    """The counter of a tenant becoming backlogged: at least the lowest counter of the tenants that
    are backlogged already (none: unchanged)."""
    low = min(backlogged, default=None)
    return counter if low is None else max(counter, low)


def dispatch_order(waiting: Sequence[tuple[int, str, float]], counters: Mapping[str, float]) -> list[int]:
    """The order to dispatch the requests ``waiting`` -- each ``(band index, tenant, arrival)`` --
    as the counters stand: the highest band first; within a band the tenant with the lowest counter
    (ties: the tenant's name); within a tenant, first come first served. Returns indexes into
    ``waiting``. The queue dispatches the first that fits and re-reads the counters after each
    (a dispatch moves its tenant's counter); this is the order at one instant."""
    return sorted(range(len(waiting)), key=lambda i: (waiting[i][0], counters.get(waiting[i][1], 0.0),
                                                     waiting[i][1], waiting[i][2], i))


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index of ``values`` (each tenant's normalized service): ``(sum x)^2 / (n sum
    x^2)``, 1.0 for equal values, ``1/n`` when one takes everything; 1.0 for none or all zero."""
    n = len(values)
    sq = sum(v * v for v in values)
    if n == 0 or sq == 0.0:
        return 1.0
    return sum(values) ** 2 / (n * sq)


def fair_shares(demands: Sequence[float], weights: Sequence[float], capacity: float) -> list[float]:
    """The weighted max-min fair split of ``capacity`` among tenants asking for ``demands`` (water
    filling: each gets ``capacity x weight / sum of weights`` of what is left, capped at its demand,
    the rest shared again among the others): what Jain's index normalizes a tenant's service by
    (Jain, Chiu, Hawe 1984: ``x_i`` = the throughput a tenant got over its fair one)."""
    share = [0.0] * len(demands)
    left = max(float(capacity), 0.0)
    active = [i for i, d in enumerate(demands) if d > 0.0]
    for w in weights:
        if not w > 0.0:
            raise ValueError(f"a tenant's weight must be > 0, not {w!r}")
    while active and left > 1e-12 * max(capacity, 1.0):
        total_w = sum(weights[i] for i in active)
        capped = [i for i in active if demands[i] - share[i] <= left * weights[i] / total_w]
        if not capped:  # nobody's demand is met: split what is left by weight
            for i in active:
                share[i] += left * weights[i] / total_w
            return share
        for i in capped:  # meet these demands in full and share the rest among the others again
            left -= demands[i] - share[i]
            share[i] = float(demands[i])
        active = [i for i in active if i not in capped]
    return share
