"""Where a learned router comes from: the MLflow store's location, ``models:/`` and ``runs:/`` URIs
fetched to a local directory, and a :class:`models.policy.LearnedPolicy` from a URI or a path
(what ``xroute evaluate``, ``xroute ope`` and the router load).

Default store (no server): tracking in ``sqlite:///<run_dir>/mlflow.db`` and artifacts under
``<run_dir>/mlartifacts``; ``$MLFLOW_TRACKING_URI`` overrides it. Open the UI with::

    mlflow ui --backend-store-uri sqlite:///runs/mlflow.db --host 127.0.0.1

Imports neither torch nor stable-baselines3; MLflow (the core install's ``mlflow-skinny``) only
when a URI is fetched, so a local export loads without it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from models.policy import LearnedPolicy, read_router
from xroute.errors import ConfigError, XrouteError

#: relative to the working directory (where `xroute train` put its store)
DEFAULT_RUN_DIR = Path("runs")


def quiet_mlflow() -> None:
    """MLflow's usage telemetry off, GitPython's missing-git warning silent, and MLflow's own INFO
    lines (creating the store's tables, validating an input example) not printed -- unless the
    user set ``MLFLOW_DISABLE_TELEMETRY``, ``GIT_PYTHON_REFRESH`` or ``MLFLOW_LOGGING_LEVEL``."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    if "MLFLOW_LOGGING_LEVEL" not in os.environ:
        os.environ["MLFLOW_LOGGING_LEVEL"] = "WARNING"  # read when mlflow is first imported
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # and if it was imported already


def tracking_uri(run_dir: str | Path | None = None, configured: str | None = None) -> str:
    """``$MLFLOW_TRACKING_URI``, else ``configured``, else the SQLite file under ``run_dir``."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    if configured:
        return configured
    d = Path(run_dir) if run_dir is not None else DEFAULT_RUN_DIR
    d.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{d.resolve() / 'mlflow.db'}"


def first_line(e: Exception) -> str:
    """An exception's first line (its type when it has no text): what one-line errors quote."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def model_version(uri: str) -> dict[str, str] | None:
    """The registered model and version a ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` URI
    points at now (``None`` for another form, e.g. a stage); what an OPE report records so that
    ``promote --ope`` can tell which version it estimated."""
    quiet_mlflow()
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    mlflow.set_tracking_uri(tracking_uri())
    rest = uri.removeprefix("models:/")
    try:
        if "@" in rest:
            name, alias = rest.split("@", 1)
            version = str(MlflowClient().get_model_version_by_alias(name, alias).version)
        else:
            name, _, version = rest.rpartition("/")
            if not name or not version.isdigit():
                return None
            MlflowClient().get_model_version(name, version)
    except MlflowException as e:
        raise ConfigError(f"--policy: cannot resolve '{uri}' in {mlflow.get_tracking_uri()}: {first_line(e)}") from None
    return {"registered_model": name, "version": version, "uri": uri}


def download_model(uri: str, dst: str | Path | None = None) -> Path:
    """Local copy of ``models:/…`` or ``runs:/…`` (default store unless ``$MLFLOW_TRACKING_URI``)."""
    quiet_mlflow()
    import mlflow
    from mlflow.exceptions import MlflowException

    mlflow.set_tracking_uri(tracking_uri())
    target = Path(dst) if dst is not None else Path(tempfile.mkdtemp(prefix="xroute-model-"))
    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(target)))
    except MlflowException as e:
        raise ConfigError(f"--policy: cannot load '{uri}' from {mlflow.get_tracking_uri()}: {first_line(e)}") from None
    except OSError as e:
        raise XrouteError(f"--policy: cannot download '{uri}': {e}") from None


def load_policy(uri: str) -> LearnedPolicy:
    """A learned policy from a local export/model directory, ``models:/NAME@ALIAS`` (or
    ``models:/NAME/VERSION``) or ``runs:/RUN_ID/PATH``. Imports neither torch nor SB3."""
    if uri.startswith(("models:/", "runs:/")):
        return LearnedPolicy(read_router(download_model(uri)), name=uri)
    p = Path(uri)
    if not p.exists():
        raise ConfigError(f"--policy: '{uri}' is neither a baseline, a models:/ or runs:/ URI, nor an existing path")
    return LearnedPolicy(read_router(p), name=p.name or uri)
