"""The knobs of the DQN fine-tuning ablations (``models.config.DQNConfig``, ``models.qnet.MaskedDQN``)
do what they say: n-step returns through SB3's own buffer on the flattened observation, a reward
scale that leaves the exported router in reward units, exploration among the best valid offerings,
the warm start's states in every update, and the diagnostics each update records. Real SB3, real
environment (a tiny bundle), no Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch as th
import yaml
from stable_baselines3.common.buffers import DictReplayBuffer, NStepReplayBuffer

from envs.cloud_route import CloudRouteEnv
from envs.features import N_OFFERING_FEATURES as NF
from models.config import load_train_config
from models.qnet import FlatObservation, MaskedDQN, SharedScorerDQNPolicy, export_router, top_k_valid_actions
from models.warmstart import fork
from tests.test_agent import PRIOR, _random_obs, _tiny_context, write_agent_setup
from xroute.errors import ConfigError


def _env(setup: dict[str, Any], tmp: Path) -> CloudRouteEnv:
    return CloudRouteEnv(str(setup["bundle"]), {"serving_config": str(tmp / "serving.yaml"), "episode_requests": 64,
                                                "max_offerings": 10})


def _model(env: Any, **kw: Any) -> MaskedDQN:
    pk = {"net_arch": [16], "context_dim": 4, "prior": PRIOR, "prior_scale": kw.pop("prior_scale", 1.0)}
    return MaskedDQN(SharedScorerDQNPolicy, env, seed=0, learning_starts=40, buffer_size=1000, batch_size=16,
                     train_freq=2, policy_kwargs=pk, device="cpu", **kw)


def test_n_step_returns_use_sb3s_buffer_on_the_flat_observation(tmp_path: Path) -> None:
    setup = write_agent_setup(tmp_path)
    dict_env = _env(setup, tmp_path)
    flat = FlatObservation(_env(setup, tmp_path))
    # the flat observation is the Dict one concatenated as the Q-network reads it: same Q-values
    m_dict, m_flat = _model(dict_env), _model(flat, n_steps=4, gamma=0.9)
    m_flat.q_net.load_state_dict(m_dict.q_net.state_dict())
    obs, _ = dict_env.reset(seed=1)
    with th.no_grad():
        q_d = m_dict.q_net(m_dict.policy.obs_to_tensor(obs)[0]).numpy()
        q_f = m_flat.q_net(m_flat.policy.obs_to_tensor(flat.observation(obs))[0]).numpy()
    assert np.array_equal(q_d, q_f)
    assert isinstance(m_dict.replay_buffer, DictReplayBuffer)
    assert isinstance(m_flat.replay_buffer, NStepReplayBuffer) and m_flat.replay_buffer.n_steps == 4
    m_flat.learn(160)
    # exploration and warm-up drew valid offerings only, read from the flat observation's mask columns
    n = int(flat.action_space.n)
    data = m_flat.replay_buffer.sample(64)
    acts = data.actions.numpy().ravel()
    assert np.all(data.observations.numpy()[:, -n:][np.arange(len(acts)), acts] == 1.0)
    # the sampled reward is the discounted sum of the next 4 (unless the episode ended first)
    assert data.discounts is not None
    disc = data.discounts.numpy().ravel()
    allowed = np.array([0.9 ** k for k in range(1, 5)])
    assert np.all(np.isclose(disc[:, None], allowed[None, :], atol=1e-5).any(axis=1))
    assert np.isclose(disc, 0.9 ** 4, atol=1e-5).mean() > 0.5  # mostly the full 4 steps
    assert {"train/td_abs", "train/q_mean", "train/action_gap", "train/target_std"} <= set(
        m_flat.logger.name_to_value)


def test_reward_scale_trains_on_that_scale_and_exports_in_reward_units(tmp_path: Path) -> None:
    setup = write_agent_setup(tmp_path)
    env = _env(setup, tmp_path)
    scaled = _model(env, reward_scale=10.0, prior_scale=10.0)
    unit = _model(env)
    scorer_s: Any = scaled.q_net.q_net
    scorer_u: Any = unit.q_net.q_net
    rng = np.random.default_rng(0)
    with th.no_grad():  # a correction of c x (the unit net's): the scaled net is c x the unit net
        for ps, pu in zip(scorer_s.parameters(), scorer_u.parameters()):
            pu.copy_(th.randn_like(pu) * 0.3)
            ps.copy_(pu)
        last_s = [m for m in scorer_s.mlp if isinstance(m, th.nn.Linear)][-1]
        last_s.weight.mul_(10.0)
        last_s.bias.mul_(10.0)
    obs = _random_obs(rng, 32, 10)
    t = {k: th.as_tensor(v) for k, v in obs.items()}
    with th.no_grad():
        q_s, q_u = scaled.q_net(t).numpy(), unit.q_net(t).numpy()
    valid = obs["mask"] > 0.5
    assert np.allclose(q_s[valid], 10.0 * q_u[valid], rtol=1e-4, atol=1e-4)
    rows = obs["offerings"].reshape(32, 10, NF)
    s_exp = export_router(scaled.q_net).scores(rows, obs["request"], obs["mask"])
    u_exp = export_router(unit.q_net).scores(rows, obs["request"], obs["mask"])
    assert np.allclose(s_exp[valid], u_exp[valid], rtol=1e-4, atol=1e-5)
    assert np.allclose(u_exp[valid], q_u[valid], rtol=1e-4, atol=1e-4)


def test_top_k_exploration_draws_among_the_best_valid_offerings(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    q = np.tile(np.arange(8, dtype=float), (400, 1))  # offering 7 best, then 6, ...
    mask = np.ones((400, 8))
    mask[:, 6] = 0  # ... but 6 is invalid: the best three valid are 7, 5, 4
    assert set(top_k_valid_actions(q, mask, 3, rng)) == {7, 5, 4}
    assert set(top_k_valid_actions(q[:1], np.eye(8)[[2]], 3, rng)) == {2}
    setup = write_agent_setup(tmp_path)
    env = _env(setup, tmp_path)
    model = _model(env, exploration="top_k", exploration_top_k=2)
    model.exploration_rate = 1.0
    obs, info = env.reset(seed=3)
    picks = set()
    for _ in range(60):
        a, _ = model.predict(obs, deterministic=False)
        with th.no_grad():
            qv = model.q_net(model.policy.obs_to_tensor(obs)[0]).numpy()[0]
        valid = np.flatnonzero(info["action_mask"])
        best2 = set(valid[np.argsort(-qv[valid], kind="stable")[:2]].tolist())
        assert int(a) in best2
        picks.add(int(a))
        obs, _, _, done, info = env.step(int(a))
        if done:
            obs, info = env.reset()
    assert len(picks) >= 2


@pytest.mark.slow
def test_demonstrations_in_every_update_pull_the_network_to_the_rollout_advantages(tmp_path: Path) -> None:
    # (admission off: the tiny bundle's few pools are past their capacity at these loads, and the sheds'
    # -2 rewards of the admission that predicts their queues swamp the TD loss this test pits the
    # demonstrations against; what it checks is that the demonstrations pull, whatever the rewards)
    setup = write_agent_setup(tmp_path, env={"admission": {"enabled": False}},
                              warm_start={"samples": 60, "horizon": 6, "top_k": 3, "random_actions": 1,
                                          "stride": 2, "epochs": 1})
    from models.scenarios import train_env_config

    ctx = _tiny_context(setup)
    data = ctx.warm_data
    env = CloudRouteEnv(ctx.train[0].bundle, train_env_config(ctx.cfg, ctx.eval_cfg, ctx.max_offerings))
    n = int(env.action_space.n)
    assert n == data.mask.shape[1]
    model = _model(env, demo=data, demo_weight=50.0, demo_batch_size=32, learning_rate=3e-3)
    first = float(model._demo_loss().detach())
    model.learn(400)
    assert "train/demo_loss" in model.logger.name_to_value
    after = float(model._demo_loss().detach())
    assert after < first
    rows = th.tensor(data.offerings).reshape(len(data), n, NF)
    with th.no_grad():
        q = model.q_net.q_net(rows, th.tensor(data.request), th.tensor(data.mask)).gather(1, th.tensor(data.actions))
    w = data.weight > 0
    diff = (q - q[:, :1]).numpy()
    # the learned differences rank the candidates like the rollouts did, more often than not
    agree = np.sign(diff[:, 1:][w[:, 1:]]) == np.sign(data.advantage[:, 1:][w[:, 1:]])
    assert agree.mean() > 0.5


@pytest.mark.parametrize(("data", "field"), [
    ({"dqn": {"n_steps": 0}}, "dqn.n_steps"),
    ({"dqn": {"loss": "l1"}}, "dqn.loss"),
    ({"dqn": {"exploration": "boltzmann"}}, "dqn.exploration"),
    ({"dqn": {"reward_scale": 0}}, "dqn.reward_scale"),
    ({"dqn": {"demo_weight": -1}}, "dqn.demo_weight"),
    ({"dqn": {"td_weight": -1}}, "dqn.td_weight"),
    ({"dqn": {"siblings": 3, "n_steps": 5}}, "dqn"),
    ({"dqn": {"sibling_continuation": "oracle"}}, "dqn.sibling_continuation"),
    ({"dqn": {"sibling_gamma": 1.5}}, "dqn.sibling_gamma"),
])
def test_bad_knobs_name_the_field(tmp_path: Path, data: dict[str, Any], field: str) -> None:
    p = tmp_path / "train.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        load_train_config(p)


def test_policy_warmup_fills_the_buffer_with_the_networks_own_choices(tmp_path: Path) -> None:
    setup = write_agent_setup(tmp_path)
    env = _env(setup, tmp_path)
    picks = {}
    for warmup in ("policy", "random"):
        model = _model(env, warmup=warmup, exploration_initial_eps=0.0, exploration_final_eps=0.0)
        model.learning_starts = 100
        model.learn(60)  # all warm-up: nothing trained, the network is the one that chose
        buf: Any = model.replay_buffer
        obs = {k: v[:60, 0] for k, v in buf.observations.items()}
        with th.no_grad():
            q = model.q_net(model.policy.obs_to_tensor(obs)[0]).numpy()
        picks[warmup] = float((q.argmax(axis=1) == buf.actions[:60, 0, 0]).mean())
    assert picks["policy"] == 1.0 and picks["random"] < 0.9


def _greedy_after(env: Any, a: int, n: int, gamma: float) -> float:
    """The discounted return of ``a`` then ``n - 1`` requests routed by greedy, on a fork of ``env``
    (the sibling's target, computed by hand)."""
    sim = fork(env)
    g = 0.0
    for t in range(n):
        _, r, _, _, _ = sim.step(a if t == 0 else int(np.argmax(sim.expected_rewards())))
        g += gamma ** t * float(r)
    return g


def _play_first_valid(w: Any, steps: int, horizon: int, gamma: float) -> list[tuple[int, float, dict[str, Any]]]:
    """Step a :class:`SiblingPlay` ``steps`` times on its first valid offering: each step's action,
    the target computed by hand (:func:`_greedy_after`), and the group the wrapper kept."""
    out = []
    for _ in range(steps):
        a = int(np.flatnonzero(np.isfinite(w.env.expected_rewards()))[0])
        want = _greedy_after(w.env, a, horizon, gamma)
        w.step(a)
        out.append((a, want, w.pending[-1]))
    return out


def test_siblings_are_played_on_the_same_draws_and_their_differences_are_fitted(tmp_path: Path) -> None:
    """``dqn.siblings``: the best offerings and the one taken are played on forks before the step
    (greedy's first), the taken one's outcome is the real step's (same request, same draws), and
    the paired loss -- with the target network held fixed, a plain regression -- goes down."""
    from models.qnet import SiblingPlay

    setup = write_agent_setup(tmp_path)
    env = SiblingPlay(_env(setup, tmp_path), k=3)
    obs, _ = env.reset(seed=4)
    for _ in range(12):
        r_exp = env.env.expected_rewards()
        valid = np.flatnonzero(np.isfinite(r_exp))
        a = int(valid[-1])  # not greedy's choice, where there is a choice
        _, r, _, _, _ = env.step(a)
        g = env.pending[-1]
        assert int(g["actions"][0]) == int(valid[np.argmax(r_exp[valid])])
        assert a in g["actions"].tolist() and len(set(g["actions"].tolist())) == len(g["actions"])
        assert float(g["rewards"][g["actions"].tolist().index(a)]) == pytest.approx(float(r), rel=1e-6)
        assert g["next"]["offerings"].shape[0] == len(g["actions"])
    env.pending.clear()
    # over a horizon: the discounted rewards of the next 3 requests (here routed by greedy: no network
    # yet), the state after them and gamma ** 3 to bootstrap with
    deep = SiblingPlay(_env(setup, tmp_path), k=2, horizon=3, gamma=0.9)
    deep.reset(seed=5)
    for a, want, g in _play_first_valid(deep, 5, 3, 0.9):
        i = g["actions"].tolist().index(a)
        assert float(g["rewards"][i]) == pytest.approx(want, rel=1e-5)
        assert float(g["discounts"][i]) == pytest.approx(0.9 ** 3)
    model = _model(env, siblings=env, sibling_weight=20.0, sibling_batch_size=16, learning_rate=3e-3,
                   target_update_interval=10**6)
    model.learn(80)  # fills the groups (learning starts at 40)
    model.sibling_groups.extend(env.pending)
    env.pending.clear()
    groups = list(model.sibling_groups)
    assert len(groups) >= 40
    with th.no_grad():
        before = float(model._sibling_batch_loss(groups))
    model.learn(400, reset_num_timesteps=False)
    assert "train/sibling_loss" in model.logger.name_to_value
    with th.no_grad():
        after = float(model._sibling_batch_loss(groups))
    assert after < before


def test_siblings_without_bootstrap_fit_the_warm_starts_own_labels(tmp_path: Path) -> None:
    """``sibling_gamma`` 1, ``sibling_bootstrap`` off and ``sibling_continuation: greedy``: a
    sibling's target is the undiscounted h-request return with greedy routing the later requests --
    the warm start's label -- whatever the network would route, and the paired loss no longer
    depends on the target network (no value compared across states); with the bootstrap it does."""
    from models.qnet import SiblingPlay

    setup = write_agent_setup(tmp_path)
    env = SiblingPlay(_env(setup, tmp_path), k=2, horizon=4, continuation="greedy")
    model = _model(env, siblings=env, sibling_gamma=1.0, sibling_bootstrap=False, sibling_batch_size=8)
    assert env.gamma == 1.0 and env.act is not None  # the network is there, and greedy routes anyway

    def worst_valid(o: dict[str, np.ndarray]) -> int:
        return int(np.flatnonzero(o["mask"])[-1])

    env.act = worst_valid  # a continuation policy that is never greedy's: must not be used
    env.reset(seed=6)
    for a, want, g in _play_first_valid(env, 6, 4, 1.0):
        assert float(g["rewards"][g["actions"].tolist().index(a)]) == pytest.approx(want, rel=1e-5)
    groups = list(env.pending)
    with th.no_grad():
        before = float(model._sibling_batch_loss(groups))
        for p in model.q_net_target.parameters():
            p.add_(1.0)
        assert float(model._sibling_batch_loss(groups)) == pytest.approx(before, rel=1e-6)
        model.sibling_bootstrap = True
        assert float(model._sibling_batch_loss(groups)) != pytest.approx(before, rel=1e-3)
    with pytest.raises(ValueError, match="continuation"):
        SiblingPlay(_env(setup, tmp_path), k=2, continuation="oracle")
    # ``extra="none"``: an exploring step's offering outside the best k is not a sibling; ``"policy"``: the
    # network's own choice is, not the one taken
    best_only = SiblingPlay(_env(setup, tmp_path), k=2, extra="none")
    best_only.reset(seed=7)
    seen = 0
    for _ in range(8):
        r_exp = best_only.env.expected_rewards()
        valid = np.flatnonzero(np.isfinite(r_exp))
        order = valid[np.argsort(-r_exp[valid], kind="stable")]
        best_only.step(int(order[-1]))
        if valid.size >= 3:
            g = best_only.pending[-1]
            assert g["actions"].tolist() == order[:2].tolist()  # greedy's first, the taken worst one left out
            seen += 1
    assert seen >= 4
    own = SiblingPlay(_env(setup, tmp_path), k=1, extra="policy")
    own.act = worst_valid
    obs, _ = own.reset(seed=8)
    for _ in range(6):
        r_exp = own.env.expected_rewards()
        valid = np.flatnonzero(np.isfinite(r_exp))
        want = list(dict.fromkeys([int(valid[np.argmax(r_exp[valid])]), worst_valid(obs)]))
        obs, *_ = own.step(int(valid[len(valid) // 2]))  # taken: neither the best nor the network's choice
        assert own.pending[-1]["actions"].tolist() == want
