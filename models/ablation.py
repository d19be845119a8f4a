"""Why does DQN fine-tuning not beat its own warm start? The ablation runner.

``python -m models.ablation --config configs/ablation.yaml`` trains every *variant* (overrides of
the train config: the DQN knobs of ``models.config.DQNConfig`` -- n-step returns, target updates,
exploration under the mask, reward scale, loss, demonstrations in every update, gamma, learning
rate, budget) for every seed, in this process, one at a time (``models.trial.run_trial``, without
Ray), and measures what fine-tuning did: the paired difference in mean reward between the
fine-tuned router and **its own warm start alone** on the gate's test windows (every gate bundle at
every gate load, ``eval_seeds`` seeds; no checkpoint selection saw them), for the checkpoint the
trial selects (``best``) and for the last one (``last``: no selection at all), per seed and pooled
over the seeds with a 95 % t-interval.

Everything goes to MLflow (experiment ``mlflow.experiment``): one parent run per invocation with
the summary table (``ablation.md``, ``ablation.json``), the variants' learning curves side by side
(``ablation_curves.png``: the selection score of each checkpoint, the rollout-labelled advantage of
the network's picks on the warm start's states, |TD error| and the action gap) and the Δ chart
(``ablation_delta.png``); a child run per variant and seed (the trial's own run: params, metrics
per step, its learning-curve plot), tagged ``xroute.variant``. The warm start's labelled states are
collected once and cached (``warm_cache``), and each (seed, gamma, reward scale)'s warm-start fit
is shared by the variants that differ only after it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from models.config import TrainConfig, load_train_config
from xroute.config import Strict, parse_config, read_yaml
from xroute.errors import ConfigError, XrouteError


class Variant(Strict):
    name: str = Field(min_length=1, max_length=80)
    overrides: dict[str, Any] = Field(default_factory=dict, description="merged into the train config (nested "
                                                                        "keys merge: {dqn: {n_steps: 5}})")
    gamma: float | None = Field(None, ge=0, le=1, description="the trial's gamma (default: the base's dqn.gamma)")
    learning_rate: float | None = Field(None, gt=0, description="the trial's learning rate (default: dqn's)")


class AblationConfig(Strict):
    """``configs/ablation.yaml``."""

    train_config: str | None = Field(None, description="the base train config (default configs/train.yaml)")
    base: dict[str, Any] = Field(default_factory=dict, description="overrides of the base for every variant")
    seeds: list[int] = Field(default_factory=lambda: [0, 1], min_length=1)
    eval_seeds: int = Field(3, ge=2, le=20, description="seeds of the gate-window evaluation (paired intervals)")
    run_dir: str = Field("runs/ablation", description="exports, the warm-start cache, the MLflow store")
    warm_cache: bool = Field(True, description="reuse the labelled warm-start states of an earlier invocation "
                                               "with the same data and warm-start settings")
    variants: list[Variant] = Field(min_length=1)

    @field_validator("variants")
    @classmethod
    def _unique(cls, v: list[Variant]) -> list[Variant]:
        names = [x.name for x in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"variant names must be unique ({dup[0]} repeats)")
        return v


def base_config(acfg: AblationConfig) -> TrainConfig:
    """The train config every variant starts from: ``train_config`` with ``base`` merged in."""
    return variant_config(load_train_config(acfg.train_config), Variant(name="base", overrides=acfg.base),
                          "ablation config: field 'base'")


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def variant_config(base: TrainConfig, variant: Variant, source: str | None = None) -> TrainConfig:
    """The train config of ``variant`` (its overrides merged into ``base``), validated."""
    data = _merge(base.model_dump(mode="json"), variant.overrides)
    return parse_config(TrainConfig, data, source or f"ablation variant '{variant.name}': overrides")


class WarmFits(dict):  # type: ignore[type-arg]
    """The fitted warm starts by (seed, gamma, reward scale) -- ``models.callbacks.WarmStartCallback``'s
    cache -- kept on disk too (``warm_fit_<data key>_<seed>_<gamma>_<scale>.pt``), so a later
    invocation with the same labelled states and settings does not fit them again."""

    def __init__(self, root: Path, data_key: str):
        super().__init__()
        self.root, self.data_key = root, data_key

    def _path(self, key: Any) -> Path:
        seed, gamma, scale = key
        return self.root / f"warm_fit_{self.data_key}_{seed}_{gamma:g}_{scale:g}.pt"

    def __contains__(self, key: object) -> bool:
        if super().__contains__(key):
            return True
        p = self._path(key)
        if not p.exists():
            return False
        import torch as th

        from models.warmstart import FitReport

        blob = th.load(p, weights_only=False)
        super().__setitem__(key, (blob["state"], FitReport(**blob["report"])))
        return True

    def __setitem__(self, key: Any, value: Any) -> None:
        import dataclasses

        import torch as th

        super().__setitem__(key, value)
        th.save({"state": value[0], "report": dataclasses.asdict(value[1])}, self._path(key))


def _rewards(results: list[Any], name: str) -> np.ndarray:
    r = next(x for x in results if x.name == name)
    return np.array([run.metrics["mean_reward"] for run in r.runs])


def evaluate_vs_warm(scenarios: list[Any], routers: dict[str, str], eval_cfg: Any, seeds: int,
                     cache: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    """Per scenario label, each router's (and greedy's) mean reward per seed on the scenario's
    window; ``cache`` holds what was evaluated before (by export directory)."""
    from models import evaluate as ev
    from models.scenarios import eval_env_config

    def key(d: str) -> str:  # the same weights and margin (e.g. one warm start, several variants): evaluated once
        p = Path(d)
        if not p.is_dir():
            return d
        h = hashlib.sha256(str(json.loads((p / "router.json").read_text()).get("margin")).encode())
        with np.load(p / "router.npz") as z:
            for k in sorted(z.files):
                h.update(k.encode() + np.ascontiguousarray(z[k]).tobytes())
        return h.hexdigest()

    keys = {d: key(d) for d in [*routers.values(), "greedy"]}
    out: dict[str, dict[str, np.ndarray]] = {}
    for s in scenarios:
        cfg = eval_cfg.model_copy(update={"env": eval_env_config(eval_cfg, s.rate, s.env)})
        got = cache.setdefault(s.label, {})
        todo = list(dict.fromkeys(d for d in keys if keys[d] not in got))
        if todo:
            res = ev.evaluate(s.bundle, todo, cfg, show_progress=False, seeds=seeds, history=s.history)
            for d in todo:
                got[keys[d]] = _rewards(res, d)
        out[s.label] = {n: got[keys[d]] for n, d in [*routers.items(), ("greedy", "greedy")]}
    return out


def scenario_diffs(pa: dict[str, dict[str, Any]], pb: dict[str, dict[str, Any]], a: str, b: str) -> np.ndarray:
    """``pa[scenario][a] - pb[scenario][b]`` for the scenarios both hold: (scenarios, evaluation seeds).
    ``pa`` and ``pb`` are rows' ``per_scenario`` (the same row's for a Δ within one run)."""
    return np.stack([np.asarray(pa[lab][a]) - np.asarray(pb[lab][b]) for lab in pa if lab in pb])


def paired(per_scenario: dict[str, dict[str, np.ndarray]], a: str, b: str) -> tuple[float, float, float]:
    """Pooled paired Δ (a − b): per seed the mean over scenarios, then a 95 % t-interval."""
    from models.evaluate import t_interval

    return t_interval(scenario_diffs(per_scenario, per_scenario, a, b).mean(axis=0))


def _fmt(iv: tuple[float, float, float]) -> str:
    m, lo, hi = iv
    return f"{m:+.5f} [{lo:+.5f}, {hi:+.5f}]" if math.isfinite(lo) else f"{m:+.5f}"


def run_ablation(acfg: AblationConfig, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Every variant x seed (module docstring); returns the summary that is also logged."""
    import mlflow

    from models import evaluate as ev
    from models import loader, registry, tracking
    from models.scenarios import build_scenarios, eval_env_config, train_env_config
    from models.trial import TrialContext, run_trial
    from models.warmstart_labels import cached_warm_start, label_key

    base = base_config(acfg)
    run_dir = Path(acfg.run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfgs = {v.name: variant_config(base, v) for v in acfg.variants}  # (every variant validated before anything runs)
    sc = build_scenarios(base)
    eval_cfg = base.evaluate_settings()
    bundle_hash = ",".join(f"{k}={v}" for k, v in sc.bundle_hashes.items())
    env_cfg = train_env_config(base, eval_cfg, sc.max_offerings)
    for name, c in cfgs.items():
        if train_env_config(c, c.evaluate_settings(), sc.max_offerings) != env_cfg or c.data != base.data:
            raise ConfigError(f"ablation variant '{name}': overrides: the environment and the data must be the "
                              "base's (the variants are compared on the same windows, from the same warm start)")
    uri = loader.tracking_uri(run_dir, base.mlflow.tracking_uri)
    exp_id = registry.setup(uri, base.mlflow.experiment, run_dir)
    echo(f"MLflow: {uri} (experiment '{base.mlflow.experiment}')")
    warm = cached_warm_start(base, env_cfg, sc.train, bundle_hash, run_dir if acfg.warm_cache else None, False, echo)
    sel = sc.selection[0]
    sel_cfg = eval_cfg.model_copy(update={"env": eval_env_config(eval_cfg, sel.rate)})
    baseline_runs = ev.evaluate(sel.bundle, ["greedy", "cheapest"], sel_cfg, show_progress=False, seeds=2,
                                history=sel.history)
    # one directory per invocation, also for two started in the same second (each would overwrite the other's table)
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    warm_fits = WarmFits(run_dir, label_key(base, bundle_hash, env_cfg) + "-" + hashlib.sha256(json.dumps(
        [base.net.model_dump(mode="json"), base.warm_start.model_dump(mode="json", exclude={"cache"}),
         base.data.selection[0] if len(base.data.selection) == 1 else base.data.selection,  # (one: its name alone)
         base.data.selection_rates]).encode()).hexdigest()[:8])
    eval_cache: dict[str, dict[str, np.ndarray]] = {}
    rows: list[dict[str, Any]] = []
    curves: dict[str, list[dict[str, Any]]] = {}
    with tracking.training_run(exp_id, f"ablation-{stamp}", bundle_hash) as parent:
        mlflow.log_dict(acfg.model_dump(mode="json"), "ablation_config.json")
        mlflow.log_params({"variants": ",".join(cfgs)[:490], "seeds": ",".join(map(str, acfg.seeds)),
                           "eval_seeds": acfg.eval_seeds, "gate": ",".join(s.label for s in sc.gate)[:490]})
        for v in acfg.variants:
            cfg = cfgs[v.name]
            for seed in acfg.seeds:
                params = {"seed": seed, "gamma": v.gamma if v.gamma is not None else cfg.dqn.gamma,
                          "learning_rate": v.learning_rate if v.learning_rate is not None else cfg.dqn.learning_rate}
                ctx = TrialContext(cfg=cfg, eval_cfg=eval_cfg, train=sc.train, selection=sc.selection,
                                   bundle_hash=bundle_hash, baseline_runs=baseline_runs, warm_data=warm,
                                   max_offerings=sc.max_offerings, tracking_uri=uri, experiment_id=exp_id,
                                   parent_run_id=parent.info.run_id,
                                   out_dir=str(run_dir / "trials" / stamp / v.name.replace("/", "_")),
                                   extra_params={"variant": v.name, "selection": sel.label}, warm_cache=warm_fits,
                                   save_last=True)
                t0 = time.perf_counter()
                echo(f"variant {v.name}, seed {seed}: {cfg.total_timesteps} DQN steps ...")
                res = run_trial(params, ctx)
                train_s = time.perf_counter() - t0
                routers = {"warm start": res["warm_dir"], "fine-tuned (best)": res["router_dir"]}
                if res.get("last_dir"):
                    routers["fine-tuned (last)"] = res["last_dir"]
                per = evaluate_vs_warm(sc.gate, routers, eval_cfg, acfg.eval_seeds, eval_cache)
                row = {"variant": v.name, "seed": seed, **params, "best_step": res["best_step"],
                       "last_step": res["last_step"], "margin": res["margin"], "train_s": round(train_s, 1),
                       "val_criterion_warm": res["warm_start_val_criterion"],
                       "val_criterion_best": res["val_criterion_no_margin"],
                       "per_scenario": {lab: {k: v_.tolist() for k, v_ in d.items()} for lab, d in per.items()}}
                for name in ("fine-tuned (best)", "fine-tuned (last)"):
                    if name in routers:
                        row[f"{name} - warm start"] = paired(per, name, "warm start")
                row["warm start - greedy"] = paired(per, "warm start", "greedy")
                rows.append(row)
                curves.setdefault(v.name, []).append({"seed": seed, "curve": res["curve"],
                                                      "run_id": res["mlflow_run_id"]})
                if res.get("mlflow_run_id"):
                    client = mlflow.MlflowClient()
                    client.set_tag(res["mlflow_run_id"], "xroute.variant", v.name)
                    for name in ("fine-tuned (best)", "fine-tuned (last)"):
                        if f"{name} - warm start" in row:
                            m, lo, hi = row[f"{name} - warm start"]
                            key = "ablation_delta_" + ("best" if "best" in name else "last")
                            client.log_metric(res["mlflow_run_id"], key, m)
                            if math.isfinite(lo):
                                client.log_metric(res["mlflow_run_id"], key + "_lo", lo)
                                client.log_metric(res["mlflow_run_id"], key + "_hi", hi)
                echo(f"  fine-tuned (best, step {res['best_step']}) − warm start: "
                     f"{_fmt(row['fine-tuned (best) - warm start'])}; last (step {res['last_step']}): "
                     f"{_fmt(row.get('fine-tuned (last) - warm start', (float('nan'),) * 3))}; "
                     f"warm start − greedy {_fmt(row['warm start - greedy'])} ({train_s:.0f} s)")
        summary = summarize(rows, cfgs)
        out_dir = run_dir / "trials" / stamp
        out_dir.mkdir(parents=True, exist_ok=True)
        scales = {n: c.dqn.reward_scale for n, c in cfgs.items()}
        steps = {n: c.total_timesteps for n, c in cfgs.items()}
        (out_dir / "ablation.json").write_text(json.dumps({"rows": rows, "summary": summary, "curves": curves,
                                                           "scales": scales, "steps": steps, "tracking_uri": uri,
                                                           "experiment": base.mlflow.experiment},
                                                          indent=2, default=float))
        (out_dir / "ablation.md").write_text(summary["markdown"])
        plot_curves(curves, rows, out_dir / "ablation_curves.png", uri, scales)
        plot_deltas(summary, out_dir / "ablation_delta.png")
        for f in ("ablation.json", "ablation.md", "ablation_curves.png", "ablation_delta.png"):
            mlflow.log_artifact(str(out_dir / f))
        for s in summary["variants"]:
            slug = "".join(ch if ch.isalnum() or ch in "_-." else "_" for ch in s["variant"])
            mlflow.log_metrics({f"delta_best.{slug}": s["best"][0], f"delta_last.{slug}": s["last"][0]})
    echo(summary["markdown"])
    return {"rows": rows, "summary": summary, "tracking_uri": uri, "out_dir": str(out_dir)}


def run_noise_study(acfg: AblationConfig, n_states: int, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """:func:`noise_study` on the ablation's base config, logged to its MLflow experiment."""
    import mlflow

    from models import loader, registry

    base = base_config(acfg)
    run_dir = Path(acfg.run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    uri = loader.tracking_uri(run_dir, base.mlflow.tracking_uri)
    exp_id = registry.setup(uri, base.mlflow.experiment, run_dir)
    res = noise_study(base, n_states, echo=echo)
    with mlflow.start_run(experiment_id=exp_id, run_name=f"noise-study-{time.strftime('%Y%m%d-%H%M%S')}"):
        mlflow.log_metrics({k: float(v) for k, v in res.items() if isinstance(v, (int, float))})
        mlflow.log_text(res["markdown"], "noise_study.md")
    return res


def summarize(rows: list[dict[str, Any]], cfgs: dict[str, Any]) -> dict[str, Any]:
    """Per variant, the pooled Δ to the warm start over its seeds (each seed's own warm start):
    the per-seed pooled means, then a t-interval over seeds x scenarios' seeds; and, with two or more
    training seeds, the stricter interval over the training seeds' means alone (``*_by_seed``: a
    training run's own randomness -- exploration, the minibatches -- is then the unit, not the
    evaluation seed)."""
    from models.evaluate import t_interval

    out: list[dict[str, Any]] = []
    for name in cfgs:
        rs = [r for r in rows if r["variant"] == name]
        if not rs:
            continue

        def per_seed(key: str, rs: list[dict[str, Any]] = rs) -> list[np.ndarray] | None:
            a, b = key.split(" - ")
            if any(a not in next(iter(r["per_scenario"].values())) for r in rs):
                return None
            return [scenario_diffs(r["per_scenario"], r["per_scenario"], a, b).mean(axis=0) for r in rs]

        def pooled(key: str) -> tuple[float, float, float]:
            d = per_seed(key)
            return t_interval(np.concatenate(d)) if d is not None else (float("nan"),) * 3

        def by_seed(key: str) -> tuple[float, float, float]:
            d = per_seed(key)
            if d is None or len(d) < 2:
                return (float("nan"),) * 3
            return t_interval(np.asarray([x.mean() for x in d]))

        steps = cfgs[name] if isinstance(cfgs[name], int) else cfgs[name].total_timesteps
        out.append({"variant": name, "seeds": len(rs), "steps": steps,
                    "best": pooled("fine-tuned (best) - warm start"), "last": pooled("fine-tuned (last) - warm start"),
                    "best_by_seed": by_seed("fine-tuned (best) - warm start"),
                    "last_by_seed": by_seed("fine-tuned (last) - warm start"),
                    "warm_vs_greedy": pooled("warm start - greedy"),
                    "best_steps": [r["best_step"] for r in rs], "train_s": round(float(np.mean([r["train_s"] for r in rs])), 1)})
    lines = ["| variant | DQN steps | seeds | fine-tuned (best checkpoint) − warm start | fine-tuned (last) − warm start "
             "| over training seeds only: best / last | warm start − greedy | checkpoint kept (step) | train s |",
             "|---|---:|---:|---|---|---|---|---|---:|"]
    for s in out:
        seeds_only = f"{_fmt(s['best_by_seed'])} / {_fmt(s['last_by_seed'])}" if s["seeds"] >= 2 else "(one seed)"
        lines.append(f"| {s['variant']} | {s['steps']:,} | {s['seeds']} | {_fmt(s['best'])} | {_fmt(s['last'])} | "
                     f"{seeds_only} | {_fmt(s['warm_vs_greedy'])} | {', '.join(map(str, s['best_steps']))} | "
                     f"{s['train_s']:.0f} |")
    return {"variants": out, "markdown": "\n".join(lines) + "\n"}


def plot_curves(curves: dict[str, list[dict[str, Any]]], rows: list[dict[str, Any]], path: Path, uri: str,
                scales: dict[str, float] | None = None) -> None:
    """Five panels, every variant (mean over its seeds): the selection score per checkpoint, the
    probe advantage of the network's picks and the churn of its choices, |TD error| and the action
    gap (from the trial runs; both divided by the variant's reward scale: reward units)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    fig, axes = plt.subplots(1, 5, figsize=(26, 4.8))
    keys = [("val_criterion", "selection score: worst Δ reward vs greedy", False),
            ("probe_advantage", "probe: rollout advantage of the pick", False),
            ("probe_churn", "probe: share of choices changed since the warm start", False),
            ("td_abs", "|TD error| (training batches, reward units)", True),
            ("action_gap", "action gap: best − 2nd Q (reward units)", True)]
    for k, (name, items) in enumerate(curves.items()):
        color = plt.get_cmap("tab20")(k % 20)
        scale = (scales or {}).get(name, 1.0)
        for ax, (key, _, scaled) in zip(axes, keys):
            series: dict[int, list[float]] = {}
            for it in items:
                if it["run_id"] is None:
                    continue
                for m in client.get_metric_history(it["run_id"], key):
                    series.setdefault(int(m.step), []).append(float(m.value) / (scale if scaled else 1.0))
            if series:
                st = sorted(series)
                ax.plot(st, [float(np.mean(series[s])) for s in st], "o-", ms=3, color=color, label=name)
    for ax, (key, title, _) in zip(axes, keys):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("DQN steps (0 = the warm start)")
        ax.grid(alpha=0.3)
        if key == "td_abs":
            ax.set_yscale("log")
    axes[0].axhline(0.0, color="black", lw=1)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_deltas(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = summary["variants"]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(vs) + 3), 4.5))
    x = np.arange(len(vs))
    for off, key, color, label in ((-0.18, "best", "tab:blue", "best checkpoint"), (0.18, "last", "tab:orange", "last")):
        m = np.array([v[key][0] for v in vs])
        lo = np.array([v[key][1] for v in vs])
        hi = np.array([v[key][2] for v in vs])
        err = np.where(np.isfinite(lo), np.vstack([m - lo, hi - m]), 0.0)
        ax.errorbar(x + off, m, yerr=err, fmt="o", color=color, capsize=3, label=label)
    ax.axhline(0.0, color="black", lw=1)
    ax.set_xticks(x, [v["variant"] for v in vs], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("Δ mean reward vs its own warm start (gate windows, 95 % CI)")
    ax.set_title("does fine-tuning beat the warm start?")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def noise_study(cfg: TrainConfig, n_states: int = 300, redraws: int = 4, seed: int = 0,
                echo: Callable[[str], None] = print) -> dict[str, Any]:
    """How much signal a DQN sample carries, against what it must resolve, on the training mix.

    Along greedy's episodes (``cfg.rate_scales`` loads, the train windows): the per-request reward's
    deviation from its one-step expectation (``expected_rewards``: what the router knows), i.e. the
    noise one TD sample carries before any bootstrapping; and, at ``n_states`` states, the effect to
    resolve -- greedy's choice against the second-best by expected reward, each played
    ``warm_start.horizon`` requests ahead under greedy (the warm start's label) -- measured three
    ways: with common random numbers (the warm start: both play-outs see the same service-time
    draws), under ``redraws`` fresh draws of the future's noise still paired, and unpaired (each
    play-out its own draw, as two TD samples of two actions are). Returns the figures and a table."""
    from envs.cloud_route import CloudRouteEnv
    from models.scenarios import ScenarioMix, build_scenarios, train_env_config
    from models.warmstart import fork

    sc = build_scenarios(cfg)
    env_cfg = train_env_config(cfg, cfg.evaluate_settings(), sc.max_offerings)
    mix = ScenarioMix([CloudRouteEnv(s.bundle, env_cfg, history=s.history) for s in sc.train], cfg.rate_scales, seed)
    rng = np.random.default_rng(seed)
    h, stride = cfg.warm_start.horizon, cfg.warm_start.stride

    def play(env: Any, first: int, z: np.ndarray | None) -> float:
        sim = fork(env)
        if z is not None:
            sim.z = z
        out, done = sim.step_outcome(first)
        g = float(out["reward"])
        for _ in range(h):
            if done:
                break
            out, done = sim.step_outcome(int(np.argmax(sim.expected_rewards())))
            g += float(out["reward"])
        return g

    resid: list[float] = []
    crn: list[float] = []
    paired_sd: list[float] = []
    unpaired_sd: list[float] = []
    env = mix.pick(rng)
    env.reset(seed=int(rng.integers(2**31)))
    since = 0
    t0 = time.perf_counter()
    while len(crn) < n_states:
        r_exp = env.expected_rewards()
        order = np.argsort(-r_exp, kind="stable")
        g = int(order[0])
        # (a state where requests wait in the admission's queue is skipped: its "future" by stream position
        # would miss them -- a queued request's service draw is still ahead of it)
        waiting = env.admission is not None and bool(env.admission.queue)
        if since >= stride and env.steps_left > h + 1 and np.isfinite(r_exp[order[1]]) and not waiting:
            since = 0
            a = int(order[1])
            crn.append(play(env, a, None) - play(env, g, None))
            k = env._pos - env._ep_start
            pd_, ud = [], []
            for _ in range(redraws):
                z1, z2 = env.z.copy(), env.z.copy()  # the future's service-time draws, redrawn
                z1[k:] = rng.standard_normal(len(z1) - k)
                z2[k:] = rng.standard_normal(len(z2) - k)
                pd_.append(play(env, a, z1) - play(env, g, z1))
                ud.append(play(env, a, z1) - play(env, g, z2))
            paired_sd.append(float(np.std(pd_, ddof=1)))
            unpaired_sd.append(float(np.std(ud, ddof=1)))
        out, done = env.step_outcome(g)
        resid.append(float(out["reward"]) - float(r_exp[g]))
        since += 1
        if done:
            env = mix.pick(rng)
            env.reset(seed=int(rng.integers(2**31)))
            since = 0
    d = np.abs(np.array(crn))
    res: dict[str, Any] = {"states": n_states, "horizon": h, "redraws": redraws, "steps": len(resid),
           "reward_noise_sd": float(np.std(resid)), "effect_median_abs": float(np.median(d)),
           "effect_mean_abs": float(d.mean()), "paired_label_sd": float(np.sqrt(np.mean(np.square(paired_sd)))),
           "unpaired_label_sd": float(np.sqrt(np.mean(np.square(unpaired_sd)))),
           "seconds": round(time.perf_counter() - t0, 1)}
    # samples for a 2-sigma answer to "is a better than greedy's choice here?"
    res["samples_unpaired"] = float((2 * res["unpaired_label_sd"] / max(res["effect_median_abs"], 1e-12)) ** 2)
    res["samples_paired"] = float((2 * res["paired_label_sd"] / max(res["effect_median_abs"], 1e-12)) ** 2)
    res["markdown"] = (
        "| quantity | value |\n|---|---:|\n"
        f"| one request's reward minus its one-step expectation, sd (what one TD sample carries) | "
        f"{res['reward_noise_sd']:.4f} |\n"
        f"| effect to resolve: 2nd-best minus greedy's choice over {h} requests, median abs | "
        f"{res['effect_median_abs']:.5f} |\n"
        f"| ... label noise, paired (same service-time draws, the warm start's labels), sd | "
        f"{res['paired_label_sd']:.5f} |\n"
        f"| ... label noise, unpaired (independent draws, as TD samples of two actions), sd | "
        f"{res['unpaired_label_sd']:.5f} |\n"
        f"| samples per decision for a 2-sigma answer, paired / unpaired | "
        f"{res['samples_paired']:.1f} / {res['samples_unpaired']:.0f} |\n")
    echo(res["markdown"])
    return res


def _all_rows(run_dir: str | Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The rows of every invocation under ``run_dir`` by (variant, seed); a seed run twice: its latest."""
    root = Path(run_dir).expanduser().resolve()
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for f in sorted(root.glob("trials/*/ablation.json")):
        for r in json.loads(f.read_text()).get("rows", []):
            rows[(r["variant"], int(r["seed"]))] = r
    return rows


def compare(run_dir: str | Path, a: str, b: str, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Across variants (``--compare A B``): variant A's fine-tuned router (best checkpoint) minus
    variant B's warm start alone, paired by training seed, gate scenario and evaluation seed (the
    windows and evaluation seeds are the same in every invocation), pooled over the seeds both ran
    with a 95 % t-interval. The control of a fine-tuning that adds labelled states: B = a warm start
    given as many more (``configs/ablation_control.yaml``)."""
    from models.evaluate import t_interval

    rows = _all_rows(run_dir)
    seeds = sorted({s for (v, s) in rows if v == a} & {s for (v, s) in rows if v == b})
    if not seeds:
        have = sorted({v for v, _ in rows})
        raise ConfigError(f"--compare: no training seed that both '{a}' and '{b}' ran under {run_dir} "
                          f"(variants there: {', '.join(have) or 'none'})")
    diffs, per = [], {}
    for s in seeds:
        ra, rb = rows[(a, s)]["per_scenario"], rows[(b, s)]["per_scenario"]
        d = scenario_diffs(ra, rb, "fine-tuned (best)", "warm start")
        per.update({f"{lab} (seed {s})": t_interval(d[i]) for i, lab in enumerate(x for x in ra if x in rb)})
        diffs.append(d.mean(axis=0))
    pooled = t_interval(np.concatenate(diffs))
    # the stricter interval: over the training seeds' means alone
    by_seed = t_interval(np.asarray([d.mean() for d in diffs])) if len(diffs) >= 2 else (float("nan"),) * 3
    lines = [f"| scenario | {a} (fine-tuned, best) − {b} (warm start alone) |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in per.items()] + [f"| **pooled** ({len(seeds)} seed(s)) | "
                                                                f"**{_fmt(pooled)}** |"]
    if len(diffs) >= 2:
        lines.append(f"| over the training seeds' means only | {_fmt(by_seed)} |")
    md = "\n".join(lines) + "\n"
    echo(md)
    return {"a": a, "b": b, "seeds": seeds, "pooled": pooled, "by_seed": by_seed, "per_scenario": per,
            "markdown": md}


def combine(run_dir: str | Path, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Every ablation invocation under ``run_dir`` (their ``ablation.json``) as one table and one
    pair of figures, logged as an MLflow run ``ablation-combined`` (the rows of a variant run more
    than once -- other seeds -- pool; a seed run twice counts once, its latest)."""
    import mlflow

    root = Path(run_dir).expanduser().resolve()
    files = sorted(root.glob("trials/*/ablation.json"))
    if not files:
        raise ConfigError(f"--combine: no ablation.json under {root / 'trials'}")
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    curves: dict[str, dict[int, dict[str, Any]]] = {}
    scales: dict[str, float] = {}
    steps: dict[str, int] = {}
    uri, experiment = None, "xroute-ablation"
    for f in files:
        d = json.loads(f.read_text())
        if "curves" not in d:
            continue
        uri, experiment = d["tracking_uri"], d.get("experiment", experiment)
        for r in d["rows"]:
            rows[(r["variant"], int(r["seed"]))] = r
        for name, items in d["curves"].items():
            for it in items:
                curves.setdefault(name, {})[int(it["seed"])] = it
        scales.update(d["scales"])
        steps.update(d["steps"])
    order = list(dict.fromkeys(r["variant"] for r in rows.values()))
    all_rows = list(rows.values())
    summary = summarize(all_rows, {n: steps[n] for n in order})
    out_dir = root / "combined"
    out_dir.mkdir(parents=True, exist_ok=True)
    assert uri is not None
    plot_curves({n: list(curves[n].values()) for n in order if n in curves}, all_rows, out_dir / "ablation_curves.png",
                uri, scales)
    plot_deltas(summary, out_dir / "ablation_delta.png")
    (out_dir / "ablation.md").write_text(summary["markdown"])
    (out_dir / "ablation.json").write_text(json.dumps({"rows": all_rows, "summary": summary}, indent=2, default=float))
    from models import registry

    exp_id = registry.setup(uri, experiment, root)
    with mlflow.start_run(experiment_id=exp_id, run_name=f"ablation-combined-{time.strftime('%Y%m%d-%H%M%S')}"):
        for art in ("ablation.md", "ablation.json", "ablation_curves.png", "ablation_delta.png"):
            mlflow.log_artifact(str(out_dir / art))
        for v in summary["variants"]:
            slug = "".join(ch if ch.isalnum() or ch in "_-." else "_" for ch in v["variant"])
            mlflow.log_metrics({f"delta_best.{slug}": v["best"][0], f"delta_last.{slug}": v["last"][0]})
    echo(summary["markdown"])
    return {"summary": summary, "out_dir": str(out_dir)}


def load_ablation_config(path: str | Path) -> AblationConfig:
    return parse_config(AblationConfig, read_yaml(path), str(path))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.ablation", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/ablation.yaml")
    ap.add_argument("--only", nargs="*", help="run only these variants (by name)")
    ap.add_argument("--seeds", type=int, nargs="*", help="these seeds instead of the config's")
    ap.add_argument("--noise", type=int, default=0, metavar="N",
                    help="instead: the noise study on N states (noise_study), logged as its own MLflow run")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"),
                    help="instead: variant A's fine-tuned router minus variant B's warm start alone, paired, from "
                         "the earlier invocations under run_dir (compare)")
    ap.add_argument("--combine", action="store_true",
                    help="instead: every earlier invocation's results under run_dir as one table and figures")
    args = ap.parse_args(argv)
    try:
        acfg = load_ablation_config(args.config)
        if args.noise:
            run_noise_study(acfg, args.noise)
            return 0
        if args.combine:
            combine(acfg.run_dir)
            return 0
        if args.compare:
            compare(acfg.run_dir, *args.compare)
            return 0
        if args.only:
            unknown = sorted(set(args.only) - {v.name for v in acfg.variants})
            if unknown:
                raise ConfigError(f"--only: no variant named '{unknown[0]}' in {args.config}")
            acfg = acfg.model_copy(update={"variants": [v for v in acfg.variants if v.name in args.only]})
        if args.seeds:
            acfg = acfg.model_copy(update={"seeds": list(args.seeds)})
        run_ablation(acfg)
    except XrouteError as e:
        print(f"ablation: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
