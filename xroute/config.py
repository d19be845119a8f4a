"""Configuration models (pydantic) and the YAML loader. One place for every config schema.

Unknown keys are errors (``extra="forbid"``) so a typo never silently falls back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xroute import admission_rules as admission
from xroute import migration_rules as rules
from xroute.errors import ConfigError
from xroute.resources import configs_dir
from xroute.schema.policy_ir import ConstraintError, PolicySet, policy_set_error
from xroute.schema.quota import DAY_S, TenantQuotas

#: the shipped configuration files (``configs/`` in a checkout; package data in an install)
CONFIG_DIR = configs_dir()


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RewardConfig(Strict):
    """reward = -(cost_weight*cost_norm + latency_weight*latency_norm) - sla_penalty*violation."""

    cost_weight: float = Field(0.6, ge=0)
    latency_weight: float = Field(0.4, ge=0)
    sla_penalty: float = Field(2.0, ge=0, description="added cost of one SLA violation, in reward units")
    reference_usd_per_replica_hour: float = Field(
        1.0, gt=0, description="cost_norm = cost / cost of the request on a reference replica at this price")
    cost_norm_cap: float = Field(5.0, gt=0)
    latency_norm_cap: float = Field(3.0, gt=0)
    failure_latency_norm: float = Field(3.0, ge=0, description="latency_norm charged to a failed request")


class EstimatorConfig(Strict):
    """The output-length estimator every policy's expectations use (``envs.estimator``): per
    (model, tenant), a decayed histogram of *past* completions' output tokens, shrunk toward the
    model's and then toward ``prior_fraction`` x the request's ``max_output_tokens``."""

    half_life: float = Field(2000.0, gt=0, description="completions after which an observation weighs half")
    shrinkage: float = Field(5.0, ge=0, description="pseudo-observations of the parent estimate (model, then prior)")
    prior_fraction: float = Field(0.25, gt=0, le=1, description="cold-start estimate as a fraction of max_output_tokens")
    history_lag_s: float = Field(
        60.0, ge=0, description="stream requests that arrived this long before an episode's first request seed the "
                               "estimator at reset (their outputs are known by then)")


class PrefixConfig(Strict):
    """KV-cache prefix caching (``envs.prefix``; active for requests that carry ``prefix_hashes``):
    the router's view of what each pool holds, kept apart from the servers' caches."""

    view_ttl_s: float = Field(600.0, gt=0, description="the view's age bound: a block sent to a pool longer ago is "
                                                       "not expected there any more")
    retention_alpha: float = Field(0.05, gt=0, le=1, description="weight of one confirmation (cached tokens the "
                                                                 "servers report) in a pool's retention")


class MigrationConfig(Strict):
    """Spot preemption with notice and migration (``docs/env.md``, "Preemption and migration"): the
    rules are ``xroute.migration_rules``, shared with the router (``router.service.migration``), and so are
    the defaults of the two the router also has (``migration_deprioritize_s``,
    ``migration_region_penalty`` in ``router/core/settings.py``)."""

    notice: bool = Field(True, description="spot pools get their notice (offerings.notice_s) before they stop and "
                                           "the work on them migrates; false = no notice (the pool dies unannounced, "
                                           "its requests restart after retry_overhead_ms)")
    default_notice_s: float = Field(
        rules.DEFAULT_NOTICE_S, ge=0, le=3600,
        description="the notice of a spot offering whose bundle row has no notice_s (the shortest the clouds give: "
                    "Azure Scheduled Events and GCP preemption about 30 s; AWS 2 minutes)")
    delay_s: float = Field(
        rules.MIGRATION_DELAY_S, ge=0, le=3600,
        description="from the notice to the session's target being ready (choose, snapshot, verify): "
                    "benchmarks/bench_migration.py committed 100 sessions 0.76 s after the event")
    deprioritize_s: float = Field(rules.DEPRIORITIZE_S, ge=0, le=7 * 86_400,
                                  description="the interrupted pool's region is de-prioritized this long after the notice")
    region_penalty: float = Field(rules.REGION_PENALTY, ge=0, le=1e6,
                                  description="what a de-prioritized region's offerings lose from every policy's score "
                                              "(reward units, like a prefer policy's weight)")
    default_throughput_gbps: float = Field(
        rules.DEFAULT_THROUGHPUT_GBPS, gt=0, le=1e4,
        description="KV transfer throughput between two locations the bundle's throughput table does not name")


class TenantAdmission(Strict):
    """A tenant's place in the admission under load (``xroute.admission_rules``): its default band and
    its fairness weight (the router's tenant defaults have the same two)."""

    band: admission.Band = Field(admission.DEFAULT_BAND, description="the band of its requests that name none "
                                                                     "(critical > standard > sheddable)")
    weight: float = Field(1.0, gt=0, le=1e6, description="its share of a scarce moment against the other tenants of "
                                                         "its band (the Virtual Token Counter's divisor)")


class AdmissionConfig(Strict):
    """Admission under load in the simulated world (``docs/env.md``, "Admission under load"): the rules
    are ``xroute.admission_rules``, the router's. On by default: while some feasible pool is predicted
    to meet a request's TTFT SLO every request is admitted and nothing changes."""

    enabled: bool = Field(True, description="apply the admission verdict before each placement; false = today's "
                                            "world (a request no pool can take fails)")
    default_band: admission.Band = Field(admission.DEFAULT_BAND,
                                         description="the band of a request whose tenant is not listed and whose "
                                                     "workload row names no priority")
    queue_limit: int = Field(1024, ge=1, le=10_000_000, description="requests the router's queue holds; a request "
                                                                     "that would queue beyond it is shed")
    shed_cost: float = Field(2.0, ge=0, le=1e6, description="a shed request's reward is -shed_cost (no cost, no "
                                                            "latency: the SLO penalty of a request never served)")
    tenants: dict[str, TenantAdmission] = Field(default_factory=dict,
                                                description="per tenant (the workload's tenant column): band, weight")


class ServingTier(Strict):
    """A serving tier: ``replicas`` of the pool of ``offering`` split off as their own offering
    (``<offering>#<name>``), each held at ``max_batch`` request slots (vLLM's ``max_num_seqs``) --
    a tight-TPOT tier of a few replicas at a small batch beside the rest of the pool at full batch.
    The tier has its parent's hardware, price and telemetry; the parent keeps the other replicas.
    Which requests may use it is a routing policy's business (``docs/policies.md``; e.g. deny the
    tier to every SLO class but the tight one). ``xroute.catalog_tools.split_tiers`` applies it and
    checks it against the catalog and the serving profile (errors name ``tiers[i].<field>``)."""

    offering: str = Field(min_length=1, description="the offering (pool) to split, as in the catalog")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$", description="the tier's name (its id suffix)")
    replicas: int = Field(ge=1, description="the pool's replicas (capacity_replicas units: one-GPU replicas) the "
                                            "tier takes; at most what the pool has")
    max_batch: int = Field(ge=1, description="request slots per replica of the tier; at most the serving profile's")


class EnvConfig(Strict):
    """Settings of ``xroute/CloudRoute-v0``; see the env docstring for their meaning."""

    max_offerings: int = Field(128, ge=1, description="observation is padded to this many offerings")
    episode_requests: int | None = Field(
        1024, ge=1, description="requests per episode (a random window); None = the whole stream once")
    rate_scale: float = Field(1.0, gt=0, description="compress arrivals: 4 = four times the load")
    queue_timeout_s: float = Field(20.0, gt=0, description="a pool whose next free slot is further away is full")
    retry_overhead_ms: float = Field(1500.0, ge=0, description="detect + reconnect time after a preemption")
    feature_refresh_s: float = Field(30.0, gt=0, description="history features are recomputed at least this often")
    risk_lookback_h: float = Field(6.0, gt=0, description="window of the spot-preemption history features")
    risk_prior_per_h: float = Field(1 / 24, ge=0, description="prior preemption rate of a spot pool, per hour")
    risk_prior_h: float = Field(
        1.0, gt=0, description="weight of that prior in hours of observation: hazard = (preemptions seen + "
                               "prior_per_h*prior_h) / (hours watched within the lookback + prior_h)")
    serving_config: str = Field("serving.yaml", description="per-accelerator service model, under configs/")
    models_config: str = Field("models.yaml", description="the models requests name, under configs/")
    spot_lag_s: float = Field(
        15.0, ge=0, description="a recorded spot preemption really happened up to this long before the telemetry "
                                "shows it (uniform, drawn per episode from the seed: a collector polls, it does not "
                                "see the instant); requests sent meanwhile are preempted at once. 0 = no lag")
    estimator: EstimatorConfig = EstimatorConfig()
    reward: RewardConfig = RewardConfig()
    tenants: dict[str, TenantQuotas] = Field(
        default_factory=dict, description="tenant budgets and rate limits of the simulated world (envs.budget): "
                                          "the workload's tenant column picks the tenant; a scenario setting")
    budget_period_s: float = Field(
        DAY_S, gt=0, description="the budgets' period, seconds since the epoch in multiples of it (86400: the "
                                 "router's UTC day; a scenario may shorten it so a short stream sees periods end)")
    policies: str | PolicySet | None = Field(
        None, description="the policies every request is routed under (docs/policies.md): a policy YAML file or a "
                          "directory of them (configs/policies/NAME for a shipped one), or the policy set inline; "
                          "None = none")
    prefix: PrefixConfig = PrefixConfig()
    migration: MigrationConfig = MigrationConfig()
    admission: AdmissionConfig = AdmissionConfig()
    tiers: list[ServingTier] = Field(
        default_factory=list, max_length=64,
        description="serving tiers split off the catalog's pools (ServingTier; docs/env.md 'Serving tiers'); "
                    "empty = none, every pool whole")


class OracleConfig(Strict):
    """The hindsight oracle's planner (``models.baselines.Oracle``, ``models.planning``). Its cost is
    documented in ``docs/results.md``: about (2 + (top_k - 1) x (1 + horizon)) environment steps per
    request for the lookahead plan, plus one pass per baseline, shared by ``workers`` processes."""

    top_k: int = Field(3, ge=1, le=20, description="offerings played ahead per request")
    horizon: int = Field(12, ge=0, le=1000, description="requests played ahead after each of them")
    max_regret: float | None = Field(
        0.008, ge=0, description="beyond the two best, an offering is played ahead only if its realized reward is "
                                 "within this of the best (null: every top_k); measured in docs/results.md")
    lookahead_max_requests: int | None = Field(
        None, ge=0, description="streams longer than this skip the lookahead plan (the oracle then plans with "
                                "hindsight-greedy and the baselines only, and its report says so); null = never")
    workers: int = Field(2, ge=1, le=256, description="processes the oracle plans in (forked; 1 = in this process): "
                                                      "the lookahead's segments and the other plans share them")
    segment_requests: int = Field(
        15_000, ge=1, description="with workers > 1, the lookahead is planned in segments of about this many "
                                  "requests, in parallel; each after the first starts burn_in_requests earlier, from "
                                  "the state hindsight-greedy reaches there, and the stitched plan is replayed exactly")
    burn_in_requests: int = Field(500, ge=0, description="requests each later segment plans before its own, "
                                                         "so its first decisions start from a state of its plan")


class CacheAwareConfig(Strict):
    """The cache-aware scorer (``models.baselines.CacheAware``): among the offerings more likely than
    not to meet the SLO, the best ``prefix_weight x expected cached share - load_weight x busy share -
    cost_weight x expected cost / reference cost`` (the weights of llm-d's prefix-cache, queue and
    cost scorers). Tuned on training windows only (``tools/tune_baselines.py``)."""

    prefix_weight: float = Field(1.0, ge=0)
    load_weight: float = Field(0.3, ge=0)
    cost_weight: float = Field(2.0, ge=0)


class SessionStickyConfig(Strict):
    """The session-sticky policy (``models.baselines.SessionSticky``): a request goes where its
    session's previous request went (the router's view) while that offering is valid and its
    expected reward is within ``margin`` of the best; else greedy's choice. Tuned on training
    windows only (``tools/tune_baselines.py``)."""

    margin: float = Field(0.005, ge=0, description="expected reward given up, at most, to stay with the session")


class EvaluateConfig(Strict):
    """Defaults of ``xroute evaluate`` (the baselines' knobs live here, not in code)."""

    static_location: str = Field("aws:us-east-1", description="location of the static baseline's offering")
    static_accelerator: str = Field("A10G", description="reference accelerator of the static baseline")
    seed: int = Field(0, description="first seed; seed k of --seeds N is seed + k")
    seeds: int = Field(5, ge=1, le=1000, description="seeds per policy (service-time noise, spot preemption "
                                                    "instants); metrics are reported as mean and 95 % interval")
    pacing_gain: float = Field(
        3.0, ge=0, description="the budget-pacing baseline's gain (models.baselines.BudgetPacing), tuned on the "
                               "training windows (tools/tune_pacing.py)")
    oracle: OracleConfig = OracleConfig()
    cache_aware: CacheAwareConfig = CacheAwareConfig()
    session_sticky: SessionStickyConfig = SessionStickyConfig()
    env: EnvConfig = EnvConfig(episode_requests=None)


class ProvisionConfig(Strict):
    """The provisioning world (``envs.provisioning``, ``docs/capacity.md``): a planner sets the
    instances held per pool every ``epoch_s`` of trace time; requests are routed on what exists."""

    epoch_s: float = Field(60.0, gt=0, le=3600, description="trace seconds between two plans")
    max_instances_per_pool: int = Field(32, ge=1, le=4096, description="most instances one pool may hold (a plan "
                                                                       "above it is an error)")
    warm_start: bool = Field(True, description="the first plan's instances are ready when the window starts (launched "
                                               "before it); false = they launch at the start like any other")
    rate_scale: float = Field(1.0, gt=0, description="compress arrivals: 4 = four times the load in a quarter of the "
                                                     "time")
    load_scale: int = Field(1, ge=1, le=100, description="the stream this many times over in the same time: copy j "
                                                         "of every request (and of the history) arrives j x epoch_s / "
                                                         "load_scale later -- more load without shortening the window")
    serving_config: str = Field("serving.yaml", description="service model and launch delays, under configs/")
    models_config: str = Field("models.yaml", description="the models requests name, under configs/")
    spot_lag_s: float = Field(15.0, ge=0, description="a recorded spot preemption really happened up to this long "
                                                      "before the telemetry shows it (as EnvConfig.spot_lag_s)")
    risk_lookback_h: float = Field(6.0, gt=0, description="window of the spot-preemption history (hazard)")
    risk_prior_per_h: float = Field(1 / 24, ge=0, description="prior preemption rate of a spot pool, per hour")
    risk_prior_h: float = Field(1.0, gt=0, description="weight of that prior, in hours of observation")
    retry_overhead_ms: float = Field(1500.0, ge=0, description="detect + reconnect after a preemption without notice")
    queue_timeout_s: float = Field(20.0, gt=0, description="a pool whose expected wait is longer is full (as "
                                                           "EnvConfig.queue_timeout_s); the request waits in the "
                                                           "router's queue for room")
    migration: MigrationConfig = MigrationConfig()
    estimator: EstimatorConfig = EstimatorConfig()
    reward: RewardConfig = RewardConfig()
    slo_miss_usd: float = Field(0.01, ge=0, description="the Gymnasium env's reward: -(held cost in the epoch + this "
                                                        "x SLO misses completed in it), USD")


class ForecastConfig(Strict):
    """The load forecast every planner but the oracle reads: the past only."""

    window_s: float = Field(300.0, gt=0, description="arrivals of the last window_s seconds")
    peak_s: float = Field(15.0, gt=0, description="the rate is the busiest peak_s sub-window's (bursts)")
    margin: float = Field(0.1, ge=0, le=10, description="planned above the forecast by this fraction")


class StaticPlannerConfig(Strict):
    """Static peak provisioning on demand: one pool, sized once for the history's peak."""

    offering: str | None = Field(None, description="its offering id; None = the on-demand offering with the lowest "
                                                   "price per unit of SLO-feasible throughput")


class AutoscalerConfig(Strict):
    """A reactive target-utilization autoscaler (Kubernetes HPA's rule and default behaviour)."""

    target_utilization: float = Field(0.7, gt=0, le=1, description="target share of an instance's SLO-feasible "
                                                                   "concurrency in use (KPA's default 0.7)")
    tolerance: float = Field(0.1, ge=0, le=1, description="no change while |ratio - 1| <= tolerance (HPA: 0.1)")
    scale_up_stabilization_s: float = Field(0.0, ge=0, description="HPA default: 0 (scale up at once)")
    scale_down_stabilization_s: float = Field(300.0, ge=0, description="HPA default: 300 (the highest "
                                                                       "recommendation of the last 5 minutes)")
    min_replicas: int = Field(1, ge=0)


class SpotHedgeConfig(Strict):
    """SpotHedge (SkyServe): knobs as SkyPilot's service spec names them (``docs/capacity.md``)."""

    num_overprovision: int = Field(1, ge=0, le=1000, description="extra spot replicas over the target")
    base_ondemand_fallback_replicas: int = Field(0, ge=0, le=1000)
    dynamic_ondemand_fallback: bool = True
    upscale_delay_s: float = Field(300.0, ge=0, description="SkyServe's default upscale delay")
    downscale_delay_s: float = Field(1200.0, ge=0, description="SkyServe's default downscale delay")
    target_qps_per_replica: float | None = Field(None, gt=0, description="None = the SLO-feasible throughput of its "
                                                                         "replica x planners.headroom")
    accelerators: list[str] | None = Field(None, description="the replica's accelerators (its spot locations are "
                                                             "every spot pool of these); None = the static pool's")


class MelangeConfig(Strict):
    """A Mélange-style cost-optimal GPU mix, re-solved every epoch for the forecast."""

    include_spot: bool = Field(False, description="Mélange plans on-demand GPUs only; true adds the spot pools "
                                                  "available now")
    switch_cost: bool = Field(True, description="charge a new instance its launch time at its price (keeps the mix "
                                                "from churning)")
    horizon_s: float = Field(600.0, gt=0, le=86_400, description="the instances' price is counted over this long "
                                                                 "against a new one's launch cost")
    time_limit_s: float = Field(5.0, gt=0, le=3600, description="HiGHS time limit per solve")


class CapacityOracleConfig(Strict):
    """The hindsight oracle of the provisioning world: the same ILP over the whole window with the
    true load and availability (it sees the future)."""

    time_limit_s: float = Field(120.0, gt=0, le=36000, description="HiGHS time limit")
    mip_rel_gap: float = Field(0.005, ge=0, le=1, description="HiGHS relative MIP gap")


class PlannersConfig(Strict):
    """Knobs of the provisioning baselines (``models.planners``)."""

    headroom: float = Field(0.8, gt=0, le=1, description="plan an instance for this share of its SLO-feasible "
                                                        "throughput (queueing margin), every planner alike")
    forecast: ForecastConfig = ForecastConfig()
    static: StaticPlannerConfig = StaticPlannerConfig()
    autoscaler: AutoscalerConfig = AutoscalerConfig()
    spothedge: SpotHedgeConfig = SpotHedgeConfig()
    melange: MelangeConfig = MelangeConfig()
    oracle: CapacityOracleConfig = CapacityOracleConfig()


class CapacityConfig(Strict):
    """``configs/capacity.yaml``: ``xroute evaluate --capacity`` (the world, the planners, the seeds)."""

    seed: int = Field(0, description="first seed")
    seeds: int = Field(5, ge=1, le=1000, description="seeds per planner (service-time noise, spot preemption instants)")
    world: ProvisionConfig = ProvisionConfig()
    planners: PlannersConfig = PlannersConfig()


M = TypeVar("M", bound=BaseModel)


def _format_validation(e: ValidationError, source: str) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f"{source}: field '{loc}': {msg}{more}"


def parse_config(model: type[M], data: dict[str, Any] | None, source: str = "config") -> M:
    """Validate ``data`` against ``model``; raise :class:`ConfigError` naming the field."""
    try:
        return model.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of keys to values")
    return data


def load_config(model: type[M], path: str | Path | None) -> M:
    if path is None:
        return parse_config(model, {}, model.__name__)
    return parse_config(model, read_yaml(path), str(path))


def config_path(name: str | Path) -> Path:
    """A config file: ``name`` as the user gave it (an absolute path, or relative to the working
    directory); a bare file name that is not there is the shipped file of that name."""
    p = Path(name).expanduser()
    return CONFIG_DIR / p if not p.exists() and len(p.parts) == 1 else p


class AcceleratorSpeed(Strict):
    """Measured serving speed of one replica of the reference model on one accelerator."""

    memory_gb: float = Field(gt=0, description="accelerator memory, GB (1e9 bytes), from the vendor's datasheet")
    prefill_tok_s: float = Field(gt=0)
    tpot_ms: float = Field(gt=0, description="ms per output token at concurrency 1")
    tpot_growth: float = Field(ge=0, description="tpot(k) = tpot_ms * (1 + tpot_growth*(k-1))")
    max_concurrency: int = Field(ge=1, description="request slots per replica")
    noise_sigma: float = Field(0.1, ge=0, description="lognormal sigma of run-to-run variation")
    sources: list[str] = Field(default_factory=list)
    derivation: str = ""


class LaunchConfig(Strict):
    """How long a new replica takes from the launch call to serving (the provisioning world,
    ``envs.provisioning``): the instance's provisioning and boot, then the inference engine's start
    -- its fixed part (imports, compilation, CUDA graphs, KV-cache profiling) and loading the
    model's weights from the instance's disk. Sources and arithmetic in ``configs/serving.yaml``."""

    boot_s_single_gpu: float = Field(gt=0, le=7200, description="launch call -> instance booted, one-GPU instances")
    boot_s_multi_gpu: float = Field(gt=0, le=7200, description="the same for multi-GPU instances")
    boot_s: dict[str, float] = Field(default_factory=dict, description="per accelerator, overriding the two above")
    engine_start_s: float = Field(ge=0, le=7200, description="the engine's start less its weight loading")
    weights_gb_per_s: float = Field(gt=0, le=1000, description="weights loaded from the instance's disk, GB/s")
    sources: list[str] = Field(default_factory=list)
    derivation: str = ""


class ServingConfig(Strict):
    reference_model: str = ""
    reference_accelerator: str = "A10G"
    accelerators: dict[str, AcceleratorSpeed]
    #: launch delays of the provisioning world (``envs.provisioning``); None: that world refuses the file
    launch: LaunchConfig | None = None


class ModelSpec(Strict):
    """One model requests may name: its size, which sets where it fits and how fast it runs."""

    params_b: float = Field(gt=0, description="parameters, billions")
    weights_gb: float = Field(gt=0, description="weight memory at the served precision, GB (1e9 bytes)")
    kv_mib_per_token: float = Field(gt=0, description="KV-cache per token, MiB (all layers, K and V)")
    tpot_growth: float | None = Field(
        None, ge=0, description="tpot(k) = tpot * (1 + tpot_growth*(k-1)); empty = the accelerator's (serving.yaml)")
    slot_context_tokens: int | None = Field(
        None, ge=1, description="KV tokens one request slot of this model's deployment reserves; empty = the "
                                "top-level nominal_context_tokens (a long-context deployment sizes its slots larger)")
    sources: list[str] = Field(default_factory=list)
    derivation: str = ""


class ModelsConfig(Strict):
    """``configs/models.yaml``: the models, and the rules that carry the reference model's measured
    speeds (``serving.yaml``) to the others (documented in that file and ``docs/env.md``)."""

    default_model: str = Field(description="the model of a request (or bundle row) that names none")
    reference_model: str = Field(description="the model serving.yaml measured; its speeds are used unchanged")
    tp_efficiency: float = Field(gt=0, le=1, description="decode/prefill speed kept per doubling of the GPUs "
                                                         "a replica spans (tensor parallelism)")
    prefill_tp_efficiency: float = Field(gt=0, le=1, description="the same for prefill (compute-bound)")
    kv_fraction: float = Field(0.9, gt=0, le=1, description="share of accelerator memory usable for weights + KV")
    nominal_context_tokens: int = Field(2048, ge=1, description="KV tokens one request slot reserves")
    min_context_tokens: int = Field(1024, ge=1, description="a replica must hold at least this many KV tokens")
    models: dict[str, ModelSpec]


#: the keys a policy YAML file may hold (``xroute.schema.policy_ir.PolicySet``, less its store version)
POLICY_FILE_KEYS = ("region_sets", "slo_tiers", "prefer_mode", "policies")


def policy_files(path: str | Path) -> list[Path]:
    """The policy YAML files ``path`` names: a file, or every ``*.yaml``/``*.yml`` of a directory
    (sorted); a relative path that is not there is the shipped one (``configs/policies``,
    ``configs/policies/<name>``, or ``<name>`` of that directory)."""
    p = Path(path).expanduser()
    if not p.exists() and not p.is_absolute():  # a shipped one: NAME, policies/NAME, configs/policies[/NAME]
        parts = p.parts[1:] if p.parts[:1] == ("configs",) else p.parts
        parts = parts[1:] if parts[:1] == ("policies",) else parts
        shipped = CONFIG_DIR.joinpath("policies", *parts)
        p = shipped if shipped.exists() else p
    if p.is_dir():
        files = sorted([*p.glob("*.yaml"), *p.glob("*.yml")])
        if not files:
            raise ConfigError(f"{p}: no policy files (*.yaml) in the directory")
        return files
    if not p.is_file():
        raise ConfigError(f"{p}: policy file or directory not found")
    return [p]


def load_policies(*paths: str | Path) -> PolicySet:
    """One :class:`PolicySet` from policy YAML files and directories (``policy_files``): each
    file may hold ``region_sets``, ``slo_tiers``, ``prefer_mode`` and ``policies``; every name is
    defined once across the files (a second definition is an error naming both files). Errors
    name the file and the field."""
    docs = [(f, read_yaml(f)) for path in paths for f in policy_files(path)]
    merged: dict[str, Any] = {"region_sets": {}, "slo_tiers": {}, "policies": []}
    where: dict[str, str] = {}
    mode: tuple[str, str] | None = None
    for f, data in docs:
        unknown = sorted(set(data) - set(POLICY_FILE_KEYS))
        if unknown:
            raise ConfigError(f"{f}: field '{unknown[0]}': unknown key (a policy file holds "
                              f"{', '.join(POLICY_FILE_KEYS)})")
        for kind in ("region_sets", "slo_tiers"):
            section = data.get(kind) or {}
            if not isinstance(section, dict):
                raise ConfigError(f"{f}: field '{kind}': must be a mapping of names to definitions")
            for name, value in section.items():
                if f"{kind}.{name}" in where:
                    raise ConfigError(f"{f}: field '{kind}.{name}': already defined in {where[f'{kind}.{name}']}")
                merged[kind][name] = value
                where[f"{kind}.{name}"] = str(f)
        if "prefer_mode" in data:
            if mode is not None and mode[0] != data["prefer_mode"]:
                raise ConfigError(f"{f}: field 'prefer_mode': '{data['prefer_mode']}' here, '{mode[0]}' in {mode[1]}")
            mode = (str(data["prefer_mode"]), str(f))
    for f, data in docs:
        try:  # each file with every file's named sets, so an error names the file and the field in it
            PolicySet.model_validate({**data, "region_sets": merged["region_sets"], "slo_tiers": merged["slo_tiers"]})
        except ValidationError as e:
            raise ConfigError(f"{f}: {policy_set_error(e)}") from None
        except ConstraintError as e:
            raise ConfigError(f"{f}: {e}") from None
        for i, p in enumerate(data.get("policies") or []):
            name = p.get("name")
            if f"policy.{name}" in where:
                raise ConfigError(f"{f}: field 'policies[{i}].name': policy '{name}' is already defined in "
                                  f"{where[f'policy.{name}']}")
            where[f"policy.{name}"] = str(f)
            merged["policies"].append(p)
    if mode is not None:
        merged["prefer_mode"] = mode[0]
    try:
        return PolicySet.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(f"{', '.join(map(str, paths))}: {policy_set_error(e)}") from None
