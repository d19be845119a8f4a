"""Shared fixtures. Heavy services (Ray, MLflow stores, servers) are started once per session."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@contextlib.contextmanager
def _mlflow_tracking_uri_kept() -> Iterator[None]:
    """``mlflow.set_tracking_uri`` (which training, registry.setup and the CLI call) sets both a
    module global and ``$MLFLOW_TRACKING_URI`` for the whole process -- and xroute reads the
    variable first. Put both back so one test's store never leaks into the next."""
    before_env = os.environ.get("MLFLOW_TRACKING_URI")
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    before = getattr(utils, "_tracking_uri", None)
    yield
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if utils is not None:
        utils._tracking_uri = before
    if before_env is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before_env


@pytest.fixture(autouse=True, scope="module")
def _mlflow_uri_per_module() -> Iterator[None]:
    """Around a module's own module-scoped fixtures (e.g. one training shared by its tests)."""
    with _mlflow_tracking_uri_kept():
        yield


@pytest.fixture(autouse=True)
def _mlflow_uri_per_test() -> Iterator[None]:
    with _mlflow_tracking_uri_kept():
        yield


@pytest.fixture(scope="session")
def shipped_bundle():
    from xroute.bundle import load_bundle

    return load_bundle()


@pytest.fixture(scope="session")
def tiny_bundle_dir(tmp_path_factory) -> Path:
    from tests.tinybundle import write_tiny_bundle

    return write_tiny_bundle(tmp_path_factory.mktemp("tiny"))


# ---- learned router (models/): one MLflow store and one Ray instance for the whole session ----
@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory) -> str:
    """Tracking URI of a fresh SQLite MLflow store (artifacts beside it), created once."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments()  # creates the schema now, not inside the first test
    return uri


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance on 2 CPUs, started once (trainings see it initialized and reuse it)."""
    import ray

    from models.tune import start_local_ray

    if not ray.is_initialized():  # (a Ray of its own, like ``xroute train``: never a cluster found on the machine)
        start_local_ray(2, log_to_driver=False)
    yield ray
    ray.shutdown()


# ---- real servers (tests/servers.py): started on first use, once per session, never faked ----
def _started(kind: str):
    """A started server of ``tests.servers``' class ``kind``, or the test fails saying why."""
    import tests.servers

    server = getattr(tests.servers, kind)()
    try:
        server.start()
    except tests.servers.ServerError as e:
        server.close()
        pytest.fail(f"the test {kind} could not start: {e}", pytrace=False)
    return server


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL on a loopback port (its admin URL: ``postgres.url``; a fresh database per
    test: ``postgres.create_database(name)``)."""
    server = _started("PostgresServer")
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a loopback port (``redis_server.url``)."""
    server = _started("RedisServer")
    yield server
    server.close()
