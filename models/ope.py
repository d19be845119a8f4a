"""Off-policy evaluation (OPE): a candidate router's reward estimated from another policy's log.

The log (``xroute.schema.ope``) holds, per decision ``i``, the action set ``A_i`` with its
feature rows ``x_i``, the chosen action ``a_i``, its propensity ``p_i = mu(a_i | x_i)`` under the
logging policy ``mu`` and the realized reward ``r_i``. For a target policy ``pi`` (deterministic
here, any ``models.baselines``-style scorer: ``pi(a | x) = 1`` for its argmax over the logged
action set; a learned router: its argmax with the departure rule around greedy's choice on the
same set, as it serves -- :class:`Departing`) with weights ``w_i = pi(a_i | x_i) / p_i``:

* IPS:   ``V = 1/n sum_i w_i r_i``
* SNIPS: ``V = sum_i w_i r_i / sum_i w_i``
* DR:    ``V = 1/n sum_i [ sum_a pi(a | x_i) q(x_i, a) + w_i (r_i - q(x_i, a_i)) ]``

``q`` (the direct-method model) is the one-step expected reward the product already defines:
``models.policy.RewardPrior.scores`` (``envs.kernels.expected_reward`` from the logged rows,
greedy's score), calibrated by a linear fit ``r ~ alpha + beta * prior`` on the logged (chosen)
actions, cross-fitted over two halves of the log (decision ``i``'s ``q`` never saw ``r_i``, so
DR stays unbiased whatever ``q`` is when the propensities are right). ``dm`` is ``1/n sum_i
sum_a pi(a | x_i) q(x_i, a)`` alone (biased when ``q`` is; reported for reference).

95 % intervals: normal approximation over decisions (``V +- 1.96 sd / sqrt(n)`` of the per-decision
terms, ``sd`` with n - 1) for IPS, DR and the logged mean; for SNIPS the delta method, ``se =
sqrt(sum_i w_i^2 (r_i - V)^2) / sum_i w_i``. Both assume independent decisions: congestion (one
decision changes the queues the next one sees) breaks that, see ``docs/ope.md``. Also reported:
the effective sample size ``(sum w)^2 / sum w^2`` and the agreement, ``1/n sum_i pi(a_i | x_i)``
(the share of decisions where the target picks the logged action).

Library decision: hand-written (vectorized numpy, ~40 lines for the estimators). ``obp`` (Open
Bandit Pipeline, the fullest OPE library) does not install here: its last release (0.5.7, 2023)
requires Python < 3.11 and pins Pillow 9.1.1. Vowpal Wabbit's estimators (``vw-estimators``
0.2.2, 2023) install but have no doubly robust estimator and take one Python call per example;
``tests/test_ope.py`` checks IPS, SNIPS and the normal interval against them. ``coba`` runs OPE
only inside its own experiment pipeline (its DR needs a VW regressor) and gives no intervals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from envs.features import OFFERING_FEATURES, OFFERING_HIGH, OFFERING_LOW, REQUEST_FEATURES, REQUEST_HIGH, REQUEST_LOW, F
from envs.features import R as RQ
from models.loader import load_policy, model_version
from models.policy import RewardPrior, RouterWeights, choose
from xroute.errors import ConfigError
from xroute.schema.ope import DecisionLog, Feedback, LogError, LoggedDecision, LogHeader, RewardWeights

Z95 = 1.959963984540054  # scipy.stats.norm.ppf(0.975)
ESTIMATORS = ("ips", "snips", "dr")
REPORT_FORMAT = "xroute-ope-report/1"
#: the baselines a log can score (they read only the observation); the others need the live environment
OFFLINE_BASELINES = ("greedy", "cheapest", "lowest-latency", "least-loaded", "random")
_BATCH = 2048
#: below this effective sample size the table flags the row (the normal intervals mean little)
MIN_ESS = 30
Scorer = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


# ------------------------------------------------------------------------------ estimators
@dataclass(frozen=True)
class Estimate:
    value: float
    lo: float
    hi: float

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "ci95": [self.lo, self.hi]}


def _normal(terms: np.ndarray) -> Estimate:
    """Mean of the per-decision terms with its normal-approximation 95 % interval."""
    n = terms.size
    mean = float(terms.mean()) if n else float("nan")
    if n < 2:
        return Estimate(mean, float("nan"), float("nan"))
    half = Z95 * float(terms.std(ddof=1)) / math.sqrt(n)
    return Estimate(mean, mean - half, mean + half)


def estimates(w: np.ndarray, r: np.ndarray, q_logged: np.ndarray, q_target: np.ndarray) -> dict[str, Estimate]:
    """IPS, SNIPS, DR and DM from per-decision arrays: importance weights ``w``, rewards ``r``,
    ``q`` of the logged action and ``sum_a pi(a|x) q(x, a)`` (module docstring)."""
    w, r = np.asarray(w, dtype=float), np.asarray(r, dtype=float)
    sw = float(w.sum())
    if sw > 0:
        v = float((w * r).sum()) / sw
        se = math.sqrt(float(((w * (r - v)) ** 2).sum())) / sw
        snips = Estimate(v, v - Z95 * se, v + Z95 * se) if w.size > 1 else Estimate(v, float("nan"), float("nan"))
    else:  # the target never agrees with the log: nothing to normalize by
        snips = Estimate(float("nan"), float("nan"), float("nan"))
    dm = float(np.mean(q_target)) if w.size else float("nan")
    return {"ips": _normal(w * r), "snips": snips, "dr": _normal(q_target + w * (r - q_logged)),
            "dm": Estimate(dm, float("nan"), float("nan"))}


def effective_sample_size(w: np.ndarray) -> float:
    """Kish's ``(sum w)^2 / sum w^2``: how many on-policy decisions the weighted log is worth."""
    s2 = float((np.asarray(w, dtype=float) ** 2).sum())
    return float(np.sum(w)) ** 2 / s2 if s2 > 0 else 0.0


# ------------------------------------------------------------------------- target policies
class Target(Protocol):
    """A policy scored on logged action sets: ``probabilities(rows (T, F), request (n, R),
    offsets (n+1,))`` -> ``pi(a | x)`` for every flat entry (each set sums to 1)."""

    name: str

    def probabilities(self, rows: np.ndarray, request: np.ndarray, offsets: np.ndarray) -> np.ndarray: ...


def padded(rows: np.ndarray, offsets: np.ndarray, lo: int, hi: int
           ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Decisions ``lo:hi`` as a padded batch: rows (b, K, F), mask (b, K), and the flat index of
    every valid cell (for writing results back)."""
    sizes = np.diff(offsets[lo:hi + 1])
    b, k = sizes.size, int(sizes.max()) if sizes.size else 0
    flat = np.arange(offsets[lo], offsets[hi])
    d = np.repeat(np.arange(b), sizes)
    pos = flat - np.repeat(offsets[lo:hi], sizes)
    out = np.zeros((b, k, rows.shape[1]), dtype=np.float32)
    out[d, pos] = rows[flat]
    mask = np.zeros((b, k), dtype=bool)
    mask[d, pos] = True
    return out, mask, (d, pos)


def flat_scores(scorer: Scorer, rows: np.ndarray, request: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``scorer(rows (b, K, F), request (b, R), mask (b, K)) -> (b, K)`` over every decision, in
    padded batches, back as one score per flat entry."""
    n = offsets.size - 1
    out = np.empty(rows.shape[0], dtype=np.float64)
    for lo in range(0, n, _BATCH):
        hi = min(n, lo + _BATCH)
        x, mask, (d, pos) = padded(rows, offsets, lo, hi)
        s = np.asarray(scorer(x, request[lo:hi], mask.astype(np.float32)), dtype=np.float64)
        out[offsets[lo]:offsets[hi]] = s[d, pos]
    return out


def one_hot(offsets: np.ndarray, choice: np.ndarray) -> np.ndarray:
    p = np.zeros(int(offsets[-1]), dtype=np.float64)
    p[offsets[:-1] + choice] = 1.0
    return p


def set_argmax(scores: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Index within each set of its best score (the first on ties, as ``np.argmax``)."""
    n = offsets.size - 1
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    best = np.maximum.reduceat(scores, offsets[:-1])
    hit = scores >= np.repeat(best, np.diff(offsets))
    owner = np.repeat(np.arange(n), np.diff(offsets))
    none = np.iinfo(np.int64).max
    first = np.full(n, none, dtype=np.int64)
    np.minimum.at(first, owner[hit], np.flatnonzero(hit))
    return np.where(first == none, 0, first - offsets[:-1])  # a set of NaN scores: its first entry


@dataclass
class ScoreArgmax:
    """Deterministic: the best score over the set (greedy via the reward prior, a learned router)."""

    name: str
    scorer: Scorer

    def probabilities(self, rows: np.ndarray, request: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        return one_hot(offsets, set_argmax(flat_scores(self.scorer, rows, request, offsets), offsets))


@dataclass
class Departing:
    """Deterministic: a learned router as it serves (``models.policy.LearnedPolicy``, the router's
    watchdog stage): on each set the network's argmax, unless the departure rule
    (:func:`models.policy.choose`, margin ``weights.margin``) keeps greedy's choice there --
    greedy as scored from the log (:func:`greedy_target`: the argmax of ``prior``'s scores of the
    logged rows). A margin of -inf is the network's argmax alone, +inf greedy alone."""

    name: str
    weights: RouterWeights
    prior: RewardPrior

    def probabilities(self, rows: np.ndarray, request: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        s = flat_scores(self.weights.scores, rows, request, offsets)
        margin = float(self.weights.margin)
        if margin == -math.inf:
            return one_hot(offsets, set_argmax(s, offsets))
        g = set_argmax(flat_scores(prior_scorer(self.prior), rows, request, offsets), offsets)
        choice = np.empty(offsets.size - 1, dtype=np.int64)
        for i in range(choice.size):
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            choice[i] = choose(s[lo:hi], np.arange(hi - lo), int(g[i]), margin) if hi > lo else 0
        return one_hot(offsets, choice)


@dataclass
class BaselineChoice:
    """Deterministic: a ``models.baselines`` policy's ``act`` on the logged rows of each set (it
    reads only the observation, so the log holds all it needs)."""

    name: str
    policy: Any

    def probabilities(self, rows: np.ndarray, request: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        n = offsets.size - 1
        choice = np.empty(n, dtype=np.int64)
        for i in range(n):
            x = rows[offsets[i]:offsets[i + 1]]
            k = x.shape[0]
            self.policy.n = k
            obs = {"offerings": x.reshape(-1), "request": request[i], "mask": np.ones(k, dtype=np.float32)}
            choice[i] = self.policy.act(obs, {"action_mask": np.ones(k, dtype=bool)})
        return one_hot(offsets, choice)


@dataclass
class Uniform:
    """Stochastic: every offering of the set alike (the ``random`` baseline)."""

    name: str = "random"

    def probabilities(self, rows: np.ndarray, request: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        sizes = np.diff(offsets)
        return np.repeat(1.0 / np.maximum(sizes, 1), sizes)


@dataclass
class Explore:
    """Stochastic: ``base`` with probability 1 - ``epsilon``, an offering of the set drawn uniformly
    otherwise -- a router exploring around its policy (``router.decision.ope_log``); ``--policy
    NAME:epsilon=EPS``."""

    name: str
    base: Target
    epsilon: float

    def probabilities(self, rows: np.ndarray, request: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        return ((1.0 - self.epsilon) * self.base.probabilities(rows, request, offsets)
                + self.epsilon * Uniform().probabilities(rows, request, offsets))


def prior_scorer(prior: RewardPrior) -> Scorer:
    return lambda rows, request, mask: prior.scores(rows, request)


def greedy_target(prior: RewardPrior) -> ScoreArgmax:
    """Greedy scored from the log: the argmax of ``envs.kernels.expected_reward`` over the rows."""
    return ScoreArgmax("greedy", prior_scorer(prior))


def reward_prior(header: LogHeader | None, env_cfg: Any) -> RewardPrior:
    """The reward the log was written with (its header), else ``env_cfg``'s."""
    rw = header.reward if header is not None else None
    if rw is None:
        return RewardPrior.from_env_config(env_cfg)
    return RewardPrior(rw.cost_weight, rw.latency_weight, rw.sla_penalty, rw.cost_norm_cap, rw.latency_norm_cap,
                       rw.retry_overhead_ms)


def reward_weights(env_cfg: Any) -> RewardWeights:
    rw = env_cfg.reward
    return RewardWeights(cost_weight=rw.cost_weight, latency_weight=rw.latency_weight, sla_penalty=rw.sla_penalty,
                         cost_norm_cap=rw.cost_norm_cap, latency_norm_cap=rw.latency_norm_cap,
                         failure_latency_norm=rw.failure_latency_norm, retry_overhead_ms=env_cfg.retry_overhead_ms)


def resolve_target(name: str, prior: RewardPrior, cfg: Any) -> tuple[Target, dict[str, Any] | None]:
    """A ``--policy`` as a target scored from the log, and the registry version it is (``None``
    for a baseline or a path). Learned routers resolve like ``xroute evaluate`` does;
    ``NAME:epsilon=EPS`` is ``NAME`` exploring with probability EPS (:class:`Explore`; no
    registry version: it is not the model ``promote --ope`` judges)."""
    base, sep, eps = name.rpartition(":epsilon=")
    if sep:
        try:
            epsilon = float(eps)
        except ValueError:
            epsilon = -1.0
        if not 0.0 <= epsilon <= 1.0:
            raise ConfigError(f"--policy: '{name}': epsilon must be a number from 0 to 1, got '{eps}'")
        return Explore(name, resolve_target(base, prior, cfg)[0], epsilon), None
    if name.startswith(("models:/", "runs:/")) or Path(name).exists():
        info = model_version(name) if name.startswith("models:/") else None
        pol = load_policy(f"models:/{info['registered_model']}/{info['version']}" if info else name)
        return Departing(name, pol.weights, prior), info
    if name == "greedy":
        return greedy_target(prior), None
    if name == "random":
        return Uniform(), None
    if name in OFFLINE_BASELINES:
        from models.baselines import make_baseline

        return BaselineChoice(name, make_baseline(name, cfg)), None
    from models.baselines import BASELINES, make_baseline

    if name in BASELINES or name.startswith("static") or name.startswith("hindsight"):
        raise ConfigError(f"--policy: '{name}' cannot be scored from a log (it needs the live environment: the "
                          f"catalog, its own history or the future); offline: {', '.join(OFFLINE_BASELINES)}, "
                          "models:/NAME@ALIAS, runs:/… or an exported router directory")
    make_baseline(name, cfg)  # raises the unknown-policy line with close matches
    raise ConfigError(f"--policy: unknown policy '{name}'")  # pragma: no cover


# ---------------------------------------------------------------------------- evaluation
def check_layout(log: DecisionLog) -> None:
    """The log's feature names must be the ones ``envs.features`` defines now."""
    h = log.header
    for what, got, want in (("offering_features", h.offering_features, OFFERING_FEATURES),
                            ("request_features", h.request_features, REQUEST_FEATURES)):
        if tuple(got) != tuple(want):
            diff = next((f"'{a}' where envs.features has '{b}'" for a, b in zip(got, want) if a != b),
                        f"{len(got)} names, envs.features has {len(want)}")
            raise LogError(f"{log.path or 'log'}: header: field '{what}': {diff}; the log was written with "
                           "another feature layout")


def q_hat(log: DecisionLog, prior: RewardPrior, calibrate: bool = True) -> np.ndarray:
    """The direct-method model for every flat entry: the reward prior, linearly calibrated on the
    logged actions with two-fold cross-fitting (module docstring); the plain prior when
    ``calibrate`` is off or the log is too small to fit (fewer than 20 decisions a fold)."""
    q = flat_scores(prior_scorer(prior), log.rows, log.request, log.offsets)
    n = log.n
    if not calibrate or n < 40:
        return q
    x, y = q[log.chosen_flat], log.reward
    fold = np.arange(n) % 2
    owner = np.repeat(fold, log.sizes)
    out = np.empty_like(q)
    for f in (0, 1):
        other = fold != f
        xo, yo = x[other], y[other]
        var = float(xo.var())
        beta = float(((xo - xo.mean()) * (yo - yo.mean())).mean()) / var if var > 1e-12 else 1.0
        alpha = float(yo.mean()) - beta * float(xo.mean())
        out[owner == f] = alpha + beta * q[owner == f]
    return out


@dataclass
class OPEResult:
    name: str
    ips: Estimate
    snips: Estimate
    dr: Estimate
    dm: Estimate
    ess: float
    agreement: float
    n: int
    model: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "ips": self.ips.to_dict(), "snips": self.snips.to_dict(),
                "dr": self.dr.to_dict(), "dm": {"value": self.dm.value}, "ess": self.ess,
                "agreement": self.agreement, "decisions": self.n}


def evaluate_target(log: DecisionLog, target: Target, q: np.ndarray, model: dict[str, Any] | None = None
                    ) -> OPEResult:
    """Every estimate of ``target`` on ``log`` with the direct-method model ``q`` (:func:`q_hat`)."""
    pi = target.probabilities(log.rows, log.request, log.offsets)
    chosen = log.chosen_flat
    w = pi[chosen] / log.propensity
    n = log.n
    owner = np.repeat(np.arange(n), log.sizes)
    q_target = np.bincount(owner, weights=pi * q, minlength=n)
    e = estimates(w, log.reward, q[chosen], q_target)
    return OPEResult(target.name, e["ips"], e["snips"], e["dr"], e["dm"], effective_sample_size(w),
                     float(pi[chosen].mean()) if n else float("nan"), n, model)


def logged_value(log: DecisionLog) -> Estimate:
    """The logging policy's own mean reward (on-policy, with its normal 95 % interval)."""
    return _normal(log.reward)


# ---------------------------------------------------------------------------- reports
def report_dict(log: DecisionLog, results: Sequence[OPEResult], calibrated: bool) -> dict[str, Any]:
    policies, counts = np.unique(log.policy.astype(str), return_counts=True)
    return {
        "format": REPORT_FORMAT,
        "log": {"path": log.path, "decisions": log.n, "pending": log.pending, "source": log.header.source,
                "logging_policies": {str(p): int(c) for p, c in zip(policies, counts)},
                "logged_mean": logged_value(log).to_dict()},
        "method": {"ci": "95 %: normal approximation over decisions (IPS, DR, logged mean), delta method (SNIPS)",
                   "q_hat": "reward prior (envs.kernels.expected_reward of the logged rows)"
                            + (", linear calibration on the logged actions, 2-fold cross-fitted" if calibrated
                               else ", uncalibrated")},
        "policies": {r.name: r.to_dict() for r in results},
    }


def print_table(report: dict[str, Any], echo: Callable[[str], None]) -> None:
    """The report as a table: each estimate ± half its interval, the ESS and the agreement."""
    from rich.console import Console
    from rich.table import Table

    lg = report["log"]
    lm = lg["logged_mean"]
    t = Table(title=f"xroute ope — {lg['decisions']} decisions ({lg['pending']} pending) from {lg['path']}",
              caption=f"estimate ± half the 95 % interval; logged mean {_pm(lm)}; ESS = effective sample size "
                      f"(! under {MIN_ESS}: trust no interval); agree = share of decisions where the policy picks the "
                      "logged action")
    for c in ("policy", "IPS", "SNIPS", "DR", "DM", "ESS", "agree"):
        t.add_column(c, justify="left" if c == "policy" else "right")
    for name, r in report["policies"].items():
        ver = f" (v{r['model']['version']})" if r.get("model") else ""
        t.add_row(name + ver, _pm(r["ips"]), _pm(r["snips"]), _pm(r["dr"]), f"{r['dm']['value']:.4f}",
                  f"{r['ess']:.0f}" + ("!" if r["ess"] < MIN_ESS else ""), f"{100 * r['agreement']:.1f} %")
    console = Console(width=160, record=True)
    with console.capture() as cap:
        console.print(t)
    echo(cap.get().rstrip("\n"))


def _pm(e: dict[str, Any]) -> str:
    v, (lo, hi) = e["value"], e["ci95"]
    if v is None or not math.isfinite(v):
        return "—"
    return f"{v:.4f}" if not math.isfinite(lo) else f"{v:.4f} ±{(hi - lo) / 2:.4f}"


def load_report(path: str | Path) -> dict[str, Any]:
    """An ``xroute ope`` report (JSON), or one line saying why it is not one."""
    import json

    p = Path(path)
    try:
        report = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"--ope: cannot read {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--ope: {p} is not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        raise ConfigError(f"--ope: {p}: field 'format': not an xroute ope report ('{REPORT_FORMAT}')")
    return report


def promotion_check(report: dict[str, Any], registered_model: str, challenger: str, champion: str | None,
                    estimator: str = "dr", source: str = "the OPE report") -> tuple[bool, str]:
    """The OPE rule of ``xroute promote --ope``: the challenger's lower 95 % bound (``estimator``)
    must be above the champion's point estimate in the same report, or above the logged mean
    reward when the report has no estimate of the champion. Returns (passed, the numbers)."""
    if estimator not in ESTIMATORS:
        raise ConfigError(f"--ope-estimator: '{estimator}' is not one of {', '.join(ESTIMATORS)}")
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        raise ConfigError(f"--ope: {source} is not an xroute ope report (field 'format' is not '{REPORT_FORMAT}')")

    def entry(version: str | None) -> dict[str, Any] | None:
        for r in report.get("policies", {}).values():
            m = r.get("model") or {}
            if version is not None and m.get("registered_model") == registered_model and \
                    str(m.get("version")) == str(version):
                return dict(r)
        return None

    est = estimator.upper()
    ch = entry(challenger)
    if ch is None:
        have = ", ".join(f"{k}" for k in report.get("policies", {})) or "none"
        return False, (f"{source} has no estimate of challenger v{challenger} of {registered_model} (it has: {have}); "
                       f"run xroute ope --log LOG --policy models:/{registered_model}@challenger")
    lo = ch[estimator]["ci95"][0]
    if lo is None or not math.isfinite(lo):
        return False, f"the challenger's {est} lower bound is undefined in {source} (no decision agrees with the log)"
    champ = entry(champion)
    if champ is not None:
        ref, what = champ[estimator]["value"], f"champion v{champion}'s {est} estimate"
    else:
        ref = report["log"]["logged_mean"]["value"]
        what = "the logged mean reward" + (f" (champion v{champion} is not in {source})" if champion else
                                           " (there is no champion)")
    n = report["log"]["decisions"]
    ok = bool(lo > ref)
    return ok, (f"OPE on {n} logged decisions: challenger v{challenger}'s {est} lower bound {lo:.4f} "
                f"{'>' if ok else '<='} {what} {ref:.4f}")


# ------------------------------------------------------------------- simulated logs (tests, demo)
@dataclass
class EpsilonGreedy:
    """The logging policy of a simulated log: ``around``'s argmax with probability 1 - eps, a
    uniformly drawn offering of the set otherwise; its propensity is exact: (1 - eps) + eps/|A|
    for the argmax, eps/|A| for the others."""

    around: Target
    epsilon: float
    rng: np.random.Generator

    def choose(self, rows: np.ndarray, request: np.ndarray) -> tuple[int, float]:
        k = rows.shape[0]
        best = int(np.argmax(self.around.probabilities(rows, request[None], np.array([0, k]))))
        a = int(self.rng.integers(k)) if self.rng.random() < self.epsilon else best
        return a, (1.0 - self.epsilon) * (a == best) + self.epsilon / k


class OnPolicy:
    """A target run in the environment (``models.baselines.Policy``): it sees the valid rows of
    the observation, as the log records them. Used for the true value of a simulated log."""

    def __init__(self, target: Target):
        self.target, self.name = target, target.name

    def reset(self, env: Any, seed: int) -> None:
        self.n = env.n
        self.rng = np.random.default_rng(seed)

    def act(self, obs: dict[str, np.ndarray], info: dict[str, Any]) -> int:
        valid = np.flatnonzero(info["action_mask"][: self.n])
        if valid.size == 0:
            return 0
        rows = obs["offerings"].reshape(-1, len(OFFERING_FEATURES))[valid]
        p = self.target.probabilities(rows, np.asarray(obs["request"])[None], np.array([0, valid.size]))
        return int(valid[int(np.argmax(p)) if p.max() >= 1.0 else int(self.rng.choice(valid.size, p=p))])


@dataclass
class SimulatedLog:
    header: LogHeader
    records: list[LoggedDecision]
    #: per record, the reward every offering of its set would really have got (``env.exact_rewards``:
    #: hindsight, the same state and noise draw): the simulator's counterfactual truth
    hindsight: list[np.ndarray] = field(default_factory=list, repr=False)
    skipped: int = 0  #: requests with no valid offering (no decision to log)

    def log(self) -> DecisionLog:
        return DecisionLog.from_records(self.header, self.records)

    def value_on_log(self, target: Target) -> float:
        """What ``target`` would have got on the logged decisions themselves -- each in the state
        the logging policy left, with the same noise draw. The estimators aim at this; the gap to
        :func:`true_value` (``target`` steering the queues itself) is the interference of
        congestion, which no estimator from this log can see."""
        lg = self.log()
        pi = target.probabilities(lg.rows, lg.request, lg.offsets)
        owner = np.repeat(np.arange(lg.n), lg.sizes)
        return float(np.bincount(owner, weights=pi * np.concatenate(self.hindsight), minlength=lg.n).mean())


def simulate_log(bundle: Any, env_cfg: Any, epsilon: float, seeds: Sequence[int], around: Target | None = None,
                 source: str = "") -> SimulatedLog:
    """Drive ``envs.cloud_route.CloudRouteEnv`` on ``bundle`` with an epsilon-greedy logging
    policy around ``around`` (default: greedy from the reward prior) for each seed, logging
    every decision: the valid set's ids and rows, the request vector, the chosen index, its
    exact propensity and the step's realized reward and outcome."""
    from datetime import UTC, datetime

    from envs.cloud_route import CloudRouteEnv
    from envs.features import offering_matrix

    if not 0.0 <= epsilon <= 1.0:
        raise ConfigError(f"--epsilon: must be in [0, 1], got {epsilon}")
    env = CloudRouteEnv(bundle, env_cfg)
    prior = RewardPrior.from_env_config(env.cfg)
    around = around if around is not None else greedy_target(prior)
    name = f"epsilon-greedy({around.name})"
    header = LogHeader(offering_features=list(OFFERING_FEATURES), request_features=list(REQUEST_FEATURES),
                       reward=reward_weights(env.cfg), source=source or f"simulate {env.bundle.path.name} "
                                                                         f"eps={epsilon:g}")
    ids = np.array([o.offering_id for o in env.catalog], dtype=object)
    w = env.bundle.workload
    tenants = w["tenant"].astype(str).to_numpy() if "tenant" in w.columns else np.full(len(w), "", dtype=object)
    records: list[LoggedDecision] = []
    hindsight: list[np.ndarray] = []
    skipped = 0
    for seed in seeds:
        obs, info = env.reset(seed=seed)
        logger = EpsilonGreedy(around, epsilon, np.random.default_rng([seed, 0x09E]))
        done = env._pos >= env._end
        while not done:
            valid = np.flatnonzero(info["action_mask"][: env.n])
            pos, rid, t = env._pos, info["request_id"], info["t"]
            if valid.size == 0:
                skipped += 1
                obs, _, _, done, info = env.step(0)
                continue
            rows = offering_matrix(obs)[valid].copy()
            request = np.asarray(obs["request"], dtype=np.float32).copy()
            a, prop = logger.choose(rows, request)
            out_tokens = int(env.req_out[pos])
            hindsight.append(env.exact_rewards()[valid])
            obs, r, _, done, info = env.step(int(valid[a]))
            lat, ttft = info["latency_ms"], info["ttft_ms"]
            records.append(LoggedDecision(
                decision_id=f"{seed}:{rid}", tenant=str(tenants[pos]),
                ts=datetime.fromtimestamp(float(t), UTC).isoformat(), action_set=list(ids[valid]),
                offering_features=rows.tolist(), request_features=request.tolist(), chosen=a, propensity=prop,
                policy=name, epsilon=epsilon, reward=float(r),
                feedback=Feedback(cost_usd=info["cost_usd"], latency_ms=None if lat != lat else lat,
                                  ttft_ms=None if ttft != ttft else ttft, output_tokens=out_tokens,
                                  sla_violation=bool(info["sla_violation"]), failed=bool(info["failed"]))))
    return SimulatedLog(header, records, hindsight, skipped)


def true_value(bundle: Any, env_cfg: Any, target: Target, seeds: Sequence[int]) -> float:
    """``target``'s mean reward run on-policy on the same stream and seeds
    (``models.evaluate.run_policy``): the truth a simulated log's estimates aim at."""
    from envs.cloud_route import CloudRouteEnv
    from models.evaluate import run_policy

    env = CloudRouteEnv(bundle, env_cfg)
    pol = OnPolicy(target)
    return float(np.mean([run_policy(env, pol, s, compare_greedy=False).metrics["mean_reward"] for s in seeds]))


@dataclass
class SyntheticBandit:
    """A contextual bandit whose truth is exact: contexts are drawn uniformly from ``n_contexts``
    fixed ones (each an action set of 2..``max_actions`` feature rows), the mean reward of an
    action is ``mu = prior + tilt * (busy - 0.5)`` -- the reward prior (what ``q`` starts from)
    misses the ``busy`` term -- and a reward is ``mu`` plus Gaussian noise. The value of a policy
    is then ``mean_k sum_a pi(a|x_k) mu(x_k, a)`` over the fixed contexts, exactly."""

    rows: np.ndarray
    request: np.ndarray
    offsets: np.ndarray
    mu: np.ndarray
    prior: RewardPrior
    noise_sd: float
    header: LogHeader = field(repr=False, default_factory=lambda: LogHeader(
        offering_features=list(OFFERING_FEATURES), request_features=list(REQUEST_FEATURES), source="synthetic"))

    @classmethod
    def make(cls, prior: RewardPrior, n_contexts: int = 400, max_actions: int = 8, tilt: float = 0.6,
             noise_sd: float = 0.5, seed: int = 0) -> SyntheticBandit:
        rng = np.random.default_rng(seed)
        sizes = rng.integers(2, max_actions + 1, n_contexts)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        t = int(offsets[-1])
        rows = rng.uniform(OFFERING_LOW, OFFERING_HIGH, (t, len(OFFERING_FEATURES))).astype(np.float32)
        rows[:, F["valid"]] = 1.0
        rows[:, F["exp_cost"]] = rng.uniform(0.2, 2.5, t)
        rows[:, F["exp_latency"]] = rng.uniform(0.2, 1.5, t)
        rows[:, F["exp_violation"]] = rng.uniform(0.0, 1.0, t) ** 3
        rows[:, F["preempt_risk"]] = np.where(rng.random(t) < 0.5, 0.0, rng.uniform(0.0, 0.3, t))
        request = rng.uniform(REQUEST_LOW, REQUEST_HIGH, (n_contexts, len(REQUEST_FEATURES))).astype(np.float32)
        request[:, RQ["budget"]] = np.log1p(rng.uniform(2000.0, 20000.0, n_contexts)) / 12.0
        base = flat_scores(prior_scorer(prior), rows, request, offsets)
        mu = base + tilt * (rows[:, F["busy"]].astype(float) - 0.5)
        return cls(rows, request, offsets, mu, prior, noise_sd)

    @property
    def n_contexts(self) -> int:
        return int(self.offsets.size - 1)

    def value(self, target: Target) -> float:
        """The exact value of ``target``."""
        pi = target.probabilities(self.rows, self.request, self.offsets)
        owner = np.repeat(np.arange(self.n_contexts), np.diff(self.offsets))
        return float(np.bincount(owner, weights=pi * self.mu, minlength=self.n_contexts).mean())

    def log(self, n: int, epsilon: float, seed: int) -> DecisionLog:
        """``n`` decisions of an epsilon-greedy logging policy around the prior's argmax."""
        rng = np.random.default_rng(seed)
        sizes_all = np.diff(self.offsets)
        best_all = set_argmax(flat_scores(prior_scorer(self.prior), self.rows, self.request, self.offsets),
                              self.offsets)
        ctx = rng.integers(0, self.n_contexts, n)
        sizes = sizes_all[ctx]
        explore = rng.random(n) < epsilon
        chosen = np.where(explore, (rng.random(n) * sizes).astype(np.int64), best_all[ctx])
        prop = np.where(chosen == best_all[ctx], 1.0 - epsilon, 0.0) + epsilon / sizes
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        src = np.repeat(self.offsets[ctx], sizes) + (np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], sizes))
        reward = self.mu[self.offsets[ctx] + chosen] + self.noise_sd * rng.standard_normal(n)
        return DecisionLog(header=self.header, decision_id=np.array([f"d{i}" for i in range(n)], dtype=object),
                           tenant=np.full(n, "", dtype=object), offsets=offsets,
                           action_ids=np.array([f"o{j}" for j in src], dtype=object), rows=self.rows[src],
                           request=self.request[ctx], chosen=chosen, propensity=prop, reward=reward,
                           policy=np.full(n, f"epsilon-greedy(greedy) eps={epsilon:g}", dtype=object))
