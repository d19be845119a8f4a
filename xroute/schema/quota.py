"""Tenant quotas -- defined here only.

A tenant's quotas (``router.core.settings.TenantConfig.quotas``; the simulated world's
``xroute.config.EnvConfig.tenants``) are :class:`TenantQuotas`: limits for the tenant as a whole
and, under ``models``, for its requests of one model. Every limit is optional (absent: none):

* ``max_concurrent`` -- requests admitted and not yet reported (feedback) or past their hold;
* ``tokens_per_minute`` -- a true sliding window: the tokens of the requests admitted in the last
  60 s (not a fixed minute, which admits up to twice the limit across its edge). A request counts
  ``input_tokens + max_output_tokens`` when admitted; its feedback reconciles that with what it
  really used (:func:`settled_amounts`) while it is still in the window;
* ``requests_per_day`` -- requests admitted in the current day;
* ``usd_per_day`` -- the expected cost of the offering a request is admitted to, reserved when it
  is admitted and reconciled with its reported cost on feedback.

A "day" is a UTC day in the router (it resets at midnight UTC); the simulation's day is
``EnvConfig.budget_period_s`` long (86,400 s by default).

A request is admitted only when every limit of every bucket it counts in -- the tenant's, and the
(tenant, model) one -- has room for it; then it is counted in all of them at once (all or
nothing). Over a limit the router answers 429 with ``Retry-After`` and the limit that was hit
(:class:`QuotaHit`, in :class:`TooManyRequests`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from xroute.schema.decision import ErrorResponse

#: the length of a quota day in the router (seconds; UTC days)
DAY_S = 86_400.0
#: the sliding window of ``tokens_per_minute`` (seconds)
WINDOW_S = 60.0
#: the limits, in the order a request is checked against them (and the order a 429 names the first hit)
LIMITS: tuple[str, ...] = ("max_concurrent", "tokens_per_minute", "requests_per_day", "usd_per_day")


class QuotaLimits(BaseModel):
    """Limits of one bucket (module docstring); absent = no limit, 0 = nothing is admitted."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_concurrent: int | None = Field(None, ge=0, description="requests admitted and not yet reported or expired")
    tokens_per_minute: int | None = Field(
        None, ge=0, description="tokens (input + max output at admission, reconciled on feedback) of the requests "
                                "admitted in the last 60 s (a sliding window)")
    requests_per_day: int | None = Field(None, ge=0, description="requests admitted in the current UTC day")
    usd_per_day: float | None = Field(
        None, ge=0, description="expected cost of the requests admitted in the current UTC day (reconciled with the "
                                "reported cost on feedback)")

    @property
    def own_empty(self) -> bool:
        """No limit of its own (a :class:`TenantQuotas`' per-model limits aside)."""
        return all(getattr(self, k) is None for k in LIMITS)

    @property
    def empty(self) -> bool:
        return self.own_empty

    def as_tuple(self) -> tuple[float, float, float, float]:
        """The limits in :data:`LIMITS` order, -1 where absent (what the state backends take)."""
        return tuple(-1.0 if getattr(self, k) is None else float(getattr(self, k)) for k in LIMITS)  # type: ignore[return-value]


class TenantQuotas(QuotaLimits):
    """A tenant's quotas: its own limits, and per model (``models``: model name -> limits)."""

    models: dict[str, QuotaLimits] = Field(
        default_factory=dict, description="limits on the tenant's requests of one model (model name -> limits)")

    @property
    def empty(self) -> bool:
        return self.own_empty and all(m.empty for m in self.models.values())


Scope = Literal["tenant", "tenant_model"]


@dataclass(frozen=True, slots=True)
class QuotaBucket:
    """One bucket a request counts in: its state key (:func:`bucket_key`), what it is, its limits
    (:meth:`QuotaLimits.as_tuple`)."""

    key: str
    scope: Scope
    tenant: str
    model: str | None
    limits: tuple[float, float, float, float]


def bucket_key(tenant: str, model: str | None = None) -> str:
    """The state's key of a tenant's bucket (``t:<tenant>``) or of a (tenant, model) bucket
    (``m:<tenant>|<model>``)."""
    return f"t:{tenant}" if model is None else f"m:{tenant}|{model}"


def buckets_for(quotas: TenantQuotas | None, tenant: str, model: str) -> list[QuotaBucket]:
    """The buckets a request of ``tenant`` for ``model`` counts in: the (tenant, model) one when it
    has limits, then the tenant's when it has any."""
    if quotas is None:
        return []
    out = []
    per_model = quotas.models.get(model)
    if per_model is not None and not per_model.empty:
        out.append(QuotaBucket(bucket_key(tenant, model), "tenant_model", tenant, model, per_model.as_tuple()))
    if not quotas.own_empty:
        out.append(QuotaBucket(bucket_key(tenant), "tenant", tenant, None, quotas.as_tuple()))
    return out


def day_index(wall: float, day_s: float = DAY_S) -> int:
    """Which day ``wall`` (seconds since the epoch) falls in."""
    return math.floor(wall / day_s)


def seconds_to_next_day(wall: float, day_s: float = DAY_S) -> float:
    return (day_index(wall, day_s) + 1) * day_s - wall


def settled_amounts(reserved_tokens: int, reserved_usd: float, input_tokens: int, output_tokens: int | None,
                    cost_usd: float | None, failed: bool) -> tuple[int, float]:
    """What a reported request finally counts (tokens, USD): ``input_tokens`` plus the reported
    output (a failed request without one: its input only; a completed one without one: what was
    reserved), and the reported cost (without one: what was reserved -- its expected cost)."""
    if output_tokens is not None:
        tokens = int(input_tokens) + int(output_tokens)
    elif failed:
        tokens = int(input_tokens)
    else:
        tokens = int(reserved_tokens)
    return tokens, float(reserved_usd if cost_usd is None else cost_usd)


class QuotaHit(BaseModel):
    """The limit a request was refused for (the 429's ``limit``)."""

    scope: Scope = Field(description="'tenant' (the tenant's own limits) or 'tenant_model' (its limits for one model)")
    tenant: str
    model: str | None = None
    name: str = Field(description="which limit: max_concurrent, tokens_per_minute, requests_per_day, usd_per_day")
    limit: float
    used: float = Field(description="what the bucket holds now (for usd_per_day: USD; else requests or tokens)")
    requested: float = Field(description="what the request would have added")
    retry_after_s: float = Field(description="when the request could fit, as far as the router can tell (seconds)")


class TooManyRequests(ErrorResponse):
    """The 429 body: ``error`` is ``quota_exceeded`` (``limit`` says which) or ``no_capacity`` (no
    allowed offering can take the request now; ``excluded`` counts why)."""

    model_config = ConfigDict(extra="allow")

    limit: QuotaHit | None = None
    excluded: dict[str, int] | None = None


def quota_hit_json(bucket: QuotaBucket, name: str, limit: float, used: float, requested: float,
                   retry_after_s: float) -> dict[str, Any]:
    """A :class:`QuotaHit` as the JSON the 429 carries."""
    return {"scope": bucket.scope, "tenant": bucket.tenant, "model": bucket.model, "name": name, "limit": limit,
            "used": used, "requested": requested, "retry_after_s": round(max(retry_after_s, 0.0), 3)}
