"""The DQN fine-tuning ablation runner (``models.ablation``) on a tiny budget: every variant trained
for real (SB3, no Ray), compared paired to its own warm start on the gate windows, logged to a real
MLflow store with its curves; its config is validated before anything trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from models.ablation import AblationConfig, combine, compare, load_ablation_config, run_ablation
from tests.test_agent import write_agent_setup
from xroute.errors import ConfigError

pytestmark = pytest.mark.slow


def _config(setup: dict[str, Any], root: Path, variants: list[dict[str, Any]]) -> AblationConfig:
    return AblationConfig.model_validate({
        "train_config": str(setup["train_yaml"]), "run_dir": str(root / "abl"), "seeds": [0], "eval_seeds": 2,
        "base": {"total_timesteps": 200, "eval_every": 100, "progress_every": 50,
                 "mlflow": {"experiment": "abl", "tracking_uri": f"sqlite:///{root / 'm.db'}"}},
        "variants": variants})


def test_every_variant_is_trained_compared_to_its_warm_start_and_logged(tmp_path: Path) -> None:
    import mlflow

    setup = write_agent_setup(tmp_path / "s")
    acfg = _config(setup, tmp_path, [
        {"name": "plain"},
        {"name": "nstep3-topk-demo", "overrides": {"dqn": {"n_steps": 3, "exploration": "top_k", "demo_weight": 1.0}}},
    ])
    lines: list[str] = []
    out = run_ablation(acfg, echo=lines.append)
    s = {v["variant"]: v for v in out["summary"]["variants"]}
    assert set(s) == {"plain", "nstep3-topk-demo"}
    for v in s.values():
        for key in ("best", "last", "warm_vs_greedy"):
            m, lo, hi = v[key]
            assert np.isfinite(lo) and lo <= m <= hi
    for r in out["rows"]:
        assert set(r["per_scenario"]) == {"bundle x1", "bundle x4"}
        for d in r["per_scenario"].values():
            assert set(d) == {"warm start", "fine-tuned (best)", "fine-tuned (last)", "greedy"}
            assert all(len(x) == 2 for x in d.values())
    # the two variants share one warm start (same seed, gamma, scale): its evaluation is the same
    a, b = out["rows"]
    assert a["per_scenario"]["bundle x1"]["warm start"] == b["per_scenario"]["bundle x1"]["warm start"]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.get_experiment_by_name("abl")
    runs = client.search_runs([exp.experiment_id])
    parent = [r for r in runs if "xroute.trial" not in r.data.tags]
    children = [r for r in runs if "xroute.trial" in r.data.tags]
    assert len(parent) == 1 and len(children) == 2
    arts = {f.path for f in client.list_artifacts(parent[0].info.run_id)}
    assert {"ablation.md", "ablation.json", "ablation_curves.png", "ablation_delta.png"} <= arts
    assert {"delta_best.plain", "delta_last.plain"} <= set(parent[0].data.metrics)
    for c in children:
        assert c.data.tags["mlflow.parentRunId"] == parent[0].info.run_id
        assert c.data.tags["xroute.variant"] in s and c.data.params["variant"] == c.data.tags["xroute.variant"]
        assert {"ablation_delta_best", "ablation_delta_last", "probe_advantage", "probe_churn", "td_abs"} <= set(
            c.data.metrics)
        assert len(client.get_metric_history(c.info.run_id, "val_criterion")) >= 3  # step 0, 100, 200
    assert (Path(out["out_dir"]) / "ablation.md").read_text().count("|") > 10
    # a second invocation (another seed) labels nothing and fits no warm start again: both from disk
    lines.clear()
    again = run_ablation(acfg.model_copy(update={"variants": acfg.variants[:1], "seeds": [1]}), echo=lines.append)
    assert any(ln.startswith("warm start: ") and " from " in ln for ln in lines)
    assert len(list((tmp_path / "abl").glob("warm_fit_*.pt"))) == 2  # seeds 0 and 1 (one gamma, one scale)
    assert again["rows"][0]["seed"] == 1
    # both invocations pooled: the variant run twice has two seeds
    combined = combine(acfg.run_dir, echo=lambda s: None)
    seeds = {v["variant"]: v["seeds"] for v in combined["summary"]["variants"]}
    assert seeds == {"plain": 2, "nstep3-topk-demo": 1}
    assert (Path(combined["out_dir"]) / "ablation_curves.png").stat().st_size > 10_000
    assert any(r.info.run_name.startswith("ablation-combined") for r in client.search_runs([exp.experiment_id]))
    # across variants: one's fine-tuned router against the other's warm start, paired by seed, scenario and
    # evaluation seed -- on seed 0, the only one both ran; against its own warm start it is the summary's Δ
    cmp = compare(acfg.run_dir, "nstep3-topk-demo", "plain", echo=lambda s: None)
    assert cmp["seeds"] == [0] and set(cmp["per_scenario"]) == {"bundle x1 (seed 0)", "bundle x4 (seed 0)"}
    row = {r["variant"]: r for r in out["rows"]}["nstep3-topk-demo"]["per_scenario"]
    want = np.mean([np.asarray(d["fine-tuned (best)"]) - np.asarray(b["per_scenario"][k]["warm start"])
                    for k, d in row.items()])
    assert cmp["pooled"][0] == pytest.approx(want)
    own = compare(acfg.run_dir, "plain", "plain", echo=lambda s: None)
    by_variant = {v["variant"]: v for v in combined["summary"]["variants"]}
    pooled_plain = by_variant["plain"]["best"]
    # two training seeds: the stricter interval over their means alone is wider, around the same mean
    m, lo, hi = by_variant["plain"]["best_by_seed"]
    assert m == pytest.approx(pooled_plain[0]) and hi - lo >= pooled_plain[2] - pooled_plain[1]
    assert not np.isfinite(by_variant["nstep3-topk-demo"]["best_by_seed"][1])  # one seed: none
    assert own["seeds"] == [0, 1] and own["pooled"] == pytest.approx(pooled_plain)
    with pytest.raises(ConfigError, match="--compare: no training seed"):
        compare(acfg.run_dir, "plain", "nope", echo=lambda s: None)


def test_bad_ablation_configs_name_the_field_before_anything_trains(tmp_path: Path) -> None:
    setup = write_agent_setup(tmp_path / "s")
    bad = _config(setup, tmp_path, [{"name": "x", "overrides": {"dqn": {"n_step": 5}}}])
    with pytest.raises(ConfigError, match=r"variant 'x'.*field 'dqn.n_step'"):
        run_ablation(bad, echo=lambda s: None)
    assert not (tmp_path / "abl" / "trials").exists()
    p = tmp_path / "a.yaml"
    p.write_text(yaml.safe_dump({"variants": [{"name": "a"}, {"name": "a"}]}))
    with pytest.raises(ConfigError, match="field 'variants'"):
        load_ablation_config(p)
    p.write_text(yaml.safe_dump({"variants": [{"name": "a"}], "sedes": [1]}))
    with pytest.raises(ConfigError, match="field 'sedes': unknown key"):
        load_ablation_config(p)
    env_change = _config(setup, tmp_path, [{"name": "y", "overrides": {"episode_requests": 32}}])
    with pytest.raises(ConfigError, match="variant 'y'"):
        run_ablation(env_change, echo=lambda s: None)


@pytest.mark.parametrize("name", ["ablation.yaml", "ablation_control.yaml", "ablation_main.yaml"])
def test_the_shipped_ablation_configs_and_every_variant_validate(name: str) -> None:
    """Every variant of the shipped ablation configs is a valid train config (a misspelt knob in
    one would otherwise surface only when that variant's turn came, minutes into a run)."""
    from models.ablation import base_config, variant_config

    root = Path(__file__).resolve().parents[1]
    acfg = load_ablation_config(root / "configs" / name)
    base = base_config(acfg)  # (configs/train.yaml with the ablation's base, as run_ablation builds it)
    for v in acfg.variants:
        cfg = variant_config(base, v)
        assert cfg.model_dump() != base.model_dump() or not v.overrides
    assert acfg.variants
