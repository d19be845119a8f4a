"""The champion's watchdog: a running doubly robust estimate of *champion minus greedy* on this
router's own recent traffic, and the switch to greedy when it is confidently negative
(``watchdog:`` in the router settings; docs/ope.md, "The watchdog").

**What is logged.** Beside every decision the decision log keeps what greedy (the argmax of the
expected reward plus the routing policies' bias over the same action set: the fallback's ranking,
``RoutingEngine._choose``) would have chosen: ``decisions.greedy_offering_id``, computed by the
``watchdog`` stage (``router.decision.stages.Watchdog``) from the expected rewards the environment
has for the request already; when greedy itself decided, it is the choice.

**The estimate.** When a decision's feedback arrives (``POST /v1/feedback``, or the gateway's own
measurement) with its realized reward ``r`` (``RoutingEngine.feedback_reward``: the one reward
definition), and the decision was made by the champion now loaded (``policy_kind`` model, the
same version) with its OPE record (``log_features``), its paired term is the doubly robust
difference of two deterministic targets, champion ``c`` and greedy ``g``, over the logged
action ``a`` with propensity ``p``::

    d = q(c) - q(g) + (1[a = c] - 1[a = g]) / p * (r - q(a))

plus greedy's **twin** figure (below): ``q(g)`` is greedy's model value *in the state greedy would
have built*, not in the champion's::

    d = q(c) - (q(g) + delta) + (1[a = c] - 1[a = g]) / p * (r - q(a))

``q`` is the reward model ``xroute ope`` uses (``models.policy.RewardPrior`` on the logged rows:
greedy's own expected reward), calibrated by an offset, ``q = prior + alpha``, learned only from
*earlier* decisions (never the decision's own reward): ``alpha`` is the mean residual (realized
reward - prior) of the earlier decisions that served greedy's choice (the champion agreed with
greedy), once there are 30 of them; else of every earlier served offering, once there are 30; else
0. Why greedy's own residuals: greedy's choice is the argmax of the prior, so its prior is the most
optimistic of the set (the winner's curse) -- a residual taken from other offerings would leave
that optimism in ``q(g)`` and make every departure from greedy look worse than it is. And only an
offset, not ``xroute ope``'s slope: one champion's served offerings span a narrow range of the
prior, and a slope fitted there extrapolates to greedy's choices wildly (seen: the priciest
offerings, prior -3.2 +- 0.01, greedy's -0.07). Where ``c == g`` the term is exactly 0.
Where they differ and the champion's choice was served (no exploration: ``p = 1``) it is
``r - q(g)``: the champion's *realized* reward against the model's counterfactual for greedy's.
An explored decision adds the importance-weighted correction (``p`` < 1).

**Greedy's twin** (``envs.twin``, :meth:`Watchdog.attach`). Judged in the queues the champion's
routing left, greedy's choice looks better than greedy is: a champion that spreads load leaves
greedy's favourite pools uncongested, and greedy routing everything itself would have crowded them
(docs/ope.md, "The watchdog": the false alarms this caused). So this process keeps a twin of its
router view in which greedy routed every request this process decided (``watchdog`` stage, every
decision, whoever decided it): greedy's choice there takes a twin slot for its expected service
time and ends when the real request is seen to end (feedback, or the real view's expected end),
scaled to greedy's pool (``envs.twin``: the real request's realized duration is the only
evidence of greedy's; greedy's own was never served). ``delta`` is the environment's one-step
expected reward (``envs.kernels``: the same kernel greedy ranks by) of greedy's choice in the twin
minus of its real choice in the real state: 0 where the twin's queues are the real ones. The
champion's side is unchanged: realized where it departs (``r``), the model where it agrees with
greedy in the real state (then ``d = q(c) - q(g) - delta``: the model's view of what greedy's own
queues would have changed, the residual cancelling on both sides as before). The offset ``alpha``
is learned in the real state (greedy-agreeing decisions' residuals) and carried to the twin's
predictions: the prior's winner's curse at greedy's argmax is the same there; the queue model's
error under greedy's heavier load is not measured by it (greedy's twin is never served) -- what
is left of the bias (docs/ope.md). A decision's ``delta`` is kept in this process until its
feedback (at most ``TWIN_PENDING``); a champion's decision whose feedback reaches a process that
did not decide it (another router, or this one after a restart) has none and is left out.

**The verdict: a confidence sequence** (anytime-valid). The terms are averaged over *every*
decision of the champion since it was loaded (or since the last reset): the running mean and a
two-sided **asymptotic confidence sequence** at ``confidence`` around it (Waudby-Smith, Arbour,
Sinha, Kennedy & Ramdas, "Time-uniform central limit theory and asymptotic confidence sequences",
Annals of Statistics 2024, arXiv:2103.06476, Theorem 2.2; its boundary is Robbins' normal mixture
with the variance estimated)::

    mean +- sd * sqrt( 2 (n rho^2 + 1) / (n^2 rho^2) * log( sqrt(n rho^2 + 1) / alpha ) )

with ``alpha = 1 - confidence``, ``sd`` the terms' sample standard deviation and ``rho`` chosen so
the boundary is tightest at ``horizon`` terms (``rho^2 = (-W_-1(-alpha^2 / e) - 1) / horizon``, the
paper's exact optimum; :func:`cs_rho2`). From ``min_decisions`` terms on, the verdict is read
after every new term, and an upper bound below ``-margin`` *trips* the watchdog. Why a confidence
sequence: the verdict is read after every term, and a fixed-level interval (``mean +- z * sd /
sqrt(n)``, :func:`normal_interval`, what the watchdog used before) read that way is optional
stopping -- its chance of *ever* lying wholly below the truth over 1,500 looks is several times
``alpha`` (``tests/test_watchdog.py`` measures it); the confidence sequence holds the running mean
of the terms' means at every ``n`` at once with probability about ``confidence`` (asymptotically:
the normal approximation, as the fixed interval's), so reading it after every term is what it is
for. Why every term since loading and not a sliding window: a confidence sequence restarted or
slid over windows is no longer anytime-valid (each window is a fresh chance to cross). The cost: a
champion that turns bad late is judged on its whole history, so its verdict comes later, the
later the more good decisions it made first; an operator's reset (below) starts the sequence
again. It keeps only the count, the mean and the sum of squared deviations (Welford), no terms.
Tripped, the ``watchdog`` stage makes every later decision greedy's (the answer's ``policy`` says
``watchdog``), and it stays tripped -- no more terms are added -- until a new champion version is
loaded (the sequence starts again for it) or an operator resets it (``POST
/v1/admin/watchdog/reset``, audited; the sequence starts again).

**Who feeds it.** ``POST /v1/feedback`` (``router.service.outcomes.record_feedback``) and the
gateway's own measurement of an attempt (``router.gateway.service``: for a champion's decision, one
lookup of its logged record after the answer), each with the decision's first outcome.

**Across routers.** The twin is per process: it is greedy routing *this* process's decisions; the
work other routers hold on a pool enters the twin as it enters the real view (``view_others``),
as the champion's load, never as greedy's -- so with several routers the twin is greedy on this
router's share only, and the state it models is part greedy's, part the champion's.
A trip and a reset are audit entries every router process reads
(``router.service.watchdog_sync``): a trip anywhere makes greedy decide on every router within
``watchdog.sync_s``, a reset anywhere hands the decisions back everywhere. The estimates are per
process (each from the outcomes it receives), in memory: a restart starts its sequence again (and
adopts the last shared verdict on the champion it loads).
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
from scipy.special import lambertw

from envs.twin import GreedyTwin
from models.policy import RewardPrior
from router.core.logs import LOG, iso
from router.decision import ope_log

#: earlier residuals needed before the reward model is calibrated
CALIBRATE_MIN = 30
#: the champion's decisions whose twin figure waits for their feedback, at most (the oldest go first)
TWIN_PENDING = 100_000


@dataclass(frozen=True, slots=True)
class Observation:
    """What one decision's feedback tells the watchdog (``None`` fields: nothing to learn)."""

    policy_kind: str
    policy_version: str | None
    features: bytes | None
    propensity: float | None
    greedy_offering_id: str | None
    reward: float | None
    #: the decision (its twin's figure is kept by it in this process: ``Watchdog.twin``)
    decision_id: str | None = None


def paired_term(q_c: float, q_g: float, q_a: float, served_c: bool, served_g: bool, p: float, r: float) -> float:
    """One decision's doubly robust champion-minus-greedy term (module docstring); 0 when the
    champion's choice is greedy's (``q_c == q_g`` and ``served_c == served_g``)."""
    w = (float(served_c) - float(served_g)) / p
    return q_c - q_g + w * (r - q_a)


def normal_interval(terms: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """(mean, lower, upper) of the fixed-level normal interval over ``terms`` at two-sided
    ``confidence``: valid read once, not after every term (the verdict's confidence sequence is;
    module docstring). Kept as the comparison the tests and ``benchmarks/bench_watchdog.py`` make."""
    n = terms.size
    mean = float(terms.mean())
    if n < 2:
        return mean, -math.inf, math.inf
    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    half = z * float(terms.std(ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half


def cs_rho2(horizon: int, confidence: float) -> float:
    """The confidence sequence's ``rho^2`` that makes its boundary tightest at ``horizon`` terms:
    ``(-W_-1(-alpha^2 / e) - 1) / horizon``, ``alpha = 1 - confidence`` (Waudby-Smith et al. 2024,
    the exact optimum of the normal-mixture boundary; ``W_-1`` the lower branch of Lambert's W)."""
    alpha = 1.0 - confidence
    return float(-lambertw(-alpha * alpha / math.e, -1).real - 1.0) / horizon


def cs_halfwidth(n: Any, sd: Any, confidence: float, rho2: float) -> Any:
    """The two-sided asymptotic confidence sequence's half-width after ``n`` terms of sample
    standard deviation ``sd`` (module docstring; Waudby-Smith et al. 2024, Theorem 2.2):
    ``sd * sqrt(2 (n rho^2 + 1) / (n^2 rho^2) * log(sqrt(n rho^2 + 1) / alpha))``. Scalars or
    numpy arrays (the tests evaluate it over many simulated sequences at once)."""
    v = np.asarray(n, dtype=float) * rho2 + 1.0
    return sd * np.sqrt(2.0 * v / (np.square(np.asarray(n, dtype=float)) * rho2)
                        * np.log(np.sqrt(v) / (1.0 - confidence)))


class WatchdogEstimator:
    """The paired terms' running mean and confidence sequence since the champion was loaded, the
    calibration and the verdict -- no router, no I/O: what the router runs and what
    ``benchmarks/bench_watchdog.py`` measures. ``horizon``: the number of terms at which the
    confidence sequence is tightest (:func:`cs_rho2`)."""

    def __init__(self, horizon: int, min_decisions: int, confidence: float, margin: float):
        self.horizon, self.min_decisions, self.confidence, self.margin = horizon, min_decisions, confidence, margin
        self.rho2 = cs_rho2(horizon, confidence)
        self.reset()

    def reset(self) -> None:
        # the terms since the start: their number, mean and sum of squared deviations (Welford)
        self.n = 0
        self._mean = self._m2 = 0.0
        # the residuals (reward - prior of the served) of the decisions seen so far, and of those
        # that served greedy's choice
        self._n = self._ng = 0
        self._sr = self._srg = 0.0
        self.tripped = False
        self.seen = 0
        self.estimate: tuple[float, float, float] | None = None

    def calibration(self) -> float:
        """The offset ``alpha`` of ``q = prior + alpha`` (module docstring): the mean residual
        (reward - prior) of greedy's choices served so far, once there are ``CALIBRATE_MIN``; else
        of every offering served so far, once there are that many; else 0."""
        if self._ng >= CALIBRATE_MIN:
            return self._srg / self._ng
        return self._sr / self._n if self._n >= CALIBRATE_MIN else 0.0

    def add(self, d: float) -> None:
        """One term into the running mean and the estimate (mean, lower, upper): the confidence
        sequence's bounds (module docstring)."""
        self.n += 1
        step = d - self._mean
        self._mean += step / self.n
        self._m2 += step * (d - self._mean)
        if self.n < 2:
            return
        half = float(cs_halfwidth(self.n, math.sqrt(self._m2 / (self.n - 1)), self.confidence, self.rho2))
        self.estimate = (self._mean, self._mean - half, self._mean + half)

    def observe(self, prior_c: float, prior_g: float, prior_a: float, served_c: bool, served_g: bool, p: float,
                r: float, twin: float = 0.0) -> bool:
        """Add one decision's term (its q from the calibration *before* its own reward), then fold
        its residual into the calibration. ``twin``: greedy's expected reward in its twin's state
        minus in the real state (``envs.twin``), added to greedy's q (module docstring). Returns
        True when this term tripped the watchdog."""
        if self.tripped:
            return False
        alpha = self.calibration()
        self.add(paired_term(prior_c + alpha, prior_g + alpha + twin, prior_a + alpha, served_c, served_g, p, r))
        self._n += 1
        self._sr += r - prior_a
        if served_g:
            self._ng += 1
            self._srg += r - prior_a
        self.seen += 1
        return self.judge()

    def judge(self) -> bool:
        """The verdict on the terms so far (read after every term): trips -- and says True -- from
        ``min_decisions`` terms on when the confidence sequence's upper bound is below ``-margin``."""
        if not self.tripped and self.estimate is not None and self.n >= self.min_decisions \
                and self.estimate[2] < -self.margin:
            self.tripped = True
            return True
        return False


class Watchdog:
    """The router's watchdog (module docstring): the estimator for the champion loaded now, fed
    by the feedback path (:meth:`observe`), read by the ``watchdog`` stage (:attr:`tripped`),
    ``GET /v1/offerings`` and the metrics (:meth:`describe`), reset by an operator (:meth:`reset`)."""

    def __init__(self, settings: Any, offering_ids: list[str], catalog_key: str, prior: RewardPrior,
                 log_features: bool):
        self.settings = settings
        self.enabled = bool(settings.enabled)
        self.log_features = log_features
        self.prior = prior
        self.catalog_key = catalog_key
        self.index = {o: i for i, o in enumerate(offering_ids)}
        self.est = WatchdogEstimator(settings.horizon, settings.min_decisions, settings.confidence, settings.margin)
        #: the champion version the sequence is about (None: none yet)
        self.version: str | None = None
        #: since when the state holds (wall seconds): the sequence's start, or the trip
        self.since = time.time()
        self.tripped = False
        self.resets = 0
        #: the answer's ``policy`` while tripped (set at the trip)
        self.info: dict[str, Any] = {}
        #: this process, as its shared verdicts name it (``router.service.watchdog_sync``)
        self.token = uuid.uuid4().hex[:16]
        #: the last shared verdict per champion version: (trip or reset, the state it recorded)
        self.shared: dict[str, tuple[str, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        #: greedy's twin (``envs.twin``; :meth:`attach`): None until attached, and when off
        self.twin: GreedyTwin | None = None
        #: per champion decision of this process awaiting its feedback: its twin figure
        self._twin_delta: OrderedDict[str, float] = OrderedDict()

    def attach(self, env: Any) -> None:
        """Keep greedy's twin of ``env``'s router view (``envs.twin``; only when enabled with the
        features logged): the ``watchdog`` stage routes every decision of this process in it, the
        engine tells it what it admits, the environment what completes."""
        if self.enabled and self.log_features:
            self.twin = GreedyTwin(env)

    def twin_step(self, decision_id: str, valid: np.ndarray, greedy: int, bias: np.ndarray | None,
                  allowed: np.ndarray | None, champion: bool) -> None:
        """The current request routed by greedy in the twin (``GreedyTwin.step``); for a decision
        of the champion watched (``champion``), its figure is kept for its feedback."""
        if self.twin is None:
            return
        _, delta = self.twin.step(decision_id, valid, greedy, bias, allowed)
        if champion and not self.tripped:
            pend = self._twin_delta
            pend[decision_id] = delta
            if len(pend) > TWIN_PENDING:
                pend.popitem(last=False)

    def follow(self, version: str | None) -> None:
        """The champion now loaded is ``version``: a new one starts the sequence again (and untrips),
        tripped at once when another router's last verdict on it was a trip."""
        if version != self.version:
            with self._lock:
                if version != self.version:
                    self.version = version
                    self._restart()
                    got = self.shared.get(version or "")
                    if got is not None and got[0] == "trip":
                        self._trip(got[1], shared=True)

    def shared_verdict(self, version: str, action: str, after: dict[str, Any]) -> None:
        """Another router's verdict (``router.service.watchdog_sync``): kept for ``version``; a trip
        of the champion watched here trips this process too, a reset of it starts the sequence again.
        This process's own verdicts are only kept."""
        self.shared[version] = (action, after)
        if after.get("by") == self.token:
            return
        with self._lock:
            if version != self.version:
                return
            if action == "trip" and not self.tripped:
                self._trip(after, shared=True)
            elif action == "reset":
                self._restart()
                LOG.warning("watchdog reset on another router: the champion decides again",
                            extra={"fields": {"version": self.version}})

    def _trip(self, state: dict[str, Any], shared: bool) -> None:
        """Trip (under the lock): greedy decides from now on; ``state``: the estimate that tripped
        (``describe()``'s, of this process or of another)."""
        self.since = time.time()
        mean, (lo, hi), n = state.get("estimate") or 0.0, state.get("interval") or (0.0, 0.0), state.get("n", 0)
        where = "another router's" if shared else "recent"
        self.info = {"name": "greedy", "kind": "fallback", "version": None, "uri": None,
                     "reason": f"watchdog: champion {self.version} worse than greedy on {where} traffic "
                               f"({mean:+.5f} [{lo:+.5f}, {hi:+.5f}], n={n})"}
        self.tripped = True
        LOG.warning("watchdog tripped: the champion is confidently worse than greedy on "
                    + ("another router's" if shared else "recent") + " traffic; serving greedy until a new champion "
                    "is loaded or an operator resets it",
                    extra={"fields": {"version": self.version, "estimate": round(mean, 6),
                                      "interval": [round(lo, 6), round(hi, 6)], "n": n}})

    def _restart(self) -> None:
        self.est.reset()
        self._twin_delta.clear()
        self.tripped = False
        self.since = time.time()

    def reset(self, principal: str) -> dict[str, Any]:
        """An operator's reset: the sequence starts again and greedy is no longer forced. Returns the
        state before and after (for the audit entry and the answer)."""
        with self._lock:
            before = self.describe()
            self._restart()
            self.resets += 1
            after = self.describe()
        LOG.warning("watchdog reset by an operator: the champion decides again", extra={"fields": {
            "principal": principal, "version": self.version, "before": before["state"]}})
        return {"before": before, "after": after}

    def wants(self, version: str | None) -> bool:
        """Whether a decision of ``version`` can add a term now (enabled, features logged, not
        tripped, the champion watched): the gateway reads a decision's record only then."""
        return self.enabled and self.log_features and not self.tripped and version is not None \
            and version == self.version

    def observe(self, ob: Observation) -> bool:
        """One decision's feedback (module docstring): a term when it is the loaded champion's
        decision with its record, greedy's choice and a reward; anything else is left out. True
        when this term tripped the watchdog (the caller shares the trip)."""
        if not self.enabled or self.tripped or ob.reward is None or ob.features is None or ob.greedy_offering_id is None:
            return False
        if ob.policy_kind != "model" or ob.policy_version is None or ob.policy_version != self.version:
            return False
        g = self.index.get(ob.greedy_offering_id)
        if g is None or ob.propensity is None:  # (moved off the draw: the served offering's probability is unknown)
            return False
        twin = 0.0
        if self.twin is not None:  # (no figure: decided by another process, or before a restart -- left out)
            got = self._twin_delta.pop(ob.decision_id, None) if ob.decision_id is not None else None
            if got is None:
                return False
            twin = got
        p = float(ob.propensity)
        rec = ope_log.unpack(ob.features)
        if rec.catalog_key != self.catalog_key:
            return False
        pos = np.flatnonzero(rec.action_idx == g)
        if pos.size == 0:
            return False
        gi = int(pos[0])
        prior = self.prior.scores(rec.rows[None], rec.request[None])[0]
        c, a = rec.argmax, rec.chosen
        with self._lock:
            if self.tripped or ob.policy_version != self.version:
                return False
            if self.est.observe(float(prior[c]), float(prior[gi]), float(prior[a]), a == c, a == gi, p,
                                float(ob.reward), twin):
                self.tripped = True  # (describe() below reads the estimate that tripped)
                self._trip(self.describe(), shared=False)
                return True
        return False

    def state(self) -> str:
        if not self.enabled:
            return "off"
        if not self.log_features:
            return "unavailable"
        if self.version is None:
            return "idle"
        if self.tripped:
            return "tripped"
        return "ok" if self.est.n >= self.est.min_decisions else "watching"

    def describe(self) -> dict[str, Any]:
        """``/v1/offerings``' ``watchdog``: the state (off, unavailable: no features logged, idle: no
        champion, watching: fewer terms than ``min_decisions``, ok, tripped), the estimate and its
        interval, the number of terms, since when, the champion version watched."""
        est = self.est.estimate
        return {"state": self.state(), "estimate": None if est is None else est[0],
                "interval": None if est is None or not math.isfinite(est[1]) else [est[1], est[2]],
                "n": self.est.n, "since": iso(self.since), "version": self.version,
                "horizon": self.est.horizon, "confidence": self.est.confidence}
