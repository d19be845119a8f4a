"""Greedy's twin: the queues greedy would have built had it routed every request itself.

The watchdog (``router.decision.watchdog``; docs/ope.md, "The watchdog") compares the champion with
greedy. Greedy's choice *in the champion's state* -- the queues the champion's routing left -- is
optimistic for a champion that spreads load: greedy routing everything itself would have crowded
its favourite pools. The twin is that counterfactual state, kept beside the real one:

* **its pools** are the router's view of its own in-flight work (``est_free``, ``est_min``,
  ``inflight``, ``shift`` of ``envs.cloud_route``), a second copy of them in which *greedy* placed
  every request the router saw: at each request, greedy's choice in the twin's state takes the
  slot the twin expects to free first (``envs.kernels.view_admit``) for the request's expected
  service time there;
* **its releases** follow what the router learns of the *real* request, as the real view's do:
  when the real request is seen complete at ``now`` (the simulation's observed completion, a live
  router's feedback, or its expected end passing without feedback: the environment's
  ``completion_listener``), greedy's copy is taken to have run as much longer or shorter than
  expected, in proportion: it ends at ``t0 + (now - t0) * (twin's expected end - t0) / (real
  expected end - t0)``, ``t0`` the decision's time (``envs.kernels.view_complete``; at that end
  when it is still to come). The real request's realized duration, scaled to greedy's pool and
  queue: the errors that matter -- the output length the router over-estimates (its upper
  estimate) and the service noise -- are the request's, wherever it runs; greedy's own pool's
  realized service is never known (its request was never served there). Where greedy's choice is
  the real one in the same state, the twin's release is exactly the real view's (so a champion
  that routes like greedy has a twin equal to the real view). A request the router never admitted
  (refused after ranking, failed) ends in the twin at its expected end. No foresight: each
  release uses only what the router knew by then;
* **greedy's choice and value there** are the environment's own expectations for the current
  request (``CloudRouteEnv.outcomes_into``, ``expected_rewards``, ``rank``), with the
  same inputs as the real decision's -- telemetry, the request, the prefix view, other routers'
  work, the pools' observed service times -- except this router's in-flight counts and expected
  slot releases, which are the twin's (and a pool's scraped load, where its servers report it,
  has the router's real work in it replaced by the twin's). Its valid set: the real decision's,
  with the pools' wait re-judged on the twin's queues (a pool the real queue timed out is
  admitted when its other constraints allow it and the twin's queue does not time out).

:meth:`GreedyTwin.step` returns ``delta``: greedy's expected reward in the twin's state minus its
expected reward in the real state (the real decision's greedy choice, the real expectations) --
what the watchdog adds to its model of greedy's reward. It is 0 while the twin's queues are the
real ones (a champion that routes like greedy).

One twin per environment (per router process: the requests this process decides); other routers'
work enters as it enters the real view (``view_others``), never as greedy's.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import numpy as np

from envs import kernels
from envs.cloud_route import resize_slots


class GreedyTwin:
    """The twin of an environment's router view (module docstring). Create it after the
    environment's ``reset``; call :meth:`step` once per request, after the request was made current
    (``set_live``, or the simulation's step) and before the real view admits it; :meth:`admitted`
    when the router admits it (the simulation admits every request it does not fail). It listens
    to the environment's completions (``completion_listener``)."""

    def __init__(self, env: Any):
        self.env = env
        self.reset()
        env.completion_listener = self.completed

    def reset(self) -> None:
        """Empty twin pools (as the environment's after ``reset``: no work in flight)."""
        e = self.env
        pad = np.arange(e.smax)[None, None, :] >= e.slots[:, :, None]
        self.est_free = np.where(pad, np.inf, -np.inf)
        self.est_min = np.where(e.slots > 0, -np.inf, np.inf)
        self.inflight = np.zeros_like(e.inflight)
        self.shift = np.zeros(self.est_free.shape)
        self.slots = e.slots.copy()
        self.C = np.zeros((kernels.N_OUT, e.n))
        self.mask = np.zeros(e.n, dtype=bool)
        #: greedy's requests in flight, by the real request's reference: (model, offering, slot, the
        #: decision's time, the expected end, admitted by the router)
        self.live: dict[Any, list[Any]] = {}
        #: when to look at a request again: (time, seq, ref, end-or-nan); nan: at its expected end,
        #: released unless the router admitted it (then its completion releases it)
        self._due: list[tuple[float, int, Any, float]] = []
        self._seq = 0

    def admitted(self, ref: Any) -> None:
        """The router admitted the real request ``ref`` (its view holds it): greedy's copy ends with
        it (module docstring), not at its own expected end."""
        x = self.live.get(ref)
        if x is not None:
            x[5] = True

    def completed(self, ref: Any, now: float, real_end: float) -> None:
        """The real request ``ref`` was seen complete at ``now``, its view having expected it to end
        at ``real_end``: greedy's copy ends in proportion (module docstring) -- now, or at that end."""
        x = self.live.get(ref)
        if x is None:
            return
        t0, end = x[3], x[4]
        span = real_end - t0
        at = t0 + (now - t0) * (end - t0) / span if span > 0.0 else end + (now - real_end)
        if at > now:
            self._seq += 1
            heapq.heappush(self._due, (at, self._seq, ref, at))
        else:
            self._end(ref, at)

    def _end(self, ref: Any, at: float) -> None:
        m, a, j, _, end, _ = self.live.pop(ref)
        shift = self.shift[m]
        kernels.view_complete(self.est_free[m], self.est_min[m], self.inflight[m], shift, a, j, at, end, shift[a, j])

    def _release(self, t: float) -> None:
        """What is due by ``t``: greedy's copies whose end came, and those the router never admitted
        at their expected end."""
        due = self._due
        while due and due[0][0] <= t:
            _, _, ref, at = heapq.heappop(due)
            x = self.live.get(ref)
            if x is None:
                continue
            if at == at:  # (an end from the real request's completion)
                self._end(ref, at)
            elif not x[5]:  # its expected end, never admitted
                self._end(ref, x[4])

    def shift_clock(self, dt: float) -> None:
        """The router's telemetry clock jumped by ``dt`` (``CloudRouteEnv.shift_live_clock``): the
        twin's expected releases move with it."""
        self.est_free += dt
        self.est_min += dt
        self._due = [(t + dt, q, ref, at + dt) for t, q, ref, at in self._due]
        heapq.heapify(self._due)
        for x in self.live.values():
            x[3] += dt
            x[4] += dt

    def _follow_sizes(self, t: float) -> None:
        """The pools' sizes moved (the inventory): the twin's slots follow as the real view's do
        (``CloudRouteEnv._resize``)."""
        e = self.env
        if np.array_equal(e.slots, self.slots):
            return
        for m, a in zip(*np.nonzero(e.slots != self.slots)):
            self.est_min[m, a] = resize_slots(self.est_free[m, a], int(self.slots[m, a]), int(e.slots[m, a]), t)
        self.slots = e.slots.copy()

    def step(self, ref: Any, valid: np.ndarray, greedy: int, bias: np.ndarray | None = None,
             allowed: np.ndarray | None = None) -> tuple[int, float]:
        """The current request (the router's reference ``ref``: what its completion will name),
        routed by greedy in the twin: ``valid`` is the real decision's
        valid set and ``greedy`` its greedy choice there; ``bias`` the prefer policies' weights
        (reward units; greedy ranks by the expected reward plus them); ``allowed`` the caller's own
        constraints beyond the environment's (the router's allow/deny, access, pool events; None:
        none). Returns (greedy's choice in the twin, ``delta``: its expected reward there minus the
        real greedy choice's in the real state; 0.0 and -1 when greedy has no valid choice in the
        twin). The twin's slot is taken for the request's expected service time there."""
        e = self.env
        t, m = float(e.t), int(e.r_m)
        self._release(t)
        self._follow_sizes(t)
        rw = e.cfg.reward
        args = (e.r_ref_cost, e.r_budget, e.cfg.retry_overhead_ms, rw.cost_weight, rw.latency_weight,
                rw.sla_penalty, rw.cost_norm_cap, rw.latency_norm_cap)
        real = kernels.expected_rewards(e.C, valid, *args)
        # a pool's scraped load has this router's real work in it: the twin's replaces it
        sb = e.view_server_busy[m]
        if (sb >= 0.0).any():
            sb = np.where(sb >= 0.0, np.maximum(sb - e.inflight[m] + self.inflight[m], 0.0), sb)
        C, mask = self.C, self.mask
        e.outcomes_into(C, mask, self.est_min[m], self.inflight[m], sb, e.c_rtt)
        # the real valid set, with each pool's wait judged on the twin's queue: a pool the real queue
        # timed out comes back when everything else allows it
        timed_out = e.static_ok[m] & (e.C[kernels.WAIT] > e.cfg.queue_timeout_s) & e.r_allowed
        if e.r_over is not None:
            timed_out &= ~e.r_over
        if allowed is not None:
            timed_out &= allowed
        tv = (valid | timed_out) & mask
        if not tv.any():
            return -1, 0.0
        r = kernels.expected_rewards(C, tv, *args)
        g = int(kernels.rank(r if bias is None else r + bias, tv, 0)[0])
        j, end, _ = kernels.view_admit(self.est_free[m], self.est_min[m], self.inflight[m], self.shift[m], g, t,
                                       C[kernels.SERVICE, g])
        if ref in self.live:  # (a reference seen twice: the older copy ends now)
            self._end(ref, t)
        self.live[ref] = [m, g, int(j), t, float(end), False]
        self._seq += 1
        heapq.heappush(self._due, (float(end), self._seq, ref, math.nan))
        return g, float(r[g] - real[greedy]) if greedy >= 0 and valid[greedy] else 0.0
