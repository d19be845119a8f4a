"""The collector end to end: three local cloud stand-ins -> a bundle that ``load_bundle`` accepts,
with partial failures, throttling, deadlines, crash-safe commits and the CLI."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from cloud_adapters.cli import telemetry_app
from cloud_adapters.collect.commit import JOURNAL, _sigint_deferred, commit, read_tables, recover
from cloud_adapters.collect.config import CollectConfig
from cloud_adapters.collect.lock import dir_lock
from cloud_adapters.collect.run import MANIFEST, collect_once
from tests.clouds import Fault, local_clouds
from xroute.bundle import load_bundle
from xroute.errors import BundleError, ConfigError

logging.getLogger("werkzeug").setLevel(logging.ERROR)
ROOT = Path(__file__).resolve().parent.parent
FAST = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 3.0}
ORIGIN = "aws:us-east-1"
#: accelerators configs/serving.yaml has speeds for (the env needs one per offering; g6e = L40S)
AWS_FAMILIES = ["g4dn", "g5", "g6", "g6e", "p4d", "p5"]


@pytest.fixture(scope="module")
def clouds():
    with local_clouds() as c:
        yield c


@pytest.fixture
def env(clouds, monkeypatch):
    clouds.reset()
    for k, v in clouds.env.items():
        monkeypatch.setenv(k, v)
    return clouds


def config(out: Path, **kw) -> CollectConfig:
    opts = {"aws": {**FAST, "instance_families": AWS_FAMILIES, "spot_placement_scores": True},
            "azure": dict(FAST), "gcp": dict(FAST)}
    for name, extra in kw.pop("provider_options", {}).items():
        opts[name] = {**opts.get(name, {}), **extra}
    return CollectConfig(**{"providers": ["aws", "azure", "gcp"],
                            "regions": {"aws": ["us-east-1"], "azure": ["eastus"], "gcp": ["us-central1"]},
                            "out": out, "origin": ORIGIN, "deadline_s": 60, "rtt_probes": 2, "rtt_timeout_s": 0.5,
                            "provider_options": opts, **kw})


def write_workload(root: Path, origin: str = ORIGIN, n: int = 120) -> None:
    t0 = pd.Timestamp("2024-05-01T12:00:00Z")
    pd.DataFrame({"ts": [(t0 + pd.Timedelta(seconds=3 * i)).strftime("%Y-%m-%dT%H:%M:%SZ") for i in range(n)],
                  "request_id": [f"r{i:05d}" for i in range(n)], "origin": origin,
                  "input_tokens": [200 + i % 60 for i in range(n)], "output_tokens": [60 + i % 40 for i in range(n)],
                  "ttft_ms": 2000.0, "tpot_ms": 100.0}).to_csv(root / "workload.csv", index=False)


def status(report, source: str) -> dict:
    return next(s for s in report.sources if s["source"] == source)


@pytest.mark.slow
def test_collected_bundle_loads_once_a_workload_is_added(env, tmp_path):
    out = tmp_path / "bundle"
    report = collect_once(config(out))
    assert report.ok, report.stale
    with pytest.raises(BundleError, match="missing table 'workload'"):
        load_bundle(out)
    write_workload(out)
    b = load_bundle(out)
    assert set(b.offerings["provider"]) == {"aws", "azure", "gcp"}
    assert set(b.offerings["pricing_mode"]) == {"on_demand", "spot"}
    assert b.locations() == ["aws:us-east-1", "azure:eastus", "gcp:us-central1"]
    assert set(zip(b.rtt["src"], b.rtt["dst"], strict=True)) == {(ORIGIN, loc) for loc in b.locations()}
    assert (b.rtt["rtt_ms"] > 0).all()
    assert b.quotas is not None and set(b.quotas["provider"]) == {"aws", "azure", "gcp"}
    assert b.availability is not None and set(b.availability["offering_id"].str.split(":").str[0]) == {"aws"}
    g5 = b.prices[b.prices["offering_id"] == "aws:us-east-1:g5.xlarge:on_demand"]
    assert g5["usd_per_hour"].tolist() == [1.006]
    assert len(b.prices[b.prices["offering_id"] == "aws:us-east-1:g5.xlarge:spot"]) > 3  # spot history
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["runs"][-1]["calls"]["aws"] > 0 and manifest["runs"][-1]["cores"] == os.cpu_count()
    assert manifest["sources"]["azure:eastus/spot_availability"]["status"] == "unsupported"
    assert manifest["sources"]["gcp:us-central1/offerings"]["last_ok"] == report.record["started"]
    assert not list(out.glob(".*.pending")) and not (out / JOURNAL).exists()


@pytest.mark.slow
def test_xroute_evaluate_runs_on_a_collected_bundle(env, tmp_path):
    out = tmp_path / "bundle"
    collect_once(config(out))
    write_workload(out)
    report = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, "-m", "xroute_app", "evaluate", "--telemetry", str(out), "--policy", "cheapest",
                        "--output", str(report), "--quiet"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert report.is_file()


@pytest.mark.slow
def test_a_second_run_keeps_order_and_adds_only_what_changed(env, tmp_path):
    out = tmp_path / "bundle"
    collect_once(config(out))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".csv"}
    report = collect_once(config(out))
    assert report.ok
    assert report.record["rows_added"]["offerings"] == 0 and report.record["rows_added"]["prices"] == 0
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".csv"}
    assert after["offerings.csv"] == before["offerings.csv"]
    assert after["prices.csv"] == before["prices.csv"]
    assert len(json.loads((out / MANIFEST).read_text())["runs"]) == 2


@pytest.mark.slow
def test_one_provider_failing_does_not_stop_the_others_and_its_rows_stay(env, tmp_path):
    out = tmp_path / "bundle"
    first = collect_once(config(out))
    n_azure = sum(1 for o in read_tables(out)["offerings"]["provider"] if o == "azure")
    assert n_azure > 0
    env.azure.inject("resource_skus", *[Fault.error(503)] * 10)
    env.gcp.inject("skus.list", *[Fault.malformed()] * 10)
    report = collect_once(config(out, provider_options={"azure": {"max_attempts": 2}}))
    off = status(report, "azure:eastus/offerings")
    assert off["status"] == "stale" and off["reason"] == "CloudUnavailableError: ServiceUnavailable"
    assert status(report, "azure:eastus/on_demand_prices")["status"] == "skipped"
    assert status(report, "gcp:us-central1/on_demand_prices")["status"] == "stale"
    assert "not JSON" in status(report, "gcp:us-central1/on_demand_prices")["reason"]
    assert status(report, "gcp:us-central1/offerings")["status"] == "ok"
    assert status(report, "aws:us-east-1/spot_prices")["status"] == "ok"
    assert not report.ok and report.any_ok
    tables = read_tables(out)
    assert sum(1 for o in tables["offerings"]["provider"] if o == "azure") == n_azure
    manifest = json.loads((out / MANIFEST).read_text())
    entry = manifest["sources"]["azure:eastus/offerings"]
    assert entry["status"] == "stale" and entry["last_ok"] == first.record["started"]
    assert "azure:eastus/offerings" in manifest["runs"][-1]["stale"]
    write_workload(out)
    load_bundle(out)


@pytest.mark.slow
def test_throttling_is_retried_within_the_run(env, tmp_path):
    env.gcp.inject("regions.get", Fault.throttle(retry_after=1))
    t0 = time.monotonic()
    report = collect_once(config(tmp_path / "b"))
    assert report.ok and report.record["retries"]["gcp"] == 1
    assert time.monotonic() - t0 >= 1.0


@pytest.mark.slow
def test_the_deadline_bounds_a_run(env, tmp_path):
    env.gcp.inject("skus.list", Fault.stall(8.0))
    t0 = time.monotonic()
    report = collect_once(config(tmp_path / "b", deadline_s=4.0, provider_options={"gcp": {"timeout_s": 20.0}}))
    assert time.monotonic() - t0 < 6.0
    stale = {s["source"]: s["reason"] for s in report.stale}
    assert any(k.startswith("gcp:us-central1") and "deadline" in v for k, v in stale.items()), stale
    assert status(report, "azure:eastus/offerings")["status"] == "ok"


def test_a_provider_whose_adapter_cannot_start_is_stale(env, tmp_path):
    report = collect_once(config(tmp_path / "b", providers=["azure", "gcp"],
                                 regions={"azure": ["eastus"], "gcp": ["us-central1"]},
                                 provider_options={"azure": {"no_such_setting": 1}}))
    assert status(report, "azure:eastus/offerings")["status"] == "stale"
    assert "no_such_setting" in status(report, "azure:eastus/offerings")["reason"]
    assert status(report, "gcp:us-central1/offerings")["status"] == "ok"


def test_pools_utilization_lands_in_the_bundle(env, tmp_path):
    pools = [{"offering_id": "azure:eastus:Standard_NC4as_T4_v3:on_demand", "source": "prometheus",
              "url": env.prometheus.url, "selector": 'pool="t4"'},
             {"offering_id": "azure:eastus:Nope:on_demand", "source": "prometheus", "url": env.prometheus.url}]
    report = collect_once(config(tmp_path / "b", providers=["azure"], regions={"azure": ["eastus"]}, pools=pools))
    u = read_tables(tmp_path / "b")["utilization"]
    assert set(u["offering_id"]) == {"azure:eastus:Standard_NC4as_T4_v3:on_demand"} and len(u) == 10
    assert any("Nope" in h for h in report.record["held_back"])


def test_offerings_without_rtt_are_held_back(env, tmp_path):
    out = tmp_path / "b"
    report = collect_once(config(out, providers=["azure"], regions={"azure": ["eastus"]},
                                 rtt_targets={"azure:eastus": "127.0.0.1:9"}))
    assert status(report, "azure:eastus/rtt")["status"] == "stale"
    assert report.record["held_back"] and "no RTT" in report.record["held_back"][0]
    assert "offerings" not in read_tables(out)


def test_a_bad_existing_table_is_refused_and_left_alone(env, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    (out / "rtt.csv").write_text("src,dst,rtt_ms\na,b,-1\n")
    with pytest.raises(BundleError, match=r"rtt.csv, row 1, column 'rtt_ms'"):
        collect_once(config(out))
    assert (out / "rtt.csv").read_text() == "src,dst,rtt_ms\na,b,-1\n"


def test_a_second_collector_on_the_same_directory_is_refused(env, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    with dir_lock(out), pytest.raises(ConfigError, match="another collector is writing"):
        collect_once(config(out))


def _tables(n: int) -> dict:
    rtt = pd.DataFrame({"src": ["a"] * n, "dst": [f"d{i}" for i in range(n)], "rtt_ms": [1.0] * n})
    return {"rtt": (rtt, ".csv")}


def test_a_crash_mid_commit_is_completed_by_recovery(tmp_path):
    commit(tmp_path, _tables(1), {MANIFEST: b'{"v": 1}'})
    commit(tmp_path, _tables(3), {MANIFEST: b'{"v": 2}'}, _crash_after=1)  # dies after the first rename
    assert (tmp_path / JOURNAL).exists()
    assert len(pd.read_csv(tmp_path / "rtt.csv")) == 3  # each file is whole, old or new
    assert json.loads((tmp_path / MANIFEST).read_text()) == {"v": 1}
    assert recover(tmp_path) == [MANIFEST]
    assert json.loads((tmp_path / MANIFEST).read_text()) == {"v": 2}
    assert not (tmp_path / JOURNAL).exists() and not list(tmp_path.glob(".*.pending"))


def test_a_crash_before_the_journal_leaves_the_old_bundle(tmp_path):
    commit(tmp_path, _tables(1), {})
    (tmp_path / ".rtt.csv.pending").write_text("src,dst\nhalf")
    assert recover(tmp_path) == []
    assert len(pd.read_csv(tmp_path / "rtt.csv")) == 1 and not list(tmp_path.glob(".*.pending"))


def test_the_next_run_recovers_an_interrupted_commit(env, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    commit(out, _tables(2), {}, _crash_after=0)
    report = collect_once(config(out, providers=["azure"], regions={"azure": ["eastus"]}))
    assert report.record["recovered"] == ["rtt.csv"]
    assert set(read_tables(out)["rtt"]["dst"]) >= {"d0", "d1", "azure:eastus"}


def test_ctrl_c_waits_for_the_commit_to_finish():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with _sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.append(True)
    assert done == [True]


def test_cli_collect_prints_a_summary_and_writes_the_bundle(env, tmp_path):
    cfg = tmp_path / "collect.yaml"
    cfg.write_text("provider_options:\n  azure: {backoff_initial_s: 0.01}\nrtt_probes: 2\n")
    r = CliRunner().invoke(telemetry_app, ["collect", "--providers", "azure,gcp", "--regions", "eastus,us-central1",
                                           "--out", str(tmp_path / "b"), "--origin", ORIGIN, "--config", str(cfg),
                                           "--quiet"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "b" / "offerings.csv").is_file()
    r = CliRunner().invoke(telemetry_app, ["collect", "--providers", "azure", "--regions", "eastus",
                                           "--out", str(tmp_path / "b"), "--every", "0.2s", "--max-runs", "2"])
    assert r.exit_code == 0, r.output
    assert "collected in" in r.output
    assert len(json.loads((tmp_path / "b" / MANIFEST).read_text())["runs"]) == 3


def test_cli_errors_are_one_line_and_exit_2(env, tmp_path):
    r = CliRunner().invoke(telemetry_app, ["collect", "--regions", "Mars", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "error: --regions: 'Mars' matches no provider" in r.output
    r = CliRunner().invoke(telemetry_app, ["collect", "--regions", "eastus", "--providers", "azure", "--out",
                                           str(tmp_path), "--every", "soon"])
    assert r.exit_code == 2 and "not a duration" in r.output


def test_cli_exits_1_when_no_source_answers(env, tmp_path, monkeypatch):
    monkeypatch.setenv("XROUTE_AZURE_ENDPOINT", "http://127.0.0.1:9")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("provider_options:\n  azure: {max_attempts: 1}\nrtt_probes: 1\nrtt_timeout_s: 0.2\n")
    r = CliRunner().invoke(telemetry_app, ["collect", "--providers", "azure", "--regions", "eastus", "--out",
                                           str(tmp_path / "b"), "--config", str(cfg)])
    assert r.exit_code == 1 and "no source answered" in r.output


def test_cli_capabilities_lists_reasons():
    r = CliRunner().invoke(telemetry_app, ["capabilities", "--providers", "gcp"])
    assert r.exit_code == 0 and "spot_availability" in r.output and "no" in r.output


def test_merge_upserts_offerings_in_place_and_keeps_user_columns(tiny_bundle_dir):
    from datetime import UTC, datetime

    from cloud_adapters.base import InstanceOffer, PricePoint
    from cloud_adapters.collect.merge import merge
    from cloud_adapters.collect.region import RegionResult

    existing = read_tables(tiny_bundle_dir)
    ids = list(existing["offerings"]["offering_id"])
    now = datetime(2030, 1, 1, tzinfo=UTC)
    rr = RegionResult("aws", "us-east-1")
    rr.offers = [InstanceOffer("aws", "us-east-1", "g5.xlarge", "A10G", 1, 8.0, 16.0),
                 InstanceOffer("aws", "us-east-1", "g6.xlarge", "L4", 1, 4.0, 16.0)]
    old_ts = datetime(2020, 1, 1, tzinfo=UTC)
    rr.prices = [PricePoint(old_ts, "aws", "us-east-1", "g5.xlarge", "on_demand", 1.006),  # unchanged
                 PricePoint(old_ts, "aws", "us-east-1", "g5.xlarge", "spot", 0.41),  # changed, stamped now
                 PricePoint(old_ts, "aws", "us-east-1", "g6.xlarge", "on_demand", 0.80)]  # new offering
    m = merge(existing, [rr], [], [], now)
    off = m.tables["offerings"]
    assert list(off["offering_id"])[: len(ids)] == ids and list(off["offering_id"])[len(ids):] == [
        "aws:us-east-1:g6.xlarge:on_demand"]
    g5 = off.set_index("offering_id").loc["aws:us-east-1:g5.xlarge:on_demand"]
    assert g5["vcpus"] == 8.0 and g5["capacity_replicas"] == 2  # hardware updated, user column kept
    p = m.tables["prices"]
    spot = p[p["offering_id"] == "aws:us-east-1:g5.xlarge:spot"]
    assert spot["usd_per_hour"].tolist() == [0.35, 0.41] and spot["ts"].iloc[-1] == now
    assert len(p[p["offering_id"] == "aws:us-east-1:g5.xlarge:on_demand"]) == 1  # repeat dropped
    assert p[p["offering_id"] == "aws:us-east-1:g6.xlarge:on_demand"]["ts"].iloc[0] == old_ts
    assert m.added["offerings"] == 1 and m.held_back == []


@pytest.mark.slow
def test_a_repeating_collector_survives_a_failed_run(env, tmp_path):
    import threading

    from cloud_adapters.collect.schedule import collect_every

    out = tmp_path / "b"
    out.mkdir()
    errors, reports = [], []
    cfg = config(out, providers=["azure"], regions={"azure": ["eastus"]})
    with dir_lock(out):
        with pytest.raises(ConfigError):  # a single run raises
            collect_every(cfg, 0.1, max_runs=1, on_error=errors.append)
        t = threading.Thread(target=collect_every, args=(cfg, 0.2),
                             kwargs={"max_runs": 4, "on_error": errors.append, "on_report": reports.append})
        t.start()
        time.sleep(0.1)  # the first repeated run finds the directory locked
    t.join(timeout=60)
    assert errors and "another collector is writing" in str(errors[0])
    assert len(errors) + len(reports) == 4 and reports and reports[-1].any_ok
