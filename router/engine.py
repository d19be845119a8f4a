"""The decision path: request -> live features -> constraint mask -> policy -> chosen offering.

Features are the environment's own (``CloudRouteEnv.observe_live``), so the policy sees exactly
what it was trained on; the router's view of each pool's load is the environment's pool model fed
with the router's own decisions (``commit_live``). Everything here is synchronous and runs on the
event-loop thread: ``observe_live`` ... ``commit_live`` of one request never interleaves with
another's, and a decision takes tens of microseconds, so it is not worth a thread hop.
"""

from __future__ import annotations

import difflib
import json
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from envs.cloud_route import CloudRouteEnv
from models.baselines import make_baseline
from router.keys import Principal
from router.policies import ActivePolicy, PolicySlot
from router.settings import RouterSettings
from router.telemetry import Freshness, ReplaySource, TelemetrySource, iso
from xroute.config import EnvConfig, EvaluateConfig, parse_config
from xroute.errors import ConfigError
from xroute.schema.decision import RouteRequest
from xroute.schema.policy_ir import CatalogIndex, CompiledConstraints, ConstraintError, Constraints, compile_constraints


class RouteFailure(Exception):
    """A request the router cannot place; becomes a 4xx JSON body (see ``router.errors``)."""

    def __init__(self, status: int, error: str, message: str, fields: list[dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.error, self.message = status, error, message
        self.fields = fields or []
        self.headers = headers or {}
        self.extra = extra or {}


class RoutingEngine:
    """Owns the live environment, the constraint compiler and the policy slot."""

    def __init__(self, settings: RouterSettings, source: TelemetrySource | None = None):
        self.settings = settings
        self.source = source or ReplaySource(settings.telemetry, settings.replay_speed, settings.replay_offset_s)
        bundle = self.source.bundle()
        self.bundle_hash = bundle.content_hash
        env_cfg = parse_config(EnvConfig, {**settings.env, "episode_requests": None}, "router settings: field 'env'")
        self.env = env = CloudRouteEnv(bundle, env_cfg)
        env.reset(seed=0)
        self.generation = 0
        self.n, self.N = env.n, env.N
        self.catalog = env.catalog
        self.refs: list[dict[str, str]] = [
            {"offering_id": o.offering_id, "provider": o.provider, "region": o.region, "location": o.location,
             "instance_type": o.instance_type, "pricing_mode": o.pricing_mode, "accelerator": o.accelerator}
            for o in self.catalog]
        self.offering_ids = [o.offering_id for o in self.catalog]
        self.origins: list[str] = list(env.origins)
        self.origin_set = frozenset(self.origins)
        self.index = CatalogIndex(self.catalog)
        self.tenants: dict[str, Constraints] = {}
        for name, t in settings.tenants.items():
            try:
                compile_constraints([(f"tenants.{name}.constraints", t.constraints)], self.index)
            except ConstraintError as e:
                raise ConfigError(f"router settings: {e}") from None
            self.tenants[name] = t.constraints
        self._compiled: OrderedDict[tuple[str, str], tuple[CompiledConstraints, dict[str, int]]] = OrderedDict()
        self.freshness = Freshness(time.time())
        self.max_age = settings.max_telemetry_age_s
        self.k_alt = settings.alternatives
        try:
            fb = make_baseline(settings.fallback_policy, EvaluateConfig(env=env_cfg))
            fb.reset(env, 0)
        except ConfigError as e:
            raise ConfigError(f"router settings: field 'fallback_policy': {e}") from None
        self.slot = PolicySlot(ActivePolicy.make(fb, fb.name, "fallback"), settings.model_uri)
        self.slot._fallback_stale["reason"] = f"telemetry stale (older than {self.max_age:g} s)"
        self.clock = self.source.describe_clock()
        self.source_name = self.source.name
        self.decisions = 0

    # ------------------------------------------------------------------ helpers
    def telemetry_info(self, t: float, wall: float) -> dict[str, Any]:
        age = self.freshness.age(wall)
        return {"source": self.source_name, "clock": self.clock, "telemetry_time": iso(t), "age_s": round(age, 3),
                "stale": age > self.max_age}

    def now(self, wall: float) -> float:
        """Telemetry time for ``wall``; on a replay wrap the pool-load view starts empty again."""
        t, gen = self.source.telemetry_time(wall)
        if gen != self.generation:
            self.env.reset(seed=0)
            self.generation = gen
        return t

    def constraints_for(self, tenant: str, request: Constraints | None) -> tuple[CompiledConstraints, dict[str, int]]:
        """Compiled tenant + request constraints (cached; at most 1024 distinct sets)."""
        key = (tenant, "" if request is None or request.empty else request.model_dump_json(exclude_defaults=True))
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            return hit
        layers = [("tenant", self.tenants.get(tenant)), ("constraints", request)]
        try:
            compiled = compile_constraints(layers, self.index)
        except ConstraintError as e:
            raise RouteFailure(422, "invalid_constraints", str(e),
                               [{"field": f"body.{e.field}", "message": e.problem, "suggestions": e.suggestions}]
                               ) from None
        counts = {k.replace("constraints:", "request:"): v for k, v in compiled.excluded_counts().items()}
        hit = (compiled, counts)
        self._compiled[key] = hit
        if len(self._compiled) > 1024:
            self._compiled.popitem(last=False)
        return hit

    def _env_exclusions(self, excluded: np.ndarray, counts: dict[str, int]) -> None:
        env = self.env
        unavailable = excluded & ~env.available
        no_capacity = excluded & env.available & (env.slots <= 0)
        no_price = excluded & ~unavailable & ~no_capacity & ~np.isfinite(env.price_s)
        queue_full = excluded & ~unavailable & ~no_capacity & ~no_price
        for name, m in (("unavailable", unavailable), ("no_capacity", no_capacity), ("no_price", no_price),
                        ("queue_full", queue_full)):
            c = int(np.count_nonzero(m))
            if c:
                counts[name] = counts.get(name, 0) + c

    # ------------------------------------------------------------------ the decision
    def decide(self, req: RouteRequest, who: Principal, decision_id: str, wall: float
               ) -> tuple[bytes, tuple[Any, ...], str, dict[str, Any]]:
        """Place one request. Returns (response JSON, decision-log row, offering id, policy info).

        Raises :class:`RouteFailure` for an unknown origin, constraints that exclude everything, or
        no allowed offering able to take the request now.
        """
        origin = req.origin
        if origin not in self.origin_set:
            close = difflib.get_close_matches(origin, self.origins, n=5, cutoff=0.4)
            raise RouteFailure(422, "unknown_origin", f"unknown origin '{origin}'",
                               [{"field": "body.origin", "message": f"unknown origin '{origin}'; "
                                 f"known origins: GET /v1/offerings", "suggestions": close}])
        compiled, ccounts = self.constraints_for(who.tenant, req.constraints)
        allowed = compiled.allowed
        if not allowed.any():
            raise RouteFailure(422, "no_offering", "the constraints (tenant defaults and request) exclude every offering",
                               [{"field": "body.constraints", "message": "excludes every offering",
                                 "suggestions": []}], extra={"excluded": ccounts})
        t = self.now(wall)
        env = self.env
        n = self.n
        obs, info = env.observe_live(t, origin, req.input_tokens, req.max_output_tokens, req.sla_ms, decision_id)
        env_mask = info["action_mask"][:n]
        valid = env_mask & allowed
        counts = dict(ccounts)
        if compiled.preferred is not None:
            pv = valid & compiled.preferred
            if pv.any():
                np_count = int(np.count_nonzero(valid & ~pv))
                if np_count:
                    counts["not_preferred"] = np_count
                valid = pv
        env_excluded = allowed & ~env_mask
        if env_excluded.any():
            self._env_exclusions(env_excluded, counts)
        idx = np.flatnonzero(valid)
        if idx.size == 0:
            wait = env.c_wait[allowed & env.available] if (allowed & env.available).any() else None
            retry = max(1, int(np.ceil(float(wait.min()) / max(self.settings.replay_speed, 1e-9)))) if wait is not None else 60
            raise RouteFailure(429, "no_capacity", "no allowed offering can take the request now",
                               headers={"Retry-After": str(min(retry, 3600))}, extra={"excluded": counts})
        stale = self.freshness.age(wall) > self.max_age
        active, pinfo = self.slot.current(stale)
        try:
            a, scores, score_kind = self._choose(active, obs, idx)
        except Exception as e:  # a model that fails at decision time: this request goes to the fallback
            if active is self.slot.fallback:
                raise
            self.slot.failed(f"decision error: {type(e).__name__}: {e}")
            active, pinfo = self.slot.fallback, {**self.slot.fallback.info, "reason": f"model error: {type(e).__name__}"}
            a, scores, score_kind = self._choose(active, obs, idx)
        lat, cost = env.c_lat, env.c_cost
        alternatives = []
        if self.k_alt and idx.size > 1:
            order = np.argsort(-scores, kind="stable")
            for j in order[: self.k_alt + 1]:
                k = int(idx[j])
                if k == a:
                    continue
                alternatives.append({"offering": self.refs[k], "score": _num(scores[j]),
                                     "expected_latency_ms": _num(lat[k]), "expected_cost_usd": _num(cost[k])})
                if len(alternatives) == self.k_alt:
                    break
        score = _num(scores[int(np.searchsorted(idx, a))])
        exp = env.commit_live(a)
        self.decisions += 1
        ref = self.refs[a]
        body = {
            "decision_id": decision_id,
            "created_at": iso(wall),
            "tenant": who.tenant,
            "session_id": req.session_id,
            "offering": ref,
            "expected_latency_ms": _num(exp["expected_latency_ms"]),
            "expected_cost_usd": _num(exp["expected_cost_usd"]),
            "score": score,
            "score_kind": score_kind,
            "alternatives": alternatives,
            "policy": pinfo,
            "excluded": {"total": n - int(idx.size), "by_reason": counts},
            "telemetry": self.telemetry_info(t, wall),
        }
        payload = json.dumps(body, separators=(",", ":")).encode()
        row = (decision_id, who.tenant, wall, t, origin, req.input_tokens, req.max_output_tokens, req.sla_ms,
               req.session_id, ref["offering_id"], body["expected_latency_ms"], body["expected_cost_usd"],
               pinfo["name"], pinfo["kind"], pinfo["version"], self.bundle_hash,
               req.model_dump_json(exclude_none=True), payload.decode())
        return payload, row, ref["offering_id"], pinfo

    def _choose(self, active: ActivePolicy, obs: dict[str, np.ndarray], idx: np.ndarray
                ) -> tuple[int, np.ndarray, str]:
        """(chosen offering, scores of ``idx``, score kind) under ``active``, restricted to ``idx``."""
        if active.scorer is not None:
            _, s = active.scorer(obs, idx)
            if s.shape != idx.shape or not np.isfinite(s).all():
                raise ValueError("the model returned non-finite or misshapen scores")
            return int(idx[int(np.argmax(s))]), s, "q_value"
        r = self.env.expected_rewards()[idx]
        if active.name == "greedy":
            return int(idx[int(np.argmax(r))]), r, "expected_reward"
        mask = np.zeros(self.N, dtype=bool)
        mask[idx] = True
        a = int(active.policy.act({**obs, "mask": mask.astype(np.float32)}, {"action_mask": mask}))
        if not (0 <= a < self.n and mask[a]):  # a policy that ignores the mask: best valid expectation instead
            a = int(idx[int(np.argmax(r))])
        return a, r, "expected_reward"

    # ------------------------------------------------------------------ state
    def offerings_state(self, wall: float) -> dict[str, Any]:
        """Current price, availability and pool load of every offering (for ``GET /v1/offerings``)."""
        t = self.now(wall)
        env = self.env
        snap = env.replay.snapshot(t, env.cfg.risk_lookback_h * 3600.0)
        price_h = snap["price"]
        available = snap["available"] > 0.5
        fa = env.free_at
        nxt = np.maximum(fa.min(axis=1) - t, 0.0)
        busy = np.count_nonzero(fa > t, axis=1) - (env.smax - env.slots)
        valid = available & (env.slots > 0) & np.isfinite(price_h) & (nxt <= env.cfg.queue_timeout_s)
        rows = [{"offering": self.refs[i], "usd_per_hour": _num(price_h[i] * env.rpi[i]) if np.isfinite(price_h[i]) else None,
                 "available": bool(available[i]), "valid": bool(valid[i]), "slots": int(env.slots[i]),
                 "busy_slots": int(busy[i]), "next_free_in_s": _num(nxt[i]), "external_util": _num(snap["util"][i])}
                for i in range(self.n)]
        return {"telemetry": self.telemetry_info(t, wall), "origins": self.origins, "offerings": rows}


def _num(x: Any) -> float:
    """A JSON-safe float (the env never yields NaN/inf for a valid offering; guard anyway)."""
    v = float(x)
    return v if v == v and v not in (float("inf"), float("-inf")) else 0.0
