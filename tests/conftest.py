"""Shared fixtures. Heavy services (Ray, MLflow stores, servers) are started once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def shipped_bundle():
    from xroute.bundle import load_bundle

    return load_bundle()


@pytest.fixture(scope="session")
def tiny_bundle_dir(tmp_path_factory) -> Path:
    from tests.tinybundle import write_tiny_bundle

    return write_tiny_bundle(tmp_path_factory.mktemp("tiny"))
