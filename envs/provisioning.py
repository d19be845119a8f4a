"""The provisioning world: how many instances to hold in which pool, epoch by epoch.

Description
-----------
A telemetry bundle is replayed in time (``docs/telemetry.md``). Its request stream is cut into
decision *epochs* of ``epoch_s`` trace seconds (``ProvisionConfig``). At the start of each epoch a
planner sets the **target number of instances per pool**; a pool is one (model, offering) pair
(``envs.serving.place``), one instance holds ``per_inst`` replicas of the model (an instance's GPUs
over the GPUs one replica spans) with ``conc`` request slots each. Then the epoch's requests are
routed, one by one, onto the instances that exist (``envs.provision_kernels``: the routing
environment's greedy expectation and service model) and the world moves on:

* **launch delay**: an instance launched at ``t`` serves from ``t + launch_s``: its boot, the
  engine's start and the model's weights loaded (``configs/serving.yaml``, ``launch``: cited
  sources); it is billed from ``t``;
* **spot launches fail** while the pool is out: the real availability trace records it
  unavailable, or a notice of its next preemption has been given (the capacity is being
  reclaimed) -- counted as failed launches, nothing held, nothing billed;
* **spot preemption** by the trace, with the cloud's notice (``offerings.notice_s``: AWS 120 s,
  Azure and GCP 30 s; else ``migration.default_notice_s``): a recorded preemption really happens
  up to ``spot_lag_s`` before the telemetry shows it (drawn from the seed, as in
  ``xroute/CloudRoute-v0``). At the notice every instance held in the pool stops taking work and
  the requests queued or running on it move by the router's migration rules
  (``xroute.migration_rules``: after ``migration.delay_s``, to the pool the router picks, their KV
  cache transferred or recomputed, or re-run from scratch when the window is missed); the
  instances are billed until the preemption. Without a notice the requests restart from scratch
  after ``retry_overhead_ms``;
* **scale down drains**: an instance the plan no longer wants takes no new work, finishes what it
  runs and is billed until then; instances still launching are cancelled first (billed until the
  cancel);
* **cloud capacity quotas** (the bundle's ``quotas`` table, ``envs.capacity``): a launch that would
  take a quota covering the offering past its room (limit - usage) is refused (``quota_refused``);
  launches never exceed the quotas;
* **cost** = held instance-seconds x the instance's price at the time (sampled at each epoch's
  start: the bundles' prices change at most daily), whether or not a request runs there.

No request is dropped: a request that finds no instance accepting work for its model waits in a
backlog until one is ready; a request still waiting when the window ends is *unserved* (an SLO
miss). ``lost`` counts requests neither served nor unserved: 0 by construction, reported as a check.

What a planner knows (decision-time)
------------------------------------
:class:`PlanContext` at reset (the pools, the request classes, the requests *before* the window
with their outputs) and :class:`PlanView` at each epoch: the instances it holds by state, the
telemetry at or before the epoch's start (prices, recorded availability, preemption history and
hazard, quota room), the requests that arrived before it, the outputs of those that completed
before it, and what happened to its own instances (launches that failed, notices). Only the
hindsight oracle reads :meth:`ProvisionWorld.hindsight` -- the true load and availability of the
whole window -- and says so. ``tests/test_no_foresight.py`` checks it for every planner.

The Gymnasium environment ``xroute/Provision-v0`` (:class:`ProvisionEnv`) wraps the world for a
learned planner: the action is a target per pool (``MultiDiscrete``, factored per pool, padded to
``max_pools``); the observation a row of features per pool plus the load; the reward
``-(held cost of the epoch + slo_miss_usd x SLO misses completed in it)``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import pandas as pd
from gymnasium import spaces

from envs import provision_kernels as pk
from envs.capacity import CapacityQuotas
from envs.replay import PoolInventory, TelemetryReplay
from envs.serving import load_models, load_serving, place
from xroute import migration_rules as rules
from xroute.bundle import Bundle, load_bundle, origins_reaching, throughput_lookup, to_seconds
from xroute.config import ProvisionConfig, parse_config
from xroute.errors import ConfigError

__all__ = ["PlanContext", "PlanView", "Pools", "ProvisionEnv", "ProvisionWorld"]

_NOTICE, _DOWN = 0, 1


@dataclass(frozen=True)
class Pools:
    """The static description of every pool (arrays of length P; ``ids[p]`` = ``model@offering_id``)."""

    ids: list[str]
    model: np.ndarray            # index into model_names
    offering: np.ndarray         # index into the bundle's offerings
    offering_ids: list[str]
    accelerator: list[str]
    is_spot: np.ndarray          # bool
    notice_s: np.ndarray         # the cloud's notice of a preemption (0: none)
    gpus: np.ndarray             # GPUs per instance
    per_inst: np.ndarray         # model replicas per instance
    conc: np.ndarray             # request slots per replica
    prefill_tok_s: np.ndarray
    tpot_s: np.ndarray           # s per output token at concurrency 1
    growth: np.ndarray           # tpot(k) = tpot * (1 + growth * (k - 1))
    sigma: np.ndarray            # service-time noise
    launch_s: np.ndarray         # launch call -> serving
    location: list[str]          # provider:region

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def slots(self) -> np.ndarray:
        return (self.per_inst * self.conc).astype(np.int64)


@dataclass(frozen=True)
class PlanContext:
    """What a planner knows when the window starts: the pools, the request classes (one per model
    and tenant, with their SLO), the RTT from each origin to each pool, and the requests before the
    window (``hist_*``: arrival times, classes, inputs, outputs and origins -- known by then; an
    output not known yet, of a request just before a window that starts mid-stream, is NaN)."""

    pools: Pools
    model_names: tuple[str, ...]
    class_names: list[str]       # "model/tenant"
    class_model: np.ndarray
    class_ttft_ms: np.ndarray    # the class's TTFT objective (its most common one)
    class_tpot_ms: np.ndarray
    rtt_ms: np.ndarray           # (origins, P)
    epoch_s: float
    n_epochs: int
    t0: float
    max_instances: int
    hist_t: np.ndarray
    hist_class: np.ndarray
    hist_in: np.ndarray
    hist_out: np.ndarray
    hist_origin: np.ndarray


@dataclass
class PlanView:
    """What a planner knows at the start of epoch ``epoch`` (time ``t``): decision-time only.

    Per pool (length P): its instances by state -- ``launching``, ``ready`` (taking work),
    ``draining``, ``noticed`` (a spot notice: dying) --, the telemetry at or before ``t``
    (``available``: recorded availability; ``price_h``: an instance's USD per hour, NaN unpriced;
    ``hazard``: preemptions per second, the posterior mean ``xroute/CloudRoute-v0`` uses;
    ``preemptions``: recorded in the lookback; ``since_preempt_s``: seconds since the last recorded
    one, inf when none), ``quota_room`` (instances more the quotas allow now;
    a large number without a quota), ``inflight`` (its requests the router has not seen complete)
    and what its own instances went through in the last epoch (``failed_launches``, ``noticed_last``,
    ``work_s``: the integral over the epoch of its requests in flight there -- over replicas x epoch,
    the mean requests in flight per replica, the concurrency an autoscaler such as Knative's KPA
    scales on). The window's requests that arrived before
    ``t`` (``arr_t``, ``arr_class``, ``arr_in``, ``arr_origin``), the decayed mean output of each
    class's completed requests (``out_mean``; NaN before the first completion) and the requests of
    each class waiting in the router's queue (``queued``)."""

    t: float
    epoch: int
    launching: np.ndarray
    ready: np.ndarray
    draining: np.ndarray
    noticed: np.ndarray
    available: np.ndarray
    price_h: np.ndarray
    hazard: np.ndarray
    preemptions: np.ndarray
    since_preempt_s: np.ndarray
    quota_room: np.ndarray
    inflight: np.ndarray
    failed_launches: np.ndarray
    noticed_last: np.ndarray
    work_s: np.ndarray
    arr_t: np.ndarray
    arr_class: np.ndarray
    arr_in: np.ndarray
    arr_origin: np.ndarray
    out_mean: np.ndarray
    queued: np.ndarray

    @property
    def held(self) -> np.ndarray:
        """Instances that count toward a target: launching + ready."""
        return self.launching + self.ready


@dataclass
class EpochResult:
    """What one epoch did (``ProvisionWorld.step``)."""

    epoch: int
    t: float
    cost_usd: float
    launches: int
    failed_launches: int
    quota_refused: int
    noticed: int
    completed: int
    slo_missed: int
    done: bool
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Hindsight:
    """HINDSIGHT, for the oracle only: the whole window's truth on the epoch grid -- per epoch and
    class the arrivals (``count``), the busiest ``peak_s`` sub-window's rate (``peak_rate``), the
    mean input and output; per epoch and pool whether a launch at its start succeeds
    (``launchable``) and whether an instance there serves through it (``alive``: no notice, no
    preemption); the instance price (``price_h``)."""

    count: np.ndarray
    peak_rate: np.ndarray
    mean_in: np.ndarray
    mean_out: np.ndarray
    launchable: np.ndarray
    alive: np.ndarray
    price_h: np.ndarray


def _decayed_means(keys: np.ndarray, values: np.ndarray, n_keys: int, decay: float) -> tuple[np.ndarray, np.ndarray]:
    """Per key, the decayed weight and weighted sum of ``values`` observed in order (the last weighs 1)."""
    w, s = np.zeros(n_keys), np.zeros(n_keys)
    for k in np.unique(keys):
        v = values[keys == k]
        wt = decay ** np.arange(v.size - 1, -1, -1, dtype=float)
        w[k], s[k] = wt.sum(), (wt * v).sum()
    return w, s


class ProvisionWorld:
    """The provisioning world (module docstring). ``bundle``: its telemetry and request stream (a
    window of it, e.g. a split's); ``history``: the requests before the stream (known at its start);
    ``pools``: restrict to these pool ids (``model@offering_id``) or offering ids."""

    def __init__(self, bundle: Bundle | str | None = None, config: ProvisionConfig | dict[str, Any] | None = None,
                 history: pd.DataFrame | None = None, pools: list[str] | None = None, **overrides: Any):
        if isinstance(config, ProvisionConfig):
            cfg = config.model_copy(update=overrides) if overrides else config
        else:
            cfg = parse_config(ProvisionConfig, {**(config or {}), **overrides}, "provision config")
        self.cfg = cfg
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
        self.catalog = self.bundle.catalog()
        self._init_pools(pools)
        self._init_stream(history)
        self._init_telemetry()
        self._T: float | None = None

    # ------------------------------------------------------------------ setup
    def _init_pools(self, only: list[str] | None) -> None:
        serving = load_serving(self.cfg.serving_config)
        models = load_models(self.cfg.models_config)
        if serving.launch is None:
            raise ConfigError(f"{self.cfg.serving_config}: field 'launch': missing (the provisioning world needs the "
                              "launch delays)")
        launch = serving.launch
        w = self.bundle.workload
        named = set(w["model"].astype(str).str.strip()) - {""} if "model" in w.columns else set()
        unknown = sorted(named - set(models.models))
        if unknown:
            raise ConfigError(f"workload: field 'model': unknown model '{unknown[0]}'")
        names = [models.default_model, *sorted(m for m in named if m != models.default_model)]
        counts = [o.replicas_per_instance for o in self.catalog]
        pl = place(self.catalog, counts, serving, models, names)
        self.model_names = pl.models
        self.models_cfg = models
        ids, mod, off = [], [], []
        for k, m in enumerate(pl.models):
            for i, o in enumerate(self.catalog):
                if pl.fits[k, i] and pl.replicas[k, i] >= 1:
                    ids.append(f"{m}@{o.offering_id}")
                    mod.append(k)
                    off.append(i)
        if only is not None:
            keep = []
            known = set(ids)
            for x in only:
                hit = [j for j, pid in enumerate(ids) if pid == x or pid.split("@", 1)[1] == x]
                if not hit:
                    raise ConfigError(f"pools: unknown pool '{x}' (a pool is model@offering_id, e.g. "
                                      f"{next(iter(sorted(known)), '-')})")
                keep.extend(hit)
            sel = sorted(set(keep))
            ids, mod, off = [ids[j] for j in sel], [mod[j] for j in sel], [off[j] for j in sel]
        if not ids:
            raise ConfigError("pools: no offering of the bundle can hold the stream's models")
        mod_a, off_a = np.array(mod, dtype=np.int64), np.array(off, dtype=np.int64)
        #: the pools of each offering (one per model the offering holds)
        self.pool_of_offering = [np.flatnonzero(off_a == i) for i in range(len(self.catalog))]
        mc = self.cfg.migration
        col = self.bundle.offerings.get("notice_s")
        notice = np.full(len(self.catalog), mc.default_notice_s) if col is None else col.to_numpy(dtype=float)
        notice = np.where(np.isnan(notice), mc.default_notice_s, notice)
        spot = np.array([self.catalog[i].is_spot for i in off_a])
        gpus = np.array([max(1, self.catalog[i].accelerator_count) for i in off_a], dtype=float)
        acc = [self.catalog[i].accelerator for i in off_a]
        boot = np.array([launch.boot_s.get(a, launch.boot_s_single_gpu if g <= 1 else launch.boot_s_multi_gpu)
                         for a, g in zip(acc, gpus)])
        wgb = np.array([models.models[pl.models[k]].weights_gb for k in mod_a])
        self.pools = Pools(
            ids=ids, model=mod_a, offering=off_a, offering_ids=[self.catalog[i].offering_id for i in off_a],
            accelerator=acc, is_spot=spot, notice_s=np.where(spot & mc.notice, notice[off_a], 0.0), gpus=gpus,
            per_inst=pl.replicas[mod_a, off_a].astype(float), conc=pl.conc[mod_a, off_a].astype(float),
            prefill_tok_s=pl.prefill_tok_s[mod_a, off_a], tpot_s=pl.tpot_s[mod_a, off_a],
            growth=pl.growth[mod_a, off_a], sigma=pl.sigma[mod_a, off_a],
            launch_s=boot + launch.engine_start_s + wgb / launch.weights_gb_per_s,
            location=[self.catalog[i].location for i in off_a])
        P, R = self.pools.n, self.cfg.max_instances_per_pool
        self.P, self.R = P, R
        self.pool_index = {pid: p for p, pid in enumerate(ids)}
        self.M = len(self.model_names)
        mp = np.full((self.M, P), -1, dtype=np.int64)
        npools = np.zeros(self.M, dtype=np.int64)
        for p in range(P):
            mk = int(mod_a[p])
            mp[mk, npools[mk]] = p
            npools[mk] += 1
        #: every pool of each model (static); ``active``/``n_active``: those with an instance taking work, the
        #: router's candidates (kept by ``_set_state``)
        self.model_pools, self.model_npools = mp, npools
        self.kv_bytes_tok = np.array([models.models[m].kv_mib_per_token * 2.0 ** 20 for m in self.model_names])
        # the compiled state's static part
        pf = np.zeros((pk.N_PF, P))
        pf[pk.PF_INV_PREFILL] = 1.0 / self.pools.prefill_tok_s
        pf[pk.PF_TPOT] = self.pools.tpot_s
        pf[pk.PF_GROWTH] = self.pools.tpot_s * self.pools.growth
        pf[pk.PF_SIGMA] = self.pools.sigma
        pf[pk.PF_PER_INST] = self.pools.per_inst
        pf[pk.PF_CONC] = self.pools.conc
        sg = self.pools.sigma
        pf[pk.PF_SURE] = np.where(sg > 0, np.exp(8.3 * np.sqrt(2.0) * sg), 1.0)
        self._pf0 = pf
        slots = self.pools.slots
        self.row_pool = np.repeat(np.arange(P), R)
        self.slot0 = np.zeros(P * R, dtype=np.int64)
        self.slot0[1:] = np.cumsum(slots[self.row_pool])[:-1]
        self.n_slots = int(slots[self.row_pool].sum())
        locs = self.pools.location
        rtt = self.bundle.rtt_lookup()
        far = max(rtt.values()) if rtt else 0.0
        tp = throughput_lookup(self.bundle.throughput)
        uniq = sorted(set(locs))
        li = {x: k for k, x in enumerate(uniq)}
        self.pool_loc = np.array([li[x] for x in locs], dtype=np.int64)
        self.loc_rtt = np.array([[rtt.get((a, b), far) for b in uniq] for a in uniq])
        self.loc_gbps = np.array([[tp.get((a, b), mc.default_throughput_gbps) for b in uniq] for a in uniq])
        # cloud capacity quotas: per quota, its times, room, and what one instance of each pool takes
        q = CapacityQuotas(self.bundle, self.catalog)
        self.quotas = []
        for qt, room, covered, take in q.quotas:
            per_off = np.zeros(len(self.catalog))
            per_off[covered] = take
            self.quotas.append((qt, room, per_off[off_a]))

    def _superpose(self, w: pd.DataFrame) -> pd.DataFrame:
        """``load_scale`` copies of a stream, copy j delayed by j x epoch_s / load_scale (arrival order kept)."""
        k = self.cfg.load_scale
        if k <= 1 or not len(w):
            return w
        step = pd.Timedelta(seconds=self.cfg.epoch_s / k)
        parts = []
        for j in range(k):
            c = w.copy()
            c["ts"] = c["ts"] + j * step
            if "request_id" in c.columns:
                c["request_id"] = c["request_id"].astype(str) + (f"#{j}" if j else "")
            parts.append(c)
        return pd.concat(parts, ignore_index=True).sort_values("ts", kind="stable").reset_index(drop=True)

    def _init_stream(self, history: pd.DataFrame | None) -> None:
        w = self._superpose(self.bundle.workload)
        if history is not None:
            history = self._superpose(history)
        t = to_seconds(w["ts"])
        self.t0_raw = float(t[0])
        self.arrival_raw = t
        rtt = self.bundle.rtt_lookup()
        origins = origins_reaching(rtt, set(self.pools.location), {s for s, _ in rtt} | set(w["origin"]))
        self.origins = origins
        oi = {o: k for k, o in enumerate(origins)}
        self.rtt_ms = np.array([[rtt[(o, loc)] for loc in self.pools.location] for o in origins])
        tenants = w["tenant"].astype(str).to_numpy() if "tenant" in w.columns else np.full(len(w), "", dtype=object)
        models = (w["model"].astype(str).str.strip().replace("", self.model_names[0]).to_numpy()
                  if "model" in w.columns else np.full(len(w), self.model_names[0], dtype=object))
        mi = {m: k for k, m in enumerate(self.model_names)}
        cls_names: list[str] = []
        cls_index: dict[tuple[str, str], int] = {}

        def cls_of(ms: np.ndarray, ts: np.ndarray) -> np.ndarray:
            out = np.empty(len(ms), dtype=np.int64)
            for k, key in enumerate(zip(ms.tolist(), ts.tolist())):
                c = cls_index.get(key)
                if c is None:
                    c = cls_index[key] = len(cls_names)
                    cls_names.append(f"{key[0]}/{key[1]}")
                out[k] = c
            return out

        self.q_class = cls_of(models, tenants)
        self.q_model = np.array([mi[m] for m in models], dtype=np.int64)
        self.q_origin = w["origin"].map(oi).to_numpy()
        if np.isnan(self.q_origin.astype(float)).any():
            raise ConfigError("workload: field 'origin': an origin with no RTT to every pool's location")
        self.q_origin = self.q_origin.astype(np.int64)
        self.q_in = w["input_tokens"].to_numpy(dtype=float)
        self.q_out = w["output_tokens"].to_numpy(dtype=float)
        self.q_maxout = w["max_output_tokens"].to_numpy(dtype=float)
        self.q_ttft = w["ttft_ms"].to_numpy(dtype=float)
        self.q_tpot = w["tpot_ms"].to_numpy(dtype=float)
        self.q_deadline = w["deadline_ms"].to_numpy(dtype=float) if "deadline_ms" in w.columns \
            else np.full(len(w), np.nan)
        self.q_tenant = tenants
        h_t = h_c = h_in = h_out = h_org = np.zeros(0)
        if history is not None and len(history):
            hm = (history["model"].astype(str).str.strip().replace("", self.model_names[0]).to_numpy()
                  if "model" in history.columns else np.full(len(history), self.model_names[0], dtype=object))
            ht = history["tenant"].astype(str).to_numpy() if "tenant" in history.columns \
                else np.full(len(history), "", dtype=object)
            ok = np.array([m in mi for m in hm])
            h_t = to_seconds(history["ts"])[ok]
            h_c = cls_of(hm[ok], ht[ok])
            h_in = history["input_tokens"].to_numpy(dtype=float)[ok]
            h_out = history["output_tokens"].to_numpy(dtype=float)[ok]
            h_org = history["origin"].map(oi).fillna(-1).to_numpy(dtype=np.int64)[ok]
        self.C = len(cls_names)
        self.class_names = cls_names
        self.class_model = np.array([mi[n.split("/", 1)[0]] for n in cls_names], dtype=np.int64)
        mode_of = pd.DataFrame({"c": self.q_class, "ttft": self.q_ttft, "tpot": self.q_tpot})
        ttft = np.full(self.C, np.nan)
        tpot = np.full(self.C, np.nan)
        for c, g in mode_of.groupby("c"):
            ttft[int(c)] = float(g["ttft"].mode().iloc[0])
            tpot[int(c)] = float(g["tpot"].mode().iloc[0])
        self.class_ttft, self.class_tpot = ttft, tpot
        self.q_key = self.M + self.q_class  # estimator rows: models first, then classes
        self.hist = (h_t.astype(float), h_c.astype(np.int64), h_in.astype(float), h_out.astype(float),
                     h_org.astype(np.int64))
        self.set_rate_scale(self.cfg.rate_scale)

    def set_rate_scale(self, rate_scale: float) -> None:
        if rate_scale <= 0:
            raise ConfigError(f"provision config: field 'rate_scale': must be > 0, got {rate_scale}")
        self.rate_scale = rate_scale
        self.arrival = self.t0_raw + (self.arrival_raw - self.t0_raw) / rate_scale
        span = float(self.arrival[-1] - self.t0_raw)
        self.n_epochs_total = max(1, math.floor(span / self.cfg.epoch_s) + 1)

    def _init_telemetry(self) -> None:
        n = len(self.catalog)
        self.replay = TelemetryReplay(self.bundle, np.ones(n))  # instance prices (not per GPU)
        self.spot_off = np.flatnonzero([o.is_spot for o in self.catalog])
        self.rec_up = self.replay.up_times

    # ------------------------------------------------------------------ the epoch grid's telemetry
    def _grid_telemetry(self, times: np.ndarray) -> dict[str, np.ndarray]:
        """Decision-time telemetry at each of ``times`` (per offering): instance price per hour,
        recorded availability, preemptions in the lookback, hazard (``xroute/CloudRoute-v0``'s)."""
        rp, c = self.replay, self.cfg
        n = len(self.catalog)
        E = times.size
        price = np.empty((E, n))
        avail = np.empty((E, n))
        for e, t in enumerate(times.tolist()):
            price[e] = rp.prices.values_at(t, default=np.nan)
            avail[e] = rp.avail.values_at(t, default=1.0)
        look = c.risk_lookback_h * 3600.0
        count = np.zeros((E, n))
        for i, d in enumerate(rp.down_times):
            if d.size:
                count[:, i] = np.searchsorted(d, times, side="right") - np.searchsorted(d, times - look, side="right")
        first = rp.avail.first_times()
        observed = np.clip(times[:, None] - first[None, :], 0.0, look)
        spot = np.array([o.is_spot for o in self.catalog])
        hazard = np.where(spot[None, :], (count + c.risk_prior_per_h * c.risk_prior_h)
                          / (observed + c.risk_prior_h * 3600.0), 0.0)
        since = np.full((E, n), np.inf)  # seconds since the last recorded preemption (inf: none recorded)
        for i, d in enumerate(rp.down_times):
            if d.size:
                k = np.searchsorted(d, times, side="right")
                since[:, i] = np.where(k > 0, times - d[np.maximum(k - 1, 0)], np.inf)
        return {"price": price, "avail": avail > 0.5, "count": count, "hazard": hazard, "since": since}

    # ------------------------------------------------------------------ reset
    def reset(self, seed: int | None = None, start_epoch: int = 0, n_epochs: int | None = None) -> PlanContext:
        """Start the window at epoch ``start_epoch`` of the stream's grid for ``n_epochs`` epochs
        (default: to the end), every pool empty. Returns what a planner knows (:class:`PlanContext`)."""
        E_all = self.n_epochs_total
        if not 0 <= start_epoch < E_all:
            raise ConfigError(f"reset: field 'start_epoch': must be in 0..{E_all - 1}, got {start_epoch}")
        E = E_all - start_epoch if n_epochs is None else int(n_epochs)
        if not 1 <= E <= E_all - start_epoch:
            raise ConfigError(f"reset: field 'n_epochs': must be in 1..{E_all - start_epoch}, got {n_epochs}")
        self.rng = np.random.default_rng(seed)
        dt = self.cfg.epoch_s
        T0 = self.t0_raw + start_epoch * dt
        self.T0, self.E, self.dt = T0, E, dt
        self.times = T0 + dt * np.arange(E)
        lo = int(np.searchsorted(self.arrival, T0, side="left"))
        hi = int(np.searchsorted(self.arrival, T0 + E * dt, side="left"))
        self.lo, self.hi = lo, hi
        N = hi - lo
        self.N = N
        sl = slice(lo, hi)
        QF = np.zeros((pk.N_QF, N))
        QF[pk.QF_T], QF[pk.QF_IN], QF[pk.QF_OUT] = self.arrival[sl], self.q_in[sl], self.q_out[sl]
        QF[pk.QF_TTFT], QF[pk.QF_TPOT], QF[pk.QF_DEADLINE] = self.q_ttft[sl], self.q_tpot[sl], self.q_deadline[sl]
        QF[pk.QF_Z] = self.rng.standard_normal(N)
        QF[pk.QF_MAXOUT] = self.q_maxout[sl]
        QF[pk.QF_FIRST] = QF[pk.QF_END] = np.nan
        QI = np.zeros((pk.N_QI, N), dtype=np.int64)
        QI[pk.QI_ORIGIN], QI[pk.QI_KEY], QI[pk.QI_MODEL] = self.q_origin[sl], self.q_key[sl], self.q_model[sl]
        QI[pk.QI_POOL] = QI[pk.QI_ROW] = -1
        self.QF, self.QI = QF, QI
        P, R = self.P, self.R
        self.PF = self._pf0.copy()
        self.PF[pk.PF_LAST] = T0
        self.PI = np.zeros((pk.N_PI, P), dtype=np.int64)
        self.PI[pk.PI_MODEL] = self.pools.model
        self.PI[pk.PI_ROW0] = np.arange(P) * R
        self.PI[pk.PI_NROWS] = 0  # (grows as rows are first taken: _launch)
        self.PI[pk.PI_SLOTS] = self.pools.slots
        self.RF = np.zeros((pk.N_RF, P * R))
        self.RF[pk.RF_END] = -np.inf
        self.RI = np.zeros((pk.N_RI, P * R), dtype=np.int64)
        self.RI[pk.RI_POOL] = self.row_pool
        self.RI[pk.RI_SLOT0] = self.slot0
        self.S = np.full(self.n_slots, -np.inf)
        self.ht = np.zeros(2 * N + 16)
        self.hi_ = np.zeros(2 * N + 16, dtype=np.int64)
        self.ctr = np.zeros(pk.N_C, dtype=np.int64)
        self.ctr[pk.C_N] = N
        self.backlog = np.zeros(N + 1, dtype=np.int64)
        rw, ec = self.cfg.reward, self.cfg.estimator
        self.prm = np.array([rw.cost_weight, rw.latency_weight, rw.sla_penalty, rw.cost_norm_cap, rw.latency_norm_cap,
                             self.cfg.retry_overhead_ms, 0.5 ** (1.0 / ec.half_life), ec.shrinkage, ec.prior_fraction,
                             self.cfg.queue_timeout_s])
        assert self.prm.size == pk.N_P
        self._seed_estimator(lo)
        # per pool state counts (launching, ready, draining, noticed), the rows by state
        self.count = np.zeros((5, P), dtype=np.int64)
        self.active = np.full((self.M, P), -1, dtype=np.int64)
        self.n_active = np.zeros(self.M, dtype=np.int64)
        self._launch_q: list[tuple[float, int]] = []  # (ready at, row)
        # telemetry on the grid (decision-time) and the truth of the spot pools
        tel = self._grid_telemetry(self.times)
        off = self.pools.offering
        self.g_price = tel["price"][:, off]
        self.g_price_s = np.nan_to_num(self.g_price, nan=0.0) / 3600.0
        self.g_avail = tel["avail"][:, off]
        self.g_count = tel["count"][:, off]
        self.g_hazard = tel["hazard"][:, off]
        self.g_since = tel["since"][:, off]
        self._true_spot()
        # per epoch records
        self.e = 0
        self._T = T0
        self.stats = {"launches": 0, "failed_launches": 0, "quota_refused": 0, "noticed": 0,
                      "migrations": 0, "transfer": 0, "recompute": 0, "resend": 0, "restart": 0, "missed_window": 0,
                      "tokens_recomputed": 0.0, "kv_bytes_moved": 0.0, "cost_usd": 0.0}
        self.rec_serving = np.zeros((E, P), dtype=np.int32)   # instances taking work at each epoch's end
        self.rec_held = np.zeros((E, P), dtype=np.int32)      # instances billed at each epoch's end
        self.rec_cost = np.zeros(E)
        self.rec_arrivals = np.zeros(E, dtype=np.int64)
        self._last_failed = np.zeros(P, dtype=np.int64)
        self._last_noticed = np.zeros(P, dtype=np.int64)
        self._last_busy = np.zeros(P)
        self.acc = np.zeros(2)
        # finished incarnations of reused rows, within the window: held and busy seconds, GPU-seconds, spot-seconds
        self.tot = np.zeros(4)
        self._finished = False
        return self.context()

    def _seed_estimator(self, lo: int) -> None:
        """The output estimator starts from the outputs known before the window: the history, and
        the stream's requests that arrived ``history_lag_s`` before it."""
        K = self.M + self.C
        self.est = np.zeros((2, K))
        ht, hc, _, hout, _ = self.hist
        cut = self.arrival[lo] - self.cfg.estimator.history_lag_s if lo < self.arrival.size else np.inf
        stop = int(np.searchsorted(self.arrival, cut, side="right"))
        stop = min(stop, lo)
        keys = np.concatenate([self.M + hc, self.q_key[:stop]]).astype(np.int64)
        vals = np.concatenate([hout, self.q_out[:stop]])
        if keys.size:
            decay = float(self.prm[pk.P_DECAY])
            parents = np.concatenate([self.class_model[hc], self.q_model[:stop]]).astype(np.int64)
            w1, s1 = _decayed_means(keys, vals, K, decay)
            w2, s2 = _decayed_means(parents, vals, K, decay)
            self.est[0] = w1 + w2
            self.est[1] = s1 + s2

    def _true_spot(self) -> None:
        """When each spot offering's recorded preemptions really happen (``spot_lag_s`` x U(0,1)
        before the record, never before its previous row), the notices' events in the window, and
        whether a launch at each epoch's start finds capacity (recorded available, and not between
        a notice and the recorded return)."""
        rp, lag = self.replay, self.cfg.spot_lag_s
        n = len(self.catalog)
        self.true_down: list[np.ndarray] = []
        for i, d in enumerate(rp.down_times):
            if d.size == 0 or lag <= 0:
                self.true_down.append(d)
                continue
            ts = rp.avail.t[rp.avail.off[i]:rp.avail.off[i + 1]]
            k = np.searchsorted(ts, d, side="left")
            gap = np.minimum(np.where(k > 0, d - ts[np.maximum(k - 1, 0)], 0.0), lag)
            self.true_down.append(d - self.rng.random(d.size) * gap)
        off = self.pools.offering
        notice_off = np.zeros(n)
        notice_off[off] = self.pools.notice_s
        launchable = self.g_avail.copy()
        end = self.T0 + self.E * self.dt
        ev: list[tuple[float, int, int, float]] = []
        for i in self.spot_off.tolist():
            d, rec = self.true_down[i], rp.down_times[i]
            if d.size == 0:
                continue
            ups = rp.up_times[i]
            cols = np.flatnonzero(off == i)
            for td, tr in zip(d.tolist(), rec.tolist()):
                tn = td - notice_off[i]
                ku = int(np.searchsorted(ups, tr, side="right"))
                up = float(ups[ku]) if ku < ups.size else np.inf
                if cols.size:
                    out = (self.times >= tn) & (self.times < up)
                    launchable[np.ix_(out, cols)] = False
                if tn < end and td >= self.T0:
                    ev.append((max(tn, self.T0), _NOTICE, i, td))
        ev.sort()
        self._events = ev
        self._ev_pos = 0
        self.g_launchable = launchable

    # ------------------------------------------------------------------ what planners read
    def context(self) -> PlanContext:
        """What a planner knows at the window's start: the history given, and -- for a window that starts
        later in the stream (``reset(start_epoch=k)``) -- the stream's requests before it, whose outputs
        are known only for those that arrived ``estimator.history_lag_s`` before (NaN for the others)."""
        ht, hc, hin, hout, horg = self.hist
        lo = self.lo
        if lo > 0:
            known = self.arrival[:lo] <= self.T0 - self.cfg.estimator.history_lag_s
            ht = np.concatenate([ht, self.arrival[:lo]])
            hc = np.concatenate([hc, self.q_class[:lo]])
            hin = np.concatenate([hin, self.q_in[:lo]])
            hout = np.concatenate([hout, np.where(known, self.q_out[:lo], np.nan)])
            horg = np.concatenate([horg, self.q_origin[:lo]])
        return PlanContext(pools=self.pools, model_names=self.model_names, class_names=list(self.class_names),
                           class_model=self.class_model, class_ttft_ms=self.class_ttft, class_tpot_ms=self.class_tpot,
                           rtt_ms=self.rtt_ms, epoch_s=self.dt, n_epochs=self.E, t0=self.T0,
                           max_instances=self.R, hist_t=ht, hist_class=hc, hist_in=hin, hist_out=hout,
                           hist_origin=horg)

    def view(self) -> PlanView:
        """What a planner knows now, at the start of the current epoch (:class:`PlanView`)."""
        e = min(self.e, self.E - 1)
        T = self._T if self._T is not None else self.T0
        k = int(np.searchsorted(self.QF[pk.QF_T], T, side="left"))
        keys = self.M + np.arange(self.C)
        w = self.est[0, keys]
        out_mean = np.where(w > 0, self.est[1, keys] / np.where(w > 0, w, 1.0), np.nan)
        lo = self.lo
        return PlanView(
            t=T, epoch=self.e, launching=self.count[pk.LAUNCHING].copy(), ready=self.count[pk.READY].copy(),
            draining=self.count[pk.DRAINING].copy(), noticed=self.count[pk.NOTICED].copy(),
            available=self.g_avail[e].copy(), price_h=self.g_price[e].copy(), hazard=self.g_hazard[e].copy(),
            preemptions=self.g_count[e].copy(), since_preempt_s=self.g_since[e].copy(), quota_room=self._quota_room(T),
            inflight=self.PI[pk.PI_INFLIGHT].copy(),
            failed_launches=self._last_failed.copy(), noticed_last=self._last_noticed.copy(),
            work_s=self._last_busy.copy(), arr_t=self.QF[pk.QF_T, :k], arr_class=self.q_class[lo:lo + k],
            arr_in=self.QF[pk.QF_IN, :k], arr_origin=self.QI[pk.QI_ORIGIN, :k], out_mean=out_mean,
            queued=np.bincount(self.q_class[lo + self.backlog[self.ctr[pk.C_BHEAD]:self.ctr[pk.C_BTAIL]]],
                               minlength=self.C))

    def inventory_at(self, at: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per pool, what the bundle's ``inventory`` table (``envs.replay.PoolInventory``) says at
        ``at``: instances running, instances launching (0 where not reported), and whether the pool
        is reported at all (a pool without rows, or before its first: not known)."""
        inv = PoolInventory(self.bundle, self.model_names, self.models_cfg.default_model)
        m, o = self.pools.model, self.pools.offering
        run, launch = inv.running_at(at)[m, o], inv.launching_at(at)[m, o]
        known = ~np.isnan(run)
        return (np.nan_to_num(run).astype(np.int64), np.nan_to_num(launch).astype(np.int64), known)

    def decision_view(self, at: float) -> tuple[PlanContext, PlanView]:
        """What a planner knows at telemetry time ``at`` when it plans for real rather than in a
        simulation (``xroute plan``, ``GET /v1/capacity/plan``): the context of a window that starts
        at ``at`` -- every request of the stream (and of the history given) before it is history,
        its output known when it arrived ``estimator.history_lag_s`` before --, and the view at its
        start: the instances the ``inventory`` table reports (running ones ready, launching ones
        launching; none where it reports nothing), the telemetry at or before ``at``, the quotas'
        room (their usage already counts what runs), nothing in flight, queued or failed (the world
        did not play the past). Decision-time only: nothing after ``at`` is read."""
        c = self.cfg
        k = int(np.searchsorted(self.arrival, at, side="left"))
        ht, hc, hin, hout, horg = self.hist
        known = self.arrival[:k] <= at - c.estimator.history_lag_s
        ctx = PlanContext(
            pools=self.pools, model_names=self.model_names, class_names=list(self.class_names),
            class_model=self.class_model, class_ttft_ms=self.class_ttft, class_tpot_ms=self.class_tpot,
            rtt_ms=self.rtt_ms, epoch_s=c.epoch_s, n_epochs=1, t0=at, max_instances=self.R,
            hist_t=np.concatenate([ht, self.arrival[:k]]), hist_class=np.concatenate([hc, self.q_class[:k]]),
            hist_in=np.concatenate([hin, self.q_in[:k]]),
            hist_out=np.concatenate([hout, np.where(known, self.q_out[:k], np.nan)]),
            hist_origin=np.concatenate([horg, self.q_origin[:k]]))
        done = np.isfinite(ctx.hist_out)
        w, sm = _decayed_means(ctx.hist_class[done], ctx.hist_out[done], self.C, 0.5 ** (1.0 / c.estimator.half_life))
        tel = self._grid_telemetry(np.array([at], dtype=float))
        off = self.pools.offering
        running, launching, _ = self.inventory_at(at)
        P, zero, empty = self.P, np.zeros(self.P, dtype=np.int64), np.zeros(0)
        view = PlanView(
            t=at, epoch=0, launching=launching, ready=running, draining=zero.copy(), noticed=zero.copy(),
            available=tel["avail"][0, off], price_h=tel["price"][0, off], hazard=tel["hazard"][0, off],
            preemptions=tel["count"][0, off], since_preempt_s=tel["since"][0, off],
            quota_room=self._quota_room(at, alive=np.zeros(P, dtype=np.int64)), inflight=zero.copy(),
            failed_launches=zero.copy(), noticed_last=zero.copy(), work_s=np.zeros(P), arr_t=empty,
            arr_class=np.zeros(0, dtype=np.int64), arr_in=empty, arr_origin=np.zeros(0, dtype=np.int64),
            out_mean=np.where(w > 0, sm / np.where(w > 0, w, 1.0), np.nan), queued=np.zeros(self.C, dtype=np.int64))
        return ctx, view

    def hindsight(self, peak_s: float = 15.0) -> Hindsight:
        """HINDSIGHT, for the oracle only (:class:`Hindsight`): it reads the realized future."""
        E, C = self.E, self.C
        t = self.QF[pk.QF_T]
        cls = self.q_class[self.lo:self.hi]
        e_of = np.minimum(((t - self.T0) // self.dt).astype(np.int64), E - 1)
        count = np.zeros((E, C))
        np.add.at(count, (e_of, cls), 1.0)
        sub = max(1, round(self.dt / peak_s))
        s_of = np.minimum(((t - self.T0) // (self.dt / sub)).astype(np.int64), E * sub - 1)
        fine = np.zeros((E * sub, C))
        np.add.at(fine, (s_of, cls), 1.0)
        peak = fine.reshape(E, sub, C).max(axis=1) / (self.dt / sub)
        s_in, s_out = np.zeros((E, C)), np.zeros((E, C))
        np.add.at(s_in, (e_of, cls), self.QF[pk.QF_IN])
        np.add.at(s_out, (e_of, cls), self.QF[pk.QF_OUT])
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_in, mean_out = s_in / count, s_out / count
        # an instance serves through epoch e when no notice (or preemption) of its pool falls in it or before its
        # end, and the pool is launchable at its start
        alive = self.g_launchable.copy()
        off = self.pools.offering
        for (tn, _kind, i, td) in self._events:
            cols = np.flatnonzero(off == i)
            if not cols.size:
                continue
            hit = (self.times + self.dt > tn) & (self.times < td)
            alive[np.ix_(hit, cols)] = False
        return Hindsight(count=count, peak_rate=peak, mean_in=mean_in, mean_out=mean_out,
                         launchable=self.g_launchable.copy(), alive=alive, price_h=self.g_price.copy())

    # ------------------------------------------------------------------ one epoch
    def targets_array(self, targets: np.ndarray | Mapping[str, int] | list[int]) -> np.ndarray:
        """A plan as an int64 array over the pools: an array (or list) of length P, or a mapping of
        pool ids (``model@offering_id``, or the offering id where one model) to targets (pools it
        omits: 0). Errors name the field: an unknown pool, a negative, fractional or too large target."""
        P = self.P
        if isinstance(targets, Mapping):
            out = np.zeros(P, dtype=np.int64)
            for key, v in targets.items():
                p = self.pool_index.get(str(key))
                if p is None:
                    hits = [j for j, pid in enumerate(self.pools.ids) if pid.split("@", 1)[1] == str(key)]
                    if len(hits) != 1:
                        raise ConfigError(f"plan: field '{key}': unknown pool (pools are model@offering_id, e.g. "
                                          f"{self.pools.ids[0]})")
                    p = hits[0]
                out[p] = self._one_target(str(key), v)
            return out
        if isinstance(targets, np.ndarray) and targets.dtype == np.int64 and targets.shape == (P,) and \
                pk.within(targets, self.R):  # (the planners' own arrays: checked in one pass, not copied)
            return targets
        a = np.asarray(targets)
        if a.shape != (P,):
            raise ConfigError(f"plan: field 'targets': expected {P} targets (one per pool), got shape {a.shape}")
        if a.dtype.kind not in "iuf" or (a.dtype.kind == "f" and not np.all(np.isfinite(a))):
            raise ConfigError("plan: field 'targets': must be whole numbers of instances")
        if a.dtype.kind == "f" and np.any(a != np.round(a)):
            p = int(np.flatnonzero(a != np.round(a))[0])
            raise ConfigError(f"plan: field '{self.pools.ids[p]}': {a[p]} is not a whole number of instances")
        a = a.astype(np.int64)
        bad = np.flatnonzero((a < 0) | (a > self.R))
        if bad.size:
            p = int(bad[0])
            raise ConfigError(f"plan: field '{self.pools.ids[p]}': target {a[p]} must be in 0..{self.R} "
                              "(max_instances_per_pool)")
        return a

    def _one_target(self, key: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer, float)) or (isinstance(v, float) and
                                                                                  (not math.isfinite(v) or v != int(v))):
            raise ConfigError(f"plan: field '{key}': {v!r} is not a whole number of instances")
        v = int(v)
        if not 0 <= v <= self.R:
            raise ConfigError(f"plan: field '{key}': target {v} must be in 0..{self.R} (max_instances_per_pool)")
        return v

    def step(self, targets: np.ndarray | Mapping[str, int] | list[int]) -> EpochResult:
        """Apply a plan at the current epoch's start, then simulate the epoch (module docstring)."""
        if self._T is None:
            raise ConfigError("step: call reset first")
        if self._finished:
            raise ConfigError("step: the window is over; call reset")
        tg = self.targets_array(targets)
        T, T1 = self._T, self._T + self.dt
        e = self.e
        self._settle(T)
        before = dict(self.stats)
        self._apply(tg, T, warm=(e == 0 and self.cfg.warm_start))
        self.acc[:] = 0.0
        work0 = self.PF[pk.PF_WORK].copy()
        self._run(T, T1)
        pk.integrate_in_flight(self.PF, self.PI, T1)  # the in-flight integral up to the epoch's end
        cost = self._bill(T, T1)
        self.stats["cost_usd"] += cost
        self._last_busy = self.PF[pk.PF_WORK] - work0
        self.rec_cost[e] = cost
        self.rec_serving[e] = self.count[pk.READY]
        self.rec_held[e] = self.count[pk.LAUNCHING:].sum(axis=0)
        self.e += 1
        self._T = T1
        self._settle(T1)
        done = self.e >= self.E
        if done:
            self._finish()
        completed, missed = int(self.acc[0]), int(self.acc[1])
        d = {k: int(self.stats[k] - before[k]) for k in ("launches", "failed_launches", "quota_refused", "noticed")}
        res = EpochResult(epoch=e, t=T, cost_usd=cost, launches=d["launches"], failed_launches=d["failed_launches"],
                          quota_refused=d["quota_refused"], noticed=d["noticed"], completed=completed,
                          slo_missed=missed, done=done)
        res.reward = -(cost + self.cfg.slo_miss_usd * missed)
        return res

    # ------------------------------------------------------------------ instances
    def _held_busy(self, rows: np.ndarray | slice, t_end: float) -> tuple[np.ndarray, np.ndarray]:
        """Rows' held seconds within ``[T0, t_end)`` and their busy seconds (some request running) in it."""
        lo = np.maximum(self.RF[pk.RF_LAUNCH, rows], self.T0)
        hi = np.minimum(self.RF[pk.RF_END, rows], t_end)
        held = np.maximum(hi - lo, 0.0)
        over = np.maximum(self.RF[pk.RF_BUSY_UNTIL, rows] - min(t_end, np.inf), 0.0)
        busy = np.minimum(np.maximum(self.RF[pk.RF_BUSY_S, rows] - over, 0.0), held)
        return held, busy

    def _set_state(self, r: int, new: int) -> None:
        p = int(self.row_pool[r])
        old = int(self.RI[pk.RI_STATE, r])
        if old != pk.EMPTY:
            self.count[old, p] -= 1
        if new != pk.EMPTY:
            self.count[new, p] += 1
        if old == pk.READY:
            self.PI[pk.PI_READY, p] -= 1
            if self.PI[pk.PI_READY, p] == 0:
                self._activity(p)
        if new == pk.READY:
            self.PI[pk.PI_READY, p] += 1
            if self.PI[pk.PI_READY, p] == 1:
                self._activity(p)
        self.RI[pk.RI_STATE, r] = new

    def _activity(self, p: int) -> None:
        """Pool ``p`` started or stopped taking work: its model's list of the router's candidates."""
        m = int(self.pools.model[p])
        ps = self.model_pools[m, :self.model_npools[m]]
        on = ps[self.PI[pk.PI_READY, ps] > 0]
        self.active[m, :on.size] = on
        self.n_active[m] = on.size

    def _settle(self, T: float) -> None:
        """Instances whose termination (a drain's end, a preemption) is past by ``T`` free their rows."""
        if not self.count[pk.DRAINING:].any():  # (draining and noticed: the last two rows)
            return
        st = self.RI[pk.RI_STATE]
        done = np.flatnonzero(((st == pk.DRAINING) | (st == pk.NOTICED)) & (self.RF[pk.RF_END] <= T))
        for r in done.tolist():
            self._set_state(r, pk.EMPTY)

    def _quota_room(self, T: float, alive: np.ndarray | None = None) -> np.ndarray:
        """Instances more each pool may launch under the quotas now (the held ones counted: ``alive``,
        by default the world's own instances, which the table's usage does not include)."""
        room = np.full(self.P, 1 << 30, dtype=np.int64)
        if not self.quotas:
            return room
        if alive is None:
            alive = self.count[pk.LAUNCHING] + self.count[pk.READY] + self.count[pk.DRAINING] + self.count[pk.NOTICED]
        for qt, qroom, take in self.quotas:
            k = int(np.searchsorted(qt, T, side="right")) - 1
            if k < 0:
                continue
            left = qroom[k] - float((take * alive).sum())
            cov = take > 0
            room[cov] = np.minimum(room[cov], np.floor(np.maximum(left, 0.0) / take[cov]).astype(np.int64))
        return room

    def _apply(self, tg: np.ndarray, T: float, warm: bool) -> None:
        """Launch, cancel or drain toward the targets at ``T`` (``warm``: launched before the window)."""
        diff = tg - self.count[pk.LAUNCHING] - self.count[pk.READY]
        e = self.e
        self._last_failed[:] = 0
        self._last_noticed[:] = 0
        for p in np.flatnonzero(diff).tolist():
            d = int(diff[p])
            r0 = p * self.R
            rows = slice(r0, r0 + self.R)
            st = self.RI[pk.RI_STATE, rows]
            if d > 0:
                if self.pools.is_spot[p] and not self.g_launchable[e, p]:
                    self.stats["failed_launches"] += d
                    self._last_failed[p] += d
                    continue
                if self.quotas:  # (the room counts the instances launched so far in this plan)
                    allowed = max(int(self._quota_room(T)[p]), 0)
                    if allowed < d:
                        self.stats["quota_refused"] += d - allowed
                        d = allowed
                free = np.flatnonzero(st == pk.EMPTY)[:d]
                for j in free.tolist():
                    self._launch(r0 + j, T, warm)
            else:
                d = -d
                launching = np.flatnonzero(st == pk.LAUNCHING)
                if launching.size:  # cancel the ones that would be ready last first
                    order = launching[np.argsort(-self.RF[pk.RF_READY, r0 + launching], kind="stable")][:d]
                    for j in order.tolist():
                        r = r0 + j
                        self.RF[pk.RF_END, r] = T
                        self._set_state(r, pk.EMPTY)
                    d -= order.size
                if d > 0:  # drain the ready ones that finish their work first
                    ready = np.flatnonzero(st == pk.READY)
                    order = ready[np.argsort(self.RF[pk.RF_BUSY_UNTIL, r0 + ready], kind="stable")][:d]
                    for j in order.tolist():
                        r = r0 + j
                        self.RF[pk.RF_END, r] = max(T, float(self.RF[pk.RF_BUSY_UNTIL, r]))
                        self._set_state(r, pk.DRAINING)

    def _launch(self, r: int, T: float, warm: bool) -> None:
        p = int(self.row_pool[r])
        if self.RF[pk.RF_END, r] > -np.inf:  # the row's previous instance: into the window's totals
            held, busy = self._held_busy(np.array([r]), T)
            self.tot += (held[0], busy[0], held[0] * self.pools.gpus[p], held[0] * self.pools.is_spot[p])
        ready = T if warm else T + float(self.pools.launch_s[p])
        used = r - p * self.R + 1
        if used > self.PI[pk.PI_NROWS, p]:
            self.PI[pk.PI_NROWS, p] = used
        self.RF[pk.RF_LAUNCH, r] = T
        self.RF[pk.RF_READY, r] = ready
        self.RF[pk.RF_END, r] = np.inf
        self.RF[pk.RF_BUSY_UNTIL, r] = ready
        self.RF[pk.RF_BUSY_S, r] = 0.0
        self.RF[pk.RF_MIN, r] = ready
        s0 = int(self.slot0[r])
        self.S[s0:s0 + int(self.pools.slots[p])] = ready
        self.RI[pk.RI_HEAD, r] = 0
        self.stats["launches"] += 1
        if warm:
            self._set_state(r, pk.READY)
        else:
            self._set_state(r, pk.LAUNCHING)
            heapq.heappush(self._launch_q, (ready, r))

    # ------------------------------------------------------------------ the epoch's events
    def _kernel_args(self) -> tuple[Any, ...]:
        return (self.QF, self.QI, self.PF, self.PI, self.RF, self.RI, self.S, self.rtt_ms, self.est, self.prm, self.ht,
                self.hi_, self.ctr, self.backlog, self.active, self.n_active, self.acc)

    def _run(self, T: float, T1: float) -> None:
        """The epoch's requests, interleaved with its events: instances becoming ready, spot notices."""
        self.PF[pk.PF_HAZARD] = self.g_hazard[min(self.e, self.E - 1)]
        args = self._kernel_args()
        lq, ev = self._launch_q, self._events
        while True:
            t_ready = lq[0][0] if lq else np.inf
            t_ev = ev[self._ev_pos][0] if self._ev_pos < len(ev) else np.inf
            t_next = min(t_ready, t_ev)
            if t_next > T1:  # (an event at T1 itself: after the epoch's arrivals, before the next plan)
                break
            if t_ready > t_ev and not self.count[1:, self.pool_of_offering[ev[self._ev_pos][2]]].any():
                self._ev_pos += 1  # a notice for an offering where nothing is held: nothing to do
                continue
            self._serve(t_next, args)
            if t_ready <= t_ev:
                _, r = heapq.heappop(lq)
                if self.RI[pk.RI_STATE, r] == pk.LAUNCHING and self.RF[pk.RF_READY, r] == t_ready:
                    self._set_state(r, pk.READY)
                    if self.ctr[pk.C_BTAIL] > self.ctr[pk.C_BHEAD]:
                        pk.drain_backlog(t_ready, *args)
            else:
                tn, _kind, i, td = ev[self._ev_pos]
                self._ev_pos += 1
                self._notice(i, tn, td, args)
        self._serve(T1, args)

    def _serve(self, t: float, args: tuple[Any, ...]) -> None:
        pk.serve_until(t, *args)

    def _notice(self, o: int, tn: float, td: float, args: tuple[Any, ...]) -> None:
        """A spot notice at ``tn`` for offering ``o`` (preemption at ``td``): its instances stop
        taking work; their requests migrate (``xroute.migration_rules``)."""
        for p in self.pool_of_offering[o].tolist():
            if not self.count[1:, p].any():  # (nothing held there)
                continue
            r0 = p * self.R
            for r in range(r0, r0 + self.R):
                st = int(self.RI[pk.RI_STATE, r])
                if st in (pk.EMPTY, pk.NOTICED) or (st == pk.DRAINING and self.RF[pk.RF_END, r] <= tn):
                    continue
                self.stats["noticed"] += 1
                self._last_noticed[p] += 1
                if st != pk.DRAINING or self.RF[pk.RF_END, r] > td:
                    self.RF[pk.RF_END, r] = td
                self._set_state(r, pk.NOTICED)
                if st in (pk.READY, pk.DRAINING):
                    self._migrate_row(r, p, tn, td, args)
                bu = float(self.RF[pk.RF_BUSY_UNTIL, r])
                if bu > tn:
                    self.RF[pk.RF_BUSY_S, r] -= bu - max(tn, float(self.RF[pk.RF_READY, r]))
                    self.RF[pk.RF_BUSY_UNTIL, r] = tn

    def _migrate_row(self, r: int, p: int, tn: float, td: float, args: tuple[Any, ...]) -> None:
        QF, QI, PI = self.QF, self.QI, self.PI
        moving = pk.requests_on_row(r, tn, QI, QF, self.ht, self.hi_, self.ctr)
        mc = self.cfg.migration
        notice = td - tn
        for i in moving.tolist():
            pk.in_flight_changes(self.PF, PI, p, tn)
            PI[pk.PI_INFLIGHT, p] -= 1
            QI[pk.QI_STATE, i] = pk.Q_PENDING
            QI[pk.QI_MIGR, i] += 1
            self.stats["migrations"] += 1
            start, pf, tp = float(QF[pk.QF_START, i]), float(QF[pk.QF_PF, i]), float(QF[pk.QF_TP, i])
            r_in, out = float(QF[pk.QF_IN, i]), float(QF[pk.QF_OUT, i])
            noticed = notice > 0
            delay = mc.delay_s if noticed else self.cfg.retry_overhead_ms / 1000.0
            t_mig = tn + delay
            ran = tn - start
            if ran <= 0:
                done_in, done_out = 0.0, 0.0
            elif ran < pf:
                done_in, done_out = math.floor(r_in * ran / pf), 0.0
            else:
                done_in = r_in
                done_out = float(min(max(math.floor((ran - pf) / tp), 0), max(out - 1.0, 0.0))) if tp > 0 else 0.0
            m = int(QI[pk.QI_MODEL, i])
            tgt = pk.route(i, t_mig, QF, QI, self.PF, PI, self.active, m, self.n_active[m], self.rtt_ms,
                           self.est, self.prm)
            if tgt < 0:  # nowhere to go yet: it waits for an instance (and re-runs from scratch there)
                self.backlog[self.ctr[pk.C_BTAIL]] = i
                self.ctr[pk.C_BTAIL] += 1
                self.ctr[pk.C_QUEUED] += 1
                QI[pk.QI_STATE, i] = pk.Q_BACKLOG
                self.stats["restart"] += 1
                self.stats["tokens_recomputed"] += done_in + done_out
                continue
            first_kept = bool(QF[pk.QF_FIRST, i] <= tn)
            tokens = done_in + done_out
            if ran <= 0:
                mode, t0, pre, dec = "resend", t_mig, r_in, out
            elif not noticed:
                mode, t0, pre, dec = "restart", t_mig, r_in, out
            else:
                a, b = int(self.pool_loc[p]), int(self.pool_loc[tgt])
                mv = rules.choose_kv_move(tn, td, mc.delay_s, tokens * self.kv_bytes_tok[m], float(self.loc_gbps[a, b]),
                                          float(self.loc_rtt[a, b]), tokens, float(self.pools.prefill_tok_s[tgt]))
                if mv.mode == rules.TRANSFER:
                    mode, t0, pre, dec = "transfer", t_mig + mv.seconds, r_in - done_in, out - done_out
                    self.stats["kv_bytes_moved"] += mv.kv_bytes
                elif mv.mode == rules.RECOMPUTE:
                    mode, t0, pre, dec = "recompute", t_mig, r_in + done_out, out - done_out
                    self.stats["tokens_recomputed"] += tokens
                else:
                    mode, t0, pre, dec = "restart", t_mig, r_in, out
                    self.stats["missed_window"] += 1
            if mode == "restart":
                first_kept = False
                self.stats["tokens_recomputed"] += tokens
            self.stats[mode] += 1
            pk.place(i, tgt, t0, tn, pre, dec, first_kept, QF, QI, self.PF, PI, self.RF, self.RI, self.S,
                     self.rtt_ms, self.ht, self.hi_, self.ctr)

    def _bill(self, T: float, T1: float) -> float:
        """Held instance-seconds within ``[T, T1)`` x the instance's price at ``T``."""
        return float(pk.bill(self.RF, self.row_pool, self.g_price_s[min(self.e, self.E - 1)], T, T1))

    def _finish(self) -> None:
        """The window is over: the requests in flight run to their ends (their completions count);
        the backlog's are unserved."""
        pk.advance(np.inf, self.QF, self.QI, self.PF, self.PI, self.est, self.prm, self.ht, self.hi_, self.ctr, self.acc)
        self.acc[1] += float(self.ctr[pk.C_BTAIL] - self.ctr[pk.C_BHEAD])  # unserved: missed
        self._finished = True

    # ------------------------------------------------------------------ results
    def arrivals_per_epoch(self) -> np.ndarray:
        """The window's arrivals in each epoch (the load the plots show beside the instances)."""
        t = self.QF[pk.QF_T]
        e = np.minimum(((t - self.T0) // self.dt).astype(np.int64), self.E - 1)
        return np.bincount(e, minlength=self.E)

    def request_outcomes(self) -> dict[str, np.ndarray]:
        """Per request of the window: served (bool), TTFT and latency (ms; NaN unserved), SLO met,
        its class and the pool it ended on (-1: unserved)."""
        QF, QI = self.QF, self.QI
        served = np.isin(QI[pk.QI_STATE], (pk.Q_RUNNING, pk.Q_DONE))
        arr = QF[pk.QF_T]
        rtt = QF[pk.QF_RTT]
        ttft = np.where(served, rtt + (QF[pk.QF_FIRST] - arr) * 1000.0, np.nan)
        lat = np.where(served, rtt + (QF[pk.QF_END] - arr) * 1000.0, np.nan)
        out = QF[pk.QF_OUT]
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(out > 1, (lat - ttft) / np.maximum(out - 1.0, 1.0), 0.0)
        dl = QF[pk.QF_DEADLINE]
        ok = served & (ttft <= QF[pk.QF_TTFT]) & ((out <= 1) | (tpot <= QF[pk.QF_TPOT])) & (np.isnan(dl) | (lat <= dl))
        return {"served": served, "ttft_ms": ttft, "latency_ms": lat, "slo_ok": ok,
                "class": self.q_class[self.lo:self.hi], "pool": np.where(served, QI[pk.QI_POOL], -1),
                "migrated": QI[pk.QI_MIGR] > 0}

    def metrics(self) -> dict[str, Any]:
        """The window's figures (``docs/capacity.md``): cost, SLO attainment (overall and per class),
        idle share, launches, failures, preemptions, migrations, unserved and lost requests."""
        o = self.request_outcomes()
        N = self.N
        served = int(o["served"].sum())
        unserved = int(((self.QI[pk.QI_STATE] == pk.Q_BACKLOG) | (self.QI[pk.QI_STATE] == pk.Q_PENDING)).sum())
        cost = float(self.stats["cost_usd"])
        t_end = self.T0 + self.e * self.dt
        held, busy = self._held_busy(slice(None), t_end)
        h = float(held.sum()) + self.tot[0]
        b = float(busy.sum()) + self.tot[1]
        gpu_s = float((held * self.pools.gpus[self.row_pool]).sum()) + self.tot[2]
        spot_s = float(held[self.pools.is_spot[self.row_pool]].sum()) + self.tot[3]
        lat = o["latency_ms"][o["served"]]
        m: dict[str, Any] = {
            "requests": N, "served": served, "unserved": unserved, "lost": N - served - unserved,
            "cost_usd": round(cost, 6), "cost_per_1k_requests": round(1000.0 * cost / max(N, 1), 6),
            "slo_attainment": round(float(o["slo_ok"].mean()) if N else float("nan"), 6),
            "idle_share": round(1.0 - b / max(h, 1e-9), 6),
            "instance_hours": round(h / 3600.0, 6), "gpu_hours": round(gpu_s / 3600.0, 6),
            "launches": int(self.stats["launches"]), "failed_launches": int(self.stats["failed_launches"]),
            "quota_refused": int(self.stats["quota_refused"]), "preemptions": int(self.stats["noticed"]),
            "migrations": int(self.stats["migrations"]), "restarts": int(self.stats["restart"]),
            "missed_window": int(self.stats["missed_window"]), "backlogged": int(self.ctr[pk.C_QUEUED]),
            "latency_p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else float("nan"),
            "latency_p95_ms": round(float(np.percentile(lat, 95)), 2) if lat.size else float("nan"),
            "ttft_p95_ms": round(float(np.nanpercentile(o["ttft_ms"], 95)), 2) if lat.size else float("nan"),
            "spot_share": round(spot_s / max(h, 1e-9), 6),
        }
        for c, name in enumerate(self.class_names):
            sel = o["class"] == c
            if sel.any():
                m[f"slo_attainment[{name.split('/', 1)[1] or name}]"] = round(float(o["slo_ok"][sel].mean()), 6)
        return m


# ---------------------------------------------------------------------------------------------- Gymnasium
#: per-pool observation features: (name, meaning); every value is clipped into [0, 4] (or [-4, 4] for log price)
POOL_FEATURES: tuple[tuple[str, str], ...] = (
    ("valid", "1 for a pool (0: padding)"),
    ("log_price", "ln(an instance's USD per hour), clipped to [-4, 4]"),
    ("is_spot", "1 for a spot pool"),
    ("available", "recorded availability now"),
    ("hazard", "preemptions per hour (decision-time posterior mean), at most 4"),
    ("launch", "launch delay / 600 s"),
    ("launching", "instances launching / max_instances_per_pool"),
    ("ready", "instances taking work / max_instances_per_pool"),
    ("draining", "instances draining / max_instances_per_pool"),
    ("noticed", "instances with a spot notice / max_instances_per_pool"),
    ("busy", "mean requests in flight per ready replica in the last epoch, at most 4"),
    ("inflight", "requests in flight / slots of the ready instances, at most 4"),
    ("failed", "1 if a launch failed there last epoch"),
    ("speed", "ln(1 + an instance's slots) / 5"),
)


class ProvisionEnv(gym.Env):  # type: ignore[type-arg]
    """``xroute/Provision-v0``: the provisioning world for a learned planner (module docstring).

    Action: ``MultiDiscrete([max_instances_per_pool + 1] * max_pools)`` -- the target instances of
    each pool (the padding entries past the bundle's pools are ignored: ``mask`` marks the pools). Observation ``Dict``: ``pools`` (max_pools x F float32,
    :data:`POOL_FEATURES`), ``load`` (per class: arrivals of the last epoch / 1000, the decayed mean
    output / 1000), ``mask``. Episodes: ``episode_epochs`` consecutive epochs from a random start."""

    metadata = {"render_modes": []}  # noqa: RUF012

    def __init__(self, bundle: Bundle | str | None = None, config: ProvisionConfig | dict[str, Any] | None = None,
                 history: pd.DataFrame | None = None, max_pools: int = 128, episode_epochs: int | None = 30,
                 **overrides: Any):
        super().__init__()
        self.world = ProvisionWorld(bundle, config, history, **overrides)
        w = self.world
        if w.P > max_pools:
            raise ConfigError(f"env: field 'max_pools': the bundle has {w.P} pools, more than {max_pools}")
        self.max_pools, self.episode_epochs = max_pools, episode_epochs
        F = len(POOL_FEATURES)
        self.observation_space = spaces.Dict({
            "pools": spaces.Box(-4.0, 4.0, (max_pools, F), dtype=np.float32),
            "load": spaces.Box(0.0, 100.0, (2 * w.C,), dtype=np.float32),
            "mask": spaces.Box(0.0, 1.0, (max_pools,), dtype=np.float32),
        })
        self.action_space = spaces.MultiDiscrete(np.full(max_pools, w.R + 1))

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        w = self.world
        E_all = w.n_epochs_total
        L = E_all if self.episode_epochs is None else min(self.episode_epochs, E_all)
        start = int(options["start_epoch"]) if options and "start_epoch" in options \
            else int(self.np_random.integers(0, E_all - L + 1))
        w.reset(seed=int(self.np_random.integers(0, 2**31 - 1)), start_epoch=start, n_epochs=min(L, E_all - start))
        return self._obs(), {"pool_ids": w.pools.ids}

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        w = self.world
        a = np.asarray(action, dtype=np.int64)
        if a.shape != (self.max_pools,):
            raise ConfigError(f"action: field 'targets': expected {self.max_pools} targets, got shape {a.shape}")
        res = w.step(a[:w.P])
        info: dict[str, Any] = {"cost_usd": res.cost_usd, "slo_missed": res.slo_missed, "completed": res.completed,
                                "launches": res.launches, "failed_launches": res.failed_launches}
        if res.done:
            info["metrics"] = w.metrics()
        return self._obs(), float(res.reward), False, res.done, info

    def _obs(self) -> dict[str, np.ndarray]:
        w = self.world
        v = w.view()
        P, R = w.P, float(w.R)
        F = len(POOL_FEATURES)
        x = np.zeros((self.max_pools, F), dtype=np.float32)
        reps = np.maximum(v.ready * w.pools.per_inst, 1e-9)
        x[:P, 0] = 1.0
        x[:P, 1] = np.clip(np.log(np.maximum(np.nan_to_num(v.price_h, nan=1e-3), 1e-3)), -4, 4)
        x[:P, 2] = w.pools.is_spot
        x[:P, 3] = v.available
        x[:P, 4] = np.clip(v.hazard * 3600.0, 0, 4)
        x[:P, 5] = np.clip(w.pools.launch_s / 600.0, 0, 4)
        x[:P, 6] = v.launching / R
        x[:P, 7] = v.ready / R
        x[:P, 8] = v.draining / R
        x[:P, 9] = v.noticed / R
        x[:P, 10] = np.clip(v.work_s / (reps * w.dt), 0, 4)
        x[:P, 11] = np.clip(v.inflight / np.maximum(v.ready * w.pools.slots, 1), 0, 4)
        x[:P, 12] = v.failed_launches > 0
        x[:P, 13] = np.clip(np.log1p(w.pools.slots) / 5.0, 0, 4)
        mask = np.zeros(self.max_pools, dtype=np.float32)
        mask[:P] = 1.0
        recent = v.arr_class[v.arr_t >= v.t - w.dt] if v.arr_t.size else np.zeros(0, dtype=np.int64)
        load = np.concatenate([np.bincount(recent, minlength=w.C) / 1000.0, np.nan_to_num(v.out_mean) / 1000.0])
        return {"pools": x, "load": np.clip(load, 0.0, 100.0).astype(np.float32), "mask": mask}
