"""``xroute train`` end to end on a tiny budget: real Ray Tune trials, a real MLflow store (temp
dir), the registered pyfunc loaded in a fresh process, the alias round trip and ``promote``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.test_agent import write_agent_setup

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mlflow_store: str, ray_local: Any) -> dict[str, Any]:
    """One tiny training (2 trials through Ray Tune) into the session's MLflow store."""
    from models.train import run_training

    root = tmp_path_factory.mktemp("train")
    setup = write_agent_setup(root, search={"seeds": [0], "gamma": [0.0, 0.5]},
                              mlflow={"experiment": "smoke", "registered_model": "xroute-router-smoke",
                                      "tracking_uri": mlflow_store})
    lines: list[str] = []
    summary = run_training(setup["cfg"], echo=lines.append)
    return {"summary": summary, "setup": setup, "root": root, "lines": lines, "uri": mlflow_store}


def _client(uri: str) -> Any:
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.MlflowClient()


def test_smoke_training_runs_tune_trials_and_tracks_them_in_mlflow(trained: dict[str, Any]) -> None:
    s, root = trained["summary"], trained["root"]
    assert len(s.trials) == 2 and {t["gamma"] for t in s.trials} == {0.0, 0.5}
    assert s.registered_version is not None and s.model_uri
    assert [g.label for g in s.gate] == ["bundle x1", "bundle x4"]  # the one bundle's test window, two loads
    for g in s.gate:
        names = {r.name for r in g.results}
        assert names >= {"greedy", "static", "learned (challenger)", "warm start only"} and "oracle" not in names
        assert len(g.deltas["learned (challenger)"]) == 2  # paired by seed
    assert s.decision.candidate == "learned (challenger)" and s.ablation.candidate == "warm start only"
    lo, hi = s.decision.pooled[1], s.decision.pooled[2]
    assert lo <= s.decision.pooled[0] <= hi
    assert s.decision.passed == (lo > 0 and not s.decision.losses)
    # Tune kept its results under the run dir, not in the home directory
    assert any((root / "runs" / "tune").iterdir())
    client = _client(trained["uri"])
    exp = client.get_experiment_by_name("smoke")
    runs = client.search_runs([exp.experiment_id])
    trials = [r for r in runs if "xroute.trial" in r.data.tags]
    parent = [r for r in runs if "xroute.trial" not in r.data.tags]
    assert len(trials) == 2 and len(parent) == 1
    for r in trials:
        assert r.data.tags["mlflow.parentRunId"] == parent[0].info.run_id
        assert r.data.params["bundle_hash"] and r.data.params["config.total_timesteps"] == "300"
        curve = client.get_metric_history(r.info.run_id, "val_mean_reward")
        assert len(curve) >= 2  # before training, during, after
        # the departure margin kept and the best-scoring one it is calibrated from (models.callbacks.pick_margin)
        assert r.data.metrics["margin"] >= r.data.metrics["margin_best"]
        names = {a.path for a in client.list_artifacts(r.info.run_id)}
        assert {"validation_table.md", "learning_curve.png", "cost_vs_p95_validation.png"} <= names
        table = (Path(client.download_artifacts(r.info.run_id, "validation_table.md"))).read_text()
        for base in ("static", "cheapest", "greedy", "random", "dqn"):
            assert f"| {base}" in table
    assert any("best trial" in ln for ln in trained["lines"])
    # one line per trial's end comes through Tune's callback (its own console tables go to a file)
    assert sum(ln.startswith("trial s0-") and " done: " in ln for ln in trained["lines"]) == 2
    assert list((root / "runs" / "tune").glob("*/tune_console.log"))


def test_registry_alias_round_trip_and_promote(trained: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from models import registry
    from models.loader import load_policy
    from models.policy import LearnedPolicy

    monkeypatch.setenv("MLFLOW_TRACKING_URI", trained["uri"])
    name = "xroute-router-smoke"
    client = _client(trained["uri"])
    v = str(client.get_model_version_by_alias(name, "challenger").version)
    assert v == trained["summary"].registered_version
    # the verdict recorded at training time is what promote reads: refused -> says why, champion untouched
    tags = client.get_model_version(name, v).tags
    assert {"gate_passed", "gate_reward_delta", "gate_reward_delta_lo", "gate_reason", "warm_start_gate_passed"} <= set(tags)
    client.set_model_version_tag(name, v, "gate_passed", "False")
    client.set_model_version_tag(name, v, "gate_reason", "loses on x4")
    d = registry.promote(name)
    assert not d.promoted and "did not pass the gate: loses on x4" in d.reason
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException):
        client.get_model_version_by_alias(name, "champion")
    # accepted: champion now points at the challenger's version, and loads as a numpy policy
    client.set_model_version_tag(name, v, "gate_passed", "True")
    d = registry.promote(name)
    assert d.promoted and str(client.get_model_version_by_alias(name, "champion").version) == v
    pol = load_policy(f"models:/{name}@champion")
    assert isinstance(pol, LearnedPolicy)
    again = registry.promote(name)
    assert not again.promoted and "already" in again.reason


def test_cli_promote_refusal_and_evaluate_with_the_registered_model(trained: dict[str, Any], tmp_path: Path) -> None:
    env = {**os.environ, "MLFLOW_TRACKING_URI": trained["uri"]}
    setup = trained["setup"]
    cfg = tmp_path / "train.yaml"
    cfg.write_text(setup["train_yaml"].read_text().replace("xroute-router-smoke", "no-such-model"))
    r = subprocess.run([sys.executable, "-m", "xroute_app", "promote", "--config", str(cfg)], env=env,
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "promote refused" in r.stderr and "no-such-model" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    out = tmp_path / "ev.json"
    export = trained["summary"].best["router_dir"]
    r = subprocess.run([sys.executable, "-m", "xroute_app", "evaluate", "--telemetry", str(setup["bundle"]),
                        "--policy", "greedy", "--policy", "models:/xroute-router-smoke@challenger",
                        "--policy", str(export), "--config", str(trained["root"] / "evaluate.yaml"),
                        "--output", str(out), "--quiet"],
                       env=env, capture_output=True, text=True, cwd=REPO, timeout=180)
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())["policies"]
    assert set(rep) == {"greedy", "models:/xroute-router-smoke@challenger", str(export)}
    # the registered model and its local export are the same policy
    assert rep[str(export)]["mean_reward"] == rep["models:/xroute-router-smoke@challenger"]["mean_reward"]


def test_registered_pyfunc_loads_in_a_fresh_process(trained: dict[str, Any], tmp_path: Path) -> None:
    import mlflow
    import pandas as pd

    from models.policy import read_router
    from models.pyfunc import predict_frame

    mlflow.set_tracking_uri(trained["uri"])
    uri = "models:/xroute-router-smoke@challenger"
    info = mlflow.models.get_model_info(uri)
    assert info.signature is not None and {c.name for c in info.signature.inputs.inputs} >= {"offerings", "mask"}
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "m")))
    example = pd.read_json(local / "input_example.json", orient="split") if (local / "input_example.json").exists() \
        else None
    script = (
        "import sys, json, mlflow, pandas as pd\n"
        f"mlflow.set_tracking_uri({trained['uri']!r})\n"
        f"m = mlflow.pyfunc.load_model({uri!r})\n"
        "from mlflow.models import Model\n"
        f"ex = Model.load({str(local)!r}).load_input_example({str(local)!r})\n"
        "out = m.predict(ex)\n"
        "print(json.dumps({'idx': out['offering_index'].tolist(), 'torch': 'torch' in sys.modules}))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["torch"] is False
    from mlflow.models import Model

    ex = Model.load(str(local)).load_input_example(str(local))
    want = predict_frame(read_router(local), ex)["offering_index"].tolist()
    assert got["idx"] == want and all(i >= 0 for i in want)
    del example
    assert np.isfinite(predict_frame(read_router(local), ex)["score"]).all()


def test_the_code_defaults_are_the_shipped_train_config() -> None:
    """``configs/train.yaml`` and ``models.config.TrainConfig``'s defaults say the same thing (they
    once disagreed on gamma, the learning rate and the warm start's size)."""
    from models.config import TrainConfig, load_train_config

    assert TrainConfig().model_dump() == load_train_config(None).model_dump()
