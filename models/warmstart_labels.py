"""The warm start's labelled states for one ``xroute train``: ``warm_start.samples`` states of the
training mix, each candidate labelled by rollouts (``models.warmstart.collect``), collected once
and shared by every trial -- in ``ray.max_concurrent_trials`` parallel Ray tasks, or in this
process without Ray."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
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


def _chunks(cfg: TrainConfig, use_ray: bool) -> int:
    return max(1, min(cfg.ray.max_concurrent_trials, cfg.warm_start.samples)) if use_ray else 1


def code_fingerprint() -> str:
    """A hash of the source that makes the labels: the environment (``envs``), the foundations it
    runs on (``xroute``) and the labelling and its scenarios here -- so labels kept by an older
    checkout are not reused after that code changed."""
    import envs
    import xroute

    here = Path(__file__).resolve().parent
    files = [*sorted(Path(envs.__file__).resolve().parent.rglob("*.py")),
             *sorted(Path(xroute.__file__).resolve().parent.rglob("*.py")),
             *(here / f"{m}.py" for m in ("warmstart", "warmstart_labels", "scenarios", "baselines", "config"))]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def label_key(cfg: TrainConfig, bundle_hash: str, env_cfg: EnvConfig) -> str:
    """What the labelled states depend on: the warm-start settings, the bundles' content, the seed,
    the loads, the episodes, the environment's settings and code, the perturbed copies and the
    training families."""
    blob = json.dumps({"warm": cfg.warm_start.model_dump(mode="json", exclude={"cache"}), "data": bundle_hash,
                       "seed": cfg.seed, "rates": cfg.rate_scales, "episode": cfg.episode_requests,
                       "ray": cfg.ray.max_concurrent_trials, "env": env_cfg.model_dump(mode="json"),
                       "perturbed": cfg.data.perturbed_copies, "code": code_fingerprint(),
                       "families": [f.model_dump(mode="json") for f in cfg.data.train_families]},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


_FIELDS = ("offerings", "request", "mask", "actions", "advantage", "weight", "greedy_reward")


def cached_warm_start(cfg: TrainConfig, env_cfg: EnvConfig, scenarios: list[Scenario], bundle_hash: str,
                      cache_dir: Path | None, use_ray: bool, echo: Callable[[str], None]) -> Any:
    """:func:`collect_warm_start`, memoized in ``cache_dir`` (None: no cache) by :func:`label_key`
    and the number of labelling chunks (the chunks' seeds differ). The labels are a function of
    those alone, so a later run that changes only what comes after them (the fit, the DQN knobs,
    the selection) reuses them. Written to a temporary file and renamed: a crash leaves either
    the whole file or none."""
    if cfg.warm_start.samples <= 0:
        return None
    k = _chunks(cfg, use_ray)
    path = None
    if cache_dir is not None:
        name = label_key(cfg, bundle_hash, env_cfg) + ("" if k == 1 else f"-{k}chunks")
        path = Path(cache_dir) / f"warm_start_{name}.npz"
        if path.exists():
            z = np.load(path)
            echo(f"warm start: {len(z['request'])} labelled states from {path} (labelled by an earlier run with "
                 "the same data and warm-start settings; delete the file to label them again)")
            return ws.RolloutData(**{f: z[f] for f in _FIELDS}, seconds=float(z["seconds"]))
    data = collect_warm_start(cfg, env_cfg, scenarios, use_ray, echo)
    if path is not None and data is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
        np.savez_compressed(tmp, **{f: getattr(data, f) for f in _FIELDS}, seconds=data.seconds)
        os.replace(tmp, path)
    return data


def collect_warm_start(cfg: TrainConfig, env_cfg: EnvConfig, scenarios: list[Scenario], use_ray: bool,
                       echo: Callable[[str], None]) -> Any:
    """The shared warm-start data set, labelled in ``ray.max_concurrent_trials`` parallel chunks."""
    n = cfg.warm_start.samples
    if n <= 0:
        return None
    k = _chunks(cfg, use_ray)
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

