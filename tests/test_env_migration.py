"""Spot notices and migration: the shared rules (``xroute.migration_rules``), the environment that
applies them (``envs.cloud_route``), the router that applies them too (``router.service.migration``), and the
bundle's ``offerings.notice_s`` column and ``throughput`` table."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pytest

from envs.cloud_route import CloudRouteEnv
from tests.tinybundle import write_tiny_bundle
from xroute import migration_rules as rules
from xroute.bundle import load_bundle
from xroute.errors import BundleError

SPOT = "aws:us-east-1:g5.xlarge:spot"
DOWN_S, UP_S = 200.0, 260.0  # the AWS spot pool's one preemption, seconds after the stream's start


# ------------------------------------------------------------------------------------ the rules
def test_the_window_fits_up_to_the_deadline_and_not_after() -> None:
    assert rules.fits_window(100.0, 130.0, 1.0, 29.0)
    assert not rules.fits_window(100.0, 130.0, 1.0, 29.5)
    assert not rules.fits_window(100.0, 130.0, 31.0)
    assert rules.past_window(131.0, 130.0) and not rules.past_window(131.0, 130.0, grace_s=2.0)


def test_transfer_wins_on_a_fast_link_and_recompute_on_a_slow_one() -> None:
    kv = 2000 * 0.5 * 2**20  # 2,000 tokens of llama-2-7b (0.5 MiB each): ~1 GB
    fast = rules.choose_kv_move(0.0, 120.0, 1.0, kv, gbps=400.0, rtt_ms=2.0, tokens=2000, prefill_tok_s=6170)
    assert fast.mode == rules.TRANSFER
    assert fast.seconds == pytest.approx(0.002 + 8 * kv / 400e9)
    assert fast.kv_bytes == kv and not fast.missed
    slow = rules.choose_kv_move(0.0, 120.0, 1.0, kv, gbps=1.0, rtt_ms=90.0, tokens=2000, prefill_tok_s=6170)
    assert slow.mode == rules.RECOMPUTE and slow.kv_bytes == 0.0
    assert slow.seconds == pytest.approx(2000 / 6170)


def test_a_transfer_that_overruns_the_window_recomputes_and_a_delay_that_does_is_lost() -> None:
    kv = 100_000 * 0.5 * 2**20  # a long context: ~52 GB
    # faster than the recompute (~16 s) but 42 s: past a 30 s notice -> recompute
    move = rules.choose_kv_move(0.0, 30.0, 1.0, kv, gbps=10.0, rtt_ms=50.0, tokens=100_000, prefill_tok_s=6170)
    assert rules.transfer_s(kv, 10.0, 50.0) < 60 and move.mode == rules.RECOMPUTE
    lost = rules.choose_kv_move(0.0, 30.0, 31.0, kv, gbps=10.0, rtt_ms=50.0, tokens=100_000, prefill_tok_s=6170)
    assert lost.mode == rules.LOST and lost.missed and lost.kv_bytes == 0.0


def test_the_region_penalty_holds_for_its_duration_then_expires() -> None:
    locs = ["aws:us-east-1", "aws:us-east-1", "gcp:europe-west4"]
    until = rules.deprioritize_until(100.0, 600.0)
    assert until == 700.0
    b = rules.region_bias(locs, [("aws:us-east-1", until), ("aws:us-east-1", until)], 650.0, 1.0)
    assert b.tolist() == [-1.0, -1.0, 0.0]  # (two notices in one region: one penalty)
    assert not rules.region_bias(locs, [("aws:us-east-1", until)], 700.0, 1.0).any()
    assert not rules.region_bias(locs, [("aws:us-east-1", until)], 650.0, 0.0).any()


def test_the_router_and_the_environment_default_to_the_same_settings() -> None:
    from router.core.settings import RouterSettings
    from xroute.config import EnvConfig

    s, m = RouterSettings(), EnvConfig().migration
    assert s.migration_deprioritize_s == m.deprioritize_s == rules.DEPRIORITIZE_S == 600.0
    assert s.migration_region_penalty == m.region_penalty == rules.REGION_PENALTY == 1.0


# ------------------------------------------------------------------------------------ the bundle
def _bundle(root: Path, notice: dict[str, float] | None = None, throughput: float | None = None,
            n_requests: int = 1400) -> Path:
    """The tiny bundle with one preemption of the AWS spot pool (down at ``DOWN_S``, back at
    ``UP_S``), spot notices per offering (``notice``: offering id -> seconds; absent: AWS 120 s,
    the others 30 s) and, with ``throughput``, that many Gbit/s between every two locations."""
    write_tiny_bundle(root, n_requests=n_requests, preempt=False)
    off = pd.read_csv(root / "offerings.csv")
    notice = notice or {}
    off["notice_s"] = [notice.get(o, 120.0 if o.startswith("aws") else 30.0) if o.endswith(":spot") else np.nan
                       for o in off["offering_id"]]
    off.to_csv(root / "offerings.csv", index=False)
    t0 = pd.Timestamp("2024-01-01T00:00:00Z")
    av = [{"ts": (t0 - pd.Timedelta("1h")).isoformat(), "offering_id": SPOT, "available": 1},
          {"ts": (t0 + pd.Timedelta(seconds=DOWN_S)).isoformat(), "offering_id": SPOT, "available": 0},
          {"ts": (t0 + pd.Timedelta(seconds=UP_S)).isoformat(), "offering_id": SPOT, "available": 1}]
    pd.DataFrame(av).to_csv(root / "availability.csv", index=False)
    if throughput is not None:
        locs = sorted(set(off["provider"] + ":" + off["region"]))
        pd.DataFrame([{"src": a, "dst": b, "gbps": throughput} for a in locs for b in locs if a != b]).to_csv(
            root / "throughput.csv", index=False)
    return root


def test_notice_and_throughput_load_and_bad_values_name_their_field(tmp_path: Path) -> None:
    b = load_bundle(_bundle(tmp_path / "ok", throughput=25.0))
    assert b.throughput is not None and len(b.throughput) == 6
    col = b.offerings.set_index("offering_id")["notice_s"]
    assert col[SPOT] == 120.0 and np.isnan(col["aws:us-east-1:g5.xlarge:on_demand"])

    bad = _bundle(tmp_path / "neg", throughput=25.0)
    off = pd.read_csv(bad / "offerings.csv")
    off.loc[1, "notice_s"] = -5
    off.to_csv(bad / "offerings.csv", index=False)
    with pytest.raises(BundleError) as ei:
        load_bundle(bad)
    assert ei.value.file == "offerings.csv" and ei.value.column == "notice_s" and ei.value.row == 2

    bad = _bundle(tmp_path / "loc", throughput=25.0)
    tp = pd.read_csv(bad / "throughput.csv")
    tp.loc[2, "dst"] = "aws:mars-1"
    tp.to_csv(bad / "throughput.csv", index=False)
    with pytest.raises(BundleError) as ei:
        load_bundle(bad)
    assert ei.value.file == "throughput.csv" and ei.value.column == "dst" and "aws:mars-1" in str(ei.value)

    bad = _bundle(tmp_path / "zero", throughput=0.0)
    with pytest.raises(BundleError) as ei:
        load_bundle(bad)
    assert ei.value.file == "throughput.csv" and ei.value.column == "gbps"


def test_the_shipped_bundles_carry_notices_and_throughput(shipped_bundle: Any) -> None:
    b = shipped_bundle
    off = b.offerings
    spot = off["pricing_mode"] == "spot"
    assert off.loc[spot, "notice_s"].notna().all() and off.loc[~spot, "notice_s"].isna().all()
    assert set(off.loc[spot & (off["provider"] == "aws"), "notice_s"]) == {120.0}
    assert set(off.loc[spot & (off["provider"] != "aws"), "notice_s"]) == {30.0}
    assert b.throughput is not None and len(b.throughput) > 0 and (b.throughput["gbps"] > 0.1).all()


# ------------------------------------------------------------------------------------ the environment
def _play(env: CloudRouteEnv, until_s: float) -> list[dict[str, Any]]:
    """Send every request to the AWS spot pool while it is valid, else the first valid offering,
    until ``until_s`` after the stream's start; the step infos."""
    spot = env.offering_index(SPOT)
    obs, info = env.reset(seed=0)
    infos, done = [], False
    while not done and env.t < env.t0 + until_s:
        mask = info["action_mask"]
        a = spot if mask[spot] else int(np.flatnonzero(mask)[0]) if mask.any() else 0
        t = env.t
        obs, _, _, done, info = env.step(a)
        infos.append({**info, "t_sent": t, "sent_to": a})
    return infos


def _env(root: Path, **migration: Any) -> CloudRouteEnv:
    # (a third of the tiny stream's load: the pools keep room, so masks come from notices)
    return CloudRouteEnv(str(root), episode_requests=None, spot_lag_s=0.0, rate_scale=0.3, migration=migration)


def test_a_notice_masks_the_pool_and_de_prioritizes_its_region_for_the_configured_time(tmp_path: Path) -> None:
    env = _env(_bundle(tmp_path / "b"), deprioritize_s=100.0)
    spot = env.offering_index(SPOT)
    same_region = [k for k, o in enumerate(env.catalog) if o.location == "aws:us-east-1"]
    obs, info = env.reset(seed=0)
    notice_at = env.t0 + DOWN_S - 120.0
    seen = {"before": False, "noticed": False, "after": False}
    done = False
    while not done and env.t < env.t0 + UP_S + 30:
        t = env.t
        if t < notice_at - 1:
            assert info["action_mask"][spot] and not env.r_bias.any()
            seen["before"] = True
        elif notice_at + 1 < t < notice_at + 99:  # masked from the notice on, its region penalized
            assert not info["action_mask"][spot]
            assert (env.r_bias[same_region] == -1.0).all() and env.r_bias.sum() == -len(same_region)
            assert np.array_equal(info["policy_bias"], env.r_bias)
            seen["noticed"] = True
        elif notice_at + 101 < t < env.t0 + DOWN_S:  # the penalty expired; the pool still masked
            assert not env.r_bias.any() and not info["action_mask"][spot]
            seen["after"] = True
        # (the least-waiting other pool: the spot pool keeps room, so only the notice masks it)
        wait = np.where(info["action_mask"][: env.n], env.c_wait, np.inf)
        wait[spot] = np.inf
        obs, _, _, done, info = env.step(int(np.argmin(wait)))
    assert all(seen.values()), seen


def test_requests_in_flight_at_the_notice_migrate_by_the_rules(tmp_path: Path) -> None:
    env = _env(_bundle(tmp_path / "b"))
    infos = _play(env, DOWN_S + 10)
    notice_at = env.t0 + DOWN_S - 120.0
    moved = [i for i in infos if i["preempted"]]
    assert moved, "requests in flight on the spot pool at its notice must migrate"
    assert env.stats["migrations"] == len(moved) and env.stats["missed_window"] == 0
    modes = {i["migration"] for i in moved}
    assert modes <= {"recompute", "resend"} and "recompute" in modes  # 1 Gbit/s (no table): recompute wins
    for i in moved:
        target = env.catalog[i["migrated_to"]]
        assert not target.is_spot and target.location != "aws:us-east-1"  # its region is de-prioritized
        # it ends after the notice plus the migration delay, on the target
        assert i["latency_ms"] >= 1000.0 * (notice_at + env.cfg.migration.delay_s - i["t_sent"])
        assert i["kv_bytes_moved"] == 0.0 and not i["missed_window"]
        assert (i["tokens_recomputed"] > 0) == (i["migration"] == "recompute")
    # work on the spot pool stops at the notice: nothing sent there runs past it
    assert all(not i["preempted"] for i in infos if i["sent_to"] == env.offering_index(SPOT)
               and i["t_sent"] + i["latency_ms"] / 1000.0 < notice_at)
    assert env.stats["tokens_recomputed"] == pytest.approx(sum(i["tokens_recomputed"] for i in moved))


def test_a_fast_link_transfers_the_kv_cache_instead(tmp_path: Path) -> None:
    env = _env(_bundle(tmp_path / "b", throughput=1000.0))
    moved = [i for i in _play(env, DOWN_S + 10) if i["preempted"]]
    transferred = [i for i in moved if i["migration"] == "transfer"]
    assert transferred and all(i["tokens_recomputed"] == 0.0 for i in transferred)
    per_tok = env.kv_bytes_tok[env.default_model]
    for i in transferred:  # whole tokens of KV: the prompt and the tokens generated before the notice
        tokens = i["kv_bytes_moved"] / per_tok
        assert tokens == pytest.approx(round(tokens)) and tokens >= 1
    assert env.stats["kv_bytes_moved"] == pytest.approx(sum(i["kv_bytes_moved"] for i in transferred))


def test_a_migration_delay_past_the_notice_misses_the_window_and_restarts_from_scratch(tmp_path: Path) -> None:
    root = _bundle(tmp_path / "b", notice={SPOT: 2.0})
    env = _env(root, delay_s=5.0)
    moved = [i for i in _play(env, DOWN_S + 10) if i["preempted"]]
    lost = [i for i in moved if i["migration"] == "lost"]
    assert lost and env.stats["missed_window"] == len(lost)
    assert all(i["missed_window"] and i["tokens_recomputed"] > 0 and i["kv_bytes_moved"] == 0.0 for i in lost)
    # the same stream with a short enough delay keeps its work
    ok = [i for i in _play(_env(root, delay_s=1.0), DOWN_S + 10) if i["preempted"]]
    assert ok and not any(i["missed_window"] for i in ok)


def test_without_notices_the_pool_dies_unannounced_and_requests_restart(tmp_path: Path) -> None:
    env = _env(_bundle(tmp_path / "b"), notice=False)
    infos = _play(env, DOWN_S + 10)
    moved = [i for i in infos if i["preempted"]]
    assert moved and {i["migration"] for i in moved} == {"restart"}
    assert all(i["latency_ms"] >= env.cfg.retry_overhead_ms for i in moved)
    assert env.stats["migrations"] == 0 and not env.region_bias.any()


def test_the_oracle_sees_the_migration_outcome(tmp_path: Path) -> None:
    """``exact_rewards`` (the hindsight oracle) plays a request that a notice will interrupt
    through the same ``_resolve`` as the step."""
    env = _env(_bundle(tmp_path / "b"))
    spot = env.offering_index(SPOT)
    obs, info = env.reset(seed=0)
    done = False
    while not done and env.t < env.t0 + DOWN_S - 125.0:
        obs, _, _, done, info = env.step(spot if info["action_mask"][spot] else int(np.flatnonzero(info["action_mask"])[0]))
    checked = 0
    while not done and env.t < env.t0 + DOWN_S - 120.0:
        if info["action_mask"][spot]:
            exact = env.exact_rewards()[spot]
            obs, r, _, done, info = env.step(spot)
            assert r == pytest.approx(exact)
            checked += info["preempted"]
        else:
            obs, _, _, done, info = env.step(int(np.flatnonzero(info["action_mask"])[0]))
    assert checked


def test_the_router_applies_the_same_region_bias_as_the_environment(tmp_path: Path) -> None:
    """The router's ``Migrator.apply_masks`` (an interruption's row in its store) and the
    environment (a notice in its telemetry) de-prioritize the same offerings by the same amount."""
    from router.core.settings import RouterSettings
    from router.service.migration import Migrator

    env = _env(_bundle(tmp_path / "b"))
    env.reset(seed=0)
    notice_at = env.t0 + DOWN_S - 120.0
    now = notice_at + 10.0
    env._refresh(now)
    engine = SimpleNamespace(n=env.n, offering_ids=[o.offering_id for o in env.catalog],
                             refs=[{"location": o.location} for o in env.catalog], events_keep=None, events_bias=None)
    mig = Migrator.__new__(Migrator)
    mig.engine, mig.settings = engine, RouterSettings()
    region = env.catalog[env.offering_index(SPOT)].location
    until = rules.deprioritize_until(notice_at, mig.settings.migration_deprioritize_s)
    mig.apply_masks([("e1", "interruption", SPOT, region, notice_at + 120.0, notice_at + 1020.0, until, notice_at)],
                    now)
    assert engine.events_bias is not None and env.region_bias.any()
    assert np.array_equal(engine.events_bias, env.region_bias)
    assert engine.events_keep is not None and not engine.events_keep[env.offering_index(SPOT)]
    assert not env.available[env.offering_index(SPOT)]
