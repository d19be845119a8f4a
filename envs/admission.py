"""Admission under load in the simulated world (issue 36; ``docs/env.md``, "Admission under load").

The environment applies the router's admission (``xroute.admission_rules``: one definition, imported
here as ``envs.cloud_route`` imports ``xroute.migration_rules``): each stream request has a priority
band (its workload row's ``priority`` when the bundle has the column and the row names one, else its
tenant's ``admission.tenants`` band, else ``admission.default_band``) and its tenant a fairness weight.
Before a request is placed, the best TTFT the router's view predicts over the feasible offerings
decides (``admission_rules.verdict``): admitted (the policy chooses, as before), shed (a sheddable
request no pool can serve in time, or any request whose TTFT budget is spent in the queue, or one
the full queue cannot hold), or queued (critical, standard) in the router's bounded queue.

:class:`WorldQueue` is the queue and the Virtual Token Counter's counters of one episode: plain
Python over the queued requests (a few hundred at most, only under overload), and per tenant id the
counters every placement updates; ``CloudRouteEnv`` drives it (when to try a dispatch, what the view
predicts). No clock, no outcome: a request's service is counted with its *expected* output when it
is admitted and corrected when its completion is observed, as the router counts it.

The fast path (:func:`admits_at_arrival`): a request arriving while nothing waits, with some
offering predicted within its TTFT SLO, is admitted whatever its band -- the verdict's first clause,
computed in one compiled pass instead of a masked copy and a call; every other case goes through
``admission_rules.verdict``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from envs.kernels import TTFT, WAIT
from xroute import admission_rules as ar
from xroute.config import AdmissionConfig
from xroute.errors import ConfigError


def request_bands(cfg: AdmissionConfig, tenants: np.ndarray, priority: np.ndarray | None) -> np.ndarray:
    """Each request's band index: its ``priority`` (non-empty), else its tenant's band, else the
    default band; a ConfigError naming the workload field for an unknown priority."""
    by_tenant = {name: ar.band_index(t.band) for name, t in cfg.tenants.items()}
    default = ar.band_index(cfg.default_band)
    out = np.array([by_tenant.get(str(x), default) for x in tenants.tolist()], dtype=np.int64)
    if priority is not None:
        for i, p in enumerate(priority.tolist()):
            p = str(p).strip() if p == p and p is not None else ""
            if p:
                try:
                    out[i] = ar.band_index(p)
                except ValueError as e:
                    raise ConfigError(f"workload: field 'priority' (row {i + 1}): {e}") from None
    return out


@njit(cache=True)
def judged(C, a, margin):  # pragma: no cover (compiled)
    """Offering ``a``'s judged TTFT, ``admission_rules.judged_ttft`` compiled: its predicted TTFT
    ``C[TTFT, a]`` with its predicted queue wait ``C[WAIT, a]`` (seconds) counted ``margin`` times."""
    return C[TTFT, a] + (margin - 1.0) * 1000.0 * C[WAIT, a]


@njit(cache=True)
def best_ttft(C, mask, margin):  # pragma: no cover (compiled)
    """The best (lowest) judged TTFT (:func:`judged`) over the offerings ``mask`` allows; ``inf``
    when none or when every one is full, NaN when one of them is NaN (:func:`best_ttft_of`)."""
    return best_ttft_of(C, mask, mask, margin)


@njit(cache=True)
def best_ttft_of(C, mask, allowed, margin):  # pragma: no cover (compiled)
    """:func:`best_ttft` over the offerings both ``mask`` and ``allowed`` allow (the masks may be
    shorter than ``C``'s rows: their first entries), without the temporaries: the router's
    ``predict`` stage, on each decision. ``admission_rules.best_judged`` compiled: ``inf`` also when
    every one of them is full (a predicted wait, ``C[WAIT] > 0``, at each)."""
    best = np.inf
    free = False
    for a in range(mask.shape[0]):
        if mask[a] and allowed[a]:
            x = judged(C, a, margin)
            if x != x:
                return x
            if x < best:
                best = x
            if not C[WAIT, a] > 0.0:
                free = True
    return best if free else np.inf


@njit(cache=True)
def soonest_ttft(C, mask, allowed, allowed2):  # pragma: no cover (compiled)
    """``admission_rules.soonest_ttft`` compiled: the lowest ``C[TTFT] - 1000 x C[WAIT]`` (the TTFT
    of a free slot; NaN skipped) over the offerings all three masks allow; ``inf`` when none. The
    masks are the offerings the request may use *whatever the pools' state* (the policies, the
    model's fit): a pool now full past the queue timeout, or down, may free or return."""
    best = np.inf
    for a in range(mask.shape[0]):
        if mask[a] and allowed[a] and allowed2[a]:
            x = C[TTFT, a] - 1000.0 * C[WAIT, a]
            if x < best:
                best = x
    return best


@njit(cache=True)
def place_within(C, mask, budget_ms, margin, free_only=False):  # pragma: no cover (compiled)
    """The placement of an admitted request (``admission_rules``, "the placement"): the offerings
    ``mask`` allows whose judged TTFT (:func:`best_ttft`'s) is over ``budget_ms`` *because of their
    queue* (a predicted wait, ``C[WAIT] > 0``) are masked, in place -- the request goes where it is
    predicted to start in time, not behind a queue that makes it late. An offering late without a
    queue (its RTT, its prefill) stays as it was: where no pool queues the placement changes nothing.
    ``free_only`` (a request dispatched from the router's queue: it has waited): every offering with a
    predicted wait is masked -- it goes where a slot is free (``admission_rules``, "Where the waiting
    happens"). Returns how many were masked."""
    k = 0
    for a in range(mask.shape[0]):
        if mask[a] and C[WAIT, a] > 0.0 and (free_only or not judged(C, a, margin) <= budget_ms):
            mask[a] = False
            k += 1
    return k


@njit(cache=True)
def admits_at_arrival(C, mask, ttft_slo_ms, margin):  # pragma: no cover (compiled)
    """Whether a request that has not waited, and finds nothing waiting, is admitted whatever its
    band, from its candidate outcomes ``C`` and the offerings ``mask`` allows: the fast path of
    ``admission_rules.verdict(band, best, ttft_slo_ms, 0) == ADMIT`` on the best judged TTFT (its
    first clause, ``best <= budget``; ``tests/test_env_admission.py`` checks the two agree on random
    inputs; like :func:`best_ttft`, not when every offering is full). Admitted, it is placed in the
    same pass (:func:`place_within`: ``mask`` narrowed in place, only when some queued offering is
    late). False hands the request to the full verdict, ``mask`` untouched."""
    best = np.inf
    late = False
    free = False
    for a in range(mask.shape[0]):
        if mask[a]:
            x = judged(C, a, margin)
            if x != x:
                return False
            if x < best:
                best = x
            if C[WAIT, a] > 0.0 and not x <= ttft_slo_ms:
                late = True
            if not C[WAIT, a] > 0.0:
                free = True
    if not (best <= ttft_slo_ms and free):
        return False
    if late:
        place_within(C, mask, ttft_slo_ms, margin)
    return True


def warm_up() -> None:
    """Compile (or load from numba's cache) the admission's kernels now, with the argument types the
    environment and the router's ``predict`` stage pass, rather than on the first request (a compile
    on the router's event loop stalls it for seconds)."""
    from envs.kernels import N_OUT

    C = np.zeros((N_OUT, 2))
    mask, allowed = np.ones(2, dtype=np.bool_), np.ones(2, dtype=np.bool_)
    best_ttft(C, mask, 2.0)
    best_ttft_of(C, mask, allowed, 2.0)
    place_within(C, mask.copy(), 1.0, 2.0)
    place_within(C, mask.copy(), 1.0, 2.0, True)
    soonest_ttft(C, mask, allowed, allowed)
    admits_at_arrival(C, mask.copy(), 1.0, 2.0)


class WorldQueue:
    """The router's queue and fairness counters in the simulated world (module docstring). The
    counters and backlogs are lists indexed by the stream's tenant id (``tid``: a request's tenant as
    a dense index into ``names``), so a placement or a completion -- every step, queue or not -- is two
    list reads and one add; the names only appear where the rules order the queue."""

    def __init__(self, cfg: AdmissionConfig, tenants: np.ndarray, bands: np.ndarray, arrival: np.ndarray,
                 ttft_ms: np.ndarray):
        self.limit = cfg.queue_limit
        names, tid = np.unique(np.asarray(tenants, dtype=str), return_inverse=True)
        #: the stream's tenant names (the counters' keys, as the router's) and each request's index into them
        self.names: list[str] = names.tolist()
        self.tid: list[int] = tid.ravel().tolist()
        self.band = bands
        self.arrival = arrival
        self.ttft_s = ttft_ms / 1000.0
        #: each tenant's fairness weight (``admission.tenants``; 1 for one not listed)
        self.weights: list[float] = [cfg.tenants[n].weight if n in cfg.tenants else 1.0 for n in self.names]
        self.begin()

    def begin(self) -> None:
        """An empty queue and counters (an episode's start)."""
        #: the stream positions waiting, in arrival order
        self.queue: list[int] = []
        #: each tenant's counter (weighted service), and its requests waiting (by tenant id)
        self.counters: list[float] = [0.0] * len(self.names)
        self.backlog: list[int] = [0] * len(self.names)
        #: the requests waiting per band (by band index)
        self.per_band: list[int] = [0] * len(ar.BANDS)
        #: the expected output each request in service was counted with (corrected at its completion)
        self.counted: dict[int, float] = {}

    @property
    def weight(self) -> dict[str, float]:
        """Each tenant's fairness weight, by name."""
        return dict(zip(self.names, self.weights))

    def by_name(self) -> dict[str, float]:
        """Each tenant's counter, by name (what ``admission_rules.dispatch_order`` reads)."""
        return dict(zip(self.names, self.counters))

    def enqueue(self, pos: int) -> None:
        """Request ``pos`` waits; its tenant, idle until now, has its counter lifted (``lift``)."""
        k = self.tid[pos]
        if not self.backlog[k]:
            others = [c for c, b in zip(self.counters, self.backlog) if b]
            self.counters[k] = ar.lift(self.counters[k], others)
        self.backlog[k] += 1
        self.per_band[int(self.band[pos])] += 1
        self.queue.append(pos)

    def remove(self, pos: int) -> None:
        self.queue.remove(pos)
        self.backlog[self.tid[pos]] -= 1
        self.per_band[int(self.band[pos])] -= 1

    def ahead(self, band: int) -> bool:
        """Whether an arrival of ``band`` (a band index) finds a request dispatched before it waiting
        (``admission_rules.waits_ahead``)."""
        return ar.waits_ahead(ar.BANDS[band], self.per_band)

    @property
    def full(self) -> bool:
        return len(self.queue) >= self.limit

    def expiry(self, pos: int) -> float:
        """When request ``pos``'s TTFT budget is spent (its arrival + its TTFT SLO)."""
        return float(self.arrival[pos] + self.ttft_s[pos])

    def next_expiry(self) -> float:
        return min((self.expiry(p) for p in self.queue), default=np.inf)

    def expired(self, t: float) -> int | None:
        """The first-arrived waiting request whose budget is spent at ``t`` (None: none)."""
        for p in self.queue:
            if self.expiry(p) <= t:
                return p
        return None

    def order(self) -> list[int]:
        """The waiting requests in dispatch order (``admission_rules.dispatch_order``)."""
        q, names = self.queue, self.names
        idx = ar.dispatch_order([(int(self.band[p]), names[self.tid[p]], float(self.arrival[p])) for p in q],
                                self.by_name())
        return [q[i] for i in idx]

    def admitted(self, pos: int, input_tokens: float, expected_output: float) -> None:
        """Request ``pos`` is placed: its tenant's counter grows by its service at its expected output."""
        k = self.tid[pos]
        self.counters[k] += ar.service(input_tokens, expected_output, self.weights[k])
        self.counted[pos] = expected_output

    def completed(self, pos: int, output_tokens: float) -> None:
        """Request ``pos``'s completion is observed with ``output_tokens``: its counter is corrected."""
        exp = self.counted.pop(pos, None)
        if exp is not None:
            k = self.tid[pos]
            self.counters[k] += ar.correction(exp, output_tokens, self.weights[k])

    def save(self) -> dict[str, Any]:
        return {"queue": list(self.queue), "counters": list(self.counters), "backlog": list(self.backlog),
                "counted": dict(self.counted), "per_band": list(self.per_band)}

    def restore(self, d: dict[str, Any]) -> None:
        self.queue, self.counters = list(d["queue"]), list(d["counters"])
        self.backlog, self.counted = list(d["backlog"]), dict(d["counted"])
        self.per_band = list(d["per_band"])

    def copy(self) -> WorldQueue:
        """A copy with its own queue and counters (``models.warmstart.fork``); the stream's arrays shared."""
        new = object.__new__(WorldQueue)
        new.__dict__.update(self.__dict__)
        new.restore(self.save())
        return new
