"""The DQN agent's torch side: a permutation-invariant Q-network plugged into stable-baselines3
through its documented extension points (a features extractor, a ``QNetwork`` subclass made by a
``DQNPolicy`` subclass, and a ``DQN`` subclass overriding ``predict``/``_sample_action``).

* ``SharedScorer`` scores each offering row with one MLP shared by all rows (input: the row's
  features, the request features and a masked-mean context of all valid rows). It has no
  per-index weights, so it neither depends on the order of the offerings nor on their number.
* ``MaskedQNetwork`` returns the scores as Q-values with invalid offerings pushed to
  ``INVALID_Q``; SB3's greedy action (``argmax``) and its TD target (``max`` over the *next*
  observation's Q-values, whose mask is the next state's) therefore only consider valid actions.
* ``MaskedDQN`` explores with valid actions only, drawn from its own seeded generator.
* ``export_router`` copies the weights into ``models.policy.RouterWeights`` (numpy).
"""

from __future__ import annotations

from collections import deque
from itertools import pairwise
from typing import Any

import gymnasium as gym
import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3 import DQN
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor, FlattenExtractor
from stable_baselines3.common.type_aliases import PyTorchObs
from stable_baselines3.dqn.policies import DQNPolicy, QNetwork
from torch import nn
from torch.nn import functional as tnf

from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES, F, R
from models.policy import RewardPrior, RouterWeights

_COST, _LAT, _VIOL, _RISK = F["exp_cost"], F["exp_latency"], F["exp_violation"], F["preempt_risk"]
_BUDGET = R["budget"]

#: Q-value given to invalid offerings: far below any reachable return, finite so TD errors stay finite
INVALID_Q = -1.0e4


class SharedScorer(nn.Module):
    """``(rows (B,N,F), request (B,R), mask (B,N)) -> scores (B,N)``, masked (see module doc).

    With ``prior`` (a :class:`models.policy.RewardPrior`), the score is that fixed one-step reward
    estimate plus the MLP's output, and the MLP's last layer starts at zero: the untrained network
    is the one-step expected-reward policy and training learns the correction."""

    def __init__(self, hidden: list[int], context_dim: int = 16, prior: RewardPrior | None = None,
                 prior_scale: float = 1.0):
        super().__init__()
        #: the reward scale this network is trained at (``dqn.reward_scale``): its scores are
        #: ``prior_scale`` x (prior + correction in reward units); ``export_router`` divides it out
        self.prior_scale = float(prior_scale)
        d_in = N_OFFERING_FEATURES + N_REQUEST_FEATURES
        self.ctx = nn.Linear(d_in, context_dim) if context_dim > 0 else None
        dims = [d_in + context_dim, *hidden]
        layers: list[nn.Module] = []
        for a, b in pairwise(dims):
            layers += [nn.Linear(a, b), nn.ReLU()]
        out = nn.Linear(dims[-1], 1)
        if prior is not None:
            nn.init.zeros_(out.weight)
            nn.init.zeros_(out.bias)
        layers.append(out)
        self.mlp = nn.Sequential(*layers)
        self.prior = prior

    def prior_scores(self, rows: th.Tensor, request: th.Tensor) -> th.Tensor:
        """``envs.kernels.expected_reward`` in torch (``tests/test_kernels.py`` pins the two)."""
        p = self.prior
        assert p is not None
        cost = rows[..., _COST].clamp(max=p.cost_norm_cap)
        lat_n = rows[..., _LAT]
        viol, risk = rows[..., _VIOL], rows[..., _RISK]
        budget = th.expm1(request[:, _BUDGET] * 12.0).clamp(min=1.0).unsqueeze(1)
        ok = -(p.cost_weight * cost + p.latency_weight * lat_n.clamp(max=p.latency_norm_cap)) - p.sla_penalty * viol
        bad_lat = (1.5 * lat_n + p.retry_overhead_ms / budget).clamp(max=p.latency_norm_cap)
        bad = -(1.5 * p.cost_weight * cost + p.latency_weight * bad_lat) - p.sla_penalty
        return (1.0 - risk) * ok + risk * bad

    def raw_scores(self, rows: th.Tensor, request: th.Tensor, mask: th.Tensor) -> th.Tensor:
        b, n, _ = rows.shape
        x = th.cat([rows, request.unsqueeze(1).expand(b, n, request.shape[-1])], dim=-1)
        if self.ctx is not None:
            e = th.relu(self.ctx(x))
            w = (mask > 0.5).to(x.dtype).unsqueeze(-1)
            c = (e * w).sum(dim=1) / w.sum(dim=1).clamp(min=1.0)
            x = th.cat([x, c.unsqueeze(1).expand(b, n, c.shape[-1])], dim=-1)
        s = self.mlp(x).squeeze(-1)
        return s if self.prior is None else s + self.prior_scale * self.prior_scores(rows, request)

    def forward(self, rows: th.Tensor, request: th.Tensor, mask: th.Tensor) -> th.Tensor:
        s = self.raw_scores(rows, request, mask)
        valid = mask > 0.5
        keep = valid | ~valid.any(dim=1, keepdim=True)
        return th.where(keep, s, th.full_like(s, INVALID_Q))


class OfferingRowsExtractor(BaseFeaturesExtractor):
    """Passes the Dict observation through as one flat tensor ``[offerings, request, mask]``
    (no parameters); ``MaskedQNetwork`` splits it again."""

    def __init__(self, observation_space: spaces.Dict):
        n = int(observation_space["mask"].shape[0])  # type: ignore[index]
        super().__init__(observation_space, features_dim=n * N_OFFERING_FEATURES + N_REQUEST_FEATURES + n)
        self.n = n

    def forward(self, observations: PyTorchObs) -> th.Tensor:
        assert isinstance(observations, dict)
        return th.cat([observations["offerings"], observations["request"], observations["mask"]], dim=1)


class FlatObservation(gym.ObservationWrapper):  # type: ignore[type-arg]
    """The Dict observation as one Box ``[offerings, request, mask]`` -- the layout
    :class:`OfferingRowsExtractor` makes of it, so the Q-network reads both alike. SB3 2.9's
    n-step returns (``NStepReplayBuffer``) exist only for non-Dict spaces: ``dqn.n_steps > 1``
    trains on this."""

    def __init__(self, env: gym.Env):  # type: ignore[type-arg]
        super().__init__(env)
        sp = env.observation_space
        keys = ("offerings", "request", "mask")
        self.observation_space = spaces.Box(np.concatenate([sp[k].low for k in keys]),  # type: ignore[index]
                                            np.concatenate([sp[k].high for k in keys]),  # type: ignore[index]
                                            dtype=np.float32)

    def observation(self, observation: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([observation["offerings"], observation["request"], observation["mask"]])


class SiblingPlay(gym.Wrapper):  # type: ignore[type-arg]
    """Paired samples of the alternatives (``dqn.siblings``): before every ``every``-th step, the
    ``k`` best valid offerings by the one-step expected reward (greedy's first) and the action taken
    are each played one request on a fork of the environment (``models.warmstart.fork``: the same
    request, the same service-time draws -- common random numbers), and their transitions are kept
    as one *group* in ``pending`` for :class:`MaskedDQN` to learn the differences between them from.

    Why (``python -m models.ablation --noise``, docs/results.md): the choice between the best two
    offerings is worth ~0.002 reward over 40 requests, and one unpaired TD sample of each carries
    noise of ~0.06 -- thousands of samples per decision; paired on the same draws, tens. SB3's
    replay holds each transition alone; a group keeps them paired.

    With ``horizon`` h > 1 each sibling is played on for h requests in all, the later ones routed by
    ``act`` (set by :class:`MaskedDQN` to its network's greedy choice: the policy being learned;
    greedy by expected reward until then), and the group holds the discounted sum of the h rewards,
    the state after them and ``gamma ** h`` (0 where the episode ended).

    ``extra`` is the sibling beside the ``k`` best: ``"taken"``, the action taken; ``"policy"``, the
    network's own choice (``act``), which the taken one is unless the step explores -- an exploring
    step's random offering can fail outright (a reward near -3, as the warm start's random candidates
    did), and one such difference in a squared loss outweighs the ~1e-3 ones that decide, while the
    network's own choice is where its errors are (DAgger's point); ``"none"``: the best only.

    ``continuation="greedy"`` routes the later requests by greedy (expected reward) instead, as the
    warm start's rollouts do: the labels are then the warm start's, on the states the learned policy
    visits (DAgger-style), and each step costs a tenth of a network call."""

    def __init__(self, env: gym.Env, k: int, every: int = 1, horizon: int = 1,  # type: ignore[type-arg]
                 gamma: float = 0.99, continuation: str = "policy", extra: str = "taken"):
        super().__init__(env)
        if continuation not in ("policy", "greedy"):
            raise ValueError(f"continuation {continuation!r}: 'policy' or 'greedy'")
        if extra not in ("taken", "policy", "none"):
            raise ValueError(f"extra {extra!r}: 'taken', 'policy' or 'none'")
        self.k, self.every = int(k), max(int(every), 1)
        self.horizon, self.gamma = max(int(horizon), 1), float(gamma)
        self.continuation, self.extra = continuation, extra
        self.act: Any = None
        self.pending: list[dict[str, Any]] = []
        self._obs: dict[str, np.ndarray] | None = None
        self._n = 0

    def _inner(self) -> Any:
        cur = getattr(self.env, "current", None)  # a models.scenarios.ScenarioMix: this episode's environment
        return cur if cur is not None else self.env

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        return obs, info

    def step(self, action: Any) -> Any:
        from models.warmstart import fork

        self._n += 1
        if self._obs is not None and self._n % self.every == 0:
            env = self._inner()
            r_exp = env.expected_rewards()
            valid = np.flatnonzero(np.isfinite(r_exp))
            if valid.size >= 2:
                order = valid[np.argsort(-r_exp[valid], kind="stable")]
                acts = order[: self.k].tolist()
                if self.extra == "taken":
                    acts.append(int(action))
                elif self.extra == "policy" and self.act is not None:
                    acts.append(int(self.act(self._obs)))
                acts = list(dict.fromkeys(acts))
                nxt, rew, done = [], [], []
                for a in acts:
                    sim = fork(env)
                    o2, r, term, trunc, _ = sim.step(int(a))
                    g, disc = float(r), self.gamma
                    for _ in range(self.horizon - 1):
                        if term or trunc:
                            break
                        nxt_a = self.act(o2) if self.act is not None and self.continuation == "policy" \
                            else int(np.argmax(sim.expected_rewards()))
                        o2, r, term, trunc, _ = sim.step(int(nxt_a))
                        g += disc * float(r)
                        disc *= self.gamma
                    nxt.append(o2)
                    rew.append(g)
                    # the discount of the bootstrap: 0 once the episode ended (a truncated one still has a future)
                    done.append(0.0 if term else disc)
                self.pending.append({"obs": {k: np.array(v, copy=True) for k, v in self._obs.items()},
                                     "actions": np.asarray(acts, np.int64), "rewards": np.asarray(rew, np.float32),
                                     "next": {k: np.stack([o[k] for o in nxt]) for k in nxt[0]},
                                     "discounts": np.asarray(done, np.float32)})
        obs, r, term, trunc, info = self.env.step(action)
        self._obs = obs
        return obs, r, term, trunc, info


def observation_mask(observation: np.ndarray | dict[str, np.ndarray], n_actions: int) -> np.ndarray:
    """The action mask of a Dict observation or of a :class:`FlatObservation` (its last columns)."""
    if isinstance(observation, dict):
        return np.asarray(observation["mask"])
    return np.asarray(observation)[..., -n_actions:]


class MaskedQNetwork(QNetwork):
    """``QNetwork`` whose head is a :class:`SharedScorer` over the offering rows."""

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Discrete,
                 features_extractor: BaseFeaturesExtractor, features_dim: int, net_arch: list[int] | None = None,
                 activation_fn: type[nn.Module] = nn.ReLU, normalize_images: bool = True, context_dim: int = 16,
                 prior: dict[str, float] | None = None, prior_scale: float = 1.0):
        super().__init__(observation_space, action_space, features_extractor, features_dim, net_arch=[],
                         activation_fn=activation_fn, normalize_images=normalize_images)
        self.net_arch = list(net_arch or [64, 64])
        self.context_dim = context_dim
        self.prior = dict(prior) if prior else None
        self.prior_scale = float(prior_scale)
        self.n_actions = int(action_space.n)
        # replaces the flat MLP of QNetwork
        self.q_net = SharedScorer(  # type: ignore[assignment]
            self.net_arch, context_dim, RewardPrior(**prior) if prior else None, prior_scale)

    def split(self, flat: th.Tensor) -> tuple[th.Tensor, th.Tensor, th.Tensor]:
        n, nf = self.n_actions, N_OFFERING_FEATURES
        rows = flat[:, : n * nf].reshape(-1, n, nf)
        request = flat[:, n * nf: n * nf + N_REQUEST_FEATURES]
        mask = flat[:, n * nf + N_REQUEST_FEATURES:]
        return rows, request, mask

    def forward(self, obs: PyTorchObs) -> th.Tensor:
        return self.q_net(*self.split(self.extract_features(obs, self.features_extractor)))

    def _get_constructor_parameters(self) -> dict[str, Any]:
        data = super()._get_constructor_parameters()
        data.update(context_dim=self.context_dim, prior=self.prior, prior_scale=self.prior_scale)
        return data


class SharedScorerDQNPolicy(DQNPolicy):
    """``DQNPolicy`` building :class:`MaskedQNetwork` (``policy_kwargs``: ``net_arch``, ``context_dim``,
    ``prior`` — the fields of :class:`models.policy.RewardPrior` as a dict, or None)."""

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Discrete, lr_schedule: Any,
                 net_arch: list[int] | None = None, context_dim: int = 16, prior: dict[str, float] | None = None,
                 prior_scale: float = 1.0, **kwargs: Any):
        self.context_dim = context_dim
        self.prior = prior
        self.prior_scale = prior_scale
        # the Dict observation is concatenated by OfferingRowsExtractor; a FlatObservation already is
        kwargs.setdefault("features_extractor_class",
                          OfferingRowsExtractor if isinstance(observation_space, spaces.Dict) else FlattenExtractor)
        super().__init__(observation_space, action_space, lr_schedule, net_arch=net_arch, **kwargs)

    def make_q_net(self) -> MaskedQNetwork:
        net_args = self._update_features_extractor(self.net_args, features_extractor=None)
        return MaskedQNetwork(**net_args, context_dim=self.context_dim, prior=self.prior,
                              prior_scale=self.prior_scale).to(self.device)

    def _get_constructor_parameters(self) -> dict[str, Any]:
        data = super()._get_constructor_parameters()
        data.update(context_dim=self.context_dim, prior=self.prior, prior_scale=self.prior_scale)
        return data


def random_valid_actions(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One uniformly drawn valid action per row of ``mask`` (B, N); 0 where nothing is valid."""
    mask = np.atleast_2d(mask) > 0.5
    out = np.zeros(mask.shape[0], dtype=np.int64)
    for k, m in enumerate(mask):
        valid = np.flatnonzero(m)
        if valid.size:
            out[k] = valid[rng.integers(valid.size)]
    return out


def top_k_valid_actions(q: np.ndarray, mask: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """One action per row of ``q`` (B, N), uniformly among the ``k`` valid actions with the highest
    Q-values (fewer when fewer are valid); 0 where nothing is valid."""
    q, mask = np.atleast_2d(q), np.atleast_2d(mask) > 0.5
    out = np.zeros(q.shape[0], dtype=np.int64)
    for i in range(q.shape[0]):
        valid = np.flatnonzero(mask[i])
        if valid.size:
            best = valid[np.argsort(-q[i, valid], kind="stable")[:k]]
            out[i] = best[rng.integers(best.size)]
    return out


def _pad_rows(v: np.ndarray, n: int) -> np.ndarray:
    """``v`` with its first row repeated up to ``n`` rows (the padding siblings, weight 0)."""
    return v if len(v) >= n else np.concatenate([v, np.repeat(v[:1], n - len(v), axis=0)])


class MaskedDQN(DQN):
    """``DQN`` whose epsilon-greedy exploration (and warm-up) draws only valid actions, from a
    generator seeded with ``seed`` (not the global numpy RNG), with the knobs of the fine-tuning
    ablations (``models.config.DQNConfig``; the defaults are SB3's DQN):

    * ``loss``: ``"huber"`` (SB3's smooth L1) or ``"mse"``;
    * ``reward_scale``: rewards times this in the TD target (build the policy with ``prior_scale``
      equal to it, so the prior is on the same scale);
    * ``exploration``: ``"uniform"`` over the valid offerings, or ``"top_k"``: uniform over the
      ``exploration_top_k`` best valid ones by the current Q-values;
    * ``warmup``: the first ``learning_starts`` steps fill the buffer with ``"random"`` valid
      offerings (SB3's warm-up), or with the ``"policy"``'s epsilon-greedy choices (the warm start's:
      n-step returns over a window of random actions are the random policy's, not the policy's);
    * ``demo`` (a ``models.warmstart.RolloutData``) and ``demo_weight``: every update also fits
      ``Q(s,a) - Q(s,a_greedy)`` to the warm start's rollout advantages of ``demo_batch_size`` of
      its labelled states (the warm start's knowledge kept in the loss, DQfD-style);
    * ``siblings`` (a :class:`SiblingPlay` around the training env) and ``sibling_weight``: every
      update also fits the differences between the paired outcomes of the best offerings
      (:meth:`_sibling_loss`); ``sibling_gamma`` discounts within a sibling's rollout (None: ``gamma``)
      and ``sibling_bootstrap`` False drops its ``gamma ** h max Q_target`` tail (the target is then
      the truncated h-request return the warm start's labels are: no value compared across states);
    * ``td_weight``: the weight of SB3's own TD loss on the replayed transitions (1; 0 = learn from
      the paired siblings, and the demonstrations, alone).

    ``train`` is SB3's ``DQN.train`` with those added, and records beside ``train/loss`` what the
    ablations diagnose: ``train/q_mean``, ``train/td_abs`` (mean |TD error|), ``train/target_std``,
    ``train/action_gap`` (best minus second-best valid Q-value), ``train/demo_loss`` and ``train/sibling_loss``."""

    def __init__(self, *args: Any, loss: str = "huber", reward_scale: float = 1.0, exploration: str = "uniform",
                 exploration_top_k: int = 3, demo: Any = None, demo_weight: float = 0.0, demo_batch_size: int = 64,
                 warmup: str = "random", siblings: SiblingPlay | None = None, sibling_weight: float = 1.0,
                 sibling_batch_size: int = 32, sibling_buffer: int = 5_000, td_weight: float = 1.0,
                 sibling_gamma: float | None = None, sibling_bootstrap: bool = True, **kwargs: Any):
        if loss not in ("huber", "mse") or exploration not in ("uniform", "top_k") or warmup not in ("random", "policy"):
            raise ValueError(f"loss {loss!r} / exploration {exploration!r} / warmup {warmup!r}")
        self.warmup = warmup
        self.loss_kind, self.reward_scale = loss, float(reward_scale)
        self.exploration_kind, self.exploration_top_k = exploration, int(exploration_top_k)
        self.demo, self.demo_weight, self.demo_batch_size = demo, float(demo_weight), int(demo_batch_size)
        self._demo_t: tuple[th.Tensor, ...] | None = None
        self.siblings, self.sibling_weight, self.td_weight = siblings, float(sibling_weight), float(td_weight)
        self.sibling_batch_size = int(sibling_batch_size)
        self.sibling_gamma, self.sibling_bootstrap = sibling_gamma, bool(sibling_bootstrap)
        self.sibling_groups: deque[dict[str, Any]] = deque(maxlen=int(sibling_buffer))
        super().__init__(*args, **kwargs)
        self.explore_rng = np.random.default_rng(self.seed)
        if self.siblings is not None:  # its later requests are routed by the policy being learned
            self.siblings.gamma = float(self.gamma if self.sibling_gamma is None else self.sibling_gamma)
            self.siblings.act = self._greedy_action
        self.demo_rng = np.random.default_rng(None if self.seed is None else self.seed + 1)

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "demo", "_demo_t", "siblings", "sibling_groups"]

    def _explore(self, observation: np.ndarray | dict[str, np.ndarray]) -> np.ndarray:
        mask = observation_mask(observation, int(self.action_space.n))  # type: ignore[attr-defined]
        if self.exploration_kind == "top_k":
            with th.no_grad():
                obs_t, _ = self.policy.obs_to_tensor(observation)
                q = self.q_net(obs_t).cpu().numpy()
            return top_k_valid_actions(q, mask, self.exploration_top_k, self.explore_rng)
        return random_valid_actions(mask, self.explore_rng)

    def predict(self, observation: np.ndarray | dict[str, np.ndarray], state: tuple[np.ndarray, ...] | None = None,
                episode_start: np.ndarray | None = None, deterministic: bool = False,
                ) -> tuple[np.ndarray, tuple[np.ndarray, ...] | None]:
        if not deterministic and self.explore_rng.random() < self.exploration_rate:
            actions = self._explore(observation)
            batched = np.asarray(observation_mask(observation, int(self.action_space.n))).ndim > 1  # type: ignore[attr-defined]
            return (actions if batched else actions[0]), state
        return self.policy.predict(observation, state, episode_start, deterministic)

    def _sample_action(self, learning_starts: int, action_noise: Any = None, n_envs: int = 1,
                       ) -> tuple[np.ndarray, np.ndarray]:
        if self.num_timesteps < learning_starts and self.warmup == "random":
            assert self._last_obs is not None
            mask = observation_mask(self._last_obs, int(self.action_space.n))  # type: ignore[attr-defined]
            actions = random_valid_actions(mask, self.explore_rng)
            return actions, actions
        # (with warmup "policy", SB3's own warm-up -- uniform over every action, valid or not -- is skipped)
        return super()._sample_action(0 if self.warmup == "policy" else learning_starts, action_noise, n_envs)

    def _demo_loss(self) -> th.Tensor:
        if self._demo_t is None:
            d = self.demo
            n = int(self.action_space.n)  # type: ignore[attr-defined]
            self._demo_t = (th.tensor(d.offerings).reshape(len(d), n, N_OFFERING_FEATURES), th.tensor(d.request),
                            th.tensor(d.mask), th.tensor(d.actions), th.tensor(d.advantage), th.tensor(d.weight))
        rows, req, mask, acts, adv, w = self._demo_t
        idx = th.as_tensor(self.demo_rng.integers(len(req), size=self.demo_batch_size))
        scorer: Any = self.q_net.q_net
        q = scorer(rows[idx], req[idx], mask[idx]).gather(1, acts[idx])
        diff = q - q[:, :1]  # column 0 is greedy's candidate (advantage 0)
        wi = w[idx]
        return (((diff - self.reward_scale * adv[idx]) ** 2) * wi).sum() / wi.sum().clamp(min=1.0)

    def _greedy_action(self, obs: dict[str, np.ndarray]) -> int:
        with th.no_grad():
            return int(self.q_net(self.policy.obs_to_tensor(obs)[0]).argmax(dim=1)[0])

    def _sibling_loss(self) -> th.Tensor | None:
        """The paired TD loss of :class:`SiblingPlay`'s groups: for ``sibling_batch_size`` groups
        drawn from the last ``sibling_buffer``, ``Q(s,a_i) - Q(s,a_0)`` against ``y_i - y_0``, with
        ``y = reward_scale * r + discount * max Q_target(s')`` as SB3's target, ``r`` the discounted
        sum of a sibling's ``horizon`` rewards and ``discount`` ``gamma ** horizon`` (0 once the
        episode ended, and always without ``sibling_bootstrap``); ``a_0`` is greedy's choice. The
        noise both share (the request, its service-time draws) cancels."""
        if self.siblings is None:
            return None
        self.sibling_groups.extend(self.siblings.pending)
        self.siblings.pending.clear()
        if len(self.sibling_groups) < self.sibling_batch_size:
            return None
        idx = self.demo_rng.integers(len(self.sibling_groups), size=self.sibling_batch_size)
        return self._sibling_batch_loss([self.sibling_groups[int(i)] for i in idx])

    def _sibling_batch_loss(self, groups: list[dict[str, Any]]) -> th.Tensor:
        kmax = max(len(g["actions"]) for g in groups)
        b = len(groups)
        acts = np.zeros((b, kmax), np.int64)
        rew = np.zeros((b, kmax), np.float32)
        dn = np.zeros((b, kmax), np.float32)
        w = np.zeros((b, kmax), np.float32)
        for i, g in enumerate(groups):
            n = len(g["actions"])
            acts[i, :n], rew[i, :n], dn[i, :n], w[i, :n] = g["actions"], g["rewards"], g["discounts"], 1.0
        obs = {k: th.as_tensor(np.stack([g["obs"][k] for g in groups])) for k in groups[0]["obs"]}
        with th.no_grad():
            y = self.reward_scale * th.as_tensor(rew)
            if self.sibling_bootstrap:  # (the states after the siblings: only the bootstrap reads them)
                nobs = {k: th.as_tensor(np.concatenate([_pad_rows(g["next"][k], kmax) for g in groups]))
                        for k in groups[0]["next"]}
                y = y + th.as_tensor(dn) * self.q_net_target(nobs).max(dim=1).values.reshape(b, kmax)
        q = self.q_net(obs).gather(1, th.as_tensor(acts))
        wt = th.as_tensor(w)
        err = (q - q[:, :1]) - (y - y[:, :1])
        return ((err ** 2) * wt).sum() / wt[:, 1:].sum().clamp(min=1.0)

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        """SB3 2.9's ``DQN.train`` (same sampling, target, clipping and counters) with the knobs and
        the recorded diagnostics of the class docstring."""
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        losses, q_mean, td_abs, t_std, gap, demo, sib = [], [], [], [], [], [], []
        for _ in range(gradient_steps):
            replay_data = self.replay_buffer.sample(batch_size, env=self._vec_normalize_env)  # type: ignore[union-attr]
            discounts = replay_data.discounts if replay_data.discounts is not None else self.gamma
            with th.no_grad():
                next_q = self.q_net_target(replay_data.next_observations).max(dim=1).values.reshape(-1, 1)
                target = self.reward_scale * replay_data.rewards + (1 - replay_data.dones) * discounts * next_q
            q_all = self.q_net(replay_data.observations)
            q = th.gather(q_all, dim=1, index=replay_data.actions.long())
            loss = tnf.smooth_l1_loss(q, target) if self.loss_kind == "huber" else tnf.mse_loss(q, target)
            loss = self.td_weight * loss
            if self.demo is not None and self.demo_weight > 0 and len(self.demo):
                d_loss = self._demo_loss()
                demo.append(float(d_loss.detach()))
                loss = loss + self.demo_weight * d_loss
            s_loss = self._sibling_loss() if self.sibling_weight > 0 else None
            if s_loss is not None:
                sib.append(float(s_loss.detach()))
                loss = loss + self.sibling_weight * s_loss
            losses.append(loss.item())
            with th.no_grad():
                q_mean.append(float(q.mean()))
                td_abs.append(float((q - target).abs().mean()))
                t_std.append(float(target.std()))
                top2 = q_all.topk(2, dim=1).values
                ok = top2[:, 1] > INVALID_Q / 2  # rows with two valid offerings
                if bool(ok.any()):
                    gap.append(float((top2[ok, 0] - top2[ok, 1]).mean()))
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", np.mean(losses))
        for key, vals in (("q_mean", q_mean), ("td_abs", td_abs), ("target_std", t_std), ("action_gap", gap),
                          ("demo_loss", demo), ("sibling_loss", sib)):
            if vals:
                self.logger.record(f"train/{key}", float(np.mean(vals)))


def export_router(q_net: MaskedQNetwork, meta: dict[str, Any] | None = None) -> RouterWeights:
    """The numpy copy of a trained Q-network's scorer."""
    scorer: Any = q_net.q_net

    def wb(lin: nn.Linear) -> tuple[np.ndarray, np.ndarray]:
        return (lin.weight.detach().cpu().numpy().T.astype(np.float32).copy(),
                lin.bias.detach().cpu().numpy().astype(np.float32).copy())

    layers = [wb(m) for m in scorer.mlp if isinstance(m, nn.Linear)]
    scale = float(getattr(scorer, "prior_scale", 1.0))
    if scale != 1.0:  # trained at a reward scale: the correction back in reward units, beside the prior's
        w, b = layers[-1]
        layers[-1] = ((w / scale).astype(np.float32), (b / scale).astype(np.float32))
    ctx = wb(scorer.ctx) if scorer.ctx is not None else None
    return RouterWeights(layers=layers, ctx=ctx, prior=scorer.prior, meta={"hidden": q_net.net_arch, **(meta or {})})
