"""Tenant budgets and rate limits in the simulated world, as a router enforces them.

The limits are ``xroute.schema.quota``'s (``EnvConfig.tenants``: the workload's ``tenant`` column
picks the tenant; per-model limits under ``models``). The simulation keeps, per bucket (a tenant,
or a (tenant, model) pair), what a router's quota state keeps (``router.state.ledger``):

* the USD of the current period (``EnvConfig.budget_period_s``: the router's UTC day by default):
  at admission the *expected* cost of the offering chosen (what the router reserves), replaced by
  the realized cost when the request ends (the router's feedback);
* the requests admitted in the current period;
* the tokens of the last 60 s (a sliding window): ``input + max_output`` at admission, the real
  ``input + output`` once the request ends (if it is still in the window).

What a router does with a request, simulated alike (``CloudRouteEnv``): an offering whose expected
cost is more than the USD left is masked (reason ``budget``); a request over its tokens-per-minute
or requests-per-period limit, or that no offering's expected cost fits, is refused -- every
offering is masked, the request fails (no cost; charged as any failed request: the failure latency
and the SLA penalty). The decision-time state is in each request's features (:class:`LiveBudget`,
:func:`budget_features`): the USD left as a share of the budget, the time left in the period, the
tokens left in the window. Nothing here reads a request's realized outcome before it ends.

Before an episode's first request the tenant is taken to have spent at an even pace: the share of
the period elapsed, of its USD and request budgets (a training episode starts anywhere in a
stream); its window starts empty. ``max_concurrent`` is not simulated (the pools bound
concurrency already): an env config that sets it is refused, naming the field.
"""

from __future__ import annotations

import copy as _copy
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from xroute.errors import ConfigError
from xroute.schema.quota import LIMITS, WINDOW_S, TenantQuotas

#: refusal reasons (``CloudRouteEnv`` info ``refused``, stats ``refused_<reason>``)
REFUSED = ("", "budget", "rate_limit")
NOT_REFUSED, REFUSED_BUDGET, REFUSED_RATE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class LiveBudget:
    """A request's tenant budget as known when it is decided: the USD left (``inf``: no USD limit)
    and the limit (-1: none), the tokens left in the sliding window and the limit (-1: none), and
    the share of the period left (1 without a USD limit)."""

    usd_left: float = math.inf
    usd_limit: float = -1.0
    tokens_left: float = math.inf
    tokens_limit: float = -1.0
    period_left: float = 1.0


#: no budget: what every request of a tenant without limits sees
NO_BUDGET = LiveBudget()


def budget_features(b: LiveBudget) -> tuple[float, float, float]:
    """The request features ``budget_left``, ``period_left``, ``rate_left`` (``envs.features``):
    each in [0, 1], 1 where the tenant has no such limit."""
    usd = 1.0 if b.usd_limit < 0 else (0.0 if b.usd_limit == 0 else min(max(b.usd_left / b.usd_limit, 0.0), 1.0))
    rate = 1.0 if b.tokens_limit < 0 else (0.0 if b.tokens_limit == 0 else
                                           min(max(b.tokens_left / b.tokens_limit, 0.0), 1.0))
    period = 1.0 if b.usd_limit < 0 else min(max(b.period_left, 0.0), 1.0)
    return usd, period, rate


def check_tenants(tenants: dict[str, TenantQuotas], models: set[str], source: str = "env config") -> None:
    """Refuse what the simulation cannot honour: ``max_concurrent``, a model the models config lacks."""
    for name, q in tenants.items():
        for where, lim in [(f"tenants.{name}", q), *((f"tenants.{name}.models.{m}", v) for m, v in q.models.items())]:
            if lim.max_concurrent is not None:
                raise ConfigError(f"{source}: field '{where}.max_concurrent': not simulated (the pools bound "
                                  "concurrency); set it in the router's tenant quotas only")
        for m in q.models:
            if m not in models:
                raise ConfigError(f"{source}: field 'tenants.{name}.models.{m}': unknown model (known: "
                                  f"{', '.join(sorted(models))})")


class BudgetBook:
    """The budgets of one stream's tenants (module docstring). Buckets are numbered; each request
    of the stream counts in up to two (its (tenant, model) one, its tenant's)."""

    def __init__(self, tenants: dict[str, TenantQuotas], period_s: float, req_tenant: np.ndarray,
                 req_model: np.ndarray, model_names: tuple[str, ...], arrival: np.ndarray):
        limits: list[tuple[float, float, float, float]] = []
        index: dict[tuple[str, str | None], int] = {}
        for name, q in tenants.items():
            for m, lim in q.models.items():
                if not lim.empty:
                    index[(name, m)] = len(limits)
                    limits.append(lim.as_tuple())
            if not q.own_empty:
                index[(name, None)] = len(limits)
                limits.append(q.as_tuple())
        self.limits = np.array(limits, dtype=float).reshape(-1, len(LIMITS))
        self._lim = [tuple(float(x) for x in row) for row in self.limits]  # (plain floats: per-request Python)
        self.period_s = float(period_s)
        n = len(req_tenant)
        self.req_b = np.full((n, 2), -1, dtype=np.int64)
        for i, (tn, m) in enumerate(zip(req_tenant, req_model)):
            mn = model_names[int(m)] if int(m) >= 0 else None
            self.req_b[i, 0] = index.get((str(tn), mn), -1)
            self.req_b[i, 1] = index.get((str(tn), None), -1)
        #: each request's buckets, as tuples (empty: none)
        self.buckets_of: list[tuple[int, ...]] = [tuple(int(b) for b in row if b >= 0) for row in self.req_b]
        B = len(limits)
        self.B = B
        self.positions = [np.flatnonzero((self.req_b[:, 0] == b) | (self.req_b[:, 1] == b)) for b in range(B)]
        self._positions = [p.tolist() for p in self.positions]
        self.set_arrival(arrival)
        self.spent = [0.0] * B
        self.requests = [0.0] * B
        self.period = [0] * B
        self.wsum = [0.0] * B
        self.head = [0] * B
        self.tok = [0.0] * n

    def set_arrival(self, arrival: np.ndarray) -> None:
        """The stream's arrival times (seconds; ``rate_scale`` changes them)."""
        self.arrival = arrival
        self._arrival = arrival.tolist()

    def any(self) -> bool:
        return self.B > 0

    # ------------------------------------------------------------------ episodes
    def begin(self, start: int, t: float) -> None:
        """A new episode from stream position ``start`` at time ``t``: an even pace before it."""
        p = math.floor(t / self.period_s)
        frac = (t - p * self.period_s) / self.period_s
        self.spent = [lim[3] * frac if lim[3] >= 0 else 0.0 for lim in self._lim]
        self.requests = [lim[2] * frac if lim[2] >= 0 else 0.0 for lim in self._lim]
        self.period = [p] * self.B
        self.wsum = [0.0] * self.B
        self.tok = [0.0] * len(self.tok)
        self.head = [int(np.searchsorted(self.positions[b], start)) for b in range(self.B)]

    STATE = ("spent", "requests", "period", "wsum", "head", "tok")

    def save(self) -> dict[str, Any]:
        return {k: getattr(self, k).copy() for k in self.STATE}

    def restore(self, d: dict[str, Any]) -> None:
        for k in self.STATE:
            setattr(self, k, d[k].copy())

    def copy(self) -> BudgetBook:
        """An independent book in the same state, for a fork of the environment
        (``models.warmstart.fork``): the stream's tables (limits, buckets, positions, arrivals) are
        shared -- never written, ``set_arrival`` replaces them --, the state (:attr:`STATE`) copied,
        so spending in one leaves the other's budgets as they were."""
        c = _copy.copy(self)
        for k in self.STATE:
            setattr(c, k, getattr(self, k).copy())
        return c

    # ------------------------------------------------------------------ time
    def _roll(self, b: int, t: float) -> None:
        p = math.floor(t / self.period_s)
        if p > self.period[b]:
            self.period[b] = p
            self.spent[b] = 0.0
            self.requests[b] = 0.0
        pos, arr, cut = self._positions[b], self._arrival, t - WINDOW_S
        h = self.head[b]
        n = len(pos)
        if h < n and arr[pos[h]] <= cut:
            tok, s = self.tok, self.wsum[b]
            while h < n and arr[pos[h]] <= cut:
                s -= tok[pos[h]]
                h += 1
            self.wsum[b] = s
            self.head[b] = h

    # ------------------------------------------------------------------ a request
    def check(self, i: int, t: float, tokens: float) -> tuple[LiveBudget, int]:
        """Stream request ``i`` at ``t`` asking for ``tokens`` (input + max output): its budget as
        known now and whether it is refused outright (``REFUSED_*``; a budget that no offering's
        expected cost fits is found by the caller, from ``usd_left``)."""
        usd_left = tok_left = math.inf
        usd_lim = tok_lim = -1.0
        period_left = 1.0
        refuse = NOT_REFUSED
        for b in self.buckets_of[i]:
            self._roll(b, t)
            _, tpm, rpd, usd = self._lim[b]
            if tpm >= 0:
                left = tpm - self.wsum[b]
                if left < tok_left:
                    tok_left, tok_lim = left, tpm
                if self.wsum[b] + tokens > tpm:
                    refuse = REFUSED_RATE
            if rpd >= 0 and self.requests[b] + 1 > rpd:
                refuse = REFUSED_RATE
            if usd >= 0:
                left = usd - self.spent[b]
                if left < usd_left or usd_lim < 0:
                    usd_left, usd_lim = left, usd
                    period_left = ((self.period[b] + 1) * self.period_s - t) / self.period_s
        return LiveBudget(usd_left, usd_lim, tok_left, tok_lim, period_left), refuse

    def admit(self, i: int, tokens: float, usd: float) -> tuple[int, ...]:
        """Request ``i`` admitted: ``tokens`` and ``usd`` counted in its buckets (``check`` rolled
        them to its time). Returns the periods it counted in (for :meth:`settle`)."""
        out = []
        for b in self.buckets_of[i]:
            self.spent[b] += usd
            self.requests[b] += 1
            self.wsum[b] += tokens
            out.append(self.period[b])
        self.tok[i] = tokens
        return tuple(out)

    def settle(self, i: int, t: float, periods: tuple[int, ...], reserved_usd: float, tokens: float,
               usd: float) -> None:
        """Request ``i`` ended at ``t`` (the router learns its outcome): it counts its real
        ``tokens`` (while in the window) and ``usd`` (in the period it was admitted in)."""
        for b, p in zip(self.buckets_of[i], periods):
            self._roll(b, t)
            if self.period[b] == p:
                self.spent[b] += usd - reserved_usd
            h = self.head[b]
            pos = self._positions[b]
            if h < len(pos) and pos[h] <= i:  # (positions ascend: i is at or after the window's oldest)
                self.wsum[b] += tokens - float(self.tok[i])
        self.tok[i] = tokens
