"""Training the learned capacity planner (``models.planner_policy``): the pieces one trial runs.

1. **Episodes** (:class:`Worlds`, :func:`sample_episodes`): random windows of ``episode_epochs``
   epochs of the training bundles' *train* windows, each at a load (``load_scale``) and a seed
   (service-time noise, the instants of the preemptions) -- the real spot traces, prices and
   request streams of the bundles, replayed.
2. **Labels** (:func:`collect_labels`): on each episode the hindsight oracle
   (``models.planners.HindsightOracle``) plans the window; its plan is played and, at each epoch,
   the learned planner's decision-time rows are recorded with the oracle's capacity share per
   pool over the next ``horizon_epochs`` epochs (training-time labels: the oracle's hindsight
   never reaches the planner's inputs).
3. **The scorer's fit** (:func:`fit_scorer`, torch): its risk head by binary cross-entropy against
   what the real spot traces did next (was the pool's capacity lost within ``risk_epochs``?), its
   preference head by cloning the oracle -- a softmax over the eligible pools of ``-ln(price per
   capacity) + f_p`` against the oracle's shares; the epoch kept is the one with the lowest loss on
   held-out episodes.
4. **The cost-sensitive fine-tune** (:func:`search_knobs`): the cross-entropy method over the
   allocator's knobs (margin, beta, hazard price, hedge, stabilization, horizon), each candidate
   played on the same training episodes (paired), scored by the mean log ratio of its penalized held
   cost (:func:`penalized`: USD per 1k requests + ``slo_miss_usd`` per SLO miss) to SpotHedge's on
   the same episode.

``models.planner_trainer`` runs trials of these in Ray Tune, selects, gates and registers.
torch is imported inside :func:`fit_scorer` only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from envs.provisioning import ProvisionWorld
from models.planner_features import N_CONTEXT, N_POOL
from models.planner_net import Knobs, PlannerWeights
from models.planner_policy import LearnedPlanner
from models.planners import HindsightOracle
from models.scenarios import Scenario
from xroute.config import CapacityConfig


# ------------------------------------------------------------------------------------------ episodes
@dataclass(frozen=True)
class Episode:
    """One training rollout: world ``key`` (a scenario and a load), its first epoch, its length, its seed."""

    key: int
    start: int
    epochs: int
    seed: int


class Worlds:
    """One :class:`ProvisionWorld` per (scenario, load), built once and reset per episode."""

    def __init__(self, scenarios: list[Scenario], loads: list[int], cfg: CapacityConfig):
        self.cfg = cfg
        self.keys: list[tuple[str, int]] = []
        self.worlds: list[ProvisionWorld] = []
        for sc in scenarios:
            for L in loads:
                self.keys.append((sc.label, int(L)))
                self.worlds.append(ProvisionWorld(sc.bundle, cfg.world.model_copy(update={"load_scale": int(L)}),
                                                  history=sc.history))

    def __len__(self) -> int:
        return len(self.worlds)

    def label(self, ep: Episode) -> str:
        name, L = self.keys[ep.key]
        return f"{name} x{L} @{ep.start}+{ep.epochs} s{ep.seed}"


#: epochs of the stream before an episode's start (its planners' history: the load of the last 5 minutes)
HISTORY_EPOCHS = 5


def sample_episodes(worlds: Worlds, n: int, epochs: int, rng: np.random.Generator) -> list[Episode]:
    """``n`` episodes: a world uniformly, a start uniformly among those leaving ``epochs`` epochs
    after :data:`HISTORY_EPOCHS` of the stream (shorter where the stream is)."""
    out = []
    for _ in range(n):
        k = int(rng.integers(len(worlds)))
        E = worlds.worlds[k].n_epochs_total
        h = min(HISTORY_EPOCHS, E - 1)
        L = max(1, min(epochs, E - h))
        out.append(Episode(k, int(rng.integers(h, E - L + 1)), L, int(rng.integers(0, 2**31 - 1))))
    return out


def run_episode(worlds: Worlds, ep: Episode, planner: Any, on_step: Callable[[Any, Any], None] | None = None
                ) -> dict[str, Any]:
    """Play ``planner`` on episode ``ep``; the world's metrics (``on_step(world, planner)`` after each plan)."""
    w = worlds.worlds[ep.key]
    ctx = w.reset(seed=ep.seed, start_epoch=ep.start, n_epochs=ep.epochs)
    if isinstance(planner, HindsightOracle):
        planner.bind(w)
    planner.reset(ctx)
    while True:
        tg = planner.plan(w.view())
        if on_step is not None:
            on_step(w, planner)
        if w.step(tg).done:
            break
    m = w.metrics()
    m["slo_missed"] = round((1.0 - m["slo_attainment"]) * m["requests"]) if m["requests"] else 0
    return m


def penalized(m: dict[str, Any], miss_usd: float) -> float:
    """USD per 1k requests of held cost plus ``miss_usd`` for each request that missed its SLO."""
    n = max(int(m["requests"]), 1)
    misses = (1.0 - float(m["slo_attainment"])) * n
    return 1000.0 * (float(m["cost_usd"]) + miss_usd * misses) / n


# ------------------------------------------------------------------------------------------ labels
@dataclass
class Labels:
    """Per labelled state ``s`` (an epoch of an episode): the rows ``x[off[s]:off[s+1]]`` of its
    eligible pools, its context ``g[s]``, each row's ``-ln(price per capacity)`` (``prior``), whether
    it is a spot pool, whether that pool's instances were preempted (or its capacity lost) within the
    next ``risk_epochs`` (``risk``; ``risk_w`` 0 where that is not known: an on-demand pool, or the
    episode ends first) and the oracle's capacity share (``target``; each state's sums to 1);
    ``episode[s]`` the episode it comes from (the hold-out splits by episode)."""

    x: np.ndarray
    g: np.ndarray
    off: np.ndarray
    prior: np.ndarray
    spot: np.ndarray
    risk: np.ndarray
    risk_w: np.ndarray
    target: np.ndarray
    episode: np.ndarray
    seconds: float = 0.0
    oracle_cost: list[float] = field(default_factory=list)

    ROWS = ("x", "prior", "spot", "risk", "risk_w", "target")

    def __len__(self) -> int:
        return int(self.g.shape[0])

    @classmethod
    def empty(cls) -> Labels:
        z = np.zeros(0)
        return cls(np.zeros((0, N_POOL), np.float32), np.zeros((0, N_CONTEXT), np.float32), np.zeros(1, dtype=np.int64),
                   z, z.astype(bool), z, z, z, np.zeros(0, dtype=np.int64))

    @classmethod
    def concat(cls, parts: list[Labels]) -> Labels:
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        offs, base = [np.zeros(1, dtype=np.int64)], 0
        for p in parts:
            offs.append(p.off[1:] + base)
            base += int(p.off[-1])
        ep_base, eps = 0, []
        for p in parts:
            eps.append(p.episode + ep_base)
            ep_base += int(p.episode.max()) + 1
        rows = {k: np.concatenate([getattr(p, k) for p in parts]) for k in cls.ROWS}
        return cls(g=np.concatenate([p.g for p in parts]), off=np.concatenate(offs), episode=np.concatenate(eps),
                   seconds=sum(p.seconds for p in parts), oracle_cost=[c for p in parts for c in p.oracle_cost], **rows)


def collect_labels(worlds: Worlds, episodes: list[Episode], horizon_epochs: int, risk_epochs: int,
                   progress: Callable[[int], None] | None = None) -> Labels:
    """The oracle's plans and the spot traces' outcomes on ``episodes`` as labels of the learned
    planner's decision-time rows (module docstring, step 2)."""
    t0 = time.perf_counter()
    cfg = worlds.cfg.planners
    rows: dict[str, list[np.ndarray]] = {k: [] for k in Labels.ROWS}
    gs, offs, eps, costs = [], [0], [], []
    for k, ep in enumerate(episodes):
        oracle = HindsightOracle(cfg)
        probe = LearnedPlanner(cfg, PlannerWeights())  # computes the rows; the oracle's plan is played
        w = worlds.worlds[ep.key]
        ctx = w.reset(seed=ep.seed, start_epoch=ep.start, n_epochs=ep.epochs)
        oracle.bind(w)
        oracle.reset(ctx)
        probe.reset(ctx)
        X = oracle.planned_x  # (E, P) instances serving per epoch
        alive = w.hindsight().alive  # HINDSIGHT: training labels only
        E = X.shape[0]
        spot = ctx.pools.is_spot
        while True:
            v = w.view()
            st = probe.step(v)
            e = v.epoch
            cap = st.demand.mix_cap
            share = (X[e:min(e + horizon_epochs, E)] * cap[None, :]).sum(axis=0)
            share = np.where(st.eligible, share, 0.0)
            pools = np.flatnonzero(st.eligible)
            if share.sum() > 0 and pools.size > 1:
                rows["x"].append(st.x[pools])
                gs.append(st.g)
                offs.append(offs[-1] + pools.size)
                with np.errstate(divide="ignore"):
                    rows["prior"].append(-np.log(st.demand.per_cap[pools]))
                rows["spot"].append(spot[pools])
                known = e + risk_epochs <= E
                rows["risk"].append((~alive[e:e + risk_epochs, pools].all(axis=0)).astype(float))
                rows["risk_w"].append((spot[pools] & known).astype(float))
                rows["target"].append(share[pools] / share.sum())
                eps.append(k)
            if w.step(oracle.plan(v)).done:
                break
        costs.append(float(w.metrics()["cost_usd"]))
        if progress is not None:
            progress(k + 1)
    if not gs:
        out = Labels.empty()
        out.seconds, out.oracle_cost = time.perf_counter() - t0, costs
        return out
    cat = {k: np.concatenate(v) for k, v in rows.items()}
    cat["x"] = cat["x"].astype(np.float32)
    cat["spot"] = cat["spot"].astype(bool)
    return Labels(g=np.stack(gs).astype(np.float32), off=np.array(offs, dtype=np.int64),
                  episode=np.array(eps, dtype=np.int64), seconds=time.perf_counter() - t0, oracle_cost=costs, **cat)


# ------------------------------------------------------------------------------------------ behaviour cloning
@dataclass
class FitReport:
    """The scorer's fit: per epoch the training loss and the held-out losses (both heads, the risk
    head's cross-entropy, the cloning cross-entropy; epoch 0: the zero network), the epoch kept."""

    train_loss: list[float]
    holdout_loss: list[float]
    holdout_risk: list[float]
    holdout_clone: list[float]
    best_epoch: int
    states: int
    rows: int
    seconds: float


def fit_scorer(labels: Labels, hidden: list[int], epochs: int, learning_rate: float, weight_decay: float,
               holdout: float, risk_weight: float, seed: int, batch_states: int = 64
               ) -> tuple[list[tuple[np.ndarray, np.ndarray]], FitReport]:
    """Fit the two heads (module docstring, step 3): the risk head by binary cross-entropy against the
    traces' outcomes (weight ``risk_weight``), the preference head so that a softmax over each state's
    eligible pools of ``-ln(price per capacity) + f_p`` matches the oracle's shares. Returns the layers of
    the epoch with the lowest held-out loss (whole episodes held out) and the curves."""
    import torch as th

    th.set_num_threads(1)
    t0 = time.perf_counter()
    th.manual_seed(seed)
    rng = np.random.default_rng(seed)
    S = len(labels)
    n_ep = int(labels.episode.max()) + 1 if S else 0
    hold_eps = set(rng.permutation(n_ep)[:max(1, round(holdout * n_ep))].tolist()) if holdout > 0 and n_ep > 1 \
        else set()
    is_hold = np.array([int(e) in hold_eps for e in labels.episode], dtype=bool)
    dims = [N_POOL + N_CONTEXT, *hidden, 2]
    mods: list[Any] = []
    for k in range(len(dims) - 1):
        lin = th.nn.Linear(dims[k], dims[k + 1])
        if k == len(dims) - 2:  # the preference starts at zero (the price prior alone), the risk at 1/2
            th.nn.init.zeros_(lin.weight)
            th.nn.init.zeros_(lin.bias)
        mods.append(lin)
        if k < len(dims) - 2:
            mods.append(th.nn.ReLU())
    net = th.nn.Sequential(*mods).double()
    opt = th.optim.Adam(net.parameters(), lr=learning_rate, weight_decay=weight_decay)
    rows_state = np.repeat(np.arange(S), np.diff(labels.off))
    X = th.as_tensor(np.concatenate([labels.x, labels.g[rows_state]], axis=1), dtype=th.float64)
    base = th.as_tensor(labels.prior, dtype=th.float64)
    Y = th.as_tensor(labels.target, dtype=th.float64)
    R = th.as_tensor(labels.risk, dtype=th.float64)
    RW = th.as_tensor(labels.risk_w, dtype=th.float64)
    bce = th.nn.BCEWithLogitsLoss(reduction="none")

    def losses(states: np.ndarray) -> tuple[Any, Any]:
        idx_np = np.flatnonzero(np.isin(rows_state, states))
        idx = th.as_tensor(idx_np)
        out = net(X[idx])
        logits = base[idx] + out[:, 1]
        uniq, inv = th.unique(th.as_tensor(rows_state[idx_np]), return_inverse=True)
        mx = th.zeros(uniq.numel(), dtype=th.float64).scatter_reduce(0, inv, logits.detach(), reduce="amax",
                                                                      include_self=False)
        z = th.zeros(uniq.numel(), dtype=th.float64).index_add(0, inv, th.exp(logits - mx[inv]))
        clone = -(Y[idx] * (logits - mx[inv] - th.log(z[inv]))).sum() / uniq.numel()
        w = RW[idx]
        risk = (bce(out[:, 0], R[idx]) * w).sum() / th.clamp(w.sum(), min=1.0)
        return clone, risk

    train_states, hold_states = np.flatnonzero(~is_hold), np.flatnonzero(is_hold)

    def snapshot() -> list[tuple[np.ndarray, np.ndarray]]:
        return [(m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy()) for m in net
                if isinstance(m, th.nn.Linear)]

    def held_out() -> tuple[float, float, float]:
        if hold_states.size == 0:
            return math.nan, math.nan, math.nan
        with th.no_grad():
            c, r = losses(hold_states)
        return float(c) + risk_weight * float(r), float(r), float(c)

    tr_curve: list[float] = []
    h0 = held_out()
    ho, ho_r, ho_c = [h0[0]], [h0[1]], [h0[2]]
    best, best_loss, best_epoch = snapshot(), h0[0], 0
    for ep in range(1, epochs + 1):
        perm = rng.permutation(train_states)
        tot = 0.0
        for b in range(0, perm.size, batch_states):
            opt.zero_grad()
            c, r = losses(perm[b:b + batch_states])
            loss = c + risk_weight * r
            loss.backward()
            opt.step()
            tot += float(loss.detach()) * min(batch_states, perm.size - b)
        tr_curve.append(tot / max(perm.size, 1))
        h = held_out()
        ho.append(h[0])
        ho_r.append(h[1])
        ho_c.append(h[2])
        if hold_states.size == 0 or h[0] < best_loss:
            best, best_loss, best_epoch = snapshot(), h[0], ep
    return best, FitReport(tr_curve, ho, ho_r, ho_c, best_epoch, S, int(labels.off[-1]), time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------ the fine-tune
#: the knobs the search moves, with their ranges (a candidate is a point of the unit cube mapped onto these)
SEARCH_SPACE: tuple[tuple[str, float, float], ...] = (
    ("margin", 0.0, 0.5),
    ("beta", 0.0, 2.0),
    ("risk_price", 0.0, 8.0),
    ("hazard_price", 0.0, 2.0),
    ("relaunch_price", 0.0, 4.0),
    ("hedge", 0.0, 0.8),
    ("stabilization_s", 0.0, 900.0),
    ("horizon_s", 120.0, 1800.0),
)


def knobs_at(u: np.ndarray, base: Knobs) -> Knobs:
    vals: dict[str, Any] = {n: float(lo + (hi - lo) * float(np.clip(v, 0.0, 1.0))) for (n, lo, hi), v in zip(SEARCH_SPACE, u)}
    return replace(base, **vals)


def unit_of(k: Knobs) -> np.ndarray:
    return np.array([(getattr(k, n) - lo) / (hi - lo) for n, lo, hi in SEARCH_SPACE])


@dataclass
class SearchReport:
    """The search's curve: per iteration the best and the mean elite score, and the knobs kept."""

    best: list[float]
    elite_mean: list[float]
    start_score: float
    final_score: float
    knobs: Knobs
    seconds: float


def reference_scores(worlds: Worlds, episodes: list[Episode], miss_usd: float, name: str = "spothedge") -> np.ndarray:
    """The penalized cost of the baseline ``name`` on each episode (what a candidate's is divided by)."""
    from models.planners import make_planner

    return np.array([penalized(run_episode(worlds, ep, make_planner(name, worlds.cfg.planners)), miss_usd)
                     for ep in episodes])


def score_weights(worlds: Worlds, episodes: list[Episode], weights: PlannerWeights, miss_usd: float,
                  ref: np.ndarray) -> float:
    """The mean over ``episodes`` of ln(penalized cost of ``weights`` / the reference's): paired, and
    every episode weighs alike whatever its load and request sizes (:func:`penalized`)."""
    cfg = worlds.cfg.planners
    pen = np.array([penalized(run_episode(worlds, ep, LearnedPlanner(cfg, weights)), miss_usd) for ep in episodes])
    return float(np.mean(np.log(np.maximum(pen, 1e-9) / np.maximum(ref, 1e-9))))


def search_knobs(worlds: Worlds, layers: list[tuple[np.ndarray, np.ndarray]], start: Knobs, iterations: int,
                 population: int, episodes: int, elite: float, epochs: int, miss_usd: float, seed: int,
                 progress: Callable[[int, float], None] | None = None) -> SearchReport:
    """The cross-entropy method over :data:`SEARCH_SPACE` (module docstring, step 4): each iteration
    draws ``population`` candidates around the mean (the current best kept among them), plays each
    on the same ``episodes`` fresh training episodes, and moves the mean and spread to the elite."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    mu = unit_of(start)
    sd = np.full(mu.size, 0.25)
    best_u, best_s = mu.copy(), math.inf
    best_curve, elite_curve = [], []
    start_score = math.nan
    for it in range(iterations):
        eps = sample_episodes(worlds, episodes, epochs, rng)
        ref = reference_scores(worlds, eps, miss_usd)
        cands = [np.clip(mu + sd * rng.standard_normal(mu.size), 0.0, 1.0) for _ in range(population - 1)]
        cands.insert(0, best_u if it else mu)
        scores = np.array([score_weights(worlds, eps, PlannerWeights(layers, knobs_at(u, start)), miss_usd, ref)
                           for u in cands])
        if it == 0:
            start_score = float(scores[0])
        n_el = max(2, round(elite * population))
        order = np.argsort(scores)
        el = np.array([cands[i] for i in order[:n_el]])
        mu = el.mean(axis=0)
        sd = np.maximum(el.std(axis=0), 0.03)
        best_u, best_s = cands[int(order[0])], float(scores[order[0]])
        best_curve.append(best_s)
        elite_curve.append(float(scores[order[:n_el]].mean()))
        if progress is not None:
            progress(it + 1, best_s)
    # the last iteration's best against the elite's mean, on fresh episodes (the winner's score is biased low)
    eps = sample_episodes(worlds, episodes, epochs, rng)
    ref = reference_scores(worlds, eps, miss_usd)
    final = [(score_weights(worlds, eps, PlannerWeights(layers, knobs_at(u, start)), miss_usd, ref), k, u)
             for k, u in enumerate((best_u, mu))]
    final_s, _, final_u = min(final, key=lambda f: (f[0], f[1]))
    return SearchReport(best_curve, elite_curve, start_score, final_s, knobs_at(final_u, start),
                        time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------ selection
@dataclass
class SelectionWindow:
    """A selection window (a validation window at a load) with the baselines' penalized costs per seed
    (``baselines[name][seed]``) and the best of them (lowest mean). Its world is built on first use
    (and not shipped to Ray's workers)."""

    label: str
    scenario: Scenario
    load: int
    baselines: dict[str, list[float]]
    world: ProvisionWorld | None = None

    @property
    def best(self) -> str:
        return min(self.baselines, key=lambda n: float(np.mean(self.baselines[n])))

    def get_world(self, cfg: CapacityConfig) -> ProvisionWorld:
        if self.world is None:
            self.world = ProvisionWorld(self.scenario.bundle, cfg.world.model_copy(update={"load_scale": self.load}),
                                        history=self.scenario.history)
        return self.world

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "world": None}


def selection_windows(scenarios: list[Scenario], loads: list[int], cfg: CapacityConfig, seeds: int, miss_usd: float,
                      baselines: tuple[str, ...] = ("static-ondemand", "autoscaler", "spothedge", "melange"),
                      echo: Callable[[str], None] | None = None) -> list[SelectionWindow]:
    """Every selection scenario at every load, with every baseline played on it for ``seeds`` seeds."""
    from models.capacity_eval import run_planner
    from models.planners import make_planner

    out = []
    for sc in scenarios:
        for L in loads:
            sw = SelectionWindow(f"{sc.label} x{L}", sc, int(L), {})
            w = sw.get_world(cfg)
            sw.baselines = {b: [penalized(run_planner(w, make_planner(b, cfg.planners), cfg.seed + s).metrics, miss_usd)
                                for s in range(seeds)] for b in baselines}
            out.append(sw)
            if echo is not None:
                echo(f"selection {sw.label}: best baseline {sw.best} "
                     f"({np.mean(sw.baselines[sw.best]):.4f} USD/1k, penalized)")
    return out


def selection_score(windows: list[SelectionWindow], weights: PlannerWeights, cfg: CapacityConfig, miss_usd: float,
                    criterion: str = "worst") -> tuple[float, dict[str, float]]:
    """Per selection window, the mean over the seeds of ln(penalized cost / the window's best
    baseline's, same seed), and the score: the worst window's (``criterion="worst"``) or the mean
    over the windows -- lower is better."""
    from models.capacity_eval import run_planner

    per: dict[str, float] = {}
    for sw in windows:
        ref = sw.baselines[sw.best]
        w = sw.get_world(cfg)
        vals = [math.log(max(penalized(run_planner(w, LearnedPlanner(cfg.planners, weights), cfg.seed + s).metrics,
                                       miss_usd), 1e-9) / max(r, 1e-9)) for s, r in enumerate(ref)]
        per[sw.label] = float(np.mean(vals))
    v = list(per.values())
    return float(max(v) if criterion == "worst" else np.mean(v)), per


def safeguarded(weights: PlannerWeights, hazard_floor: float, hedge_floor: float, keep_launching: bool
                ) -> PlannerWeights:
    """``weights`` with ``hazard_price`` and ``hedge`` raised to at least the floors, and ``keep_launching``."""
    k = weights.knobs
    return replace(weights, knobs=replace(k, hazard_price=max(k.hazard_price, hazard_floor),
                                          hedge=max(k.hedge, hedge_floor), keep_launching=keep_launching))
