"""The learned router as an MLflow ``pyfunc`` model (what the registry holds and serving loads).

Input: a DataFrame, one row per routing request:

==============  ==================  ====================================================
column          type                meaning
==============  ==================  ====================================================
``request_id``  string (optional)   echoed back
``offerings``   array of double     the offering feature rows, flattened row-major
                                    (``n * len(envs.features.OFFERING_FEATURES)``; any n)
``request``     array of double     the request features (``envs.features.REQUEST_FEATURES``)
``mask``        array of double     1 = the offering may take the request (length n)
``affinity``    boolean (optional)  the request carries KV-prefix blocks or a session:
                                    the model's affinity guard serves greedy's choice
                                    (``models.policy.holds``); absent = false
==============  ==================  ====================================================

Output: a DataFrame with ``request_id`` (when given), ``offering_index`` (the chosen row; -1
when no offering is valid: the network's argmax, kept only where the departure rule
``models.policy.departs`` lets it leave greedy's choice -- here the reward prior's best valid row,
greedy's choice as the features give it), ``score`` (its score) and ``scores`` (every row's score,
NaN where masked). Numpy only: no torch, no stable-baselines3.

The model stands on its own: it carries the code its inference imports
(:data:`INFERENCE_MODULES`, copied by :func:`stage_code` into the model's ``code/`` directory,
which MLflow puts first on ``sys.path`` when it loads the model), is built at load by
:data:`MODEL_CODE` (no pickle), records what that code needs from PyPI (:func:`pip_requirements`)
and states its :func:`signature`. Only those modules are copied, not whole packages: ``envs``' own
``__init__`` imports the environment (pandas tables, pydantic configs, gymnasium), which scoring
never touches, so each package in the copy gets an ``__init__`` that only marks it. (So in a
process that loads the model before it imports ``envs``, ``models`` or ``xroute`` itself, those
names are the model's copies: MLflow's ``code_paths`` come first on ``sys.path``.)
"""

from __future__ import annotations

import math
import shutil
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.pyfunc import PythonModel
from mlflow.types import ColSpec, Schema
from mlflow.types.schema import Array
from packaging.requirements import Requirement

from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES
from models.policy import RouterWeights, choose, holds, read_router

ARTIFACT_KEY = "router"
#: every module of ours that loading and scoring the model imports: this one (:data:`MODEL_CODE`
#: builds its :class:`RouterModel`), the numpy/numba scorer and what that imports. A test loads a
#: registered model where only these exist (``tests/test_model_standalone.py``).
INFERENCE_MODULES = ("models.pyfunc", "models.policy", "envs.features", "envs.kernels", "xroute.errors")
#: what those modules import from PyPI besides MLflow, at the ranges xroute itself requires
#: (``pyproject.toml``, read from the installed metadata); numba's ``np.dot`` needs SciPy's BLAS
REQUIREMENTS = ("numpy", "numba", "scipy", "pandas")
#: the file MLflow runs to build the model at load (``python_model`` of ``mlflow.pyfunc.log_model``)
MODEL_CODE = Path(__file__).with_name("pyfunc_model.py")
#: the directory the modules are found under: the one holding the ``models`` package
SOURCE_ROOT = Path(__file__).resolve().parent.parent
_MARKER = ('"""Part of xroute carried by a registered router model: only the modules its inference imports '
           '(models.pyfunc.INFERENCE_MODULES)."""\n')


def predict_frame(weights: RouterWeights, model_input: pd.DataFrame) -> pd.DataFrame:
    """Route every row of ``model_input`` with ``weights``."""
    missing = [c for c in ("offerings", "request", "mask") if c not in model_input.columns]
    if missing:
        raise ValueError(f"input is missing column(s) {', '.join(missing)}")
    out: dict[str, list[Any]] = {"offering_index": [], "score": [], "scores": []}
    for k, row in enumerate(model_input.itertuples(index=False)):
        rows = np.asarray(row.offerings, dtype=np.float32)
        mask = np.asarray(row.mask, dtype=np.float32)
        req = np.asarray(row.request, dtype=np.float32)
        n = mask.size
        if rows.size != n * N_OFFERING_FEATURES or req.size != N_REQUEST_FEATURES:
            raise ValueError(f"row {k}: 'offerings' has {rows.size} values and 'mask' {n}; expected "
                             f"{N_OFFERING_FEATURES} per offering and {N_REQUEST_FEATURES} request features")
        s = weights.scores(rows.reshape(1, n, N_OFFERING_FEATURES), req[None], mask[None])[0].astype(float)
        valid = mask > 0.5
        best = int(np.argmax(np.where(valid, s, -np.inf))) if valid.any() else -1
        if best >= 0 and weights.prior is not None and weights.margin != -math.inf:
            # the departure rule (models.policy.departs) around greedy's choice as the features give it:
            # the reward prior's best valid offering (the router has greedy's own, from its live state)
            idx = np.flatnonzero(valid)
            p = weights.prior.scores(rows.reshape(1, n, N_OFFERING_FEATURES)[:, idx], req[None])[0]
            hold = holds(weights, bool(getattr(row, "affinity", False)))  # (optional column: the affinity guard)
            best = choose(s[idx], idx, int(idx[int(np.argmax(p))]), weights.margin, hold)
        out["offering_index"].append(best)
        out["score"].append(float(s[best]) if best >= 0 else float("nan"))
        out["scores"].append(np.where(valid, s, np.nan).tolist())
    df = pd.DataFrame(out)
    if "request_id" in model_input.columns:
        df.insert(0, "request_id", model_input["request_id"].astype(str).to_numpy())
    return df


class RouterModel(PythonModel):
    """``mlflow.pyfunc`` wrapper of an exported router (artifact ``router``: the export directory)."""

    def load_context(self, context: Any) -> None:
        self.weights = read_router(context.artifacts[ARTIFACT_KEY])

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        return predict_frame(self.weights, model_input)


def example_frame(observations: list[dict[str, np.ndarray]], n: int, request_ids: list[str] | None = None
                  ) -> pd.DataFrame:
    """Model input for environment observations, cut to the catalog's ``n`` offerings."""
    return pd.DataFrame({
        **({"request_id": request_ids} if request_ids is not None else {}),
        "offerings": [np.asarray(o["offerings"][: n * N_OFFERING_FEATURES], dtype=float) for o in observations],
        "request": [np.asarray(o["request"], dtype=float) for o in observations],
        "mask": [np.asarray(o["mask"][:n], dtype=float) for o in observations],
    })


def signature() -> ModelSignature:
    """The input and output columns of the module docstring (``request_id`` optional)."""
    vec = Array("double")
    return ModelSignature(
        inputs=Schema([ColSpec("string", "request_id", required=False), ColSpec(vec, "offerings"),
                       ColSpec(vec, "request"), ColSpec(vec, "mask"), ColSpec("boolean", "affinity", required=False)]),
        outputs=Schema([ColSpec("string", "request_id", required=False), ColSpec("long", "offering_index"),
                        ColSpec("double", "score"), ColSpec(vec, "scores")]))


def stage_code(dst: str | Path, modules: tuple[str, ...] = INFERENCE_MODULES) -> list[str]:
    """Copy ``modules`` (default :data:`INFERENCE_MODULES`) into ``dst`` as packages
    (``dst/envs/kernels.py`` ...), each package with a marker ``__init__``; returns the package
    directories, MLflow's ``code_paths`` (it copies each under the model's ``code/`` and puts that
    first on ``sys.path`` at load)."""
    root = Path(dst)
    tops: list[str] = []
    for name in modules:
        *pkgs, mod = name.split(".")
        d = root.joinpath(*pkgs)
        d.mkdir(parents=True, exist_ok=True)
        for k in range(1, len(pkgs) + 1):
            marker = root.joinpath(*pkgs[:k], "__init__.py")
            if not marker.exists():
                marker.write_text(_MARKER)
        shutil.copyfile(SOURCE_ROOT.joinpath(*pkgs, f"{mod}.py"), d / f"{mod}.py")
        if pkgs[0] not in tops:
            tops.append(pkgs[0])
    return [str(root / t) for t in sorted(tops)]


def pip_requirements(names: tuple[str, ...] = REQUIREMENTS) -> list[str]:
    """What the model needs from PyPI to load and score: the MLflow client it was logged with
    (``mlflow-skinny``, pinned: the model format is MLflow's) and :data:`REQUIREMENTS` at the
    ranges xroute's own metadata gives them."""
    try:
        ours = [Requirement(r) for r in requires("xroute") or []]
    except PackageNotFoundError:
        raise RuntimeError("logging a router model needs xroute installed (pip install -e .): its "
                           "requirement ranges come from the package metadata") from None
    ranges = {r.name: str(r) for r in ours if r.name in names and r.marker is None}
    missing = [n for n in names if n not in ranges]
    if missing:
        raise RuntimeError(f"xroute's metadata does not require {', '.join(missing)}; reinstall it (pip install -e .)")
    return [f"mlflow-skinny=={version('mlflow-skinny')}", *(ranges[n] for n in names)]
