"""Which policy decides: the registered model (``models:/xroute-router@champion`` or a local export),
or the configured baseline when no model can be loaded.

The model is loaded by ``settings.model_loader`` (default ``models.loader:load_policy``, imported
lazily; when that module is missing the router serves the fallback and says why). A *version* names
what is loaded: the registry version an alias points to, or a fingerprint of a local export, so
the watcher can tell when to swap.

Swaps are atomic: :class:`PolicySlot` holds one immutable :class:`ActivePolicy`; a request reads it
once, so it is decided entirely by the old or entirely by the new policy. A candidate must load,
``reset`` against the live environment and answer one smoke decision before it replaces the
current one; any failure keeps the last good policy (or the fallback) and is reported in
``/readyz``, ``/v1/admin/status`` and the ``xroute_router_model_errors_total`` metric.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from xroute.errors import ConfigError

Scorer = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class ActivePolicy:
    """A ready policy and how responses name it (``info`` is the response's ``policy`` object)."""

    policy: Any
    name: str
    kind: Literal["model", "fallback"]
    version: str | None = None
    uri: str | None = None
    scorer: Scorer | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, policy: Any, name: str, kind: Literal["model", "fallback"], version: str | None = None,
             uri: str | None = None) -> ActivePolicy:
        info = {"name": name, "kind": kind, "version": version, "uri": uri, "reason": None}
        return cls(policy, name, kind, version, uri, scorer_of(policy), info)


def scorer_of(policy: Any) -> Scorer | None:
    """A one-pass scorer for policies that expose numpy weights (``models.policy.LearnedPolicy``):
    ``(rows, request) -> scores``, for the offering rows (k, F) of the valid offerings and the
    request vector, computed exactly as its ``act`` computes them (context over the valid rows
    only). ``None`` for policies without one."""
    weights = getattr(policy, "weights", None)
    one = getattr(weights, "scores_one", None)
    if one is not None:  # the same scores, bit for bit, without the batch and mask handling
        return one  # type: ignore[no-any-return]
    score = getattr(weights, "scores", None)
    if score is None:
        return None

    def run(rows: np.ndarray, request: np.ndarray) -> np.ndarray:
        return score(rows[None], request[None], np.ones((1, rows.shape[0]), dtype=np.float32))[0]  # type: ignore[no-any-return]

    return run


def import_loader(spec: str) -> Callable[[str], Any]:
    """``module:function`` -> the function (raises ImportError/AttributeError when missing)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"model_loader: '{spec}' must look like package.module:function")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def fingerprint(path: Path) -> str:
    """A short content-derived version for a local model file or directory."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(path) if path.is_dir() else p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return "local-" + h.hexdigest()[:12]


def resolve(uri: str) -> tuple[str, str]:
    """What ``uri`` points to now: ``(uri to load, version)``. Blocking (may call the registry).

    ``models:/NAME@ALIAS`` resolves the alias to ``models:/NAME/VERSION`` so the loaded model is
    exactly the version reported; ``models:/NAME/VERSION`` and ``runs:/`` URIs are their own
    version; a local path is versioned by :func:`fingerprint`.
    """
    if uri.startswith("models:/"):
        rest = uri[len("models:/"):]
        if "@" in rest:
            name, alias = rest.split("@", 1)
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            from mlflow import MlflowClient

            from models.loader import tracking_uri

            # the same store `xroute train` registers in: $MLFLOW_TRACKING_URI, else runs/mlflow.db
            mv = MlflowClient(tracking_uri=tracking_uri()).get_model_version_by_alias(name, alias)
            return f"models:/{name}/{mv.version}", str(mv.version)
        return uri, rest.rsplit("/", 1)[-1]
    if uri.startswith("runs:/"):
        return uri, uri
    p = Path(uri)
    if not p.exists():
        raise FileNotFoundError(f"model path '{uri}' does not exist")
    return uri, fingerprint(p)


class PolicySlot:
    """The policy that decides now: the model if one is loaded, else the fallback.

    ``current(stale)`` is what a request uses; ``stale`` (telemetry too old) forces the fallback.
    """

    def __init__(self, fallback: ActivePolicy, model_uri: str):
        self.fallback = fallback
        self.model_uri = model_uri
        self.model: ActivePolicy | None = None
        self.loaded_version: str | None = None
        self.last_error: str | None = None if model_uri else "no model configured"
        self.swaps = 0
        self._fallback_no_model = self._with_reason(fallback, self._no_model_reason())
        self._fallback_stale: dict[str, Any] = self._with_reason(fallback, "telemetry stale")

    @staticmethod
    def _with_reason(p: ActivePolicy, reason: str) -> dict[str, Any]:
        return {**p.info, "reason": reason}

    def _no_model_reason(self) -> str:
        return f"no model loaded ({self.last_error})" if self.last_error else "no model loaded"

    def install(self, model: ActivePolicy) -> None:
        self.model = model
        self.loaded_version = model.version
        self.last_error = None
        self.swaps += 1

    def failed(self, error: str) -> None:
        self.last_error = error
        if self.model is None:
            self._fallback_no_model = self._with_reason(self.fallback, self._no_model_reason())

    def current(self, stale: bool) -> tuple[ActivePolicy, dict[str, Any]]:
        """The deciding policy and the ``policy`` object to put in the response."""
        m = self.model
        if stale:
            return self.fallback, self._fallback_stale
        if m is None:
            return self.fallback, self._fallback_no_model
        return m, m.info
