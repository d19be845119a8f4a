"""The registered router model stands on its own: it carries the code its inference imports and
lists what that code needs, so ``mlflow.pyfunc.load_model`` scores with it where xroute is not
installed.

The fresh process runs in a new virtual environment holding only what the model's own
``requirements.txt`` names (installed with ``constraints.txt``, so from the pip cache), started
with ``python -I`` from a temporary directory: no xroute distribution, no editable-install
finder, no ``.pth``, no ``PYTHONPATH`` and no working directory on ``sys.path`` -- nothing but the
model's ``code/`` can supply ``models``, ``envs`` or ``xroute``, and a requirement missing from the
model fails the load. (``python -I`` with this checkout's venv would not do: its site-packages
holds the editable install's finder, which maps our packages back to the checkout.)
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from packaging.requirements import Requirement

from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES
from models import pyfunc
from models.policy import RewardPrior, RouterWeights, read_router, save_router
from xroute.config import EnvConfig

REPO = Path(__file__).resolve().parent.parent
OURS = ("models", "envs", "xroute", "router", "cloud_adapters")


def _weights(seed: int = 0) -> RouterWeights:
    """Random weights using every part of the scorer: the context layer, two hidden layers, the
    reward prior and the margin."""
    rng = np.random.default_rng(seed)
    nx = N_OFFERING_FEATURES + N_REQUEST_FEATURES
    ctx = (rng.normal(0, 0.2, (nx, 6)).astype(np.float32), rng.normal(0, 0.1, 6).astype(np.float32))
    dims = [nx + 6, 16, 8, 1]
    layers = [(rng.normal(0, 0.2, (a, b)).astype(np.float32), rng.normal(0, 0.1, b).astype(np.float32))
              for a, b in itertools.pairwise(dims)]
    return RouterWeights(layers=layers, ctx=ctx, prior=RewardPrior.from_env_config(EnvConfig()), margin=0.01)


def _frame(seed: int = 1, request_ids: bool = True) -> pd.DataFrame:
    """Requests over catalogs of several sizes, with masked offerings and one request that no
    offering may take."""
    rng = np.random.default_rng(seed)
    sizes, rows = (3, 7, 12, 5), []
    for k, n in enumerate(sizes):
        mask = (rng.random(n) < 0.7).astype(float)
        mask[0] = 1.0
        if k == 3:
            mask[:] = 0.0
        rows.append({"request_id": f"r{k}", "offerings": rng.uniform(0, 1.5, n * N_OFFERING_FEATURES),
                     "request": rng.uniform(0.2, 1.2, N_REQUEST_FEATURES), "mask": mask})
    df = pd.DataFrame(rows)
    return df if request_ids else df.drop(columns="request_id")


def _plain(out: pd.DataFrame) -> dict[str, Any]:
    """A prediction as JSON-exact Python values (``json`` round-trips float64; NaN stays NaN)."""
    return {"offering_index": [int(i) for i in out["offering_index"]],
            "score": [float(s) for s in out["score"]],
            "scores": [[float(x) for x in s] for s in out["scores"]],
            **({"request_id": [str(r) for r in out["request_id"]]} if "request_id" in out.columns else {})}


# ----------------------------------------------------------------------------------- fast checks
def test_the_staged_code_is_the_inference_modules_with_marker_inits(tmp_path: Path) -> None:
    dirs = pyfunc.stage_code(tmp_path)
    assert sorted(Path(d).name for d in dirs) == ["envs", "models", "xroute"]
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.py"))
    modules = sorted(f"{m.replace('.', '/')}.py" for m in pyfunc.INFERENCE_MODULES)
    assert files == sorted([*modules, "envs/__init__.py", "models/__init__.py", "xroute/__init__.py"])
    for m in modules:  # the modules themselves, unchanged
        assert (tmp_path / m).read_bytes() == (REPO / m).read_bytes()
    # envs' own __init__ imports the environment (pandas, pydantic, gymnasium): the copy's only marks the package
    assert "cloud_route" in (REPO / "envs" / "__init__.py").read_text()
    assert ast.parse((tmp_path / "envs" / "__init__.py").read_text()).body[0].__class__ is ast.Expr
    assert len(ast.parse((tmp_path / "envs" / "__init__.py").read_text()).body) == 1


def _ours_imported(tree: ast.AST) -> list[str]:
    out: list[str] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            if n.module in OURS:  # from envs import kernels
                out += [f"{n.module}.{a.name}" for a in n.names]
            elif n.module.split(".")[0] in OURS:
                out.append(n.module)
        elif isinstance(n, ast.Import):
            out += [a.name for a in n.names if a.name.split(".")[0] in OURS]
    return out


def test_the_inference_modules_import_nothing_of_ours_beyond_each_other() -> None:
    """The closure is closed: what each inference module imports of our packages (at any depth,
    inside functions too) is an inference module. Read from the source, nothing imported."""
    for m in pyfunc.INFERENCE_MODULES:
        got = _ours_imported(ast.parse((REPO / f"{m.replace('.', '/')}.py").read_text()))
        assert set(got) <= set(pyfunc.INFERENCE_MODULES), f"{m} imports {set(got) - set(pyfunc.INFERENCE_MODULES)}"
    assert set(_ours_imported(ast.parse((REPO / "models" / "policy.py").read_text()))) == {
        "envs.kernels", "envs.features", "xroute.errors"}


def test_the_model_requirements_are_pyprojects_ranges() -> None:
    deps = {Requirement(r).name: Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())
            ["project"]["dependencies"]}
    reqs = [Requirement(r) for r in pyfunc.pip_requirements()]
    assert [r.name for r in reqs] == ["mlflow-skinny", *pyfunc.REQUIREMENTS]
    for r in reqs[1:]:
        assert r.specifier == deps[r.name].specifier, r
    from importlib.metadata import version

    assert str(reqs[0].specifier) == f"=={version('mlflow-skinny')}"
    assert reqs[0].specifier.contains(version("mlflow-skinny")) and deps["mlflow-skinny"].specifier.contains(
        version("mlflow-skinny"))


# ----------------------------------------------------------------------------------- the real thing
@pytest.fixture()
def store(tmp_path: Path) -> Any:
    """A fresh SQLite MLflow store in ``tmp_path`` (conftest puts the process-wide URI back after)."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


_LOAD = """
import json, sys, time
t0 = time.perf_counter()
import mlflow.pyfunc
import pandas as pd
t1 = time.perf_counter()
model = mlflow.pyfunc.load_model(sys.argv[1])
t2 = time.perf_counter()
frames = [pd.read_json(p, orient="split") for p in sys.argv[2:]]
outs = [model.predict(f) for f in frames]
t3 = time.perf_counter()
plain = [{"offering_index": [int(i) for i in o["offering_index"]], "score": [float(s) for s in o["score"]],
          "scores": [[float(x) for x in s] for s in o["scores"]],
          **({"request_id": [str(r) for r in o["request_id"]]} if "request_id" in o.columns else {})} for o in outs]
ours = {k: getattr(v, "__file__", None) for k, v in sys.modules.items()
        if k.split(".")[0] in ("models", "envs", "xroute", "router", "cloud_adapters")}
print(json.dumps({"outs": plain, "ours": ours, "path": sys.path, "import_s": t1 - t0, "load_s": t2 - t1,
                  "predict_s": t3 - t2, "others": sorted(m for m in ("torch", "gymnasium", "stable_baselines3", "ray")
                                                          if m in sys.modules)}))
"""


@pytest.mark.slow
def test_a_registered_model_loads_and_scores_where_xroute_is_not_installed(store: str, tmp_path: Path) -> None:
    import mlflow
    from mlflow import MlflowClient

    from models import registry

    weights = _weights()
    export = save_router(weights, tmp_path / "export")
    example = _frame()
    exp = registry.setup(store, "standalone", tmp_path)
    with mlflow.start_run(experiment_id=exp):
        info = registry.log_router_model(export, example)
    version = registry.register(info.model_uri, "xroute-standalone", registry.CHALLENGER)
    client = MlflowClient(tracking_uri=store)
    mv = client.get_model_version_by_alias("xroute-standalone", registry.CHALLENGER)
    assert str(mv.version) == version
    local = Path(mlflow.artifacts.download_artifacts(client.get_model_version_download_uri("xroute-standalone",
                                                                                            version),
                                                     dst_path=str(tmp_path / "model")))
    size = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    # what the model records: its code, its requirements, its signature and input example
    reqs = [Requirement(r) for r in (local / "requirements.txt").read_text().split()]
    assert [r.name for r in reqs] == ["mlflow-skinny", "numpy", "numba", "scipy", "pandas"]
    assert sorted(str(p.relative_to(local / "code")) for p in (local / "code").rglob("*.py")) == sorted(
        [f"{m.replace('.', '/')}.py" for m in pyfunc.INFERENCE_MODULES]
        + ["envs/__init__.py", "models/__init__.py", "xroute/__init__.py"])
    meta = mlflow.models.get_model_info(f"models:/xroute-standalone/{version}")
    assert meta.signature is not None
    assert [c.name for c in meta.signature.inputs.inputs] == ["request_id", "offerings", "request", "mask", "affinity"]
    assert not any(local.rglob("*.pkl"))  # built from code at load, nothing unpickled

    # a fresh venv with exactly the model's requirements
    venv = tmp_path / "venv"
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    py = str(venv / "bin" / "python")
    r = subprocess.run([py, "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"), "-r",
                        str(local / "requirements.txt")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    venv_s = time.perf_counter() - t
    r = subprocess.run([py, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True, timeout=120)
    installed = {p["name"].lower() for p in json.loads(r.stdout)}
    assert "xroute" not in installed and "torch" not in installed and "mlflow" not in installed

    frames = {"with_ids": _frame(), "without_ids": _frame(seed=5, request_ids=False)}
    paths = []
    for name, f in frames.items():
        p = tmp_path / f"{name}.json"
        f.to_json(p, orient="split", double_precision=15)
        paths.append(str(p))
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    r = subprocess.run([py, "-I", "-c", _LOAD, str(local), *paths], capture_output=True, text=True, cwd=work, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])

    # the same scores as in this process (the checkout's modules), from the same JSON input
    want = [_plain(pyfunc.predict_frame(read_router(export), pd.read_json(p, orient="split"))) for p in paths]
    assert json.dumps(got["outs"]) == json.dumps(want)
    assert got["outs"][0]["offering_index"][3] == -1 and got["outs"][0]["request_id"] == ["r0", "r1", "r2", "r3"]
    assert "request_id" not in got["outs"][1]
    # every module of ours came from the model's code/, and only the inference modules came
    code = (local / "code").resolve()
    assert set(got["ours"]) == set(pyfunc.INFERENCE_MODULES) | {"models", "envs", "xroute"}
    for mod, f in got["ours"].items():
        assert f is not None and Path(f).resolve().is_relative_to(code), (mod, f)
    assert not any(str(REPO) in p for p in got["path"])
    assert got["others"] == []
    print(f"\nstandalone model: {size} bytes, venv {venv_s:.0f} s, "
          f"import {got['import_s']:.2f} s, load {got['load_s']:.2f} s, first predictions {got['predict_s']:.2f} s")
