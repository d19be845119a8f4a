"""The capacity plan now: what a planner wants held in each pool at one instant of real telemetry
(issue 37, item 4) -- the one code path of ``xroute plan`` and the router's ``GET /v1/capacity/plan``.

:class:`PlanMaker` binds a telemetry bundle (a recorded one, or a live collector's directory) and a
planner -- a baseline by name (``models.planners``) or a learned one (``models:/xroute-planner@champion``,
``runs:/...``, an export directory: ``models.planner_policy``) -- and :meth:`PlanMaker.plan` answers a
:class:`~xroute.schema.capacity.CapacityPlan` for a time ``at``:

1. the planner's decision-time view at ``at`` (``envs.provisioning.ProvisionWorld.decision_view``):
   every request before ``at`` as history, the telemetry at or before it, the instances the bundle's
   ``inventory`` table reports running (``ready``) and launching -- nothing after ``at``;
2. a fresh planner (``reset`` on that context, then one ``plan``): its first plan, as when it takes
   over a running service;
3. per pool, the target beside ``current`` (the inventory's running instances; ``None`` where it
   reports nothing) and the reasons it read: the forecast requests/s of the pool's model (the
   baselines' forecast: the busiest 15-s window of the last 300 s, plus the margin), the recorded
   availability and the preemption hazard (spot pools), the price, the tightest TTFT objective of the
   model's requests, and a one-line note.

The hindsight oracle is refused (it plans with the future). Errors are ``ConfigError`` naming the
option (``--policy``, ``--at``). Numpy and SciPy only: the router imports it (``core-without-training``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import numpy as np

from envs.provisioning import PlanContext, PlanView, ProvisionWorld
from models.planner_policy import LearnedPlanner, planner_factory
from models.planners import forecast
from xroute.bundle import Bundle
from xroute.config import CapacityConfig, PlannersConfig
from xroute.errors import ConfigError
from xroute.schema.capacity import CapacityPlan, PoolReasons, PoolTarget

__all__ = ["PlanMaker", "build_plan", "plan_table"]


class PlanMaker:
    """``bundle`` and the planner named ``planner``, ready to plan at any time (module docstring).
    Building it reads the bundle into a provisioning world and loads the planner once (a learned
    one's export is read or downloaded here): an unknown planner or a missing model fails here."""

    def __init__(self, bundle: Bundle, planner: str, cfg: CapacityConfig | None = None, source: str = ""):
        if planner == "oracle":
            raise ConfigError("--policy: 'oracle' plans with hindsight (the true future load and availability), "
                              "which a plan made now does not have")
        self.cfg = cfg or CapacityConfig()
        self.planner = planner
        self.factory: Callable[[], Any] = planner_factory(planner, self.cfg.planners)
        self.world = ProvisionWorld(bundle, self.cfg.world)
        self.bundle = bundle
        self.source = source or f"{bundle.path.name}@{bundle.content_hash}"

    def plan(self, at: float) -> CapacityPlan:
        """The plan at telemetry time ``at`` (seconds since the epoch)."""
        if not math.isfinite(at):
            raise ConfigError(f"--at: not a time ({at})")
        ctx, view = self.world.decision_view(at)
        if ctx.hist_t.size == 0:
            raise ConfigError(f"--at: {_iso(at)} is before the telemetry's first request: the planners forecast from "
                              "the requests before the plan")
        p = self.factory()
        p.reset(ctx)
        targets = np.asarray(p.plan(view), dtype=np.int64)
        _, _, known = self.world.inventory_at(at)
        note = _learned_notes(p) if isinstance(p, LearnedPlanner) else None
        return build_plan(ctx, view, targets, known, getattr(p, "display_name", self.planner), self.source,
                          self.cfg.planners, note)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _learned_notes(p: LearnedPlanner) -> Callable[[int], str] | None:
    """The learned planner's own reasons per pool: eligibility and its effective price."""
    step = p.last
    if step is None:
        return None

    def note(k: int) -> str:
        if not step.eligible[k]:
            return "not eligible (recorded out, noticed or a recent failed launch)"
        return f"effective price x{math.exp(-float(step.scores[k])):.2f} of list; plan covers {step.need:.2f} req/s"

    return note


def build_plan(ctx: PlanContext, view: PlanView, targets: np.ndarray, known: np.ndarray, planner: str, source: str,
               pcfg: PlannersConfig, note_of: Callable[[int], str] | None = None) -> CapacityPlan:
    """The :class:`CapacityPlan` of ``targets`` (one per pool of ``ctx``) made from ``view``:
    ``current`` the view's ready instances where the inventory reports the pool (``known``)."""
    pl = ctx.pools
    fc = forecast(ctx, view, pcfg)  # per class, requests/s
    M = len(ctx.model_names)
    rps = np.bincount(ctx.class_model, weights=fc, minlength=M)
    ttft = np.full(M, np.nan)
    for c, m in enumerate(ctx.class_model.tolist()):
        if np.isfinite(ctx.class_ttft_ms[c]):
            ttft[m] = np.fmin(ttft[m], ctx.class_ttft_ms[c])
    price = view.price_h
    pools = []
    for k in range(pl.n):
        m, spot, tgt = int(pl.model[k]), bool(pl.is_spot[k]), int(targets[k])
        cur = int(view.ready[k]) if known[k] else None
        ok_price = bool(np.isfinite(price[k]))
        parts = [_change(cur, tgt)]
        if spot and not view.available[k]:
            parts.append("recorded out")
        if view.quota_room[k] <= 0:
            parts.append("no quota room")
        if note_of is not None:
            parts.append(note_of(k))
        reasons = PoolReasons(
            forecast_rps=round(float(rps[m]), 6), available=bool(view.available[k]) if spot else None,
            usd_per_hour=float(price[k]) if ok_price else None,
            hazard_per_hour=round(float(view.hazard[k]) * 3600.0, 9) if spot else None,
            ttft_ms=float(ttft[m]) if np.isfinite(ttft[m]) and ttft[m] > 0 else None,
            note="; ".join(parts)[:500])
        pools.append(PoolTarget(offering_id=pl.offering_ids[k], model=ctx.model_names[m], target=tgt, current=cur,
                                reasons=reasons))
    usd = float(np.nansum(np.where(np.isfinite(price), price, 0.0) * targets))
    return CapacityPlan(at=datetime.fromtimestamp(view.t, UTC), planner=planner, source=source, epoch_s=ctx.epoch_s,
                        usd_per_hour=round(usd, 6), pools=pools)


def _change(cur: int | None, tgt: int) -> str:
    if cur is None:
        return f"hold {tgt}" if tgt else "none"
    if tgt > cur:
        return f"scale up {cur} -> {tgt}"
    if tgt < cur:
        return f"scale down {cur} -> {tgt}"
    return f"keep {tgt}" if tgt else "none"


def plan_table(plan: CapacityPlan, show_all: bool = False) -> tuple[list[str], list[list[str]]]:
    """The plan as a table: one row per pool with a target or instances now (every pool with ``show_all``)."""
    head = ["pool", "mode", "$/h", "current", "target", "forecast req/s", "hazard /h", "reason"]
    rows = []
    for p in plan.pools:
        if not show_all and p.target == 0 and not p.current:
            continue
        r = p.reasons
        spot = r.available is not None or r.hazard_per_hour is not None
        rows.append([f"{p.model}@{p.offering_id}", "spot" if spot else "on-demand",
                     "-" if r.usd_per_hour is None else f"{r.usd_per_hour:.3f}",
                     "?" if p.current is None else str(p.current), str(p.target),
                     "-" if r.forecast_rps is None else f"{r.forecast_rps:.2f}",
                     "-" if r.hazard_per_hour is None else f"{r.hazard_per_hour:.3f}", r.note])
    return head, rows
