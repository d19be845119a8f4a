"""The decision path: request -> live features -> constraint mask -> policy -> ranked offerings ->
(the shared state reserves one) -> admitted.

Features are the environment's own (``CloudRouteEnv.observe_live``), so the policy sees exactly
what it was trained on. The router's view of each pool's load is the environment's pool model fed
with this process's own decisions (``admit``: each holds a slot for its expected service time,
until its expected end or until feedback says it ended), plus the work the shared state
(``router.state.base``) holds there that is not this process's own -- other workers' and hosts', or
this process's before a restart (``apply_shared_view``). Everything here is synchronous and runs
on the event-loop thread; ranking (:meth:`RoutingEngine.rank`) and admitting
(:meth:`RoutingEngine.admit`) are separate so that a reservation on a shared server can be awaited
between them.
"""

from __future__ import annotations

import difflib
import heapq
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np

from envs import admission as admission_kernels
from envs import kernels as env_kernels
from envs import policies as env_policies
from envs.cloud_route import CloudRouteEnv
from envs.features import N_OFFERING_FEATURES
from models.baselines import make_baseline
from models.policy import RewardPrior
from router.core.logs import iso, json_str
from router.core.settings import RouterSettings
from router.core.startup import CLOCK
from router.decision import kernels, ope_log
from router.decision.access import AccessControl
from router.decision.canary import CanaryArms
from router.decision.ejections import POOL, EjectionView
from router.decision.model_slot import ActivePolicy, PolicySlot
from router.decision.quotas import QuotaPlan, QuotaView, quota_failure
from router.decision.stages import EXPLAIN, ROUTE, RULES, Decision, RouteFailure, Stage, Unattainable, _num
from router.decision.telemetry import Freshness, LiveSource, ReplaySource, TelemetrySource
from router.decision.watchdog import Watchdog
from router.state.base import Affinity, PrefixSend, hold_for, pool_key
from router.state.ledger import QuotaUsage
from router.store.rows import DecisionRow
from xroute.admission_rules import DEFAULT_BAND
from xroute.config import EnvConfig, EvaluateConfig, parse_config
from xroute.errors import ConfigError
from xroute.schema.access import Principal
from xroute.schema.decision import FeedbackRequest, RouteRequest
from xroute.schema.policy_ir import (
    CatalogIndex,
    CompiledConstraints,
    ConstraintError,
    Constraints,
    PolicyCatalog,
    PolicySet,
    check_policy_set,
    compile_constraints,
)
from xroute.schema.quota import QuotaBucket

#: how a committed migration marks a session's entry in the shared state (``sess:<tenant>:<session>``,
#: ``router.service.migration``): the target's pool key, then this suffix. The session's next decision goes
#: to that offering when it may and can take it (:meth:`RoutingEngine.rank`); that decision writes
#: the entry anew, unmarked, so the mark holds for one turn. (0x1f: no pool key holds it.)
MIGRATED_MARK = "\x1fmigrated"


def migrated_entry(pool_key: str) -> bytes:
    """The session entry a committed migration to ``pool_key`` writes."""
    return (pool_key + MIGRATED_MARK).encode()


def session_entry(value: str) -> tuple[str, bool]:
    """A session entry as stored: (the pool key, whether a committed migration put it there)."""
    if value.endswith(MIGRATED_MARK):
        return value[: -len(MIGRATED_MARK)], True
    return value, False


def env_config(settings: RouterSettings) -> EnvConfig:
    """The environment config the router serves with: the evaluate defaults with the settings'
    ``env`` overrides, every request one step (no episodes). The simulation's own spot notices are
    off: a live router learns of interruptions from ``POST /v1/events`` (``router.service.migration``),
    which applies the same rules (``xroute.migration_rules``)."""
    mig = settings.env.get("migration") if isinstance(settings.env, dict) else None
    migration = {**(mig if isinstance(mig, dict) else {}), "notice": False}
    return parse_config(EnvConfig, {**settings.env, "episode_requests": None, "migration": migration},
                        "router settings: field 'env'")


@dataclass(slots=True)
class Ranked:
    """A request ranked but not yet admitted (:meth:`RoutingEngine.rank`, then
    :meth:`~RoutingEngine.admit` once the shared state reserved one of ``cands``): what the answer
    and the log row need, copied out of the environment, so other requests may be ranked before
    this one is admitted."""

    req: RouteRequest
    who: Principal
    decision_id: str
    wall: float
    t: float
    age: float
    m: int
    pinfo: dict[str, Any]
    score_kind: str
    ccounts: dict[str, int]
    ctext: str
    n_valid: int
    n_not_preferred: int
    env_counts: list[int]
    #: offerings, the chosen one first, then the alternatives
    cands: list[int]
    #: (score, expected latency ms, expected cost USD) of each candidate
    nums: list[float]
    #: each candidate's expected service time, seconds
    service: list[float]
    bundle_hash: str
    request_json: str | None = None
    #: the tenant's exploration probability
    epsilon: float = 0.0
    #: what the decision log keeps for off-policy evaluation (``log_features``): the record
    #: (``router.decision.ope_log.pack``; its served offering the first candidate), the action set's size
    #: and the position in it of the first candidate and of the policy's choice
    ope: tuple[bytes, int, int, int] | None = None
    #: the routing policies' part of the answer (``"policies":{...}``, JSON)
    ptext: str = "{}"
    #: the routing policies' exclusion counts (their compiled set, a copy of the counts by rank),
    #: made a dictionary only when an error needs it (:meth:`RoutingEngine._all_counts`)
    pcounts: tuple[Any, np.ndarray] | None = None
    #: what the prefix index records on the pool the reservation takes (``router.state.base.PrefixSend``;
    #: None: the request carried no prefix hashes and no session)
    prefix: PrefixSend | None = None
    #: the first candidate is the session's committed migration target, put before the policy's
    #: choice (:meth:`RoutingEngine.rank`): its propensity is unknown to off-policy evaluation
    pinned: bool = False
    #: the canary running when it was ranked (``router.decision.canary.CanaryArms``; None: none) and
    #: whether its arm decided (True) or the stable set did
    canary: Any = None
    arm: bool = False
    #: greedy's choice beside the policy's (the ``watchdog`` stage; -1: not known)
    greedy: int = -1


class RoutingEngine:
    """Owns the live environment, the constraint compiler and the policy slot."""

    def __init__(self, settings: RouterSettings, source: TelemetrySource | None = None):
        self.settings = settings
        env_kernels.warm_up()  # compiled (or loaded from numba's cache) now, not on the first request
        kernels.warm_up()
        admission_kernels.warm_up()
        CLOCK.mark("kernels")
        if source is None:
            if settings.telemetry_live:
                assert settings.telemetry is not None  # RouterSettings checks it
                source = LiveSource(settings.telemetry)
            else:
                source = ReplaySource(settings.telemetry, settings.replay_speed, settings.replay_offset_s)
        self.source = source
        bundle = self.source.bundle()
        self.bundle_hash = bundle.content_hash
        CLOCK.mark("telemetry")
        if "policies" in settings.env:
            raise ConfigError("router settings: field 'env.policies': a router's routing policies come from its "
                              "policy store (policy_files, the admin API: docs/policies.md), not the env config")
        env_cfg = env_config(settings)
        self.env = env = CloudRouteEnv(bundle, env_cfg, all_models=True)
        env.reset(seed=0)
        CLOCK.mark("environment")
        self._init_catalog(env)
        self._init_tenants(settings)
        self._check_servers(settings)
        self._init_slot(settings, env_cfg)
        #: the champion's watchdog (``router.decision.watchdog``; the ``watchdog`` stage reads it)
        self.watchdog = Watchdog(settings.watchdog, self.offering_ids, self.catalog_key,
                                 RewardPrior.from_env_config(env_cfg), settings.log_features)
        self.watchdog.attach(env)
        self._init_answers(env_cfg)
        self._init_buffers(settings)
        CLOCK.mark("engine")

    def _init_catalog(self, env: CloudRouteEnv) -> None:
        """The catalog, origins and models the environment serves, the pool-event masks."""
        self.generation = 0
        self.n, self.N = env.n, env.N
        self.catalog = env.catalog
        self.refs: list[dict[str, str]] = [
            {"offering_id": o.offering_id, "provider": o.provider, "region": o.region, "location": o.location,
             "instance_type": o.instance_type, "pricing_mode": o.pricing_mode, "accelerator": o.accelerator}
            for o in self.catalog]
        self.offering_ids = [o.offering_id for o in self.catalog]
        #: the key the decision log keeps this catalog's offering ids under (``router.decision.ope_log``)
        self.catalog_key = ope_log.catalog_key(self.offering_ids)
        self._catalog_key = bytes.fromhex(self.catalog_key)
        self.origins: list[str] = list(env.origins)
        self.origin_set = frozenset(self.origins)
        self.models: list[str] = [env.model_names[env.default_model]] + [
            m for k, m in enumerate(env.model_names) if k != env.default_model]
        self.index = CatalogIndex(self.catalog)
        #: pool events (``router.service.migration``): the offerings new decisions may use (None: all), and the
        #: bias (reward units) on offerings of a just-preempted region (None: none)
        self.events_keep: np.ndarray | None = None
        self.events_bias: np.ndarray | None = None

    def _init_tenants(self, settings: RouterSettings) -> None:
        """The declared tenants, their constraints (compiled once to check them), the routing
        policies (none until the store's version is installed), exploration, access control."""
        #: the declared tenants (``tenants:``); a key of another is refused unless ``undeclared_tenants: allow``
        self.tenant_names = frozenset(settings.tenants)
        self.open_tenants = settings.undeclared_tenants == "allow"
        #: what a policy's values are checked against when written (``check_policies``)
        self.policy_catalog = PolicyCatalog(self.catalog, self.models, self.origins)
        self.policies = env_policies.CompiledPolicies(PolicySet(), self.catalog)
        self._policies_head = '{"version":0,"arm":"stable","canary":null,'
        #: the canary rollout in force (``router.decision.canary``; None: none -- the stable set decides all)
        self.canary: CanaryArms | None = None
        #: tallies of canaries that ended or changed, not yet written to the store (``drain_tallies``)
        self._retired: list[tuple[str, str, str, str, int]] = []
        self.install_policies(self.policies)
        self.tenants: dict[str, Constraints] = {}
        #: exploring tenants' probabilities (``tenants.<name>.explore_epsilon`` > 0)
        self.epsilon = {name: t.explore_epsilon for name, t in settings.tenants.items() if t.explore_epsilon > 0}
        self.log_features = settings.log_features
        for name, t in settings.tenants.items():
            try:
                compile_constraints([(f"tenants.{name}.constraints", t.constraints)], self.index)
            except ConstraintError as e:
                raise ConfigError(f"router settings: {e}") from None
            self.tenants[name] = t.constraints
        #: admission (``router.decision.stages.Predict``, ``router.service.admission_queue``): on or off,
        #: the tenants' default bands and fairness weights
        self.admission_on = settings.admission.enabled
        self.bands = {name: t.priority for name, t in settings.tenants.items() if t.priority is not None}
        self.weights = {name: t.weight for name, t in settings.tenants.items()}
        #: who may do what (``router.decision.access``): the built-in roles until the access store's version is
        #: installed (``router.control.access_store.AccessSync``)
        self.access = AccessControl({}, {}, self.refs)
        #: (constraints, permission mask) -> the two combined, their counts (``rank``)
        self._masked: dict[tuple[int, int], tuple[Any, ...]] = {}

    def _check_servers(self, settings: RouterSettings) -> None:
        """The inference servers the settings name exist in the catalog (an error naming the field)."""
        for i, server in enumerate(settings.inference_servers):
            where = f"router settings: field 'inference_servers[{i}]"
            if server.offering_id not in self.offering_ids:
                close = difflib.get_close_matches(server.offering_id, self.offering_ids, n=3, cutoff=0.4)
                raise ConfigError(f"{where}.offering_id': unknown offering '{server.offering_id}'"
                                  + (f" (did you mean {', '.join(close)}?)" if close else ""))
            if server.model is not None and server.model not in self.env.model_index:
                raise ConfigError(f"{where}.model': unknown model '{server.model}' (known: {', '.join(self.models)})")

    def _init_slot(self, settings: RouterSettings, env_cfg: EnvConfig) -> None:
        """The constraint cache, the quota plan, the freshness clock and the model slot with its fallback."""
        self._compiled: OrderedDict[tuple[str, str], tuple[CompiledConstraints, dict[str, int], bool, str]] = OrderedDict()
        #: the tenants' quotas as buckets (``router.decision.quotas``); what a decision reads of them -- the
        #: embedded state's counters, or the shared view (``quota_view``) -- is set by the app
        self.quota_plan = QuotaPlan(settings.tenants, self.models)
        self.quota_usage: Callable[[Sequence[str]], dict[str, QuotaUsage]] | None = None
        self.quota_view = QuotaView()
        self.freshness = Freshness(time.time())
        self.max_age = settings.max_telemetry_age_s
        self.k_alt = settings.alternatives
        try:
            fb = make_baseline(settings.fallback_policy, EvaluateConfig(env=env_cfg))
            fb.reset(self.env, 0)
        except ConfigError as e:
            raise ConfigError(f"router settings: field 'fallback_policy': {e}") from None
        self.slot = PolicySlot(ActivePolicy.make(fb, fb.name, "fallback"), settings.model_uri)
        self.slot._fallback_stale["reason"] = f"telemetry stale (older than {self.max_age:g} s)"
        self.clock = self.source.describe_clock()
        self.source_name = self.source.name
        self.decisions = 0

    def _init_answers(self, env_cfg: EnvConfig) -> None:
        """The answer's pre-serialized pieces and the reward's constants the compiled paths take."""
        # the response is assembled from pre-serialized pieces: json.dumps of the whole nested
        # answer was a fifth of a decision's cost. Its expectations and scores carry 9 significant
        # digits (estimates, far coarser than that; the decision log's columns keep every bit):
        # float repr, 17 digits, cost ~0.3 us a number and an answer has 16
        self.ref_json = [_dumps(r) for r in self.refs]
        self._alt_head = [f'{{"offering":{r},"score":' for r in self.ref_json]
        self._tele_head = f'{{"source":{_dumps(self.source_name)},"clock":{_dumps(self.clock)},"telemetry_time":"'
        self._policy_json: dict[int, tuple[dict[str, Any], str]] = {}
        self._static_key: tuple[int, int, int] | None = None
        self._quota_only = np.zeros(self.n, dtype=bool)
        self._static_code = np.zeros(self.n, dtype=np.int64)
        rw = env_cfg.reward
        self._reward_args = (float(self.env.cfg.retry_overhead_ms), float(rw.cost_weight), float(rw.latency_weight),
                             float(rw.sla_penalty), float(rw.cost_norm_cap), float(rw.latency_norm_cap))

    def _init_buffers(self, settings: RouterSettings) -> None:
        """The compiled paths' buffers, the pool keys, this process's own reservations, the
        prefix caches' capacities and the stages."""
        env = self.env
        #: the greedy policy in one compiled call (``decide``); False sends it through ``_choose``
        #: like every other policy (the same answers: the tests compare the two)
        self.fused_greedy = True
        #: a learned scorer's inputs and choice in two compiled calls around it (``decide``); False
        #: sends it through ``_choose`` (the same answers: the tests compare the two)
        self.fused_learned = True
        # the compiled decisions' outputs (ints, floats: router.decision.kernels.greedy_decide documents them)
        self._out = (np.zeros(8 + self.k_alt, dtype=np.int64), np.zeros(5 + 3 * self.k_alt))
        self._rows = np.zeros((self.n, N_OFFERING_FEATURES), dtype=np.float32)  # the scorer's input rows
        self._idx = np.zeros(self.n, dtype=np.int64)
        self._ints_log = np.zeros(7, dtype=np.int64)  # ``valid_rows``' counts when only the log needs its rows
        # the shared state's keys of the pools, [model][offering] (``router.state.base.pool_key``), and back
        self.pool_keys = [[pool_key(mn, o) for o in self.offering_ids] for mn in env.model_names]
        self.pool_index = {k: (m, a) for m, row in enumerate(self.pool_keys) for a, k in enumerate(row)}
        self._slots_src: np.ndarray | None = None  # (``_slots_list``'s source array)
        self._slots_cache: list[list[int]] = []
        #: reservations this process made and still holds (``admit`` with a hold; released by
        #: ``release_local``, or when their hold passes), per pool and by id; the shared view's
        #: in-flight work beyond these is other routers' (``apply_shared_view``)
        self.own_held = np.zeros((env.M, self.n), dtype=np.int64)
        #: the ejected pools and servers (``router.decision.ejections``; the shared view's loop keeps it)
        self.ejection = EjectionView(self.pool_index, (env.M, self.n))
        self._own: dict[str, tuple[int, int, float]] = {}
        self._own_due: list[tuple[float, str]] = []
        #: telemetry seconds per wall second (a replay's speed; 1 live)
        self._speed = 1.0 if settings.telemetry_live else settings.replay_speed
        #: prefix affinity (``router.state.base``): the block size clients hash with, and each pool's prefix
        #: cache in blocks -- its replicas' KV memory (``envs.serving``) / the block size
        self.block_tokens = settings.prefix_block_tokens
        self.prefix_ttl_s = settings.prefix_ttl_s
        kv = np.where(env.fits, np.floor(env.placement.kv_tokens / self.block_tokens), 0) * np.floor(env.replicas)
        self._cap_blocks: list[list[int]] = kv.astype(np.int64).tolist()
        #: the decision's stages (``router.decision.stages``): a route's, an explanation's, the rules'
        self.route_stages: list[Stage] = [stage(self) for stage in ROUTE]
        self.explain_stages: list[Stage] = [stage(self) for stage in EXPLAIN]
        self.rule_stages: list[Stage] = [stage(self) for stage in RULES]
        #: (stage name, seconds) of a timed route (``run_stages``; the app sets the metrics' histogram),
        #: every ``stage_timing_every``-th route
        self.stage_timer: Callable[[str, float], None] | None = None
        self.stage_timing_every = 1
        self._stage_runs = 0

    @property
    def _slots_list(self) -> list[list[int]]:
        """The pools' slots now, as lists: ``env.slots`` follows the inventory (``CloudRouteEnv``
        replaces the array when a pool's size changes), so the lists are rebuilt when it is a new one."""
        s = self.env.slots
        if s is not self._slots_src:
            self._slots_src, self._slots_cache = s, s.astype(int).tolist()
        return self._slots_cache

    def response_dictionary(self) -> bytes:
        """A preset dictionary for compressing this engine's answers in the decision log
        (``DecisionStore.use_dictionary``): the pieces every answer repeats, most common last."""
        keys = ('"alternatives":[{"offering":"score":"expected_latency_ms":"expected_cost_usd":"decision_id":"d_'
                '"created_at":"tenant":"session_id":null,"score_kind":"q_value""expected_reward""excluded":{"total":'
                '"by_reason":{"unavailable":"queue_full":"not_preferred":"tenant:"request:"policy:"}],"policy":'
                '"policies":{"version":"arm":"stable","canary":null,"request_class":"biased":{')
        fallback = self._policy_text(self.slot.fallback.info)
        return (keys + "".join(self.ref_json) + fallback + self._tele_head).encode()

    def prepare_telemetry(self, bundle: Any) -> dict[str, Any]:
        """New telemetry from the source, made ready off the event loop (``apply_telemetry``
        swaps it in); raises ``ConfigError`` when the catalog changed."""
        return self.env.prepare_telemetry(bundle)

    def apply_telemetry(self, prepared: dict[str, Any]) -> None:
        """On the event loop, between two decisions: the env's tables, origins and the bundle hash
        the decision log records."""
        self.env.apply_telemetry(prepared)
        self.bundle_hash = prepared["bundle"].content_hash
        self.origins = list(self.env.origins)
        self.origin_set = frozenset(self.origins)
        self.policy_catalog = PolicyCatalog(self.catalog, self.models, self.origins)
        self._static_key = None

    def servable_models(self) -> list[str]:
        """The models some offering holds replicas of (the others are known but answered 422
        ``model_unavailable`` whatever the constraints), in :attr:`models`' order."""
        env = self.env
        held = {env.model_names[m] for m in range(len(env.model_names))
                if (env.fits[m] & (env.slots_alloc[m] > 0)).any()}
        return [m for m in self.models if m in held]

    # ------------------------------------------------------------------ routing policies
    def compile_policies(self, ps: PolicySet) -> env_policies.CompiledPolicies:
        """``ps`` compiled against this catalog (no state touched: safe off the event loop)."""
        return env_policies.CompiledPolicies(ps, self.catalog)

    def compile_canary(self, ps: PolicySet) -> CanaryArms | None:
        """The canary of the store's set ``ps`` compiled for this catalog (None: ``ps`` holds none);
        off the event loop, as :meth:`compile_policies`."""
        if ps.canary is None:
            return None
        return CanaryArms(ps.canary, env_policies.CompiledPolicies(ps.canary.policy_set, self.catalog), ps.version)

    def install_policies(self, compiled: env_policies.CompiledPolicies, canary: CanaryArms | None = None) -> None:
        """Swap a compiled policy set -- and its canary, if any (:meth:`compile_canary`) -- in,
        between two decisions (on the event loop): the next decision sees the whole new version,
        none sees a mix. A canary's counts not yet written carry over to the next version of the
        same canary, or wait for :meth:`drain_tallies`."""
        self.env.set_policies(compiled)
        self._stable_buffers = self.env.r_policy
        self.policies = compiled
        self._policies_head = f'{{"version":{compiled.version},"arm":"stable","canary":null,'
        old = self.canary
        if old is not None and old is not canary:
            if canary is not None and canary.id == old.id:
                canary.carry(old)
            else:
                self._retired += old.drain()
        self.canary = canary

    def drain_tallies(self) -> list[tuple[str, str, str, str, int]]:
        """What the canaries counted since the last drain (``CanaryArms.drain``'s rows), emptied."""
        rows, self._retired = self._retired, []
        if self.canary is not None:
            rows += self.canary.drain()
        return rows

    def use_arm(self, canary: bool) -> env_policies.CompiledPolicies:
        """Route the next request under the canary's set (True) or the stable one; returns it."""
        c = self.canary
        if canary and c is not None:
            self.env.use_policies(c.compiled, c.buffers)
            return c.compiled
        self.env.use_policies(self.policies, self._stable_buffers)
        return self.policies

    @property
    def policy_version(self) -> int:
        return self.policies.version

    def check_policies(self, ps: PolicySet, prefix: str = "") -> None:
        """Raise :class:`ConstraintError` (naming the field, with close matches) for a value of
        ``ps`` this router's catalog, models or origins lack."""
        check_policy_set(ps, self.policy_catalog, prefix)

    def prepare_tenants(self, tenants: Mapping[str, Any]) -> dict[str, Any]:
        """The tenants (name -> ``TenantConfig``: the settings' overlaid by the access store's)
        compiled for :meth:`install_tenants` -- off the event loop. Raises ``ConstraintError`` for
        constraints naming what the catalog lacks, ``ConfigError`` for a quota's unknown model."""
        constraints: dict[str, Constraints] = {}
        for name, t in tenants.items():
            compile_constraints([(f"tenants.{name}.constraints", t.constraints)], self.index)
            constraints[name] = t.constraints
        return {"names": frozenset(tenants), "constraints": constraints,
                "epsilon": {name: t.explore_epsilon for name, t in tenants.items() if t.explore_epsilon > 0},
                "plan": QuotaPlan(tenants, self.models)}

    def install_tenants(self, prepared: dict[str, Any]) -> None:
        """Swap the tenants in, between two decisions (on the event loop, no ``await`` between the
        assignments): a decision sees the old tenants or the new ones."""
        self.tenant_names = prepared["names"]
        self.tenants = prepared["constraints"]
        self.epsilon = prepared["epsilon"]
        self.quota_plan = prepared["plan"]
        self._compiled = OrderedDict()

    def install_access(self, access: AccessControl) -> None:
        self.access = access

    def tenant_known(self, tenant: str) -> bool:
        return tenant in self.tenant_names or self.open_tenants

    def unknown_tenant(self, tenant: str) -> RouteFailure:
        """The 403 for a key whose tenant this router does not serve (fail closed)."""
        return RouteFailure(403, "unknown_tenant", f"tenant '{tenant}' is not declared on this router: add it under "
                            "'tenants:' in the router config (docs/policies.md, \"Tenants\")",
                            [{"field": "tenant", "message": f"unknown tenant '{tenant}'", "suggestions": difflib.get_close_matches(
                                tenant, sorted(self.tenant_names), n=3, cutoff=0.6)}])

    def _policies_text(self, ctx: env_policies.PolicyContext | None, out: env_policies.PolicyOutcome,
                       pol: env_policies.CompiledPolicies | None = None, head: str | None = None) -> str:
        """The answer's ``policies`` object: the store's version in force, the arm that decided
        (``stable``, or ``canary``; with a canary running, its id, version, key and share), the
        request class and, when prefer policies applied, how many allowed offerings each raised
        (which policies applied is ``POST /v1/explain``'s: with tens of policies the list would
        double the answer). ``pol``/``head``: the arm's compiled set and head (default: stable)."""
        if head is None:
            head = self._policies_head
        if ctx is None:
            return head + '"request_class":null,"biased":{}}'
        cls = _dumps(ctx.request_class) if ctx.request_class else "null"
        text = f'{head}"request_class":{cls},"biased":{{'
        p = self.policies if pol is None else pol
        if ctx.has_prefer and not p.lexicographic:
            return text + p.biased_text(out) + "}}"
        return text + "}}"

    # ------------------------------------------------------------------ helpers
    def telemetry_info(self, t: float, wall: float) -> dict[str, Any]:
        age = self.freshness.age(wall)
        return {"source": self.source_name, "clock": self.clock, "telemetry_time": iso(t), "age_s": round(age, 3),
                "stale": age > self.max_age}

    def now(self, wall: float) -> float:
        """Telemetry time for ``wall``. On a replay wrap (telemetry time goes back by the recorded
        window) the pool-load view moves back with it (``CloudRouteEnv.shift_live_clock``): the
        work in flight stays in flight, the output-length estimator keeps what it learned."""
        t, gen = self.source.telemetry_time(wall)
        if gen != self.generation:
            dt = -float(getattr(self.source, "span", 0.0)) * (gen - self.generation)
            self.env.shift_live_clock(dt)
            if self.watchdog.twin is not None:
                self.watchdog.twin.shift_clock(dt)
            self.generation = gen
        return t

    def constraints_for(self, tenant: str, request: Constraints | None
                        ) -> tuple[CompiledConstraints, dict[str, int], bool, str]:
        """Compiled tenant + request constraints, their exclusion counts, whether they allow any
        offering, and the counts as the members of a JSON object (cached; at most 1024 distinct
        sets)."""
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
        hit = (compiled, counts, bool(compiled.allowed.any()), ",".join(f"{_dumps(k)}:{v}" for k, v in counts.items()))
        self._compiled[key] = hit
        if len(self._compiled) > 1024:
            self._compiled.popitem(last=False)
        return hit

    def _static_codes(self, model: int) -> np.ndarray:
        """Why the environment masks each offering for a request of ``model``, as
        ``router.decision.kernels.ENV_REASONS`` codes: the static reasons change only when the env refreshes
        its telemetry snapshot (new arrays), anything else is a full queue. ``no_capacity``: the
        pool holds no replica of the model (or the model does not fit on the offering)."""
        env = self.env
        key = (id(env.available), id(env.quota_blocked), model)
        if key != self._static_key:
            code = np.full(self.n, 3, dtype=np.int64)
            priced = np.isfinite(env.price_s)
            code[~priced] = 2
            holds = (env.slots[model] > 0) & env.fits[model]
            code[~holds] = 1
            # cloud quota (no room for one more instance): counted apart as ``quota`` (``_quota_counts``)
            code[env.quota_blocked & holds & priced] = 1
            code[~env.available] = 0
            self._quota_only = env.quota_blocked & holds & priced & env.available
            self._static_code, self._static_key = code, key
        return self._static_code

    def _quota_counts(self, env_counts: list[int], allowed: np.ndarray) -> list[int]:
        """The environment's exclusion counts (``router.decision.kernels.ENV_REASONS``) with the tenant
        budget's and the cloud quotas' own: ``quota`` (counted by the kernels as ``no_capacity``)
        and ``budget`` (an expected cost over the USD left; counted as ``queue_full``)."""
        env = self.env
        q = int((allowed & self._quota_only).sum()) if env.capacity.active else 0
        b = int((allowed & env.r_over).sum()) if env.r_over is not None else 0
        if q or b:
            return [env_counts[0], env_counts[1] - q, env_counts[2], env_counts[3] - b, q, b]
        return [*env_counts, 0, 0]

    def _policy_text(self, pinfo: dict[str, Any]) -> str:
        hit = self._policy_json.get(id(pinfo))
        if hit is None or hit[0] is not pinfo:
            if len(self._policy_json) > 64:
                self._policy_json.clear()
            hit = self._policy_json[id(pinfo)] = (pinfo, _dumps(pinfo))
        return hit[1]

    # ------------------------------------------------------------------ prefix affinity and sessions
    @staticmethod
    def wants_affinity(req: RouteRequest) -> bool:
        """Whether the request carries prefix hashes or a session (the shared index is asked)."""
        return req.prefix_hashes is not None or req.session_id is not None

    def check_prefix(self, req: RouteRequest) -> None:
        """A 422 naming ``body.prefix_hashes`` when the request carries more block hashes than its
        prompt has blocks (``ceil(input_tokens / prefix_block_tokens)``: hashed with another block size)."""
        h = req.prefix_hashes
        if h is None:
            return
        most = -(-req.input_tokens // self.block_tokens)
        if len(h) > most:
            msg = (f"{len(h)} block hashes for {req.input_tokens} input tokens: at most ceil(input_tokens / "
                   f"{self.block_tokens}) = {most} (prefix_block_tokens, GET /v1/offerings)")
            raise RouteFailure(422, "invalid_prefix", msg, [{"field": "body.prefix_hashes", "message": msg,
                                                              "suggestions": []}])

    @staticmethod
    def prefix_array(req: RouteRequest) -> np.ndarray:
        h = req.prefix_hashes
        return np.array(h, dtype=np.int64) if h else np.zeros(0, dtype=np.int64)

    @staticmethod
    def session_key(who: Principal, req: RouteRequest) -> str | None:
        """The shared state's key of the request's session (per tenant: two tenants' ids never meet)."""
        return None if req.session_id is None else f"{who.tenant}:{req.session_id}"

    def _live_prefix(self, m: int, affinity: Affinity) -> tuple[np.ndarray, np.ndarray, int, int]:
        """What the shared index said, as the environment takes it for model ``m`` (``set_live``):
        per offering the leading blocks expected cached and the pool's retention, the session's
        offering (-1: none), the block size."""
        n = self.n
        runs = np.zeros(n, dtype=np.int64)
        ret = np.ones(n)
        index = self.pool_index
        for pool, k in affinity.runs.items():
            ma = index.get(pool)
            if ma is not None and ma[0] == m:
                runs[ma[1]] = k
                ret[ma[1]] = affinity.retention.get(pool, 1.0)
        sess = -1
        if affinity.session_pool is not None:
            ma = index.get(session_entry(affinity.session_pool)[0])
            if ma is not None and ma[0] == m:
                sess = ma[1]
        return runs, ret, sess, self.block_tokens

    def _migrated_to(self, m: int, affinity: Affinity | None) -> int:
        """The offering (of model ``m``) a committed migration put the request's session on, when its
        entry still says so (the session's first turn since); else -1."""
        if affinity is None or affinity.session_pool is None:
            return -1
        pool, migrated = session_entry(affinity.session_pool)
        ma = self.pool_index.get(pool) if migrated else None
        return ma[1] if ma is not None and ma[0] == m else -1

    def _prefix_send(self, req: RouteRequest, who: Principal, m: int, cands: list[int],
                     hashes: np.ndarray | None = None) -> PrefixSend:
        """What the index records for this request on whichever candidate the reservation takes:
        its cache capacity, the cached tokens the view predicted there, when its blocks are
        expected computed (the expected TTFT without the network, in wall seconds)."""
        env = self.env
        keys, caps = self.pool_keys[m], self._cap_blocks[m]
        view, ttft, rtt = env.r_view_tokens, env.C[env_kernels.TTFT], env.c_rtt
        per = {keys[a]: (caps[a], float(view[a]), max(float(ttft[a] - rtt[a]), 0.0) / 1000.0 / self._speed)
               for a in cands}
        return PrefixSend(self.prefix_array(req) if hashes is None else hashes, self.session_key(who, req),
                          self.prefix_ttl_s, per)

    def rank(self, req: RouteRequest, who: Principal, decision_id: str, wall: float,
             request_json: str | None = None, explore_key: str | None = None,
             affinity: Affinity | None = None, hashes: np.ndarray | None = None, waited_ms: float = 0.0) -> Ranked:
        """Rank the offerings for one request: the chosen one and up to ``alternatives`` next
        best (:class:`Ranked`; nothing is admitted yet: :meth:`admit`) -- the stages of
        ``router.decision.stages.ROUTE`` in order, each timed (``xroute_router_stage_seconds``).

        ``affinity``: what the shared prefix index said of the request's prefix hashes (``hashes``,
        as :meth:`prefix_array` gives them, when the caller has them already) and session
        (``router.service.ports.DecisionState.lookup``): the expected cached prefix on each pool lowers
        its expected prefill, cost and TTFT, and shows in the features (``exp_cached``,
        ``session_here``) -- a soft preference every policy weighs against load, cost and the SLO;
        an offering the constraints exclude is never a candidate, pinned or not.
        ``explore_key``: what an exploring tenant's draw is a function of (the request's
        idempotency key; else ``decision_id``). ``waited_ms``: how long the request has waited in the
        admission queue (the ``predict`` stage's budget is its TTFT SLO less that). Raises
        :class:`RouteFailure` (the stages')."""
        d = Decision(req, who, who.tenant, decision_id, wall, request_json, explore_key, affinity, hashes)
        d.waited_ms = waited_ms
        try:
            self.run_stages(self.route_stages, d)
        except RouteFailure as f:
            if d.canary is not None and getattr(f, "verdict", None) != "queue":  # (a queued request is re-ranked)
                d.canary.denied(d.arm, f.error)
            raise
        prefix = self._prefix_send(req, who, d.m, d.cands, hashes) if affinity is not None else None
        svc = self.env.c_service
        return Ranked(req, who, decision_id, wall, d.t, d.age, d.m, d.pinfo, d.score_kind, d.ccounts, d.ctext,
                      d.n_valid, d.n_not_preferred, d.env_counts, d.cands, d.nums, [svc.item(k) for k in d.cands],
                      self.bundle_hash, request_json, d.epsilon, d.ope, d.ptext, d.pcounts, prefix, d.pinned,
                      d.canary, d.arm, d.greedy)

    def run_stages(self, stages: Sequence[Stage], d: Decision) -> None:
        """Apply ``stages`` to ``d`` in order; with a :attr:`stage_timer`, every
        :attr:`stage_timing_every`-th run is timed stage by stage (a stage that raises is timed too)."""
        timer = self.stage_timer
        self._stage_runs += 1
        if timer is None or self._stage_runs % self.stage_timing_every:
            for stage in stages:
                stage.apply(d)
            return
        t0 = perf_counter()
        name = ""
        try:
            for stage in stages:
                name = stage.name
                stage.apply(d)
                t1 = perf_counter()
                timer(name, t1 - t0)
                t0 = t1
        except BaseException:
            timer(name, perf_counter() - t0)
            raise

    def _first(self, d: int, cands: list[int], nums: list[float], s: Any, m: int, full: np.ndarray | None,
               bias: np.ndarray, has_bias: bool) -> tuple[list[int], list[float]]:
        """``cands`` with offering ``d`` first, with its numbers (its score as the policy gives it:
        ``s``, the fused scorer's over ``self._idx[:m]``; ``full``, the general path's; else the
        expected reward plus the bias), the rest in their order, at most ``k_alt`` after it."""
        if s is not None:
            score = float(s[int(np.searchsorted(self._idx[:m], d))])
        elif full is not None:
            score = float(full[d])
        else:
            score = float(self.env.expected_rewards()[d]) + (float(bias[d]) if has_bias else 0.0)
        env = self.env
        out = [_num(score), _num(env.c_lat.item(d)), _num(env.c_cost.item(d))]
        rest: list[int] = []
        for q, c in enumerate(cands):
            if c != d and len(rest) < self.k_alt:
                rest.append(c)
                out += nums[3 * q:3 * q + 3]
        return [d, *rest], out

    def _explore(self, key: str, eps: float, idx: np.ndarray, cands: list[int], nums: list[float], s: Any,
                 full: np.ndarray | None) -> tuple[list[int], list[float], int]:
        """An exploring tenant's candidates: with probability ``eps`` (:func:`router.decision.ope_log.draw`
        of ``key``) an offering drawn uniformly from the action set ``idx`` goes first, with its
        score (``s``: the fused scorer's scores of ``idx``; ``full``: the general path's of every
        offering; else the expected reward) and expectations, the policy's ranking after it (the
        shared state falls back along it when the drawn pool has no room). Returns the candidates,
        their numbers and the drawn offering's position in ``idx`` (-1: the policy's choice stands)."""
        u, v = ope_log.draw(key)
        if u >= eps:
            return cands, nums, -1
        j = min(int(v * idx.shape[0]), idx.shape[0] - 1)
        d = int(idx[j])
        if d == cands[0]:
            return cands, nums, -1
        if s is not None:
            score = float(s[j])
        elif full is not None:
            score = float(full[d])
        else:
            score = float(self.env.expected_rewards()[d]) + float(self.env.r_bias[d])
        env = self.env
        out = [_num(score), _num(env.c_lat.item(d)), _num(env.c_cost.item(d))]
        rest: list[int] = []
        for q, c in enumerate(cands):
            if c != d and len(rest) < self.k_alt:
                rest.append(c)
                out += nums[3 * q:3 * q + 3]
        return [d, *rest], out, j

    # ------------------------------------------------------------------ tenant quotas
    def quota_charge(self, r: Ranked, k: int = 0) -> tuple[list[QuotaBucket], int, float] | None:
        """What the request ranked as ``r`` counts in its tenant's quotas: its buckets, ``input_tokens
        + max_output_tokens`` and the expected cost of its ``k``-th candidate (the route charges the
        policy's choice, ``k = 0``, reserved with the pool in one step); None when no quota applies."""
        if not self.quota_plan:
            return None
        req = r.req
        buckets = self.quota_plan.buckets(r.who.tenant, self.env.model_names[r.m])
        if not buckets:
            return None
        return buckets, int(req.input_tokens + req.max_output_tokens), float(r.nums[3 * k + 2])

    @staticmethod
    def quota_exceeded(buckets: Sequence[QuotaBucket], verdict: Any) -> RouteFailure:
        """The 429 (or 422) of a request the state refused (an admission's quota refusal, ``router.state.base.Admitted``)."""
        return RouteFailure(**quota_failure(buckets[verdict.bucket], verdict))

    def candidates(self, r: Ranked) -> list[tuple[str, int]]:
        """The ranked offerings as the shared state's ``(pool, capacity)`` candidates. A pool's
        capacity is its slots plus the queue a request may wait in: ``slots + floor(queue_timeout_s
        x slots / service)``, ``service`` this request's expected service there -- the most work in
        flight with which the queue's expected wait, ``(in flight - slots + 1) x service / slots``,
        stays within ``queue_timeout_s`` (the wait the environment's mask allows)."""
        keys, slots, qt = self.pool_keys[r.m], self._slots_list[r.m], self.env.cfg.queue_timeout_s
        out = []
        for a, service in zip(r.cands, r.service):
            n = slots[a]
            out.append((keys[a], n + int(min(qt * n / max(service, 1e-6), 1e9))))
        return out

    def candidate_of(self, r: Ranked, pool: str) -> int:
        """The position among ``r``'s candidates of the pool the state reserved."""
        keys = self.pool_keys[r.m]
        for k, a in enumerate(r.cands):
            if keys[a] == pool:
                return k
        raise ValueError(f"the shared state reserved '{pool}', which is not a candidate")

    def hold_s(self, r: Ranked) -> float:
        """How long (wall-clock seconds) a reservation for ``r`` is held when no release comes:
        ``state_hold_factor`` times the longest expected latency among its candidates, within the
        floor and the ceiling (``router.state.base.hold_for``). Expectations are in telemetry time: a
        replay at ``replay_speed`` s plays them out over that many times fewer wall seconds."""
        st = self.settings
        return hold_for(max(r.nums[1::3]) / 1000.0 / self._speed, st.state_hold_factor, st.state_hold_floor_s,
                        st.state_hold_max_s)

    def shared_full(self, r: Ranked) -> RouteFailure:
        """The 429 for a request whose every candidate is at its capacity in the shared state
        (counted as ``queue_full``); ``Retry-After``: the shortest expected time for one of them
        to free a slot (service / slots), at least 1 s."""
        counts = list(r.env_counts)
        counts[3] += len(r.cands)
        slots = self._slots_list[r.m]
        soonest = min(service / max(slots[a], 1) for a, service in zip(r.cands, r.service))
        return RouteFailure(429, "no_capacity", "no allowed offering can take the request now (the pools able to "
                            "are at their capacity in the shared state)", headers={"Retry-After": self._retry_after(soonest)},
                            extra={"excluded": self._counts(self._all_counts(r.ccounts, r.pcounts), r.n_not_preferred,
                                                            counts)})

    def admit(self, r: Ranked, k: int = 0, hold_s: float | None = None, idempotency_key: str | None = None,
              quota: tuple[int, float] | None = None) -> tuple[bytes, DecisionRow, str, dict[str, Any]]:
        """The request ranked as ``r`` goes to its ``k``-th candidate (the first the shared state
        had room on; the ones before it count as ``queue_full``): the router's view holds that
        pool's slot for its expected service time (``CloudRouteEnv.admit_live``), and, with
        ``hold_s`` (a reservation was made), this process counts the reservation as its own until
        it is released or its hold passes. Returns (response JSON, decision-log row, offering id,
        policy info). Reads nothing of the environment's current request, so other requests may
        have been ranked in between. ``quota``: the tokens and USD its tenant's quotas reserved
        (the decision log's ``quota_tokens``, ``quota_usd``; ``router.decision.quotas.quota_events``)."""
        a = r.cands[k]
        alt_idx = r.cands[k + 1:]
        nums = r.nums[3 * k:]
        env = self.env
        env.admit_live(r.m, a, r.t, r.service[k], r.decision_id)
        if self.watchdog.twin is not None:  # (greedy's copy ends with it: envs.twin)
            self.watchdog.twin.admitted(r.decision_id)
        if hold_s is not None:
            self._own_add(r.decision_id, r.m, a, hold_s)
        self.decisions += 1
        env_counts = r.env_counts
        if k:
            env_counts = [*env_counts[:3], env_counts[3] + k, *env_counts[4:]]
        # {"reason":count,...}: the constraint layers' part is encoded once per constraint set
        # (``constraints_for``); the environment's reasons and not_preferred are plain identifiers
        parts = [r.ctext] if r.ctext else []
        if r.n_not_preferred:
            parts.append(f'"not_preferred":{r.n_not_preferred}')
        for reason, c in zip(_ENV_KEYS, env_counts):
            if c:
                parts.append(f"{reason}{c}")
        # the alternatives' format arguments: (offering head, score, latency, cost) for each
        m = len(alt_idx)
        alt_args: list[Any] = [None] * (4 * m)
        head = self._alt_head
        alt_args[0::4] = [head[i] for i in alt_idx]
        alt_args[1::4], alt_args[2::4], alt_args[3::4] = nums[3::3], nums[4::3], nums[5::3]
        exp_lat, exp_cost = nums[1], nums[2]
        req, who, wall, t, age, pinfo = r.req, r.who, r.wall, r.t, r.age, r.pinfo
        decision_id = r.decision_id
        text = _answer_format(m) % (
            decision_id, iso(wall), json_str(who.tenant), "null" if req.session_id is None else _dumps(req.session_id),
            self.ref_json[a], exp_lat, exp_cost, nums[0], r.score_kind, *alt_args, self._policy_text(pinfo),
            self.n - r.n_valid + k, ",".join(parts), r.ptext, self._tele_head, iso(t), round(age, 3),
            "true" if age > self.max_age else "false")
        offering_id = self.offering_ids[a]
        request_json = r.request_json if r.request_json is not None else req.model_dump_json(exclude_none=True)
        # the propensity of what was served: unknown when the shared state moved the request off the
        # first candidate (that pool had no room)
        features = None
        propensity = None if k or r.pinned else 1.0
        if r.ope is not None:
            features, size, first, argmax = r.ope
            if k:
                features = ope_log.serving(features, a)
            elif not r.pinned:
                propensity = ope_log.propensity(r.epsilon, size, first == argmax)
        # DecisionRow's fields in their order (positional: a keyword call costs the hot path several times more)
        row = DecisionRow(decision_id, who.tenant, wall, t, req.origin, req.input_tokens, req.max_output_tokens,
                          req.ttft_ms, req.tpot_ms, req.deadline_ms, self.env.model_names[r.m], req.session_id,
                          offering_id, exp_lat, exp_cost, pinfo["name"], pinfo["kind"], pinfo["version"],
                          r.bundle_hash, self.pool_keys[r.m][a], None if hold_s is None else wall + hold_s,
                          idempotency_key, propensity, r.epsilon, features,
                          None if quota is None else int(quota[0]), None if quota is None else float(quota[1]),
                          request_json, text, greedy_offering_id=None if r.greedy < 0 else self.offering_ids[r.greedy])
        c = r.canary
        if c is not None:  # (a canary running: the row says which arm decided, its exclusions are counted)
            row.policy_arm = c.labels[r.arm]
            c.excluded(r.arm, r.ccounts, r.pcounts, (("not_preferred", r.n_not_preferred), *zip(REASONS, env_counts)))
        return text.encode(), row, offering_id, pinfo

    def feedback_reward(self, ref: Any, body: FeedbackRequest) -> tuple[float | None, bool | None]:
        """The realized reward of the outcome ``body`` reports for the decision ``ref``
        (``router.store.sqlite.DecisionRef``) and whether it missed its SLO, as the simulation computes
        them (``CloudRouteEnv.outcome_reward``, ``envs.kernels.realized_reward``). The cost is the
        observed one, else the decision's expected cost (clients rarely know a request's cost); a
        failed request's is the observed one, else 0, and its output length the observed one, else
        the request's maximum. ``(None, None)`` when a completed request's feedback lacks its
        latency, TTFT or output length: there is nothing to score it on."""
        if body.failed:
            out = body.output_tokens if body.output_tokens is not None else ref.max_output_tokens
            cost = body.cost_usd if body.cost_usd is not None else 0.0
        elif body.latency_ms is None or body.ttft_ms is None or body.output_tokens is None:
            return None, None
        else:
            out = body.output_tokens
            cost = body.cost_usd if body.cost_usd is not None else ref.expected_cost_usd
        return self.env.outcome_reward(ref.input_tokens, out, ref.ttft_ms, ref.tpot_ms, ref.deadline_ms, cost,
                                       body.latency_ms, body.ttft_ms, body.failed)

    # ------------------------------------------------------------------ the shared view
    def _own_add(self, reservation_id: str, m: int, a: int, hold_s: float) -> None:
        until = time.monotonic() + hold_s
        self._own[reservation_id] = (m, a, until)
        heapq.heappush(self._own_due, (until, reservation_id))
        self.own_held[m, a] += 1

    def _own_expire(self, now: float) -> None:
        due, own = self._own_due, self._own
        while due and due[0][0] <= now:
            until, rid = heapq.heappop(due)
            h = own.get(rid)
            if h is not None and h[2] == until:
                del own[rid]
                self.own_held[h[0], h[1]] -= 1
        if len(due) > 2 * len(own) + 1024:  # released long before their hold ends: drop them
            self._own_due = [(u, r) for u, r in due if r in own and own[r][2] == u]
            heapq.heapify(self._own_due)

    def release_local(self, reservation_id: str, wall: float) -> bool:
        """This process's side of a release (feedback came, or the answer was never sent): the
        reservation is no longer its own, and its view learns the request ended now (the slot frees
        and what is expected after it moves up). False when neither knew it (another process
        decided it, or it had passed its expected end)."""
        h = self._own.pop(reservation_id, None)
        if h is not None:
            self.own_held[h[0], h[1]] -= 1
        return self.env.complete_live(reservation_id, self.now(wall)) or h is not None

    def apply_shared_view(self, in_flight: dict[str, int], durations_ms: dict[str, float]) -> None:
        """The shared state's in-flight work per pool (``router.state.base.StateView``) and observed mean
        durations (its ``durations``), as the decisions use them: the work this process does not hold
        itself -- ``max(0, shared - own)`` per pool -- goes into the environment's ``view_others``,
        the durations (seconds) into ``view_service_s`` (``envs.kernels.candidate_outcomes_into``
        documents the formula)."""
        self._own_expire(time.monotonic())
        shared = np.zeros_like(self.own_held)
        index = self.pool_index
        for pool, n in in_flight.items():
            ma = index.get(pool)
            if ma is not None:
                shared[ma] = n
        np.maximum(shared - self.own_held, 0, out=self.env.view_others)
        svc = self.env.view_service_s
        svc[:] = 0.0
        for pool, ms in durations_ms.items():
            ma = index.get(pool)
            if ma is not None:
                svc[ma] = ms / 1000.0

    def pool_key_of(self, offering_id: str, model: str | None = None) -> str:
        """The shared state's key of ``offering_id``'s pool of ``model`` (default: the default model)."""
        m = self.env.default_model if model is None else self.env.model_index[model]
        return self.pool_keys[m][self.offering_ids.index(offering_id)]

    def apply_server_metrics(self, loads: dict[str, tuple[float, float, float | None]]) -> None:
        """The load the pools' inference servers report (``router.service.scrape``: per pool, requests
        running, waiting, KV-cache usage or None) into the environment's ``view_server_busy``:
        running + waiting, and at least the pool's slots when the KV cache is ``kv_cache_full``
        (the server can take no more sequences); -1 for the pools not reported."""
        busy = self.env.view_server_busy
        busy[:] = -1.0
        full = self.settings.kv_cache_full
        for pool, (running, waiting, kv) in loads.items():
            ma = self.pool_index.get(pool)
            if ma is not None:
                b = running + waiting
                if kv is not None and kv >= full:
                    b = max(b, float(self._slots_list[ma[0]][ma[1]]))
                busy[ma] = b

    @staticmethod
    def _all_counts(ccounts: dict[str, int], pcounts: tuple[Any, np.ndarray] | None) -> dict[str, int]:
        """The constraint layers' exclusion counts, then the routing policies' (``Ranked.pcounts``)."""
        if pcounts is None:
            return ccounts
        compiled, counts = pcounts
        return {**ccounts, **{compiled.reasons[k]: int(counts[k]) for k in np.flatnonzero(counts[: compiled.R])}}

    @staticmethod
    def _counts(ccounts: dict[str, int], n_not_preferred: int, env_counts: list[int]) -> dict[str, int]:
        """Why offerings were excluded: the constraint layers', then not preferred, then the
        environment's ``ENV_REASONS`` and the quotas' (:data:`REASONS`; the answer's
        ``excluded.by_reason``, in this order)."""
        counts = dict(ccounts)
        if n_not_preferred:
            counts["not_preferred"] = n_not_preferred
        for reason, c in zip(REASONS, env_counts):
            if c:
                counts[reason] = c
        return counts

    def _no_capacity(self, allowed: np.ndarray, counts: dict[str, int]) -> None:
        """Raise the 429 for a request no allowed offering can take now; ``Retry-After`` is the
        shortest queue wait among the allowed available offerings."""
        env = self.env
        ok = allowed & env.available & env.fits[env.r_m] & (env.slots[env.r_m] > 0) & np.isfinite(env.c_wait)
        retry = self._retry_after(float(env.c_wait[ok].min())) if ok.any() else "60"
        raise RouteFailure(429, "no_capacity", "no allowed offering can take the request now",
                           headers={"Retry-After": retry}, extra={"excluded": counts})

    def band_of(self, req: RouteRequest, tenant: str) -> str:
        """The request's priority band: its own, else its tenant's default, else the default band."""
        return req.priority or self.bands.get(tenant, DEFAULT_BAND)

    def weight_of(self, tenant: str) -> float:
        """The tenant's fairness weight (1 for a tenant the settings do not declare)."""
        return self.weights.get(tenant, 1.0)

    def unattainable(self, verdict: str, band: str, best_ttft_ms: float, budget_ms: float) -> Unattainable:
        """The 429 ``slo_unattainable`` of a request no pool is predicted to serve within ``budget_ms``
        (``verdict``: queue or shed); ``Retry-After``: how much later the best pool's prediction would fit."""
        over = (best_ttft_ms - budget_ms) / 1000.0
        return Unattainable(verdict, band, best_ttft_ms, budget_ms, self._retry_after(over) if over < 3600 else "1")

    def _retry_after(self, telemetry_s: float) -> str:
        """``Retry-After`` for a wait of ``telemetry_s`` telemetry seconds: wall seconds at this
        clock's speed (a replay's ``replay_speed``; 1 live), from 1 to 3600."""
        return str(min(max(1, int(np.ceil(telemetry_s / max(self._speed, 1e-9)))), 3600))

    def _choose(self, active: ActivePolicy, valid: np.ndarray, bias: np.ndarray | None = None
                ) -> tuple[int, float, list[int], list[float], str, np.ndarray]:
        """(chosen offering, its score, the next ``alternatives`` offerings and their scores, score
        kind, every offering's score: NaN where not valid) under ``active``, among the ``valid``
        offerings (the current request is the env's, set by ``set_live``); ``bias``: the prefer
        policies' weights, added to every score (the baselines add it as ``models.baselines``
        says)."""
        k_alt = self.k_alt
        env = self.env
        if active.scorer is not None:
            idx = np.flatnonzero(valid)
            s = active.scorer(env.offering_features(idx), env.request_features())
            if s.shape != idx.shape:
                raise ValueError(f"the model returned {s.shape} scores for {idx.size} offerings")
            if bias is not None:
                s = s + bias[idx]
            picked, vals = kernels.rank_scored(s, idx, k_alt)
            if picked.size == 0:
                raise ValueError("the model returned non-finite scores")
            ks, ss = picked.tolist(), vals.tolist()
            full = np.full(self.n, np.nan)
            full[idx] = s
            return ks[0], ss[0], ks[1:], ss[1:], "q_value", full
        r = env.expected_rewards()
        if bias is not None:
            r = r + bias
        if active.name == "greedy":
            best, alt = env_kernels.rank(r, valid, k_alt)
            return int(best), float(r[best]), alt.tolist(), r[alt].tolist(), "expected_reward", r
        mask = np.zeros(self.N, dtype=bool)
        mask[: self.n] = valid
        info: dict[str, Any] = {"action_mask": mask}
        if bias is not None:
            info["policy_bias"] = bias
        a = int(active.policy.act({**env.observation(), "mask": mask.astype(np.float32)}, info))
        best, alt = env_kernels.rank(r, valid, k_alt + 1)
        if not (0 <= a < self.n and valid[a]):  # a policy that ignores the mask: best valid expectation instead
            a = int(best)
        others = [int(k) for k in [int(best), *alt.tolist()] if k != a][:k_alt]
        return a, float(r[a]), others, r[others].tolist(), "expected_reward", r

    # ------------------------------------------------------------------ explain
    def explain(self, req: RouteRequest, tenant: str, wall: float, who: Principal | None = None) -> dict[str, Any]:
        """Why each offering is or is not eligible for ``req`` of ``tenant`` now (``POST
        /v1/explain``): the route's own stages up to feasibility (``router.decision.stages.EXPLAIN``)
        with a per-offering trace -- each offering excluded by the first stage that excluded it, as
        the route counts it -- without deciding anything. ``who``: the caller, whose permissions
        apply when it explains its own tenant (None: an admin explaining another's). Makes the
        request current in the environment (as ranking would); admits nothing."""
        d = self.trace_stages(self.explain_stages, req, tenant, wall, who, own_permissions=who is not None)
        env = self.env
        pol = d.policies if d.policies is not None else self.policies
        pctx, pout = d.pctx, d.pout
        applies = pctx is not None and not pctx.empty
        busy, slots = env.C[env_kernels.BUSY], env.slots[d.m]
        rows = []
        assert d.trace is not None
        for i, why in enumerate(d.trace):
            head = env_policies.headroom(float(busy[i]), float(slots[i]))
            usd = float(env.usd_h[i])
            p = (pol.explain(pctx, pout, i, usd, float(env.c_rtt[i]), head) if applies
                 else {"allowed": True, "excluded_by": None, "bias": 0.0, "biased_by": []})
            rows.append({"offering": self.refs[i], "eligible": why is None, "excluded_by": why, "policy": p,
                         "usd_per_hour": usd if np.isfinite(usd) else None, "rtt_ms": _num(env.c_rtt[i]),
                         "headroom": round(head, 6)})
        c = d.canary
        return {"tenant": tenant, "policy_version": self.policies.version,
                "arm": "canary" if d.arm else "stable",
                "canary": None if c is None else {"id": c.id, "version": c.version, "key": c.key, "share": c.share},
                "request_class": pctx.request_class or None if pctx is not None else None,
                "applied": list(pctx.applied) if pctx is not None else [],
                "eligible": sum(r["eligible"] for r in rows), "offerings": rows}

    def rule_exclusion(self, req: RouteRequest, tenant: str, wall: float, offering: int) -> str | None:
        """What in the tenant's constraints or the routing policies excludes ``offering`` for
        ``req`` now (``"tenant:deny"``, ``"policy:<name>"``), None when they allow it: the rule
        stages (``router.decision.stages.RULES``) with every pool at full headroom (a busy pool is
        no reason to move a session); a price ceiling counts, at today's price
        (``router.service.migration``: placements the rules no longer allow are migrated)."""
        if not self.tenant_known(tenant):
            return None
        d = self.trace_stages(self.rule_stages, req, tenant, wall, request_constraints=False, full_headroom=True)
        assert d.trace is not None
        return d.trace[offering]

    def trace_stages(self, stages: Sequence[Stage], req: RouteRequest, tenant: str, wall: float,
                     who: Principal | None = None, **how: Any) -> Decision:
        """``stages`` applied to ``req`` of ``tenant`` with a per-offering trace, nothing failing
        for want of offerings (``Decision``'s ``trace`` and ``strict``); ``how``: the decision's
        other switches (``own_permissions``, ``request_constraints``, ``full_headroom``, ``policies``)."""
        d = Decision(req, who if who is not None else Principal(tenant, "tenant", ""), tenant, None, wall,
                     trace=[None] * self.n, strict=False, **how)
        for stage in stages:
            stage.apply(d)
        return d


    # ------------------------------------------------------------------ state
    def pool_load(self, wall: float) -> list[tuple[str, int, int]]:
        """Each offering's pool of the default model: (offering id, work in flight as this process
        sees it -- its own reservations and the shared state's others' -- and its slots now)."""
        m = self.env.default_model
        slots = self.env.live_pools(self.now(wall), m)["slots"]
        busy = self.own_held[m] + self.env.view_others[m]
        return [(self.offering_ids[i], int(busy[i]), int(slots[i])) for i in range(self.n)]

    def default_band(self, tenant: str) -> str:
        """The tenant's default priority band (the one its outcomes are counted under)."""
        return self.bands.get(tenant, DEFAULT_BAND)

    def offerings_state(self, wall: float, reserved: dict[str, int] | None = None) -> dict[str, Any]:
        """Current price, availability and the router's view of each offering's pool of the
        default model (for ``GET /v1/offerings``), with the shared state's reservations per pool
        (``reserved``) when given."""
        t = self.now(wall)
        m = self.env.default_model
        p = self.env.live_pools(t, m)
        usd, available, valid, slots = p["usd_per_hour"], p["available"], p["valid"], p["slots"]
        busy, nxt, util = p["busy"], p["next_free_in_s"], p["external_util"]
        keys = self.pool_keys[m]
        ejection = self.ejection
        rows = []
        for i in range(self.n):
            left = ejection.left(POOL + keys[i])
            rows.append({"offering": self.refs[i], "usd_per_hour": _num(usd[i]) if np.isfinite(usd[i]) else None,
                         "available": bool(available[i]), "valid": bool(valid[i]), "slots": int(slots[i]),
                         "busy_slots": int(busy[i]), "reserved": None if reserved is None else reserved.get(keys[i], 0),
                         "next_free_in_s": _num(nxt[i]), "external_util": _num(util[i]),
                         "ejected": left is not None, "ejected_for_s": None if left is None else round(left, 3)})
        ejections = []
        for target, e in sorted(ejection.health.items()):
            left = ejection.left(target)
            ejections.append({"target": target, "ejected": left is not None,
                              "ejected_for_s": None if left is None else round(left, 3),
                              "consecutive_failures": e.failures, "ejections": e.ejections})
        return {"telemetry": self.telemetry_info(t, wall), "origins": self.origins, "models": self.models,
                "prefix_block_tokens": self.block_tokens, "offerings": rows, "ejections": ejections,
                "watchdog": self.watchdog.describe()}


_dumps = json.JSONEncoder(separators=(",", ":")).encode
#: why the environment masks an allowed offering: ``router.decision.kernels.ENV_REASONS``, then the cloud
#: quotas' ``quota`` (no room for one more instance) and the tenant budget's ``budget``
REASONS = (*kernels.ENV_REASONS, "quota", "budget")
_ENV_KEYS = tuple(f'"{r}":' for r in REASONS)
_ANSWER_FORMATS: dict[int, str] = {}


def _answer_format(alternatives: int) -> str:
    """The answer with ``alternatives`` alternatives as one %-format (one formatting call, faster
    than an f-string's per-field formatting); scores and expectations with 9 significant digits."""
    fmt = _ANSWER_FORMATS.get(alternatives)
    if fmt is None:
        alt = '%s%.9g,"expected_latency_ms":%.9g,"expected_cost_usd":%.9g}'
        fmt = _ANSWER_FORMATS[alternatives] = (
            '{"decision_id":"%s","created_at":"%s","tenant":%s,"session_id":%s,"offering":%s,'
            '"expected_latency_ms":%.9g,"expected_cost_usd":%.9g,"score":%.9g,"score_kind":"%s",'
            f'"alternatives":[{",".join([alt] * alternatives)}],"policy":%s,'
            '"excluded":{"total":%d,"by_reason":{%s}},"policies":%s,"telemetry":%s%s","age_s":%r,"stale":%s}}')
    return fmt
