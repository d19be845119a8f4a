"""Policies (``xroute.schema.policy_ir.PolicySet``) compiled to masks and biases -- the one
compiled form the environment, every baseline, ``xroute evaluate``, the learned policy and the
router apply.

Two stages, so that a decision pays only for what changes per request:

* **per request context** (tenant, model, request class, origin; cached per
  :class:`CompiledPolicies`, which is itself bound to one catalog and one policy-set version, so
  the cache key is (tenant, model, class, origin, catalog, version)): which policies apply
  (:meth:`Target.matches`), and what their attribute constraints say -- folded into arrays: the
  first (highest-priority) attribute-only deny of each offering, the union of the attribute-only
  allows, and, for the policies whose outcome depends on numbers (price, RTT, headroom) and for
  every prefer policy, their match rows and limits (:class:`PolicyContext`);
* **per decision** (:func:`apply_policies`, one compiled loop over the offerings): the numeric
  constraints against the current price per instance-hour, the RTT from the request's origin and
  the pool's headroom in the router's view -- all known when the router decides -- giving the
  allowed mask (ANDed into the action mask), each excluded offering's reason (the policy's rank)
  and each offering's bias; with ``prefer_mode: lexicographic`` :func:`prefer_filter` then keeps
  only the valid offerings with the highest total weight.

An offering is excluded by the first (by priority, then name) deny that hits it, else -- when any
allow policy applies and none admits it -- by the first applicable allow policy. Reasons are
``policy:<name>`` (:attr:`CompiledPolicies.reasons`).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from xroute.schema.offering import Offering
from xroute.schema.policy_ir import ATTRIBUTE_FIELDS, Policy, PolicySet, is_pattern

DENY, ALLOW, PREFER = 0, 1, 2
_KIND = {"deny": DENY, "allow": ALLOW, "prefer": PREFER}
#: the prefix of a policy's reason in exclusion counts (``excluded.by_reason``)
REASON_PREFIX = "policy:"
#: contexts kept per compiled set (each a few arrays over the catalog)
CONTEXT_CACHE = 4096
#: exclusion and bias counts kept as their JSON text (per compiled set)
TEXT_CACHE = 16384


@dataclass(frozen=True, eq=False)
class PolicyContext:
    """The policies that apply to one request context, compiled against the catalog. Read-only:
    shared by every request of the context (and across threads)."""

    #: the request class the context is for ("" none)
    request_class: str
    #: names of the applicable policies, in rank order, and as a JSON array
    applied: tuple[str, ...]
    applied_json: str
    #: per offering: rank of the first attribute-only deny that hits it, -1 none (int64)
    static_deny: np.ndarray
    #: whether an allow policy applies; the union of the attribute-only allows; the reason of an
    #: offering no allow admits (the first applicable allow's rank)
    has_allow: bool
    allow_hit: np.ndarray
    allow_miss: int
    #: the policies checked per decision (numeric constraints, and every prefer): their attribute
    #: match rows (K, n), kinds, ranks, limits (NaN: none) and weights
    dyn_match: np.ndarray
    dyn_kind: np.ndarray
    dyn_rank: np.ndarray
    dyn_max_usd: np.ndarray
    dyn_max_rtt: np.ndarray
    dyn_min_head: np.ndarray
    dyn_weight: np.ndarray
    #: a prefer policy applies (the bias may be non-zero)
    has_prefer: bool
    #: nothing applies: every offering allowed, no bias
    empty: bool
    #: the same, packed as :func:`apply_policies` takes them (fewer arguments: numba's dispatch
    #: costs ~0.2 us an argument): [static deny rank, allow hit] (2, n); [has allow, allow miss];
    #: [kind, rank] (K, 2); [max usd, max rtt, min headroom, weight] (K, 4)
    static: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((2, 0), dtype=np.int64))
    meta: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(2, dtype=np.int64))
    dyn_int: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    dyn_float: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 4)))

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "static", np.ascontiguousarray(np.stack([self.static_deny, self.allow_hit.astype(np.int64)])))
        set_(self, "meta", np.array([int(self.has_allow), self.allow_miss], dtype=np.int64))
        set_(self, "dyn_int", np.ascontiguousarray(np.stack([self.dyn_kind, self.dyn_rank], axis=1)
                                                   .reshape(-1, 2).astype(np.int64)))
        set_(self, "dyn_float", np.ascontiguousarray(np.stack([self.dyn_max_usd, self.dyn_max_rtt, self.dyn_min_head,
                                                               self.dyn_weight], axis=1).reshape(-1, 4)))

    def __repr__(self) -> str:
        return f"PolicyContext(class={self.request_class!r}, applied={list(self.applied)})"

    def args(self) -> tuple[np.ndarray, ...]:
        """:func:`apply_policies`' arguments after ``pre``."""
        return self.static, self.meta, self.dyn_match, self.dyn_int, self.dyn_float


@dataclass
class PolicyOutcome:
    """Per-decision output buffers of :meth:`CompiledPolicies.apply` (over ``n`` offerings and the
    set's ``R`` policies), reused request after request."""

    allowed: np.ndarray
    reason: np.ndarray
    bias: np.ndarray
    #: (2, R) int64: exclusions among ``pre`` per policy rank, and the allowed offerings among ``pre``
    #: each prefer policy raised (``counts`` and ``bias_counts`` are its rows)
    counts2: np.ndarray
    #: offerings the policies excluded among ``pre`` (the sum of ``counts``)
    excluded: int = 0
    #: valid offerings dropped by the lexicographic prefer filter
    not_preferred: int = 0
    ctx: PolicyContext | None = field(default=None, repr=False)

    @property
    def counts(self) -> np.ndarray:
        return self.counts2[0]

    @property
    def bias_counts(self) -> np.ndarray:
        return self.counts2[1]

    @classmethod
    def empty(cls, n: int, r: int) -> PolicyOutcome:
        return cls(np.ones(n, dtype=np.bool_), np.full(n, -1, dtype=np.int64), np.zeros(n),
                   np.zeros((2, max(r, 1)), dtype=np.int64))

    def copy(self) -> PolicyOutcome:
        return PolicyOutcome(self.allowed.copy(), self.reason.copy(), self.bias.copy(), self.counts2.copy(),
                             self.excluded, self.not_preferred, self.ctx)


def _attribute_match(p: Policy, ps: PolicySet, attrs: dict[str, list[str]], n: int) -> np.ndarray:
    """Offerings ``p``'s attribute constraints match (AND across fields, OR within one; a value
    the catalog lacks matches nothing)."""
    m = np.ones(n, dtype=bool)
    c = p.constraints
    for fld in ATTRIBUTE_FIELDS:
        if fld == "region_sets":
            continue
        values = ps.regions_of(c) if fld == "regions" else getattr(c, fld)
        if values is None:
            continue
        attr = ATTRIBUTE_FIELDS[fld]
        cols = [attrs[attr]] + ([attrs["location"]] if fld == "regions" else [])
        hit = np.zeros(n, dtype=bool)
        for v in values:
            for col in cols:
                if is_pattern(v):
                    hit |= np.array([fnmatch.fnmatchcase(x, v) for x in col], dtype=bool)
                else:
                    hit |= np.array([x == v for x in col], dtype=bool)
        m &= hit
    return m


class CompiledPolicies:
    """A :class:`PolicySet` compiled against one catalog: immutable once built (a router swaps a
    whole new one in when the set changes), its per-context compilations cached."""

    def __init__(self, ps: PolicySet, catalog: Sequence[Offering]):
        self.set = ps
        self.version = ps.version
        self.n = n = len(catalog)
        self.lexicographic = ps.prefer_mode == "lexicographic"
        order = sorted(range(len(ps.policies)), key=lambda i: (-ps.policies[i].priority, ps.policies[i].name))
        self.policies: list[Policy] = [ps.policies[i] for i in order]
        self.names = [p.name for p in self.policies]
        self.rank = {name: k for k, name in enumerate(self.names)}
        #: each policy's reason in exclusion counts, as text and as a JSON object key
        self.reasons = [REASON_PREFIX + name for name in self.names]
        self.reason_keys = [json.dumps(r) + ":" for r in self.reasons]
        self.name_keys = [json.dumps(name) + ":" for name in self.names]
        attrs = {a: [str(getattr(o, a)) for o in catalog] for a in (*{*ATTRIBUTE_FIELDS.values()}, "location")}
        self.match = np.zeros((len(self.policies), n), dtype=bool)
        for k, p in enumerate(self.policies):
            self.match[k] = _attribute_match(p, ps, attrs, n)
        self._contexts: dict[tuple[str, str, str, str], PolicyContext] = {}
        self._texts: dict[bytes, str] = {}

    @property
    def R(self) -> int:
        return len(self.policies)

    def outcome_buffers(self) -> PolicyOutcome:
        return PolicyOutcome.empty(self.n, self.R)

    def request_class(self, explicit: str | None, ttft_ms: float, tpot_ms: float, deadline_ms: float | None) -> str:
        return self.set.request_class(explicit, ttft_ms, tpot_ms, deadline_ms)

    def context(self, tenant: str, model: str, request_class: str, origin: str) -> PolicyContext:
        """The compiled policies for one request context (cached)."""
        key = (tenant, model, request_class, origin)
        hit = self._contexts.get(key)
        if hit is None:
            if len(self._contexts) >= CONTEXT_CACHE:
                self._contexts.clear()
            hit = self._contexts[key] = self._compile(key)
        return hit

    def _compile(self, key: tuple[str, str, str, str]) -> PolicyContext:
        n = self.n
        static_deny = np.full(n, -1, dtype=np.int64)
        allow_hit = np.zeros(n, dtype=bool)
        has_allow, allow_miss = False, -1
        dyn: list[int] = []
        applied: list[str] = []
        for k, p in enumerate(self.policies):
            if not p.target.matches(*key):
                continue
            applied.append(p.name)
            numeric = p.constraints.numeric
            if p.effect == "allow":
                if not has_allow:
                    has_allow, allow_miss = True, k
                if numeric:
                    dyn.append(k)
                else:
                    allow_hit |= self.match[k]
            elif p.effect == "deny":
                if numeric:
                    dyn.append(k)
                else:
                    static_deny[(static_deny < 0) & self.match[k]] = k
            else:
                dyn.append(k)
        kinds = np.array([_KIND[self.policies[k].effect] for k in dyn], dtype=np.int64)

        def limit(fld: str) -> np.ndarray:
            vals = [getattr(self.policies[k].constraints, fld) for k in dyn]
            return np.array([np.nan if v is None else float(v) for v in vals], dtype=np.float64)

        weights = np.array([self.policies[k].weight or 0.0 for k in dyn], dtype=np.float64)
        return PolicyContext(
            request_class=key[2], applied=tuple(applied), applied_json=json.dumps(applied, separators=(",", ":")),
            static_deny=static_deny, has_allow=has_allow, allow_hit=allow_hit, allow_miss=allow_miss,
            dyn_match=np.ascontiguousarray(self.match[dyn]) if dyn else np.zeros((0, n), dtype=bool),
            dyn_kind=kinds, dyn_rank=np.array(dyn, dtype=np.int64), dyn_max_usd=limit("max_usd_per_hour"),
            dyn_max_rtt=limit("max_rtt_ms"), dyn_min_head=limit("min_headroom"), dyn_weight=weights,
            has_prefer=bool((kinds == PREFER).any()), empty=not applied)

    def apply(self, ctx: PolicyContext, pre: np.ndarray, usd_h: np.ndarray, rtt: np.ndarray, busy: np.ndarray,
              slots: np.ndarray, mask: np.ndarray, out: PolicyOutcome) -> PolicyOutcome:
        """One decision: ``ctx``'s policies on the offerings' current numbers -- ``usd_h`` (price per
        instance-hour, NaN unpriced), ``rtt`` (ms from the request's origin), ``busy`` and ``slots``
        (the pool's requests in flight in the router's view, and its request slots: headroom =
        free share of the slots) -- into ``out``; ``mask`` (the action mask) is ANDed with the
        allowed offerings in place. ``pre``: the offerings a caller's own earlier layers still
        allow (a router's tenant and request constraints; all True otherwise): only those are
        counted, and only those compete in the lexicographic filter."""
        out.excluded = apply_policies(pre, ctx.static, ctx.meta, ctx.dyn_match, ctx.dyn_int, ctx.dyn_float, usd_h, rtt,
                                      busy, slots, mask, out.allowed, out.reason, out.bias, out.counts2)
        out.not_preferred = prefer_filter(mask, pre, out.bias) if self.lexicographic and ctx.has_prefer else 0
        out.ctx = ctx
        return out

    def explain(self, ctx: PolicyContext, out: PolicyOutcome, i: int, usd_h: float, rtt: float, headroom: float
                ) -> dict[str, object]:
        """Offering ``i`` after :meth:`apply` with these numbers: whether the policies allow it,
        which policy excluded it, its bias and the prefer policies that gave it."""
        r = int(out.reason[i])
        biased = []
        if r < 0:
            for q, k in enumerate(ctx.dyn_rank.tolist()):
                if ctx.dyn_kind[q] == PREFER and ctx.dyn_match[q, i] and _meets(ctx, q, usd_h, rtt, headroom):
                    biased.append(self.names[k])
        return {"allowed": r < 0, "excluded_by": None if r < 0 else self.names[r], "bias": float(out.bias[i]),
                "biased_by": biased}

    def counts_text(self, out: PolicyOutcome) -> str:
        """``out``'s exclusions as the members of a JSON object (``"policy:<name>":count,...``);
        cached by the counts (a context's exclusions repeat request after request)."""
        if not out.excluded:
            return ""
        c = out.counts
        key = c.tobytes()
        hit = self._texts.get(key)
        if hit is None:
            keys = self.reason_keys
            if len(self._texts) >= TEXT_CACHE:
                self._texts.clear()
            hit = self._texts[key] = ",".join(f"{keys[k]}{c[k]}" for k in np.flatnonzero(c[: self.R]).tolist())
        return hit

    def counts_dict(self, out: PolicyOutcome) -> dict[str, int]:
        c = out.counts
        return {self.reasons[k]: int(c[k]) for k in np.flatnonzero(c[: self.R]).tolist()}

    def biased_text(self, out: PolicyOutcome) -> str:
        """The prefer policies that raised some allowed offering, with how many: JSON members
        (cached as :meth:`counts_text`)."""
        c = out.bias_counts
        key = b"b" + c.tobytes()
        hit = self._texts.get(key)
        if hit is None:
            keys = self.name_keys
            if len(self._texts) >= TEXT_CACHE:
                self._texts.clear()
            hit = self._texts[key] = ",".join(f"{keys[k]}{c[k]}" for k in np.flatnonzero(c[: self.R]).tolist())
        return hit


def _meets(ctx: PolicyContext, q: int, usd_h: float, rtt: float, headroom: float) -> bool:
    """Whether an offering with these numbers meets ``ctx``'s ``q``-th checked policy's limits
    (as :func:`apply_policies` decides it)."""
    lim = float(ctx.dyn_max_usd[q])
    if lim == lim and not usd_h <= lim:
        return False
    lim = float(ctx.dyn_max_rtt[q])
    if lim == lim and not rtt <= lim:
        return False
    lim = float(ctx.dyn_min_head[q])
    return not (lim == lim and not headroom >= lim)


def headroom(busy: float, slots: float) -> float:
    """A pool's headroom as the policies read it: the free share of its request slots."""
    return max(0.0, (slots - busy) / slots) if slots > 0 else 0.0


@njit(cache=True)
def apply_policies(pre, static, meta, dyn_match, dyn_int, dyn_float, usd_h, rtt, busy, slots, mask, allowed, reason,
                   bias, counts2):  # pragma: no cover
    """One decision's policies in one pass over the offerings (module docstring): writes
    ``allowed`` (bool), ``reason`` (the excluding policy's rank, -1 allowed), ``bias`` (the summed
    prefer weights of an allowed offering, 0 for an excluded one), ``counts2[0]`` (exclusions among
    ``pre`` per rank) and ``counts2[1]`` (allowed offerings among ``pre`` each prefer policy
    raised), ANDs ``mask`` with ``allowed``, and returns the number excluded among ``pre``. The
    context's arrays come packed (:class:`PolicyContext`): ``static`` [first attribute-only deny's
    rank or -1, allow hit], ``meta`` [has allow, allow miss rank], ``dyn_int`` [kind, rank] and
    ``dyn_float`` [max usd, max rtt, min headroom, weight] of each policy checked per decision.

    A numeric limit that is NaN is not set; an offering meets ``max_usd_per_hour`` when its price
    is known and at most the limit, ``max_rtt_ms`` when its RTT is at most the limit,
    ``min_headroom`` when ``(slots - busy) / slots`` (0 without slots) is at least the limit."""
    n = mask.shape[0]
    K = dyn_int.shape[0]
    for k in range(counts2.shape[1]):
        counts2[0, k] = 0
        counts2[1, k] = 0
    has_allow = meta[0] != 0
    allow_miss = meta[1]
    n_out = 0
    for i in range(n):
        r = static[0, i]
        hit = static[1, i] != 0
        b = 0.0
        if K > 0:
            head = 0.0
            if slots[i] > 0:
                head = (slots[i] - busy[i]) / slots[i]
                if head < 0.0:
                    head = 0.0
            for k in range(K):
                if not dyn_match[k, i]:
                    continue
                lim = dyn_float[k, 0]
                meets = lim != lim or usd_h[i] <= lim
                lim = dyn_float[k, 1]
                if meets and lim == lim and not rtt[i] <= lim:
                    meets = False
                lim = dyn_float[k, 2]
                if meets and lim == lim and not head >= lim:
                    meets = False
                kind = dyn_int[k, 0]
                if kind == 0:  # deny: the matching offerings that break a limit
                    if not meets and (r < 0 or dyn_int[k, 1] < r):
                        r = dyn_int[k, 1]
                elif kind == 1:  # allow
                    if meets:
                        hit = True
                elif meets:  # prefer
                    b += dyn_float[k, 3]
                    if pre[i]:  # (counted below if the offering stays allowed)
                        counts2[1, dyn_int[k, 1]] += 1
        if r < 0 and has_allow and not hit:
            r = allow_miss
        reason[i] = r
        if r < 0:
            allowed[i] = True
            bias[i] = b
        else:
            allowed[i] = False
            bias[i] = 0.0
            mask[i] = False
            if pre[i]:
                counts2[0, r] += 1
                n_out += 1
                if K > 0:  # its prefer counts were taken before its exclusion was known: give them back
                    for k in range(K):
                        if dyn_int[k, 0] == 2 and dyn_match[k, i]:
                            lim = dyn_float[k, 0]
                            ok = lim != lim or usd_h[i] <= lim
                            lim = dyn_float[k, 1]
                            if ok and lim == lim and not rtt[i] <= lim:
                                ok = False
                            lim = dyn_float[k, 2]
                            if ok and lim == lim:
                                h = 0.0
                                if slots[i] > 0:
                                    h = (slots[i] - busy[i]) / slots[i]
                                if not h >= lim:
                                    ok = False
                            if ok:
                                counts2[1, dyn_int[k, 1]] -= 1
    return n_out


@njit(cache=True)
def prefer_filter(mask, pre, bias):  # pragma: no cover
    """The lexicographic prefer filter: among the offerings valid in ``mask`` and allowed by
    ``pre``, keep only those with the highest ``bias`` (``mask`` updated in place); returns how
    many of them it dropped (``not_preferred``)."""
    best = -np.inf
    any_ok = False
    for i in range(mask.shape[0]):
        if mask[i] and pre[i]:
            any_ok = True
            if bias[i] > best:
                best = bias[i]
    if not any_ok:
        return 0
    dropped = 0
    for i in range(mask.shape[0]):
        if mask[i] and bias[i] < best:
            mask[i] = False
            if pre[i]:
                dropped += 1
    return dropped


def warm_up() -> None:
    """Compile (or load from numba's cache) now rather than on the first request."""
    n = 2
    ok = np.ones(n, dtype=np.bool_)
    f = np.ones(n)
    apply_policies(ok, np.zeros((2, n), dtype=np.int64), np.zeros(2, dtype=np.int64), np.zeros((0, n), dtype=np.bool_),
                   np.zeros((0, 2), dtype=np.int64), np.zeros((0, 4)), f, f, f, np.ones(n, dtype=np.int64), ok.copy(),
                   ok.copy(), np.full(n, -1, dtype=np.int64), f.copy(), np.zeros((2, 1), dtype=np.int64))
    prefer_filter(ok.copy(), ok, f)
