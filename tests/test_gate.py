"""The promotion gate's verdict (``models.gate.decide``) on known differences, and its families
(``data.gate_families``: the scenarios they add, the bundles they rescale, their validation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from models.config import TrainConfig
from models.gate import ScenarioResult, decide, families_markdown
from tests.test_agent import write_agent_setup
from xroute.config import parse_config
from xroute.errors import ConfigError


def _scenarios(*per_seed: list[float]) -> list[ScenarioResult]:
    """Scenarios whose best baseline is greedy: the differences to it are the differences to greedy."""
    return [ScenarioResult(f"s{k}", [], "greedy", {"router": np.array(d)}, vs_greedy={"router": np.array(d)})
            for k, d in enumerate(per_seed)]


def test_a_clear_gain_everywhere_passes() -> None:
    d = decide(_scenarios([0.010, 0.011, 0.012], [0.004, 0.005, 0.006]), "router")
    assert d.passed and d.wins == ["s0", "s1"] and not d.losses and d.pooled[1] > 0


def test_a_significant_loss_anywhere_refuses_even_with_a_pooled_gain() -> None:
    d = decide(_scenarios([0.05, 0.051, 0.052], [-0.002, -0.0021, -0.0019]), "router")
    assert not d.passed and d.losses == ["s1"] and "loses to the best baseline" in d.reason and d.pooled[1] > 0


def test_a_gain_within_noise_refuses() -> None:
    d = decide(_scenarios([0.004, -0.003, 0.001], [0.002, -0.004, 0.003]), "router")
    assert not d.passed and not d.losses and "beyond noise" in d.reason and d.pooled[1] <= 0 < d.pooled[2]


def test_the_verdict_is_recorded_as_tags() -> None:
    d = decide(_scenarios([0.01, 0.012, 0.011], [0.02, 0.018, 0.019]), "router")
    t = d.tags()
    assert t["gate_passed"] is True and t["gate_reward_delta"] == d.pooled[0] and t["gate_losses"] == "none"
    assert t["gate_inferior"] == "none" and t["gate_margin"] == 0.0002 and t["gate_margin_rel"] == 0.0025


def _sr(label: str, fam: str, vs_best: list[float], vs_greedy: list[float], greedy: float = -0.08) -> ScenarioResult:
    return ScenarioResult(label, [], "cheapest", {"router": np.array(vs_best)}, family=fam,
                          vs_greedy={"router": np.array(vs_greedy)}, greedy_reward=greedy)


def test_a_load_where_the_router_is_worse_than_greedy_refuses_whatever_the_pooled_gain() -> None:
    """Against the best baseline (not greedy) the router wins pooled and loses nowhere significantly;
    family B pooled is even above greedy -- but at x1 it is worse than greedy beyond the margin:
    refused, naming the scenario (the issue's "every family and load")."""
    runs = [_sr("a x1", "A", [0.020, 0.021, 0.022], [0.003, 0.004, 0.003]),
            _sr("b x1", "B", [0.004, -0.003, 0.002], [-0.0018, -0.0021, -0.0015]),
            _sr("b x4", "B", [0.001, -0.002, 0.003], [0.0040, 0.0041, 0.0039])]
    d = decide(runs, "router", margin=0.0002, margin_rel=0.0025)
    assert d.pooled[1] > 0 and not d.losses  # the old gate would have passed it
    assert d.families["B"][1] > 0  # pooled over its loads B looks fine
    assert not d.passed and d.inferior == ["b x1"] and "non-inferior to greedy" in d.reason and "b x1 (B)" in d.reason
    assert d.tags()["gate_inferior"] == "b x1"
    assert decide(runs, "router", margin=0.01).passed  # a wider margin tolerates it
    table = families_markdown(runs, ["router"], 0.0002)
    assert "| B | b x1; b x4 |" in table and "**no**: b x1" in table and "| A | a x1 |" in table


def test_the_margin_scales_with_greedys_reward() -> None:
    """-0.002 is within 0.0025 x |-2.9| (the overload scenario's scale) but not within 0.0025 x 0.08."""
    small = _sr("w x1", "w", [0.01, 0.011, 0.012], [-0.0020, -0.0021, -0.0019], greedy=-0.08)
    big = _sr("o x2", "overload", [0.01, 0.011, 0.012], [-0.0020, -0.0021, -0.0019], greedy=-2.9)
    assert small.margin(0.0002, 0.0025) == pytest.approx(0.0002)
    assert big.margin(0.0002, 0.0025) == pytest.approx(0.00725)
    assert not small.non_inferior("router", 0.0002, 0.0025) and big.non_inferior("router", 0.0002, 0.0025)
    assert decide([big], "router").inferior == [] and decide([small], "router").inferior == ["w x1"]


def _family_cfg(setup: dict[str, Any], families: list[dict[str, Any]]) -> TrainConfig:
    raw = yaml.safe_load(Path(setup["train_yaml"]).read_text())
    raw.pop("telemetry")
    raw["data"] = {**raw["data"], "train": [str(setup["bundle"])], "selection": [str(setup["bundle"])],
                   "gate": [str(setup["bundle"])], "gate_rates": [1.0], "gate_overload": None,
                   "gate_families": families, "train_families": []}
    return parse_config(TrainConfig, raw, "test")


def test_families_add_scenarios_with_their_tenants_slos_and_capacity(tmp_path: Path) -> None:
    from models.scenarios import build_scenarios

    setup = write_agent_setup(tmp_path)
    cfg = _family_cfg(setup, [
        {"name": "strict-relaxed", "rates": [1.0, 4.0],
         "tenants": {"strict": {"share": 0.5, "slo_scale": 0.5}, "relaxed": {"share": 0.5, "slo_scale": 2.0}}},
        {"name": "scarce", "capacity_scale": 0.25}])
    sc = build_scenarios(cfg)
    assert [(s.label, s.family, s.rate) for s in sc.gate] == [
        ("bundle x1", "bundle", 1.0), ("strict-relaxed:bundle x1", "strict-relaxed", 1.0),
        ("strict-relaxed:bundle x4", "strict-relaxed", 4.0), ("scarce:bundle x1", "scarce", 1.0)]
    base, sr, scarce = sc.gate[0].bundle, sc.gate[1].bundle, sc.gate[3].bundle
    # the same requests at the same times; only what they ask for changes
    assert sr.workload["request_id"].tolist() == base.workload["request_id"].tolist()
    assert sr.workload["ts"].tolist() == base.workload["ts"].tolist()
    tenants = sr.workload["tenant"]
    assert set(tenants) == {"strict", "relaxed"} and 0.3 < (tenants == "strict").mean() < 0.7
    for t, k in (("strict", 0.5), ("relaxed", 2.0)):
        m = (tenants == t).to_numpy()
        np.testing.assert_allclose(sr.workload["ttft_ms"].to_numpy()[m], base.workload["ttft_ms"].to_numpy()[m] * k)
        np.testing.assert_allclose(sr.workload["tpot_ms"].to_numpy()[m], base.workload["tpot_ms"].to_numpy()[m] * k)
    caps, scarce_caps = base.offerings["capacity_replicas"], scarce.offerings["capacity_replicas"]
    assert (scarce_caps == (caps * 0.25).round().clip(lower=1)).all() and scarce_caps.sum() < caps.sum()
    assert scarce.workload.equals(base.workload)
    assert len({base.content_hash, sr.content_hash, scarce.content_hash}) == 3  # (no cache mixes them up)
    assert {"strict-relaxed/bundle", "scarce/bundle"} <= set(sc.bundle_hashes)


@pytest.mark.parametrize(("families", "field"), [
    ([{"name": "a"}, {"name": "a"}], "data.gate_families.*'a' repeats"),
    ([{"name": "overload"}], "data.gate_families.*reserved"),
    ([{"name": "Bad Name"}], r"data.gate_families.0.name"),
    ([{"name": "a", "capacity_scale": 0}], r"data.gate_families.0.capacity_scale"),
    ([{"name": "a", "rates": [0]}], r"data.gate_families.0.rates"),
    ([{"name": "a", "tenants": {"t": {"share": 0.5, "slo_scale": -1}}}], r"data.gate_families.0.tenants.t.slo_scale"),
    ([{"name": "a", "colour": "red"}], r"data.gate_families.0.colour"),
])
def test_a_bad_family_is_a_config_error_naming_the_field(tmp_path: Path, families: list[dict[str, Any]],
                                                          field: str) -> None:
    setup = write_agent_setup(tmp_path)
    with pytest.raises(ConfigError, match=field) as e:
        _family_cfg(setup, families)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["gate_families", "selection_families"])
def test_a_family_naming_a_missing_bundle_says_which_field(tmp_path: Path, kind: str) -> None:
    from models.scenarios import build_scenarios

    setup = write_agent_setup(tmp_path)
    family = [{"name": "x", "bundles": [str(tmp_path / "nowhere")]}]
    cfg = _family_cfg(setup, family) if kind == "gate_families" else _selection_family_cfg(setup, family)
    with pytest.raises(ConfigError, match=rf"data.{kind}\[0\].bundles\[0\]"):
        build_scenarios(cfg)


def test_training_families_add_randomized_copies_of_the_train_windows_and_key_the_labels(tmp_path: Path) -> None:
    """``data.train_families`` (domain randomization): each training bundle's train window also
    relabelled into the family's tenants with their SLOs rescaled; the warm start's cached labels
    are keyed by them (a run with other families never reuses them)."""
    from models.scenarios import build_scenarios, train_env_config
    from models.warmstart_labels import label_key

    setup = write_agent_setup(tmp_path)
    mix = {"name": "slo-mix", "tenants": {"strict": {"share": 0.5, "slo_scale": 0.6},
                                          "relaxed": {"share": 0.5, "slo_scale": 1.6}}}
    plain = _family_cfg(setup, [])
    cfg = plain.model_copy(update={"data": plain.data.model_copy(update={"train_families": [
        parse_config(TrainConfig, {"data": {"train_families": [mix]}}, "t").data.train_families[0]]})})
    base, sc = build_scenarios(plain), build_scenarios(cfg)
    assert [s.label for s in sc.train] == [s.label for s in base.train] + ["slo-mix:bundle"]
    fam, orig = sc.train[-1].bundle.workload, base.train[0].bundle.workload
    assert fam["request_id"].tolist() == orig["request_id"].tolist() and set(fam["tenant"]) == {"strict", "relaxed"}
    ratio = (fam["ttft_ms"] / orig["ttft_ms"]).round(6)
    assert set(ratio[fam["tenant"] == "strict"]) == {0.6} and set(ratio[fam["tenant"] == "relaxed"]) == {1.6}
    env_cfg = train_env_config(plain, plain.evaluate_settings(), base.max_offerings)
    assert label_key(plain, "h", env_cfg) != label_key(cfg, "h", env_cfg)
    with pytest.raises(ConfigError, match=r"data.*train_families\[0\].bundles\[0\]: 'nope' is not one of data.train"):
        parse_config(TrainConfig, {"data": {"train_families": [{**mix, "bundles": ["nope"]}]}}, "t")


def _selection_family_cfg(setup: dict[str, Any], families: list[dict[str, Any]],
                          gate_families: list[dict[str, Any]] | None = None) -> TrainConfig:
    raw = yaml.safe_load(Path(setup["train_yaml"]).read_text())
    raw.pop("telemetry")
    raw["data"] = {**raw["data"], "train": [str(setup["bundle"])], "selection": [str(setup["bundle"])],
                   "selection_rates": [1.0], "gate": [str(setup["bundle"])], "gate_rates": [1.0],
                   "gate_overload": None, "gate_families": gate_families or [], "train_families": [],
                   "selection_families": families}
    return parse_config(TrainConfig, raw, "test")


def test_selection_families_are_validation_windows_relabelled_never_a_test_window(tmp_path: Path) -> None:
    """``data.selection_families``: the selection also sees its bundles' *validation* windows with the
    requests relabelled into the family's tenants (SLOs rescaled) -- the same requests at the same
    times as the plain validation window, none of the test window's (which the gate judges on)."""
    from models.scenarios import build_scenarios, split_bundle
    from xroute.bundle import load_bundle

    setup = write_agent_setup(tmp_path)
    mix = {"name": "slo-mix", "rates": [1.0, 2.0],
           "tenants": {"strict": {"share": 0.5, "slo_scale": 0.6}, "relaxed": {"share": 0.5, "slo_scale": 1.6}}}
    cfg = _selection_family_cfg(setup, [mix])
    sc = build_scenarios(cfg)
    assert [(s.label, s.family, s.rate) for s in sc.selection] == [
        ("bundle x1", "bundle", 1.0), ("slo-mix:bundle x1", "slo-mix", 1.0), ("slo-mix:bundle x2", "slo-mix", 2.0)]
    windows = split_bundle(load_bundle(setup["bundle"]), cfg.split).bundles
    val, test = windows["validation"].workload, windows["test"].workload
    for s in sc.selection[1:]:
        w = s.bundle.workload
        assert w["request_id"].tolist() == val["request_id"].tolist()  # the validation window, whole
        assert w["ts"].tolist() == val["ts"].tolist()
        assert not set(w["request_id"]) & set(test["request_id"])  # and nothing of the test window
        assert w["ts"].max() < test["ts"].min()
        assert set(w["tenant"]) == {"strict", "relaxed"}
        ratio = (w["ttft_ms"] / val["ttft_ms"]).round(6)
        assert set(ratio[w["tenant"] == "strict"]) == {0.6} and set(ratio[w["tenant"] == "relaxed"]) == {1.6}
    assert "selection:slo-mix/bundle" in sc.bundle_hashes
    assert sc.bundle_hashes["selection:slo-mix/bundle"] != sc.bundle_hashes["bundle"]
    assert [s.label for s in sc.gate] == ["bundle x1"]  # the gate unchanged


@pytest.mark.parametrize(("families", "gate_families", "field"), [
    ([{"name": "a"}, {"name": "a"}], None, "data.selection_families.*'a' repeats"),
    ([{"name": "overload"}], None, "data.selection_families.*reserved"),
    ([{"name": "a", "rates": [0]}], None, r"data.selection_families.0.rates"),
    ([{"name": "a", "tenants": {"t": {"share": 0}}}], None, r"data.selection_families.0.tenants.t.share"),
    ([{"name": "a", "window": "test"}], None, r"data.selection_families.0.window"),
    ([{"name": "b", "tenants": {"s": {"share": 0.5, "slo_scale": 0.5}, "r": {"share": 0.5, "slo_scale": 2.0}}}],
     [{"name": "sr", "tenants": {"s": {"share": 0.5, "slo_scale": 0.5}, "r": {"share": 0.5, "slo_scale": 2.0}}}],
     r"data.*selection_families\[0\]: the recipe of gate_families\[0\] 'sr'"),
])
def test_a_bad_selection_family_is_a_config_error_naming_the_field(
        tmp_path: Path, families: list[dict[str, Any]], gate_families: list[dict[str, Any]] | None,
        field: str) -> None:
    setup = write_agent_setup(tmp_path)
    with pytest.raises(ConfigError, match=field) as e:
        _selection_family_cfg(setup, families, gate_families)
    assert "\n" not in str(e.value)


