"""The learned router's pieces, without Ray or MLflow: the numpy export equals the torch network,
the scorer ignores offering order, masks hold at acting and in targets, the env fork used by the
warm start is faithful, one seed gives one policy, and bad configs fail with one clear line."""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch as th
import yaml
from gymnasium import spaces

from envs.features import N_OFFERING_FEATURES as NF
from envs.features import N_REQUEST_FEATURES as NR
from envs.features import OFFERING_HIGH, REQUEST_HIGH
from models.config import TrainConfig, load_train_config
from models.policy import LearnedPolicy, RewardPrior, RouterWeights, read_router, save_router
from models.qnet import INVALID_Q, MaskedDQN, SharedScorerDQNPolicy, export_router, random_valid_actions
from tests.tinybundle import write_tiny_bundle
from xroute.config import EvaluateConfig, RewardConfig, parse_config
from xroute.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
PRIOR = asdict(RewardPrior.from_env_config(EvaluateConfig().env))

SERVING = {"reference_accelerator": "A10G", "accelerators": {
    "A10G": {"memory_gb": 24, "prefill_tok_s": 6170, "tpot_ms": 31.0, "tpot_growth": 0.051, "max_concurrency": 7, "noise_sigma": 0.07},
    "L4": {"memory_gb": 24, "prefill_tok_s": 5970, "tpot_ms": 62.0, "tpot_growth": 0.051, "max_concurrency": 7, "noise_sigma": 0.07},
    "T4": {"memory_gb": 16, "prefill_tok_s": 3100, "tpot_ms": 58.0, "tpot_growth": 0.051, "max_concurrency": 3, "noise_sigma": 0.08},
}}


def write_agent_setup(root: Path, n_requests: int = 400, env: dict[str, Any] | None = None,
                      **train: Any) -> dict[str, Any]:
    """A tiny bundle, its own serving/evaluate YAML (``env``: more env settings) and a tiny-budget
    train config under ``root``."""
    bundle = write_tiny_bundle(root / "bundle", n_requests=n_requests)
    (root / "serving.yaml").write_text(yaml.safe_dump(SERVING))
    (root / "evaluate.yaml").write_text(yaml.safe_dump({"env": {"serving_config": str(root / "serving.yaml"),
                                                                **(env or {})}}))
    cfg: dict[str, Any] = {
        "telemetry": str(bundle), "run_dir": str(root / "runs"), "evaluate_config": str(root / "evaluate.yaml"),
        "total_timesteps": 300, "episode_requests": 64, "eval_every": 150, "progress_every": 100,
        "net": {"hidden": [16], "context_dim": 4},
        "warm_start": {"samples": 12, "horizon": 4, "top_k": 2, "random_actions": 1, "stride": 2, "epochs": 2},
        # SB3's own DQN (the knobs' tests, tests/test_dqn_knobs.py, and test_the_main_jobs_fine_tuning_runs
        # cover the siblings and demonstrations the shipped config turns on)
        "dqn": {"learning_starts": 50, "batch_size": 16, "buffer_size": 2000, "target_update_interval": 100,
                "learning_rate": 1e-5, "train_freq": 4, "siblings": 0, "td_weight": 1.0, "demo_weight": 0.0,
                "warmup": "random", "exploration": "uniform"},
        "search": {"seeds": [0], "gamma": [0.5]},
        "rate_scales": [1.0, 2.0],
        "data": {"perturbed_copies": 1, "gate_rates": [1.0, 4.0], "gate_seeds": 2},
    }
    for k, v in train.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    (root / "train.yaml").write_text(yaml.safe_dump(cfg))
    return {"bundle": bundle, "train_yaml": root / "train.yaml", "cfg": parse_config(TrainConfig, cfg, "test")}


def _spaces(n: int) -> tuple[spaces.Dict, spaces.Discrete]:
    obs = spaces.Dict({
        "offerings": spaces.Box(0.0, np.tile(OFFERING_HIGH, n), dtype=np.float32),
        "request": spaces.Box(0.0, REQUEST_HIGH, dtype=np.float32),
        "mask": spaces.Box(0.0, 1.0, (n,), dtype=np.float32),
    })
    return obs, spaces.Discrete(n)


def _q_net(n: int, prior: bool, context_dim: int, seed: int = 0) -> Any:
    th.manual_seed(seed)
    obs_space, act_space = _spaces(n)
    pol = SharedScorerDQNPolicy(obs_space, act_space, lambda _: 1e-3, net_arch=[32, 16], context_dim=context_dim,
                                prior=PRIOR if prior else None)
    with th.no_grad():  # random weights everywhere (a prior net's last layer starts at zero)
        for p in pol.q_net.parameters():
            p.normal_(0.0, 0.5)
    return pol.q_net


def _random_obs(rng: np.random.Generator, b: int, n: int) -> dict[str, np.ndarray]:
    mask = (rng.random((b, n)) < 0.6).astype(np.float32)
    mask[0] = 0.0  # a request with no valid offering at all
    return {"offerings": (rng.random((b, n * NF)) * np.tile(OFFERING_HIGH, n)).astype(np.float32),
            "request": (rng.random((b, NR)) * REQUEST_HIGH).astype(np.float32), "mask": mask}


@pytest.mark.parametrize(("prior", "context_dim"), [(True, 8), (False, 0), (False, 8)])
def test_numpy_export_chooses_what_the_torch_network_chooses(prior: bool, context_dim: int) -> None:
    n, b = 13, 256
    q_net = _q_net(n, prior, context_dim)
    obs = _random_obs(np.random.default_rng(1), b, n)
    with th.no_grad():
        q = q_net({k: th.as_tensor(v) for k, v in obs.items()}).numpy()
    w = export_router(q_net)
    s = w.scores(obs["offerings"].reshape(b, n, NF), obs["request"], obs["mask"])
    valid = obs["mask"] > 0.5
    assert np.allclose(np.where(valid, s, 0), np.where(valid, q, 0), atol=1e-4, rtol=1e-4)
    assert np.all(q[valid.any(axis=1)][~valid[valid.any(axis=1)]] == INVALID_Q)
    assert np.array_equal(q.argmax(axis=1), np.where(np.isfinite(s), s, -np.inf).argmax(axis=1))
    pol = LearnedPolicy(w)
    pol.reset(None, 0)
    for k in range(1, b):  # the per-request acting path agrees too
        one = {key: v[k] for key, v in obs.items()}
        if valid[k].any():
            assert pol.act(one, {"action_mask": valid[k]}) == int(q[k].argmax())


def test_export_round_trips_through_files_and_loads_without_torch(tmp_path: Path) -> None:
    q_net = _q_net(7, True, 4)
    w = export_router(q_net, {"note": "x"})
    d = save_router(w, tmp_path / "router")
    back = read_router(d)
    obs = _random_obs(np.random.default_rng(2), 16, 7)
    rows = obs["offerings"].reshape(16, 7, NF)
    assert np.array_equal(w.scores(rows, obs["request"], obs["mask"]), back.scores(rows, obs["request"], obs["mask"]))
    assert back.prior == RewardPrior(**PRIOR) and back.meta["note"] == "x"
    code = ("import sys; from models.loader import load_policy; import numpy as np; "
            f"p = load_policy({str(d)!r}); p.reset(None, 0); "
            "o = {'offerings': np.ones(7*%d, np.float32), 'request': np.ones(%d, np.float32), "
            "'mask': np.ones(7, np.float32)}; p.act(o, {}); "
            "assert 'torch' not in sys.modules and 'stable_baselines3' not in sys.modules, 'torch imported'" % (NF, NR))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_scores_ignore_offering_order_and_catalog_size() -> None:
    w = export_router(_q_net(9, True, 8))
    rng = np.random.default_rng(3)
    obs = _random_obs(rng, 8, 9)
    rows = obs["offerings"].reshape(8, 9, NF)
    s = w.scores(rows, obs["request"], obs["mask"])
    perm = rng.permutation(9)
    sp = w.scores(rows[:, perm], obs["request"], obs["mask"][:, perm])
    assert np.allclose(sp, s[:, perm], atol=1e-5)
    # a catalog of another size is just fewer rows; invalid rows do not change the valid ones' scores
    keep = np.flatnonzero(obs["mask"][1] > 0.5)
    sub = w.scores(rows[1:2, keep], obs["request"][1:2], np.ones((1, keep.size), np.float32))
    assert np.allclose(sub[0], s[1, keep], atol=1e-5)


def test_bad_export_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no router\.json"):
        read_router(tmp_path)
    d = save_router(export_router(_q_net(5, False, 0)), tmp_path / "r")
    meta = (d / "router.json").read_text()
    (d / "router.json").write_text(meta.replace('"valid"', '"renamed"'))
    with pytest.raises(ConfigError, match="offering_features"):
        read_router(d)


def test_exploration_and_greedy_actions_are_always_valid(tmp_path: Path) -> None:
    from envs.cloud_route import CloudRouteEnv

    setup = write_agent_setup(tmp_path)
    env = CloudRouteEnv(str(setup["bundle"]), {"serving_config": str(tmp_path / "serving.yaml"),
                                                "episode_requests": 64, "max_offerings": 10})
    model = MaskedDQN(SharedScorerDQNPolicy, env, seed=0, learning_starts=30, buffer_size=500, batch_size=8,
                      policy_kwargs={"net_arch": [8], "context_dim": 0, "prior": None}, device="cpu")
    obs, info = env.reset(seed=0)
    model.exploration_rate = 1.0
    checked = 0
    for _ in range(200):
        a, _ = model.predict(obs, deterministic=False)
        g, _ = model.predict(obs, deterministic=True)
        if info["action_mask"].any():  # (none valid: a request the admission sheds -- any action is its shed)
            assert info["action_mask"][int(a)] and info["action_mask"][int(g)]
            checked += 1
        obs, _, _, done, info = env.step(int(a))
        if done:
            obs, info = env.reset()
    assert checked >= 100, checked
    rng = np.random.default_rng(0)
    m = np.zeros((50, 10), np.float32)
    m[:, [2, 7]] = 1
    assert set(random_valid_actions(m, rng)) == {2, 7}
    # warm-up actions (before learning_starts) and the TD target's max both see only valid actions
    model.learn(120)
    data = model.replay_buffer.sample(64)
    acts = data.actions.numpy().ravel()
    assert np.all(data.observations["mask"].numpy()[np.arange(len(acts)), acts] == 1.0)
    with th.no_grad():
        q_next = model.q_net_target(data.next_observations)
    nm = data.next_observations["mask"].numpy() > 0.5
    has = nm.any(axis=1)
    assert np.all(nm[has, q_next.numpy()[has].argmax(axis=1)])


def test_fork_plays_out_alternatives_without_touching_the_env(tmp_path: Path) -> None:
    import copy

    from envs.cloud_route import CloudRouteEnv
    from models.warmstart import fork

    setup = write_agent_setup(tmp_path)
    env = CloudRouteEnv(str(setup["bundle"]), {"serving_config": str(tmp_path / "serving.yaml"),
                                                "episode_requests": 200})
    env.reset(seed=4)
    for _ in range(30):
        env.step(int(np.argmax(env.expected_rewards())))
    ref = copy.deepcopy(env)
    sim = fork(env)
    acts = [int(np.argmax(sim.expected_rewards())) for _ in range(1)]
    out_sim, out_ref = [], []
    for k in range(60):
        a = acts[0] if k == 0 else int(np.argmax(sim.expected_rewards()))
        out_sim.append(sim.step(a)[1])
        out_ref.append(ref.step(a)[1])
    assert out_sim == out_ref
    # the original did not move: stepping it now matches a fresh deep copy of its old state
    again = copy.deepcopy(ref)
    del again
    env2 = fork(env)
    assert [env.step(int(np.argmax(env.expected_rewards())))[1] for _ in range(20)] == \
        [env2.step(int(np.argmax(env2.expected_rewards())))[1] for _ in range(20)]
    assert env._pos == env2._pos


def _greedy_play(sim: Any, first: int, steps: int) -> tuple[float, int]:
    """The warm start's rollout: ``first``, then ``steps`` greedy requests; (return, its budget refusals)."""
    before = sim.stats["refused_budget"]
    g = sim.step(first)[1]
    for _ in range(steps):
        g += sim.step(int(np.argmax(sim.expected_rewards())))[1]
    return g, sim.stats["refused_budget"] - before


def test_forks_of_one_state_play_alike_with_tenant_budgets_binding(tmp_path: Path) -> None:
    """The warm start labels each candidate of a state by a rollout on a fork of the state, one
    candidate after another (``models.warmstart.collect``). With tenant budgets in the world, what a
    fork spends must stay in the fork: the same candidate played again after the others returns the
    same, and the environment's budgets and future are untouched. (The budget book was once shared
    by every fork: each candidate's rollout started from a budget the previous ones had spent, the
    refusals that followed (about -3 each) made the labels' outliers, and the episode itself ran
    out of budget.)"""
    import copy

    from envs.cloud_route import CloudRouteEnv
    from models.warmstart import fork

    setup = write_agent_setup(tmp_path)
    env = CloudRouteEnv(str(setup["bundle"]), {"serving_config": str(tmp_path / "serving.yaml"),
                                                "episode_requests": 300, "budget_period_s": 60.0,
                                                "tenants": {"a": {"usd_per_day": 0.008}}})
    env.reset(seed=4)
    for _ in range(30):
        env.step(int(np.argmax(env.expected_rewards())))
    assert env.budget is not None
    book = env.budget.save()
    ref = copy.deepcopy(env)
    r_exp = env.expected_rewards()
    cands = [int(a) for a in np.argsort(-r_exp, kind="stable")[:3] if np.isfinite(r_exp[a])]
    assert len(cands) >= 2
    plays = [_greedy_play(fork(env), a, 60) for a in [*cands, cands[0]]]
    assert min(refused for _, refused in plays) > 0  # the budget binds within every rollout
    assert plays[-1] == plays[0]
    assert env.budget.save() == book
    assert [env.step(int(np.argmax(env.expected_rewards())))[1] for _ in range(60)] == \
        [ref.step(int(np.argmax(ref.expected_rewards())))[1] for _ in range(60)]
    assert env.stats == ref.stats


def test_fork_refuses_state_it_does_not_know_how_to_copy(tmp_path: Path) -> None:
    """An object the environment gains is not shared by a fork by accident (as the budget book was):
    ``fork`` names it until it is declared read-only or copied."""
    from envs.cloud_route import CloudRouteEnv
    from models.warmstart import fork

    setup = write_agent_setup(tmp_path)
    env = CloudRouteEnv(str(setup["bundle"]), {"serving_config": str(tmp_path / "serving.yaml"),
                                                "episode_requests": 100})
    env.reset(seed=1)
    fork(env)
    env.new_state = type("Ledger", (), {})()
    with pytest.raises(TypeError, match="'new_state' \\(Ledger\\)"):
        fork(env)


def _tiny_context(setup: dict[str, Any], seed_data: int = 5) -> Any:
    from models.scenarios import build_scenarios, train_env_config
    from models.trial import TrialContext
    from models.warmstart_labels import collect_warm_start

    cfg: TrainConfig = setup["cfg"]
    sc = build_scenarios(cfg)
    eval_cfg = cfg.evaluate_settings()
    env_cfg = train_env_config(cfg, eval_cfg, sc.max_offerings)
    data = collect_warm_start(cfg, env_cfg, sc.train, use_ray=False, echo=lambda s: None)
    return TrialContext(cfg=cfg, eval_cfg=eval_cfg, train=sc.train, selection=sc.selection, bundle_hash="h",
                        baseline_runs=[], warm_data=data, max_offerings=sc.max_offerings, out_dir="")


def test_same_seed_gives_the_same_policy(tmp_path: Path) -> None:
    from models.trial import run_trial

    setup = write_agent_setup(tmp_path)
    results = []
    for k in range(2):
        ctx = _tiny_context(setup)
        ctx.out_dir = str(tmp_path / f"out{k}")
        results.append(run_trial({"seed": 3, "gamma": 0.5, "learning_rate": 1e-3}, ctx))
    a, b = (read_router(r["router_dir"]) for r in results)
    assert len(a.layers) == len(b.layers)
    for (wa, ba), (wb, bb) in zip(a.layers, b.layers):
        assert np.array_equal(wa, wb) and np.array_equal(ba, bb)
    assert results[0]["val_mean_reward"] == results[1]["val_mean_reward"]
    assert results[0]["best_step"] == results[1]["best_step"]


def test_the_main_jobs_fine_tuning_runs_and_serves_its_best_checkpoint(tmp_path: Path) -> None:
    """The shipped ``dqn:`` block (siblings played to the warm start's horizon under greedy,
    demonstrations, no TD term, no random offering among them) on the tiny setup: DQN changes the network, and the checkpoint
    kept is the one with the best selection score, the warm start (step 0) included."""
    from models.trial import run_trial

    shipped = yaml.safe_load((REPO / "configs" / "train.yaml").read_text())["dqn"]
    small = {k: shipped[k] for k in shipped if k.startswith(("sibling", "demo", "td_", "train_freq", "warmup",
                                                             "exploration"))}
    setup = write_agent_setup(tmp_path, dqn={**small, "siblings": 2, "sibling_horizon": 6, "sibling_every": 2,
                                             "sibling_batch_size": 4, "demo_batch_size": 8, "learning_rate": 1e-3},
                              total_timesteps=400, eval_every=100)
    d = setup["cfg"].dqn
    assert d.siblings > 0 and d.td_weight == 0 and not d.sibling_bootstrap and d.warmup == "policy"
    ctx = _tiny_context(setup)
    ctx.out_dir, ctx.save_last = str(tmp_path / "out"), True
    res = run_trial({"seed": 1, "gamma": 0.95, "learning_rate": 1e-3}, ctx)
    assert [s for s, _ in res["curve"]] == [0, 100, 200, 300, 400]
    assert res["val_criterion_no_margin"] == max(c for _, c in res["curve"])
    assert res["warm_start_val_criterion"] == res["curve"][0][1]
    # the departure margin kept is never below the best-scoring non-inferior one (models.callbacks.pick_margin),
    # the best's score interval to itself is [0, 0], and the export carries the kept one
    assert res["margin"] >= res["margin_best"] and res["margin"] == read_router(res["router_dir"]).margin
    assert set(res["margin_gaps"]) == set(res["margins"])
    assert res["margin_gaps"][str(res["margin_best"])] == [0.0, 0.0]
    assert all(lo <= hi for lo, hi in res["margin_gaps"].values())
    warm, last = read_router(res["warm_dir"]), read_router(res["last_dir"])
    assert any(not np.array_equal(a[0], b[0]) for a, b in zip(warm.layers, last.layers))  # DQN did train


@pytest.mark.parametrize(("data", "field"), [
    ({"bogus": 1}, "bogus"),
    ({"total_timesteps": -5}, "total_timesteps"),
    ({"dqn": {"gama": 0.9}}, "dqn.gama"),
    ({"split": {"train": 0.9}}, "split"),
    ({"search": {"gamma": [1.5]}}, "search"),
    ({"rate_scales": [0]}, "rate_scales"),
])
def test_bad_train_config_names_the_field(tmp_path: Path, data: dict[str, Any], field: str) -> None:
    p = tmp_path / "train.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=f"field '{field}") as e:
        load_train_config(p)
    assert "\n" not in str(e.value)


def test_missing_bundle_is_a_config_error(tmp_path: Path) -> None:
    from models.scenarios import resolve_bundle

    with pytest.raises(ConfigError, match=r"telemetry.*not found"):
        resolve_bundle(tmp_path / "nope", "train config: field 'telemetry'")


def test_default_train_config_is_valid_and_matches_the_evaluate_reward() -> None:
    cfg = load_train_config(REPO / "configs" / "train.yaml")
    assert cfg.total_timesteps >= 0 and cfg.warm_start.samples > 0 and cfg.split.test > 0
    assert set(cfg.data.selection) - set(cfg.data.train)  # selected on a distribution it was not trained on, too
    assert isinstance(cfg.evaluate_settings().env.reward, RewardConfig)


@pytest.mark.parametrize("args", [
    ["train", "--config", "{bad}"],
    ["train", "--config", "{neg}"],
    ["train", "--telemetry", "/nonexistent/bundle", "--config", "{ok}"],
    ["train", "--ray-address", "127.0.0.1:1", "--config", "{ok}"],
])
def test_cli_train_errors_are_one_line_exit_2(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "bad.yaml").write_text("total_timestep: 10\n")
    (tmp_path / "neg.yaml").write_text("total_timesteps: -10\n")
    (tmp_path / "ok.yaml").write_text(f"run_dir: {tmp_path / 'runs'}\n")
    argv = [a.format(bad=tmp_path / "bad.yaml", neg=tmp_path / "neg.yaml", ok=tmp_path / "ok.yaml") for a in args]
    r = subprocess.run([sys.executable, "-m", "xroute_app", *argv], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("xroute: error:"), r.stderr
    assert "Traceback" not in r.stderr
    assert any(k in lines[0] for k in ("total_timestep", "telemetry", "ray-address"))


def test_the_margin_is_the_departure_rules_and_leaves_the_scores_alone() -> None:
    """``RouterWeights.margin`` is the departure rule's tau (``models.policy.departs``,
    tests/test_departure.py), applied at the choice, not in the scores: both scorers (batch and
    the router's one-request path) give the same scores at any margin; a large margin gives
    greedy's choice (the prior's best row here); saved and read back with the export."""
    import tempfile

    from models.policy import choose, save_router

    rng = np.random.default_rng(4)
    dims = [NF + NR, 8, 1]
    layers = [(rng.normal(0, 1.0, (a, b)).astype(np.float32), rng.normal(0, 0.5, b).astype(np.float32))
              for a, b in itertools.pairwise(dims)]
    w = RouterWeights(layers=layers, prior=RewardPrior(**PRIOR))
    picks = {0.0: 0, 1e6: 0}
    idx = np.arange(12)
    for _ in range(40):
        rows = rng.uniform(0, 1, (12, NF)).astype(np.float32)
        req = rng.uniform(0.2, 1.0, NR).astype(np.float32)
        greedy = int(np.argmax(w.prior.scores(rows[None], req[None])[0]))
        base = w.scores_one(rows, req)
        for m in (0.0, 1e6):
            w.margin = m
            one = w.scores_one(rows, req)
            batch = w.scores(rows[None], req[None], np.ones((1, 12)))[0]
            assert int(np.argmax(one)) == int(np.argmax(batch))
            np.testing.assert_array_equal(one, base)
            picks[m] += choose(one, idx, greedy, m) == greedy
        w.margin = 0.0
    assert picks[1e6] == 40 and picks[0.0] < 40  # the untrained correction does move some choices
    w.margin = 0.005
    with tempfile.TemporaryDirectory() as d:
        assert read_router(save_router(w, d)).margin == 0.005
