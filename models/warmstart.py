"""Warm start of the Q-network before DQN: one step of rollout policy improvement over greedy.

Greedy (``models.baselines.Greedy``) maximizes the one-step expected reward; what it ignores is
that a request occupies a slot and slows its replica for the next requests. The replay simulator
can measure that: from a state ``s`` visited on the train window, each candidate offering ``a``
(the best few by expected reward plus a few random valid ones) is played on a fork of the
environment, followed by ``horizon`` requests routed by greedy. Forks share the request stream and
the service-time noise (common random numbers), so ``G(s,a) - G(s,greedy)`` isolates the effect
of the choice. The Q-network is then fitted by regression to

    y(s, a) = prior(s, a_greedy) + level + G(s, a) - G(s, a_greedy)

(``level`` = ``gamma/(1-gamma)`` x the mean reward, the scale DQN's targets will have), so DQN
starts from a policy that already prices the load it causes. Only the train window is used, and
only the observation is the network's input; the rollouts are training-time labels.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.features import N_OFFERING_FEATURES

#: env attributes that never change after construction: shared by forks instead of copied
_SHARED = ("bundle", "replay", "catalog", "serving", "cfg", "ref", "observation_space", "action_space", "spec",
           "placement", "capacity", "policies", "models_cfg", "inventory")
#: env attributes holding an object a step changes in place: a fork gets ``v.copy()`` (the tenants'
#: budgets, ``envs.budget.BudgetBook``; the current request's policy outcome buffers; the admission queue
#: and fairness counters, ``envs.admission.WorldQueue``)
_COPIED = ("budget", "_pol", "admission")
#: values a fork may share as they are: immutable, or (tuples) of read-only arrays
_PLAIN = (type(None), bool, int, float, complex, str, bytes, tuple, frozenset, range, np.generic)


def fork(env: Any) -> Any:
    """An independent copy of ``env`` in its current state, for playing out alternatives.

    The telemetry, the config and the per-request arrays of the whole stream are read-only and
    shared; every other container is copied (numpy arrays and deques shallowly: their elements
    are numbers), and the state objects of ``_COPIED`` with their own ``copy()``, so stepping the
    fork leaves ``env`` untouched (``tests/test_agent.py`` checks this against a full deep copy,
    with tenant budgets binding). Any other object is refused (``TypeError``): an attribute the
    environment gains must be declared shared or copied here, not shared by accident -- the tenants'
    budget book once was, and every candidate's rollout spent the budget of the state's other
    candidates and of the episode itself (docs/results.md, issue 26)."""
    sim = copy.copy(env)
    n_req = getattr(env, "n_requests", -1)
    for k, v in vars(env).items():
        if k in _SHARED or isinstance(v, _PLAIN):
            continue
        if k in _COPIED:
            setattr(sim, k, v.copy())
        elif isinstance(v, np.ndarray):
            if v.ndim and v.shape[0] == n_req:
                continue  # per-request column of the stream: never written after construction
            setattr(sim, k, v.copy())
        elif isinstance(v, (list, dict, set, deque)):
            setattr(sim, k, copy.copy(v))
        elif isinstance(v, np.random.Generator):
            setattr(sim, k, copy.deepcopy(v))
        else:
            raise TypeError(f"fork: the environment's attribute {k!r} ({type(v).__name__}) is neither known "
                            "read-only nor copied; declare it in models.warmstart._SHARED or _COPIED")
    for e in (env, sim):  # what the two still share (the servers' prefix caches) is copied before a write
        unshare = getattr(e, "unshare", None)
        if unshare is not None:
            unshare()
    return sim


def _greedy(env: Any) -> int:
    return int(np.argmax(env.expected_rewards()))


@dataclass
class RolloutData:
    """Targets for ``S`` states with ``K`` candidate actions each (``weight`` 0 = padding)."""

    offerings: np.ndarray  # (S, N*F) float32
    request: np.ndarray  # (S, R) float32
    mask: np.ndarray  # (S, N) float32
    actions: np.ndarray  # (S, K) int64
    advantage: np.ndarray  # (S, K) float32: G(s,a) - G(s,greedy)
    weight: np.ndarray  # (S, K) float32
    greedy_reward: np.ndarray  # (S,) realized one-step reward of greedy's action
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.request)

    @classmethod
    def concat(cls, parts: list[RolloutData]) -> RolloutData:
        names = ("offerings", "request", "mask", "actions", "advantage", "weight", "greedy_reward")
        arrays = {k: np.concatenate([getattr(p, k) for p in parts]) for k in names}
        return cls(**arrays, seconds=sum(p.seconds for p in parts))


def collect(pick_env: Any, n_states: int, horizon: int, top_k: int, n_random: int, stride: int,
            behaviour_epsilon: float, rng: np.random.Generator,
            progress: Callable[[int], None] | None = None) -> RolloutData:
    """Visit states (episodes, epsilon-greedy) and label ``n_states`` of them. ``pick_env(rng)``
    gives each episode's environment (``models.scenarios.ScenarioMix.pick``); an environment
    itself stands for one that gives always it."""
    t0 = time.perf_counter()
    if not callable(pick_env):
        one = pick_env

        def pick_env(_rng: np.random.Generator) -> Any:
            return one

    env = pick_env(rng)
    k_max = top_k + n_random
    n_act = env.action_space.n
    off = np.zeros((n_states, n_act * N_OFFERING_FEATURES), np.float32)
    req = np.zeros((n_states, env.observation_space["request"].shape[0]), np.float32)
    msk = np.zeros((n_states, n_act), np.float32)
    acts = np.zeros((n_states, k_max), np.int64)
    adv = np.zeros((n_states, k_max), np.float32)
    wts = np.zeros((n_states, k_max), np.float32)
    g_rew = np.zeros(n_states, np.float32)
    s = 0
    obs, info = env.reset(seed=int(rng.integers(2**31)))
    since = stride
    while s < n_states:
        remaining = env._end - env._pos
        if since >= stride and remaining > horizon + 1 and info["action_mask"].any():
            since = 0
            r_exp = env.expected_rewards()
            valid = np.flatnonzero(np.isfinite(r_exp))
            order = valid[np.argsort(-r_exp[valid], kind="stable")]
            cands = list(order[:top_k])
            rest = order[top_k:]
            if rest.size and n_random:
                cands += list(rng.choice(rest, size=min(n_random, rest.size), replace=False))
            returns = []
            first = []
            for a in cands:
                sim = fork(env)
                _, r, _, done, _ = sim.step(int(a))
                g = r
                first.append(r)
                for _ in range(horizon):
                    if done:
                        break
                    _, r, _, done, _ = sim.step(_greedy(sim))
                    g += r
                returns.append(g)
            k = len(cands)
            acts[s, :k] = cands
            adv[s, :k] = np.asarray(returns) - returns[0]
            wts[s, :k] = 1.0
            off[s], req[s], msk[s] = obs["offerings"], obs["request"], obs["mask"]
            g_rew[s] = first[0]
            s += 1
            if progress is not None:
                progress(s)
        a = _greedy(env)
        if rng.random() < behaviour_epsilon:
            valid = np.flatnonzero(info["action_mask"])
            if valid.size:
                a = int(rng.choice(valid))
        obs, _, _, done, info = env.step(a)
        since += 1
        if done:
            env = pick_env(rng)
            obs, info = env.reset(seed=int(rng.integers(2**31)))
            since = stride
    return RolloutData(off, req, msk, acts, adv, wts, g_rew, time.perf_counter() - t0)


@dataclass
class FitReport:
    """What the warm-start fit did: the training loss of each epoch, and on the held-out states the
    loss and the *realized advantage of the candidate the network would pick* (its mean over the
    states: 0 for the prior's pick, greedy's) before training (index 0) and after each epoch. The
    network kept is the one of ``best_epoch`` (0: the prior alone, i.e. greedy)."""

    train_loss: list[float]
    hold_loss: list[float]
    hold_gain: list[float]
    best_epoch: int
    hold_states: int
    #: the selection measure (``select``'s value) at each epoch, 0 = the untrained prior
    selection: list[float]


def fit(q_net: Any, data: RolloutData, level: float, epochs: int, batch_size: int, learning_rate: float,
        seed: int, holdout: float = 0.2, select: Callable[[], float] | None = None) -> FitReport:
    """Regress ``q_net`` (a ``models.qnet.MaskedQNetwork``) onto the rollout targets, keeping the
    epoch that decides best.

    The labels are realized returns: with decision-time features only, two states that look alike
    can have very different outcomes (the output length is unknown), so the regression overfits
    noise within a few epochs -- measured: 20 epochs on 3,000 states made the policy 11 % worse
    than greedy on validation, 5 epochs 0.3 % better. And a one-step improvement labelled around
    greedy's trajectories says little once the network deviates from greedy everywhere: the
    held-out states' realized advantage of the network's pick (kept in the report, share
    ``holdout``) stayed within noise while the policy lost 5 % on validation. So the epoch is chosen
    by ``select`` -- the mean reward of the network as a policy on the selection window -- after
    each epoch and before the first (the prior alone: greedy); without ``select``, by the held-out
    advantage."""
    import torch as th

    gen = th.Generator().manual_seed(seed)
    scorer = q_net.q_net
    opt = th.optim.Adam(scorer.parameters(), lr=learning_rate)
    n_act = q_net.n_actions
    # copies: arrays shared through Ray's object store are read-only
    rows = th.tensor(data.offerings).reshape(len(data), n_act, N_OFFERING_FEATURES)
    req, mask = th.tensor(data.request), th.tensor(data.mask)
    acts, adv, wts = th.tensor(data.actions), th.tensor(data.advantage), th.tensor(data.weight)
    with th.no_grad():
        base = scorer.prior_scores(rows, req).gather(1, acts[:, :1]) if scorer.prior is not None else \
            th.tensor(data.greedy_reward)[:, None]
    # a network trained at a reward scale (``SharedScorer.prior_scale``) is fitted on that scale
    target = float(getattr(scorer, "prior_scale", 1.0)) * (base + level + adv)
    if not (th.isfinite(rows).all() and th.isfinite(req).all() and th.isfinite(target).all()):
        # one NaN feature (even of a masked row: the context's masked mean sums them) makes every score NaN
        raise ValueError("warm start: the labelled states hold non-finite features or targets; every observation "
                         "must be finite (envs.features bounds)")
    order = th.randperm(len(data), generator=gen)
    n_hold = round(holdout * len(data)) if len(data) >= 10 else 0
    hold, train = order[:n_hold], order[n_hold:]
    with th.no_grad():  # start the output at the targets' level, so the fit spends itself on the differences
        last = [m for m in scorer.mlp if isinstance(m, th.nn.Linear)][-1]
        last.bias.add_(float((target[train] - scorer(rows[train], req[train], mask[train]).gather(1, acts[train]))
                             [wts[train] > 0].mean()))

    def held_out() -> tuple[float, float]:
        if n_hold == 0:
            return float("nan"), 0.0
        with th.no_grad():
            q = scorer(rows[hold], req[hold], mask[hold]).gather(1, acts[hold])
            w = wts[hold]
            loss = float(((q - target[hold]) ** 2 * w).sum() / w.sum().clamp(min=1.0))
            pick = th.where(w > 0, q, th.full_like(q, -th.inf)).argmax(dim=1, keepdim=True)
            return loss, float(adv[hold].gather(1, pick).mean())

    def measure() -> tuple[float, float, float]:
        loss, gain = held_out()
        return loss, gain, (select() if select is not None else gain)

    hl, hg, sel = measure()
    report = FitReport([], [hl], [hg], 0, n_hold, [sel])
    best_state = {k: v.clone() for k, v in scorer.state_dict().items()}
    best_sel = sel
    for epoch in range(1, epochs + 1):
        perm = train[th.randperm(len(train), generator=gen)]
        total = 0.0
        for i in range(0, len(perm), batch_size):
            idx = perm[i: i + batch_size]
            q = scorer(rows[idx], req[idx], mask[idx]).gather(1, acts[idx])
            w = wts[idx]
            loss = ((q - target[idx]) ** 2 * w).sum() / w.sum().clamp(min=1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        report.train_loss.append(total / max(len(perm), 1))
        hl, hg, sel = measure()
        report.hold_loss.append(hl)
        report.hold_gain.append(hg)
        report.selection.append(sel)
        if (n_hold == 0 and select is None) or sel > best_sel:
            best_sel, report.best_epoch = sel, epoch
            best_state = {k: v.clone() for k, v in scorer.state_dict().items()}
    scorer.load_state_dict(best_state)
    return report
