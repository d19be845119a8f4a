"""Tenant quotas on the decision path (``docs/quotas.md``): which buckets a request counts in, what
the decisions know of them, the 429, and the quota events the decision log implies.

* :class:`QuotaPlan` -- the tenants' quotas from the settings (``tenants.<name>.quotas``) as the
  buckets of each (tenant, model) (``xroute.schema.quota.buckets_for``), checked against the
  served models;
* :class:`QuotaView` -- what the decisions read of the buckets with a shared server: the usage
  read with the shared view (``router.service.recovery.refresh_shared_view``), plus this
  process's own reservations since; the embedded state is read directly (``quota_reader``: exact,
  in process);
* :func:`live_budget` -- a request's tenant budget as the environment takes it
  (``envs.budget.LiveBudget``: its features, and the offerings it cannot afford masked);
* :func:`quota_failure` -- the 429 ``quota_exceeded`` naming the limit hit, with ``Retry-After`` (as
  the arguments of ``router.decision.engine.RouteFailure``, which the engine raises);
* :func:`quota_events` -- the reservations and settles a decision log implies, to rebuild the
  counters after a restart (the state's ``restore``, ``router.service.ports.Recovery``).

The check that admits a request is the state's (its ``admit`` with a quota charge,
``router.service.ports.DecisionState``: atomic and exact across every router sharing it); the view
only shapes the decision (features, the budget mask).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from envs.budget import LiveBudget
from router.core.logs import id_floor
from router.state.ledger import QuotaReserved, QuotaSettled, QuotaUsage, QuotaVerdict
from router.store.dialect import reading
from xroute.errors import ConfigError
from xroute.schema.quota import (
    DAY_S,
    QuotaBucket,
    TenantQuotas,
    buckets_for,
    quota_hit_json,
    seconds_to_next_day,
    settled_amounts,
)


class QuotaPlan:
    """The buckets of each (tenant, model), from the tenants' settings (module docstring)."""

    def __init__(self, tenants: Mapping[str, Any], models: Sequence[str]):
        self.quotas: dict[str, TenantQuotas] = {}
        for name, t in tenants.items():
            q = getattr(t, "quotas", None)
            if q is None or q.empty:
                continue
            for m in q.models:
                if m not in models:
                    raise ConfigError(f"router settings: field 'tenants.{name}.quotas.models.{m}': unknown model "
                                      f"'{m}' (known: {', '.join(models)})")
            self.quotas[name] = q
        self._cache: dict[tuple[str, str], list[QuotaBucket]] = {}
        self._budgeted: dict[tuple[str, str], tuple[list[QuotaBucket], list[str]]] = {}
        self._keys: list[str] | None = None

    def __bool__(self) -> bool:
        return bool(self.quotas)

    def buckets(self, tenant: str, model: str) -> list[QuotaBucket]:
        """The buckets a request of ``tenant`` for ``model`` counts in (none: no quota applies)."""
        key = (tenant, model)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = buckets_for(self.quotas.get(tenant), tenant, model)
        return got

    def budgeted(self, tenant: str, model: str) -> tuple[list[QuotaBucket], list[str]]:
        """The buckets of :meth:`buckets` with a USD or a token limit (what a decision's budget
        reads: :func:`live_budget`), and their keys."""
        key = (tenant, model)
        got = self._budgeted.get(key)
        if got is None:
            bs = [b for b in self.buckets(tenant, model) if b.limits[1] >= 0 or b.limits[3] >= 0]
            got = self._budgeted[key] = (bs, [b.key for b in bs])
        return got

    def keys(self) -> list[str]:
        """Every bucket the settings name (what the shared view reads)."""
        if self._keys is not None:
            return self._keys
        out = set()
        for tenant, q in self.quotas.items():
            for b in buckets_for(q, tenant, ""):
                out.add(b.key)
            for m in q.models:
                out.update(b.key for b in buckets_for(q, tenant, m))
        self._keys = sorted(out)
        return self._keys


class QuotaView:
    """The buckets' usage as the decisions see it with a shared server: read with the shared view
    (:meth:`apply`), plus what this process reserved since (:meth:`add_own`)."""

    def __init__(self) -> None:
        self.usage: dict[str, QuotaUsage] = {}
        self._own: dict[str, tuple[int, float]] = {}

    def apply(self, usage: dict[str, QuotaUsage]) -> None:
        self.usage = usage
        self._own = {}

    def add_own(self, buckets: Sequence[QuotaBucket], tokens: int, usd: float) -> None:
        for b in buckets:
            t, u = self._own.get(b.key, (0, 0.0))
            self._own[b.key] = (t + tokens, u + usd)

    def get(self, keys: Sequence[str]) -> dict[str, QuotaUsage]:
        out = {}
        for k in keys:
            u = self.usage.get(k, QuotaUsage())
            own = self._own.get(k)
            if own is not None:
                u = QuotaUsage(u.concurrent, u.tokens_window + own[0], u.requests_day, u.usd_day + own[1])
            out[k] = u
        return out


def live_budget(buckets: Sequence[QuotaBucket], usage: Mapping[str, QuotaUsage], wall: float
                ) -> tuple[LiveBudget | None, int]:
    """The request's budget (the tightest USD and token limits of its buckets; ``envs.budget``)
    and the index of the bucket whose USD binds (-1: none); None when no bucket has either limit."""
    usd_left = tok_left = math.inf
    usd_lim = tok_lim = -1.0
    binding = -1
    for i, b in enumerate(buckets):
        _, tpm, _, usd = b.limits
        u = usage.get(b.key) or QuotaUsage()
        if tpm >= 0 and tpm - u.tokens_window < tok_left:
            tok_left, tok_lim = tpm - u.tokens_window, tpm
        if usd >= 0 and (usd - u.usd_day < usd_left or usd_lim < 0):
            usd_left, usd_lim, binding = usd - u.usd_day, usd, i
    if usd_lim < 0 and tok_lim < 0:
        return None, -1
    period = seconds_to_next_day(wall) / DAY_S if usd_lim >= 0 else 1.0
    return LiveBudget(usd_left, usd_lim, tok_left, tok_lim, period), binding


def quota_failure(bucket: QuotaBucket, v: QuotaVerdict) -> dict[str, Any]:
    """The 429 for a request over ``bucket``'s limit ``v.name``: ``Retry-After`` (whole seconds,
    at least 1) and the limit in the body (``xroute.schema.quota.QuotaHit``). A request that can
    never fit -- more tokens than ``tokens_per_minute`` by itself -- is a 422 naming its
    ``max_output_tokens``."""
    who = f"tenant '{bucket.tenant}'" + (f" for model '{bucket.model}'" if bucket.model else "")
    if not math.isfinite(v.retry_after_s):
        return {"status": 422, "error": "quota_too_small",
                "message": f"the request alone ({v.requested:g} tokens: input + max_output_tokens) is over {who}'s "
                           f"{v.name} ({v.limit:g})",
                "fields": [{"field": "body.max_output_tokens", "message": f"input + max_output_tokens exceeds the "
                            f"{v.name} quota ({v.limit:g})", "suggestions": []}]}
    retry = min(max(1, math.ceil(v.retry_after_s)), int(DAY_S))
    unit = "USD" if v.name == "usd_per_day" else ("tokens" if v.name == "tokens_per_minute" else "requests")
    return {"status": 429, "error": "quota_exceeded",
            "message": f"{who} is over its {v.name} quota (limit {v.limit:g}, in use {v.used:g} {unit}, this request "
                       f"{v.requested:g}); retry after {retry} s",
            "headers": {"Retry-After": str(retry)},
            "extra": {"limit": quota_hit_json(bucket, v.name, v.limit, v.used, v.requested, retry)}}


def budget_failure(bucket: QuotaBucket, budget: LiveBudget, cheapest_usd: float, wall: float,
                   excluded: dict[str, int]) -> dict[str, Any]:
    """The 429 for a request no allowed offering of which its tenant's USD left can pay for (as
    the decision saw the budget), naming ``usd_per_day``; ``Retry-After``: the next UTC day."""
    v = QuotaVerdict(False, 0, "usd_per_day", budget.usd_limit, budget.usd_limit - budget.usd_left, cheapest_usd,
                     seconds_to_next_day(wall))
    f = quota_failure(bucket, v)
    f["extra"]["excluded"] = excluded
    return f


def quota_events(target: Path | str, since: float, keys_of: Callable[[str, str], Sequence[str]],
                 before: float | None = None) -> Iterator[QuotaReserved | QuotaSettled]:
    """The tenant quota reservations the decision log holds from wall time ``since`` on (decisions
    charged a quota: ``quota_tokens`` set), oldest first, each followed by its settle when it has
    feedback (its first: what ``POST /v1/feedback`` settled, ``settled_amounts``). ``keys_of(tenant,
    model)``: the buckets it counts in now (the settings' quotas). ``before``: only decisions made
    before that wall time -- what a shared state begun then lost."""
    upto = "" if before is None else " AND d.created_at < ?"
    sql = ("SELECT d.decision_id, d.tenant, d.model, d.created_at, d.hold_until, d.input_tokens, d.quota_tokens, "
           "d.quota_usd, f.output_tokens, f.cost_usd, f.failed FROM decisions d LEFT JOIN feedback f ON "
           "f.feedback_id = (SELECT MIN(feedback_id) FROM feedback WHERE decision_id = d.decision_id) "
           "WHERE d.decision_id >= ? AND d.created_at >= ? AND d.quota_tokens IS NOT NULL" + upto
           + " ORDER BY d.created_at, d.decision_id")
    args: tuple[Any, ...] = (id_floor(since), since) if before is None else (id_floor(since), since, before)
    with reading(target) as query:
        rows = query(sql, args)
    for did, tenant, model, created, hold_until, n_in, q_tok, q_usd, out, cost, failed in rows:
        keys = tuple(keys_of(str(tenant), str(model)))
        if not keys:
            continue
        until = float(hold_until) if hold_until is not None else float(created)
        yield QuotaReserved(str(did), keys, int(q_tok), float(q_usd), float(created), until)
        if failed is not None:
            tok, usd = settled_amounts(int(q_tok), float(q_usd), int(n_in), None if out is None else int(out),
                                       None if cost is None else float(cost), bool(failed))
            yield QuotaSettled(str(did), tok, usd)
