"""The capacity plan the router answers (``GET /v1/capacity/plan``; issue 37, item 4; docs/capacity.md,
"Planning in the service").

Contract:

* **What.** The plan of ``capacity.planner`` (a baseline, or a learned planner from MLflow:
  ``models:/xroute-planner@champion``) made by ``models.capacity_plan.PlanMaker`` -- the one code
  path of ``xroute plan`` -- from the router's own telemetry: the engine's current bundle (the
  replayed recording, or the live collector's last commit, inventory included) at the start of the
  current epoch of telemetry time (``capacity.epoch_s``; a replay's clock), so the routers on one
  telemetry answer one plan within an epoch.
* **Off the event loop, once per epoch.** The plan is computed in a worker thread
  (``asyncio.to_thread``) and cached per (telemetry hash, epoch); callers of one epoch wait for
  the one computation. The planner (its model downloaded once) and the provisioning world are
  built on first use and again when the telemetry changes (a live commit).
* **Cannot plan.** A planner that cannot be loaded (a model that is not registered) or cannot plan
  (no request before the plan time: the forecast needs the past) raises :class:`PlanUnavailable`,
  answered 503 with the reason; nothing is cached, so the next call tries again (a model
  registered since is picked up).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from router.core.settings import CapacitySettings
from router.decision.engine import RoutingEngine
from xroute.config import CapacityConfig, config_path, load_config
from xroute.errors import XrouteError
from xroute.schema.capacity import CapacityPlan

if TYPE_CHECKING:
    from models.capacity_plan import PlanMaker


class PlanUnavailable(Exception):
    """The planner cannot plan now (the message says why); answered 503."""


class CapacityPlans:
    """The router's capacity plan, per epoch (module docstring)."""

    def __init__(self, settings: CapacitySettings, engine: RoutingEngine, clock: Callable[[], float] = time.time):
        self.settings, self.engine, self.clock = settings, engine, clock
        self._lock = asyncio.Lock()
        self._key: tuple[str, float] | None = None
        self._plan: CapacityPlan | None = None
        self._maker: tuple[str, PlanMaker] | None = None
        self._build = threading.Lock()  # (the worker thread's: one maker built at a time)

    def epoch_start(self) -> float:
        """The start of the current epoch of telemetry time."""
        t, _ = self.engine.source.telemetry_time(self.clock())
        step = self.settings.epoch_s
        return math.floor(t / step) * step

    async def current(self) -> CapacityPlan:
        """The plan of the current epoch (cached), or :class:`PlanUnavailable`."""
        bundle = self.engine.env.bundle
        key = (bundle.content_hash, self.epoch_start())
        if self._key == key and self._plan is not None:
            return self._plan
        async with self._lock:
            if self._key == key and self._plan is not None:
                return self._plan
            plan = await asyncio.to_thread(self._make, bundle, key[1])
            self._key, self._plan = key, plan
            return plan

    def _make(self, bundle: Any, at: float) -> CapacityPlan:
        # (scipy's ILP and the world: loaded on the first plan, not at the router's start)
        from models.capacity_plan import PlanMaker

        try:
            with self._build:
                if self._maker is None or self._maker[0] != bundle.content_hash:
                    cfg = load_config(CapacityConfig, config_path(self.settings.config))
                    cfg = cfg.model_copy(update={"world": cfg.world.model_copy(
                        update={"epoch_s": self.settings.epoch_s})})
                    self._maker = (bundle.content_hash, PlanMaker(bundle, self.settings.planner, cfg,
                                                                  source=self.engine.source_name))
                maker = self._maker[1]
            return maker.plan(at)
        except XrouteError as e:
            why = str(e).removeprefix("--policy: ").removeprefix("--at: ")
            raise PlanUnavailable(f"capacity.planner '{self.settings.planner}' cannot plan now: {why}") from None
