"""``xroute evaluate`` as a user runs it: a real subprocess, real files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from models.evaluate import METRICS


def xroute(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xroute_app", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_evaluate_writes_the_report_and_the_plot(tiny_bundle_dir, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    p = xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "static", "--policy", "cheapest",
               "--policy", "oracle", "--output", str(out), "--plot", str(png), "--quiet")
    assert p.returncode == 0, p.stderr
    assert "cheapest" in p.stdout and "oracle" in p.stdout
    rep = json.loads(out.read_text())
    assert set(rep["policies"]) == {"static", "cheapest", "oracle"}
    assert rep["seeds"] == 5 and rep["best_baseline"] == "cheapest"
    for m in rep["policies"].values():
        assert set(METRICS) <= set(m)
        assert m["requests"] == 400 and len(m["per_seed"]) == 5
        lo, hi = m["ci95"]["mean_reward"]
        assert lo <= m["mean_reward"] <= hi
    assert rep["policies"]["cheapest"]["vs_best_baseline"]["mean_reward"] == {"mean": 0.0, "ci95": [0.0, 0.0]}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_window_and_rate_scale(tiny_bundle_dir, tmp_path):
    out = tmp_path / "w.json"
    p = xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "greedy", "--start",
               "2024-01-01T00:00:20Z", "--end", "2024-01-01T00:01:00Z", "--rate-scale", "4", "--output", str(out),
               "--quiet")
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    assert 0 < rep["policies"]["greedy"]["requests"] < 400
    assert rep["rate_scale"] == 4.0


def _one_line_error(p: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_inputs_give_one_readable_line(tiny_bundle_dir, tmp_path):
    _one_line_error(xroute("evaluate", "--telemetry", str(tmp_path / "missing"), "--policy", "greedy"),
                    "not a directory")
    _one_line_error(xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "cheapst"),
                    "unknown policy 'cheapst'", "did you mean cheapest")
    _one_line_error(xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "greedy", "--start", "yesterday"),
                    "--start")
    _one_line_error(xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "greedy", "--rate-scale", "0"),
                    "--rate-scale")
    bad = tmp_path / "bad"
    shutil.copytree(tiny_bundle_dir, bad)
    text = (bad / "prices.csv").read_text().splitlines()
    text[2] = text[2].rsplit(",", 1)[0] + ",-1.5"
    (bad / "prices.csv").write_text("\n".join(text) + "\n")
    _one_line_error(xroute("evaluate", "--telemetry", str(bad), "--policy", "greedy"),
                    "prices.csv", "row 2", "usd_per_hour")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("env:\n  rewrd: {}\n")
    _one_line_error(xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "greedy", "--config", str(cfg)),
                    "env.rewrd", "unknown key")


def test_seeds_give_intervals_and_paired_differences(tiny_bundle_dir, tmp_path):
    """Per seed the metrics differ (noise, spot instants); the mean and its 95 % t-interval, and each
    policy's paired difference to the best baseline, are computed from the per-seed values."""
    import numpy as np
    from scipy import stats

    out = tmp_path / "s.json"
    p = xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "greedy", "--policy", "random",
               "--seeds", "4", "--seed", "10", "--rate-scale", "4", "--output", str(out), "--no-plot", "--quiet")
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    assert rep["seeds"] == 4 and rep["seed"] == 10 and not out.with_suffix(".png").exists()
    best = rep["best_baseline"]
    assert best == max(("greedy", "random"), key=lambda k: rep["policies"][k]["mean_reward"])
    g, r = rep["policies"][best], rep["policies"]["random" if best == "greedy" else "greedy"]
    x = np.array([s["mean_reward"] for s in g["per_seed"]])
    assert len(set(x)) > 1
    half = stats.t.ppf(0.975, 3) * x.std(ddof=1) / 2
    assert g["mean_reward"] == pytest.approx(x.mean(), abs=2e-6)
    assert g["ci95"]["mean_reward"] == pytest.approx([x.mean() - half, x.mean() + half], abs=2e-6)
    d = np.array([a["mean_reward"] - b["mean_reward"] for a, b in zip(r["per_seed"], g["per_seed"])])
    assert r["vs_best_baseline"]["mean_reward"]["mean"] == pytest.approx(d.mean(), abs=2e-6) and d.mean() < 0


def test_reports_never_overwrite_each_other_and_progress_shows_off_a_terminal(tiny_bundle_dir, tmp_path):
    """Without --output each run writes its own timestamped report (the README's examples used to
    overwrite the main job's); with output not a terminal, progress comes as plain lines."""
    runs = [xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "greedy", "--seeds", "1",
                   "--no-plot", cwd=tmp_path) for _ in range(2)]
    for p in runs:
        assert p.returncode == 0, p.stderr
        assert "evaluate: greedy seed 1/1: 400/400 requests (100 %)" in p.stderr
    reports = sorted((tmp_path / "reports").glob("evaluate-*.json"))
    assert len(reports) == 2 and reports[0] != reports[1]


def test_sample_and_a_multi_day_title(tiny_bundle_dir, tmp_path):
    import pandas as pd

    out = tmp_path / "q.json"
    p = xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "greedy", "--sample", "120",
               "--seeds", "1", "--output", str(out), "--no-plot", "--quiet")
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text())["policies"]["greedy"]["requests"] == 120
    assert "120 requests (sample of 120)" in p.stdout.replace("\n", " ")
    w = pd.read_csv(tiny_bundle_dir / "workload.csv")
    w.loc[w.index[-50:], "ts"] = [(pd.Timestamp(t) + pd.Timedelta(days=3)).isoformat() for t in w["ts"].iloc[-50:]]
    root = tmp_path / "days"
    shutil.copytree(tiny_bundle_dir, root)
    w.to_csv(root / "workload.csv", index=False)
    p = xroute("evaluate", "--telemetry", str(root), "--policy", "greedy", "--seeds", "1", "--output", str(out),
               "--no-plot", "--quiet")
    assert p.returncode == 0, p.stderr
    assert "2024-01-01 00:00–2024-01-04 00:" in p.stdout  # the end's date is shown when it differs


def test_errors_say_where_the_answer_is(tiny_bundle_dir, tmp_path):
    _one_line_error(xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "greedy",
                           "--start", "2031-01-01T00:00:00Z"),
                    "no requests between 2031-01-01T00:00:00Z and the end", "this bundle's requests span 2024-01-01T00:00")
    _one_line_error(xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy",
                           "static:aws:us-east-1:g5.xlarge:on_demnd"),
                    "no such offering_id", "did you mean aws:us-east-1:g5.xlarge:on_demand", "offerings.csv")
    _one_line_error(xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "greedy", "--seeds", "0"),
                    "--seeds")


def test_evaluate_capacity_writes_the_report_and_the_plot(tmp_path):
    """``xroute evaluate --capacity``: the planners over the shipped bundle's test window, paired by seed."""
    from models.capacity_eval import METRICS as CAP_METRICS

    out = tmp_path / "cap.json"
    p = xroute("evaluate", "--capacity", "--policy", "static-ondemand", "--policy", "spothedge", "--policy", "oracle",
               "--seeds", "2", "--output", str(out), "--quiet")
    assert p.returncode == 0, p.stderr
    assert "spothedge" in p.stdout and "oracle (hindsight)" in p.stdout
    rep = json.loads(out.read_text())
    assert set(rep["planners"]) == {"static-ondemand", "spothedge", "oracle (hindsight)"}
    assert rep["reference"] == "static-ondemand" and rep["window"] == "test" and rep["seeds"] == 2
    ref = rep["planners"]["static-ondemand"]["per_seed"]
    for name, m in rep["planners"].items():
        assert set(CAP_METRICS) <= set(m) and len(m["per_seed"]) == 2
        assert m["lost"] == 0 and "slo_attainment[code]" in m and "slo_attainment[conv]" in m
        ratios = [a["cost_usd"] / b["cost_usd"] for a, b in zip(m["per_seed"], ref)]
        assert m["vs_reference"]["cost_ratio"]["mean"] == pytest.approx(sum(ratios) / 2, abs=2e-6), name
    assert rep["summary"]["best_baseline"] in {"static-ondemand", "spothedge"}
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_capacity_bad_input_gives_one_readable_line(tmp_path):
    _one_line_error(xroute("evaluate", "--capacity", "--policy", "greedy"), "unknown planner 'greedy'")
    _one_line_error(xroute("evaluate", "--capacity", "--policy", "spothedge", "--sample", "100"),
                    "--sample: not available with --capacity")
    _one_line_error(xroute("evaluate", "--policy", "greedy", "--load-scale", "2"), "--load-scale: only with --capacity")
    cfg = tmp_path / "cap.yaml"
    cfg.write_text("planners:\n  spothedge:\n    overprovision: 2\n")
    _one_line_error(xroute("evaluate", "--capacity", "--policy", "spothedge", "--config", str(cfg)),
                    "planners.spothedge.overprovision", "unknown key")
    cfg.write_text("world:\n  epoch_s: -60\n")
    _one_line_error(xroute("evaluate", "--capacity", "--policy", "spothedge", "--config", str(cfg)), "world.epoch_s")
