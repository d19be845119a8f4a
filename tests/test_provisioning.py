"""The provisioning world (``envs.provisioning``) against cases computed by hand: a launch delay, a
spot launch refused while the trace says the pool is out, a preemption with its notice (AWS's 120 s,
Azure's 30 s) and the migration of the work, a drain, a quota cap; bad plans and bad config; the
conservation of requests (none lost) and determinism on the shipped bundle."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import envs  # noqa: F401 (registers xroute/Provision-v0)
from envs import provision_kernels as pk
from envs.provisioning import ProvisionWorld
from tests.capbundle import OD, OD_AZ, SPOT, SPOT_AZ, T0, world, write_capbundle
from xroute.errors import ConfigError

T0S = T0.timestamp()


def _run(w: ProvisionWorld, plans: list[dict[str, int]], seed: int = 0) -> list:
    w.reset(seed=seed)
    out = []
    for k in range(w.E):
        out.append(w.step(plans[min(k, len(plans) - 1)]))
    return out


def _row(w: ProvisionWorld, offering: str) -> int:
    return w.pool_index[f"llama-2-7b@{offering}"] * w.R


def test_launch_delay_and_cost(tmp_path: Path) -> None:
    """Launched at T0 (no warm start), an instance serves from T0 + 100 s boot + 10 s engine + 13.48 /
    1.348 s of weights = T0 + 120 s; the request that arrived at T0 waits for it: start 120 s, first
    token after 1 s of prefill + 10 ms, end after 100 x 10 ms more. Billed from T0: 0.001 USD a second."""
    root = write_capbundle(tmp_path, [{"t": 0, "in": 1000, "out": 100}, {"t": 250}])
    w = world(root, warm_start=False)
    assert w.pools.launch_s[w.pool_index[f"llama-2-7b@{OD}"]] == pytest.approx(120.0)
    w.reset(seed=0)
    assert w.E == 5
    seen = []
    for _ in range(w.E):
        v = w.view()
        seen.append((int(v.launching.sum()), int(v.ready.sum())))
        w.step({OD: 1})
    assert seen[:3] == [(0, 0), (1, 0), (0, 1)]  # ready at T0 + 120 s exactly: the start of epoch 2
    qf = w.QF
    assert qf[pk.QF_START, 0] == pytest.approx(T0S + 120.0)
    assert qf[pk.QF_FIRST, 0] == pytest.approx(T0S + 121.01)
    assert qf[pk.QF_END, 0] == pytest.approx(T0S + 122.0)
    m = w.metrics()
    assert m["cost_usd"] == pytest.approx(5 * 60 * 0.001)
    assert m["launches"] == 1 and m["served"] == 2 and m["lost"] == 0 and m["unserved"] == 0
    o = w.request_outcomes()
    assert o["ttft_ms"][0] == pytest.approx(2.0 + 121.01 * 1000.0)  # the RTT (2 ms) + the wait


def test_spot_launch_refused_while_the_trace_says_out(tmp_path: Path) -> None:
    """The spot pool is recorded out from before T0 until T0 + 150 s: launches at T0, +60, +120 fail
    (nothing held, nothing billed); the one at +180 succeeds and serves from +300."""
    root = write_capbundle(tmp_path, [{"t": 0}, {"t": 400}], availability={SPOT: [(-1800, 0), (150, 1)]})
    w = world(root, warm_start=False)
    res = _run(w, [{SPOT: 1}])
    assert [r.failed_launches for r in res[:4]] == [1, 1, 1, 0]
    assert [r.launches for r in res[:4]] == [0, 0, 0, 1]
    assert [r.cost_usd for r in res[:3]] == [0.0, 0.0, 0.0]
    assert res[3].cost_usd == pytest.approx(60 * 0.0001)
    assert w.QF[pk.QF_START, 0] == pytest.approx(T0S + 300.0)
    assert w.metrics()["failed_launches"] == 3


def test_preemption_with_notice_migrates_the_work(tmp_path: Path) -> None:
    """A spot pool recorded out at T0 + 300 s with AWS's 120 s notice: at T0 + 180 its instance stops
    taking work and the request running there (started at T0: 1 s of prefill, then 10 ms a token, so
    17,900 tokens decoded) moves after the 1 s migration delay to the on-demand instance ready since
    T0 + 180. Recomputing its 18,900 tokens of KV takes 18.9 s at 1,000 tokens/s, transferring 9.9 GB
    at the default 1 Gbit/s 79 s: recompute. It ends 18.9 s + 12,100 x 10 ms after T0 + 181; its first
    token stays the source's. The spot instance is billed until the preemption, T0 + 300."""
    root = write_capbundle(tmp_path, [{"t": 0, "in": 1000, "out": 30000}, {"t": 500}],
                           availability={SPOT: [(300, 0), (400, 1)]})
    w = world(root)
    _run(w, [{SPOT: 1}] + [{SPOT: 1, OD: 1}] * 4 + [{OD: 1}])  # (no spot relaunch once it is gone)
    qf, st = w.QF, w.stats
    assert st["noticed"] == 1 and st["migrations"] == 1 and st["recompute"] == 1 and st["transfer"] == 0
    assert st["tokens_recomputed"] == pytest.approx(18900.0)
    assert qf[pk.QF_END, 0] == pytest.approx(T0S + 181.0 + 18.9 + 121.0)
    assert qf[pk.QF_FIRST, 0] == pytest.approx(T0S + 1.01)
    assert w.QI[pk.QI_POOL, 0] == w.pool_index[f"llama-2-7b@{OD}"]
    r = _row(w, SPOT)
    assert w.RF[pk.RF_END, r] == pytest.approx(T0S + 300.0)
    m = w.metrics()
    assert m["lost"] == 0 and m["served"] == 2 and m["preemptions"] == 1
    # spot: 300 s at 0.0001; on demand from T0 + 60 to the window's end (9 epochs) at 0.001
    assert m["cost_usd"] == pytest.approx(300 * 0.0001 + (9 * 60 - 60) * 0.001)


def test_azure_notice_is_30_seconds_and_no_new_work_after_it(tmp_path: Path) -> None:
    """Azure's 30 s: recorded out at T0 + 300, the notice comes at T0 + 270; a request arriving at
    T0 + 280 goes to the on-demand pool, not to the noticed instance (billed until T0 + 300)."""
    root = write_capbundle(tmp_path, [{"t": 0, "out": 10}, {"t": 280, "out": 10, "origin": "azure:eastus"},
                                      {"t": 400}], availability={SPOT_AZ: [(300, 0)]})
    w = world(root)
    _run(w, [{SPOT_AZ: 1, OD: 1}])
    assert w.stats["noticed"] == 1
    assert w.RF[pk.RF_END, _row(w, SPOT_AZ)] == pytest.approx(T0S + 300.0)
    assert w.QI[pk.QI_POOL, 1] == w.pool_index[f"llama-2-7b@{OD}"]  # (the near pool is noticed)


def test_no_notice_restarts_from_scratch(tmp_path: Path) -> None:
    """Without notices (``migration.notice`` off) the pool dies at the preemption and its running
    request restarts on another pool after the retry overhead, from scratch."""
    root = write_capbundle(tmp_path, [{"t": 0, "in": 1000, "out": 30000}, {"t": 500}],
                           availability={SPOT: [(300, 0)]})
    w = world(root, migration={"notice": False})
    _run(w, [{SPOT: 1, OD: 1}, {SPOT: 1, OD: 1}])
    # the router sent it to the on-demand pool (the spot pool carries a preemption risk): force the case
    w2 = world(root, migration={"notice": False})
    _run(w2, [{SPOT: 1}, {SPOT: 1, OD: 1}])
    assert w2.stats["restart"] == 1 and w2.stats["migrations"] == 1
    assert w2.QF[pk.QF_END, 0] == pytest.approx(T0S + 300.0 + 1.5 + 1.0 + 300.0)
    assert w2.metrics()["lost"] == 0


def test_drain_finishes_running_work_and_takes_no_new_work(tmp_path: Path) -> None:
    """The plan drops the near on-demand instance at T0 + 60 while a 101 s request runs there: it
    takes no new work (the request at T0 + 70 goes to the far pool), finishes at T0 + 101 and is
    billed until then."""
    root = write_capbundle(tmp_path, [{"t": 0, "in": 1000, "out": 10000}, {"t": 70, "out": 10}, {"t": 200}])
    w = world(root)
    _run(w, [{OD: 1, OD_AZ: 1}, {OD: 0, OD_AZ: 1}])
    assert w.QI[pk.QI_POOL, 0] == w.pool_index[f"llama-2-7b@{OD}"]
    assert w.QF[pk.QF_END, 0] == pytest.approx(T0S + 101.0)
    assert w.QI[pk.QI_POOL, 1] == w.pool_index[f"llama-2-7b@{OD_AZ}"]
    assert w.RF[pk.RF_END, _row(w, OD)] == pytest.approx(T0S + 101.0)
    m = w.metrics()
    assert m["cost_usd"] == pytest.approx(101 * 0.001 + 4 * 60 * 0.001)


def test_quota_caps_launches(tmp_path: Path) -> None:
    """An instance quota of 2 covering the near on-demand offering: a plan of 5 launches 2 and the
    quota refuses 3, every epoch it asks; the held instances count against the room."""
    q = [{"ts": -3600, "provider": "aws", "region": "us-east-1", "quota_name": "G instances", "unit": "instances",
          "limit": 2, "usage": 0, "covers": "aws:us-east-1:g5.*:on_demand"}]
    root = write_capbundle(tmp_path, [{"t": 0}, {"t": 200}], quotas=q)
    w = world(root)
    w.reset(seed=0)
    p = w.pool_index[f"llama-2-7b@{OD}"]
    r0 = w.step({OD: 5})
    assert (r0.launches, r0.quota_refused) == (2, 3)
    assert w.view().quota_room[p] == 0
    r1 = w.step({OD: 5})
    assert (r1.launches, r1.quota_refused) == (0, 3)
    assert int(w.view().held[p]) == 2


def test_full_pools_queue_requests_at_the_router_first_come_first_served(tmp_path: Path) -> None:
    """One instance, 2 slots, three 101 s requests at T0: the third would wait 101 / 2 s -- past the
    20 s queue timeout -- so it waits in the router's queue; so does a short one at T0 + 5 (first
    come, first served) though it would fit. The two slots free at T0 + 101: both start then."""
    root = write_capbundle(tmp_path, [{"t": 0, "out": 10000}, {"t": 0, "out": 10000}, {"t": 0, "out": 10000},
                                      {"t": 5, "out": 10}, {"t": 300}])
    w = world(root)
    w.reset(seed=0)
    w.step({OD: 1})
    assert w.view().queued.sum() == 2
    _ = [w.step({OD: 1}) for _ in range(w.E - 1)]
    qf = w.QF
    assert [qf[pk.QF_START, i] - T0S for i in range(4)] == pytest.approx([0.0, 0.0, 101.0, 101.0])
    assert w.metrics()["backlogged"] == 2


def test_the_view_dates_the_last_recorded_preemption(tmp_path: Path) -> None:
    """``since_preempt_s``: seconds since the trace last recorded the pool out, at each epoch's start
    (decision time: a record after the epoch's start is not seen); inf where none is recorded."""
    root = write_capbundle(tmp_path, [{"t": k * 30.0} for k in range(12)],
                           availability={SPOT: [(-200.0, 0), (-100.0, 1), (90.0, 0), (150.0, 1)]})
    w = world(root)
    w.reset(seed=0)
    p, q = w.pool_index[f"llama-2-7b@{SPOT}"], w.pool_index[f"llama-2-7b@{OD}"]
    seen = []
    for _ in range(w.E):
        v = w.view()
        seen.append(float(v.since_preempt_s[p]))
        assert v.since_preempt_s[q] == np.inf
        w.step({})
    # epochs start at 0, 60, 120, 180, ...: the record at -200 until the one at 90 s
    assert seen[:4] == [200.0, 260.0, 30.0, 90.0]


def test_a_window_starting_mid_stream_knows_the_stream_before_it(tmp_path: Path) -> None:
    """``reset(start_epoch=k)``: the planners' history is the stream before the window; the outputs
    of the requests of the last ``estimator.history_lag_s`` (60 s) are not known yet (NaN)."""
    root = write_capbundle(tmp_path, [{"t": k * 10.0, "out": 100 + k} for k in range(60)])
    w = world(root)
    ctx = w.reset(seed=0, start_epoch=3)  # the window starts at 180 s
    assert ctx.hist_t.size == 18 and ctx.hist_t.max() == T0S + 170.0
    known = np.isfinite(ctx.hist_out)
    assert ctx.hist_t[known].max() == T0S + 120.0 and ctx.hist_out[known].tolist() == [100.0 + k for k in range(13)]
    assert w.reset(seed=0).hist_t.size == 0  # (from the start: only the history given, here none)


def test_bad_plans_name_the_field(tmp_path: Path) -> None:
    root = write_capbundle(tmp_path, [{"t": 0}, {"t": 100}])
    w = world(root)
    w.reset(seed=0)
    with pytest.raises(ConfigError, match=rf"field '{OD}'.*-1 must be in 0\.\.32"):
        w.step({OD: -1})
    with pytest.raises(ConfigError, match="field 'aws:nowhere:x:spot': unknown pool"):
        w.step({"aws:nowhere:x:spot": 1})
    with pytest.raises(ConfigError, match="field 'targets': expected 5 targets"):
        w.step(np.zeros(3, dtype=int))
    with pytest.raises(ConfigError, match=f"field 'llama-2-7b@{OD}'.*not a whole number"):
        w.step(np.array([1.5, 0, 0, 0, 0]))
    with pytest.raises(ConfigError, match=f"field '{OD}'.*not a whole number"):
        w.step({OD: "two"})  # type: ignore[dict-item]
    r = w.step({OD: 1})  # nothing was half-applied by the refused plans
    assert r.launches == 1


def test_bad_config_names_the_field(tmp_path: Path) -> None:
    root = write_capbundle(tmp_path, [{"t": 0}, {"t": 100}])
    with pytest.raises(ConfigError, match="field 'epoch_s'"):
        world(root, epoch_s=-5)
    with pytest.raises(ConfigError, match="field 'epochs': unknown key"):
        world(root, epochs=5)
    with pytest.raises(ConfigError, match=r"field 'migration\.delay_s'"):
        world(root, migration={"delay_s": -1})
    (root / "serving-nolaunch.yaml").write_text((root / "serving.yaml").read_text().split("launch:")[0])
    with pytest.raises(ConfigError, match="field 'launch'"):
        world(root, serving_config=str(root / "serving-nolaunch.yaml"))
    w = world(root)
    with pytest.raises(ConfigError, match="field 'n_epochs'"):
        w.reset(seed=0, n_epochs=99)


def test_nothing_lost_and_deterministic_on_the_shipped_bundle(shipped_bundle) -> None:  # type: ignore[no-untyped-def]
    """An instance in every spot pool (and one on demand) over the shipped hour: its real spot traces
    preempt many of them; every request is served or still waiting at the end (lost = 0), the work
    of the preempted ones migrated; the same seed gives the same figures, another seed others."""
    w = ProvisionWorld(shipped_bundle)
    plan = np.where(w.pools.is_spot, 1, 0)
    plan[w.pool_index["llama-2-7b@aws:us-east-1:g5.xlarge:on_demand"]] = 1
    runs = []
    for seed in (3, 3, 4):
        w.reset(seed=seed)
        while not w.step(plan).done:
            pass
        runs.append(w.metrics())
    m = runs[0]
    assert m["lost"] == 0 and m["served"] + m["unserved"] == m["requests"] == 28185
    assert m["preemptions"] >= 10 and m["migrations"] >= 10 and m["failed_launches"] > 0
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_the_figures_are_pinned_on_a_fixed_seed(shipped_bundle) -> None:  # type: ignore[no-untyped-def]
    """The world's outcome on the shipped hour (an instance in every spot pool, seed 3: preemptions,
    migrations, multi-replica instances) is the one the world gave before its kernels were made
    faster: the pool, instance, first token and end of every request and the window's figures.
    A speed-up must leave this digest as it is; a change of the model's behaviour changes it on
    purpose (and says why in its commit)."""
    import hashlib

    w = ProvisionWorld(shipped_bundle)
    plan = np.where(w.pools.is_spot, 1, 0)
    plan[w.pool_index["llama-2-7b@aws:us-east-1:g5.xlarge:on_demand"]] = 1
    w.reset(seed=3)
    while not w.step(plan).done:
        pass
    h = hashlib.sha256()
    for a in (w.QI[pk.QI_POOL], w.QI[pk.QI_ROW]):
        h.update(a.astype(np.int64).tobytes())
    for a in (w.QF[pk.QF_END], w.QF[pk.QF_FIRST]):
        h.update(np.round(a, 3).tobytes())
    m = w.metrics()
    assert (m["served"], m["cost_usd"], m["cost_per_1k_requests"], m["slo_attainment"]) == \
        (28185, 506.039817, 17.954224, 1.0)
    assert h.hexdigest()[:16] == "38004f029a10e5c5"


def test_gym_env_runs_an_episode() -> None:
    env = gym.make("xroute/Provision-v0", episode_epochs=3)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    n = len(info["pool_ids"])
    total, trunc = 0.0, False
    while not trunc:
        a = np.zeros(env.action_space.shape, dtype=np.int64)
        a[:n] = 0
        a[0] = 1
        obs, r, term, trunc, info = env.step(a)
        assert not term and r <= 0.0
        total += r
    assert "metrics" in info and info["metrics"]["lost"] == 0


def test_the_benchmark_runs(tmp_path: Path) -> None:
    """``benchmarks/bench_provisioning.py``'s measuring code, once, on the hand-made bundle."""
    import pandas as pd

    import benchmarks.bench_provisioning as bp

    hist = pd.DataFrame({"ts": [T0 - pd.Timedelta(seconds=30 - k) for k in range(30)],
                         "request_id": [f"h{k}" for k in range(30)], "origin": "aws:us-east-1", "input_tokens": 1000,
                         "output_tokens": 100, "tenant": "a"})
    root = write_capbundle(tmp_path, [{"t": k * 5.0} for k in range(60)])
    w = ProvisionWorld(str(root), {"serving_config": str((root / "serving.yaml").resolve())}, history=hist)
    eps, rps, n = bp.world_rate(w, 0)
    assert n == w.E == 5 and eps > 0 and rps > 0
    assert len(bp.plan_times(w, "melange", 0)) == w.E and len(bp.plan_times(w, "oracle", 0)) == 1
