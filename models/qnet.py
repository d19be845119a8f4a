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

from itertools import pairwise
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3 import DQN
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from stable_baselines3.common.type_aliases import PyTorchObs
from stable_baselines3.dqn.policies import DQNPolicy, QNetwork
from torch import nn

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

    def __init__(self, hidden: list[int], context_dim: int = 16, prior: RewardPrior | None = None):
        super().__init__()
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
        return s if self.prior is None else s + self.prior_scores(rows, request)

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


class MaskedQNetwork(QNetwork):
    """``QNetwork`` whose head is a :class:`SharedScorer` over the offering rows."""

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Discrete,
                 features_extractor: BaseFeaturesExtractor, features_dim: int, net_arch: list[int] | None = None,
                 activation_fn: type[nn.Module] = nn.ReLU, normalize_images: bool = True, context_dim: int = 16,
                 prior: dict[str, float] | None = None):
        super().__init__(observation_space, action_space, features_extractor, features_dim, net_arch=[],
                         activation_fn=activation_fn, normalize_images=normalize_images)
        self.net_arch = list(net_arch or [64, 64])
        self.context_dim = context_dim
        self.prior = dict(prior) if prior else None
        self.n_actions = int(action_space.n)
        # replaces the flat MLP of QNetwork
        self.q_net = SharedScorer(  # type: ignore[assignment]
            self.net_arch, context_dim, RewardPrior(**prior) if prior else None)

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
        data.update(context_dim=self.context_dim, prior=self.prior)
        return data


class SharedScorerDQNPolicy(DQNPolicy):
    """``DQNPolicy`` building :class:`MaskedQNetwork` (``policy_kwargs``: ``net_arch``, ``context_dim``,
    ``prior`` — the fields of :class:`models.policy.RewardPrior` as a dict, or None)."""

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Discrete, lr_schedule: Any,
                 net_arch: list[int] | None = None, context_dim: int = 16, prior: dict[str, float] | None = None,
                 **kwargs: Any):
        self.context_dim = context_dim
        self.prior = prior
        kwargs.setdefault("features_extractor_class", OfferingRowsExtractor)
        super().__init__(observation_space, action_space, lr_schedule, net_arch=net_arch, **kwargs)

    def make_q_net(self) -> MaskedQNetwork:
        net_args = self._update_features_extractor(self.net_args, features_extractor=None)
        return MaskedQNetwork(**net_args, context_dim=self.context_dim, prior=self.prior).to(self.device)

    def _get_constructor_parameters(self) -> dict[str, Any]:
        data = super()._get_constructor_parameters()
        data.update(context_dim=self.context_dim, prior=self.prior)
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


class MaskedDQN(DQN):
    """``DQN`` whose epsilon-greedy exploration (and warm-up) draws only valid actions, from a
    generator seeded with ``seed`` (not the global numpy RNG)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.explore_rng = np.random.default_rng(self.seed)

    def predict(self, observation: np.ndarray | dict[str, np.ndarray], state: tuple[np.ndarray, ...] | None = None,
                episode_start: np.ndarray | None = None, deterministic: bool = False,
                ) -> tuple[np.ndarray, tuple[np.ndarray, ...] | None]:
        if not deterministic and self.explore_rng.random() < self.exploration_rate:
            assert isinstance(observation, dict), "MaskedDQN needs the Dict observation (it carries the mask)"
            mask = np.asarray(observation["mask"])
            actions = random_valid_actions(mask, self.explore_rng)
            return (actions if mask.ndim > 1 else actions[0]), state
        return self.policy.predict(observation, state, episode_start, deterministic)

    def _sample_action(self, learning_starts: int, action_noise: Any = None, n_envs: int = 1,
                       ) -> tuple[np.ndarray, np.ndarray]:
        if self.num_timesteps < learning_starts:
            assert isinstance(self._last_obs, dict)
            actions = random_valid_actions(self._last_obs["mask"], self.explore_rng)
            return actions, actions
        return super()._sample_action(learning_starts, action_noise, n_envs)


def export_router(q_net: MaskedQNetwork, meta: dict[str, Any] | None = None) -> RouterWeights:
    """The numpy copy of a trained Q-network's scorer."""
    scorer: Any = q_net.q_net

    def wb(lin: nn.Linear) -> tuple[np.ndarray, np.ndarray]:
        return (lin.weight.detach().cpu().numpy().T.astype(np.float32).copy(),
                lin.bias.detach().cpu().numpy().astype(np.float32).copy())

    layers = [wb(m) for m in scorer.mlp if isinstance(m, nn.Linear)]
    ctx = wb(scorer.ctx) if scorer.ctx is not None else None
    return RouterWeights(layers=layers, ctx=ctx, prior=scorer.prior, meta={"hidden": q_net.net_arch, **(meta or {})})
