"""``xroute train-planner`` end to end on a tiny budget: real Ray Tune trials (the scorer network and
the ablation without it), a real MLflow store (temp dir) with the trials' runs and the gate's
table, the registered ``pyfunc`` loaded in a fresh process without torch, the alias round trip and
``promote``, and the registered planner evaluated by ``xroute evaluate --capacity``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL = "xroute-planner-smoke"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mlflow_store: str, ray_local: Any) -> dict[str, Any]:
    """One tiny training: the shipped bundle's windows, one load, two trials through Ray Tune."""
    from models.config import PlannerTrainConfig
    from models.planner_trainer import run_planner_training

    root = tmp_path_factory.mktemp("planner")
    cfg = PlannerTrainConfig.model_validate({
        "run_dir": str(root / "runs"),
        "data": {"train": ["default"], "loads": [1, 2], "selection": ["default"], "selection_loads": [1],
                 "selection_seeds": 1, "gate": ["default"], "gate_loads": [1], "gate_seeds": 2},
        "labels": {"episodes": 3, "episode_epochs": 12, "risk_epochs": 4},
        "fit": {"hidden": [16], "epochs": 8},
        "search": {"iterations": 1, "population": 3, "episodes": 2, "hazard_floors": [0.0, 1.0], "hedge_floors": [0.0],
                   "keep_launching": [True]},
        "trials": {"seeds": [0], "scorers": ["network", "none"]},
        "mlflow": {"experiment": "planner-smoke", "registered_model": MODEL, "tracking_uri": mlflow_store},
    })
    lines: list[str] = []
    summary = run_planner_training(cfg, echo=lines.append)
    return {"summary": summary, "cfg": cfg, "root": root, "lines": lines, "uri": mlflow_store}


def _client(uri: str) -> Any:
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.MlflowClient()


def test_trials_run_in_tune_and_are_tracked_with_the_gate_in_mlflow(trained: dict[str, Any]) -> None:
    s, root = trained["summary"], trained["root"]
    assert {t["scorer"] for t in s.trials} == {"network", "none"} and len(s.trials) == 2
    net = next(t for t in s.trials if t["scorer"] == "network")
    assert net["fit"]["states"] > 0 and net["fit"]["best_epoch"] >= 0 and s.labels["risk_rows"] > 0
    for t in s.trials:
        assert set(t["variants"]) == {"hazard>=0 hedge>=0 keep=y", "hazard>=1 hedge>=0 keep=y"}
        assert t["criterion"] == min(t["variants"].values()) == max(t["selection"].values())  # the worst window
    assert s.best["criterion"] == min(t["criterion"] for t in s.trials)
    assert [g.label for g in s.gate] == ["default x1"]
    names = {r.name for r in s.gate[0].results}
    assert names >= {"static-ondemand", "autoscaler", "spothedge", "melange", "oracle (hindsight)",
                     "learned planner (challenger)"} and len(names) == 7  # and the ablation
    assert s.decision.candidate == "learned planner (challenger)" and s.ablation is not None
    lo, hi = s.decision.pooled[1], s.decision.pooled[2]
    assert lo <= s.decision.pooled[0] <= hi and s.registered_version is not None
    assert any((root / "runs" / "tune").iterdir()) and list((root / "runs" / "tune").glob("*/tune_console.log"))
    assert any(ln.startswith("best trial: ") for ln in trained["lines"])
    assert sum(ln.startswith("trial s0-") for ln in trained["lines"]) == 2
    client = _client(trained["uri"])
    exp = client.get_experiment_by_name("planner-smoke")
    runs = client.search_runs([exp.experiment_id])
    trials = [r for r in runs if "xroute.trial" in r.data.tags]
    parent = [r for r in runs if "xroute.trial" not in r.data.tags]
    assert len(trials) == 2 and len(parent) == 1
    for r in trials:
        assert r.data.tags["mlflow.parentRunId"] == parent[0].info.run_id
        assert r.data.params["config.search.iterations"] == "1"
        assert "selection_criterion" in r.data.metrics
        assert len(client.get_metric_history(r.info.run_id, "search_best")) == 1
        names = {a.path for a in client.list_artifacts(r.info.run_id)}
        assert {"selection.md", "learning_curve.png", "planner_export"} <= names
    net_run = next(r for r in trials if r.data.tags["xroute.trial"] == "s0-network")
    assert len(client.get_metric_history(net_run.info.run_id, "fit_holdout_risk")) == 9  # epoch 0 (zero net) .. 8
    p = parent[0].info.run_id
    top = {a.path for a in client.list_artifacts(p)}
    assert {"gate.md", "gate", "baselines_selection.md", "labels.json", "trials.json"} <= top
    gate_md = Path(client.download_artifacts(p, "gate.md")).read_text()
    assert "| default x1 |" in gate_md and "× SpotHedge" in gate_md and "gap closed" in gate_md
    assert {a.path for a in client.list_artifacts(p, "gate")} >= {"gate/gate.png", "gate/default_x1.md"}
    assert "gate_cost_ratio" in client.get_run(p).data.metrics


def test_registry_alias_round_trip_and_promote(trained: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.exceptions import MlflowException

    from models import registry
    from models.planner_net import read_planner
    from models.planner_policy import load_planner

    monkeypatch.setenv("MLFLOW_TRACKING_URI", trained["uri"])
    client = _client(trained["uri"])
    v = str(client.get_model_version_by_alias(MODEL, "challenger").version)
    assert v == trained["summary"].registered_version
    tags = client.get_model_version(MODEL, v).tags
    assert {"gate_passed", "gate_cost_ratio", "gate_cost_ratio_hi", "gate_reason", "ablation_gate_passed",
            "variant", "scorer"} <= set(tags)
    lp = load_planner(f"models:/{MODEL}@challenger")
    local = read_planner(trained["summary"].best["planner_dir"])
    assert lp.weights.knobs == local.knobs and len(lp.weights.layers) == len(local.layers)
    client.set_model_version_tag(MODEL, v, "gate_passed", "False")
    client.set_model_version_tag(MODEL, v, "gate_reason", "loses on default x4")
    d = registry.promote(MODEL)
    assert not d.promoted and "did not pass the gate: loses on default x4" in d.reason
    with pytest.raises(MlflowException):
        client.get_model_version_by_alias(MODEL, "champion")
    client.set_model_version_tag(MODEL, v, "gate_passed", "True")
    d = registry.promote(MODEL)
    assert d.promoted and str(client.get_model_version_by_alias(MODEL, "champion").version) == v
    assert load_planner(f"models:/{MODEL}@champion").weights.knobs == local.knobs


def test_evaluate_capacity_plays_the_registered_planner(trained: dict[str, Any], tmp_path: Path) -> None:
    env = {**os.environ, "MLFLOW_TRACKING_URI": trained["uri"]}
    out = tmp_path / "cap.json"
    export = trained["summary"].best["planner_dir"]
    r = subprocess.run([sys.executable, "-m", "xroute_app", "evaluate", "--capacity", "--policy", "spothedge",
                        "--policy", f"models:/{MODEL}@challenger", "--policy", export, "--seeds", "2",
                        "--output", str(out), "--no-plot", "--quiet"],
                       env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())["planners"]
    assert set(rep) == {"spothedge", f"models:/{MODEL}@challenger", Path(export).name}
    # the registered model and its local export are the same planner
    assert rep[Path(export).name]["cost_usd"] == rep[f"models:/{MODEL}@challenger"]["cost_usd"]
    assert rep[f"models:/{MODEL}@challenger"]["lost"] == 0


def test_registered_pyfunc_plans_in_a_fresh_process_without_torch(trained: dict[str, Any], tmp_path: Path) -> None:
    import mlflow
    from mlflow.models import Model

    from models.planner_net import read_planner
    from models.planner_pyfunc import predict_frame

    mlflow.set_tracking_uri(trained["uri"])
    uri = f"models:/{MODEL}@challenger"
    info = mlflow.models.get_model_info(uri)
    assert info.signature is not None and {c.name for c in info.signature.inputs.inputs} >= {"pools", "demand"}
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "m")))
    script = (
        "import sys, json, mlflow\n"
        f"mlflow.set_tracking_uri({trained['uri']!r})\n"
        f"m = mlflow.pyfunc.load_model({uri!r})\n"
        "from mlflow.models import Model\n"
        f"ex = Model.load({str(local)!r}).load_input_example({str(local)!r})\n"
        "out = m.predict(ex)\n"
        "print(json.dumps({'targets': out['targets'].tolist(), 'torch': 'torch' in sys.modules,\n"
        "                  'envs': 'envs.provisioning' in sys.modules}))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["torch"] is False and got["envs"] is False
    ex = Model.load(str(local)).load_input_example(str(local))
    want = predict_frame(read_planner(local), ex)["targets"].tolist()
    assert [list(map(int, t)) for t in got["targets"]] == want and sum(want[0]) > 0


def test_the_code_defaults_are_the_shipped_planner_config() -> None:
    from models.config import PlannerTrainConfig, load_planner_config

    assert PlannerTrainConfig().model_dump() == load_planner_config(None).model_dump()
