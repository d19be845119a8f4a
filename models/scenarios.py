"""What ``xroute train`` learns from, selects on and is judged on.

* **Bundles** by name (``data/bundles/<name>``: ``default``, ``feb2024``, ``mar2024`` -- real data of
  three windows of the shared traces) or by directory, each cut by time into train / validation /
  test windows (:func:`split_bundle`).
* **Training**: the train windows of the ``data.train`` bundles, each also with its catalog
  perturbed (offerings dropped, copies added, order shuffled), replayed at the loads of
  ``rate_scales`` -- one drawn per episode (:class:`ScenarioMix`).
* **Selection** (warm-start epoch, DQN checkpoint, margin, trial): the validation windows of the
  ``data.selection`` bundles (never trained on: the training mix holds train windows only), each at
  each of ``data.selection_rates``; a candidate's score is its worst paired difference in mean
  reward to greedy over those windows and loads. ``data.selection_families`` add the validation
  windows of their bundles relabelled into their tenants (SLO scales; :func:`family_bundle`, the
  gate families' one definition) at their rates: a shift in what requests ask for that the
  margin's calibration and the trial choice see -- validation windows only, never a test window.
* **Gate and report**: the test windows of the ``data.gate`` bundles at each of ``data.gate_rates``,
  which no selection saw; the routers start from the outputs of the windows before (``history``).
* **Episodes**: the environment config a training episode runs with (:func:`train_env_config`)
  and the one a window is evaluated with (:func:`eval_env_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from models.config import SplitConfig, TrainConfig
from xroute.bundle import Bundle, bundle_root, load_bundle
from xroute.config import EnvConfig, EvaluateConfig, ServingTier
from xroute.errors import BundleError, ConfigError
from xroute.resources import shipped_bundles
from xroute.schema.policy_ir import PolicySet

SPLITS = ("train", "validation", "test")


def train_env_config(cfg: TrainConfig, eval_cfg: EvaluateConfig, n_offerings: int) -> EnvConfig:
    """The evaluate config's env (same reward, same dynamics) with training episodes and padding."""
    pad = cfg.max_offerings or max(n_offerings, 1)
    if pad < n_offerings:
        raise ConfigError(f"train config: field 'max_offerings': the bundle has {n_offerings} offerings, more than {pad}")
    return eval_cfg.env.model_copy(update={"episode_requests": cfg.episode_requests, "max_offerings": pad})


def eval_env_config(eval_cfg: EvaluateConfig, rate_scale: float | None = None,
                    env: dict[str, Any] | None = None) -> EnvConfig:
    """The env a window is evaluated with: the whole window, at ``rate_scale``, with a scenario's
    ``env`` settings (validated: nested settings become their models)."""
    upd: dict[str, Any] = {"episode_requests": None}
    if rate_scale is not None:
        upd["rate_scale"] = rate_scale
    if env:
        return EnvConfig.model_validate({**eval_cfg.env.model_dump(), **env, **upd})
    return eval_cfg.env.model_copy(update=upd)


@dataclass
class Splits:
    """The three windows ``[start, end)`` of the workload and the bundles cut to them."""

    windows: dict[str, tuple[pd.Timestamp, pd.Timestamp]]
    bundles: dict[str, Bundle]

    def history(self, name: str) -> pd.DataFrame | None:
        """The requests of the windows before ``name``: their outputs are known when it starts, so
        the routers' output estimators start from them."""
        before = [self.bundles[w].workload for w in SPLITS[: SPLITS.index(name)]]
        return pd.concat(before, ignore_index=True) if before else None

    def describe(self) -> dict[str, dict[str, Any]]:
        return {k: {"start": str(s), "end": str(e), "requests": len(self.bundles[k].workload)}
                for k, (s, e) in self.windows.items()}


def split_bundle(bundle: Bundle, split: SplitConfig) -> Splits:
    """Cut the workload at fractions of its time span: train, then validation, then test."""
    t0, t1 = bundle.time_span()
    span = t1 - t0
    c1 = t0 + span * split.train
    c2 = c1 + span * split.validation
    end = t1 + pd.Timedelta(microseconds=1)
    windows = {"train": (t0, c1), "validation": (c1, c2), "test": (c2, end)}
    bundles = {}
    for name, (s, e) in windows.items():
        try:
            bundles[name] = bundle.window(s, e)
        except BundleError:
            raise ConfigError(f"train config: field 'split.{name}': the {name} window {s} .. {e} holds no "
                              "requests; widen it") from None
    return Splits(windows, bundles)


def resolve_bundle(ref: str | Path | None, source: str) -> Bundle:
    """A bundle by name (a directory under ``data/bundles/``) or path (default: the shipped one); a
    missing one is a ConfigError naming ``source``."""
    if ref is None:
        return load_bundle(None)
    p = bundle_root(ref)
    if not p.exists():
        raise ConfigError(f"{source}: bundle '{ref}' not found (a directory, or one of the shipped bundles: "
                          f"{', '.join(shipped_bundles())})")
    return load_bundle(p)


@dataclass
class Scenario:
    """One stream a policy is run on: a label, the window's bundle, the requests before it and a load."""

    label: str
    bundle: Bundle
    history: pd.DataFrame | None
    rate: float = 1.0
    #: env settings this scenario changes (the overload scenario's tenants and admission)
    env: dict[str, Any] | None = None
    #: what the gate judges it with (non-inferiority per family): a bundle's own label for the shipped
    #: windows, ``overload``, or a ``data.gate_families`` name
    family: str = ""

    def __post_init__(self) -> None:
        if not self.family:
            self.family = self.label.split(" ")[0]


@dataclass
class Scenarios:
    train: list[Scenario]  # rate is drawn per episode (TrainConfig.rate_scales)
    selection: list[Scenario]  # the validation windows, each at several loads
    gate: list[Scenario]
    bundle_hashes: dict[str, str]

    def describe(self) -> dict[str, Any]:
        def one(s: Scenario) -> dict[str, Any]:
            t0, t1 = s.bundle.time_span()
            return {"label": s.label, "requests": len(s.bundle.workload), "start": str(t0), "end": str(t1),
                    "offerings": len(s.bundle.offerings), "rate": s.rate}

        return {"train": [one(s) for s in self.train], "selection": [one(s) for s in self.selection],
                "gate": [one(s) for s in self.gate], "bundle_hashes": self.bundle_hashes}

    @property
    def max_offerings(self) -> int:
        return max(len(s.bundle.offerings) for s in [*self.train, *self.selection, *self.gate])


def build_scenarios(cfg: TrainConfig, telemetry: str | Path | None = None) -> Scenarios:
    """The scenarios of ``cfg.data`` (or of one bundle: ``telemetry``, else ``cfg.telemetry``)."""
    from xroute.catalog_tools import perturb_catalog

    d = cfg.data
    one = telemetry if telemetry is not None else cfg.telemetry
    src = "--telemetry" if telemetry is not None else "train config: field 'telemetry'"
    names: dict[str, str] = {}
    if one is not None:
        names = {"train": str(one), "selection": str(one), "gate": str(one)}
    whole: dict[str, Bundle] = {}
    loaded: dict[str, Splits] = {}
    hashes: dict[str, str] = {}

    def bundle(ref: str, field: str) -> Bundle:  # (each bundle read once, whatever uses it)
        if ref not in whole:
            whole[ref] = resolve_bundle(ref, field if one is None else src)
        return whole[ref]

    def splits(ref: str, field: str) -> Splits:
        if ref not in loaded:
            b = bundle(ref, field)
            loaded[ref] = split_bundle(b, cfg.split)
            hashes[_label(ref)] = b.content_hash
        return loaded[ref]

    train_refs = [names["train"]] if one is not None else d.train
    train = []
    for k, ref in enumerate(train_refs):
        sp = splits(ref, f"train config: field 'data.train[{k}]'")
        train.append(Scenario(_label(ref), sp.bundles["train"], sp.history("train")))
        for c in range(d.perturbed_copies):
            pb = perturb_catalog(sp.bundles["train"], 0.2, seed=1000 + 17 * k + c)
            train.append(Scenario(f"{_label(ref)}~perturbed{c}", pb, None))
        for fam in d.train_families if one is None else []:
            if fam.bundles is not None and ref not in fam.bundles:
                continue
            fb = split_bundle(family_bundle(bundle(ref, f"train config: field 'data.train[{k}]'"), fam), cfg.split)
            train.append(Scenario(f"{fam.name}:{_label(ref)}", fb.bundles["train"], fb.history("train"),
                                  family=fam.name))
    selection = []
    for k, ref in enumerate([names["selection"]] if one is not None else d.selection):
        sp = splits(ref, f"train config: field 'data.selection[{k}]'")
        for r in d.selection_rates:
            selection.append(Scenario(f"{_label(ref)} x{r:g}", sp.bundles["validation"], sp.history("validation"), r))
    for i, fam in enumerate(d.selection_families if one is None else []):  # validation windows only
        for k, ref in enumerate(fam.bundles or d.selection):
            b = family_bundle(bundle(ref, f"train config: field 'data.selection_families[{i}].bundles[{k}]'"), fam)
            sp = split_bundle(b, cfg.split)
            hashes[f"selection:{fam.name}/{_label(ref)}"] = b.content_hash
            for r in fam.rates:
                selection.append(Scenario(f"{fam.name}:{_label(ref)} x{r:g}", sp.bundles["validation"],
                                          sp.history("validation"), r, family=fam.name))
    gate = []
    for k, ref in enumerate([names["gate"]] if one is not None else d.gate):
        sp = splits(ref, f"train config: field 'data.gate[{k}]'")
        for r in d.gate_rates:
            gate.append(Scenario(f"{_label(ref)} x{r:g}", sp.bundles["test"], sp.history("test"), r))
    if d.gate_overload is not None and one is None:  # the overload scenario (configs/overload.yaml)
        from xroute.config import config_path

        sc, _ = overload_scenario(config_path(d.gate_overload), cfg.split)
        sc.family = "overload"
        gate.append(sc)
        hashes[sc.label] = sc.bundle.content_hash
    for i, fam in enumerate(d.gate_families if one is None else []):
        for k, ref in enumerate(fam.bundles or d.gate):
            field = f"train config: field 'data.gate_families[{i}].bundles[{k}]'"
            b = family_bundle(bundle(ref, field), fam)
            sp = split_bundle(b, cfg.split)
            hashes[f"{fam.name}/{_label(ref)}"] = b.content_hash
            for r in fam.rates:
                gate.append(Scenario(f"{fam.name}:{_label(ref)} x{r:g}", sp.bundles["test"], sp.history("test"), r,
                                     family=fam.name))
    return Scenarios(train, selection, gate, hashes)


def _label(ref: str | Path) -> str:
    return Path(str(ref)).name or str(ref)


class ScenarioMix(gym.Env):  # type: ignore[type-arg]
    """The training environment: each episode replays one of the training scenarios' environments
    (uniformly) at a load drawn from ``rate_scales``, from the mix's own generator. Every
    environment pads its observation to the same ``max_offerings``, so the spaces are one."""

    metadata = {"render_modes": []}  # noqa: RUF012

    def __init__(self, envs: list[Any], rate_scales: list[float], seed: int):
        super().__init__()
        if not envs:
            raise ValueError("no training environment")
        if len({repr(e.observation_space) + repr(e.action_space) for e in envs}) != 1:
            raise ConfigError("train config: the training bundles' environments differ in their spaces "
                              "(set max_offerings to cover every catalog)")
        self.envs, self.rate_scales = list(envs), list(rate_scales)
        self.observation_space, self.action_space = envs[0].observation_space, envs[0].action_space
        self.rng = np.random.default_rng(seed)
        self.current = envs[0]

    def pick(self, rng: np.random.Generator | None = None) -> Any:
        """The next episode's environment, its load set (not yet reset)."""
        g = rng if rng is not None else self.rng
        env = self.envs[int(g.integers(len(self.envs)))]
        rate = float(g.choice(self.rate_scales))
        if env.rate_scale != rate:
            env.set_rate_scale(rate)
        self.current = env
        return env

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        env = self.pick()
        return env.reset(seed=int(self.rng.integers(2**31)), options=options)

    def step(self, action: int) -> Any:
        return self.current.step(action)


class OverloadTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    share: float = Field(gt=0, le=1)
    band: str = "standard"
    weight: float = Field(1.0, gt=0)


class OverloadConfig(BaseModel):
    """``configs/overload.yaml`` (its comments say what each field is)."""

    model_config = ConfigDict(extra="forbid")
    bundle: str = "default"
    window: str = Field("test", pattern="^(train|validation|test)$")
    offerings: list[str] = Field(min_length=1)
    rate_scale: float = Field(2.0, gt=0)
    seed: int = 0
    tenants: dict[str, OverloadTenant] = Field(min_length=1)
    #: the operator's serving tiers of the pools (``EnvConfig.tiers``) and the policies saying which
    #: requests may use them (``EnvConfig.policies``); tools/overload.py --tiers off runs without both
    tiers: list[ServingTier] = Field(default_factory=list)
    policies: PolicySet | None = None


def _request_draw(workload: pd.DataFrame, salt: str) -> np.ndarray:
    """One uniform draw in [0, 1) per request, a hash of its request id and ``salt``: the same request,
    the same draw, whatever the window (what :func:`relabel_tenants` and :func:`thin_tenants` draw on)."""
    ids = workload["request_id"].astype(str)
    return (pd.util.hash_pandas_object(ids + f"#{salt}", index=False).to_numpy() % 1_000_003) / 1_000_003.0


def relabel_tenants(bundle: Bundle, shares: dict[str, float], seed: int) -> Bundle:
    """The bundle with each request's ``tenant`` drawn from ``shares`` (normalized) by a hash of its
    request id and ``seed``: the same request, the same tenant, whatever the window."""
    names = list(shares)
    cum = np.cumsum([shares[n] for n in names])
    cum = cum / cum[-1]
    u = _request_draw(bundle.workload, str(seed))
    w = bundle.workload.copy()
    w["tenant"] = [names[int(k)] for k in np.searchsorted(cum, u, side="right").clip(0, len(names) - 1)]
    from dataclasses import replace

    return replace(bundle, workload=w, content_hash=bundle.content_hash + f"-tenants{seed}")


def family_bundle(bundle: Bundle, fam: Any) -> Bundle:
    """``bundle`` as a gate family (``models.config.GateFamily``) has it: its requests relabelled into
    the family's tenants (a hash of the request id, as :func:`relabel_tenants`), each tenant's SLOs
    (``ttft_ms``, ``tpot_ms``, ``deadline_ms``) times its ``slo_scale``, and every pool's
    ``capacity_replicas`` times ``capacity_scale`` (at least 1). What the requests are and when they
    come is unchanged: only what a request asks for and what serves it."""
    from dataclasses import replace

    if fam.tenants:
        bundle = relabel_tenants(bundle, {k: t.share for k, t in fam.tenants.items()}, fam.seed)
        w = bundle.workload.copy()
        scale = w["tenant"].map({k: t.slo_scale for k, t in fam.tenants.items()}).astype(float)
        for col in ("ttft_ms", "tpot_ms", "deadline_ms"):
            if col in w.columns:
                w[col] = w[col] * scale
        bundle = replace(bundle, workload=w, content_hash=bundle.content_hash + "-slo" + "-".join(
            f"{k}{t.share:g}x{t.slo_scale:g}" for k, t in fam.tenants.items()))
    if fam.capacity_scale != 1.0:
        if bundle.inventory is not None:
            raise ConfigError(f"gate family '{fam.name}': capacity_scale cannot rescale {bundle.path}: its pools "
                              "follow the instances its inventory table reports")
        o = bundle.offerings.copy()
        if "capacity_replicas" in o.columns:
            o["capacity_replicas"] = (o["capacity_replicas"].astype(float) * fam.capacity_scale).round().clip(
                lower=1).astype("int64")
        bundle = replace(bundle, offerings=o, content_hash=bundle.content_hash + f"-cap{fam.capacity_scale:g}")
    return bundle


def thin_tenants(bundle: Bundle, keep: dict[str, float], seed: int) -> Bundle:
    """The bundle with a share ``keep[t]`` (0..1) of tenant ``t``'s requests kept, drawn by a hash of
    the request id and ``seed`` (another draw than :func:`relabel_tenants`'), the rest dropped: the
    other tenants' requests are the same ones at the same times. ``tools/overload.py --share`` runs
    the overload scenario with the noisy tenant at its fair share this way."""
    from dataclasses import replace

    w = bundle.workload
    u = _request_draw(w, f"thin{seed}")
    frac = w["tenant"].map(keep).fillna(1.0).to_numpy(dtype=float)
    w = w[u < frac].reset_index(drop=True)
    tag = "-".join(f"{k}{v:g}" for k, v in sorted(keep.items()))
    return replace(bundle, workload=w, content_hash=bundle.content_hash + f"-thin{seed}-{tag}")


def overload_scenario(path: str | Path, split: SplitConfig,
                      shares: dict[str, float] | None = None) -> tuple[Scenario, dict[str, Any]]:
    """The overload scenario of ``path`` (``configs/overload.yaml``): its window's bundle on the
    named offerings with the tenants relabelled, and the env settings it runs under (no tenant
    budgets; the admission's tenants). ``shares`` sends a tenant at a lower share of the stream than
    the config's by dropping the rest of its requests (:func:`thin_tenants`; the isolation check: the
    noisy tenant at its fair share against at 10x it). A ConfigError names a bad field."""
    from xroute.catalog_tools import select_offerings
    from xroute.config import parse_config, read_yaml

    oc = parse_config(OverloadConfig, read_yaml(path), str(path))
    adm = {"tenants": {k: {"band": t.band, "weight": t.weight} for k, t in oc.tenants.items()}}
    parse_config(EnvConfig, {"admission": adm}, str(path))  # (an unknown band named here, not mid-run)
    tiered: dict[str, Any] = {"tiers": oc.tiers} if oc.tiers else {}
    if oc.policies is not None:
        tiered["policies"] = oc.policies
    b = select_offerings(resolve_bundle(oc.bundle, f"{path}: field 'bundle'"), oc.offerings)
    b = relabel_tenants(b, {k: t.share for k, t in oc.tenants.items()}, oc.seed)
    for name, share in (shares or {}).items():
        if name not in oc.tenants:
            raise ConfigError(f"{path}: share for tenant '{name}': no such tenant (the config's: "
                              f"{', '.join(oc.tenants)})")
        if not 0 < share <= oc.tenants[name].share:
            raise ConfigError(f"{path}: share for tenant '{name}': {share:g} must be in (0, "
                              f"{oc.tenants[name].share:g}], its share in the config (requests are only dropped)")
    if shares:
        b = thin_tenants(b, {k: v / oc.tenants[k].share for k, v in shares.items()}, oc.seed)
    sp = split_bundle(b, split)
    sc = Scenario(f"{_label(oc.bundle)} overload x{oc.rate_scale:g}", sp.bundles[oc.window], sp.history(oc.window),
                  oc.rate_scale, env={"tenants": {}, "admission": adm, **tiered})
    return sc, {"config": oc.model_dump()}
