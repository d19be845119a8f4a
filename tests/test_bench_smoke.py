"""The benchmarks still run: each router benchmark's measuring code, at a size of seconds.

Nothing here times anything (speed is the benchmarks' business, ``benchmarks/``); it checks that
the code a benchmark measures is the product's current code path and still answers. Two of them
broke unnoticed when undeclared tenants started failing closed (issue 22): their engines routed
for a tenant the router had not been told about.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import benchmarks.bench_migration as bench_migration
import benchmarks.bench_oracle as bench_oracle
import benchmarks.bench_policies as bench_policies
import benchmarks.bench_prefix as bench_prefix
import benchmarks.bench_quotas as bench_quotas
import benchmarks.bench_rbac as bench_rbac
import benchmarks.bench_router as br
import benchmarks.bench_startup as bench_startup
from router.control.keys import add_key


def _pct_ok(d: dict[str, float]) -> None:
    assert 0 < d["p50_us"] <= d["p99_us"], d


def test_bench_prefix_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_prefix, "HISTORY", 500)
    res = bench_prefix.in_process(200, tmp_path)
    for k in ("lookup", "lookup_and_conversion", "admit_recording", "decision_with_prefix", "decision_without"):
        assert res[k]["p50_us"] > 0, (k, res[k])
    # the prompts share blocks with the index's history: some lookups must find a pool
    assert 0 < res["lookups_with_a_match"] <= 1


def test_bench_oracle_mooncake_stream_keeps_its_prefixes_and_the_snapshot_ab_agrees(tmp_path: Path) -> None:
    """Issue 39's stream: the tiled Mooncake hour keeps its KV-prefix blocks past the first tile (the
    prefix caches stay on), and ``--ab``'s two ways of snapshotting take the same decisions."""
    import numpy as np
    import pandas as pd

    b = bench_oracle.tiled_bundle("mooncake", tmp_path / "tiled", 4100)
    w = pd.read_csv(tmp_path / "tiled" / "workload.csv.gz", dtype=str, keep_default_na=False)
    assert len(w) == 4100 and (w["prefix_hashes"].iloc[4000:] != "").all()
    assert b.meta.prefix_block_tokens == 512
    res = bench_oracle.snapshot_ab("mooncake", 300, repeats=1)
    assert res["prefix_caches"] and res["same_decisions"] and res["requests"] == 300, res
    assert np.isfinite(res["cpu_ratio_copied_over_shared"]) and res["median"]["shared"]["cpu_s"] > 0, res


def test_bench_quotas_decide() -> None:
    res = bench_quotas.bench_decide(300, 1)
    _pct_ok(res["off"])
    _pct_ok(res["on"])


def test_bench_policies_engine(tmp_path: Path) -> None:
    bundle = br.make_bundle(tmp_path / "bundle", 30, n_requests=400)
    res = bench_policies.bench_engine(bundle, 200, 1, tmp_path)
    assert set(res) >= {"policies_off", "policies_on"}, res


def test_bench_rbac_decide(tmp_path: Path) -> None:
    eng = bench_rbac._engine(br.make_bundle(tmp_path / "bundle", 30, n_requests=400), tmp_path)
    assert bench_rbac.bench_check(eng, 200)
    assert bench_rbac.bench_decide(eng, 100, 1)


@pytest.mark.slow
def test_bench_migration_run(tmp_path: Path) -> None:
    res = bench_migration.run(20, 2, tmp_path)
    assert res["sessions"] == 20 and res["missed_window"] == 0 and res["fits_30s"], res


@pytest.mark.slow
def test_bench_startup_start_once(tmp_path: Path) -> None:
    """One start of this checkout's ``xroute serve`` (fallback only, numba's own cache) through the
    benchmark's code: ready, a decision, the phases of the start read from its log."""
    (tmp_path / "router.yaml").write_text("tenants:\n  acme: {}\n")
    key = add_key(tmp_path / "keys.json", "acme")
    r = bench_startup.start_once(bench_startup.REPO, 1, tmp_path, "smoke", None, tmp_path / "keys.json", key, None,
                                 False, 0)
    assert 0 < r["ready_s"] <= r["route_s"] and r["cpu_s"] > 0 and r["policy_kind"] == "fallback", r
    assert {"imports", "kernels", "model"} <= set(r["phases"]) and r["started_in_s"] > 0, r
    summary = bench_startup.summarize([r, r])
    assert summary["ready_s"] == r["ready_s"] and summary["phases"] == r["phases"]


def test_bench_canary_measures_both_arms(tmp_path: Path) -> None:
    import benchmarks.bench_canary as bench_canary

    bundle = br.make_bundle(tmp_path / "b", 30, n_requests=400)
    off = bench_canary.measure(bundle, tmp_path, False, 200, False)
    on = bench_canary.measure(bundle, tmp_path, True, 400, False)
    _pct_ok(off)
    _pct_ok(on)
    assert off["canary_share_seen"] == 0 and 0.15 < on["canary_share_seen"] < 0.45, on  # (30 % by request)
