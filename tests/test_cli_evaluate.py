"""``xroute evaluate`` as a user runs it: a real subprocess, real files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from xroute.evaluate import METRICS


def xroute(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xroute.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_evaluate_writes_the_report_and_the_plot(tiny_bundle_dir, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    p = xroute("evaluate", "--telemetry", str(tiny_bundle_dir), "--policy", "static", "--policy", "cheapest",
               "--policy", "oracle", "--output", str(out), "--plot", str(png), "--quiet")
    assert p.returncode == 0, p.stderr
    assert "cheapest" in p.stdout and "oracle" in p.stdout
    rep = json.loads(out.read_text())
    assert set(rep["policies"]) == {"static", "cheapest", "oracle"}
    for m in rep["policies"].values():
        assert set(METRICS) <= set(m)
        assert m["requests"] == 400
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
