"""``xroute/CloudRoute-v0``: route each request of a replayed request stream to an offering.

Description
-----------
A telemetry bundle (see ``docs/telemetry.md``) is replayed in time. Each step is one request of its
workload (in arrival order, arrivals optionally compressed by ``rate_scale``); the action picks the
offering (provider x region x instance type x pricing mode) that serves it.

What a router knows, and what only the simulation knows
-------------------------------------------------------
A request arrives with what a client sends: origin, ``input_tokens``, ``max_output_tokens``, its
SLO (``ttft_ms``, ``tpot_ms``, optional ``deadline_ms``), its ``model`` and tenant. Its realized
``output_tokens`` and service-time noise are the *outcome*: they are read only when the step
simulates the service (``_resolve``), and by the hindsight oracle (``exact_rewards``).

The environment keeps two views of every pool:

* **the truth** (``free_at``, ``tmin``, ``tbusy``): when each slot really frees, from realized
  service times -- used to simulate service and nothing else;
* **the router's view** (``est_free``, ``est_min``, ``inflight``): what a router can know -- the
  requests it sent that it has not yet seen complete, and when it *expects* each slot to free,
  from expected service times, corrected when a completion is observed (``envs.kernels.view_*``).

Observations, masks and the expectations every policy reads come from the router's view, the
telemetry at or before the request's arrival, and the output length *estimated* from past
completions (``envs.estimator``; a completion is observed at its simulated end, never earlier).
``tests/test_no_foresight.py`` proves it: changing the realized outputs and noise of the current
and all later requests changes no policy's decision at the current step.

Pools and service
-----------------
A pool is one (model, offering) pair (``configs/models.yaml``; ``envs.serving.place``): the
offering's ``capacity_replicas`` GPUs hold ``capacity // gpus_per_replica`` replicas of the model,
each with ``max_concurrency`` request slots; an offering where the model does not fit is masked for
it. A request waits for the first free slot, then is served in ``input/prefill_tok_s + output *
tpot(k)`` seconds, ``tpot(k) = tpot * (1 + growth*(k-1))`` growing with the requests batched on the
replica (plus external utilization), times a lognormal factor (``noise_sigma``). Its first token
comes after the prefill and one decode step.

Latency = RTT + queueing + service. Cost = price of the replica's GPUs per second x service /
slots per replica. A spot pool's preemption (it really happens up to ``spot_lag_s`` before the
telemetry records it) is announced ``notice_s`` before (``offerings.notice_s``; the notice is what a
router knows from then: the pool is masked and its region de-prioritized); requests queued or in
flight there at the notice migrate by the rules the router applies too (``xroute.migration_rules``):
after ``migration.delay_s`` on the on-demand offering with the lowest expected latency outside the
de-prioritized regions, their KV cache transferred or recomputed, or their work lost when the window
is missed. Without a notice (``migration.notice`` off) the request is preempted at the preemption:
it pays for the time it ran and is retried after ``retry_overhead_ms`` (``docs/env.md``).
The SLO is met when TTFT <= ``ttft_ms``, the time per output token after the first <= ``tpot_ms``
(requests with more than one token) and, when given, latency <= ``deadline_ms``.

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
invalid action (padding, spot pool unavailable, model does not fit, zero capacity, or a pool whose
next expected free slot is more than ``queue_timeout_s`` away) fails the request: counted in
``failed``, costs nothing, charged ``failure_latency_norm`` plus the SLA penalty.

Reward
------
``envs.kernels.realized_reward``: ``-(cost_weight*cost_norm + latency_weight*latency_norm) -
sla_penalty*violation`` with ``cost_norm = min(cost / reference_cost, cap)`` (the request on one
reference replica at ``reference_usd_per_replica_hour``) and ``latency_norm = min(latency /
budget, cap)``, budget = ``deadline_ms`` or ``ttft_ms + tpot_ms * (output_tokens - 1)``.

Episode
-------
``reset`` picks ``episode_requests`` consecutive requests starting at a random index (the whole
stream when None), empties every pool and seeds the output estimator with the stream's requests
that completed before the episode (arrived ``estimator.history_lag_s`` before its first request)
and with ``history`` (outputs of requests before the stream). Truncated, never terminated, after
its last request. Everything random comes from ``self.np_random``: the same seed, the same
trajectory.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import pandas as pd
from gymnasium import spaces

from envs import estimator as est
from envs import features as fz
from envs import kernels
from envs import policies as pol
from envs import prefix as px
from envs.admission import WorldQueue, admits_at_arrival, best_ttft, place_within, request_bands, soonest_ttft
from envs.budget import (
    NO_BUDGET,
    NOT_REFUSED,
    REFUSED,
    REFUSED_BUDGET,
    BudgetBook,
    LiveBudget,
    budget_features,
    check_tenants,
)
from envs.capacity import CapacityQuotas
from envs.kernels import COST, LAT, PVIOL, RISK, SERVICE, TTFT, WAIT
from envs.replay import PoolInventory, TelemetryReplay
from envs.serving import Placement, load_models, load_serving, place
from xroute import admission_rules as ar
from xroute import migration_rules as rules
from xroute.bundle import Bundle, load_bundle, origins_reaching, prefix_arrays, throughput_lookup, to_seconds
from xroute.catalog_tools import split_tiers
from xroute.config import EnvConfig, load_policies, parse_config
from xroute.errors import ConfigError
from xroute.schema.policy_ir import PolicySet

#: view events: a request's completion becomes known; a retry after a preemption enters a pool; a
#: live router's request reaches its expected end without feedback (``admit_live``); a request's end
#: settles its tenant budget (``envs.budget``)
_COMPLETE, _ADMIT, _LIVE_END, _SETTLE = 0, 1, 2, 3
#: a completion event's output tokens when the request was preempted (-1: completed, length unknown)
_PREEMPTED = -2.0
#: the weight of one completion's service time in its pool's observed mean (``view_service_s``), as
#: the router's shared state weighs an outcome (``router.state.base``, ``state_stats_alpha``)
SERVICE_ALPHA = 0.05

__all__ = ["CloudRouteEnv", "load_serving"]

_NO_BUDGET_FEATURES = budget_features(NO_BUDGET)
#: a step's migration outcome when its request was not preempted (``_resolve``'s info keys)
_NO_MIGRATION = {"migration": None, "tokens_recomputed": 0.0, "kv_bytes_moved": 0.0, "missed_window": False}


def resize_slots(row: np.ndarray, old: int, new: int, t: float) -> float:
    """A pool's slot release times ``row`` (one pool of ``free_at``/``est_free``) resized from ``old``
    to ``new`` slots at ``t``: the slots dropped retire now when free (+inf: never free again; a busy
    one retires when it frees), the slots added are free now (-inf). Returns the row's new minimum."""
    if new < old:
        seg = row[new:old]
        seg[seg <= t] = np.inf
    else:
        seg = row[old:new]
        seg[np.isposinf(seg)] = -np.inf
    return float(row.min())


class CloudRouteEnv(gym.Env):  # type: ignore[type-arg]
    """``xroute/CloudRoute-v0`` (the module docstring is the spec).

    Beside the Gymnasium API (``reset``, ``step``), a live router (``router.decision.engine``) reaches the
    environment only through this interface -- never through an attribute whose name starts with
    ``_`` -- so the simulation may change how it keeps its state:

    * the catalog and its pools: ``catalog``, ``n``, ``N``, ``M``, ``model_names``,
      ``model_index``, ``default_model``, ``origins``, ``slots`` and ``fits`` ((M, n));
    * a request: ``set_live`` makes a live request current and returns its action mask;
      ``request_features``, ``offering_features(idx)``, ``observation`` and
      ``expected_rewards`` read it; the arrays its compiled decisions read are the current
      request's, read-only and replaced by the next one: ``C`` (candidate outcomes, rows named in
      ``envs.kernels``; ``c_wait``, ``c_service``, ``c_lat``, ``c_cost`` name some), ``c_mask``,
      ``c_rtt``, ``r_m`` (its model), ``r_ttft``, ``r_tpot``, ``r_budget``, ``r_ref_cost``, and the
      telemetry's ``static_feats``, ``inv_slots``, ``available``, ``price_s``;
    * the router's view of the pools: ``admit_live`` (a request sent), ``complete_live`` (its end
      learned), ``observe_output`` (a completion's output length), ``shift_live_clock`` (a replay
      wrap); ``view_others``, ``view_service_s`` and ``view_server_busy`` ((M, n), written by the
      router: the shared state's work of other routers, its observed durations, the servers'
      reported load); ``live_pools(t, model)`` lists every pool as the router sees it;
    * routing policies (``envs.policies``, ``docs/policies.md``): ``set_policies`` (a compiled set,
      swapped between two decisions), ``policies``; the current request's outcome: ``r_allowed``
      (what the policies allow, ANDed into ``c_mask``), ``r_bias`` (prefer weights, zeros unless
      ``r_has_bias``), ``r_policy`` (reasons and exclusion counts); ``set_live``'s ``request_class``
      and ``pre`` (the router's own constraint layers);
    * telemetry swaps: ``prepare_telemetry`` (off the event loop), ``apply_telemetry``;
    * outcomes: ``outcome_reward`` -- the reward of an observed outcome, computed as the
      simulation computes a simulated one (``reference_cost``, ``latency_budget``, ``slo_missed``,
      ``envs.kernels.realized_reward``).
    """

    metadata = {"render_modes": []}  # noqa: RUF012

    def __init__(self, bundle: Bundle | str | None = None, config: EnvConfig | dict[str, Any] | None = None,
                 history: pd.DataFrame | None = None, all_models: bool = False, **overrides: Any):
        """``history``: requests before the stream (their ``output_tokens``, ``model``, ``tenant``)
        the output estimator starts from. ``all_models``: pools for every model of the models
        config (a live router, whose requests may name any); by default only for the default model
        and the models the stream names (the others would only cost memory and time)."""
        super().__init__()
        if isinstance(config, EnvConfig):
            cfg = config.model_copy(update=overrides) if overrides else config
        else:
            cfg = parse_config(EnvConfig, {**(config or {}), **overrides}, "env config")
        self.cfg = cfg
        self.bundle = self._tiered(bundle if isinstance(bundle, Bundle) else load_bundle(bundle))
        self.catalog = self.bundle.catalog()
        n = len(self.catalog)
        if n > cfg.max_offerings:
            raise ConfigError(f"env config: field 'max_offerings': the bundle has {n} offerings, more than {cfg.max_offerings}")
        self.n = n
        self.N = cfg.max_offerings
        self._all_models = all_models
        self._init_static()
        self._init_stream(history)
        self._pol = pol.PolicyOutcome.empty(self.n, 0)
        self._zero_bias = np.zeros(self.n)  # (writeable: numba types a read-only array apart, one more compilation)
        self.r_has_bias = False
        self._r_bias: np.ndarray | None = None
        self.policies: pol.CompiledPolicies | None = None
        ps = cfg.policies if isinstance(cfg.policies, PolicySet) or cfg.policies is None else load_policies(cfg.policies)
        self.set_policies(ps)
        self.observation_space = spaces.Dict({
            "offerings": spaces.Box(np.tile(fz.OFFERING_LOW, self.N), np.tile(fz.OFFERING_HIGH, self.N),
                                    dtype=np.float32),
            "request": spaces.Box(fz.REQUEST_LOW, fz.REQUEST_HIGH, dtype=np.float32),
            "mask": spaces.Box(0.0, 1.0, (self.N,), dtype=np.float32),
        })
        self.action_space = spaces.Discrete(self.N)
        self._pos = 0
        self._end = 0

    # ------------------------------------------------------------------ setup
    def _tiered(self, bundle: Bundle) -> Bundle:
        """``bundle`` with the settings' serving tiers split off its pools (``tiers``;
        ``xroute.catalog_tools.split_tiers``): each tier is an offering of its own, so its requests
        see its own batch. No tiers: the bundle as it is."""
        if not self.cfg.tiers:
            return bundle
        serving = load_serving(self.cfg.serving_config)
        return split_tiers(bundle, list(self.cfg.tiers), {k: a.max_concurrency for k, a in serving.accelerators.items()})

    # ------------------------------------------------------------------ setup
    def _init_static(self) -> None:
        serving = load_serving(self.cfg.serving_config)
        models = load_models(self.cfg.models_config)
        self.serving, self.models_cfg = serving, models
        ref = serving.accelerators.get(serving.reference_accelerator)
        if ref is None:
            raise ConfigError(f"{self.cfg.serving_config}: field 'reference_accelerator': "
                              f"'{serving.reference_accelerator}' has no entry under accelerators")
        self.ref = ref
        caps = self.bundle.offerings.get("capacity_replicas")
        capacity = []
        for o, c in zip(self.catalog, caps if caps is not None else [np.nan] * self.n):
            capacity.append(o.replicas_per_instance if c is None or (isinstance(c, float) and np.isnan(c)) else int(c))
        only = None
        if not self._all_models:
            w = self.bundle.workload
            named = set(w["model"].astype(str).str.strip()) - {""} if "model" in w.columns else set()
            only = [models.default_model, *sorted(m for m in named if m in models.models and m != models.default_model)]
        pl: Placement = place(self.catalog, capacity, serving, models, only)
        self.placement = pl
        self.model_names: tuple[str, ...] = pl.models
        self.model_index = {m: k for k, m in enumerate(pl.models)}
        self.default_model = self.model_index[models.default_model]
        self.M = len(pl.models)
        self.fits = pl.fits
        self.conc = pl.conc
        self._init_inventory(pl, models.default_model)
        self.inv_prefill = 1.0 / pl.prefill_tok_s
        self.conc_m1 = self.conc - 1.0
        self.tpot_s = pl.tpot_s
        self.tpot_growth_s = pl.tpot_s * pl.growth
        self.sigma = pl.sigma
        self.gpus_per_slot = np.where(pl.fits, pl.gpus / np.maximum(pl.conc, 1.0), 0.0)
        #: a live router's shared view (``router.state.base``): per pool, the work other routers hold there
        #: and its observed mean duration in seconds (0: none observed); zero in training and evaluation
        self.view_others = np.zeros((self.M, self.n), dtype=np.int64)
        self.view_service_s = np.zeros((self.M, self.n))
        #: ... and the requests running + waiting its inference servers report (-1: not reported)
        self.view_server_busy = np.full((self.M, self.n), -1.0)
        #: told of every completion the router's view learns (``envs.twin``): called with the
        #: request's reference (a stream request's position, a live request's ``admit_live`` ref), the
        #: time it was seen complete and the end its view expected at admission; None: nobody listens
        self.completion_listener: Callable[[Any, float, float], None] | None = None
        self.params_feat = np.minimum(np.log1p(pl.params_b) / 5.0, 2.0)
        self.is_spot = np.array([o.is_spot for o in self.catalog], dtype=float)
        self.on_demand_idx = np.flatnonzero(self.is_spot < 0.5)
        self._all_idx = np.arange(self.n)
        ref_tpot = ref.tpot_ms / 1000.0
        self.speed_feat = np.where(pl.fits, np.clip(np.log(ref_tpot / pl.tpot_s), -3, 3), -3.0)
        self.gpu_count = np.array([o.replicas_per_instance for o in self.catalog], dtype=float)
        self.replay = TelemetryReplay(self.bundle, self.gpu_count)
        #: cloud capacity quotas (``envs.capacity``): offerings no quota leaves room for one more instance of
        self.capacity = CapacityQuotas(self.bundle, self.catalog)
        self.quota_blocked = np.zeros(self.n, dtype=bool)
        self.origins, self.rtt_ms = self._origins_rtt(self.bundle)
        self.origin_index = {o: i for i, o in enumerate(self.origins)}
        self._ref_prefill_s = 1.0 / ref.prefill_tok_s
        self._ref_cost_rate = self.cfg.reward.reference_usd_per_replica_hour / 3600.0 / ref.max_concurrency
        self._zero_n = np.zeros(self.n)
        self._zero_n.flags.writeable = False
        self._no_blocks = np.zeros(0, dtype=np.int64)
        self._run_buf = np.zeros(self.n, dtype=np.int64)  # scratch of the prefix lookup (no state)
        self._init_migration()

    def _init_inventory(self, pl: Placement, default_model: str) -> None:
        """The pools' sizes. Without an ``inventory`` table they are the catalog's
        (``capacity_replicas``), fixed. With one (``envs.replay.PoolInventory``) a pool's replicas
        follow its running instances over time: the slot arrays are sized for the most it ever
        holds (``replicas_alloc``: the catalog's or the table's largest, whichever is more -- a live
        collector's later commit is capped there until a restart), and ``replicas``/``slots`` (and
        what derives from them) are the current ones, set at each telemetry refresh (``_resize``);
        a pool with no running instance has no slot and is masked (``no_capacity``)."""
        self.inventory = PoolInventory(self.bundle, pl.models, default_model)
        self._static_replicas = pl.replicas.copy()
        self._inst_replicas = np.where(pl.fits, np.array([o.replicas_per_instance for o in self.catalog])[None, :]
                                       / np.maximum(pl.gpus, 1.0), 0.0)  # replicas one instance holds
        alloc = pl.replicas.copy()
        if self.inventory.active:
            alloc = np.maximum(alloc, np.floor(self.inventory.max_running() * self._inst_replicas))
        self.replicas_alloc = alloc
        self.slots_alloc = (alloc * self.conc).astype(np.int64)
        self.smax = max(1, int(self.slots_alloc.max()))
        self._set_sizes(alloc)

    def _set_sizes(self, replicas: np.ndarray) -> None:
        """The pools' current replicas and what derives from them (new arrays: snapshots share them)."""
        self.replicas = replicas
        self.slots = (replicas * self.conc).astype(np.int64)
        self.inv_replicas = 1.0 / np.maximum(self.replicas, 1e-9)
        self.inv_slots = 1.0 / np.maximum(self.slots, 1)
        self.cap_feat = np.clip(np.log1p(self.slots) / 5.0, 0, 2)

    def replicas_at(self, t: float) -> np.ndarray:
        """(M, n): each pool's replicas at telemetry time ``t`` (the inventory's, else the catalog's)."""
        if not self.inventory.active:
            return self._static_replicas
        run = self.inventory.running_at(t)
        rep = np.where(np.isnan(run), self._static_replicas, np.floor(np.nan_to_num(run) * self._inst_replicas))
        return np.where(self.fits, np.minimum(rep, self.replicas_alloc), 0.0)

    def _resize(self, t: float) -> None:
        """The pools follow the inventory at ``t``: a pool that lost replicas retires its free
        slots now and its busy ones when they free (``_advance``: the work running there finishes);
        one that gained replicas has the new slots free now. The truth and the router's view alike."""
        rep = self.replicas_at(t)
        if np.array_equal(rep, self.replicas):
            return
        new_slots = (rep * self.conc).astype(np.int64)
        for m, a in zip(*np.nonzero(new_slots != self.slots)):
            old, new = int(self.slots[m, a]), int(new_slots[m, a])
            for arr, mins in ((self.free_at, self.tmin), (self.est_free, self.est_min)):
                mins[m, a] = resize_slots(arr[m, a], old, new, t)
        self._set_sizes(rep)

    def _init_migration(self) -> None:
        """Spot notices and migration (``xroute.migration_rules``, ``docs/env.md``): each spot
        offering's notice (``offerings.notice_s``, else ``migration.default_notice_s``; 0 = none,
        and 0 everywhere with ``migration.notice`` off), and between the offerings' locations the
        RTT (the bundle's; the largest one where the table has no pair) and the throughput a KV
        transfer gets (``throughput``, else ``migration.default_throughput_gbps``)."""
        mc = self.cfg.migration
        col = self.bundle.offerings.get("notice_s")
        notice = np.full(self.n, mc.default_notice_s) if col is None else col.to_numpy(dtype=float)
        notice = np.where(np.isnan(notice), mc.default_notice_s, notice)
        self.notice_s = np.where((self.is_spot > 0.5) & mc.notice, notice, 0.0)
        self.locations = [o.location for o in self.catalog]
        rtt = self.bundle.rtt_lookup()
        far = max(rtt.values()) if rtt else 0.0
        tp = throughput_lookup(self.bundle.throughput)
        locs = self.locations
        self.pair_rtt_ms = np.array([[rtt.get((x, y), far) for y in locs] for x in locs])
        self.pair_gbps = np.array([[tp.get((x, y), mc.default_throughput_gbps) for y in locs] for x in locs])
        #: KV cache bytes per token of each model (configs/models.yaml kv_mib_per_token)
        self.kv_bytes_tok = np.array([self.models_cfg.models[m].kv_mib_per_token * 2.0 ** 20
                                      for m in self.model_names])
        self.region_bias = np.zeros(self.n)
        self.notice_at = np.full(self.n, np.inf)
        self.cut_at = np.full(self.n, np.inf)

    def _init_stream(self, history: pd.DataFrame | None) -> None:
        """The request stream as arrays: what the client sends, and (``req_out``) the outcome."""
        w = self.bundle.workload
        t = to_seconds(w["ts"])
        self.t0 = float(t[0])
        self.arrival_raw = t
        self.req_origin = w["origin"].map(self.origin_index).to_numpy()
        self.req_in = w["input_tokens"].to_numpy(dtype=float)
        self.req_max_out = w["max_output_tokens"].to_numpy(dtype=float)
        self.req_ttft = w["ttft_ms"].to_numpy(dtype=float)
        self.req_tpot = w["tpot_ms"].to_numpy(dtype=float)
        self.req_deadline = w["deadline_ms"].to_numpy(dtype=float) if "deadline_ms" in w.columns \
            else np.full(len(w), np.nan)
        self.req_model = self._model_column(w)
        tenants = w["tenant"].astype(str).to_numpy() if "tenant" in w.columns else np.full(len(w), "", dtype=object)
        #: who sent each request and its class (``request_class``; empty: none), for the policies' targets
        self.req_tenant = tenants
        self.req_class = (w["request_class"].fillna("").astype(str).str.strip().to_numpy()
                          if "request_class" in w.columns else np.full(len(w), "", dtype=object))
        self._tenant_keys: dict[str, int] = {}
        self.est_w, self.est_s, self.est_n = est.new_tables(self.M)
        self.req_key = np.array([self.estimator_key(int(m), str(tn)) for m, tn in zip(self.req_model, tenants)],
                                dtype=np.int64)
        self.req_ids = w["request_id"].to_numpy()
        self.req_tenant = tenants
        #: the realized outcome: read by the simulation of service (``_resolve``) and the oracle only
        self.req_out = w["output_tokens"].to_numpy(dtype=float)
        self._init_prefix(w)
        self.n_requests = len(w)
        self.history: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        if history is not None and len(history):
            hm = self._model_column(history)
            ht = history["tenant"].astype(str).to_numpy() if "tenant" in history.columns else \
                np.full(len(history), "", dtype=object)
            ok = hm >= 0
            keys = np.array([self.estimator_key(int(m), str(tn)) for m, tn in zip(hm[ok], ht[ok])], dtype=np.int64)
            self.history = (hm[ok], keys, history["output_tokens"].to_numpy(dtype=float)[ok])
        check_tenants(self.cfg.tenants, set(self.models_cfg.models))
        #: the tenants' budgets (``envs.budget``), when the config sets any
        self.budget: BudgetBook | None = None
        if self.cfg.tenants:
            book = BudgetBook(self.cfg.tenants, self.cfg.budget_period_s, tenants, self.req_model, self.model_names,
                              self.arrival_raw)
            self.budget = book if book.any() else None
        ac = self.cfg.admission
        #: each request's priority band (an index into ``admission_rules.BANDS``; ``envs.admission``)
        self.req_band = request_bands(ac, tenants, w["priority"].to_numpy(dtype=object) if "priority" in w.columns
                                      else None)
        #: each request's band's queue-wait margin (``admission_rules.WAIT_MARGINS``), as floats
        self.req_margin: list[float] = [ar.WAIT_MARGINS[b] for b in self.req_band.tolist()]
        #: the router's queue and fairness counters (None: admission off)
        self.admission: WorldQueue | None = None
        self.set_rate_scale(self.cfg.rate_scale)
        if ac.enabled:
            self.admission = WorldQueue(ac, tenants, self.req_band, self.arrival, self.req_ttft)

    def _init_prefix(self, w: pd.DataFrame) -> None:
        """The stream's prefix blocks (``prefix_hashes``, as dense ids: ``req_blk[req_blk_off[i]:
        req_blk_off[i + 1]]``) and sessions (dense ids, -1 none), and the caches' sizes: per pool,
        each replica's capacity in blocks (the truth, ``kv_capacity``) and the replicas' together
        (the view's ``pv_cap``). ``block_tokens`` is the bundle's ``prefix_block_tokens``."""
        off, ids = prefix_arrays(w)
        self.has_prefix = bool(ids.size)
        self.block_tokens = int(self.bundle.meta.prefix_block_tokens or 0)
        dense, uniq = pd.factorize(ids)  # in order of first appearance
        self.req_blk_off, self.req_blk = off, dense.astype(np.int64).reshape(-1)
        self.n_blocks = len(uniq)
        self._episode_blocks(0, len(w))
        if "session_id" in w.columns:
            sid = w["session_id"].astype(str).str.strip().to_numpy()
            codes, names = pd.factorize(sid)
            self.req_session = np.where(sid == "", -1, codes).astype(np.int64)
            self.n_sessions = len(names)
        else:
            self.req_session = np.full(len(w), -1, dtype=np.int64)
            self.n_sessions = 0
        b = max(self.block_tokens, 1)
        self.kv_capacity = np.where(self.fits, np.floor(self.placement.kv_tokens / b), 0).astype(np.int64) \
            if self.has_prefix else np.zeros((self.M, self.n), dtype=np.int64)
        self.pv_cap = (self.kv_capacity * np.floor(self.replicas_alloc).astype(np.int64)).reshape(-1)

    def _episode_blocks(self, start: int, end: int) -> None:
        """The episode's blocks renumbered from 0 (``ep_blk``, ``ep_off``: request ``i``'s are
        ``ep_blk[ep_off[i - start]:ep_off[i - start + 1]]``): the view and the caches hold rows for
        the blocks the episode can reach only (a training episode's ~10k rather than the stream's)."""
        lo, hi = int(self.req_blk_off[start]), int(self.req_blk_off[end])
        local, uniq = pd.factorize(self.req_blk[lo:hi])
        self.ep_blk = local.astype(np.int64)
        self.ep_off = self.req_blk_off[start:end + 1] - lo
        self.ep_first = start
        self.n_ep_blocks = len(uniq)

    def _blocks_of(self, pos: int) -> np.ndarray:
        """The episode's block ids of the stream's request ``pos``."""
        k = pos - self.ep_first
        return self.ep_blk[self.ep_off[k]:self.ep_off[k + 1]]

    def _model_column(self, w: pd.DataFrame) -> np.ndarray:
        if "model" not in w.columns:
            return np.full(len(w), self.default_model, dtype=np.int64)
        names = w["model"].astype(str).str.strip()
        unknown = sorted(set(names) - set(self.models_cfg.models) - {""})
        if unknown:
            raise ConfigError(f"workload: field 'model': unknown model '{unknown[0]}' (known: "
                              f"{', '.join(self.model_names)}; add it to configs/{self.cfg.models_config})")
        # a model with no pools here (named only by a history row) is -1
        return np.array([self.model_index.get(x, -1) if x else self.default_model for x in names], dtype=np.int64)

    def estimator_key(self, model: int, tenant: str) -> int:
        """The output estimator's row for (model, tenant) (rows 0..M-1: each model, all tenants)."""
        t = self._tenant_keys.get(tenant)
        if t is None:
            t = self._tenant_keys[tenant] = len(self._tenant_keys)
        k = self.M * (1 + t) + model
        if k >= self.est_n.shape[0]:
            w, s, n = self.est_w, self.est_s, self.est_n
            self.est_w, self.est_s, self.est_n = est.new_tables(max(k + 1, 2 * n.shape[0]))
            self.est_w[: w.shape[0]], self.est_s[: s.shape[0]], self.est_n[: n.shape[0]] = w, s, n
        return k

    def _origins_rtt(self, bundle: Bundle) -> tuple[list[str], np.ndarray]:
        """Origins (RTT sources, or workload origins, that reach every offering's location) and
        the (origin, offering) RTT matrix in ms."""
        rtt = bundle.rtt_lookup()
        origins = origins_reaching(rtt, (o.location for o in self.catalog),
                                   {s for s, _ in rtt} | set(bundle.workload["origin"]))
        return origins, np.array([[rtt[(org, off.location)] for off in self.catalog] for org in origins])

    def set_policies(self, policies: PolicySet | pol.CompiledPolicies | None) -> None:
        """The policies every request is routed under (``envs.policies``; None: none): each
        request's action mask excludes what they exclude, ``r_bias`` holds their prefer weights,
        and the stream's tenant, model, class and origin select the policies that apply. A live
        router swaps a new compiled set in between two decisions."""
        if isinstance(policies, PolicySet):
            policies = pol.CompiledPolicies(policies, self.catalog)
        if policies is not None and policies.n != self.n:
            raise ConfigError(f"policies compiled for {policies.n} offerings, the catalog has {self.n}")
        self.policies = policies
        self._pol = policies.outcome_buffers() if policies is not None else pol.PolicyOutcome.empty(self.n, 0)
        self._pol_dirty = False
        self.r_has_bias = False
        self._req_ctx: np.ndarray | None = None
        self._req_contexts: list[pol.PolicyContext] = []

    def use_policies(self, policies: pol.CompiledPolicies, buffers: pol.PolicyOutcome) -> None:
        """Make ``policies`` (compiled for this catalog, with its own ``buffers``:
        ``policies.outcome_buffers()``) the set the next request is routed under, allocating
        nothing: a live router's canary arms (``router.decision.canary``), each decision under its
        arm's set. A no-op when it is the set in use."""
        if policies is self.policies:
            return
        self.policies = policies
        self._pol = buffers
        self._pol_dirty = True  # (the buffers may hold an earlier request's outcome)
        self.r_has_bias = False
        self._req_ctx = None
        self._req_contexts = []

    def _stream_contexts(self) -> None:
        """Each stream request's policy context, compiled once (a stream names a handful of
        distinct ones): on the first request made current under a new policy set."""
        policies = self.policies
        assert policies is not None
        ids: dict[tuple[Any, ...], int] = {}
        ctx = np.empty(self.n_requests, dtype=np.int64)
        rows = zip(self.req_tenant.tolist(), self.req_model.tolist(), self.req_class.tolist(), self.req_ttft.tolist(),
                   self.req_tpot.tolist(), self.req_deadline.tolist(), self.req_origin.tolist())
        for i, row in enumerate(rows):
            k = ids.get(row)
            if k is None:
                tenant, model, explicit, ttft, tpot, dl, origin = row
                cls = policies.request_class(str(explicit), ttft, tpot, None if dl != dl else dl)
                k = ids[row] = len(self._req_contexts)
                self._req_contexts.append(policies.context(str(tenant), self.model_names[model], cls,
                                                           self.origins[origin]))
            ctx[i] = k
        self._req_ctx = ctx

    def policy_context(self, tenant: str, model: int, request_class: str | None, ttft_ms: float, tpot_ms: float,
                       deadline_ms: float | None, origin: str) -> pol.PolicyContext | None:
        """The compiled policies of a request context (None without policies): its class is
        ``request_class`` when given, else its SLO tier."""
        p = self.policies
        if p is None:
            return None
        cls = p.request_class(request_class, ttft_ms, tpot_ms, deadline_ms)
        return p.context(tenant, self.model_names[model], cls, origin)

    def prepare_telemetry(self, bundle: Bundle) -> dict[str, Any]:
        """New telemetry (prices, availability, utilization, RTT) for the *same* catalog, made
        ready without touching the environment (a live router builds it off its event loop);
        :meth:`apply_telemetry` swaps it in. Raises ``ConfigError`` when the catalog or the pool
        sizes differ (that needs a new environment)."""
        bundle = self._tiered(bundle)
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
        return {"bundle": bundle, "replay": TelemetryReplay(bundle, self.gpu_count), "origins": origins,
                "rtt_ms": rtt_ms, "capacity": CapacityQuotas(bundle, self.catalog),
                "inventory": PoolInventory(bundle, self.model_names, self.model_names[self.default_model])}

    def apply_telemetry(self, prepared: dict[str, Any]) -> None:
        """Swap in :meth:`prepare_telemetry`'s result. The pools keep their load; the next request
        re-reads prices and availability from the new tables."""
        self.bundle, self.replay = prepared["bundle"], prepared["replay"]
        self.capacity = prepared.get("capacity") or CapacityQuotas(self.bundle, self.catalog)
        inv = prepared.get("inventory")
        self.inventory = inv if inv is not None else PoolInventory(self.bundle, self.model_names,
                                                                   self.model_names[self.default_model])
        self.origins, self.rtt_ms = prepared["origins"], prepared["rtt_ms"]
        self.origin_index = {o: i for i, o in enumerate(self.origins)}
        self._req_ctx = None  # (the stream's contexts name origins by index)
        self._true_down = self._jittered_downs()
        self._refresh_at = -np.inf
        self._next_event = -np.inf

    def set_rate_scale(self, rate_scale: float) -> None:
        """Compress arrivals by ``rate_scale`` (4 = four times the load)."""
        if rate_scale <= 0:
            raise ConfigError(f"env config: field 'rate_scale': must be > 0, got {rate_scale}")
        self.rate_scale = rate_scale
        self.arrival = self.t0 + (self.arrival_raw - self.t0) / rate_scale
        book = getattr(self, "budget", None)
        if book is not None:
            book.set_arrival(self.arrival)
        adm = getattr(self, "admission", None)
        if adm is not None:
            adm.arrival = self.arrival

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
        #: the next arrival, and the requests still to decide (each gets one step: in arrival order
        #: unless admission queues it, ``envs.admission``)
        self._next, self._left = start, end - start
        if self.admission is not None:
            self.admission.begin()
        self.z = self.np_random.standard_normal(end - start)
        self._true_down = self._jittered_downs()
        if self.has_prefix:
            self._episode_blocks(start, end)
        self._reset_pools()
        self._seed_estimator(start)
        self._refresh_at = -np.inf
        self._next_event = -np.inf
        self._recent: deque[float] = deque()
        self.stats = {"preempted": 0, "failed": 0, "refused_budget": 0, "refused_rate_limit": 0,
                      "excluded_budget": 0, "excluded_quota": 0, "migrations": 0, "missed_window": 0,
                      "tokens_recomputed": 0.0, "kv_bytes_moved": 0.0, "queued": 0, "shed": 0}
        if self.budget is not None:
            self.budget.begin(start, float(self.arrival[start]))
        self._prepare()
        return self._obs(), self._info()

    def step(self, action: int) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        a = int(action)
        out = self._resolve(a)
        self._left -= 1
        truncated = self._left <= 0
        if not truncated:
            self._prepare()
            obs, info = self._obs(), self._info()
        else:
            self._pos = self._end
            obs, info = self._last_obs, {"action_mask": np.zeros(self.N, dtype=bool)}
        info.update(out)
        return obs, float(out["reward"]), False, truncated, info

    def step_outcome(self, action: int) -> tuple[dict[str, Any], bool]:
        """:meth:`step` without building the next observation, for planners that play thousands of
        steps ahead and read only outcomes (the oracle's lookahead): the step's outcome (``step``'s
        ``info`` keys, ``reward`` among them) and whether the episode ended. The environment
        advances exactly as with ``step`` (``tests/test_env.py`` checks it)."""
        out = self._resolve(int(action))
        self._left -= 1
        done = self._left <= 0
        if not done:
            self._prepare()
        else:
            self._pos = self._end
        return out, done

    @property
    def steps_left(self) -> int:
        """Requests of the episode not yet routed (the current one included)."""
        return self._left

    # ------------------------------------------------------------------ pools
    def _reset_pools(self) -> None:
        shape = (self.M, self.n, self.smax)
        self._set_sizes(self.replicas_alloc)  # (the inventory's sizes at the first refresh: _resize)
        pad = np.arange(self.smax)[None, None, :] >= self.slots[:, :, None]
        # the truth: when each slot really frees (padding slots never do)
        self.free_at = np.where(pad, np.inf, -np.inf)
        self.tmin = np.where(self.slots > 0, -np.inf, np.inf)
        self.tbusy = np.zeros((self.M, self.n), dtype=np.int64)
        self._tevents: list[tuple[float, int, int, int]] = []
        # the router's view: when it expects each slot to free, and its requests not yet seen complete
        self.est_free = self.free_at.copy()
        self.est_min = self.tmin.copy()
        self.inflight = np.zeros((self.M, self.n), dtype=np.int64)
        self.view_service_s[:] = 0.0  # (nothing observed yet; a live router writes its shared state's)
        self.shift = np.zeros(shape)
        self._events: list[tuple[float, int, int, tuple[Any, ...]]] = []
        self._seq = 0
        #: a live router's requests in its view, by reference: (model, offering, slot, expected end,
        #: the slot's correction at admission) until their completion is known (``admit_live``)
        self._live: dict[Any, tuple[int, int, int, float, float]] = {}
        #: when the router last saw one of its requests preempted on each offering (passive health check)
        self.seen_down_at = np.full(self.n, -np.inf)
        # prefix caching (envs.prefix): the router's view -- per block, the pools it last sent it to --
        # and its record of each session's last pool; the servers' caches (the truth) per pool, shared
        # with snapshots until written (copy on write, ``_kv_owner``)
        rows = self._rows(self.n_ep_blocks if self.has_prefix else 1)
        self.pv_ent = px.new_view_rows(rows)
        self.pv_sent = np.zeros(self._rows(self.M * self.n), dtype=np.int64)
        self.pv_ret = np.ones(self._rows(self.M * self.n))
        srows = self._rows(max(self.n_sessions, 1))
        self.ps_pool = np.full(srows, -1, dtype=np.int64)
        self.ps_time = np.full(srows, -np.inf)
        self._kv: dict[int, px.PoolKV] = {}
        self._kv_owner = px.new_owner()
        #: per stream request in flight: (pool, the view's expected cached tokens, the server's cached
        #: tokens) -- what its completion teaches the view's retention
        self._cache_fb: dict[int, tuple[int, float, float]] = {}

    def _rows(self, k: int) -> int:
        """``k`` rows, or one more when ``k`` is the stream's length: ``models.warmstart.fork`` shares
        (never copies) arrays as long as the stream, its read-only per-request columns."""
        return k + 1 if k == self.n_requests else k

    def unshare(self) -> None:
        """After a shallow copy of this environment (``models.warmstart.fork``): neither it nor the
        copy may change the servers' caches they still share in place (each copies a pool's
        cache before its first write)."""
        self._kv_owner = px.new_owner()

    def _seed_estimator(self, start: int) -> None:
        """Forget, then learn the outputs known before the episode: ``history`` and the stream's
        requests that arrived ``history_lag_s`` before its first one."""
        self.est_w[:] = 0.0
        self.est_s[:] = 0.0
        self.est_n[:] = 0.0
        decay = est.decay_for(self.cfg.estimator)
        if self.history is not None:
            for m, k, x in zip(*self.history):
                est.observe(self.est_w, self.est_s, self.est_n, int(k), float(x), decay)
                est.observe(self.est_w, self.est_s, self.est_n, int(m), float(x), decay)
        if start > 0:
            cut = self.arrival[start] - self.cfg.estimator.history_lag_s
            stop = int(np.searchsorted(self.arrival, cut, side="right"))
            for i in range(max(0, stop - 20 * int(self.cfg.estimator.half_life)), min(stop, start)):
                x = float(self.req_out[i])
                est.observe(self.est_w, self.est_s, self.est_n, int(self.req_key[i]), x, decay)
                est.observe(self.est_w, self.est_s, self.est_n, int(self.req_model[i]), x, decay)

    def _observe_output(self, model: int, key: int, tokens: float) -> None:
        decay = est.decay_for(self.cfg.estimator)
        est.observe(self.est_w, self.est_s, self.est_n, key, tokens, decay)
        est.observe(self.est_w, self.est_s, self.est_n, model, tokens, decay)

    def _push(self, t: float, kind: int, data: tuple[Any, ...]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, data))

    def _advance(self, t: float) -> None:
        """Everything the router learns up to ``t``: completions (which free its view of a slot
        and teach the estimator an output length) and retries entering a pool after a preemption;
        and the truth's slot releases."""
        ev = self._events
        while ev and ev[0][0] <= t:
            now, _, kind, d = heapq.heappop(ev)
            if kind == _COMPLETE:
                m, a, j, exp_end, shift0, key, tokens, pos, ran = d
                kernels.view_complete(self.est_free[m], self.est_min[m], self.inflight[m], self.shift[m], a, j, now,
                                      exp_end, shift0)
                if pos >= 0 and self.completion_listener is not None:
                    self.completion_listener(pos, now, exp_end)
                if j >= self.slots[m, a]:
                    self._retire(self.est_free, self.est_min, m, a, j, now)
                if self._cache_fb:  # the server's cached-token count (its usage) corrects the view's retention
                    fb = self._cache_fb.pop(pos, None)
                    if fb is not None:
                        px.retention_update(self.pv_ret, fb[0], fb[1], fb[2], self.cfg.prefix.retention_alpha)
                if ran > 0.0:  # its service time, as the pool's observed durations fold it (the router's shared state)
                    svc = self.view_service_s[m]
                    svc[a] = ran if svc[a] <= 0.0 else svc[a] + SERVICE_ALPHA * (ran - svc[a])
                if tokens >= 0:
                    self._observe_output(m, key, tokens)
                    if pos >= 0 and self.admission is not None:  # its tenant's counter, corrected
                        self.admission.completed(pos, tokens)
                elif tokens == _PREEMPTED:  # the router saw its request die there: the pool is down
                    self.seen_down_at[a] = now
                    self._refresh_at = -np.inf
            elif kind == _LIVE_END:  # a live request's expected end, unless feedback completed it before
                self.complete_live(d[0], now)
            elif kind == _SETTLE:  # a request ended: its budget counts what it really used
                if self.budget is not None:
                    pos, periods, reserved_usd, tokens, usd = d
                    self.budget.settle(pos, now, periods, reserved_usd, tokens, usd)
            else:  # _ADMIT
                m, a, service, true_end, key, tokens, pos = d
                j, exp_end, shift0 = kernels.view_admit(self.est_free[m], self.est_min[m], self.inflight[m],
                                                        self.shift[m], a, now, service)
                self._push(true_end, _COMPLETE, (m, a, j, exp_end, shift0, key, tokens, pos, -1.0))
                if self.has_prefix and pos >= 0:  # the retry's prefix and session went there
                    self._view_sent(pos, m * self.n + a, now, now + service)
        tev, fa = self._tevents, self.free_at
        while tev and tev[0][0] <= t:
            end, m, a, j = heapq.heappop(tev)
            if fa[m, a, j] == end:
                self.tbusy[m, a] -= 1
                if j >= self.slots[m, a]:
                    self._retire(fa, self.tmin, m, a, j, end)

    def _retire(self, arr: np.ndarray, mins: np.ndarray, m: int, a: int, j: int, now: float) -> None:
        """Slot ``j`` of pool (m, a) is past the pool's current size (the inventory shrank it): once
        free it is gone (never chosen again)."""
        if arr[m, a, j] <= now:
            arr[m, a, j] = np.inf
            mins[m, a] = arr[m, a].min()

    def _occupy(self, m: int, a: int, j: int, end: float) -> None:
        kernels.occupy_slot(self.free_at[m], self.tmin[m], self.tbusy[m], a, j, self.t, end)
        heapq.heappush(self._tevents, (end, m, a, j))

    # attributes replaced (never mutated in place) as the episode advances: a reference suffices
    _SHARED_STATE = ("_pos", "_end", "z", "_refresh_at", "_next_event", "t", "price_s", "available", "ext_util",
                     "next_down", "hazard", "static_feats", "static_ok", "cost_rate", "ext_util_conc", "_true_down",
                     "r_m", "r_key", "r_origin", "r_in", "r_max_out", "r_ttft", "r_tpot", "r_deadline", "r_est_out",
                     "r_budget", "r_ref_cost", "r_id", "r_z", "c_rtt", "c_load", "_last_obs", "_seq", "r_blocks",
                     "r_session", "r_view_tokens", "r_cached", "r_sess_here", "pv_valid_from", "r_has_bias", "usd_h",
                     "_pol_dirty", "r_refused", "r_bfeat", "r_excl_budget", "r_excl_quota",
                     "quota_blocked", "r_over", "notice_at", "cut_at", "region_bias", "_r_bias", "_next", "_left",
                     "r_admission", "r_waited_ms", "replicas", "slots", "inv_replicas", "inv_slots", "cap_feat")
    _COPIED_STATE = ("free_at", "tmin", "tbusy", "est_free", "est_min", "inflight", "shift", "est_w", "est_s", "est_n",
                     "view_service_s",
                     "C", "c_mask", "seen_down_at", "pv_ent", "pv_sent", "pv_ret", "ps_pool", "ps_time", "_pol")

    def save_state(self, share: bool = False) -> dict[str, Any]:
        """Everything a step changes, so a planner can look ahead and come back (``restore_state``).
        ``share``: the arrays a step writes in place (``_COPIED_STATE``: ~10 MB on the Mooncake
        bundle, its prefix view and slots) go into the snapshot uncopied -- it holds this
        environment's own arrays, so it is valid only until this environment steps or is restored
        again; for a snapshot restored into other environments at once (``restore_state`` copies
        them; ``models.planning.lookahead``)."""
        d = {k: getattr(self, k) for k in self._SHARED_STATE if hasattr(self, k)}
        d.update({k: getattr(self, k) if share else getattr(self, k).copy() for k in self._COPIED_STATE})
        d.update(_tevents=list(self._tevents), _events=list(self._events), stats=dict(self.stats),
                 _recent=deque(self._recent), _live=dict(self._live), _kv=dict(self._kv),
                 _cache_fb=dict(self._cache_fb))
        self._kv_owner = px.new_owner()  # the snapshot shares the servers' caches: copy before writing
        if self.budget is not None:
            d["_budget"] = self.budget.save()
        if self.admission is not None:
            d["_admission"] = self.admission.save()
        return d

    def restore_state(self, d: dict[str, Any], in_place: bool = True) -> None:
        """Back to the state ``d`` (``save_state``), which stays reusable. ``in_place``: this
        environment's own arrays of ``_COPIED_STATE`` (never shared: ``save_state`` copies them, or
        hands them to a snapshot that this call then must not outlive) take the snapshot's values in
        place where shapes match, sparing an allocation per array and restore; False: fresh copies
        (as before issue 39; ``benchmarks/bench_oracle.py --ab`` times the two)."""
        own = {k: getattr(self, k, None) if in_place else None for k in self._COPIED_STATE}
        for k, v in d.items():
            if k not in ("_budget", "_admission"):
                setattr(self, k, v)
        if self.budget is not None and "_budget" in d:
            self.budget.restore(d["_budget"])
        if self.admission is not None and "_admission" in d:
            self.admission.restore(d["_admission"])
        # the snapshot stays reusable: give the environment its own copies of what it mutates
        for k in self._COPIED_STATE:
            src, cur = d[k], own[k]
            if (isinstance(src, np.ndarray) and isinstance(cur, np.ndarray) and cur is not src
                    and cur.shape == src.shape and cur.dtype == src.dtype):
                np.copyto(cur, src)
                setattr(self, k, cur)
            else:
                setattr(self, k, src.copy())
        self._tevents, self._events = list(d["_tevents"]), list(d["_events"])
        self.stats, self._recent = dict(d["stats"]), deque(d["_recent"])
        self._live = dict(d.get("_live", {}))
        self._kv = dict(d.get("_kv", {}))
        self._cache_fb = dict(d.get("_cache_fb", {}))
        self._kv_owner = px.new_owner()

    # ------------------------------------------------------------------ dynamics
    def _jittered_downs(self) -> list[np.ndarray]:
        """When each recorded preemption really happened: ``spot_lag_s`` x U(0, 1) before the
        telemetry records it, never before the offering's previous row."""
        out = []
        av, lag = self.replay.avail, self.cfg.spot_lag_s
        for i, d in enumerate(self.replay.down_times):
            if d.size == 0 or lag <= 0:
                out.append(d)
                continue
            ts = av.t[av.off[i]:av.off[i + 1]]
            k = np.searchsorted(ts, d, side="left")
            gap = np.minimum(np.where(k > 0, d - ts[np.maximum(k - 1, 0)], 0.0), lag)
            out.append(d - self.np_random.random(d.size) * gap)
        return out

    def _refresh(self, t: float) -> None:
        snap = self.replay.snapshot(t, self.cfg.risk_lookback_h * 3600.0)
        p, p24 = snap["price"], snap["price_24h"]  # per GPU-hour
        self.price_s = p / 3600.0
        # available as the telemetry says -- unless the router saw a request of its own preempted
        # there since the telemetry's last change for that offering (it reports preemptions late)
        self.available = (snap["available"] > 0.5) & ~(self.seen_down_at > self.replay.avail.last_times(t))
        # the prefix view forgets what it sent to a pool before it was last seen down (telemetry or its own requests)
        self.pv_valid_from = px.us_array(np.maximum(self.seen_down_at, self._recorded_down(t)))
        self.ext_util = snap["util"]
        self.ext_util_conc = self.ext_util[None, :] * self.conc
        # the truth's next preemption of each offering: the first one not yet recorded at t (with
        # spot_lag_s it may already have happened: the telemetry reports it late)
        nd = np.full(self.n, np.inf)
        for i, d in enumerate(self.replay.down_times):
            if d.size:
                k = int(np.searchsorted(d, t, side="right"))
                if k < d.size:
                    nd[i] = self._true_down[i][k]
        self.next_down = nd
        self._notices(t)
        ref_price = self.cfg.reward.reference_usd_per_replica_hour
        # preemption hazard per second, the posterior mean of a Poisson rate under a Gamma prior: the
        # preemptions seen within the lookback over the time watched, plus the prior's
        c = self.cfg
        self.hazard = np.where(self.is_spot > 0.5, (snap["preempt_count"] + c.risk_prior_per_h * c.risk_prior_h)
                               / (snap["observed_s"] + c.risk_prior_h * 3600.0), 0.0)
        st = np.zeros((self.M, self.n, fz.N_OFFERING_FEATURES))
        replica_price = np.where(self.fits, p[None, :] * np.maximum(self.placement.gpus, 1.0), np.nan)
        st[..., fz.F["log_price"]] = np.clip(np.log(np.maximum(np.nan_to_num(replica_price, nan=1e-6), 1e-6)
                                                    / ref_price), -3, 3)
        st[..., fz.F["price_trend"]] = np.clip(np.nan_to_num((p - p24) / np.maximum(p, 1e-9)), -1, 1)
        st[..., fz.F["price_volatility"]] = np.clip(snap["volatility"] / 10.0, 0, 1)
        st[..., fz.F["is_spot"]] = self.is_spot
        st[..., fz.F["ext_util"]] = np.clip(self.ext_util, 0, 1)
        st[..., fz.F["available"]] = self.available
        st[..., fz.F["preemptions"]] = np.clip(snap["preempt_count"] / 5.0, 0, 2)
        st[..., fz.F["preempt_recency"]] = snap["preempt_recency"]
        st[..., fz.F["speed"]] = self.speed_feat
        st[..., fz.F["capacity"]] = self.cap_feat
        self.static_feats = st
        # the parts of the mask and of the expectations that only change with telemetry
        priced = np.isfinite(self.price_s)
        if self.inventory.active:  # the pools follow the running instances
            self._resize(t)
            st[..., fz.F["capacity"]] = self.cap_feat
        self.quota_blocked = self.capacity.blocked(t) if self.capacity.active else np.zeros(self.n, dtype=bool)
        self.static_ok = self.available[None, :] & (self.slots > 0) & priced[None, :] & self.fits & ~self.quota_blocked
        self.cost_rate = np.where(priced, self.price_s, 0.0)[None, :] * self.gpus_per_slot
        #: each offering's price per instance-hour now (NaN unpriced): what max_usd_per_hour reads
        self.usd_h = np.where(priced, p * self.gpu_count, np.nan)
        self._refresh_at = t + self.cfg.feature_refresh_s
        self._next_event = min(self.replay.next_event_after(t), self._notice_event)
        if self.capacity.active:
            k = int(np.searchsorted(self.capacity.event_times, t, side="right"))
            if k < self.capacity.event_times.size:
                self._next_event = min(self._next_event, float(self.capacity.event_times[k]))
        if self.inventory.active:
            self._next_event = min(self._next_event, self.inventory.next_event_after(t))

    def _notices(self, t: float) -> None:
        """The spot notices delivered by ``t`` (information a router really has then): a pool
        whose next true preemption (``next_down``) is announced (``notice_at`` <= t) is masked for
        new decisions, and each region with a notice within ``migration.deprioritize_s`` is
        de-prioritized (``region_bias``, the router's rule: ``xroute.migration_rules``). ``cut_at``:
        when work on each spot pool stops -- at the notice, or at the preemption itself when the
        offering gets none. ``_notice_event``: the next notice or end of a de-prioritization."""
        ns, spot = self.notice_s, self.is_spot > 0.5
        self.notice_at = np.where(ns > 0, self.next_down - ns, np.inf)
        self.cut_at = np.where(spot, np.where(ns > 0, self.notice_at, self.next_down), np.inf)
        noticed = self.notice_at <= t
        if noticed.any():
            self.available = self.available & ~noticed
        nxt = float(self.notice_at[self.notice_at > t].min(initial=np.inf))
        mc = self.cfg.migration
        depri: list[tuple[str, float]] = []
        if mc.region_penalty > 0 and mc.deprioritize_s > 0:
            for i in np.flatnonzero(ns > 0):
                d = self._true_down[i]
                if d.size:
                    at = d - ns[i]
                    recent = at[(at <= t) & (at > t - mc.deprioritize_s)]
                    for x in recent.tolist():
                        until = rules.deprioritize_until(x, mc.deprioritize_s)
                        depri.append((self.locations[i], until))
                        nxt = min(nxt, until)
        self.region_bias = rules.region_bias(self.locations, depri, t, mc.region_penalty)
        self._notice_event = nxt

    def _prepare(self) -> None:
        """Make the next decision's request current: the stream's next request in arrival order, or,
        with admission (``envs.admission``, ``docs/env.md`` "Admission under load"), the next one the
        router's queue dispatches or sheds, or the next arrival it admits or sheds at once."""
        q = self.admission
        if q is None or not q.queue:  # nothing waits: the next arrival, admitted at once when it fits
            i = self._next
            self._next += 1
            self._current(i, float(self.arrival[i]))
            if q is None or self.r_refused != NOT_REFUSED:
                return
            if admits_at_arrival(self.C, self.c_mask, self.r_ttft, self.req_margin[i]):
                return  # (admission_rules.verdict's ADMIT without waiting, placed: envs.admission, the fast path)
            if self._arrived(q):
                return
        while True:
            t_arr = float(self.arrival[self._next]) if self._next < self._end else np.inf
            while q.queue:  # capacity may free (a completion learned, telemetry) or a budget end first
                tau = min(self._events[0][0] if self._events else np.inf, q.next_expiry(), self._next_event)
                if tau > t_arr:
                    break
                if self._dispatch(max(tau, self.t)):
                    return
            if self._next >= self._end:
                raise RuntimeError("admission: no request left to decide")  # (unreachable while _left > 0)
            i = self._next
            self._next += 1
            self._current(i, t_arr)
            if self._arrived(q):
                return

    def _arrived(self, q: WorldQueue) -> bool:
        """The verdict on the current request at its arrival: it waits in the queue (False), or it is
        this step's, admitted or shed (True; a full queue sheds)."""
        v = self._verdict(0.0, q.ahead(int(self.req_band[self._pos])))
        if v == ar.QUEUE and not q.full:
            q.enqueue(self._pos)
            self.stats["queued"] += 1
            return False
        self._decide(ar.SHED if v == ar.QUEUE else v, 0.0)
        return True

    def _verdict(self, waited_ms: float, ahead: bool = False) -> str:
        """The admission verdict of the current request (``admission_rules.verdict``) on the best TTFT
        the router's view predicts over the offerings it may use (``c_mask``; none, or every one full:
        infinite), and the soonest any of them could start it (``soonest_ttft``). A
        request its tenant's budget refused, or one no offering the routing policies allow can hold
        (the router's 422 ``no_offering``, decided before its ``predict`` stage), is not the
        admission's: it fails as before. ``ahead``: an arrival finds requests waiting that the queue
        dispatches before it (``admission_rules.waits_ahead``)."""
        if self.r_refused != NOT_REFUSED or not (self.r_allowed & self.fits[self.r_m]).any():
            return ar.ADMIT
        b = int(self.req_band[self._pos])
        best = float(best_ttft(self.C, self.c_mask, self.req_margin[self._pos]))
        ok = self.fits[self.r_m]  # (the soonest over the offerings it may use, whatever their state now)
        soonest = -np.inf if best <= self.r_ttft - waited_ms else float(soonest_ttft(self.C, ok, self.r_allowed, ok))
        return ar.verdict(ar.BANDS[b], best, self.r_ttft, waited_ms, ahead, soonest)

    def _dispatch(self, t: float) -> bool:
        """At ``t``, with what the router learned by then: shed the first waiting request whose TTFT
        budget is spent, else make current the first waiting request in dispatch order
        (``admission_rules.dispatch_order``) that some offering is now predicted to serve in time.
        False: none (everything still waits)."""
        q = self.admission
        assert q is not None
        self._advance(t)
        p = q.expired(t)
        if p is not None:
            q.remove(p)
            self._current(p, t, count=False)
            self._decide(ar.SHED, 1000.0 * (t - float(self.arrival[p])))
            return True
        for p in q.order():  # (the first that does not fit ends the pass, as the router's queue)
            waited = 1000.0 * (t - float(self.arrival[p]))
            self._current(p, t, count=False)
            v = self._verdict(waited)
            if v == ar.QUEUE:
                return False
            q.remove(p)
            self._decide(v, waited)
            return True
        return False

    def _decide(self, verdict: str, waited_ms: float) -> None:
        """The current request is this step's: admitted after waiting ``waited_ms``, or shed (every
        offering masked; ``_resolve`` charges ``admission.shed_cost``)."""
        self.r_admission, self.r_waited_ms = verdict, waited_ms
        if verdict == ar.SHED:
            self.c_mask[:] = False
        elif verdict == ar.ADMIT and self.admission is not None and self.r_refused == NOT_REFUSED:
            place_within(self.C, self.c_mask, self.r_ttft - waited_ms, self.req_margin[self._pos], waited_ms > 0.0)

    def _current(self, i: int, t: float, count: bool = True) -> None:
        """Make the stream's request ``i`` current at ``t`` and compute its candidate outcomes. Reads
        only what the client sends (never ``req_out``). ``count``: an arrival (the recent arrival
        rate counts it), not a queued request tried again."""
        self._pos = i
        ctx = None
        if self.policies is not None:
            if self._req_ctx is None:
                self._stream_contexts()
            assert self._req_ctx is not None
            ctx = self._req_contexts[self._req_ctx[i]]
        budget, refuse = NO_BUDGET, NOT_REFUSED
        if self.budget is not None and self.budget.buckets_of[i]:
            self._advance(t)  # (the ends the budget learns of up to t)
            budget, refuse = self.budget.check(i, t, float(self.req_in[i] + self.req_max_out[i]))
        self._set_request(t, int(self.req_origin[i]), self.req_in[i], self.req_max_out[i],
                          self.req_ttft[i], self.req_tpot[i], self.req_deadline[i], int(self.req_model[i]),
                          int(self.req_key[i]), self.req_ids[i], float(self.z[i - self._ep_start]), ctx, pos=i,
                          budget=budget, refuse=refuse, count=count)

    def _set_request(self, t: float, origin: int, n_in: float, max_out: float, ttft_ms: float, tpot_ms: float,
                     deadline_ms: float, model: int, key: int, request_id: Any, z: float,
                     ctx: pol.PolicyContext | None = None, pre: np.ndarray | None = None, pos: int = -1,
                     live_prefix: tuple[np.ndarray, np.ndarray, int, int] | None = None,
                     budget: LiveBudget = NO_BUDGET, refuse: int = NOT_REFUSED, count: bool = True) -> None:
        """Make a request current: the router learns what happened up to ``t``, estimates the
        output length, looks its prefix up in its view (the stream's request ``pos``, or a live
        router's ``live_prefix``: per offering the leading blocks its shared index expects there,
        the pools' retention, the session's offering, the block size), computes the request's
        expectations on every offering in one compiled pass (``envs.kernels.candidate_outcomes_into``),
        then applies the policies of its context ``ctx`` (``envs.policies``; ``pre``: a router's own
        constraint layers, see ``CompiledPolicies.apply``); then its tenant's ``budget`` masks
        what it cannot afford, or ``refuse`` masks everything (``envs.budget``)."""
        self._advance(t)
        if t >= self._refresh_at or t >= self._next_event:
            self._refresh(t)
        self.t = t
        self._prefix_view(t, model, float(n_in), pos, live_prefix)
        cfg = self.cfg.estimator
        est_out = float(est.estimate(self.est_w, self.est_s, self.est_n, key, model, float(max_out), cfg.shrinkage,
                                     cfg.prior_fraction, est.UPPER))
        dl = float(deadline_ms)
        self.r_m, self.r_key, self.r_origin, self.r_in, self.r_max_out = model, key, origin, float(n_in), float(max_out)
        self.r_ttft, self.r_tpot, self.r_deadline, self.r_est_out = float(ttft_ms), float(tpot_ms), dl, est_out
        self.r_budget = self.latency_budget(ttft_ms, tpot_ms, dl, est_out)
        self.r_ref_cost = self.reference_cost(n_in, est_out)
        self.r_id, self.r_z = request_id, z
        rtt = self.rtt_ms[origin]
        if not hasattr(self, "C"):
            self.C = np.zeros((kernels.N_OUT, self.n))
            self.c_mask = np.zeros(self.n, dtype=bool)
        m = model
        busy_valid, slots_valid = self.outcomes_into(self.C, self.c_mask, self.est_min[m], self.inflight[m],
                                                     self.view_server_busy[m], rtt)
        self.c_load = min(busy_valid / max(slots_valid, 1.0), 1.0)
        self.c_rtt = rtt
        self.r_excl_quota = int((self.quota_blocked & self.fits[m] & (self.slots[m] > 0)).sum()) \
            if self.capacity.active else 0
        policies = self.policies
        out = self._pol
        if policies is not None and ctx is not None and not ctx.empty:
            policies.apply(ctx, self._all_true if pre is None else pre, self.usd_h, rtt, self.C[kernels.BUSY],
                           self.slots[m], self.c_mask, out)
            self.r_has_bias = ctx.has_prefer and not policies.lexicographic
            self._pol_dirty = True
        else:
            if self._pol_dirty:  # the previous request's outcome: back to "everything allowed"
                out.allowed[:] = True
                out.reason[:] = -1
                out.bias[:] = 0.0
                out.counts[:] = 0
                out.bias_counts[:] = 0
                out.excluded = out.not_preferred = 0
                self._pol_dirty = False
            out.ctx = ctx
            self.r_has_bias = False
        self._r_bias = None
        if self.region_bias.any():  # a region with a spot notice, de-prioritized (xroute.migration_rules)
            # (a new array per request: a step's info keeps it)
            self._r_bias = (self._pol.bias + self.region_bias) if self.r_has_bias else self.region_bias.copy()
            self.r_has_bias = True
        self._apply_budget(budget, refuse)
        self.r_admission, self.r_waited_ms = ar.ADMIT, 0.0
        if count:
            self._recent.append(t)
        while self._recent and self._recent[0] < t - 10.0:
            self._recent.popleft()

    def outcomes_into(self, C: np.ndarray, mask: np.ndarray, est_min: np.ndarray, inflight: np.ndarray,
                      server_busy: np.ndarray, rtt: float) -> tuple[float, float]:
        """The current request's expectations on every offering (``kernels.candidate_outcomes_into``
        into ``C`` and ``mask``) on a view of the router's own work -- its pools' expected first
        releases ``est_min``, its requests in flight ``inflight`` and the servers' reported load
        ``server_busy`` (the real view's, or greedy's twin's: ``envs.twin``) -- with everything
        else the request's and the telemetry's. Returns the busy and total slots of the valid."""
        m, t = self.r_m, self.t
        return kernels.candidate_outcomes_into(  # type: ignore[no-any-return]
            C, mask, est_min, inflight, self.inv_replicas[m], self.conc_m1[m], self.ext_util_conc[m],
            self.inv_prefill[m], self.tpot_s[m], self.tpot_growth_s[m], self.sigma[m], rtt, self.cost_rate[m],
            self.static_ok[m], self.hazard, self.slots[m], t, self.r_in, self.r_est_out, self.r_max_out, self.r_ttft,
            self.r_tpot, self.r_deadline, self.cfg.queue_timeout_s, 0.5 * self.cfg.spot_lag_s, self.view_others[m],
            self.view_service_s[m], server_busy, self.r_cached, self.r_sess_here)

    def _apply_budget(self, budget: LiveBudget, refuse: int) -> None:
        """The current request's budget: its features, and the offerings it cannot afford masked
        (an expected cost over the USD left); refused (everything masked) when ``refuse`` says so
        or no valid offering is affordable."""
        #: the offerings the budget masked (None: none)
        self.r_over: np.ndarray | None = None
        self.r_excl_budget = 0
        self.r_refused = refuse
        if budget is NO_BUDGET and refuse == NOT_REFUSED:  # (the common case: no budget, nothing to do)
            self.r_bfeat = _NO_BUDGET_FEATURES
            return
        self.r_bfeat = budget_features(budget)
        if refuse != NOT_REFUSED:
            self.c_mask[:] = False
        elif budget.usd_limit >= 0 and budget.usd_left < self.C[COST].max():  # (else nothing is over)
            over = self.c_mask & (self.C[COST] > budget.usd_left)
            if over.any():
                self.r_excl_budget = int(over.sum())
                self.r_over = over
                self.c_mask &= ~over
                if not self.c_mask.any():
                    self.r_refused = REFUSED_BUDGET

    @property
    def carries_affinity(self) -> bool:
        """Whether the current request carries KV-prefix blocks or a session -- what a live router's
        request does with ``prefix_hashes`` or ``session_id`` (``RoutingEngine.wants_affinity``);
        the learned router's affinity guard reads it (``models.policy.holds``)."""
        return bool(self.r_blocks.size > 0 or self.r_session >= 0)

    def _prefix_view(self, t: float, m: int, n_in: float, pos: int,
                     live: tuple[np.ndarray, np.ndarray, int, int] | None) -> None:
        """The current request's prefix as the router sees it: ``r_view_tokens`` (the prompt tokens
        its record expects each pool of model ``m`` to hold), ``r_cached`` (the same times each
        pool's retention: what the expectations use) and ``r_sess_here`` (1 on the offering its
        session's previous request went to); zeros without prefix information."""
        blocks, session = self._no_blocks, -1
        if live is not None:
            runs, retention, sess_a, block = live
            view = np.empty(self.n)
            px.expected_cached(runs, block, n_in, np.ones(self.n), view)
            self.r_view_tokens, self.r_cached = view, view * retention
            here = np.zeros(self.n)
            if 0 <= sess_a < self.n:
                here[sess_a] = 1.0
            self.r_blocks, self.r_session, self.r_sess_here = blocks, session, here
            return
        if pos >= 0 and self.has_prefix:
            blocks = self._blocks_of(pos)
            session = int(self.req_session[pos])
        self.r_blocks, self.r_session = blocks, session
        if blocks.size == 0 or self.block_tokens <= 0:
            self.r_view_tokens = self.r_cached = self._zero_n
        else:
            n = self.n
            self.r_view_tokens, self.r_cached = np.empty(n), np.empty(n)
            px.view_expect(self.pv_ent, self.pv_sent, self.pv_cap, blocks, m * n, n, px.us(t),
                           px.us(t - self.cfg.prefix.view_ttl_s), self.pv_valid_from, self.block_tokens, n_in,
                           self.pv_ret, self._run_buf, self.r_view_tokens, self.r_cached)
        self.r_sess_here = self._zero_n
        if session >= 0:
            p = int(self.ps_pool[session])
            if p // self.n == m and self.ps_time[session] >= t - self.cfg.prefix.view_ttl_s:
                self.r_sess_here = np.zeros(self.n)
                self.r_sess_here[p % self.n] = 1.0

    def _view_sent(self, pos: int, p: int, t: float, ready: float) -> None:
        """The router sent the stream's request ``pos`` to pool ``p`` at ``t``: its view records the
        prefix blocks there, computed by ``ready`` (the request's expected first token), and its
        session's pool."""
        blocks = self._blocks_of(pos)
        if blocks.size:
            px.view_record(self.pv_ent, self.pv_sent, blocks, p, px.us(ready))
        s = int(self.req_session[pos])
        if s >= 0:
            self.ps_pool[s], self.ps_time[s] = p, t

    def _recorded_down(self, t: float) -> np.ndarray:
        """When the telemetry last recorded each offering preempted, at or before ``t`` (-inf: never)."""
        out = np.full(self.n, -np.inf)
        for i, d in enumerate(self.replay.down_times):
            if d.size:
                k = int(np.searchsorted(d, t, side="right"))
                if k:
                    out[i] = d[k - 1]
        return out

    def _last_down(self, a: int, t: float) -> float:
        """When offering ``a`` last really lost its replicas (a spot preemption) at or before ``t``."""
        d = self._true_down[a]
        if d.size == 0:
            return -np.inf
        k = int(np.searchsorted(d, t, side="right"))
        return float(d[k - 1]) if k else -np.inf

    def _pool_kv(self, m: int, a: int, t: float, write: bool) -> px.PoolKV | None:
        """The servers' caches of pool (m, a) at ``t`` -- empty again after the pool was preempted --
        this environment's own copy when it will ``write``; None when empty and not writing."""
        key = m * self.n + a
        kv = self._kv.get(key)
        down = self._last_down(a, t)
        if kv is None or kv.cleared_at < down:
            if not write:
                return None
            kv = px.PoolKV(int(self.replicas_alloc[m, a]), int(self.kv_capacity[m, a]), self._kv_owner, down)
            self._kv[key] = kv
        elif write and kv.owner != self._kv_owner:
            kv = self._kv[key] = kv.copy(self._kv_owner)
        return kv

    def true_cached(self) -> np.ndarray:
        """HINDSIGHT, for the oracle only: the prompt tokens of the current request each valid
        offering's servers really hold for it now (the replica its scheduler would pick)."""
        blocks = self.r_blocks
        if blocks.size == 0 or not self._kv:
            return self._zero_n
        out = np.zeros(self.n)
        m, n, t = self.r_m, self.n, self.t
        conc = self.conc[m]
        for key in list(self._kv):
            if key // n != m or not self.c_mask[key % n]:
                continue
            a = key % n
            kv = self._pool_kv(m, a, t, False)
            if kv is not None:
                _, hit = kv.place(self.free_at[m, a], int(conc[a]), t, blocks)
                out[a] = min(hit * self.block_tokens, self.r_in)
        return out

    # the candidate outcomes as named arrays (views of rows of ``C``)
    @property
    def c_wait(self) -> np.ndarray:
        return self.C[WAIT]

    @property
    def c_service(self) -> np.ndarray:
        return self.C[SERVICE]

    @property
    def c_lat(self) -> np.ndarray:
        return self.C[LAT]

    @property
    def c_cost(self) -> np.ndarray:
        return self.C[COST]

    @property
    def c_risk(self) -> np.ndarray:
        return self.C[RISK]

    @property
    def c_pviol(self) -> np.ndarray:
        return self.C[PVIOL]

    def _obs(self) -> dict[str, np.ndarray]:
        n = self.n
        nf = fz.N_OFFERING_FEATURES
        offerings = np.zeros(self.N * nf, dtype=np.float32)
        self.offering_features(self._all_idx, out=offerings[: n * nf].reshape(n, nf))
        mask = np.zeros(self.N, dtype=np.float32)
        mask[:n] = self.c_mask
        self._last_obs = {"offerings": offerings, "request": self.request_features(), "mask": mask}
        return self._last_obs

    def observation(self) -> dict[str, np.ndarray]:
        """The current request's observation (what ``reset``/``step`` returned for it)."""
        return self._obs()

    def offering_features(self, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The observation's offering rows of offerings ``idx`` (int64) for the current request,
        as a (len(idx), F) float32 matrix (written into ``out`` when given)."""
        if out is None:
            out = np.empty((idx.shape[0], fz.N_OFFERING_FEATURES), dtype=np.float32)
        m = self.r_m
        kernels.offering_rows(out, idx, self.static_feats[m], self.c_mask, self.c_rtt, self.C, self.inv_slots[m],
                              self.r_ttft, self.r_tpot, self.r_budget, self.r_ref_cost)
        return out

    def request_features(self) -> np.ndarray:
        """The observation's request vector (``envs.features.REQUEST_FEATURES``), float32."""
        return np.array([
            min(math.log1p(self.r_in) / 10.0, 2.0),
            min(math.log1p(self.r_est_out) / 8.0, 2.0),
            min(math.log1p(self.r_max_out) / 8.0, 2.0),
            min(math.log1p(self.r_ttft) / 10.0, 2.0),
            min(math.log1p(self.r_tpot) / 6.0, 2.0),
            min(math.log1p(self.r_budget) / 12.0, 2.0),
            self.params_feat[self.r_m],
            min(len(self._recent) / 100.0, 3.0),
            self.c_load,
            *self.r_bfeat,
        ], dtype=np.float32)

    @property
    def _all_true(self) -> np.ndarray:
        a = self.__dict__.get("_all_true_arr")
        if a is None:
            a = self.__dict__["_all_true_arr"] = np.ones(self.n, dtype=bool)
        return a  # type: ignore[no-any-return]

    # the current request's policy outcome (``envs.policies``), read-only, replaced by the next request
    @property
    def r_bias(self) -> np.ndarray:
        """The prefer policies' weight of each offering for the current request (reward units;
        zeros when no prefer policy applies, or with ``prefer_mode: lexicographic``, where the mask
        does it), plus ``-migration.region_penalty`` on the offerings of a region with a spot notice
        within ``migration.deprioritize_s`` (``xroute.migration_rules.region_bias``): every policy
        adds it to its score."""
        if not self.r_has_bias:
            return self._zero_bias
        return self._pol.bias if self._r_bias is None else self._r_bias

    @property
    def r_allowed(self) -> np.ndarray:
        """Offerings the policies allow for the current request (whatever the pools' state)."""
        return self._pol.allowed

    @property
    def r_policy(self) -> pol.PolicyOutcome:
        """The current request's policy outcome: allowed, reason (rank), bias, exclusion counts."""
        return self._pol

    def _info(self) -> dict[str, Any]:
        mask = np.zeros(self.N, dtype=bool)
        mask[: self.n] = self.c_mask
        info = {"action_mask": mask, "request_id": self.r_id, "t": self.t}
        if self.r_has_bias:
            info["policy_bias"] = self.r_bias
        return info

    def action_mask(self) -> np.ndarray:
        """Valid actions for the current request (for ``sb3_contrib``-style masking)."""
        return self._info()["action_mask"]

    # ------------------------------------------------------------------ outcomes (the simulation)
    @property
    def _ep_start(self) -> int:
        return self._end - len(self.z)

    def _fallback(self, exclude: int, noticed: bool = False) -> int | None:
        """Where a preempted (or migrating) request goes on: the valid on-demand offering with the
        lowest expected latency, outside the de-prioritized regions -- those with a notice within
        ``migration.deprioritize_s``, and the source's own when ``noticed`` -- unless every one is
        in such a region."""
        cand = self.on_demand_idx[self.c_mask[self.on_demand_idx]]
        cand = cand[cand != exclude]
        if cand.size == 0:
            return None
        penalized = self.region_bias[cand] < 0
        if noticed:
            src = self.locations[exclude]
            penalized |= np.array([self.locations[c] == src for c in cand.tolist()])
        if penalized.any() and not penalized.all():
            cand = cand[~penalized]
        return int(cand[np.argmin(self.c_lat[cand])])

    def _progress(self, r1: dict[str, float], out: float) -> tuple[float, float]:
        """(prompt tokens, output tokens) whose KV cache a request stopped by ``_attempt`` holds on
        its pool when it stops: nothing while queued; the cached prefix and the prefilled share of
        the rest during its prefill; the prompt and the tokens decoded so far after it."""
        ran, pf, tp = r1["ran"], r1.get("pf", 0.0), r1.get("tp", 0.0)
        if ran <= 0:
            return 0.0, 0.0
        cached = r1["cached"]
        if ran < pf:
            return float(math.floor(cached + (self.r_in - cached) * ran / pf)), 0.0
        done = math.floor((ran - pf) / tp) if tp > 0 else 0
        return self.r_in, float(min(max(done, 0), max(out - 1.0, 0.0)))

    def _attempt(self, m: int, a: int, start_t: float, out: float, dry: bool = False, have_in: float = 0.0,
                 extra_prefill: float = 0.0) -> dict[str, float]:
        """Simulate the request on pool (m, a) from ``start_t``: its true slot and service, cut short
        when work on the pool stops (``cut_at``: its next spot notice, or its true preemption when
        it gets no notice). Takes the slot in the truth (unless ``dry``). ``out``: the tokens to
        decode; a migrated request's target has ``have_in`` prompt tokens' KV already (transferred)
        and prefills ``extra_prefill`` more (its generated tokens, recomputed)."""
        f = math.exp(self.sigma[m, a] * self.r_z - 0.5 * self.sigma[m, a] ** 2)
        blocks, kv, cached = self.r_blocks, None, 0.0
        if blocks.size and self.kv_capacity[m, a] > 0:  # the servers' prefix caches (envs.prefix)
            kv = self._pool_kv(m, a, start_t, not dry)
        if kv is None:
            j = kernels.earliest_slot(self.free_at[m], a)
        else:  # the in-pool scheduler's replica; its blocks are computed by the end of the prefill
            conc = int(self.conc[m, a])
            if dry:
                j, hit = kv.place(self.free_at[m, a], conc, start_t, blocks)
            else:
                j, hit = kv.serve(self.free_at[m, a], conc, start_t, blocks, self.block_tokens, self.r_in,
                                  self.inv_prefill[m, a] * f)
            cached = min(hit * self.block_tokens, self.r_in)
        start = max(start_t, self.free_at[m, a, j])
        k = min(self.tbusy[m, a] * self.inv_replicas[m, a], self.conc_m1[m, a]) + self.ext_util_conc[m, a]
        pf = (max(self.r_in - max(cached, have_in), 0.0) + extra_prefill) * self.inv_prefill[m, a] * f
        tp = (self.tpot_s[m, a] + self.tpot_growth_s[m, a] * k) * f
        service = pf + out * tp
        first = start + pf + (tp if out >= 1 else 0.0)
        down = self.cut_at[a]
        if down < start + service:
            # work on the pool stops (its notice, or it dies unannounced) while the request is queued
            # (or already dead when it is sent: the telemetry shows it late) or in service: it stops
            # then, having run what it ran
            stop = max(down, start_t)
            ran = max(stop - start, 0.0)
            if ran > 0 and not dry:
                self._occupy(m, a, j, stop)
            return {"end": stop, "first": first if first <= stop else np.inf, "ran": ran, "preempted": 1.0,
                    "cached": cached, "pf": pf, "tp": tp}
        if not dry:
            self._occupy(m, a, j, start + service)
        return {"end": start + service, "first": first, "ran": service, "preempted": 0.0, "cached": cached}

    def reference_cost(self, input_tokens: float, output_tokens: float) -> float:
        """The reward's cost yardstick: the request served alone on one replica of the reference
        accelerator at ``reference_usd_per_replica_hour`` (USD; at least 1e-12)."""
        return max(self._ref_cost_rate * (input_tokens * self._ref_prefill_s + output_tokens * self.ref.tpot_ms / 1000.0),
                   1e-12)

    @staticmethod
    def latency_budget(ttft_ms: float, tpot_ms: float, deadline_ms: float, output_tokens: float) -> float:
        """The reward's latency yardstick (ms, at least 1): the deadline when given (not NaN), else
        TTFT + TPOT x (output - 1)."""
        return float(max(deadline_ms if deadline_ms == deadline_ms else ttft_ms + tpot_ms * max(output_tokens - 1.0, 0.0),
                         1.0))

    @staticmethod
    def slo_missed(ttft: float, latency: float, output_tokens: float, ttft_ms: float, tpot_ms: float,
                   deadline_ms: float) -> tuple[float, bool]:
        """(time per output token after the first, whether the SLO was missed) of an outcome: TTFT
        over ``ttft_ms``, that time per token over ``tpot_ms`` (more than one token), or the latency
        over the deadline (when given, not NaN)."""
        out = output_tokens
        tpot = (latency - ttft) / (out - 1.0) if out > 1 else 0.0
        return tpot, bool(ttft > ttft_ms or (out > 1 and tpot > tpot_ms) or (deadline_ms == deadline_ms and
                                                                             latency > deadline_ms))

    def _reward(self, cost: float, ref_cost: float, latency: float, budget: float, violated: bool, failed: bool
                ) -> float:
        """``envs.kernels.realized_reward`` with this environment's reward weights."""
        rw = self.cfg.reward
        return float(kernels.realized_reward(cost, ref_cost, latency, budget, violated, failed, rw.cost_weight,
                                             rw.latency_weight, rw.sla_penalty, rw.cost_norm_cap, rw.latency_norm_cap,
                                             rw.failure_latency_norm))

    def _resolve(self, a: int, dry: bool = False) -> dict[str, Any]:
        """Simulate serving the current request on offering ``a``: its realized outcome and reward.
        Updates the truth, the router's view (the decision, and the completion or the retry it
        will learn of) and the statistics -- or nothing at all when ``dry`` (the oracle's
        hindsight: the same outcome, leaving the environment as it was). When the admission acted
        on the request (it waited, or was shed) its keys join the outcome (``_admission_info``)."""
        r = self._serve(a, dry)
        if self.r_waited_ms or self.r_admission != ar.ADMIT:
            r.update(self._admission_info())
        return r

    def _serve(self, a: int, dry: bool) -> dict[str, Any]:
        t, m = self.t, self.r_m
        out = float(self.req_out[self._pos])  # the realized outcome: simulation only
        ref_cost = self.reference_cost(self.r_in, out)
        dl = self.r_deadline
        budget = self.latency_budget(self.r_ttft, self.r_tpot, dl, out)
        refused = REFUSED[self.r_refused] or None
        if not dry:
            self.stats["excluded_budget"] += self.r_excl_budget
            self.stats["excluded_quota"] += self.r_excl_quota
        prompt = self.r_in if self.r_blocks.size else 0.0  # prefix-bearing prompt tokens (the hit rate's base)
        if self.r_admission == ar.SHED:  # the admission shed it: never served, charged admission.shed_cost
            self.stats["shed"] += not dry
            return {"reward": -float(self.cfg.admission.shed_cost), "offering": a, "cost_usd": 0.0,
                    "latency_ms": np.nan, "ttft_ms": np.nan, "tpot_ms": np.nan, "sla_violation": True,
                    "failed": False, "preempted": False, "migrated_to": None, "refused": None, "prompt_tokens": prompt,
                    "cached_tokens": 0.0, **_NO_MIGRATION}
        if a < 0 or a >= self.n or not self.c_mask[a]:
            self.stats["failed"] += not dry
            if refused is not None and not dry:
                self.stats[f"refused_{refused}"] += 1
            reward = self._reward(0.0, ref_cost, 0.0, budget, True, True)
            return {"reward": float(reward), "offering": a, "cost_usd": 0.0, "latency_ms": np.nan, "ttft_ms": np.nan,
                    "tpot_ms": np.nan, "sla_violation": True, "failed": True, "preempted": False, "migrated_to": None,
                    "refused": refused,
                    "prompt_tokens": prompt, "cached_tokens": 0.0, **_NO_MIGRATION}
        if not dry:  # the router records the decision with the expected service time (and its prefix)
            j_est, exp_end, shift0 = kernels.view_admit(self.est_free[m], self.est_min[m], self.inflight[m],
                                                        self.shift[m], a, t, self.C[SERVICE, a])
            if self.has_prefix:
                self._view_sent(self._pos, m * self.n + a, t, t + max(self.C[TTFT, a] - self.c_rtt[a], 0.0) / 1000.0)
            if self.admission is not None:  # its tenant's fairness counter: the service expected
                self.admission.admitted(self._pos, self.r_in, self.r_est_out)
        r1 = self._attempt(m, a, t, out, dry)
        cached = r1["cached"]
        cost = self.cost_rate[m, a] * r1["ran"]
        waited = self.r_waited_ms  # (its wait in the router's queue: latency and TTFT run from its arrival)
        latency = self.c_rtt[a] + 1000.0 * (r1["end"] - t) + waited
        ttft = self.c_rtt[a] + 1000.0 * (r1["first"] - t) + waited
        failed, migrated_to, preempted = False, None, bool(r1["preempted"])
        mode, recomputed, kv_moved, missed = None, 0.0, 0.0, False
        if not preempted:
            if not dry:
                self._push(r1["end"], _COMPLETE, (m, a, j_est, exp_end, shift0, self.r_key, out, self._pos,
                                                    r1["ran"]))
                if prompt:  # its completion will say (the server's usage) how much of the prompt was cached
                    self._cache_fb[self._pos] = (m * self.n + a, float(self.r_view_tokens[a]), cached)
        else:
            if not dry:
                self.stats["preempted"] += 1
                self._push(r1["end"], _COMPLETE, (m, a, j_est, exp_end, shift0, self.r_key, _PREEMPTED, self._pos,
                                                    -1.0))
            noticed = bool(self.notice_s[a] > 0)
            ctx_in, out_done = self._progress(r1, out)
            ctx = ctx_in + out_done
            f = self._fallback(a, noticed)
            if f is None:
                failed = True
                recomputed = ctx
            else:
                migrated_to = f
                if noticed:  # the migration rules (xroute.migration_rules), from the notice
                    mc = self.cfg.migration
                    ready = r1["end"] + mc.delay_s
                    mode = "resend"  # nothing computed yet: the request just goes to the target
                    if ctx > 0:
                        mv = rules.choose_kv_move(r1["end"], float(self.next_down[a]), mc.delay_s,
                                                  ctx * self.kv_bytes_tok[m], float(self.pair_gbps[a, f]),
                                                  float(self.pair_rtt_ms[a, f]), ctx, 1.0 / self.inv_prefill[m, f])
                        mode = mv.mode
                    if mode == rules.TRANSFER:
                        r2 = self._attempt(m, f, ready + mv.seconds, out - out_done, dry, have_in=ctx_in)
                        kv_moved = mv.kv_bytes
                    elif mode == rules.RECOMPUTE:
                        r2 = self._attempt(m, f, ready, out - out_done, dry, extra_prefill=out_done)
                        recomputed = ctx
                    else:  # lost (the window missed) or resent: from scratch
                        r2 = self._attempt(m, f, ready, out, dry)
                        recomputed = ctx
                        missed = mode == rules.LOST
                else:  # no notice: it restarts from scratch once the router has noticed
                    mode = "restart"
                    restart = r1["end"] + self.cfg.retry_overhead_ms / 1000.0
                    r2 = self._attempt(m, f, restart, out, dry)
                    recomputed = ctx
                cached = r2["cached"]
                cost += self.cost_rate[m, f] * r2["ran"]
                latency = self.c_rtt[f] + 1000.0 * (r2["end"] - t) + waited
                if not np.isfinite(ttft):
                    ttft = self.c_rtt[f] + 1000.0 * (r2["first"] - t) + waited
                if not dry:  # the router learns of the retry when the preemption happens
                    self._push(r1["end"], _ADMIT, (m, f, self.C[SERVICE, f], r2["end"], self.r_key, out, self._pos))
        if not dry and self.budget is not None and self.budget.buckets_of[self._pos]:
            # the tenant's budget: the expected cost reserved now, what it really used when it ends
            end = r1["end"] if failed or migrated_to is None else r2["end"]
            periods = self.budget.admit(self._pos, self.r_in + self.r_max_out, float(self.C[COST, a]))
            self._push(end, _SETTLE, (self._pos, periods, float(self.C[COST, a]),
                                      self.r_in + (0.0 if failed else out), float(cost)))
        mig = {"migration": mode, "tokens_recomputed": float(recomputed), "kv_bytes_moved": float(kv_moved),
               "missed_window": missed}
        if preempted and not dry:
            self.stats["migrations"] += mode is not None and mode != "restart"
            self.stats["missed_window"] += missed
            self.stats["tokens_recomputed"] += recomputed
            self.stats["kv_bytes_moved"] += kv_moved
        if failed:
            self.stats["failed"] += not dry
            reward = self._reward(cost, ref_cost, 0.0, budget, True, True)
            return {"reward": float(reward), "offering": a, "cost_usd": float(cost), "latency_ms": np.nan,
                    "ttft_ms": np.nan, "tpot_ms": np.nan, "sla_violation": True, "failed": True, "preempted": True,
                    "migrated_to": None, "prompt_tokens": prompt, "cached_tokens": 0.0, "refused": None, **mig}
        tpot, viol = self.slo_missed(ttft, latency, out, self.r_ttft, self.r_tpot, dl)
        reward = self._reward(cost, ref_cost, latency, budget, viol, False)
        return {"reward": float(reward), "offering": a, "cost_usd": float(cost), "latency_ms": float(latency),
                "ttft_ms": float(ttft), "tpot_ms": float(tpot), "sla_violation": viol, "failed": False,
                "preempted": preempted, "migrated_to": migrated_to, "prompt_tokens": prompt,
                "cached_tokens": float(cached) if prompt else 0.0, "refused": None, **mig}

    def _admission_info(self) -> dict[str, Any]:
        """What the admission did to the current request, for its step's ``info`` -- only when it acted
        (a request admitted at its arrival adds nothing): ``admission`` (``queued`` -- admitted after
        waiting in the router's queue -- or ``shed``), ``queue_wait_ms``, its ``band`` and ``tenant``.
        (``xroute evaluate``'s per-band, per-tenant report reads the rest by the request's position.)"""
        v, i = self.r_admission, self._pos
        return {"admission": "queued" if v == ar.ADMIT else v, "queue_wait_ms": self.r_waited_ms,
                "band": ar.BANDS[int(self.req_band[i])], "tenant": self.req_tenant[i]}

    # ------------------------------------------------------------------ live routing (the router)
    def observe_live(self, t: float, origin: str, input_tokens: int, max_output_tokens: int, ttft_ms: float,
                     tpot_ms: float, deadline_ms: float | None = None, model: str | None = None, tenant: str = "",
                     request_id: Any = None, request_class: str | None = None,
                     prefix: tuple[np.ndarray, np.ndarray, int, int] | None = None,
                     budget: LiveBudget | None = None
                     ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Make a live request (not from the stream) the current one, at telemetry time ``t``
        (seconds since the epoch), and return its observation — the same features the agent was
        trained on. ``origin`` must be a location id with RTT to every offering (``self.origins``)."""
        self.set_live(t, origin, input_tokens, max_output_tokens, ttft_ms, tpot_ms, deadline_ms, model, tenant,
                      request_id, request_class, prefix, budget=budget)
        return self._obs(), self._info()

    def set_live(self, t: float, origin: str, input_tokens: int, max_output_tokens: int, ttft_ms: float,
                 tpot_ms: float, deadline_ms: float | None = None, model: str | None = None, tenant: str = "",
                 request_id: Any = None, request_class: str | None = None,
                 prefix: tuple[np.ndarray, np.ndarray, int, int] | None = None, pre: np.ndarray | None = None,
                 budget: LiveBudget | None = None) -> np.ndarray:
        """:meth:`observe_live` without building the observation: makes the live request current
        (its expectations, as ``observe_live``) and returns its action mask over the ``n``
        offerings (``c_mask``; read-only, overwritten by the next request). Raises ``KeyError`` for
        an unknown origin, ``ValueError`` for an unknown model. ``prefix``: what the router's shared
        prefix index says of the request's prompt (``router.state.base``): per offering, the leading
        blocks it expects there (int64) and the pool's retention (float), the offering its session
        last went to (-1: none) and the block size in tokens. ``budget``: its tenant's budget as
        the router's quota state has it (``envs.budget``: the features, and the offerings it cannot
        afford masked); None = no budget."""
        if origin not in self.origin_index:
            raise KeyError(origin)
        m = self.default_model if model is None else self.model_index.get(model, -1)
        if m < 0:
            raise ValueError(model)
        if not hasattr(self, "free_at"):
            self.reset(seed=0)
        ctx = None if self.policies is None else self.policy_context(
            tenant, m, request_class, float(ttft_ms), float(tpot_ms), deadline_ms, origin)
        self._set_request(t, self.origin_index[origin], input_tokens, max_output_tokens, ttft_ms, tpot_ms,
                          np.nan if deadline_ms is None else float(deadline_ms), m, self.estimator_key(m, tenant),
                          request_id, 0.0, ctx, pre, live_prefix=prefix,
                          budget=NO_BUDGET if budget is None else budget)
        return self.c_mask

    def commit_live(self, a: int) -> dict[str, float]:
        """Record that the current live request was sent to offering ``a``: the router's view
        holds a slot there for its expected service time, so later decisions see the load. Returns
        the expectations."""
        if not self.c_mask[a]:
            raise ValueError(f"offering {a} is not valid now")
        m = self.r_m
        j, end, shift0 = kernels.view_admit(self.est_free[m], self.est_min[m], self.inflight[m], self.shift[m], a,
                                            self.t, self.C[SERVICE, a])
        self.admitted_live(a, j, end, shift0)
        return {"expected_latency_ms": float(self.C[LAT, a]), "expected_cost_usd": float(self.C[COST, a])}

    def admitted_live(self, a: int, j: int, end: float, shift0: float) -> None:
        """:meth:`commit_live` for a caller that already took the slot in its own compiled pass
        (``kernels.view_admit`` on the current model's ``est_free``/``est_min``/``inflight``/
        ``shift``): with no completion feedback yet, the request is taken to complete when
        expected."""
        self._push(end, _COMPLETE, (self.r_m, a, j, end, shift0, self.r_key, -1.0, -1, -1.0))

    def admit_live(self, m: int, a: int, t: float, service: float, ref: Any) -> float:
        """A live router sent a request (its reference ``ref``, e.g. the decision id) of model
        ``m`` to offering ``a`` at telemetry time ``t``, expected to take ``service`` seconds: its
        view holds the slot expected to free first until the request's expected end (returned), or
        until :meth:`complete_live` learns it ended before. Unlike :meth:`commit_live`, it reads
        nothing of the current request, so it may come after other requests were made current."""
        j, end, shift0 = kernels.view_admit(self.est_free[m], self.est_min[m], self.inflight[m], self.shift[m], a, t,
                                            service)
        self._live[ref] = (m, a, j, end, shift0)
        self._push(end, _LIVE_END, (ref,))
        return float(end)

    def complete_live(self, ref: Any, now: float) -> bool:
        """A live request admitted by :meth:`admit_live` ended at telemetry time ``now`` (feedback
        came, or its answer was never sent): everything expected after it on its slot moves by the
        error, as when the simulation observes a completion. False when its view entry is gone
        already (its expected end passed, or it was completed)."""
        live = self._live.pop(ref, None)
        if live is None:
            return False
        m, a, j, exp_end, shift0 = live
        kernels.view_complete(self.est_free[m], self.est_min[m], self.inflight[m], self.shift[m], a, j, now, exp_end,
                              shift0)
        if self.completion_listener is not None:
            self.completion_listener(ref, now, exp_end)
        return True

    def shift_live_clock(self, dt: float) -> None:
        """A live router's telemetry clock jumped by ``dt`` seconds (a replay wrap goes back by the
        recorded window): the view moves with it -- every expected slot release, pending completion
        and recent arrival -- so the work in flight stays in flight; telemetry-derived state
        (prices, availability, the passive health check) is recomputed at the next request."""
        for arr in (self.est_free, self.est_min, self.free_at, self.tmin):
            arr += dt  # +-inf (padding, never used) stay what they are
        # (a completion's own expected end moves too: view_complete reads its error against it)
        self._events = [(t + dt, seq, kind, (*d[:3], d[3] + dt, *d[4:]) if kind == _COMPLETE else d)
                        for t, seq, kind, d in self._events]
        heapq.heapify(self._events)
        self._tevents = [(t + dt, m, a, j) for t, m, a, j in self._tevents]
        heapq.heapify(self._tevents)
        self._live = {ref: (m, a, j, end + dt, s0) for ref, (m, a, j, end, s0) in self._live.items()}
        self._recent = deque(x + dt for x in self._recent)
        times = self.pv_ent[:, 3::3]
        times[times != np.iinfo(np.int64).min] += px.us(dt)
        self.ps_time += dt
        self.seen_down_at[:] = -np.inf
        self._refresh_at = -np.inf
        self._next_event = -np.inf
        if hasattr(self, "t"):
            self.t += dt

    def live_pools(self, t: float, model: int) -> dict[str, np.ndarray]:
        """A live router's listing of every offering's pool of ``model`` (an index into
        ``model_names``) at telemetry time ``t``, from what it knows: the view learns what happened
        up to ``t`` (as when a request is made current; nothing else changes). Arrays over the
        ``n`` offerings: ``usd_per_hour`` (one instance, NaN where unpriced), ``available`` (the
        telemetry, less the pools the router saw preempt its own requests), ``external_util``,
        ``slots``, ``busy`` (its requests in flight, at most the slots), ``next_free_in_s`` (until
        the first expected slot release, 0 when one is free) and ``valid`` (available, priced,
        with slots, a slot expected within ``queue_timeout_s``, and room for one more instance under
        its cloud quotas: ``envs.capacity``)."""
        self._advance(t)
        snap = self.replay.snapshot(t, self.cfg.risk_lookback_h * 3600.0)
        price_h = snap["price"]
        available = (snap["available"] > 0.5) & ~(self.seen_down_at > self.replay.avail.last_times(t))
        nxt = np.maximum(self.est_min[model] - t, 0.0)
        slots = (self.replicas_at(t)[model] * self.conc[model]).astype(np.int64)
        valid = available & (slots > 0) & np.isfinite(price_h) & (nxt <= self.cfg.queue_timeout_s)
        if self.capacity.active:  # no room for one more instance under a cloud quota
            valid &= ~self.capacity.blocked(t)
        return {"usd_per_hour": price_h * self.gpu_count, "available": available, "external_util": snap["util"],
                "slots": slots, "busy": np.minimum(self.inflight[model], slots), "next_free_in_s": nxt, "valid": valid}

    def outcome_reward(self, input_tokens: float, output_tokens: float, ttft_ms: float, tpot_ms: float,
                       deadline_ms: float | None, cost_usd: float, observed_latency_ms: float | None,
                       observed_ttft_ms: float | None, failed: bool) -> tuple[float, bool]:
        """The reward (``envs.kernels.realized_reward``, with this environment's weights) and
        whether the SLO was missed, of an outcome a live router was told of (feedback): a request
        of ``input_tokens`` with the SLO ``ttft_ms``/``tpot_ms``/``deadline_ms`` that produced
        ``output_tokens`` at ``cost_usd``, its first token after ``observed_ttft_ms`` and its end
        after ``observed_latency_ms`` -- the reference cost, the latency budget and the SLO check
        exactly as the simulation computes them for a simulated outcome. A ``failed`` request is
        charged as the simulation charges one (its latencies are not read)."""
        out = float(output_tokens)
        dl = np.nan if deadline_ms is None else float(deadline_ms)
        ref_cost = self.reference_cost(float(input_tokens), out)
        budget = self.latency_budget(float(ttft_ms), float(tpot_ms), dl, out)
        if failed:
            return self._reward(float(cost_usd), ref_cost, 0.0, budget, True, True), True
        if observed_latency_ms is None or observed_ttft_ms is None:
            raise ValueError("a completed request's reward needs its observed latency and TTFT")
        latency, ttft = float(observed_latency_ms), float(observed_ttft_ms)
        _, viol = self.slo_missed(ttft, latency, out, float(ttft_ms), float(tpot_ms), dl)
        return self._reward(float(cost_usd), ref_cost, latency, budget, viol, False), viol

    def observe_output(self, model: str | None, tenant: str, output_tokens: int) -> None:
        """A completed request's output length (the router's feedback) for the estimator."""
        m = self.default_model if model is None else self.model_index[model]
        self._observe_output(m, self.estimator_key(m, tenant), float(output_tokens))

    # ------------------------------------------------------------------ for baselines and the oracle
    def expected_rewards(self) -> np.ndarray:
        """One-step expected reward of each offering (``envs.kernels.expected_reward``) from what
        the router knows: expected cost and latency, P(SLO miss), the spot-preemption risk."""
        rw = self.cfg.reward
        return kernels.expected_rewards(self.C, self.c_mask, self.r_ref_cost, self.r_budget, self.cfg.retry_overhead_ms,
                                        rw.cost_weight, rw.latency_weight, rw.sla_penalty, rw.cost_norm_cap,
                                        rw.latency_norm_cap)

    def exact_rewards(self) -> np.ndarray:
        """HINDSIGHT, for the oracle only: the reward each offering would really get for the
        current request (it knows the realized output, the noise draw, the true queues and future
        preemptions). Leaves the environment unchanged."""
        rw, m = self.cfg.reward, self.r_m
        out = float(self.req_out[self._pos])
        ref_cost = self.reference_cost(self.r_in, out)
        dl = self.r_deadline
        budget = self.latency_budget(self.r_ttft, self.r_tpot, dl, out)
        r, end = kernels.exact_outcomes(
            self.tmin[m], self.tbusy[m], self.inv_replicas[m], self.conc_m1[m], self.ext_util_conc[m],
            self.inv_prefill[m], self.tpot_s[m], self.tpot_growth_s[m], self.sigma[m], self.c_rtt, self.cost_rate[m],
            self.c_mask, self.t, self.r_in, out, self.r_z, self.r_ttft, self.r_tpot, dl, ref_cost, budget,
            rw.cost_weight, rw.latency_weight, rw.sla_penalty, rw.cost_norm_cap, rw.latency_norm_cap,
            self.true_cached())
        # requests a preemption would interrupt take the full path (retry elsewhere)
        hit = self.c_mask & (self.cut_at < end)
        for a in np.flatnonzero(hit):
            r[a] = self._resolve(int(a), dry=True)["reward"]
        return r

    def offering_index(self, offering_id: str) -> int:
        for k, o in enumerate(self.catalog):
            if o.offering_id == offering_id:
                return k
        raise KeyError(offering_id)
