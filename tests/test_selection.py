"""Selection on several validation windows (``data.selection`` as a list) and the warm start's
labelled states kept between runs (``warm_start.cache``)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES
from models.config import TrainConfig, load_train_config
from tests.test_agent import write_agent_setup
from tests.tinybundle import write_tiny_bundle
from xroute.config import parse_config
from xroute.errors import ConfigError


def _cfg(setup: dict[str, Any], **data: Any) -> TrainConfig:
    raw = yaml.safe_load(Path(setup["train_yaml"]).read_text())
    raw.pop("telemetry")
    raw["data"] = {**raw["data"], **data}
    return parse_config(TrainConfig, raw, "test")


def test_selection_is_one_bundle_or_a_list(tmp_path: Path) -> None:
    p = tmp_path / "t.yaml"
    p.write_text(yaml.safe_dump({"data": {"selection": "feb2024"}}))
    assert load_train_config(p).data.selection == ["feb2024"]
    p.write_text(yaml.safe_dump({"data": {"selection": ["mar2024", "feb2024"]}}))
    assert load_train_config(p).data.selection == ["mar2024", "feb2024"]
    for bad, what in (([], "at least 1"), (["mar2024", "mar2024"], "mar2024 repeats"), (3, "")):
        p.write_text(yaml.safe_dump({"data": {"selection": bad}}))
        with pytest.raises(ConfigError, match=f"field 'data.selection.*{what}") as e:
            load_train_config(p)
        assert "\n" not in str(e.value)


def test_every_selection_bundles_validation_window_at_every_load_and_the_worst_decides(tmp_path: Path) -> None:
    """Two bundles x two loads: four scenarios, each its bundle's validation window (never a train
    window); a candidate's score is the minimum of its four paired differences to greedy."""
    from envs.cloud_route import CloudRouteEnv
    from models.baselines import make_baseline
    from models.callbacks import Selection
    from models.evaluate import run_policy
    from models.policy import LearnedPolicy, RewardPrior, RouterWeights
    from models.scenarios import build_scenarios, eval_env_config, split_bundle, train_env_config
    from xroute.bundle import load_bundle

    setup = write_agent_setup(tmp_path / "a")
    other = write_tiny_bundle(tmp_path / "b" / "bundle", n_requests=300, seed=11)
    cfg = _cfg(setup, train=[str(setup["bundle"])], selection=[str(setup["bundle"]), str(other)],
               selection_rates=[1.0, 3.0], gate=[str(other)])
    sc = build_scenarios(cfg)
    assert [s.label for s in sc.selection] == ["bundle x1", "bundle x3", "bundle x1", "bundle x3"]
    assert [s.rate for s in sc.selection] == [1.0, 3.0, 1.0, 3.0]
    for s, ref in zip(sc.selection, [setup["bundle"], setup["bundle"], other, other]):
        val = split_bundle(load_bundle(ref), cfg.split).bundles["validation"].workload
        assert s.bundle.workload["request_id"].tolist() == val["request_id"].tolist()
    train_ids = set(sc.train[0].bundle.workload["request_id"])
    assert not train_ids & set(sc.selection[0].bundle.workload["request_id"])

    eval_cfg = cfg.evaluate_settings()
    env_cfg = train_env_config(cfg, eval_cfg, sc.max_offerings)
    envs = [(s.label, CloudRouteEnv(s.bundle, eval_env_config(eval_cfg, s.rate), history=s.history))
            for s in sc.selection]
    greedy = make_baseline("greedy", eval_cfg)
    sel = Selection(envs, 0, greedy)
    rng = np.random.default_rng(0)
    dims = [N_OFFERING_FEATURES + N_REQUEST_FEATURES, 8, 1]
    w = RouterWeights(layers=[(rng.normal(0, 1, (a, b)).astype(np.float32), rng.normal(0, 1, b).astype(np.float32))
                              for a, b in itertools.pairwise(dims)],
                      prior=RewardPrior.from_env_config(env_cfg))
    score, runs = sel.score(w)
    diffs = [float(run_policy(env, LearnedPolicy(w), 0, compare_greedy=False).metrics["mean_reward"])
             - float(run_policy(env, greedy, 0).metrics["mean_reward"]) for _, env in envs]
    assert len(runs) == 4 and score == pytest.approx(min(diffs), abs=1e-12)
    assert len({round(d, 9) for d in diffs}) > 1  # the four windows do differ: the minimum is a choice


def test_labelled_states_are_kept_and_reused_only_for_the_same_settings(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from models.scenarios import build_scenarios, train_env_config
    from models.warmstart_labels import cached_warm_start

    setup = write_agent_setup(tmp_path)
    cfg: TrainConfig = setup["cfg"]
    sc = build_scenarios(cfg)
    env_cfg = train_env_config(cfg, cfg.evaluate_settings(), sc.max_offerings)
    cache = tmp_path / "cache"
    said: list[str] = []
    first = cached_warm_start(cfg, env_cfg, sc.train, "h", cache, False, said.append)
    assert any("labelling" in s for s in said)
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 1 and files[0].startswith("warm_start_") and files[0].endswith(".npz")
    said.clear()
    again = cached_warm_start(cfg, env_cfg, sc.train, "h", cache, False, said.append)
    assert not any("labelling" in s for s in said) and any("from" in s for s in said)
    for f in ("offerings", "request", "mask", "actions", "advantage", "weight", "greedy_reward"):
        assert np.array_equal(getattr(first, f), getattr(again, f)), f
    # other labels (another horizon, other bundles, other chunks): labelled again, into another file
    other = cfg.model_copy(update={"warm_start": cfg.warm_start.model_copy(update={"horizon": 3})})
    said.clear()
    cached_warm_start(other, env_cfg, sc.train, "h", cache, False, said.append)
    cached_warm_start(cfg, env_cfg, sc.train, "h2", cache, False, said.append)
    assert sum("labelling" in s for s in said) == 2
    assert len(list(cache.iterdir())) == 3  # (no temporary file left behind)
    # after the code that makes the labels changed (an upgrade, an edit), labelled again: a checkout with other
    # code differs in its fingerprint alone, which is what is set here
    import models.warmstart_labels as wl

    real = wl.code_fingerprint()
    assert len(real) == 16 and wl.code_fingerprint() == real
    key = wl.label_key(cfg, "h", env_cfg)
    said.clear()
    monkeypatch.setattr(wl, "code_fingerprint", lambda: "0" * 16)
    assert wl.label_key(cfg, "h", env_cfg) != key
    cached_warm_start(cfg, env_cfg, sc.train, "h", cache, False, said.append)
    monkeypatch.undo()
    assert any("labelling" in s for s in said) and len(list(cache.iterdir())) == 4
    # without a cache directory nothing is written and the labels are the same
    fresh = cached_warm_start(cfg, env_cfg, sc.train, "h", None, False, lambda s: None)
    assert np.array_equal(fresh.advantage, first.advantage)
