"""The decision as a list of stages.

A :class:`Stage` has one method, :meth:`~Stage.apply`, over one request's :class:`Decision`: it
narrows the offerings the request may use (``allowed``), adds a bias to their scores, prepares what
later stages read, or fails with the router's error shape (:class:`RouteFailure`). Ranking a request
(``RoutingEngine.rank``) is the loop over :data:`ROUTE`; ``POST /v1/explain`` runs the filtering
stages of the same list with a per-offering trace; the rules sweep of migration and the policy dry
run run the rule stages (:data:`RULES`) the same way. Each exclusion reason and each failure is
written once, in its stage, so the four cannot drift.

The route's list, in order (the exclusion counts are by the first stage that excluded an offering):

=================  =======================================================================  ===========================
stage              what it does                                                             fails with
=================  =======================================================================  ===========================
``validate``       the caller's tenant is served, the origin known, the prefix hashes fit   403 unknown_tenant, 422
``arm``            a canary rollout running: the request's arm by the hash of its key; the
                   environment gets that arm's compiled policies (``router.decision.canary``)
``constraints``    the tenant's and the request's allow/deny/prefer (``tenant:``, ``request:``)  422 no_offering
``access``         regions the caller may not use for the model (``permission``)            403 (a permission it lacks)
``pool_events``    pools masked by a preemption, drain or degradation (``pool_event``)      429 no_capacity
``ejected``        pools the gateways' outlier ejection took out (``upstream_ejected``)     429 no_capacity
``prepare``        the tenant's USD budget and the prefix affinity, as the environment takes them
``environment``    the request made current: expectations on every offering, its mask       422 unknown_model
``policies``       the routing policies' mask (``policy:<name>``) and bias; a notice's region bias  422 no_offering
                   (what they allow is masked by ``pool_events`` / ``ejected`` only)        429 no_capacity
``feasibility``    the model held somewhere allowed; the budget pays for something          422 model_unavailable, 429
``predict``        admission on: the best predicted TTFT over the feasible pools within     429 slo_unattainable
                   the request's SLO, else queue or shed (``xroute.admission_rules``)
``score``          the active model's (or the fallback's) ranking of the valid offerings;   429 no_capacity
                   the environment's reasons (``unavailable`` .. ``budget``) and ``not_preferred``
``watchdog``       greedy's choice beside the policy's (the decision log's ``greedy_offering_id``), and
                   in greedy's twin (``envs.twin``, with the watchdog enabled); the
                   model's departure rule (``models.policy.departs``: greedy's choice unless sure);
                   a tripped watchdog (``router.decision.watchdog``) makes the decision greedy's
``pin``            a session's first turn after a committed migration goes to its target
``explore``        an exploring tenant's draw, and the off-policy record
=================  =======================================================================  ===========================

In a trace (:class:`Decision` with ``trace``), every offering gets the reason of the first stage
that excluded it (None: eligible), and a stage that would fail because nothing is left records
instead (``strict`` False). ``GET /metrics`` has each stage's time (``xroute_router_stage_seconds``).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs import kernels as env_kernels
from envs import policies as env_policies
from envs.admission import best_ttft_of, place_within, soonest_ttft
from models import policy as policy_rule
from router.core.logs import request_id_var
from router.decision import kernels, ope_log
from router.decision.access import denied
from router.decision.quotas import budget_failure, live_budget
from router.state.base import Affinity, PrefixSend
from xroute.admission_rules import ADMIT, verdict, wait_margin
from xroute.schema.access import Principal, model_resource
from xroute.schema.decision import RouteRequest


class RouteFailure(Exception):
    """A request the router cannot place; becomes a 4xx JSON body (see ``router.http.errors``)."""

    def __init__(self, status: int, error: str, message: str, fields: list[dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.error, self.message = status, error, message
        self.fields = fields or []
        self.headers = headers or {}
        self.extra = extra or {}


class Unattainable(RouteFailure):
    """No feasible pool is predicted to serve the request within what is left of its TTFT SLO
    (the ``predict`` stage; ``xroute.admission_rules.verdict``): ``verdict`` says what admission
    does with it -- wait in the queue (``queue``) or leave now (``shed``: this 429 is the answer)."""

    def __init__(self, verdict: str, band: str, best_ttft_ms: float, budget_ms: float, retry_after: str):
        best = best_ttft_ms if best_ttft_ms < float("inf") else None
        super().__init__(429, "slo_unattainable",
                         f"no pool is predicted to serve this {band} request within its TTFT SLO (best predicted "
                         + ("none: no pool can take it now" if best is None else f"{best:.0f} ms")
                         + f", {max(budget_ms, 0.0):.0f} ms left)", headers={"Retry-After": retry_after},
                         extra={"priority": band, "best_predicted_ttft_ms": best})
        self.verdict, self.band, self.best_ttft_ms = verdict, band, best_ttft_ms


def _num(x: Any) -> float:
    """A finite float for an answer (NaN and infinities -> 0.0: JSON has neither)."""
    v = float(x)
    return v if np.isfinite(v) else 0.0


@dataclass(slots=True, eq=False)
class Decision:
    """One request's scratch, shared by the stages (filled in their order)."""

    req: RouteRequest
    who: Principal
    tenant: str
    decision_id: str | None
    wall: float
    request_json: str | None = None
    explore_key: str | None = None
    affinity: Affinity | None = None
    hashes: np.ndarray | None = None
    #: a trace (explain, the rules sweep, the dry run): per offering, the first stage's reason that
    #: excluded it, else None; ``strict`` False: a stage that would fail for want of offerings records
    trace: list[str | None] | None = None
    strict: bool = True
    #: the caller's permissions apply (False: an admin explaining another tenant)
    own_permissions: bool = True
    #: the request's own constraints apply (False: the rules sweep judges a placement by the tenant's)
    request_constraints: bool = True
    #: the rules (sweep, dry run): every pool at full headroom, this compiled set (None: the engine's)
    full_headroom: bool = False
    policies: env_policies.CompiledPolicies | None = None
    #: the canary running (``router.decision.canary.CanaryArms``; None: none) and whether its arm
    #: decides this request (set by the ``arm`` stage)
    canary: Any = None
    arm: bool = False
    # ---- filled by the stages
    compiled: Any = None
    allowed: Any = None
    ccounts: dict[str, int] = None  # type: ignore[assignment]
    ctext: str = ""
    t: float = 0.0
    budget: Any = None
    binding: int = -1
    buckets: Any = None
    live_prefix: Any = None
    env_mask: Any = None
    pout: Any = None
    pctx: Any = None
    n_pol_pref: int = 0
    pcounts: tuple[Any, np.ndarray] | None = None
    bias: Any = None
    has_bias: bool = False
    ptext: str = "{}"
    m: int = -1
    codes: Any = None
    age: float = 0.0
    pinfo: dict[str, Any] = None  # type: ignore[assignment]
    score_kind: str = ""
    n_valid: int = 0
    n_not_preferred: int = 0
    env_counts: list[int] = None  # type: ignore[assignment]
    cands: list[int] = None  # type: ignore[assignment]
    nums: list[float] = None  # type: ignore[assignment]
    #: the fused learned path's action set size (its rows in the engine's buffers), the scorer's
    #: scores, the general path's valid mask and scores of every offering, the request vector
    fused_m: int = -1
    scores: Any = None
    valid: np.ndarray | None = None
    full: np.ndarray | None = None
    req_f: np.ndarray | None = None
    policy_choice: int = -1
    #: what greedy would have chosen among the same valid offerings (the ``watchdog`` stage; -1: not known)
    greedy: int = -1
    #: the deciding model's departure margin (``models.policy.departs``; set by the ``score`` stage,
    #: -inf: no rule -- a fallback, or a policy without one)
    margin: float = -math.inf
    #: the model's affinity guard holds greedy's choice for this request (``models.policy.holds``:
    #: it carries prefix hashes or a session; set by the ``score`` stage)
    guarded: bool = False
    pinned: bool = False
    epsilon: float = 0.0
    ope: tuple[bytes, int, int, int] | None = None
    prefix: PrefixSend | None = None
    #: admission (the ``predict`` stage): how long the request has waited in the queue, the best TTFT
    #: (ms) predicted over the feasible pools
    waited_ms: float = 0.0
    best_ttft_ms: float = float("inf")
    #: the offerings a transient stage (``pool_events``, ``ejected``) hid from the request, each with its stage
    held: list[tuple[np.ndarray, Any]] | None = None

    def exclude(self, mask: np.ndarray, reason: str) -> None:
        """Record ``reason`` for the offerings of ``mask`` that no earlier stage excluded (a trace)."""
        trace = self.trace
        if trace is not None:
            for i in np.flatnonzero(mask).tolist():
                if trace[i] is None:
                    trace[i] = reason

    def hold(self, keep: np.ndarray, stage: Any) -> None:
        """``stage`` (``pool_events``, ``ejected``: a mask that lifts by itself) hides the offerings
        allowed but not in ``keep``: remembered, so that a later stage that finds nothing left (the
        policies) fails as ``stage`` would -- a 429 to retry, not a 422 for a valid request."""
        hidden = self.allowed & ~keep
        self.held = [*(self.held or []), (hidden, stage)]

    def held_by(self, allowed: np.ndarray) -> Any:
        """The transient stage that hid some of ``allowed`` (the first; None: none did)."""
        for hidden, stage in self.held or []:
            if (hidden & allowed).any():
                return stage
        return None

    def narrow(self, keep: np.ndarray, reason: str, count: int) -> None:
        """``allowed &= keep``, counted under ``reason`` (and traced)."""
        if self.trace is not None:
            self.exclude(self.allowed & ~keep, reason)
        self.allowed = self.allowed & keep
        self.ccounts = {**self.ccounts, reason: count}
        self.ctext = f'{self.ctext},"{reason}":{count}' if self.ctext else f'"{reason}":{count}'


class Stage:
    """One step of the decision (module docstring): :meth:`apply` narrows ``d.allowed``, adds to
    ``d.bias``, fills what later stages read, or raises :class:`RouteFailure`."""

    #: the stage's name: ``xroute_router_stage_seconds{stage}``, the module docstring's table
    name = ""

    def __init__(self, engine: Any):
        #: the ``RoutingEngine`` that owns the stage (typed loosely: the engine imports this module)
        self.engine = engine

    def apply(self, d: Decision) -> None:
        raise NotImplementedError


class Validate(Stage):
    name = "validate"

    def apply(self, d: Decision) -> None:
        e = self.engine
        if not e.tenant_known(d.tenant):
            raise e.unknown_tenant(d.tenant)
        origin = d.req.origin
        if origin not in e.origin_set:
            close = difflib.get_close_matches(origin, e.origins, n=5, cutoff=0.4)
            raise RouteFailure(422, "unknown_origin", f"unknown origin '{origin}'",
                               [{"field": "body.origin", "message": f"unknown origin '{origin}'; "
                                 f"known origins: GET /v1/offerings", "suggestions": close}])
        if d.affinity is not None:
            e.check_prefix(d.req)


class ConstraintLayers(Stage):
    """The tenant's defaults and the request's constraints (``xroute.schema.policy_ir``), compiled
    and counted once per distinct set (``RoutingEngine.constraints_for``)."""

    name = "constraints"

    def apply(self, d: Decision) -> None:
        compiled, ccounts, any_allowed, ctext = self.engine.constraints_for(
            d.tenant, d.req.constraints if d.request_constraints else None)
        d.compiled, d.allowed, d.ccounts, d.ctext = compiled, compiled.allowed, ccounts, ctext
        if d.trace is not None:
            for i, why in enumerate(compiled.reason):
                if why:
                    d.trace[i] = why.replace("constraints:", "request:")
        if not any_allowed and d.strict:
            raise RouteFailure(422, "no_offering", "the constraints (tenant defaults and request) exclude every offering",
                               [{"field": "body.constraints", "message": "excludes every offering",
                                 "suggestions": []}], extra={"excluded": ccounts})


class Access(Stage):
    """Access control (``router.decision.access``): the regions the caller may not use for this model
    are masked out like a deny policy (``permission``); none left is a 403 naming one it lacks."""

    name = "access"

    def apply(self, d: Decision) -> None:
        e = self.engine
        if not d.own_permissions:
            return
        model_name = d.req.model or e.models[0]
        perm = e.access.inference_mask(d.who, model_name) if model_name in e.env.model_index else None
        if perm is None:
            return
        compiled, allowed = d.compiled, d.allowed
        hit = e._masked.get((id(compiled), id(perm)))
        if hit is None or hit[0] is not compiled or hit[1] is not perm:
            kept = allowed & perm
            cut = int(allowed.sum() - kept.sum())
            hit = (compiled, perm, kept, cut, {**d.ccounts, "permission": cut},
                   f'{d.ctext},"permission":{cut}' if d.ctext else f'"permission":{cut}', not kept.any())
            if len(e._masked) >= 1024:
                e._masked.clear()
            e._masked[(id(compiled), id(perm))] = hit
        if not hit[3]:
            return
        if d.trace is not None:
            d.exclude(allowed & ~perm, "permission")
        if hit[6] and d.strict:  # nothing the request could use is permitted
            a = int(np.flatnonzero(allowed)[0])
            raise RouteFailure(**denied(d.who, model_resource("inference", model_name, e.refs[a]["region"]),
                                        f"a request of model '{model_name}'"))
        d.allowed, d.ccounts, d.ctext = hit[2], hit[4], hit[5]


class PoolEvents(Stage):
    """Pools a pool event masked (``router.service.migration``; docs/migration.md)."""

    name = "pool_events"

    def apply(self, d: Decision) -> None:
        keep = self.engine.events_keep
        if keep is None:
            return
        hidden = int((d.allowed & ~keep).sum())
        if not hidden:
            return
        d.hold(keep, self)
        d.narrow(keep, "pool_event", hidden)
        if not d.allowed.any() and d.strict:
            raise self.failure(d)

    def failure(self, d: Decision, excluded: dict[str, int] | None = None) -> RouteFailure:
        """Nothing left to the request but pools a pool event masked (for now); ``excluded``: the
        counts (default: the constraint layers')."""
        return RouteFailure(429, "no_capacity", "every allowed offering is masked by a pool event "
                            "(a preemption, a drain or a degradation: docs/migration.md)",
                            headers={"Retry-After": "5"}, extra={"excluded": excluded or d.ccounts})


class Ejected(Stage):
    """Pools the gateways' outlier ejection took out (``router.decision.ejections``: failing in a
    row, in the shared state; reason ``upstream_ejected``), read from this process's view of it --
    no round trip. A half-open pool whose probe this process holds is let through to one decision."""

    name = "ejected"

    def apply(self, d: Decision) -> None:
        e = self.engine
        ej = e.ejection
        if ej.keep is None and not ej.ready:
            return
        env = e.env
        m = env.default_model if d.req.model is None else env.model_index.get(d.req.model, -1)
        if m < 0:  # (an unknown model: the environment's stage says so)
            return
        route = d.trace is None and d.strict
        keep = ej.offer(m, d.allowed, d.decision_id) if route else (None if ej.keep is None else ej.keep[m])
        if keep is None:
            return
        hidden = int((d.allowed & ~keep).sum())
        if not hidden:
            return
        d.hold(keep, self)
        d.narrow(keep, "upstream_ejected", hidden)
        if not d.allowed.any() and d.strict:
            raise self.failure(d)

    def failure(self, d: Decision, excluded: dict[str, int] | None = None) -> RouteFailure:
        """Nothing left to the request but pools the outlier ejection took out (for now); ``excluded``:
        the counts (default: the constraint layers')."""
        e = self.engine
        m = e.env.default_model if d.req.model is None else e.env.model_index.get(d.req.model, -1)
        return RouteFailure(429, "no_capacity", "every allowed offering's pool is ejected: its servers failed "
                            "requests in a row (docs/gateway.md, \"Outlier ejection\")",
                            headers={"Retry-After": str(math.ceil(e.ejection.retry_after_s(m)))},
                            extra={"excluded": excluded or d.ccounts})


class Prepare(Stage):
    """What the environment takes besides the request: its tenant's USD budget as the quota state
    has it (``router.decision.quotas.live_budget``) and the shared prefix index's answer."""

    name = "prepare"

    def apply(self, d: Decision) -> None:
        e = self.engine
        d.t = e.now(d.wall)
        if e.quota_plan and e.quota_usage is not None:
            buckets, keys = e.quota_plan.budgeted(d.tenant, d.req.model or e.models[0])
            if buckets:
                d.buckets = buckets
                d.budget, d.binding = live_budget(buckets, e.quota_usage(keys), d.wall)
        if d.affinity is not None:
            env = e.env
            m_req = env.default_model if d.req.model is None else env.model_index.get(d.req.model, -1)
            if m_req >= 0:
                d.live_prefix = e._live_prefix(m_req, d.affinity)


class Arm(Stage):
    """With a canary rollout running (``router.decision.canary``), the request's arm: the hash of
    its key (the tenant, the session -- else the request id --, or the request id) against the
    canary's share; the environment is given that arm's compiled set. None running: nothing (the
    stable set is the environment's)."""

    name = "arm"

    def apply(self, d: Decision) -> None:
        e = self.engine
        c = e.canary
        if c is None:
            return
        kind = c.key
        if kind == "tenant":
            key = d.tenant
        else:
            sid = d.req.session_id if kind == "session" else None
            key = sid if sid is not None else request_id_var.get() or d.decision_id or ""
        d.canary = c
        d.arm = c.choose(key)
        compiled = e.use_arm(d.arm)
        if d.arm:
            d.policies = compiled


class Environment(Stage):
    """The request made current in the environment (``CloudRouteEnv.set_live``): its expectations
    on every offering, the environment's mask, the routing policies' outcome under the live view."""

    name = "environment"

    def apply(self, d: Decision) -> None:
        e = self.engine
        req = d.req
        try:
            d.env_mask = e.env.set_live(d.t, req.origin, req.input_tokens, req.max_output_tokens, req.ttft_ms,
                                        req.tpot_ms, req.deadline_ms, req.model, d.tenant, d.decision_id,
                                        request_class=req.request_class, prefix=d.live_prefix, pre=d.allowed,
                                        budget=d.budget)
        except ValueError:
            close = difflib.get_close_matches(str(req.model), e.models, n=3, cutoff=0.4)
            raise RouteFailure(422, "unknown_model", f"unknown model '{req.model}'",
                               [{"field": "body.model", "message": f"unknown model '{req.model}'; known models: "
                                 f"{', '.join(e.models)} (GET /v1/offerings)", "suggestions": close}]) from None
        d.m = e.env.r_m


class Policies(Stage):
    """The routing policies (``envs.policies``, applied by the environment): their mask narrows the
    layers' (each offering counted by the first policy that excluded it), their bias adds to the
    scores; a just-preempted region's de-prioritization adds too. Under the rules (``full_headroom``:
    the migration sweep, the dry run) the same compiled policies are applied with every pool at full
    headroom, without the environment."""

    name = "policies"

    def apply(self, d: Decision) -> None:
        e = self.engine
        if d.full_headroom:
            self._rules(d)
            return
        env = e.env
        pol = e.policies if d.policies is None else d.policies  # (the canary arm's set, when it decides)
        pout = d.pout = env.r_policy
        pctx = d.pctx = pout.ctx
        if pctx is not None and not pctx.empty:
            if d.trace is not None:
                excluded = d.allowed & ~pout.allowed
                for i in np.flatnonzero(excluded).tolist():
                    if d.trace[i] is None:
                        d.trace[i] = pol.reasons[int(pout.reason[i])]
            d.allowed = d.allowed & pout.allowed
            d.n_pol_pref = pout.not_preferred
            if pout.excluded:
                ptext = pol.counts_text(pout)
                d.ctext = f"{d.ctext},{ptext}" if d.ctext else ptext
                d.pcounts = (pol, pout.counts.copy())
                if not d.allowed.any() and d.strict:
                    held = d.held_by(pout.allowed)
                    if held is not None:  # (what the policies allow is there, but masked for now: a 429)
                        raise held.failure(d, e._all_counts(d.ccounts, d.pcounts))
                    raise RouteFailure(422, "no_offering", "the routing policies, the tenant's defaults and the "
                                       "request's constraints exclude every offering",
                                       [{"field": "body", "message": "excludes every offering (see excluded.by_reason "
                                         "and POST /v1/explain)", "suggestions": []}],
                                       extra={"excluded": e._all_counts(d.ccounts, d.pcounts)})
        d.bias, d.has_bias = env.r_bias, env.r_has_bias
        if e.events_bias is not None:  # a just-preempted region, de-prioritized (router.service.migration)
            d.bias = d.bias + e.events_bias
            d.has_bias = True
        c = d.canary
        d.ptext = e._policies_text(pctx, pout) if c is None else e._policies_text(pctx, pout, pol, c.heads[d.arm])

    def _rules(self, d: Decision) -> None:
        e = self.engine
        env = e.env
        p = d.policies if d.policies is not None else e.policies
        req = d.req
        model = req.model or e.models[0]
        m = env.model_index.get(model, -1)
        o = env.origin_index.get(req.origin, -1)
        if m < 0 or o < 0:  # (a model or origin this router no longer serves: not the rules' business)
            return
        d.m = m
        cls = p.request_class(req.request_class, float(req.ttft_ms), float(req.tpot_ms), req.deadline_ms)
        ctx = d.pctx = p.context(d.tenant, model, cls, req.origin)
        if ctx.empty:
            d.bias = np.zeros(e.n)
            return
        out = d.pout = p.outcome_buffers()
        p.apply(ctx, d.allowed, env.usd_h, env.rtt_ms[o], np.zeros(e.n), env.slots[m], np.ones(e.n, dtype=bool), out)
        if d.trace is not None:
            for i in np.flatnonzero(d.allowed & ~out.allowed).tolist():
                if d.trace[i] is None:
                    d.trace[i] = p.reasons[int(out.reason[i])]
        d.allowed = d.allowed & out.allowed
        d.bias = out.bias.copy()


class Feasibility(Stage):
    """Whether anything allowed can serve the request at all: some allowed offering holds the
    model; the tenant's USD left pays for some allowed offering. Then the environment's reasons
    for each offering it masks (static ones cached per telemetry snapshot)."""

    name = "feasibility"

    def apply(self, d: Decision) -> None:
        e = self.engine
        env = e.env
        m_ = d.m
        allowed = d.allowed
        holds = env.fits[m_] & (env.slots_alloc[m_] > 0)  # (a pool the inventory empties now still holds it)
        if not (holds & allowed).any() and d.strict:
            raise RouteFailure(422, "model_unavailable", f"no allowed offering holds model '{env.model_names[m_]}'",
                               [{"field": "body.model", "message": f"no allowed offering has replicas of "
                                 f"'{env.model_names[m_]}' (it needs more accelerator memory, or the constraints "
                                 "exclude the offerings that hold it)", "suggestions": []}])
        d.codes = e._static_codes(m_)
        if d.budget is not None and env.r_over is not None and d.binding >= 0 and d.strict \
                and not (d.env_mask & allowed).any() and (env.r_over & allowed).any():
            cheapest = float(env.c_cost[env.r_over & allowed].min())  # its USD left pays for none allowed
            raise RouteFailure(**budget_failure(d.buckets[d.binding], d.budget, cheapest, d.wall, self._counts(d)))
        if d.trace is not None:
            self._trace(d)

    def _counts(self, d: Decision) -> dict[str, int]:
        """The exclusions by reason of a request nothing valid is left to, as the score counts them."""
        e = self.engine
        pref = d.compiled.preferred
        _, _, n_not_preferred, env_counts = kernels.combine(
            d.env_mask, d.allowed, d.allowed if pref is None else pref, pref is not None, d.codes)
        return e._counts(e._all_counts(d.ccounts, d.pcounts), n_not_preferred + d.n_pol_pref,
                         e._quota_counts(env_counts.tolist(), d.allowed))

    def _trace(self, d: Decision) -> None:
        """Each allowed offering the environment masks, by its reason (as the score's counts), and
        the allowed valid ones a preference leaves out (``not_preferred``)."""
        e = self.engine
        env = e.env
        trace = d.trace
        assert trace is not None
        quota_only, over = e._quota_only, env.r_over
        codes = d.codes
        for i in np.flatnonzero(d.allowed & ~d.env_mask).tolist():
            if trace[i] is None:
                why = kernels.ENV_REASONS[int(codes[i])]
                if why == "no_capacity" and env.capacity.active and quota_only[i]:
                    why = "quota"
                elif why == "queue_full" and over is not None and over[i]:
                    why = "budget"
                trace[i] = why
        pref = d.compiled.preferred
        if pref is not None:
            ok = d.allowed & d.env_mask
            n_pref = int((ok & pref).sum())
            if 0 < n_pref < int(ok.sum()):
                d.exclude(ok & ~pref, "not_preferred")


class Predict(Stage):
    """Admission that predicts (``router.service.admission_queue``; with ``admission.enabled``): the
    TTFT the request is expected to see at each feasible pool -- allowed, valid (the environment's
    queue and service model: RTT, wait, prefill, one token) -- and its best; when that is over what
    is left of the request's TTFT SLO, ``xroute.admission_rules.verdict`` says queue or shed
    (:class:`Unattainable`). No pool feasible at all, or every one full: the best is infinite (the
    same verdict); the soonest a free slot would start it over the budget: shed. A request the queue
    dispatches is placed where a slot is free (``envs.admission.place_within``)."""

    name = "predict"

    def apply(self, d: Decision) -> None:
        e = self.engine
        if not e.admission_on or d.trace is not None:
            return
        # (one compiled pass over the TTFT the environment computed: no temporary arrays)
        band = e.band_of(d.req, d.tenant)
        margin = wait_margin(band)
        best = d.best_ttft_ms = float(best_ttft_of(e.env.C, d.env_mask, d.allowed, margin))
        slo = float(d.req.ttft_ms)
        budget = slo - d.waited_ms  # (within it, so is the soonest: read only when it is not)
        soonest = -float("inf") if best <= budget else \
            float(soonest_ttft(e.env.C, e.env.fits[d.m], e.env.r_allowed, d.allowed))  # (whatever their state)
        v = verdict(band, best, slo, d.waited_ms, False, soonest)
        if v != ADMIT:
            raise e.unattainable(v, band, best, slo - d.waited_ms)
        # admitted: placed where it is predicted to start in time (the world's rule, envs.admission)
        place_within(e.env.C, d.env_mask, slo - d.waited_ms, margin, d.waited_ms > 0.0)


class Score(Stage):
    """The active model's ranking (or the fallback's, when the telemetry is stale or the model
    fails): greedy in one compiled call (``router.decision.kernels.greedy_decide``), a learned scorer
    in two around it (``valid_rows``, ``scored_decide``), every other policy -- and a scorer that
    fails or returns a non-finite score -- through ``RoutingEngine._choose``. The compiled and
    general paths give the same answers byte for byte (``tests/test_router_unit.py``)."""

    name = "score"

    def apply(self, d: Decision) -> None:
        e = self.engine
        d.age = e.freshness.age(d.wall)
        active, d.pinfo = e.slot.current(d.age > e.max_age)
        w = getattr(active.policy, "weights", None) if active.kind == "model" else None
        d.margin = float(getattr(w, "margin", -math.inf))
        d.guarded = w is not None and policy_rule.holds(w, e.wants_affinity(d.req))
        n_alt = self._fused(d, active)
        if n_alt >= 0:
            # ints: [chosen, valid, not preferred, 4 env reason counts, alternatives...]; floats: (score,
            # latency, cost) of the chosen and of each alternative
            ints, floats = e._out
            ii, d.nums = ints.tolist()[: 7 + n_alt], floats.tolist()[: 3 + 3 * n_alt]
            a, d.n_valid, d.n_not_preferred = ii[0], ii[1], ii[2] + d.n_pol_pref
            d.env_counts = e._quota_counts(ii[3:7], d.allowed)
            if a < 0:
                e._no_capacity(d.allowed, e._counts(e._all_counts(d.ccounts, d.pcounts), d.n_not_preferred,
                                                    d.env_counts))
            d.cands = [a, *ii[7:]]
        else:
            self._general(d, active)
        d.policy_choice = d.cands[0]

    def _fused(self, d: Decision, active: Any) -> int:
        """The compiled paths: the number of alternatives ranked (their outputs in the engine's
        buffers), or -1 for the general path."""
        e = self.engine
        env = e.env
        pref = d.compiled.preferred
        allowed, m_ = d.allowed, d.m
        ints, floats = e._out
        if active.scorer is None:
            if e.fused_greedy and active.name == "greedy":
                d.score_kind = "expected_reward"
                return int(kernels.greedy_decide(
                    d.env_mask, allowed, allowed if pref is None else pref, pref is not None, d.codes, env.C, d.bias,
                    d.has_bias, env.r_ref_cost, env.r_budget, *e._reward_args, e.k_alt, ints, floats))
            return -1
        if not e.fused_learned:
            return -1
        d.score_kind = "q_value"
        m = d.fused_m = kernels.valid_rows(
            d.env_mask, allowed, allowed if pref is None else pref, pref is not None, d.codes, env.static_feats[m_],
            env.c_rtt, env.C, env.inv_slots[m_], env.r_ttft, env.r_tpot, env.r_budget, env.r_ref_cost, e._rows,
            e._idx, ints)
        if m == 0:
            return 0  # no capacity (ints[0] is -1)
        d.req_f = env.request_features()
        try:
            s = active.scorer(e._rows[:m], d.req_f)
            if d.has_bias and s is not None:  # the prefer policies' weights, reward units
                s = s + d.bias[e._idx[:m]]
        except Exception:  # the general path asks again, and falls back
            s = None
        d.scores = s
        if s is not None and s.shape == (m,):  # -1 for a NaN or infinite score: the general path
            return int(kernels.scored_decide(s, e._idx, e.k_alt, env.C, ints, floats))
        return -1

    def _general(self, d: Decision, active: Any) -> None:
        e = self.engine
        env = e.env
        pref = d.compiled.preferred
        valid, d.n_valid, n_not_preferred, env_counts_a = kernels.combine(
            d.env_mask, d.allowed, d.allowed if pref is None else pref, pref is not None, d.codes)
        d.valid = valid
        d.env_counts = e._quota_counts(env_counts_a.tolist(), d.allowed)
        d.n_not_preferred = n_not_preferred + d.n_pol_pref
        if d.n_valid == 0:
            e._no_capacity(d.allowed, e._counts(e._all_counts(d.ccounts, d.pcounts), d.n_not_preferred, d.env_counts))
        d.fused_m = -1
        d.scores = None
        pbias = d.bias if d.has_bias else None
        try:
            a, score, alt_idx, alt_scores, d.score_kind, d.full = e._choose(active, valid, pbias)
        except Exception as ex:  # a model that fails at decision time: this request goes to the fallback
            if active is e.slot.fallback:
                raise
            e.slot.failed(f"decision error: {type(ex).__name__}: {ex}")
            active = e.slot.fallback
            d.pinfo = {**e.slot.fallback.info, "reason": f"model error: {type(ex).__name__}"}
            a, score, alt_idx, alt_scores, d.score_kind, d.full = e._choose(active, valid, pbias)
        c_lat, c_cost = env.c_lat, env.c_cost  # nums as the compiled path's
        d.cands = [a, *alt_idx]
        nums: list[float] = []
        for k, sc in zip(d.cands, [score, *alt_scores]):
            nums += (_num(sc), _num(c_lat.item(k)), _num(c_cost.item(k)))
        d.nums = nums


class Watchdog(Stage):
    """Greedy's choice beside the policy's (``router.decision.watchdog``): when a model (or a
    fallback other than greedy) decided, the argmax of the expected rewards plus the policies' bias
    over the same valid offerings -- greedy's ranking, ``env_kernels.rank`` as the fallback ranks --
    else the policy's own choice. Then the model's **departure rule** (``models.policy.choose``, the
    one the environment's rollouts apply): the model's choice stands only where its score exceeds
    its score of greedy's choice by more than its margin; elsewhere greedy's choice goes first (the
    model's ranking after it). When the watchdog is tripped and the champion decided, the decision
    becomes greedy's: its ranking, its scores, ``policy`` naming the watchdog."""

    name = "watchdog"

    def apply(self, d: Decision) -> None:
        e = self.engine
        wd = e.watchdog
        model = d.pinfo.get("kind") == "model"
        if model and wd.enabled:
            wd.follow(d.pinfo.get("version"))
        if not model and d.pinfo.get("name") == "greedy":
            d.greedy = d.policy_choice
            if wd.twin is not None and d.trace is None and d.decision_id is not None:  # (the twin routes every one)
                valid = d.valid
                if valid is None:  # (the fused greedy path: its action set, as the kernel made it)
                    pref = d.compiled.preferred
                    valid = kernels.combine(d.env_mask, d.allowed, d.allowed if pref is None else pref,
                                            pref is not None, d.codes)[0]
                wd.twin_step(d.decision_id, valid, d.greedy, d.bias if d.has_bias else None, d.allowed, False)
            return
        env = e.env
        valid = d.valid
        if valid is None:  # (the fused learned path: its action set is in the engine's buffers)
            valid = np.zeros(e.n, dtype=bool)
            valid[e._idx[:d.fused_m]] = True
        r = env.expected_rewards()
        if d.has_bias:
            r = r + d.bias
        best, alt = env_kernels.rank(r, valid, e.k_alt)
        d.greedy = int(best)
        if wd.twin is not None and d.trace is None and d.decision_id is not None:
            wd.twin_step(d.decision_id, valid, d.greedy, d.bias if d.has_bias else None, d.allowed,
                         model and d.pinfo.get("version") == wd.version)
        if not (model and wd.tripped):
            if model:
                self._depart(d)
            return
        # the champion is confidently worse than greedy: this decision is greedy's
        c_lat, c_cost = env.c_lat, env.c_cost
        d.cands = [int(best), *alt.tolist()]
        nums: list[float] = []
        for k in d.cands:
            nums += (_num(r[k]), _num(c_lat.item(k)), _num(c_cost.item(k)))
        d.nums, d.score_kind, d.policy_choice = nums, "expected_reward", int(best)
        d.valid, d.full, d.scores, d.fused_m = valid, r, None, -1
        d.pinfo = wd.info

    def _depart(self, d: Decision) -> None:
        """The departure rule on the model's scores of the valid offerings (the fused path's, over
        the engine's ``_idx[:fused_m]``; the general path's ``full``): greedy's choice first unless
        the model's own beats it by more than the margin, and always where the affinity guard holds
        (``d.guarded``)."""
        if d.margin == -math.inf or d.greedy < 0 or d.greedy == d.policy_choice:
            return
        e = self.engine
        fused = d.fused_m > 0 and d.valid is None
        if fused and d.scores is not None:
            idx, s = e._idx[:d.fused_m], np.asarray(d.scores)
        elif d.full is not None and d.valid is not None:
            idx = np.flatnonzero(d.valid)
            s = np.asarray(d.full)[idx]
        else:
            return
        if policy_rule.choose(s, idx, d.greedy, d.margin, d.guarded) != d.greedy:
            return
        d.cands, d.nums = e._first(d.greedy, d.cands, d.nums, d.scores if fused else None, d.fused_m, d.full, d.bias,
                                   d.has_bias)
        d.policy_choice = d.greedy


class Pin(Stage):
    """A session's first turn after a committed migration goes where the migration put its state
    (``router.service.migration``), when that offering is one the policy could have chosen now
    (allowed, valid, preferred when a prefer rule applies); the policy's ranking follows it."""

    name = "pin"

    def apply(self, d: Decision) -> None:
        e = self.engine
        pin = e._migrated_to(d.m, d.affinity)
        if pin < 0 or pin == d.policy_choice:
            return
        pref = d.compiled.preferred
        if not (d.allowed[pin] and d.env_mask[pin]
                and (pref is None or pref[pin] or not (pref & d.allowed & d.env_mask).any())):
            return
        d.pinned = True
        d.cands, d.nums = e._first(pin, d.cands, d.nums, d.scores if (d.fused_m > 0 and d.valid is None) else None,
                                   d.fused_m, d.full, d.bias, d.has_bias)


class Explore(Stage):
    """With ``log_features``: the action set -- the valid offerings the policy ranked -- with its rows
    and request vector, for the decision log's off-policy record; for an exploring tenant, with its
    ``explore_epsilon``, an offering drawn uniformly from that set goes first (``router.decision.ope_log``:
    the draw is a function of the request's idempotency key, else of its decision id)."""

    name = "explore"

    def apply(self, d: Decision) -> None:
        e = self.engine
        d.epsilon = e.epsilon.get(d.tenant, 0.0) if e.epsilon else 0.0
        if not e.log_features:
            return
        idx, rows = self._action_set(d)
        assert d.req_f is not None
        argmax = first = int(np.searchsorted(idx, d.policy_choice))
        if d.pinned:  # (served by the session's placement, not drawn: no exploration, no propensity)
            first = int(np.searchsorted(idx, d.cands[0]))
        elif d.epsilon > 0.0:
            d.cands, d.nums, drawn = e._explore(d.explore_key or d.decision_id or "", d.epsilon, idx, d.cands, d.nums,
                                                d.scores, d.full)
            first = argmax if drawn < 0 else drawn
        # (the record copies the rows and indices out of the buffers the next request reuses)
        d.ope = (ope_log.pack(e._catalog_key, idx, first, argmax, d.req_f, rows), idx.shape[0], first, argmax)

    def _action_set(self, d: Decision) -> tuple[np.ndarray, np.ndarray]:
        e = self.engine
        m = d.fused_m
        if m > 0 and d.valid is None:  # the fused learned path: its scorer's inputs
            return e._idx[:m], e._rows[:m]
        env = e.env
        if d.valid is None:  # the fused greedy path: the same compiled pass the learned one makes
            pref, allowed, m_ = d.compiled.preferred, d.allowed, d.m
            m = kernels.valid_rows(
                d.env_mask, allowed, allowed if pref is None else pref, pref is not None, d.codes,
                env.static_feats[m_], env.c_rtt, env.C, env.inv_slots[m_], env.r_ttft, env.r_tpot,
                env.r_budget, env.r_ref_cost, e._rows, e._idx, e._ints_log)
            idx, rows = e._idx[:m], e._rows[:m]
        else:
            idx = np.flatnonzero(d.valid)
            rows = env.offering_features(idx)
            d.scores = None
        d.req_f = env.request_features()
        return idx, rows


#: the stages of a route, in order (module docstring)
ROUTE: tuple[type[Stage], ...] = (Validate, Arm, ConstraintLayers, Access, PoolEvents, Ejected, Prepare, Environment,
                                  Policies, Feasibility, Predict, Score, Watchdog, Pin, Explore)
#: what ``POST /v1/explain`` runs: every stage that excludes, none that ranks
EXPLAIN: tuple[type[Stage], ...] = ROUTE[:ROUTE.index(Feasibility) + 1]
#: the rules alone (the migration sweep, the dry run): the constraint layers and the policies at full headroom
RULES: tuple[type[Stage], ...] = (ConstraintLayers, Policies)
