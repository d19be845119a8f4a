"""``TrainConfig``: everything ``xroute train`` reads from ``configs/train.yaml``.

Unknown keys are errors (``xroute.config.Strict``); every bad value raises
:class:`xroute.errors.ConfigError` naming the field. The environment and the reward are *not*
configured here: training uses exactly the env settings of the evaluate config (``evaluate_config``)
so the agent optimizes the reward it is judged on; only the episode length differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from xroute.config import CapacityConfig, EvaluateConfig, Strict, config_path, load_config, parse_config, read_yaml
from xroute.errors import ConfigError


class SplitConfig(Strict):
    """Time split of the bundle's workload (fractions of its time span, in this order)."""

    train: float = Field(0.6, gt=0, lt=1)
    validation: float = Field(0.2, gt=0, lt=1)
    test: float = Field(0.2, gt=0, lt=1)

    @model_validator(mode="after")
    def _sums_to_one(self) -> SplitConfig:
        total = self.train + self.validation + self.test
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"train + validation + test must be 1, got {total:g}")
        return self


class NetConfig(Strict):
    """The shared per-offering scorer: ``score_i = prior_i + MLP([row_i, request, context])``."""

    hidden: list[int] = Field(default_factory=lambda: [64, 64], min_length=1,
                              description="hidden layer widths of the scorer MLP")
    context_dim: int = Field(16, ge=0, description="width of the masked-mean pooled context of all valid rows "
                                                   "(0 = score each row alone)")
    margins: list[float] = Field(
        default_factory=lambda: [0.0, 0.001, 0.002, 0.005, 0.01], min_length=1,
        description="departure margins (models.policy.departs) tried on the selection windows after training: the "
                    "router leaves greedy's choice only where its score of its own choice exceeds its score of "
                    "greedy's by more than the margin; kept: the largest margin whose paired Δ to the best one "
                    "(the best worst-window Δ to greedy among the margins no selection window is significantly "
                    "worse than greedy at, beyond the gate's margin) is not significantly below minus the gate's "
                    "margin on any selection window; +inf (greedy itself) is always a candidate "
                    "(models.callbacks.pick_margin)")
    affinity_guard: bool = Field(
        True, description="a request that carries KV-prefix blocks or a session is served greedy's choice "
                          "(models.policy.holds): what its placement is worth depends on the requests that reuse "
                          "the prefix or session later, far beyond the labels' horizon, so the router cannot be "
                          "sure of a departure there")
    reward_prior: bool = Field(True, description="add the fixed one-step expected reward computed from the row's "
                                                 "exp_* features (models.policy.RewardPrior); the MLP learns the "
                                                 "correction and starts at zero")

    @model_validator(mode="after")
    def _positive(self) -> NetConfig:
        if any(h < 1 for h in self.hidden):
            raise ValueError("every hidden width must be >= 1")
        return self


class WarmStartConfig(Strict):
    """Rollout warm start of the Q-network before DQN (``models.warmstart``): candidate offerings
    of states on the train window are played out for ``horizon`` more requests under greedy and
    the network is regressed onto the differences in return."""

    samples: int = Field(16_000, ge=0, description="states labelled (0 = no warm start)")
    horizon: int = Field(40, ge=0, description="requests played out by greedy after the candidate action")
    top_k: int = Field(6, ge=1, description="candidates: the best this many by expected reward ...")
    random_actions: int = Field(0, ge=0, description="... plus this many random valid offerings (0: the top_k only; docs/results.md)")
    stride: int = Field(8, ge=1, description="requests between two labelled states")
    epochs: int = Field(12, ge=1, description="most epochs of the fit; the epoch kept is chosen on the selection windows")
    holdout: float = Field(0.2, ge=0, lt=1, description="share of the labelled states held out to choose the epoch "
                                                        "(by the realized advantage of the network's pick)")
    batch_size: int = Field(128, ge=1)
    learning_rate: float = Field(1e-3, gt=0)
    behaviour_epsilon: float = Field(0.1, ge=0, le=1, description="share of random valid actions on the walk")
    cache: bool = Field(True, description="keep the labelled states in <run_dir>/warm_start/ and reuse them in a later "
                                          "run with the same data, warm-start settings and labelling code")


class DQNConfig(Strict):
    """stable-baselines3 ``DQN`` arguments (same names). ``gamma`` and ``learning_rate`` are the
    defaults of trials whose search space does not set them."""

    learning_rate: float = Field(3e-5, gt=0)
    gamma: float = Field(0.975, ge=0, le=1)
    buffer_size: int = Field(50_000, ge=1)
    learning_starts: int = Field(1_000, ge=0)
    batch_size: int = Field(64, ge=1)
    tau: float = Field(1.0, gt=0, le=1)
    train_freq: int = Field(8, ge=1)
    gradient_steps: int = Field(1, ge=1)
    target_update_interval: int = Field(2_000, ge=1)
    exploration_fraction: float = Field(0.3, gt=0, le=1)
    exploration_initial_eps: float = Field(0.05, ge=0, le=1)
    exploration_final_eps: float = Field(0.02, ge=0, le=1)
    max_grad_norm: float = Field(10.0, gt=0)
    # the knobs of the fine-tuning ablations (docs/results.md, "Why DQN fine-tuning does not beat its warm
    # start"); the defaults are the main job's (the ablations' api-greedy without random offerings); SB3's own DQN
    # is n_steps 1, huber, siblings 0, td_weight 1, demo_weight 0, exploration uniform, warmup random
    n_steps: int = Field(1, ge=1, le=256, description="n-step returns (SB3's NStepReplayBuffer; the training "
                                                      "observation is then flattened to one Box, which SB3 needs "
                                                      "for them)")
    loss: Literal["huber", "mse"] = Field("huber", description="TD loss: SB3's Huber (smooth L1), or squared error")
    reward_scale: float = Field(1.0, gt=0, description="rewards (and the reward prior and the warm start's "
                                                       "targets with them) are multiplied by this while training; "
                                                       "the export is in reward units again")
    exploration: Literal["uniform", "top_k"] = Field(
        "top_k", description="an exploring step's offering: uniform over the valid ones, or uniform over the "
                               "exploration_top_k best valid ones by the current Q-values")
    exploration_top_k: int = Field(3, ge=2, description="offerings an exploring step draws from (exploration: top_k)")
    demo_weight: float = Field(1.0, ge=0, description="weight of the warm start's labelled states in every DQN "
                                                      "update (replay composition, DQfD-style): the squared error "
                                                      "of Q(s,a) - Q(s,greedy's a) against the rollout advantage")
    demo_batch_size: int = Field(32, ge=1, description="warm-start states per update when demo_weight > 0")
    siblings: int = Field(5, ge=0, le=16, description="before each training step (every sibling_every-th), also "
                                                     "play this many best offerings by expected reward and the one "
                                                     "taken on forks of the environment (same request, same draws) "
                                                     "and fit the differences of their TD targets (models.qnet."
                                                     "SiblingPlay); 0 = off. Needs n_steps 1 (sibling_horizon "
                                                     "instead)")
    sibling_weight: float = Field(1.0, ge=0, description="weight of that paired loss in every update")
    td_weight: float = Field(0.0, ge=0, description="weight of SB3's TD loss on the replayed transitions (0 = learn "
                                                   "from the paired siblings and demonstrations alone)")
    sibling_every: int = Field(4, ge=1, description="play the siblings at every this many steps")
    sibling_horizon: int = Field(41, ge=1, le=256, description="requests each sibling is played for (the later ones "
                                                              "routed as sibling_continuation says) before its "
                                                              "target bootstraps (if sibling_bootstrap)")
    sibling_batch_size: int = Field(16, ge=1, description="groups of siblings per update")
    sibling_buffer: int = Field(20_000, ge=1, description="the last this many groups are kept to draw from")
    sibling_gamma: float | None = Field(1.0, ge=0, le=1, description="discount within a sibling's rollout (null: "
                                                                       "the trial's gamma)")
    sibling_bootstrap: bool = Field(False, description="add gamma^h max Q_target(s_h) to a sibling's target (false: "
                                                      "the truncated h-request return, as the warm start's labels)")
    sibling_extra: Literal["taken", "policy", "none"] = Field(
        "taken", description="the sibling beside the `siblings` best: the action taken, the network's own choice "
                             "(not an exploring step's random offering, whose failures near -3 outweigh the "
                             "differences that decide), or none")
    sibling_continuation: Literal["policy", "greedy"] = Field(
        "greedy", description="who routes a sibling's later requests: the network being trained, or greedy (the "
                              "warm start's rollouts)")
    warmup: Literal["random", "policy"] = Field(
        "policy", description="the first learning_starts steps: random valid offerings (SB3's warm-up), or the warm "
                              "start's own epsilon-greedy choices (n-step returns over random actions are the random "
                              "policy's)")

    @model_validator(mode="after")
    def _siblings_one_step(self) -> DQNConfig:
        if self.siblings > 0 and self.n_steps > 1:
            raise ValueError("siblings: needs n_steps 1 (the siblings wrap the Dict observation; "
                             "sibling_horizon gives them multi-request targets)")
        return self


class SearchConfig(Strict):
    """Ray Tune grid: one trial per combination of these values."""

    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2, 3], min_length=1)
    gamma: list[float] = Field(default_factory=lambda: [0.95], description="empty = dqn.gamma")
    learning_rate: list[float] = Field(default_factory=list, description="empty = dqn.learning_rate")

    @model_validator(mode="after")
    def _ranges(self) -> SearchConfig:
        if any(not 0.0 <= g <= 1.0 for g in self.gamma):
            raise ValueError("every gamma must be in [0, 1]")
        if any(lr <= 0 for lr in self.learning_rate):
            raise ValueError("every learning_rate must be > 0")
        return self


class RayConfig(Strict):
    num_cpus: int = Field(2, ge=1, description="CPUs of the local Ray instance (ignored with --ray-address)")
    cpus_per_trial: float = Field(1.0, gt=0)
    max_concurrent_trials: int = Field(2, ge=1)


class MlflowConfig(Strict):
    experiment: str = Field("xroute-train", min_length=1)
    registered_model: str = Field("xroute-router", min_length=1)
    tracking_uri: str | None = Field(
        None, description="default: $MLFLOW_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db")


class FamilyTenant(Strict):
    """One tenant of a gate family: its share of the requests and how its SLOs are rescaled."""

    share: float = Field(gt=0, le=1, description="share of the requests (normalized over the family's tenants)")
    slo_scale: float = Field(1.0, gt=0, le=100, description="its requests' ttft_ms, tpot_ms and deadline_ms times "
                                                           "this (0.5: twice as strict)")


class GateFamily(Strict):
    """A family of gate scenarios that differs from training in what matters (``models.scenarios``,
    ``docs/results.md`` "Families in the gate"): the test windows of ``bundles`` at ``rates``, with
    the requests relabelled into tenants whose SLOs are rescaled, and the pools' capacity rescaled."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,39}$", description="the family's name in the gate's report")
    bundles: list[str] | None = Field(None, min_length=1, description="whose test windows (default: data.gate)")
    rates: list[float] = Field(default_factory=lambda: [1.0], min_length=1, description="loads")
    tenants: dict[str, FamilyTenant] = Field(
        default_factory=dict, description="the requests' tenants (by a hash of the request id) and their SLO scales; "
                                          "empty = as the bundle has them")
    capacity_scale: float = Field(1.0, gt=0, le=100, description="every pool's capacity_replicas times this (at least "
                                                                "1): scarce (< 1) or ample (> 1) capacity")
    seed: int = Field(0, description="the tenant relabelling's draw")

    @field_validator("rates")
    @classmethod
    def _rates(cls, v: list[float]) -> list[float]:
        if any(r <= 0 for r in v):
            raise ValueError("every rate must be > 0")
        return v


class DataConfig(Strict):
    """What ``xroute train`` learns from, selects on and is judged on. Bundles are names under
    ``data/bundles/`` (the shipped ones: ``default``, ``feb2024``, ``mar2024``) or directories.
    Training uses their ``train`` windows; checkpoint and trial selection the ``validation`` window
    of ``selection`` (a bundle not trained on: another distribution); the promotion gate and the
    report the ``test`` windows of ``gate``, which no selection saw. ``--telemetry`` (or
    ``telemetry``) replaces every list with one bundle."""

    train: list[str] = Field(default_factory=lambda: ["default", "feb2024", "mooncake", "asia"], min_length=1)
    train_families: list[GateFamily] = Field(
        default_factory=lambda: [GateFamily(name="slo-mix", tenants={
            "strict": FamilyTenant(share=0.34, slo_scale=0.6), "same": FamilyTenant(share=0.33),
            "relaxed": FamilyTenant(share=0.33, slo_scale=1.6)})], description="domain randomization: each training bundle also as these families have it "
                                          "(their tenants' SLO scales, capacity_scale; bundles = which of data.train, "
                                          "default all; rates are ignored: training draws rate_scales)")
    perturbed_copies: int = Field(1, ge=0, le=10, description="each training bundle also with its catalog perturbed "
                                                             "this many times (20 % dropped, as many copies added)")
    selection: list[str] = Field(
        default_factory=lambda: ["mar2024", "feb2024", "default"], min_length=1,
        description="bundles whose validation windows select warm-start epochs, checkpoints, margins and trials (one "
                    "name or a list)")
    selection_rates: list[float] = Field(
        default_factory=lambda: [1.0, 4.0], min_length=1,
        description="loads each selection window is replayed at; a candidate's score is its worst paired difference "
                    "to greedy over every window and load (robust to the one it was not selected for)")
    selection_families: list[GateFamily] = Field(
        default_factory=list,
        description="more selection windows, by family: the *validation* windows of the family's bundles (default: "
                    "data.selection) relabelled into its tenants (SLO scales, capacity_scale) at its rates, so the "
                    "margin's calibration and the trial choice see a shift in what requests ask for; never a gate "
                    "family's recipe (the gate's families stay unseen); none by default (configs/train.yaml sets one)")
    gate: list[str] = Field(default_factory=lambda: ["default", "feb2024", "mar2024", "mooncake"], min_length=1)
    gate_rates: list[float] = Field(default_factory=lambda: [1.0, 4.0], min_length=1)
    gate_seeds: int = Field(3, ge=2, le=50, description="seeds per gate scenario (paired intervals need two)")
    gate_families: list[GateFamily] = Field(
        default_factory=lambda: [GateFamily(
            name="strict-relaxed", bundles=["feb2024", "mar2024"], rates=[1.0, 4.0],
            tenants={"strict": FamilyTenant(share=0.5, slo_scale=0.5), "relaxed": FamilyTenant(share=0.5, slo_scale=2.0)})],
        description="more gate scenarios, by family (other SLO recipes and tenant mixes, scarce "
                                          "or ample capacity); the shipped windows are one family per bundle and the "
                                          "overload scenario one more")
    gate_margin: float = Field(
        0.0002, ge=0, le=1, description="non-inferiority to greedy in every gate scenario (each family at each load): "
                                        "the 95 % interval of the challenger's paired difference to greedy must lie "
                                        "above minus the larger of this (mean reward) ...")
    gate_margin_rel: float = Field(
        0.0025, ge=0, le=1, description="... and this times greedy's |mean reward| there (0.0025 x 0.08 = 0.0002 on "
                                        "the shipped windows; the overload scenario's rewards are 30x larger)")
    gate_overload: str | None = Field(
        "overload.yaml", description="an overload scenario for the gate too (configs/overload.yaml: a shipped bundle's window "
                          "on a few pools past their capacity, a noisy tenant beside a quiet one); None = none")

    @field_validator("selection", mode="before")
    @classmethod
    def _one_or_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("selection")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) < len(v):
            raise ValueError(f"each bundle once ({next(x for x in v if v.count(x) > 1)} repeats)")
        return v

    @field_validator("gate_rates", "selection_rates")
    @classmethod
    def _rates(cls, v: list[float]) -> list[float]:
        if any(r <= 0 for r in v):
            raise ValueError("every rate must be > 0")
        return v

    @model_validator(mode="after")
    def _train_family_bundles(self) -> DataConfig:
        for i, fam in enumerate(self.train_families):
            for k, b in enumerate(fam.bundles or []):
                if b not in self.train:
                    raise ValueError(f"train_families[{i}].bundles[{k}]: '{b}' is not one of data.train")
        return self

    @model_validator(mode="after")
    def _selection_families_unlike_the_gates(self) -> DataConfig:
        def recipe(f: GateFamily) -> Any:
            return ({k: (t.share, t.slo_scale) for k, t in f.tenants.items()}, f.capacity_scale, f.seed)

        for i, fam in enumerate(self.selection_families):
            for j, g in enumerate(self.gate_families):
                if recipe(fam) == recipe(g):
                    raise ValueError(f"selection_families[{i}]: the recipe of gate_families[{j}] '{g.name}' (the "
                                     "gate's families stay unseen by the selection)")
        return self

    @field_validator("gate_families", "train_families", "selection_families")
    @classmethod
    def _family_names(cls, v: list[GateFamily]) -> list[GateFamily]:
        names = [f.name for f in v]
        for n in names:
            if names.count(n) > 1 or n == "overload":
                raise ValueError(f"each family name once, and not 'overload' ('{n}' repeats or is reserved)")
        return v


class TrainConfig(Strict):
    """``configs/train.yaml``."""

    telemetry: str | None = Field(None, description="one bundle directory for training, selection and the gate "
                                                    "(default: the bundles of 'data')")
    data: DataConfig = DataConfig()
    run_dir: str = Field("runs", description="Tune results, MLflow store and exports (relative to the working "
                                               "directory)")
    evaluate_config: str = Field("evaluate.yaml", description="env, reward and baseline settings (under configs/)")
    total_timesteps: int = Field(0, ge=0, description="DQN fine-tuning steps per trial after the warm start "
                                 "(0: the warm start alone, the default: fine-tuning lowered the selection score in "
                                 "7 of 8 trials of the last main jobs; docs/results.md, issue 39 item 5)")
    episode_requests: int = Field(1024, ge=1, description="requests per training episode (random windows)")
    max_offerings: int | None = Field(None, ge=1, description="observation padding while training "
                                                              "(default: the evaluate config's)")
    rate_scales: list[float] = Field(default_factory=lambda: [1.0, 2.0, 4.0], min_length=1,
                                     description="each training episode replays its window at one of these loads")
    eval_every: int = Field(2_500, ge=1, description="validate (full validation window) every this many steps")
    progress_every: int = Field(1_000, ge=1, description="report training reward and loss every this many steps")
    seed: int = Field(0, description="seed of the splits' evaluation episodes and the warm start")
    split: SplitConfig = SplitConfig()
    net: NetConfig = NetConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    dqn: DQNConfig = DQNConfig()
    search: SearchConfig = SearchConfig()
    ray: RayConfig = RayConfig()
    mlflow: MlflowConfig = MlflowConfig()

    @field_validator("rate_scales")
    @classmethod
    def _rates(cls, v: list[float]) -> list[float]:
        if any(r <= 0 for r in v):
            raise ValueError("every rate scale must be > 0")
        return v

    def run_path(self) -> Path:
        p = Path(self.run_dir).expanduser()
        return p.resolve()  # relative to the working directory, like every path a user gives

    def evaluate_settings(self) -> EvaluateConfig:
        path = config_path(self.evaluate_config)
        if not path.exists():
            if self.evaluate_config == "evaluate.yaml":
                return EvaluateConfig()
            raise ConfigError(f"train config: field 'evaluate_config': {path} not found")
        return load_config(EvaluateConfig, path)


def load_train_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """``configs/train.yaml`` (or ``path``), validated; ``overrides`` are merged at the top level."""
    if path is None:
        default = config_path("train.yaml")
        data, source = (read_yaml(default), str(default)) if default.exists() else ({}, "train config")
    else:
        data, source = read_yaml(path), str(path)
    data = {**data, **(overrides or {})}
    return parse_config(TrainConfig, data, source)


# ------------------------------------------------------------------------------------------ the planner
class PlannerDataConfig(Strict):
    """What ``xroute train-planner`` learns from, selects on and is judged on (bundles as in
    :class:`DataConfig`): the training bundles' *train* windows, the selection bundles' *validation*
    windows, the gate bundles' *test* windows -- none of which the earlier ones saw."""

    train: list[str] = Field(default_factory=lambda: ["default", "feb2024", "asia", "mooncake"], min_length=1)
    loads: list[int] = Field(default_factory=lambda: [1, 2, 4], min_length=1,
                             description="load_scale of the training episodes (one world per bundle and load)")
    selection: list[str] = Field(default_factory=lambda: ["mar2024", "feb2024", "default"], min_length=1)
    selection_loads: list[int] = Field(default_factory=lambda: [1, 4], min_length=1)
    selection_seeds: int = Field(2, ge=1, le=50)
    gate: list[str] = Field(default_factory=lambda: ["default", "feb2024", "mar2024"], min_length=1)
    gate_loads: list[int] = Field(default_factory=lambda: [1, 4], min_length=1)
    gate_seeds: int = Field(3, ge=2, le=50, description="seeds per gate window (paired intervals need two)")

    @field_validator("loads", "selection_loads", "gate_loads")
    @classmethod
    def _loads(cls, v: list[int]) -> list[int]:
        if any(x < 1 or x > 100 for x in v):
            raise ValueError("every load must be in 1..100 (the stream that many times over)")
        return v


class PlannerLabelsConfig(Strict):
    """The labels (``models.planner_train.collect_labels``): the oracle's plans and the traces' outcomes."""

    episodes: int = Field(40, ge=0, description="training episodes the hindsight oracle plans (0: no network)")
    episode_epochs: int = Field(15, ge=2, le=1000, description="epochs per training episode")
    horizon_epochs: int = Field(5, ge=1, description="the oracle's capacity share is taken over this many epochs")
    risk_epochs: int = Field(10, ge=1, description="the risk head predicts a preemption within this many epochs")


class PlannerFitConfig(Strict):
    """The scorer's fit (``models.planner_train.fit_scorer``)."""

    hidden: list[int] = Field(default_factory=lambda: [64, 64], min_length=1)
    epochs: int = Field(150, ge=0)
    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    holdout: float = Field(0.2, ge=0, lt=1, description="share of the labelled episodes held out to choose the epoch")
    risk_weight: float = Field(1.0, ge=0, description="weight of the risk head's loss beside the cloning loss")


class PlannerSearchConfig(Strict):
    """The cost-sensitive fine-tune (``models.planner_train.search_knobs``): the cross-entropy method
    over the allocator's knobs on training episodes."""

    iterations: int = Field(5, ge=0)
    population: int = Field(10, ge=2)
    episodes: int = Field(8, ge=1, description="training episodes each candidate plays, per iteration")
    elite: float = Field(0.3, gt=0, le=1)
    slo_miss_usd: float = Field(0.02, ge=0, description="the objective's price of one request that misses its SLO "
                                                        "(USD, beside the held cost)")
    hazard_floors: list[float] = Field(
        default_factory=lambda: [0.0, 0.5, 1.0], min_length=1,
        description="after the search, each trial tries its knobs with hazard_price raised to at least each of these "
                    "(the training traces rarely show how a pool with an extreme recorded hazard ends) ...")
    hedge_floors: list[float] = Field(default_factory=lambda: [0.0, 0.5], min_length=1,
                                      description="... with hedge raised to at least each of these ...")
    keep_launching: list[bool] = Field(default_factory=lambda: [False, True], min_length=1,
                                       description="... and with keep_launching each of these, on the selection "
                                                   "windows, and keeps the best variant (selection_criterion)")
    selection_criterion: Literal["worst", "mean"] = Field(
        "worst", description="a variant's (and a trial's) score on the selection windows: the worst window's mean "
                             "ln(penalized cost / best baseline's) -- as the gate, which refuses a loss anywhere -- or "
                             "the mean over the windows")

    @field_validator("hazard_floors", "hedge_floors")
    @classmethod
    def _floors(cls, v: list[float]) -> list[float]:
        if any(x < 0 for x in v):
            raise ValueError("every floor must be >= 0")
        return v


class PlannerTrialsConfig(Strict):
    """Ray Tune's grid: one trial per seed and scorer (``network``: the fitted scorer; ``none``: the
    zero network, the knobs searched alone -- the ablation)."""

    seeds: list[int] = Field(default_factory=lambda: [0, 1], min_length=1)
    scorers: list[Literal["network", "none"]] = Field(default_factory=lambda: ["network", "none"],  # type: ignore[arg-type]
                                                      min_length=1)


class PlannerTrainConfig(Strict):
    """``configs/planner.yaml``: ``xroute train-planner`` (``models.planner_trainer``)."""

    run_dir: str = Field("runs", description="Tune results, the MLflow store and exports (relative to the working "
                                             "directory)")
    capacity_config: str = Field("capacity.yaml", description="the world and the baselines (under configs/)")
    seed: int = 0
    split: SplitConfig = SplitConfig()
    data: PlannerDataConfig = PlannerDataConfig()
    labels: PlannerLabelsConfig = PlannerLabelsConfig()
    fit: PlannerFitConfig = PlannerFitConfig()
    search: PlannerSearchConfig = PlannerSearchConfig()
    trials: PlannerTrialsConfig = PlannerTrialsConfig()
    ray: RayConfig = RayConfig()
    mlflow: MlflowConfig = MlflowConfig(experiment="xroute-planner", registered_model="xroute-planner")

    def run_path(self) -> Path:
        return Path(self.run_dir).expanduser().resolve()

    def capacity_settings(self) -> CapacityConfig:
        path = config_path(self.capacity_config)
        if not path.exists():
            raise ConfigError(f"planner config: field 'capacity_config': {path} not found")
        return load_config(CapacityConfig, path)


def load_planner_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PlannerTrainConfig:
    """``configs/planner.yaml`` (or ``path``), validated; ``overrides`` are merged at the top level."""
    if path is None:
        default = config_path("planner.yaml")
        data, source = (read_yaml(default), str(default)) if default.exists() else ({}, "planner config")
    else:
        data, source = read_yaml(path), str(path)
    data = {**data, **(overrides or {})}
    return parse_config(PlannerTrainConfig, data, source)
