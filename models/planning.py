"""How the HINDSIGHT oracle (``models.baselines.Oracle``) plans: it knows the realized future of
the stream (``CloudRouteEnv.exact_rewards``), so no router can run any of this.

* :func:`lookahead` -- the lookahead plan, incrementally: for each request, the ``top_k`` offerings
  by realized reward are each played out for ``horizon`` more requests under hindsight-greedy and
  the best total is taken (``models.baselines.HindsightRollout``'s decision, exactly). What makes it
  scale to whole streams: the greedy candidate's play-out is not recomputed per request -- it is
  the *continuation*, kept one step ahead at a time (the play-out from the next state is the
  current one minus its first step plus one more); when an alternative wins, its own play-out
  becomes the continuation; and planning steps skip building observations
  (``CloudRouteEnv.step_outcome``). So a request costs ``2 + (top_k - 1) * (1 + horizon)``
  environment steps instead of ``1 + top_k * (1 + horizon)``, plus one snapshot and ``top_k - 1``
  restores.
* :func:`best_plan` -- every plan played out (the lookahead, hindsight-greedy, every baseline) and
  the best total kept, in ``workers`` forked processes: the lookahead cut into segments of about
  ``segment_requests`` (each after the first starts ``burn_in_requests`` earlier, from the state
  hindsight-greedy reaches there, and keeps only its own requests' decisions), the other plans one
  task each (a stream with KV-prefix blocks is planned in one segment: its caches outlive any
  burn-in). The segments' decisions, stitched, are one plan like any other: replayed from the
  start, its total is exact (a decision the stitched trajectory cannot take -- an offering invalid
  there -- is replaced by hindsight-greedy's, and counted); the oracle follows whichever plan's
  replayed total is best, so it never scores below any plan it knows, every baseline included.
"""

from __future__ import annotations

import copy
import multiprocessing
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envs.cloud_route import CloudRouteEnv

#: ``progress(plan_name, plan_index, n_plans, steps_done, steps_total)``
Progress = Callable[[str, int, int, int, int], None]


def exact_scores(env: CloudRouteEnv) -> np.ndarray:
    """The current request's *realized* rewards (HINDSIGHT) plus the prefer weights of the routing
    policies that apply to it (``env.r_bias``, when ``env.r_has_bias``): what the hindsight plans rank."""
    r = env.exact_rewards()
    return r + env.r_bias if env.r_has_bias else r


def hindsight_greedy_action(env: CloudRouteEnv) -> int:
    """The offering with the best *realized* reward for the current request (HINDSIGHT), prefer
    weights included."""
    return int(np.argmax(exact_scores(env)))


def candidates(r: np.ndarray, top_k: int, max_regret: float | None = None) -> np.ndarray:
    """The offerings a lookahead plays out for a request whose realized rewards are ``r`` (-inf
    where invalid): the ``top_k`` best valid ones (ties: the lower index first) -- beyond the two
    best, only those within ``max_regret`` of the best (None: no limit)."""
    valid = np.flatnonzero(np.isfinite(r))
    cand = valid[np.argsort(-r[valid], kind="stable")[:top_k]]
    if max_regret is not None and cand.size > 2:
        cand = np.concatenate([cand[:2], cand[2:][r[cand[0]] - r[cand[2:]] <= max_regret]])
    return cand


def _play_out(env: CloudRouteEnv, first: int, horizon: int) -> tuple[list[float], bool]:
    """Step ``first``, then ``horizon`` more requests under hindsight-greedy: the rewards."""
    out, done = env.step_outcome(first)
    rewards = [float(out["reward"])]
    for _ in range(horizon):
        if done:
            break
        out, done = env.step_outcome(hindsight_greedy_action(env))
        rewards.append(float(out["reward"]))
    return rewards, done


def lookahead(env: CloudRouteEnv, top_k: int, horizon: int, steps: int | None = None,
              progress: Callable[[int], None] | None = None, max_regret: float | None = None,
              share_snapshots: bool = True) -> list[int]:
    """The lookahead plan for ``env``'s next ``steps`` decisions (default: to the episode's end):
    the decisions ``HindsightRollout(top_k, horizon, max_regret).act`` takes at each of them (module
    docstring). Steps ``env`` that far. Plans count decisions (steps), not stream positions: under
    admission (``envs.admission``) a queued request's decision comes after later arrivals'.
    ``progress(k)`` is called every 500 decisions with the number made. ``share_snapshots`` (the
    default): each request's snapshot holds ``env``'s arrays uncopied and the spares are restored
    in place (``CloudRouteEnv.save_state(share=True)``); False: copied snapshots and fresh copies on
    restore, as before issue 39 -- the same decisions (``benchmarks/bench_oracle.py --ab`` times both)."""
    stop = env.steps_left if steps is None else min(steps, env.steps_left)
    cont = copy.deepcopy(env)  # the greedy continuation's frontier ...
    cont_rewards: deque[float] = deque()  # ... and its rewards, from env's current request on
    spare = [copy.deepcopy(env) for _ in range(max(top_k - 1, 0))]  # alternatives are played out in these
    cont_done = cont.steps_left <= 0
    actions: list[int] = []
    while len(actions) < stop:
        while len(cont_rewards) < horizon + 1 and not cont_done:
            out, cont_done = cont.step_outcome(hindsight_greedy_action(cont))
            cont_rewards.append(float(out["reward"]))
        cand = candidates(exact_scores(env), top_k, max_regret)
        best = int(cand[0]) if cand.size else 0  # (nothing valid: HindsightRollout's 0, greedy's argmax too)
        best_total = sum(cont_rewards)
        won: tuple[CloudRouteEnv, list[float], bool] | None = None
        if cand.size > 1:
            snap = env.save_state(share=share_snapshots)  # (restored into the spares before env steps)
            for a in cand[1:]:
                sim = spare.pop()
                sim.restore_state(snap, in_place=share_snapshots)
                rewards, done = _play_out(sim, int(a), horizon)
                total = sum(rewards)
                if total > best_total:
                    if won is not None:
                        spare.append(won[0])
                    best, best_total, won = int(a), total, (sim, rewards, done)
                else:
                    spare.append(sim)
        env.step_outcome(best)
        actions.append(best)
        if won is None:
            cont_rewards.popleft()
        else:  # the winner's play-out is the continuation from the new state on
            spare.append(cont)
            cont, cont_rewards, cont_done = won[0], deque(won[1][1:]), won[2]
        if progress is not None and len(actions) % 500 == 0:
            progress(len(actions))
    return actions


def greedy_plan(env: CloudRouteEnv, steps: int | None = None, snapshots_at: tuple[int, ...] = ()
                ) -> tuple[list[int], float, dict[int, dict[str, Any]]]:
    """Hindsight-greedy for ``env``'s next ``steps`` decisions (default: to the episode's end): its
    actions, their total, and ``env``'s state (``save_state``) after each number of decisions in
    ``snapshots_at``."""
    stop = env.steps_left if steps is None else min(steps, env.steps_left)
    actions: list[int] = []
    total, snaps = 0.0, {}
    want = set(snapshots_at)
    while len(actions) < stop:
        if len(actions) in want:
            snaps[len(actions)] = env.save_state()
        a = hindsight_greedy_action(env)
        out, _ = env.step_outcome(a)
        actions.append(a)
        total += float(out["reward"])
    return actions, total, snaps


def policy_plan(env: CloudRouteEnv, policy: Any, seed: int) -> tuple[list[int], float]:
    """``policy`` (anything with ``reset``/``act``, reading observations) played from ``env``'s
    current request to the episode's end: its actions and their total reward."""
    policy.reset(env, seed)
    obs, info = env.observation(), env._info()
    actions: list[int] = []
    total, done = 0.0, env.steps_left <= 0
    while not done:
        a = int(policy.act(obs, info))
        actions.append(a)
        obs, r, _, done, info = env.step(a)
        total += r
    return actions, total


def replay(env: CloudRouteEnv, actions: list[int], total: float = 0.0) -> tuple[list[int], float, int]:
    """``actions`` played from ``env``'s current request: the actions taken (an invalid one -- a
    masked offering -- replaced by hindsight-greedy's), ``total`` plus their rewards (summed in
    order: a plan replayed in pieces sums as in one), and how many were replaced."""
    taken, replaced = [], 0
    for a in actions:
        if env.steps_left <= 0:
            break
        mask = env.c_mask
        if not (0 <= a < env.n and mask[a]) and mask.any():
            a = hindsight_greedy_action(env)
            replaced += 1
        out, _ = env.step_outcome(a)
        taken.append(int(a))
        total += float(out["reward"])
    return taken, total, replaced


@dataclass
class Planned:
    """The oracle's chosen plan and what every plan it knew scored (for reports and tests)."""

    actions: list[int]
    total: float
    name: str
    totals: dict[str, float] = field(default_factory=dict)
    segments: int = 1
    replaced: int = 0
    #: wall seconds of the phases: "main" (this process alone: hindsight-greedy and the replay) and
    #: "total" (the policies' and the segments' plays overlap the former in the workers)
    seconds: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- parallel planning
#: what forked workers read (set in the parent before the pool forks; never sent through a pipe)
_FORKED: dict[str, Any] = {}


def _segment_task(start: int, own: int, stop: int, snap: dict[str, Any] | None) -> list[int]:
    """The lookahead's decisions ``own`` to ``stop`` (decision counts from the episode's start),
    planned from the state after ``start`` decisions (``snap``; None: the start)."""
    st = _FORKED
    env = copy.deepcopy(st["env"])
    n = env.steps_left
    if snap is not None:
        env.restore_state(snap)
    assert n - env.steps_left == start
    return lookahead(env, st["top_k"], st["horizon"], stop - start, max_regret=st["max_regret"])[own - start:]


def _policy_task(j: int) -> tuple[list[int], float]:
    st = _FORKED
    return policy_plan(copy.deepcopy(st["env"]), st["policies"][j], st["seed"])


def _fork_context() -> Any:
    if "fork" not in multiprocessing.get_all_start_methods():
        return None
    return multiprocessing.get_context("fork")


def best_plan(env: CloudRouteEnv, seed: int, policies: list[Any], top_k: int, horizon: int, with_lookahead: bool,
              workers: int = 1, segment_requests: int = 20_000, burn_in_requests: int = 500,
              progress: Progress | None = None, max_regret: float | None = None,
              known: dict[str, tuple[list[int], float]] | None = None) -> Planned:
    """Every plan from ``env``'s current request (it is left untouched: plans run on copies) --
    the lookahead (if ``with_lookahead``), hindsight-greedy, and ``policies`` (each played as it
    decides) -- and the best total (the first on ties, in that order). See the module docstring.
    ``known``: plans already played on this very episode (the same environment, reset with the
    same seed), by policy name -- their actions and total -- which need not be played again
    (``models.evaluate`` hands the oracle the runs of the policies evaluated before it)."""
    n = env.steps_left
    first = 0  # (segments are cut by decisions made, not stream positions: envs.admission may reorder)
    names = (["hindsight-rollout"] if with_lookahead else []) + ["hindsight-greedy"] + [p.name for p in policies]
    n_plans = len(names)

    def tell(name: str, done: int) -> None:
        if progress is not None:
            progress(name, names.index(name) + 1, n_plans, done, n)

    ctx = _fork_context() if workers > 1 else None
    n_seg = (-(-n // max(segment_requests, 1)) if ctx is not None else 1) if with_lookahead and n > 0 else 0
    if env.has_prefix:
        # a stream with KV-prefix blocks is planned in one segment: the pools' prefix caches remember far
        # longer than a burn-in, so a segment started from hindsight-greedy's caches plans for caches the
        # stitched plan does not have (the 96k Mooncake stream: stitched 15k segments -0.000518 a request
        # under hindsight-greedy, one segment +0.001836 over it; docs/results.md "Evaluation throughput")
        n_seg = min(n_seg, 1)
    bounds = [first + (n * i) // n_seg for i in range(n_seg + 1)] if n_seg else []
    starts = [max(first, b - burn_in_requests) if i else first for i, b in enumerate(bounds[:-1])]

    segments = list(zip(starts, bounds[:-1], bounds[1:]))
    want = tuple(st for st in starts if st != first)
    t_start = time.perf_counter()
    main_s = 0.0
    known = known or {}
    results: dict[str, tuple[list[int], float]] = {p.name: known[p.name] for p in policies if p.name in known}
    policies = [p for p in policies if p.name not in results]
    seg_actions: list[list[int]] = [[] for _ in segments]
    replaced = 0
    if ctx is None:
        g_actions, g_total, _ = greedy_plan(copy.deepcopy(env))
        results["hindsight-greedy"] = (g_actions, g_total)
        tell("hindsight-greedy", n)
        if with_lookahead:
            acts = lookahead(copy.deepcopy(env), top_k, horizon, progress=lambda k: tell("hindsight-rollout", k),
                             max_regret=max_regret)
            t0 = time.perf_counter()
            taken, total, replaced = replay(copy.deepcopy(env), acts)
            main_s += time.perf_counter() - t0
            results["hindsight-rollout"] = (taken, total)
        for p in policies:
            results[p.name] = policy_plan(copy.deepcopy(env), p, seed)
            tell(p.name, n)
    else:
        _FORKED.clear()
        _FORKED.update(env=env, top_k=top_k, horizon=horizon, policies=policies, seed=seed, max_regret=max_regret)
        try:
            with ctx.Pool(processes=workers) as pool:
                # the first segment and the policies' plays need no state but the start: they run while
                # this process plays hindsight-greedy, whose states start the later segments
                seg_jobs = [pool.apply_async(_segment_task, (*segments[0], None))] if segments else []
                pol_jobs = [pool.apply_async(_policy_task, (j,)) for j in range(len(policies))]
                t0 = time.perf_counter()
                g_actions, g_total, snaps = greedy_plan(copy.deepcopy(env), snapshots_at=want)
                main_s += time.perf_counter() - t0
                results["hindsight-greedy"] = (g_actions, g_total)
                tell("hindsight-greedy", n)
                seg_jobs += [pool.apply_async(_segment_task, (st, own, stop, snaps[st])) for st, own, stop in segments[1:]]
                for j, job in enumerate(pol_jobs):
                    results[policies[j].name] = job.get()
                    tell(policies[j].name, n)
                # the stitched plan is replayed segment by segment as they come, while later ones are planned
                sim, taken, total, replaced = copy.deepcopy(env), [], 0.0, 0
                for i, job in enumerate(seg_jobs):
                    seg_actions[i] = job.get()
                    tell("hindsight-rollout", segments[i][2] - first)
                    t0 = time.perf_counter()
                    part, total, rep = replay(sim, seg_actions[i], total)
                    main_s += time.perf_counter() - t0
                    taken += part
                    replaced += rep
                if with_lookahead:
                    results["hindsight-rollout"] = (taken, total)
        finally:
            _FORKED.clear()
    best_name = max(names, key=lambda k: (results[k][1], -names.index(k)))
    return Planned(actions=results[best_name][0], total=results[best_name][1], name=best_name,
                   totals={k: v[1] for k, v in results.items()}, segments=len(segments), replaced=replaced,
                   seconds={"main": round(main_s, 2), "total": round(time.perf_counter() - t_start, 2)})
