"""stable-baselines3 callbacks of a training trial: the rollout warm start, validation with model
selection, and progress reports (to Ray Tune and MLflow)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

Report = Callable[[dict[str, Any], "str | None"], None]


def _log_metrics(metrics: dict[str, float], step: int) -> None:
    import mlflow

    mlflow.log_metrics({k: float(v) for k, v in metrics.items() if v is not None and np.isfinite(v)}, step=step)


class WarmStartCallback(BaseCallback):
    """Before the first DQN step: fit the Q-network to rollout-labelled states of the train window
    (``models.warmstart``; labelled once per ``xroute train`` and shared by its trials); the
    target network is then synced."""

    def __init__(self, data: Any, cfg: Any, gamma: float, seed: int, log_mlflow: bool = False,
                 validation: Any = None):
        super().__init__()
        self.data, self.cfg, self.gamma, self.seed = data, cfg, gamma, seed
        #: the trial's ValidationCallback: its window chooses the fit's epoch (models.warmstart.fit)
        self.validation = validation
        self.log_mlflow = log_mlflow
        self.losses: list[float] = []
        self.report: Any = None
        self.seconds = 0.0

    def _on_training_start(self) -> None:
        from models import warmstart as ws

        c, data = self.cfg, self.data
        t0 = time.perf_counter()
        level = min(self.gamma, 0.99) / (1.0 - min(self.gamma, 0.99)) * float(np.mean(data.greedy_reward))
        model: Any = self.model
        q_net = model.q_net
        select = None
        if self.validation is not None:
            from models.policy import LearnedPolicy
            from models.qnet import export_router
            from xroute.evaluate import run_policy

            val = self.validation

            def select() -> float:
                run = run_policy(val.val_env, LearnedPolicy(export_router(q_net)), val.eval_seed)
                return float(run.metrics["mean_reward"])

        self.report = ws.fit(q_net, data, level, c.epochs, c.batch_size, c.learning_rate, self.seed, c.holdout,
                             select)
        self.losses = self.report.train_loss
        model.q_net_target.load_state_dict(q_net.state_dict())
        self.seconds = time.perf_counter() - t0
        if self.log_mlflow:
            for i, loss in enumerate(self.losses):
                _log_metrics({"warm_start_loss": loss}, i + 1)
            for i, (hl, hg, sv) in enumerate(zip(self.report.hold_loss, self.report.hold_gain, self.report.selection)):
                _log_metrics({"warm_start_holdout_loss": hl, "warm_start_holdout_gain": hg,
                              "warm_start_val_mean_reward": sv}, i)
            _log_metrics({"warm_start_fit_s": self.seconds, "warm_start_label_s": data.seconds,
                          "warm_start_states": len(data), "warm_start_best_epoch": self.report.best_epoch,
                          "warm_start_positive_advantage": float((data.advantage > 1e-9).mean())}, 0)

    def _on_step(self) -> bool:
        return True


@dataclass
class Checkpoint:
    step: int
    weights: Any  # models.policy.RouterWeights
    run: Any  # xroute.evaluate.PolicyRun on the validation window


class ValidationCallback(BaseCallback):
    """Every ``every`` steps (and before the first and after the last), export the Q-network to
    numpy and replay the whole validation window with it; keep the best export (model
    selection by validation mean reward)."""

    def __init__(self, val_env: Any, every: int, seed: int, meta: dict[str, Any], report: Report | None = None,
                 log_mlflow: bool = False):
        super().__init__()
        self.val_env, self.every, self.eval_seed, self.meta = val_env, every, seed, meta
        self.report, self.log_mlflow = report, log_mlflow
        self.best: Checkpoint | None = None
        #: the first checkpoint (step 0: the warm start alone, before any DQN step; the ablation's)
        self.initial: Checkpoint | None = None
        self.curve: list[tuple[int, float]] = []
        self.train_curve: list[tuple[int, float]] = []
        self.last_reward = float("nan")
        self._last_step = -1

    def validate(self, model: Any) -> None:
        from models.policy import LearnedPolicy
        from models.qnet import export_router
        from xroute.evaluate import run_policy

        step = int(model.num_timesteps)
        if step == self._last_step:
            return
        self._last_step = step
        weights = export_router(model.q_net, dict(self.meta))
        run = run_policy(self.val_env, LearnedPolicy(weights), self.eval_seed)
        run.name = "dqn"
        r = float(run.metrics["mean_reward"])
        self.curve.append((step, r))
        self.last_reward = r
        if self.best is None or r > self.best.run.metrics["mean_reward"]:
            weights.meta.update({"step": step, "val_mean_reward": r,
                                 "val_sla_attainment": run.metrics["sla_attainment"]})
            self.best = Checkpoint(step, weights, run)
        if self.initial is None:
            self.initial = Checkpoint(step, weights, run)
        metrics = {"val_mean_reward": r, "val_sla_attainment": run.metrics["sla_attainment"],
                   "val_cost_per_1k_requests": run.metrics["cost_per_1k_requests"],
                   "val_latency_p95_ms": run.metrics["latency_p95_ms"]}
        if self.log_mlflow:
            _log_metrics(metrics, step)
        if self.report is not None:
            self.report({"timesteps": step, **metrics, "best_val_mean_reward": self.best.run.metrics["mean_reward"],
                         "train_reward": self.train_reward()}, None)

    def train_reward(self) -> float:
        buf = getattr(self.model, "ep_info_buffer", None) if self.model is not None else None
        if not buf:
            return float("nan")
        return float(np.mean([e["r"] / max(e["l"], 1) for e in buf]))

    def _on_training_start(self) -> None:
        self.validate(self.model)

    def _on_step(self) -> bool:
        if self.num_timesteps % self.every == 0:
            self.validate(self.model)
        return True

    def finish(self, model: Any) -> None:
        self.validate(model)

    def plot_curve(self, path: str | Path, references: list[Any] | None = None, warm: Any = None) -> None:
        """Three panels a reviewer compares: (1) the selection-window reward of every checkpoint with
        the references -- each baseline's mean and 95 % interval over seeds (``references``:
        ``xroute.evaluate.PolicyResult`` on the same window) -- and the checkpoint kept; (2) the warm
        start's fit: the selection-window reward after each epoch (epoch 0 = the prior alone, greedy)
        and the epoch kept; (3) the training episodes' reward, which includes exploration and the
        other loads of the mix, so it is not comparable to (1)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, axw, axt) = plt.subplots(1, 3, figsize=(16, 4.5))
        if self.curve:
            s, r = zip(*self.curve)
            ax.plot(s, r, "o-", color="tab:blue", label="DQN checkpoints (numpy export)")
        refs = sorted((references or []), key=lambda x: -x.metrics["mean_reward"])[:3]
        for k, ref in enumerate(refs):
            m, (lo, hi) = ref.metrics["mean_reward"], ref.ci["mean_reward"]
            c = ["tab:green", "tab:orange", "tab:gray"][k]
            ax.axhline(m, color=c, ls="--", lw=1, label=f"{ref.name} (mean over {len(ref.runs)} seeds)")
            if np.isfinite(lo):
                ax.axhspan(lo, hi, color=c, alpha=0.15)
        if self.best is not None:
            ax.axvline(self.best.step, color="gray", ls=":", label=f"kept (step {self.best.step})")
        ax.set_xlabel("DQN environment steps (0 = the warm start)")
        ax.set_ylabel("mean reward per request, selection window")
        ax.set_title("selection window: checkpoints vs the baselines")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        rep = getattr(warm, "report", None)
        if rep is not None and rep.selection:
            axw.plot(range(len(rep.selection)), rep.selection, "o-", color="tab:purple", label="selection-window reward")
            axw.axvline(rep.best_epoch, color="gray", ls=":", label=f"kept (epoch {rep.best_epoch})")
            if refs:
                axw.axhline(refs[0].metrics["mean_reward"], color="tab:green", ls="--", lw=1, label=refs[0].name)
            axw.set_xlabel("warm-start epoch (0 = the prior alone)")
            axw.legend(fontsize=7)
        else:
            axw.text(0.5, 0.5, "no warm start", ha="center", va="center", transform=axw.transAxes)
        axw.set_title("warm-start fit")
        axw.grid(alpha=0.3)
        if self.train_curve:
            s, r = zip(*self.train_curve)
            axt.plot(s, r, color="tab:red", alpha=0.7)
        axt.set_xlabel("DQN environment steps")
        axt.set_ylabel("mean reward per request")
        axt.set_title("training episodes (exploration, mixed loads)")
        axt.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


class ProgressCallback(BaseCallback):
    """Every ``every`` steps: training reward and TD loss to Ray Tune (trial status) and MLflow."""

    def __init__(self, every: int, validation: ValidationCallback, report: Report | None = None,
                 log_mlflow: bool = False):
        super().__init__()
        self.every, self.validation = every, validation
        self.report, self.log_mlflow = report, log_mlflow
        self.t0 = time.perf_counter()

    def _on_training_start(self) -> None:
        self.t0 = time.perf_counter()

    def _on_step(self) -> bool:
        if self.num_timesteps % self.every:
            return True
        step = int(self.num_timesteps)
        tr = self.validation.train_reward()
        loss = self.model.logger.name_to_value.get("train/loss") if self.model.logger is not None else None
        self.validation.train_curve.append((step, tr))
        metrics = {"train_reward": tr, "exploration_rate": float(getattr(self.model, "exploration_rate", 0.0)),
                   "steps_per_s": step / max(time.perf_counter() - self.t0, 1e-9)}
        if loss is not None:
            metrics["td_loss"] = float(loss)
        if self.log_mlflow:
            _log_metrics(metrics, step)
        if self.report is not None:
            self.report({"timesteps": step, **metrics, "val_mean_reward": self.validation.last_reward,
                         "best_val_mean_reward": (self.validation.best.run.metrics["mean_reward"]
                                                  if self.validation.best else float("nan"))}, None)
        return True
