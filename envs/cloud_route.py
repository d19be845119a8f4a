"""``xroute/CloudRoute-v0``: route each request of a replayed request stream to an offering.

Description
-----------
A telemetry bundle (see ``docs/telemetry.md``) is replayed in time. Each step is one request of its
workload (in arrival order, arrivals optionally compressed by ``rate_scale``); the action picks the
offering (provider x region x instance type x pricing mode) that serves it.

Each offering is a pool of ``capacity_replicas`` model replicas (default: one instance's worth), each
replica with ``max_concurrency`` request slots (``configs/serving.yaml``). A request waits for the
first free slot, then is served in ``input/prefill_tok_s + output * tpot(k)`` seconds, where
``tpot(k) = tpot_ms * (1 + tpot_growth*(k-1))`` grows with the ``k`` requests batched on the replica
(plus the pool's external utilization), times a per-request lognormal factor (``noise_sigma``).

Latency = RTT(origin, offering location) + queueing + service time. Cost = price per replica-second
x service time / slots per replica (the slot-time the request occupies). If the replayed
availability of a spot pool flips to 0 while a request is queued or in flight there, the request is
preempted: it pays for the time it ran, and is retried on the on-demand offering with the lowest
expected latency from its origin, after ``retry_overhead_ms``. An SLA violation is latency > sla_ms.

Observation (``Dict``)
----------------------
==============  ===============================  ==============================================
key             shape                            meaning
==============  ===============================  ==============================================
``offerings``   (max_offerings * F,) float32     per-offering feature rows, flattened row-major
                                                 (``envs.features.offering_matrix`` reshapes);
                                                 rows past the catalog are zero
``request``     (R,) float32                     request features, see ``envs.features``
``mask``        (max_offerings,) float32         1 = valid action (same as ``info["action_mask"]``)
==============  ===============================  ==============================================

Action
------
``Discrete(max_offerings)``: the index of an offering in the bundle's ``offerings`` table. An
invalid action (padding, spot pool unavailable, zero capacity, or a pool whose next free slot is
more than ``queue_timeout_s`` away) is defined: the request fails (counted in ``failed``), costs
nothing, and is charged ``failure_latency_norm`` plus the SLA penalty.

Reward
------
``-(cost_weight*cost_norm + latency_weight*latency_norm) - sla_penalty*violation`` with
``cost_norm = min(cost / reference_cost, cost_norm_cap)`` where ``reference_cost`` is the request's
cost on one replica of the reference accelerator priced ``reference_usd_per_replica_hour``, and
``latency_norm = min(latency / sla, latency_norm_cap)``. Defaults 0.6 / 0.4 / 2.0.

Episode
-------
``reset`` picks ``episode_requests`` consecutive requests starting at a random index (the whole
stream from its start when ``episode_requests`` is None) and empties every pool. The episode is
truncated (never terminated) after its last request. Everything random comes from
``self.np_random``, so the same seed gives the same trajectory.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from envs import features as fz
from envs import kernels
from envs.replay import TelemetryReplay
from xroute.bundle import Bundle, load_bundle, origins_reaching, to_seconds
from xroute.config import EnvConfig, ServingConfig, config_path, parse_config, read_yaml
from xroute.errors import ConfigError


def load_serving(name: str) -> ServingConfig:
    path = config_path(name)
    return parse_config(ServingConfig, read_yaml(path), str(path))




class CloudRouteEnv(gym.Env):  # type: ignore[type-arg]
    metadata = {"render_modes": []}  # noqa: RUF012

    def __init__(self, bundle: Bundle | str | None = None, config: EnvConfig | dict[str, Any] | None = None,
                 **overrides: Any):
        super().__init__()
        if isinstance(config, EnvConfig):
            cfg = config.model_copy(update=overrides) if overrides else config
        else:
            cfg = parse_config(EnvConfig, {**(config or {}), **overrides}, "env config")
        self.cfg = cfg
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
        self.catalog = self.bundle.catalog()
        n = len(self.catalog)
        if n > cfg.max_offerings:
            raise ConfigError(f"env config: field 'max_offerings': the bundle has {n} offerings, more than {cfg.max_offerings}")
        self.n = n
        self.N = cfg.max_offerings
        self._init_static()
        self.observation_space = spaces.Dict({
            "offerings": spaces.Box(np.tile(fz.OFFERING_LOW, self.N), np.tile(fz.OFFERING_HIGH, self.N),
                                    dtype=np.float32),
            "request": spaces.Box(fz.REQUEST_LOW, fz.REQUEST_HIGH, dtype=np.float32),
            "mask": spaces.Box(0.0, 1.0, (self.N,), dtype=np.float32),
        })
        self.action_space = spaces.Discrete(self.N)
        self._pos = 0
        self._end = 0
        self._live_buffers: tuple[np.ndarray, ...] | None = None

    # ------------------------------------------------------------------ setup
    def _init_static(self) -> None:
        serving = load_serving(self.cfg.serving_config)
        self.serving = serving
        ref = serving.accelerators.get(serving.reference_accelerator)
        if ref is None:
            raise ConfigError(f"{self.cfg.serving_config}: field 'reference_accelerator': "
                              f"'{serving.reference_accelerator}' has no entry under accelerators")
        speeds = []
        for o in self.catalog:
            s = serving.accelerators.get(o.accelerator)
            if s is None:
                raise ConfigError(f"{self.cfg.serving_config}: field 'accelerators': no entry for accelerator "
                                  f"'{o.accelerator or '(none)'}' used by offering {o.offering_id}")
            speeds.append(s)
        self.prefill = np.array([s.prefill_tok_s for s in speeds])
        self.tpot_s = np.array([s.tpot_ms for s in speeds]) / 1000.0
        self.growth = np.array([s.tpot_growth for s in speeds])
        self.conc = np.array([s.max_concurrency for s in speeds], dtype=float)
        self.sigma = np.array([s.noise_sigma for s in speeds])
        self.ref = ref
        self.rpi = np.array([o.replicas_per_instance for o in self.catalog], dtype=float)
        caps = self.bundle.offerings.get("capacity_replicas")
        replicas = []
        for o, c in zip(self.catalog, caps if caps is not None else [np.nan] * self.n):
            replicas.append(o.replicas_per_instance if c is None or (isinstance(c, float) and np.isnan(c)) else int(c))
        self.replicas = np.array(replicas, dtype=float)
        self.slots = (self.replicas * self.conc).astype(np.int64)
        self.smax = max(1, int(self.slots.max()))
        self.inv_replicas = 1.0 / np.maximum(self.replicas, 1e-9)
        self.inv_prefill = 1.0 / self.prefill
        self.conc_m1 = self.conc - 1.0
        self.tpot_growth_s = self.tpot_s * self.growth
        self.inv_slots = 1.0 / np.maximum(self.slots, 1)
        self.is_spot = np.array([o.is_spot for o in self.catalog], dtype=float)
        self.on_demand_idx = np.flatnonzero(self.is_spot < 0.5)
        self._all_idx = np.arange(self.n)
        self.speed_feat = np.clip(np.log(ref.tpot_ms / 1000.0 / self.tpot_s), -3, 3)
        self.cap_feat = np.clip(np.log1p(self.slots) / 5.0, 0, 2)
        self.replay = TelemetryReplay(self.bundle, self.rpi)

        w = self.bundle.workload
        self.origins, self.rtt_ms = self._origins_rtt(self.bundle)
        oi = {o: i for i, o in enumerate(self.origins)}
        self.origin_index = oi
        t = to_seconds(w["ts"])
        self.t0 = float(t[0])
        self.arrival_raw = t
        self.req_origin = w["origin"].map(oi).to_numpy()
        self.req_in = w["input_tokens"].to_numpy(dtype=float)
        self.req_out = w["output_tokens"].to_numpy(dtype=float)
        self.req_sla_ms = w["sla_ms"].to_numpy(dtype=float)
        self.req_ids = w["request_id"].to_numpy()
        self.n_requests = len(w)
        self.set_rate_scale(self.cfg.rate_scale)
        # reference cost of each request: served alone on one reference replica at the reference price
        ref_service = self.req_in / ref.prefill_tok_s + self.req_out * ref.tpot_ms / 1000.0
        self.ref_cost = self._reference_cost(ref_service)

    def _origins_rtt(self, bundle: Bundle) -> tuple[list[str], np.ndarray]:
        """Origins (RTT sources, or workload origins, that reach every offering's location) and
        the (origin, offering) RTT matrix in ms."""
        rtt = bundle.rtt_lookup()
        origins = origins_reaching(rtt, (o.location for o in self.catalog),
                                   {s for s, _ in rtt} | set(bundle.workload["origin"]))
        return origins, np.array([[rtt[(org, off.location)] for off in self.catalog] for org in origins])

    def prepare_telemetry(self, bundle: Bundle) -> dict[str, Any]:
        """New telemetry (prices, availability, utilization, RTT) for the *same* catalog, made
        ready without touching the environment (a live router builds it off its event loop);
        :meth:`apply_telemetry` swaps it in. Raises ``ConfigError`` when the catalog or the pool
        sizes differ (that needs a new environment)."""
        if bundle.catalog() != self.catalog:
            raise ConfigError(f"{bundle.path}: the catalog changed (offerings added, removed or altered); "
                              "restart the router to serve the new catalog")
        caps = bundle.offerings.get("capacity_replicas")
        new_caps = caps.to_numpy(dtype=float) if caps is not None else np.full(self.n, np.nan)
        old_caps = self.bundle.offerings.get("capacity_replicas")
        old = old_caps.to_numpy(dtype=float) if old_caps is not None else np.full(self.n, np.nan)
        if not np.array_equal(new_caps, old, equal_nan=True):
            raise ConfigError(f"{bundle.path}: field 'capacity_replicas' changed; restart the router to resize its pools")
        origins, rtt_ms = self._origins_rtt(bundle)
        return {"bundle": bundle, "replay": TelemetryReplay(bundle, self.rpi), "origins": origins, "rtt_ms": rtt_ms}

    def apply_telemetry(self, prepared: dict[str, Any]) -> None:
        """Swap in :meth:`prepare_telemetry`'s result. The pools keep their load; the next request
        re-reads prices and availability from the new tables."""
        self.bundle, self.replay = prepared["bundle"], prepared["replay"]
        self.origins, self.rtt_ms = prepared["origins"], prepared["rtt_ms"]
        self.origin_index = {o: i for i, o in enumerate(self.origins)}
        self._refresh_at = -np.inf
        self._next_event = -np.inf

    def _reference_cost(self, ref_service_s: Any) -> Any:
        ref = self.ref
        return np.maximum(self.cfg.reward.reference_usd_per_replica_hour / 3600.0 * ref_service_s
                          / ref.max_concurrency, 1e-12)

    def set_rate_scale(self, rate_scale: float) -> None:
        """Compress arrivals by ``rate_scale`` (4 = four times the load)."""
        if rate_scale <= 0:
            raise ConfigError(f"env config: field 'rate_scale': must be > 0, got {rate_scale}")
        self.rate_scale = rate_scale
        self.arrival = self.t0 + (self.arrival_raw - self.t0) / rate_scale

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        L = self.cfg.episode_requests
        if options and "start" in options:
            start = int(options["start"])
        elif L is None or L >= self.n_requests:
            start = 0
        else:
            start = int(self.np_random.integers(0, self.n_requests - L + 1))
        end = self.n_requests if L is None else min(self.n_requests, start + L)
        if options and "end" in options:
            end = min(self.n_requests, int(options["end"]))
        self._pos, self._end = start, end
        self.z = self.np_random.standard_normal(end - start)
        self._reset_pools()
        self._refresh_at = -np.inf
        self._next_event = -np.inf
        self._recent: deque[float] = deque()
        self.stats = {"preempted": 0, "failed": 0}
        self._prepare()
        return self._obs(), self._info()

    def step(self, action: int) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        a = int(action)
        out = self._resolve(a)
        self._pos += 1
        truncated = self._pos >= self._end
        if not truncated:
            self._prepare()
            obs, info = self._obs(), self._info()
        else:
            obs, info = self._last_obs, {"action_mask": np.zeros(self.N, dtype=bool)}
        info.update(out)
        return obs, float(out["reward"]), False, truncated, info

    # ------------------------------------------------------------------ pools
    # Each pool's slots hold the time they next free up (``free_at``, padded with +inf). Per-step
    # cost must not scale with the number of slots, so the busy count per pool is kept by a heap of
    # slot-release events (stale ones — a slot reassigned before it freed — are skipped), and the
    # earliest release per pool (``row_min``) is recomputed only for the pool that changed.
    def _reset_pools(self) -> None:
        self.free_at = np.full((self.n, self.smax), -np.inf)
        for i in range(self.n):
            self.free_at[i, self.slots[i]:] = np.inf
        self.row_min = np.where(self.slots > 0, -np.inf, np.inf)
        self.busy = np.zeros(self.n, dtype=np.int64)
        self._events: list[tuple[float, int, int]] = []

    def _occupy(self, a: int, j: int, end: float) -> None:
        kernels.occupy_slot(self.free_at, self.row_min, self.busy, a, j, self.t, end)
        heapq.heappush(self._events, (end, a, j))

    def _release_until(self, t: float) -> None:
        ev, fa = self._events, self.free_at
        while ev and ev[0][0] <= t:
            end, a, j = heapq.heappop(ev)
            if fa[a, j] == end:
                self.busy[a] -= 1

    # attributes replaced (never mutated in place) as the episode advances: a reference suffices
    _SHARED_STATE = ("_pos", "_end", "z", "_refresh_at", "_next_event", "t", "price_s", "available", "ext_util",
                     "ext_util_conc", "next_down", "hazard", "static_feats", "static_ok", "cost_rate", "r_origin",
                     "r_in", "r_out", "r_sla", "r_ref_cost", "r_id", "r_z", "c_wait", "c_busy", "c_service",
                     "c_rtt", "c_lat", "c_cost", "c_mask", "c_risk", "c_load", "_last_obs")
    # ... except these, with use_live_buffers: set_live then writes them in place
    _LIVE_BUFFERED = ("c_wait", "c_busy", "c_service", "c_lat", "c_cost", "c_mask", "c_risk")

    def save_state(self) -> dict[str, Any]:
        """Everything a step changes, so a planner can look ahead and come back (``restore_state``)."""
        d = {k: getattr(self, k) for k in self._SHARED_STATE if hasattr(self, k)}
        if self._live_buffers is not None:  # overwritten in place by the next set_live: keep copies
            d.update({k: getattr(self, k).copy() for k in self._LIVE_BUFFERED if hasattr(self, k)})
        d.update(free_at=self.free_at.copy(), row_min=self.row_min.copy(), busy=self.busy.copy(),
                 _events=list(self._events), stats=dict(self.stats), _recent=deque(self._recent))
        return d

    def restore_state(self, d: dict[str, Any]) -> None:
        for k, v in d.items():
            setattr(self, k, v)
        # the snapshot stays reusable: give the environment its own copies of what it mutates
        self.free_at, self.row_min, self.busy = d["free_at"].copy(), d["row_min"].copy(), d["busy"].copy()
        self._events, self.stats, self._recent = list(d["_events"]), dict(d["stats"]), deque(d["_recent"])

    # ------------------------------------------------------------------ dynamics
    def _refresh(self, t: float) -> None:
        snap = self.replay.snapshot(t, self.cfg.risk_lookback_h * 3600.0)
        p, p24 = snap["price"], snap["price_24h"]
        self.price_s = p / 3600.0
        self.available = snap["available"] > 0.5
        self.ext_util = snap["util"]
        self.ext_util_conc = self.ext_util * self.conc
        self.next_down = self.replay.next_down(t)
        ref_price = self.cfg.reward.reference_usd_per_replica_hour
        lookback_h = self.cfg.risk_lookback_h
        # preemption hazard per second: (count + prior) / (lookback + prior time); prior = 1 per 24 h
        self.hazard = np.where(self.is_spot > 0.5, (snap["preempt_count"] + 0.25) / ((lookback_h + 6.0) * 3600.0), 0.0)
        st = np.zeros((self.n, fz.N_OFFERING_FEATURES))
        st[:, fz.F["log_price"]] = np.clip(np.log(np.maximum(p, 1e-6) / ref_price), -3, 3)
        st[:, fz.F["price_trend"]] = np.clip(np.nan_to_num((p - p24) / np.maximum(p, 1e-9)), -1, 1)
        st[:, fz.F["price_volatility"]] = np.clip(snap["volatility"] / 10.0, 0, 1)
        st[:, fz.F["is_spot"]] = self.is_spot
        st[:, fz.F["ext_util"]] = np.clip(self.ext_util, 0, 1)
        st[:, fz.F["available"]] = self.available
        st[:, fz.F["preemptions"]] = np.clip(snap["preempt_count"] / 5.0, 0, 2)
        st[:, fz.F["preempt_recency"]] = snap["preempt_recency"]
        st[:, fz.F["speed"]] = self.speed_feat
        st[:, fz.F["capacity"]] = self.cap_feat
        self.static_feats = st
        # the parts of the mask and of the expectations that only change with telemetry
        self.static_ok = self.available & (self.slots > 0) & np.isfinite(self.price_s)
        self.cost_rate = np.where(np.isfinite(self.price_s), self.price_s, 0.0) / self.conc
        self._refresh_at = t + self.cfg.feature_refresh_s
        self._next_event = self.replay.next_event_after(t)

    def _prepare(self) -> None:
        """Make the stream's next request the current one and compute its candidate outcomes."""
        i = self._pos
        self._set_request(float(self.arrival[i]), int(self.req_origin[i]), self.req_in[i], self.req_out[i],
                          self.req_sla_ms[i], self.ref_cost[i], self.req_ids[i], float(self.z[i - self._ep_start]))

    def _set_request(self, t: float, origin: int, n_in: float, n_out: float, sla_ms: float, ref_cost: float,
                     request_id: Any, z: float, into: tuple[np.ndarray, ...] | None = None) -> None:
        """Make a request current: its expectations on every offering (``c_*``) in one compiled
        pass (envs/kernels.py has the formulas), into new arrays, or written into ``into``
        (``use_live_buffers``) when given."""
        if t >= self._refresh_at or t >= self._next_event:
            self._refresh(t)
        self.t = t
        self.r_origin, self.r_in, self.r_out, self.r_sla, self.r_ref_cost, self.r_id, self.r_z = (
            origin, float(n_in), float(n_out), float(sla_ms), float(ref_cost), request_id, z)
        self._release_until(t)
        rtt = self.rtt_ms[origin]
        if into is None:
            wait, busy, service, lat, cost, mask, risk, busy_valid, slots_valid = kernels.candidate_outcomes(
                self.row_min, self.busy, self.inv_replicas, self.conc_m1, self.ext_util_conc, self.inv_prefill,
                self.tpot_s, self.tpot_growth_s, rtt, self.cost_rate, self.static_ok, self.hazard, self.slots, t,
                self.r_in, self.r_out, self.cfg.queue_timeout_s)
            self.c_wait, self.c_busy, self.c_service, self.c_lat, self.c_cost, self.c_mask, self.c_risk = (
                wait, busy, service, lat, cost, mask, risk)
        else:
            busy_valid, slots_valid = kernels.candidate_outcomes_into(  # type: ignore[call-arg]
                *into, self.row_min, self.busy, self.inv_replicas, self.conc_m1, self.ext_util_conc,
                self.inv_prefill, self.tpot_s, self.tpot_growth_s, rtt, self.cost_rate, self.static_ok, self.hazard,
                self.slots, t, self.r_in, self.r_out, self.cfg.queue_timeout_s)
            if self.c_lat is not into[3]:  # after a restore_state or a request without the buffers
                self.c_wait, self.c_busy, self.c_service, self.c_lat, self.c_cost, self.c_mask, self.c_risk = into
        self.c_load = min(busy_valid / max(slots_valid, 1.0), 1.0)
        self.c_rtt = rtt
        self._recent.append(t)
        while self._recent and self._recent[0] < t - 10.0:
            self._recent.popleft()

    def _obs(self) -> dict[str, np.ndarray]:
        n = self.n
        nf = fz.N_OFFERING_FEATURES
        offerings = np.zeros(self.N * nf, dtype=np.float32)
        self.offering_features(self._all_idx, out=offerings[: n * nf].reshape(n, nf))
        mask = np.zeros(self.N, dtype=np.float32)
        mask[:n] = self.c_mask
        self._last_obs = {"offerings": offerings, "request": self.request_features(), "mask": mask}
        return self._last_obs

    def offering_features(self, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The observation's offering rows of offerings ``idx`` (int64) for the current request,
        as a (len(idx), F) float32 matrix (written into ``out`` when given)."""
        if out is None:
            out = np.empty((idx.shape[0], fz.N_OFFERING_FEATURES), dtype=np.float32)
        kernels.offering_rows(out, idx, self.static_feats, self.c_mask, self.c_rtt, self.c_busy, self.inv_slots,
                              self.c_wait, self.c_risk, self.c_lat, self.c_cost, self.r_sla, self.r_ref_cost)
        return out

    def request_features(self) -> np.ndarray:
        """The observation's request vector (``envs.features.REQUEST_FEATURES``), float32."""
        return np.array([
            min(math.log1p(self.r_in) / 10.0, 2.0),
            min(math.log1p(self.r_out) / 8.0, 2.0),
            min(math.log1p(self.r_sla) / 12.0, 2.0),
            min(len(self._recent) / 100.0, 3.0),
            self.c_load,
        ], dtype=np.float32)

    def _info(self) -> dict[str, Any]:
        mask = np.zeros(self.N, dtype=bool)
        mask[: self.n] = self.c_mask
        return {"action_mask": mask, "request_id": self.r_id, "t": self.t}

    def action_mask(self) -> np.ndarray:
        """Valid actions for the current request (for ``sb3_contrib``-style masking)."""
        return self._info()["action_mask"]

    # ------------------------------------------------------------------ outcomes
    def _served(self, a: int, start_t: float, service: float) -> tuple[float, float, bool, float]:
        """Serve the current request on offering a from ``start_t`` (>= its slot's free time). Returns
        (end time, cost, preempted, preemption time). Updates the pool's slots."""
        j = int(np.argmin(self.free_at[a]))
        start = max(start_t, self.free_at[a, j])
        down = self.next_down[a] if self.is_spot[a] > 0.5 else np.inf
        if down < start + service and down >= self.t:
            ran = max(0.0, down - start)
            if down > start:
                self._occupy(a, j, down)
            return down, self.price_s[a] * ran / self.conc[a], True, down
        self._occupy(a, j, start + service)
        return start + service, self.price_s[a] * service / self.conc[a], False, np.inf

    def _actual_service(self, a: int) -> float:
        return float(self.c_service[a] * np.exp(self.sigma[a] * self.r_z - 0.5 * self.sigma[a] ** 2))

    @property
    def _ep_start(self) -> int:
        return self._end - len(self.z)

    def _fallback(self, exclude: int) -> int | None:
        cand = self.on_demand_idx[self.c_mask[self.on_demand_idx]]
        cand = cand[cand != exclude]
        if cand.size == 0:
            return None
        return int(cand[np.argmin(self.c_lat[cand])])

    def _resolve(self, a: int) -> dict[str, Any]:
        t, sla, ref_cost = self.t, self.r_sla, self.r_ref_cost
        rw = self.cfg.reward
        if a < 0 or a >= self.n or not self.c_mask[a]:
            self.stats["failed"] += 1
            reward = -(rw.latency_weight * rw.failure_latency_norm) - rw.sla_penalty
            return {"reward": reward, "offering": a, "cost_usd": 0.0, "latency_ms": np.nan, "sla_violation": True,
                    "failed": True, "preempted": False, "migrated_to": None}
        service = self._actual_service(a)
        end, cost, preempted, tp = self._served(a, t, service)
        latency = self.c_rtt[a] + 1000.0 * (end - t)
        failed, migrated_to = False, None
        if preempted:
            self.stats["preempted"] += 1
            f = self._fallback(a)
            if f is None:
                failed = True
                latency = np.nan
            else:
                migrated_to = f
                restart = tp + self.cfg.retry_overhead_ms / 1000.0
                s2 = self._actual_service(f)
                end2, cost2, _, _ = self._served(f, restart, s2)
                cost += cost2
                latency = self.c_rtt[f] + 1000.0 * (end2 - t)
        if failed:
            self.stats["failed"] += 1
            reward = -(rw.cost_weight * min(cost / ref_cost, rw.cost_norm_cap)
                       + rw.latency_weight * rw.failure_latency_norm) - rw.sla_penalty
            viol = True
        else:
            viol = bool(latency > sla)
            reward = -(rw.cost_weight * min(cost / ref_cost, rw.cost_norm_cap)
                       + rw.latency_weight * min(latency / sla, rw.latency_norm_cap)) - rw.sla_penalty * viol
        return {"reward": float(reward), "offering": a, "cost_usd": float(cost), "latency_ms": float(latency),
                "sla_violation": viol, "failed": failed, "preempted": preempted, "migrated_to": migrated_to}

    # ------------------------------------------------------------------ live routing (the router)
    def observe_live(self, t: float, origin: str, input_tokens: int, output_tokens: int, sla_ms: float,
                     request_id: Any = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Make a live request (not from the stream) the current one, at telemetry time ``t``
        (seconds since the epoch), and return its observation — the same features the agent was
        trained on. ``origin`` must be a location id with RTT to every offering (``self.origins``)."""
        self.set_live(t, origin, input_tokens, output_tokens, sla_ms, request_id)
        return self._obs(), self._info()

    def set_live(self, t: float, origin: str, input_tokens: int, output_tokens: int, sla_ms: float,
                 request_id: Any = None) -> np.ndarray:
        """:meth:`observe_live` without building the observation: makes the live request current
        (its expectations ``c_*``, as ``observe_live``) and returns its action mask over the ``n``
        offerings (``c_mask``; read-only). A policy that needs the features calls :meth:`_obs`
        next, which gives exactly ``observe_live``'s observation."""
        if origin not in self.origin_index:
            raise KeyError(origin)
        if not hasattr(self, "free_at"):
            self.reset(seed=0)
        ref = self.ref
        ref_service = input_tokens / ref.prefill_tok_s + output_tokens * ref.tpot_ms / 1000.0
        ref_cost = max(self.cfg.reward.reference_usd_per_replica_hour / 3600.0 * ref_service / ref.max_concurrency,
                       1e-12)  # _reference_cost for one request, without numpy's scalar overhead
        self._set_request(t, self.origin_index[origin], input_tokens, output_tokens, sla_ms, ref_cost, request_id, 0.0,
                          self._live_buffers)
        return self.c_mask  # type: ignore[no-any-return]

    def use_live_buffers(self) -> None:
        """From now on :meth:`set_live` writes the live request's expectations (``c_wait``,
        ``c_busy``, ``c_service``, ``c_lat``, ``c_cost``, ``c_mask``, ``c_risk``) into one set of
        arrays, overwritten by the next live request, instead of new arrays every time (the
        router: ~0.3 us saved per array). Read them before the next ``set_live``;
        :meth:`save_state` copies them."""
        n = self.n
        self._live_buffers = (np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n),
                              np.zeros(n, dtype=bool), np.zeros(n))

    def commit_live(self, a: int) -> dict[str, float]:
        """Record that the current live request was sent to offering ``a``: it occupies a slot there
        for its expected service time, so later decisions see the load. Returns the expectations."""
        if not self.c_mask[a]:
            raise ValueError(f"offering {a} is not valid now")
        # _occupy on the earliest-free slot, in one compiled call
        j, end = kernels.occupy(self.free_at, self.row_min, self.busy, a, self.t, self.c_service[a])
        self.occupied_live(a, j, end)
        return {"expected_latency_ms": float(self.c_lat[a]), "expected_cost_usd": float(self.c_cost[a])}

    def occupied_live(self, a: int, j: int, end: float) -> None:
        """:meth:`commit_live` for a caller that already took the slot in its own compiled pass
        (``kernels.occupy`` on ``free_at``/``row_min``/``busy`` for offering ``a`` at ``self.t``,
        giving slot ``j`` until ``end``): schedules the slot's release."""
        heapq.heappush(self._events, (end, a, j))

    # ------------------------------------------------------------------ for baselines and the oracle
    def expected_rewards(self) -> np.ndarray:
        """One-step expected reward of each offering from what the observation shows (no future):
        expected cost/latency, with the spot-preemption risk estimated from availability history."""
        rw = self.cfg.reward
        return kernels.expected_rewards(self.c_lat, self.c_cost, self.c_service, self.c_risk, self.c_mask, self.r_sla,
                                        self.r_ref_cost, rw.cost_weight, rw.latency_weight, rw.sla_penalty,
                                        rw.cost_norm_cap, rw.latency_norm_cap, self.cfg.retry_overhead_ms)

    def exact_rewards(self) -> np.ndarray:
        """The reward each offering would really get for the current request (hindsight: knows the
        noise draw and future preemptions). Leaves the environment unchanged."""
        rw = self.cfg.reward
        sla = self.r_sla
        service = self.c_service * np.exp(self.sigma * self.r_z - 0.5 * self.sigma**2)
        lat = self.c_rtt + 1000.0 * (self.c_wait + service)
        cost = self.cost_rate * service
        out = -(rw.cost_weight * np.minimum(cost / self.r_ref_cost, rw.cost_norm_cap)
                + rw.latency_weight * np.minimum(lat / sla, rw.latency_norm_cap)) - rw.sla_penalty * (lat > sla)
        out = np.where(self.c_mask, out, -np.inf)
        # requests a replayed preemption would interrupt take the full path (retry elsewhere)
        hit = self.c_mask & (self.is_spot > 0.5) & (self.next_down < self.t + self.c_wait + service)
        if hit.any():
            saved = self.save_state()
            for a in np.flatnonzero(hit):
                out[a] = self._resolve(int(a))["reward"]
                self.restore_state(saved)
        return out

    def offering_index(self, offering_id: str) -> int:
        for k, o in enumerate(self.catalog):
            if o.offering_id == offering_id:
                return k
        raise KeyError(offering_id)
