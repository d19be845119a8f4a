"""Capacity plans and their actuation -- the one place that defines them (issue 37; ``docs/capacity.md``).

* :class:`CapacityPlan` -- what a planner wants held now: per pool (offering x model) a target number of
  instances beside what the inventory says runs, with the reasons a planner read (forecast, availability,
  price, hazard, SLO). ``xroute plan`` writes it, ``GET /v1/capacity/plan`` answers it, ``xroute capacity
  apply`` reads it.
* :class:`CapacityChange` -- one intended change of one pool, recorded before it is made (so a run killed
  between two changes resumes without making one twice) and then marked applied or failed.
* :class:`ActuationLimits` -- the safety limits every apply is bounded by.

Provider-neutral: pools are offering ids; the cloud adapters map them to their groups.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

PLAN_VERSION: Literal[1] = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolReasons(_Strict):
    """What the planner read of a pool when it set its target (None: not known to it)."""

    forecast_rps: float | None = Field(None, ge=0, description="the load forecast for the pool's model, requests/s")
    available: bool | None = Field(None, description="the pool's recorded availability (spot) at plan time")
    usd_per_hour: float | None = Field(None, ge=0, description="an instance's price at plan time")
    hazard_per_hour: float | None = Field(None, ge=0, description="expected preemptions per instance-hour (spot)")
    ttft_ms: float | None = Field(None, gt=0, description="the TTFT objective the target is sized for")
    note: str = Field("", max_length=500, description="one line: why this target")


class PoolTarget(_Strict):
    offering_id: str = Field(min_length=1)
    model: str = Field(min_length=1)
    target: int = Field(ge=0, description="instances to hold")
    current: int | None = Field(None, ge=0, description="instances running now, as the inventory says (None: unknown)")
    reasons: PoolReasons = Field(default_factory=PoolReasons)


class CapacityPlan(_Strict):
    version: Literal[1] = PLAN_VERSION
    at: AwareDatetime = Field(description="when the plan was made (UTC)")
    planner: str = Field(min_length=1, description="the planner: a baseline's name or a models:/ URI")
    source: str = Field("", description="the telemetry it read: a bundle path/hash, or 'live'")
    epoch_s: float = Field(gt=0, description="how long the plan is meant to hold, seconds")
    usd_per_hour: float = Field(ge=0, description="what holding the targets costs per hour at plan-time prices")
    pools: list[PoolTarget]


ChangeState = Literal["intended", "applied", "failed", "skipped"]


class CapacityChange(_Strict):
    change_id: str = Field(min_length=1, description="stable id: the plan's time, the pool and the target")
    offering_id: str = Field(min_length=1)
    model: str = Field(min_length=1)
    before: int = Field(ge=0)
    after: int = Field(ge=0)
    state: ChangeState
    reason: str = Field("", max_length=500)
    at: datetime


class ActuationLimits(_Strict):
    """Every apply is bounded by these; a plan that breaks one is refused naming it, nothing changed."""

    max_usd_per_hour: float = Field(gt=0, description="the most the held instances may cost per hour, all pools")
    max_step: int = Field(ge=1, description="the most instances one pool may change by in one apply")
    dry_run: bool = Field(True, description="say what would change, change nothing (the default)")
