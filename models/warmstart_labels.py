"""The warm start's labelled states for one ``xroute train``: ``warm_start.samples`` states of the
training mix, each candidate labelled by rollouts (``models.warmstart.collect``), collected once
and shared by every trial -- in ``ray.max_concurrent_trials`` parallel Ray tasks, or in this
process without Ray."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from envs.cloud_route import CloudRouteEnv
from models import warmstart as ws
from models.config import TrainConfig
from models.scenarios import Scenario, ScenarioMix
from xroute.config import EnvConfig


def collect_chunk(cfg: TrainConfig, env_cfg: EnvConfig, scenarios: list[Scenario], n_states: int, seed: int,
                  progress_output: bool = False) -> Any:
    """Label ``n_states`` states of the training mix for the warm start (one process, one thread)."""
    c = cfg.warm_start
    mix = ScenarioMix([CloudRouteEnv(sc.bundle, env_cfg, history=sc.history) for sc in scenarios], cfg.rate_scales,
                      seed)
    every = max(1, n_states // 5)
    t0 = time.perf_counter()

    def progress(k: int) -> None:  # printed by the Ray task; Ray forwards it to the driver's console
        if k % every == 0 and k < n_states:
            print(f"warm start: {k}/{n_states} states labelled ({time.perf_counter() - t0:.0f} s)", flush=True)

    return ws.collect(mix.pick, n_states, c.horizon, c.top_k, c.random_actions, c.stride, c.behaviour_epsilon,
                      np.random.default_rng(seed), progress if progress_output else None)


def collect_warm_start(cfg: TrainConfig, env_cfg: EnvConfig, scenarios: list[Scenario], use_ray: bool,
                       echo: Callable[[str], None]) -> Any:
    """The shared warm-start data set, labelled in ``ray.max_concurrent_trials`` parallel chunks."""
    n = cfg.warm_start.samples
    if n <= 0:
        return None
    k = max(1, min(cfg.ray.max_concurrent_trials, n)) if use_ray else 1
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    seeds = [cfg.seed * 1000 + 17 + i for i in range(k)]
    t0 = time.perf_counter()
    echo(f"warm start: labelling {n} states of {len(scenarios)} training scenarios by {cfg.warm_start.horizon}-request "
         "rollouts "
         f"({k} parallel task{'s' if k > 1 else ''}) ...")
    if use_ray:
        import ray

        task = ray.remote(num_cpus=cfg.ray.cpus_per_trial)(_collect_task)
        ref = ray.put(scenarios)
        pending = [task.remote(cfg, env_cfg, ref, m, sd) for m, sd in zip(sizes, seeds)]
        waiting = list(pending)
        while waiting:  # progress from the driver: the tasks' own output stays in Ray's logs
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=30.0)
            if waiting:
                echo(f"warm start: {len(pending) - len(waiting)} of {len(pending)} labelling tasks finished "
                     f"({time.perf_counter() - t0:.0f} s)")
        parts = ray.get(pending)
    else:
        parts = [collect_chunk(cfg, env_cfg, scenarios, m, sd) for m, sd in zip(sizes, seeds)]
    data = ws.RolloutData.concat(parts)
    echo(f"warm start: {len(data)} states in {time.perf_counter() - t0:.0f} s; "
         f"{100 * float((data.advantage > 1e-9).mean()):.1f}% of candidates beat greedy's choice over the horizon")
    return data


def _collect_task(cfg: TrainConfig, env_cfg: EnvConfig, scenarios: list[Scenario], n: int, seed: int) -> Any:
    import torch as th

    th.set_num_threads(1)
    return collect_chunk(cfg, env_cfg, scenarios, n, seed, progress_output=True)

