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
Python over the queued requests (a few hundred at most, only under overload); ``CloudRouteEnv``
drives it (when to try a dispatch, what the view predicts). No clock, no outcome: a request's
service is counted with its *expected* output when it is admitted and corrected when its
completion is observed, as the router counts it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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


class WorldQueue:
    """The router's queue and fairness counters in the simulated world (module docstring)."""

    def __init__(self, cfg: AdmissionConfig, tenants: np.ndarray, bands: np.ndarray, arrival: np.ndarray,
                 ttft_ms: np.ndarray):
        self.limit = cfg.queue_limit
        self.tenant = tenants  # (the stream's tenant names: the counters' keys, as the router's)
        self.band = bands
        self.arrival = arrival
        self.ttft_s = ttft_ms / 1000.0
        self.weight = {name: t.weight for name, t in cfg.tenants.items()}
        self.begin()

    def begin(self) -> None:
        """An empty queue and counters (an episode's start)."""
        #: the stream positions waiting, in arrival order
        self.queue: list[int] = []
        #: each tenant's counter (weighted service), and its requests waiting
        self.counters: dict[str, float] = {}
        self.backlog: dict[str, int] = {}
        #: the expected output each request in service was counted with (corrected at its completion)
        self.counted: dict[int, float] = {}

    def weight_of(self, tenant: str) -> float:
        return self.weight.get(tenant, 1.0)

    def enqueue(self, pos: int) -> None:
        """Request ``pos`` waits; its tenant, idle until now, has its counter lifted (``lift``)."""
        tn = str(self.tenant[pos])
        if not self.backlog.get(tn):
            others = [self.counters.get(x, 0.0) for x, k in self.backlog.items() if k]
            self.counters[tn] = ar.lift(self.counters.get(tn, 0.0), others)
            self.backlog[tn] = 0
        self.backlog[tn] += 1
        self.queue.append(pos)

    def remove(self, pos: int) -> None:
        self.queue.remove(pos)
        self.backlog[str(self.tenant[pos])] -= 1

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
        q = self.queue
        idx = ar.dispatch_order([(int(self.band[p]), str(self.tenant[p]), float(self.arrival[p])) for p in q],
                                self.counters)
        return [q[i] for i in idx]

    def admitted(self, pos: int, input_tokens: float, expected_output: float) -> None:
        """Request ``pos`` is placed: its tenant's counter grows by its service at its expected output."""
        tn = str(self.tenant[pos])
        self.counters[tn] = self.counters.get(tn, 0.0) + ar.service(input_tokens, expected_output, self.weight_of(tn))
        self.counted[pos] = expected_output

    def completed(self, pos: int, output_tokens: float) -> None:
        """Request ``pos``'s completion is observed with ``output_tokens``: its counter is corrected."""
        exp = self.counted.pop(pos, None)
        if exp is not None:
            tn = str(self.tenant[pos])
            self.counters[tn] += ar.correction(exp, output_tokens, self.weight_of(tn))

    def save(self) -> dict[str, Any]:
        return {"queue": list(self.queue), "counters": dict(self.counters), "backlog": dict(self.backlog),
                "counted": dict(self.counted)}

    def restore(self, d: dict[str, Any]) -> None:
        self.queue, self.counters = list(d["queue"]), dict(d["counters"])
        self.backlog, self.counted = dict(d["backlog"]), dict(d["counted"])

    def copy(self) -> WorldQueue:
        """A copy with its own queue and counters (``models.warmstart.fork``); the stream's arrays shared."""
        new = object.__new__(WorldQueue)
        new.__dict__.update(self.__dict__)
        new.restore(self.save())
        return new
