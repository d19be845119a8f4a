"""The router's state besides telemetry: the types its operations take and answer, and its two
backends' shared arithmetic. The operations themselves are declared where they are consumed
(``router.service.ports``: the decision path's ``admit``, ``settle``, ``lookup``, ``view``;
idempotency; recovery), each backend implementing them:
:class:`router.state.embedded.EmbeddedState` (the default; one synchronous core in this process,
behind one generic async adapter; durable through the decision log) and
``router.state.redis.RedisState`` (Redis or Valkey: any number of router processes and hosts share
one view; every operation is one server-side Lua script, ``router/state/lua/``).

What the state holds:

* **in-flight work per pool** -- an :class:`Admission` reserves ``slots`` on the first of a ranked
  list of ``(pool, capacity)`` candidates that has room, until its :class:`Settlement` releases it
  or its ``hold_s`` passes (derived from the work's expected time: :func:`hold_for`; then counted
  per pool as expired). The pool key is an opaque string (:func:`pool_key`); capacity an int of slots.
* **tenant quotas** -- the same admission checks an optional :class:`QuotaCharge` against every
  limit of the buckets it counts in (``xroute.schema.quota``) and counts it in all of them: the
  pool and the quotas are taken together or not at all (``router.state.ledger`` holds the
  arithmetic); the settlement reconciles them with what the request used, or undoes them.
* **outcome statistics per pool** -- a settlement's :class:`PoolOutcome` (time to first token,
  duration, failure) folds into an exponentially weighted mean and variance of each (the estimator
  below): O(1) memory per pool, whatever the traffic; the decisions read the mean durations
  (:class:`StateView`).
* **prefix affinity and sessions** -- which pool recently received which KV-cache blocks of the
  prompts the router sent (``envs.prefix``: the router's view, an aging record, never the servers'
  real caches): the lookup answers, for a request's block hashes, the leading blocks each pool is
  expected to hold (an :class:`Affinity`, with the pools' retention and the pool the request's
  session last went to); the admission records a decision's blocks, session and prediction on the
  pool it took (:class:`PrefixSend`); a settlement's ``cached_tokens`` corrects the pool's
  retention. Every worker and host sharing the state sees the same affinity.
* **fairness counters** -- with admission on, each tenant's Virtual Token Counter
  (``xroute.admission_rules``): an admission's ``fair`` adds the request's weighted service to its
  tenant's counter, a settlement's ``fair`` corrects it with what the outcome reports, and
  ``fairness`` (the admission queue's, never on the decision path) lifts the tenants that became
  backlogged and reads the counters. Every router and worker sharing the state reads one set.
* **idempotency keys** -- a claim takes a key for ``ttl_s`` or returns what the first request with
  it answered (:class:`Claim`); complete stores that answer, abandon drops a claim whose request
  failed, so a retry decides anew.

When Redis cannot be reached its operations raise :class:`StateUnavailable` -- the API's 503 (fail
closed, the default); ``router.state.failopen.FailOpenState`` (``state_fail_open``) answers from an
embedded view instead while the server is away.

The estimator (both backends, the same arithmetic): for each pool and each measure ``x`` (TTFT ms,
duration ms) with weight ``alpha`` (``state_stats_alpha``, default 0.05: the last ~20 outcomes
carry 64 % of the weight, the half-life is ~13.5 outcomes), the first observation sets
``mean = x, var = 0``; each later one ``d = x - mean; mean += alpha * d;
var = (1 - alpha) * (var + alpha * d * d)`` (the incremental exponentially weighted variance,
Finch 2009). The failure rate is the same mean over 0/1. Counts are kept exactly.

The per-request types (an admission, a settlement and their answers, a lookup's affinity) are
plain slotted dataclasses -- not frozen, whose construction costs five times as much -- and are not
changed once made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from router.core.settings import HOLD_FACTOR, HOLD_FLOOR_S, HOLD_MAX_S
from router.state.ledger import QuotaUsage, QuotaVerdict
from xroute.schema.quota import QuotaBucket


class StateUnavailable(RuntimeError):
    """The shared state's server cannot be reached (or did not answer in time): the router cannot
    tell what the other routers have admitted, so it answers 503 rather than guess (fail closed)."""


class StateRestoring(StateUnavailable):
    """The shared state lost its data (a new :class:`Epoch`) and the routers' decision logs are not
    all back in it yet: an idempotency key it lacks may have been answered before, so a keyed
    request is not decided anew -- the API's 503 with ``Retry-After``, never a second decision. Not
    an outage: a fail-open state does not answer it locally either."""


def hold_for(expected_s: float, factor: float = HOLD_FACTOR, floor_s: float = HOLD_FLOOR_S,
             max_s: float = HOLD_MAX_S) -> float:
    """How long to hold a reservation whose release may never come: ``factor`` times the work's
    expected time (its expected latency: the wait and the service), at least ``floor_s`` and at
    most ``max_s`` seconds."""
    return min(max_s, max(floor_s, factor * max(expected_s, 0.0)))


@dataclass(frozen=True, slots=True)
class Claim:
    """A claim's answer (``router.service.ports.Idempotency``): ``"new"`` (the key is the caller's
    now: decide, then complete or abandon), ``"pending"`` (another request
    with the key is being decided: answer 409) or ``"done"`` (``answer`` is the first answer: send
    it again, book nothing)."""

    status: Literal["new", "pending", "done"]
    answer: bytes | None = None


@dataclass(frozen=True, slots=True)
class Epoch:
    """One lifetime of a shared state on its server (``router.service.ports.Recovery.epoch``): ``id`` changes
    when the server lost its data (restarted without persistence, flushed); ``started`` is when
    that lifetime began (wall seconds, the server's clock)."""

    id: str
    started: float


@dataclass(slots=True)
class Affinity:
    """The lookup's answer (``router.service.ports.DecisionState.lookup``): per pool with a match, the leading blocks of the
    request's prompt the index expects cached there (``runs``) and the pool's retention (the share
    of the predicted cached tokens its servers confirmed, 1 before any report); the pool the
    request's session last went to within the age bound, or None -- as stored: a committed
    migration's target carries a mark (``router.decision.engine.session_entry`` reads it)."""

    runs: dict[str, int]
    retention: dict[str, float]
    session_pool: str | None = None


@dataclass(slots=True)
class PrefixSend:
    """What a decision records in the prefix index with its :class:`Admission`: the
    prompt's block hashes, the session key (or None), the age bound (``ttl_s``), and per candidate
    pool (the reservation picks one) its cache capacity in blocks, the cached tokens the view
    predicted there and the seconds until the blocks are expected computed (its expected TTFT)."""

    hashes: np.ndarray
    session: str | None
    ttl_s: float
    candidates: dict[str, tuple[int, float, float]]


@dataclass(slots=True)
class QuotaCharge:
    """What a request counts in its tenant's quotas: the buckets it counts in (all of them, or
    none), its tokens (``input_tokens + max_output_tokens``) and USD (the expected cost), one
    request and one concurrency slot."""

    buckets: Sequence[QuotaBucket]
    tokens: int
    usd: float


@dataclass(slots=True)
class Admission:
    """One decision's admission, all or nothing (one Lua script on Redis, one round trip): reserve
    ``slots`` on the first ``(pool, capacity)`` of ``candidates`` whose in-flight work plus
    ``slots`` stays within its capacity, until a settlement releases it or ``hold_s`` seconds pass;
    with ``quota``, count the request in its tenant's quotas when every limit of every bucket has
    room (the concurrency slot held as long); with ``prefix``, record its blocks, session and
    prediction on the pool taken. An id that holds a reservation already gets its pool back and
    books nothing (a retry). Nothing is taken when no candidate has room or a quota refuses."""

    reservation_id: str
    candidates: Sequence[tuple[str, int]]
    hold_s: float
    quota: QuotaCharge | None = None
    prefix: PrefixSend | None = None
    slots: int = 1
    #: with admission on: the tenant whose fairness counter grows by the request's service
    #: (``xroute.admission_rules.service``) when it is admitted -- in the same call, no extra round trip
    fair: tuple[str, float] | None = None


@dataclass(slots=True)
class Admitted:
    """An admission's answer: the pool reserved, or None when nothing was taken -- then ``refused``
    is the quota's verdict when a limit refused it (the first limit hit), None when no candidate
    had room (checked first: a full pool's request is not counted against a quota)."""

    pool: str | None
    refused: QuotaVerdict | None = None


@dataclass(slots=True)
class PoolOutcome:
    """One outcome of work on ``pool``, for its statistics (the module docstring's estimator)."""

    pool: str
    ttft_ms: float | None = None
    duration_ms: float | None = None
    failed: bool = False


@dataclass(slots=True)
class QuotaSettle:
    """What a settlement does with the decision's tenant quota reservation: reconcile it with what
    the request used (``tokens`` while in the sliding window, ``usd`` in its day; None keeps what was
    reserved; its concurrency slot frees) -- once -- or, ``undo``, give back everything it counted
    (the request was not admitted after all)."""

    tokens: int | None = None
    usd: float | None = None
    undo: bool = False


#: a settlement's quota part that undoes the reservation (shared: never changed)
QUOTA_UNDO = QuotaSettle(undo=True)


@dataclass(slots=True)
class Settlement:
    """One decision's outcome, or its undo, in one call (one Lua script on Redis): ``release`` its
    pool's reservation (twice is harmless), fold ``outcome`` into the pool's statistics, settle or
    undo its ``quota`` reservation, and fold ``cached_tokens`` (what a server reported cached of the
    prompt) into the retention of the pool its prefix was recorded on (``envs.prefix.retention_update``,
    weight ``retention_alpha``; once per decision). Every part optional."""

    reservation_id: str
    release: bool = True
    outcome: PoolOutcome | None = None
    quota: QuotaSettle | None = None
    cached_tokens: float | None = None
    retention_alpha: float = 0.0
    #: the tenant whose fairness counter changes by this much (``xroute.admission_rules.correction``:
    #: the service its outcome reports less what its admission counted; may be negative)
    fair: tuple[str, float] | None = None


@dataclass(slots=True)
class Settled:
    """What a settlement found: the pool released (None: not held -- never reserved, released or
    expired already), whether a quota reservation was settled or undone (False: none held, or
    settled already), the pool whose retention learned the cached tokens (None: no prediction)."""

    pool: str | None = None
    quota: bool = False
    retention_pool: str | None = None


@dataclass(slots=True)
class StateView:
    """The state as the decisions and the status pages read it: slots reserved per pool (pools
    with none absent), reservations expired per pool since the state began, the observed mean
    duration (ms) of the pools with work in flight (when asked), and each asked quota bucket's
    usage (zeros for one never used)."""

    in_flight: dict[str, int]
    expired: dict[str, int] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    quotas: dict[str, QuotaUsage] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reserved:
    """A decision log event: ``reservation_id`` took ``slots`` on ``pool`` until ``until`` (wall clock)."""

    reservation_id: str
    pool: str
    until: float
    slots: int = 1


@dataclass(frozen=True, slots=True)
class Released:
    """A decision log event: ``reservation_id``'s work ended (feedback came)."""

    reservation_id: str


def _ewm(n: int, mean: float, var: float, x: float, alpha: float) -> tuple[float, float]:
    """One step of the exponentially weighted mean and variance (module docstring)."""
    if n == 0:
        return x, 0.0
    d = x - mean
    return mean + alpha * d, (1.0 - alpha) * (var + alpha * d * d)


def _finite(x: float | None, name: str) -> float | None:
    if x is not None and not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return x


def _check_reserve(candidates: Sequence[tuple[str, int]], hold_s: float, slots: int) -> None:
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if not (hold_s > 0 and math.isfinite(hold_s)):
        raise ValueError(f"hold_s must be a positive number of seconds, got {hold_s!r}")
    for pool, capacity in candidates:
        if not isinstance(pool, str) or int(capacity) != capacity:
            raise ValueError(f"candidates must be (pool: str, capacity: int) pairs, got {(pool, capacity)!r}")


def pool_key(model: str, offering_id: str) -> str:
    """The state's key of a pool: the (model, offering) pair (``docs/env.md``, "Pools")."""
    return f"{model}|{offering_id}"


# ------------------------------------------------------------------ outlier ejection
@dataclass(frozen=True, slots=True)
class EjectionRule:
    """When a target (a server, a pool: an opaque string) is ejected (``router.service.ports.Ejections``):
    after ``after`` consecutive failures, for ``base_s`` seconds, doubled on each ejection in a row
    (a failed half-open probe, or a new ejection less than ``max_s`` after it came back), at most
    ``max_s``."""

    after: int
    base_s: float
    max_s: float


@dataclass(slots=True)
class Ejection:
    """A target's health as the state has it: its consecutive failures, the ejections it has had
    in all, and ``left_s`` -- None: not ejected; > 0: ejected for this long yet; <= 0: its interval
    is over and it is half-open (one probe lets it back). ``probe``: the caller holds the probe
    (claimed by this call); ``ejected_now``: the report that answered this ejected it."""

    target: str
    failures: int
    ejections: int
    left_s: float | None
    probe: bool = False
    ejected_now: bool = False


def check_rule(rule: EjectionRule) -> None:
    if rule.after < 1:
        raise ValueError(f"after must be >= 1, got {rule.after}")
    if not (0 < rule.base_s <= rule.max_s and math.isfinite(rule.max_s)):
        raise ValueError(f"need 0 < base_s <= max_s (finite), got {rule.base_s!r}, {rule.max_s!r}")


def as_ejection(target: str, rec: Sequence[int], now_ms: int, probe: bool = False,
                ejected_now: bool = False) -> Ejection:
    """A record (:func:`ejection_step`) as its :class:`Ejection` at ``now_ms``."""
    return Ejection(target, int(rec[0]), int(rec[2]), (int(rec[3]) - now_ms) / 1000.0 if rec[3] else None, probe,
                    ejected_now)


def ejection_step(rec: list[int], failed: bool, now_ms: int, rule: EjectionRule) -> bool:
    """One outcome folded into a target's record ``rec`` = ``[failures, streak, ejections, until ms,
    probe lease ms, back since ms]`` (changed in place; ``until`` 0: not ejected); True when it
    ejected the target. The Redis script ``lua/lib/eject.lua`` is this function, line for line:

    * ejected (``now < until``): nothing (an attempt decided before the ejection);
    * half-open (``until <= now``): a success brings it back (failures, until, lease 0; back = now),
      a failure ejects it again for the doubled interval;
    * otherwise a success clears the failures; a failure counts, and the ``after``-th in a row
      ejects it: for ``min(max, base * 2**streak)``, ``streak`` + 1 -- after a reset of ``streak``
      to 0 when it came back at least ``max`` ago."""
    fails, streak, total, until, _lease, back = rec
    if until > 0:
        if now_ms < until:
            return False
        if not failed:
            rec[:] = [0, streak, total, 0, 0, now_ms]
            return False
    elif not failed:
        rec[0] = 0
        return False
    else:
        fails += 1
        if fails < rule.after:
            rec[0] = fails
            return False
        if back > 0 and now_ms - back >= round(rule.max_s * 1000):
            streak = 0
    interval = min(round(rule.max_s * 1000), round(rule.base_s * 1000) * 2 ** min(streak, 40))
    rec[:] = [0, streak + 1, total + 1, now_ms + interval, 0, back]
    return True
