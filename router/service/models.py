"""The model slot's service: which registered model decides (``RoutingEngine``'s slot,
``router.decision.model_slot``), loaded at start and swapped in between decisions when the alias it
follows moves (``model_poll_s``), with the fallback and the reason recorded on every decision."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from router.core.logs import LOG
from router.core.metrics import Metrics
from router.core.settings import RouterSettings
from router.decision.engine import RoutingEngine
from router.decision.model_slot import ActivePolicy, import_loader, resolve


class ModelManager:
    """Loads the configured model, validates it, and swaps it in; never raises to its caller."""

    def __init__(self, engine: RoutingEngine, settings: RouterSettings, metrics: Metrics):
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self._lock = asyncio.Lock()

    def _fail(self, stage: str, error: BaseException | str) -> str:
        msg = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        msg = f"{stage}: {msg}"[:500]
        self.engine.slot.failed(msg)
        self.metrics.model_errors.labels(stage).inc()
        LOG.warning("model not loaded; keeping the current policy", extra={"fields": {
            "stage": stage, "error": msg, "serving": (self.engine.slot.model or self.engine.slot.fallback).name}})
        self._publish()
        return "error"

    def _publish(self) -> None:
        m = self.engine.slot.model or self.engine.slot.fallback
        self.metrics.set_model(m.name, m.kind, m.version)

    def _prepare(self, policy: Any, version: str, uri: str) -> ActivePolicy:
        """Reset against the live env and answer one decision on a sampled observation."""
        env = self.engine.env
        policy.reset(env, 0)
        name = str(getattr(policy, "name", "") or uri)
        active = ActivePolicy.make(policy, name, "model", version, uri)
        space = env.observation_space
        space.seed(0)
        obs = space.sample()
        mask = np.zeros(env.N, dtype=bool)
        mask[: env.n] = True
        obs["mask"] = mask.astype(np.float32)
        idx = np.flatnonzero(mask)
        if active.scorer is not None:
            s = np.asarray(active.scorer(obs["offerings"].reshape(env.N, -1)[idx], obs["request"]))
            if s.shape != idx.shape or not np.isfinite(s).all():
                raise ValueError(f"smoke decision: scores of shape {s.shape}, finite={np.isfinite(s).all()}")
        else:
            a = policy.act(obs, {"action_mask": mask})
            if not (0 <= int(a) < env.n):
                raise ValueError(f"smoke decision: action {a} outside 0..{env.n - 1}")
        return active

    async def check(self, force: bool = False) -> str:
        """Resolve the model URI; load, validate and install a new version. Returns
        ``"swapped"``, ``"unchanged"``, ``"disabled"`` or ``"error"``."""
        uri = self.settings.model_uri
        if not uri:
            return "disabled"
        async with self._lock:
            try:
                load_uri, version = await asyncio.to_thread(resolve, uri)
            except Exception as e:
                return self._fail("resolve", e)
            slot = self.engine.slot
            if version == slot.loaded_version and not force:
                return "unchanged"
            try:
                loader = import_loader(self.settings.model_loader)
                policy = await asyncio.to_thread(loader, load_uri)
            except Exception as e:
                return self._fail("load", e)
            try:
                active = self._prepare(policy, version, uri)
            except Exception as e:
                return self._fail("validate", e)
            old = slot.model.version if slot.model else None
            slot.install(active)
            self.metrics.model_swaps.inc()
            self._publish()
            LOG.info("model installed", extra={"fields": {"uri": uri, "version": version, "previous": old}})
            return "swapped"

    async def initial(self) -> None:
        self._publish()
        if not self.settings.model_uri:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self.check()), self.settings.model_load_timeout_s)
        except TimeoutError:
            self._fail("load", f"timed out after {self.settings.model_load_timeout_s:g} s; serving the fallback "
                               "and retrying in the background")

    async def watch(self) -> None:
        poll = self.settings.model_poll_s
        if poll <= 0 or not self.settings.model_uri:
            return
        while True:
            await asyncio.sleep(poll)
            await self.check()
