"""Ray for ``xroute train``: reaching or starting the cluster, and the trials of the grid as Ray
Tune function trials (``models.trial.run_trial`` each), with one console line per trial event.
Ray is imported here only, inside the functions that use it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from models.config import TrainConfig
from models.loader import first_line
from models.trial import TrialContext, run_trial, trial_name
from xroute.errors import ConfigError, XrouteError


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail fast on an unreachable ``--ray-address`` (``ray.init`` itself retries for minutes).
    ``auto`` and ``ray://`` client addresses are left to Ray."""
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address: '{address}' is not HOST:PORT (e.g. 10.0.0.5:6379), 'auto' or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise XrouteError(f"--ray-address: cannot reach the Ray head at {address} ({e.strerror or e})") from None


def keep_ray_out_of_home() -> None:
    """Ray >= 2.5x enables token auth for a new local cluster and, unless told otherwise, writes
    the token to ``~/.ray/auth_token``. Hand it a fresh per-process token in ``RAY_AUTH_TOKEN``
    instead (auth stays on, nothing is written to the home directory). A token the user set up
    (``RAY_AUTH_*`` variables or an existing token file) is left alone."""
    if any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        return
    if (Path.home() / ".ray" / "auth_token").exists():
        return
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def start_local_ray(num_cpus: int, **kwargs: Any) -> None:
    """A new Ray instance of this process on ``num_cpus`` CPUs, whatever the machine holds.

    ``ray.init()`` without an address joins the cluster ``$RAY_ADDRESS`` or the file
    ``<ray temp dir>/ray_current_cluster`` names -- which ``ray start --head`` writes and a head
    that stopped without ``ray stop`` leaves behind -- and then refuses ``num_cpus`` ("When
    connecting to an existing cluster, num_cpus and num_gpus must not be provided"), or, with a
    live head of someone else's, would run on it. ``address="local"`` is Ray's documented way to
    start a new local instance even if one exists (``ray.init``, case 4 of ``address``)."""
    import ray

    keep_ray_out_of_home()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)


@contextmanager
def ray_session(cfg: TrainConfig, ray_address: str | None, use_ray: bool) -> Iterator[None]:
    """Ray for the duration of training: the caller's if already initialized (tests), else an
    existing cluster (``ray_address``) or a new local instance of its own (``start_local_ray``:
    never a cluster it happens to find on the machine), shut down afterwards."""
    if not use_ray:
        yield
        return
    import ray

    started = False
    if not ray.is_initialized():
        try:
            if ray_address:
                ray.init(address=ray_address, include_dashboard=False, logging_level=logging.ERROR,
                         log_to_driver=False)
            else:
                start_local_ray(cfg.ray.num_cpus, logging_level=logging.ERROR, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = f"--ray-address: cannot reach Ray at '{ray_address}'" if ray_address else \
                "cannot start a local Ray instance"
            raise XrouteError(f"{where}: {first_line(e)}") from None
        started = True
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def tune_trials(cfg: TrainConfig, ctx: TrialContext, points: list[dict[str, Any]], storage: Path, name: str,
                echo: Callable[[str], None]) -> list[dict[str, Any]]:
    """``run_trial`` for every grid point as a Ray Tune function trial, at most
    ``ray.max_concurrent_trials`` at a time; the trials' results with their exports copied out of
    Tune's checkpoints."""
    from ray import tune

    trainable = tune.with_resources(tune.with_parameters(_tune_trainable, ctx=ctx),
                                    {"cpu": cfg.ray.cpus_per_trial})
    space = {
        "seed": tune.grid_search(sorted({p["seed"] for p in points})),
        "gamma": tune.grid_search(sorted({p["gamma"] for p in points})),
        "learning_rate": tune.grid_search(sorted({p["learning_rate"] for p in points})),
    }
    storage.mkdir(parents=True, exist_ok=True)
    tuner = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(max_concurrent_trials=cfg.ray.max_concurrent_trials),
        run_config=tune.RunConfig(name=name, storage_path=str(storage.resolve()), verbose=0,
                                  callbacks=[_TrialLines()],
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )
    # Tune prints its own header and hints whatever the verbosity: into a file beside its results,
    # so the console shows only the lines a user acts on (``_TrialLines``, written to the real stdout)
    (storage / name).mkdir(parents=True, exist_ok=True)
    _CONSOLE.append(_to(sys.stdout, echo))
    try:
        with open(storage / name / "tune_console.log", "a") as console, contextlib.redirect_stdout(console):
            grid_results = tuner.fit()
    finally:
        _CONSOLE.pop()
    trials = []
    errors = []
    for i in range(len(grid_results)):
        r = grid_results[i]
        if r.error is not None:
            errors.append(r.error)
            continue
        if r.checkpoint is None:
            continue
        with r.checkpoint.as_directory() as d:
            info = json.loads((Path(d) / "trial.json").read_text())
        # the checkpoint (not the worker's scratch directory) is where the export lives for good
        info["router_dir"] = r.checkpoint.to_directory(str(storage / name / "exports" / info["trial"]))
        info["warm_dir"] = str(Path(info["router_dir"]) / "warm_start_only")  # (saved inside it: trial.py)
        trials.append(info)
    if not trials:
        first = str(errors[0]).strip().splitlines()[-1] if errors else "no trial reported a result"
        raise XrouteError(f"training failed: every trial failed ({first}); see {storage / name}")
    if errors:
        echo(f"warning: {len(errors)} trial(s) failed; see {storage / name}")
    return trials


def _to(stream: Any, echo: Callable[[str], None]) -> Callable[[str], None]:
    """``echo`` writing to ``stream`` (the real stdout, taken before Tune's console output is
    redirected): print and typer's echo write to whatever ``sys.stdout`` is at call time."""
    def out(msg: str) -> None:
        saved = sys.stdout
        sys.stdout = stream
        try:
            echo(msg)
        finally:
            sys.stdout = saved

    return out


#: where ``_TrialLines`` writes while Tune runs (module state, not captured by the callback: Tune
#: pickles its callbacks, and a console stream does not pickle)
_CONSOLE: list[Callable[[str], None]] = []


def _emit(msg: str) -> None:
    if _CONSOLE:
        _CONSOLE[-1](msg)


class _TrialLines:
    """One line per trial event a user acts on (Tune's own status tables are off: ``verbose=0``)."""

    def __new__(cls) -> Any:
        from ray import tune

        echo = _emit

        class Lines(tune.Callback):  # type: ignore[misc]
            def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any],
                                **info: Any) -> None:
                if result.get("done_validation"):
                    echo(f"trial {trial_name(trial.config)}: step {result.get('timesteps', 0)}, worst Δ reward vs "
                         f"greedy on the selection windows {result.get('val_criterion', float('nan')):+.5f}")

            def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
                r = trial.last_result or {}
                echo(f"trial {trial_name(trial.config)} done: {r.get('best_val_criterion', float('nan')):+.5f} "
                     f"(step {r.get('best_step', '?')}, margin {r.get('margin', '?')})")

            def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
                echo(f"trial {trial_name(trial.config)} failed (see the Tune directory)")

        return Lines()


def _tune_trainable(config: dict[str, Any], ctx: TrialContext) -> None:
    from ray import tune

    def report(metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            tune.report(metrics)
        else:
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(checkpoint_dir))

    run_trial({"seed": int(config["seed"]), "gamma": float(config["gamma"]),
               "learning_rate": float(config["learning_rate"])}, ctx, report)
