"""Admission that predicts, the service's side (issue 36; ``docs/router.md``, "Admission, priority
and fairness"): the bounded queue a router process keeps of the requests no pool can serve within
their TTFT SLO now, dispatched by priority and fair share as capacity frees.

The verdict is ``xroute.admission_rules.verdict`` (one definition, shared with the simulated world):
the ``predict`` stage (``router.decision.stages.Predict``) raises ``Unattainable`` with it when the
best predicted TTFT over the feasible pools is over what is left of the request's SLO; a request no
pool can take at all (``no_capacity``, in the ranking or in the shared state) is judged with an
infinite prediction. ``shed`` is the answer at once (429 ``slo_unattainable``); ``queue`` waits here
(:meth:`AdmissionQueue.wait`).

Contract:

* **Bounded.** At most ``admission.queue_limit`` requests wait in one process; one more is a 429
  ``admission_queue_full`` naming the limit. Nothing of it was taken (no pool, no quota).
* **Order.** A dispatch pass tries the waiting requests in ``xroute.admission_rules.dispatch_order``
  (:class:`FairQueue` keeps it without sorting: the highest band first, within a band the tenant
  with the lowest fairness counter, within a tenant first come first served) on the counters the
  shared state holds (``DecisionState.fairness``: every router and worker reads one set; a tenant
  just backlogged is lifted first). Each try is a whole decision again (the prediction with the
  time waited); a request placed moves its tenant's counter by its service and the pass goes on;
  the first that does not fit ends the pass (a lower one never overtakes it). Nor does an arrival:
  one that finds a request of its band or a higher one waiting here joins the queue behind them
  (sheddable: shed) without a decision (:meth:`AdmissionQueue.ahead`,
  ``xroute.admission_rules.waits_ahead``; ``router.service.admission.placed``).
* **When.** A pass runs when capacity frees here -- a feedback's release, a decision given back --
  when a waiting request's budget runs out (the one behind it may fit now),
  when a read of the shared view shows a pool with less in-flight work than the last read (the
  capacity other routers free, and reservations whose hold passed, are seen only in the state:
  ``router.service.recovery.refresh_shared_view``, every ``state_view_refresh_s``), and every
  ``admission.recheck_s`` while anything waits.
* **Leaving.** A request whose budget runs out waiting leaves with 429 ``slo_unattainable``; one
  whose client goes away (``left`` returns: the ASGI ``http.disconnect``) leaves the queue, and
  anything a try placed for it meanwhile is given back.
* **Metrics.** ``xroute_router_admission_queue_length`` (gauge), ``xroute_router_admission_wait_seconds``
  (histogram, by outcome) and ``xroute_router_admission_total{band,outcome}``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from router.core.logs import LOG
from router.decision.engine import RouteFailure
from router.decision.stages import Unattainable
from xroute import admission_rules as rules


class Waiting(Protocol):
    """What :class:`FairQueue` reads of a waiting request."""

    band: int
    tenant: str
    seq: int


W = TypeVar("W", bound=Waiting)


class FairQueue(Generic[W]):
    """The waiting requests, per band and per tenant, first come first served within a tenant:
    :meth:`first` is ``xroute.admission_rules.dispatch_order(...)[0]`` over the counters given,
    without sorting (a band's backlogged tenants scanned for the lowest counter)."""

    def __init__(self) -> None:
        self._bands: list[dict[str, deque[W]]] = [{} for _ in rules.BANDS]
        self._n = 0
        #: the requests waiting per band (by band index)
        self.per_band: list[int] = [0] * len(rules.BANDS)

    def __len__(self) -> int:
        return self._n

    def push(self, w: W) -> bool:
        """Add ``w`` (its ``seq`` above every one waiting); True when its tenant was not backlogged."""
        new = not any(w.tenant in band for band in self._bands)
        self._bands[w.band].setdefault(w.tenant, deque()).append(w)
        self._n += 1
        self.per_band[w.band] += 1
        return new

    def remove(self, w: W) -> bool:
        """Take ``w`` out (False: it was not waiting)."""
        band = self._bands[w.band]
        q = band.get(w.tenant)
        if q is None or w not in q:
            return False
        q.remove(w)
        if not q:
            del band[w.tenant]
        self._n -= 1
        self.per_band[w.band] -= 1
        return True

    def first(self, counters: Mapping[str, float]) -> W | None:
        """The request to dispatch first as ``counters`` stand (None: none waits)."""
        for band in self._bands:
            if band:
                tenant = min(band, key=lambda t: (counters.get(t, 0.0), t))
                return band[tenant][0]
        return None

    def tenants(self) -> list[str]:
        """The backlogged tenants."""
        return sorted({t for band in self._bands for t in band})


@dataclass(slots=True, eq=False)
class Waiter:
    """One request in the queue: its band's rank, tenant, arrival, budget and service, how to try
    it again (``attempt(waited_ms)``: a whole decision) and to give back what a try placed when
    nobody waits for it any more, and the future its route awaits."""

    band: int
    tenant: str
    seq: int
    arrived: float
    deadline: float
    service: float
    attempt: Callable[[float], Awaitable[Any]]
    give_back: Callable[[Any], Awaitable[None]]
    refusal: Unattainable
    done: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    timer: asyncio.TimerHandle | None = None


def judged(e: RouteFailure, band: str, slo_ms: float, waited_ms: float, engine: Any) -> Unattainable | None:
    """What admission makes of a decision's failure: the predict stage's verdict as it is; a
    request no pool can take at all (``no_capacity``) judged with an infinite prediction; None for
    any other failure (it is the answer)."""
    if isinstance(e, Unattainable):
        return e
    if e.error != "no_capacity":
        return None
    v = rules.verdict(band, float("inf"), slo_ms, waited_ms)
    refusal = engine.unattainable(v, band, float("inf"), slo_ms - waited_ms)
    refusal.extra = {**e.extra, **refusal.extra}
    return refusal  # type: ignore[no-any-return]


class AdmissionQueue:
    """One router process's admission queue (module docstring)."""

    def __init__(self, state: Any, limit: int, recheck_s: float, metrics: Any):
        self.state, self.limit, self.recheck_s, self.metrics = state, limit, recheck_s, metrics
        self.fq: FairQueue[Waiter] = FairQueue()
        self._seq = 0
        self._lift: set[str] = set()
        self._counters: dict[str, float] = {}
        self._pass: asyncio.Task[None] | None = None
        self._again = False
        self._timer: asyncio.TimerHandle | None = None

    def ahead(self, band: str) -> bool:
        """Whether a request of ``band`` arriving now finds one waiting here that the queue dispatches
        before it (``xroute.admission_rules.waits_ahead``): then it does not overtake them."""
        return rules.waits_ahead(band, self.fq.per_band)

    def waiter(self, band: str, tenant: str, slo_ms: float, service: float, refusal: Unattainable,
               attempt: Callable[[float], Awaitable[Any]], give_back: Callable[[Any], Awaitable[None]],
               arrived: float) -> Waiter:
        self._seq += 1
        return Waiter(rules.band_index(band), tenant, self._seq, arrived, arrived + slo_ms / 1000.0, service,
                      attempt, give_back, refusal)

    async def wait(self, w: Waiter, left: Callable[[], Awaitable[Any]] | None = None) -> Any:
        """Queue ``w`` until a pass places it (its decision), its budget runs out (429
        ``slo_unattainable``) or ``left`` returns (the client went away: cancelled)."""
        band = rules.BANDS[w.band]
        if len(self.fq) >= self.limit:
            self.metrics.admission.labels(band, "queue_full").inc()
            raise RouteFailure(429, "admission_queue_full", f"the admission queue is full ({self.limit} requests "
                               "wait in this router: admission.queue_limit)", headers={"Retry-After": "1"},
                               extra={"priority": band, "queue_limit": self.limit})
        if self.fq.push(w):
            self._lift.add(w.tenant)
        self.metrics.admission.labels(band, "queued").inc()
        w.timer = asyncio.get_running_loop().call_at(
            asyncio.get_running_loop().time() + max(w.deadline - time.monotonic(), 0.0), self._expire, w)
        self._changed()
        self.kick()
        outcome = "left"
        try:
            got = await (w.done if left is None else _first_of(w.done, left))
            outcome = "dispatched"
            return got
        except RouteFailure as e:
            outcome = "expired" if isinstance(e, Unattainable) else "left" if e.status == 499 else "failed"
            raise
        finally:
            if w.timer is not None:
                w.timer.cancel()
            if not w.done.done():
                w.done.cancel()
            self.fq.remove(w)
            self._changed()
            self.metrics.admission.labels(band, outcome).inc()
            self.metrics.admission_wait.labels(outcome).observe(time.monotonic() - w.arrived)

    def _expire(self, w: Waiter) -> None:
        """``w``'s TTFT budget is spent: it leaves with 429 ``slo_unattainable``, and a pass runs (a pass
        ends at the first that does not fit: the one behind it may fit now)."""
        if self.fq.remove(w) and not w.done.done():
            w.done.set_exception(w.refusal)
        self._changed()
        self.kick()

    def _changed(self) -> None:
        self.metrics.admission_queue.set(len(self.fq))

    def kick(self) -> None:
        """Capacity may have freed: run a dispatch pass (one at a time; another after it if asked meanwhile)."""
        if not self.fq:
            return
        if self._pass is not None and not self._pass.done():
            self._again = True
            return
        self._pass = asyncio.get_running_loop().create_task(self._run(), name="admission-pass")

    async def _run(self) -> None:
        while True:
            self._again = False
            try:
                await self._dispatch()
            except Exception as e:  # (logged; the next kick or re-check tries again)
                LOG.warning("admission pass failed", extra={"fields": {"error": f"{type(e).__name__}: {e}"[:300]}})
            if not (self._again and self.fq):
                break
        if self.fq and (self._timer is None or self._timer.cancelled() or self._timer.when()
                        <= asyncio.get_running_loop().time()):
            self._timer = asyncio.get_running_loop().call_later(self.recheck_s, self.kick)

    async def _counters_now(self) -> dict[str, float]:
        """The backlogged tenants' counters in the shared state (the just backlogged lifted first);
        the last ones read when the state cannot answer."""
        lift, self._lift = sorted(self._lift), set()
        try:
            self._counters = dict(await self.state.fairness(self.fq.tenants(), lift))
        except Exception as e:
            # the lifts not applied stay pending for the next read (dropped, a newly backlogged
            # tenant would count 0 against the others' read counters until it is lifted again)
            self._lift.update(lift)
            LOG.warning("fairness counters not read (the last ones serve)", extra={"fields": {"error": str(e)[:300]}})
            others = [v for t, v in self._counters.items() if t not in self._lift]
            for t in lift:  # (meanwhile lifted here as the shared state would: never 0 against the others)
                self._counters[t] = rules.lift(self._counters.get(t, 0.0), others)
        return self._counters

    async def _dispatch(self) -> None:
        """One pass (module docstring, "Order")."""
        counters = await self._counters_now()
        while True:
            w = self.fq.first(counters)
            if w is None:
                return
            waited_ms = (time.monotonic() - w.arrived) * 1000.0
            try:
                got = await w.attempt(waited_ms)
            except RouteFailure as e:
                refusal = e if isinstance(e, Unattainable) else None
                if refusal is None and e.error == "no_capacity":
                    return  # no room yet: it keeps its place
                if refusal is not None and refusal.verdict == rules.QUEUE:
                    return
                self._leave(w, e)  # its budget is spent, or another failure: that is its answer
                continue
            except Exception as e:
                self._leave(w, e)
                continue
            if self.fq.remove(w) and not w.done.done():
                w.done.set_result(got)
                counters[w.tenant] = counters.get(w.tenant, 0.0) + w.service
            else:  # it left while it was tried: what the try placed goes back
                await w.give_back(got)

    def _leave(self, w: Waiter, e: BaseException) -> None:
        if self.fq.remove(w) and not w.done.done():
            w.done.set_exception(e)


async def _first_of(done: asyncio.Future[Any], left: Callable[[], Awaitable[Any]]) -> Any:
    """``done``'s result, unless ``left`` returns first (cancelled: the client went away)."""
    gone = asyncio.ensure_future(left())
    try:
        await asyncio.wait([done, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not done.done():  # (nobody reads this answer: said for the access log)
        raise RouteFailure(499, "client_disconnected", "the client went away while its request waited")
    return done.result()


def client_gone(receive: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[None]]:
    """What returns when the client of an ASGI request whose body has been read goes away (its
    ``http.disconnect``): :meth:`AdmissionQueue.wait`'s ``left``."""

    async def left() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return left
