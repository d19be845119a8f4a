"""Non-learned routing policies a user would otherwise pick, and a hindsight oracle.

Every policy but the oracle decides on what a router knows when it decides: the observation and
``info["action_mask"]`` (features from the router's view of the pools, the telemetry so far, and
the output length estimated from past completions), and ``greedy`` the environment's
``expected_rewards`` -- ``envs.kernels.expected_reward`` over the same expectations.
``tests/test_no_foresight.py`` proves that changing the realized outcome of the current and later
requests changes none of their decisions. Only the oracle and its hindsight plans read
``exact_rewards``, which knows the future, and say so. Policies never pick a masked offering when a
valid one exists, except ``static``, which pins one (and fails when its pool cannot take a request).

Routing policies (``docs/policies.md``): the action mask already excludes what a deny or an allow
excludes, and ``info["policy_bias"]`` (present when a prefer policy applies) holds each offering's
prefer weight in reward units, which every baseline adds to its own score: greedy's expected
reward; ``-cost_weight x cost_norm`` for cheapest, ``-latency_weight x latency_norm`` for
lowest-latency (the reward's own terms, so a weight trades against them on the reward's scale);
``-busy share`` for least-loaded; the hindsight plans' realized reward. Policies without a score
(round-robin, random) choose among the valid offerings with the highest weight. ``static``, when a
policy excludes its offering, routes as cheapest does (its pinned deployment is forbidden there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from envs.cloud_route import CloudRouteEnv
from envs.features import F, R, offering_matrix
from models.policy import greedy_choice
from xroute.config import EvaluateConfig
from xroute.errors import ConfigError

Obs = dict[str, np.ndarray]


class Policy(Protocol):
    name: str

    def reset(self, env: CloudRouteEnv, seed: int) -> None: ...

    def act(self, obs: Obs, info: dict[str, Any]) -> int: ...


def policy_bias(info: dict[str, Any], n: int) -> np.ndarray | None:
    """The prefer policies' weight of each of the ``n`` offerings (``info["policy_bias"]``), or
    None when no prefer policy applies to the request."""
    b = info.get("policy_bias")
    return None if b is None else np.asarray(b)[:n]


def top_bias(mask: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``mask`` narrowed to the valid offerings with the highest prefer weight (for policies
    without a score); ``mask`` itself without a bias or with nothing valid."""
    if bias is None or not mask.any():
        return mask
    return mask & (bias >= bias[mask].max())


def _masked_argmin(values: np.ndarray, mask: np.ndarray, tiebreak: np.ndarray | None = None) -> int:
    n = len(values)
    m = mask[:n]
    if not m.any():
        return 0
    v = np.where(m, values, np.inf)
    if tiebreak is None:
        return int(np.argmin(v))
    return int(np.lexsort((np.where(m, tiebreak[:n], np.inf), v))[0])


class _Base:
    name = "base"

    def reset(self, env: CloudRouteEnv, seed: int) -> None:
        self.env = env
        self.n = env.n


class Static(_Base):
    """Everything to one offering (a team's single deployment)."""

    def __init__(self, offering_id: str | None = None, location: str = "", accelerator: str = ""):
        self.offering_id, self.location, self.accelerator = offering_id, location, accelerator
        self.name = f"static:{offering_id}" if offering_id else "static"

    def reset(self, env: CloudRouteEnv, seed: int) -> None:
        super().reset(env, seed)
        if self.offering_id:
            try:
                self.idx = env.offering_index(self.offering_id)
            except KeyError:
                import difflib

                ids = [o.offering_id for o in env.catalog]
                close = difflib.get_close_matches(self.offering_id, ids, n=3, cutoff=0.5)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"policy 'static:{self.offering_id}': no such offering_id in the bundle{hint}; the "
                                  f"ids are in {env.bundle.path}/offerings.csv (column offering_id) and "
                                  "GET /v1/offerings") from None
            return
        found = [k for k, o in enumerate(env.catalog)
                 if o.location == self.location and o.accelerator == self.accelerator and not o.is_spot]
        if not found:
            raise ConfigError(
                f"policy 'static': the bundle has no on-demand {self.accelerator} offering in {self.location}; "
                "name one with static:OFFERING_ID")
        # the cheapest such instance (the smallest one, typically)
        self.idx = min(found, key=lambda k: float(env.price_s[k]))

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        env = self.env
        if env.policies is not None and not env.r_allowed[self.idx]:  # a policy forbids the deployment here
            return Cheapest.choose(env.n, obs, info, env.cfg.reward.cost_weight)
        return self.idx


class Cheapest(_Base):
    """Cheapest offering more likely than not to meet the SLO (SkyPilot-optimizer style); the
    cheapest valid one if none is."""

    name = "cheapest"

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        bias = policy_bias(info, self.n)  # (present only in an environment: self.env is set then)
        return self.choose(self.n, obs, info, self.env.cfg.reward.cost_weight if bias is not None else 1.0)

    @staticmethod
    def choose(n: int, obs: Obs, info: dict[str, Any], cost_weight: float) -> int:
        """Cheapest's choice among the first ``n`` offerings; with a prefer bias, by
        ``cost_weight x cost_norm - bias``."""
        m = info["action_mask"]
        x = offering_matrix(obs)
        feasible = m[:n] & (x[:n, F["exp_violation"]] < 0.5)
        use = feasible if feasible.any() else m[:n]
        cost = x[:n, F["exp_cost"]]
        bias = policy_bias(info, n)
        if bias is not None:
            cost = cost_weight * cost.astype(np.float64) - bias
        return _masked_argmin(cost, use, x[:n, F["exp_latency"]])


class LowestLatency(_Base):
    """Lowest expected latency (LiteLLM latency-based routing style), cheaper on ties."""

    name = "lowest-latency"

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        x = offering_matrix(obs)
        lat = x[: self.n, F["exp_latency"]]
        bias = policy_bias(info, self.n)
        if bias is not None:
            lat = self.env.cfg.reward.latency_weight * lat.astype(np.float64) - bias
        return _masked_argmin(lat, info["action_mask"], x[: self.n, F["exp_cost"]])


class LeastLoaded(_Base):
    """Lowest busy-slot fraction; lower expected latency on ties."""

    name = "least-loaded"

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        x = offering_matrix(obs)
        busy = x[: self.n, F["busy"]]
        bias = policy_bias(info, self.n)
        if bias is not None:
            busy = busy.astype(np.float64) - bias
        return _masked_argmin(busy, info["action_mask"], x[: self.n, F["exp_latency"]])


class Greedy(_Base):
    """One-step best expected reward (``envs.kernels.expected_reward``): expected cost and latency
    with the output length estimated from past completions, the probability of missing the SLO
    under service-time noise, and the spot-preemption risk estimated from the availability history
    (and the time a preemption goes unseen by the telemetry)."""

    name = "greedy"

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        return greedy_choice(self.env.expected_rewards(), policy_bias(info, self.n))


class CacheAware(_Base):
    """Prefix match + load + cost, in the spirit of the in-cluster scorers (the Gateway API
    inference extension / llm-d endpoint picker's prefix-cache, queue and cost scorers; SGLang's
    cache-aware router): among the offerings more likely than not to meet the SLO (every valid one
    when none is), the best ``prefix_weight x exp_cached - load_weight x busy - cost_weight x
    exp_cost`` -- the expected share of the prompt cached there (the router's view), the busy share
    of its slots, the expected cost / the request's reference cost. Weights from
    ``EvaluateConfig.cache_aware`` (tuned on training windows only). Without prefix information it
    is a load and cost scorer."""

    name = "cache-aware"

    def __init__(self, prefix_weight: float = 1.0, load_weight: float = 0.3, cost_weight: float = 2.0):
        self.w = (float(prefix_weight), float(load_weight), float(cost_weight))

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        x = offering_matrix(obs)[: self.n]
        m = info["action_mask"][: self.n]
        feasible = m & (x[:, F["exp_violation"]] < 0.5)
        use = feasible if feasible.any() else m
        wp, wl, wc = self.w
        score = wp * x[:, F["exp_cached"]] - wl * x[:, F["busy"]] - wc * x[:, F["exp_cost"]]
        bias = policy_bias(info, self.n)  # (prefer policies, a de-prioritized region: as greedy)
        if bias is not None:
            score = score + bias
        return _masked_argmin(-score, use, x[:, F["exp_latency"]])


class SessionSticky(_Base):
    """Session affinity as a soft preference: a request goes to the offering its session's previous
    request went to (``session_here``: the router's own record) while that offering is valid and
    its expected reward (``envs.kernels.expected_reward``) is within ``margin`` of the best; any
    other request, and one whose session's offering is masked or too far behind, gets greedy's
    choice. ``margin`` from ``EvaluateConfig.session_sticky`` (tuned on training windows only)."""

    name = "session-sticky"

    def __init__(self, margin: float = 0.005):
        self.margin = float(margin)

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        r = self.env.expected_rewards()
        bias = policy_bias(info, self.n)  # (prefer policies, a de-prioritized region: as greedy)
        if bias is not None:
            r = r + bias
        best = int(np.argmax(r))
        here = np.flatnonzero(offering_matrix(obs)[: self.n, F["session_here"]] > 0.5)
        if here.size:
            s = int(here[0])
            if info["action_mask"][s] and r[s] >= r[best] - self.margin:
                return s
        return best


class BudgetPacing(_Base):
    """Greedy with its tenant's budget paced over the period (``envs.budget``): each offering's
    expected reward less ``lambda`` times its weighted expected cost, ``lambda = gain x max(0,
    period_left - budget_left) / max(budget_left, 0.05)`` -- zero while the USD left is at least
    the share of the period left (on pace: greedy itself), growing as spending runs ahead of it, so
    cheaper offerings win before the budget runs out rather than requests being refused after.
    Reads only the request's budget features (decision-time state). ``gain``: tuned on the training
    windows (``EvaluateConfig.pacing_gain``; ``tools/tune_pacing.py``)."""

    name = "budget-pacing"

    def __init__(self, gain: float = 1.0):
        self.gain = gain

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        env = self.env
        r = env.expected_rewards()
        bias = policy_bias(info, self.n)  # (prefer policies, a de-prioritized region: as greedy)
        if bias is not None:
            r = r + bias
        req = obs["request"]
        left, period = float(req[R["budget_left"]]), float(req[R["period_left"]])
        behind = period - left
        if behind <= 0.0 or self.gain <= 0.0:
            return int(np.argmax(r))
        lam = self.gain * behind / max(left, 0.05)
        rw = env.cfg.reward
        cost_n = np.minimum(env.c_cost / max(env.r_ref_cost, 1e-12), rw.cost_norm_cap)
        return int(np.argmax(r - lam * rw.cost_weight * cost_n))


class RoundRobin(_Base):
    name = "round-robin"

    def reset(self, env: CloudRouteEnv, seed: int) -> None:
        super().reset(env, seed)
        self.k = -1

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        m = top_bias(info["action_mask"][: self.n], policy_bias(info, self.n))
        for step in range(1, self.n + 1):
            c = (self.k + step) % self.n
            if m[c]:
                self.k = c
                return c
        return 0


class Random(_Base):
    name = "random"

    def reset(self, env: CloudRouteEnv, seed: int) -> None:
        super().reset(env, seed)
        self.rng = np.random.default_rng(seed)

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        valid = np.flatnonzero(top_bias(info["action_mask"][: self.n], policy_bias(info, self.n)))
        return int(self.rng.choice(valid)) if valid.size else 0


class HindsightGreedy(_Base):
    """For each request, the offering with the best *realized* reward: it knows the service-time
    draw, the queues and every future preemption of the replayed telemetry — but only one step."""

    name = "hindsight-greedy"

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        return int(np.argmax(_biased(self.env.exact_rewards(), self.env)))


def _biased(r: np.ndarray, env: CloudRouteEnv) -> np.ndarray:
    """Scores ``r`` plus the current request's prefer weights (``env.r_bias``; ``r`` itself when
    no prefer policy applies)."""
    return r + env.r_bias if env.r_has_bias else r


class HindsightRollout(_Base):
    """Hindsight lookahead: for each request, the ``top_k`` offerings by realized reward are each
    played out for ``horizon`` more requests under hindsight-greedy, and the one with the best total
    is taken — so the queueing and batching a choice imposes on the next requests count too. Beyond
    the two best, only candidates within ``max_regret`` of the best realized reward are played
    (``models.planning.candidates``; None: all ``top_k``). (The
    oracle plans a whole stream of these decisions at once with ``models.planning.lookahead``: the
    same decisions at a fraction of the cost.)"""

    name = "hindsight-rollout"

    def __init__(self, top_k: int = 3, horizon: int = 24, max_regret: float | None = None):
        self.top_k, self.horizon, self.max_regret = top_k, horizon, max_regret

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        from models.planning import candidates

        env = self.env
        cand = candidates(_biased(env.exact_rewards(), env), self.top_k, self.max_regret)
        if cand.size == 0:
            return 0
        if cand.size == 1:
            return int(cand[0])
        snap = env.save_state()
        best, best_total = int(cand[0]), -np.inf
        for a in cand:
            env.restore_state(snap)
            _, total, _, done, _ = env.step(int(a))
            for _ in range(self.horizon):
                if done:
                    break
                _, rew, _, done, _ = env.step(int(np.argmax(_biased(env.exact_rewards(), env))))
                total += rew
            if total > best_total:
                best, best_total = int(a), total
        env.restore_state(snap)
        return best


class Oracle(_Base):
    """The HINDSIGHT oracle (it sees the future; no router can run it): it knows the whole episode
    in advance -- realized outputs, service-time draws, future preemptions -- so it plays it out
    under every plan it knows -- hindsight lookahead, hindsight-greedy and every baseline -- and
    follows the one with the best total reward. Hence it never scores below any baseline on the same
    stream (an upper reference, not a proof of optimality: the true optimum over all routings is
    intractable). How it plans, and what that costs, is ``models.planning``: the lookahead
    (``HindsightRollout``'s decisions, computed incrementally) costs about ``2 + (top_k - 1) * (1 +
    horizon)`` environment steps per request, and runs on whole streams in ``EvaluateConfig.oracle.
    workers`` processes; only a stream longer than ``lookahead_max_requests`` (when set) skips it
    (the name then says ``oracle[no lookahead]``)."""

    name = "oracle"

    def __init__(self, cfg: EvaluateConfig):
        self.cfg = cfg
        #: called as ``on_progress(plan_name, plan_index, n_plans, steps_done, steps_total)`` while
        #: planning (the slow part: minutes on a long stream), so callers can show progress
        self.on_progress: Callable[[str, int, int, int, int], None] | None = None
        #: plans already played on the episode the oracle will plan, by seed, then policy name:
        #: (actions, total reward) -- ``models.evaluate`` fills it with the runs of the baselines it
        #: evaluated before the oracle on the same environment, so they are not played twice
        self.known: dict[int, dict[str, tuple[list[int], float]]] = {}

    def reset(self, env: CloudRouteEnv, seed: int) -> None:
        from models import planning

        super().reset(env, seed)
        oc = self.cfg.oracle
        n_steps = env.steps_left
        lookahead = oc.horizon > 0 and (oc.lookahead_max_requests is None or n_steps <= oc.lookahead_max_requests)
        self.display_name = "oracle" if lookahead else "oracle[no lookahead]"
        plans: list[Policy] = [f(self.cfg) for k, f in BASELINES.items() if k != "oracle"]
        self.planned = planning.best_plan(env, seed, plans, oc.top_k, oc.horizon, lookahead, workers=oc.workers,
                                          segment_requests=oc.segment_requests,
                                          burn_in_requests=oc.burn_in_requests, progress=self.on_progress,
                                          max_regret=oc.max_regret, known=self.known.get(seed))
        self.plan, self.k, self.chosen = self.planned.actions, 0, self.planned.name
        self.total = self.planned.total

    def act(self, obs: Obs, info: dict[str, Any]) -> int:
        a = self.plan[self.k]
        self.k += 1
        return a


BASELINES: dict[str, Callable[[EvaluateConfig], Policy]] = {
    "static": lambda c: Static(location=c.static_location, accelerator=c.static_accelerator),
    "cheapest": lambda c: Cheapest(),
    "lowest-latency": lambda c: LowestLatency(),
    "least-loaded": lambda c: LeastLoaded(),
    "greedy": lambda c: Greedy(),
    "budget-pacing": lambda c: BudgetPacing(c.pacing_gain),
    "cache-aware": lambda c: CacheAware(c.cache_aware.prefix_weight, c.cache_aware.load_weight,
                                        c.cache_aware.cost_weight),
    "session-sticky": lambda c: SessionSticky(c.session_sticky.margin),
    "round-robin": lambda c: RoundRobin(),
    "random": lambda c: Random(),
    "oracle": lambda c: Oracle(c),
}


def make_baseline(name: str, cfg: EvaluateConfig) -> Policy:
    """A baseline by name; ``static:OFFERING_ID`` pins the static baseline to one offering."""
    if name.startswith("static:"):
        return Static(offering_id=name.split(":", 1)[1])
    if name == "oracle":
        return Oracle(cfg)
    if name not in BASELINES:
        import difflib

        close = difflib.get_close_matches(name, BASELINES, n=2)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"--policy: unknown policy '{name}'{hint}; known: {', '.join(BASELINES)}, static:OFFERING_ID")
    return BASELINES[name](cfg)
