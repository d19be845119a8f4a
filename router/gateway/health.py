"""What the gateway learns of its servers and pools: outlier ejection and the retry budget.

**Outlier ejection** (Envoy's consecutive-failure detection, ``gateway.ejection``). Each attempt's
outcome is reported to the shared state (``router.service.ports.Ejections.report``) for its pool
(``pool:<model>|<offering>``) and for each server it reached (``server:<base URL>``): a connection
refused or timed out, a ``5xx``, a first token (or, not streamed, an answer) that did not come in
time, or a server gone before its first token are failures; an answer is a success; the client's
faults (it went away, its request was refused as invalid) and a ``429`` (the server is alive and
says so) count neither way. ``consecutive_failures`` in a row eject the target for ``base_s``,
doubled on each ejection in a row (a failed probe, or a new ejection within ``max_s`` of its
return) up to ``max_s``; then it is half-open: one probe request (one router at a time holds it),
whose success brings it back and whose failure ejects it again for the doubled interval. The
state's answer goes into this process's view at once (``router.decision.ejections``); the other
routers read it with their shared view. A failure is reported before the request is retried (so
the retry's decision knows it); a success only when the view has the target failing or ejected (a
healthy path reports nothing: no round trip). An ejected pool is masked for new decisions (the
stage ``ejected``); an ejected server is skipped by the choice of server (``Upstreams.pick``),
and a pool whose servers are all ejected fails its attempt at once (``servers_ejected``) -- a
pool failure -- unless the attempt is the pool's probe.

Hand-written rather than a circuit-breaker library (``pybreaker``, ``aiobreaker``,
``circuitbreaker``): those keep a breaker per process (``aiobreaker-redis`` shares one through
Redis with several calls a transition), so one router's ejection would not mask the pool for the
others; here the state is the router's shared state -- embedded, or one Lua script an operation on
Redis, in the iteration's pipeline -- with the same arithmetic on both backends
(``router.state.base.ejection_step``).

**The retry budget** (:class:`RetryBudget`; Envoy's ``retry_budget``, Linkerd's ``retryRatio``):
over a sliding window of ``window_s``, retries -- attempts on another offering after a failed one
-- are at most ``ratio`` of the requests, or ``min_retries`` when that is more; when it is spent a
failed attempt's error is the answer at once. So during an outage the retries add at most that
share to the load rather than multiplying it by ``max_attempts``. Per process (as Envoy's): each
worker spends its own share of its own requests."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import Gauge

from router.core.logs import LOG
from router.core.metrics import LoopCounter
from router.core.text import one_line
from router.decision.ejections import POOL, SERVER, EjectionView
from router.gateway.exchange import Outcome
from router.state.base import EjectionRule, StateUnavailable, pool_key

#: an attempt's errors that count against its server and pool (besides any 5xx)
FAILURES = frozenset({"connect_error", "first_token_timeout", "response_timeout", "upstream_disconnected",
                      "upstream_error", "upstream_error_event", "servers_ejected"})


def failed(o: Outcome) -> bool | None:
    """An outcome as the ejection counts it: True a failure, False a success, None neither."""
    if o.error is None:
        return False
    if o.client_fault:
        return None
    return o.error in FAILURES or (o.status is not None and o.status >= 500)


def _reader(read: Callable[[str], Any], target: str) -> Callable[[], float]:
    """A gauge's reading of ``target`` in the view."""
    return lambda: float(read(target))


class RetryBudget:
    """Retries at most ``ratio`` of the requests over the last ``window_s`` (in ``buckets`` slices),
    or ``min_retries`` when that is more (module docstring)."""

    def __init__(self, ratio: float, min_retries: int, window_s: float, buckets: int = 10,
                 clock: Callable[[], float] = time.monotonic):
        self.ratio, self.min_retries, self.clock = ratio, min_retries, clock
        self.width = window_s / buckets
        self.n = buckets
        self._stamp = [-1] * buckets
        self._requests = [0] * buckets
        self._retries = [0] * buckets

    def _slot(self) -> tuple[int, int]:
        k = int(self.clock() // self.width)
        i = k % self.n
        if self._stamp[i] != k:
            self._stamp[i], self._requests[i], self._retries[i] = k, 0, 0
        return i, k

    def request(self) -> None:
        """A client request arrived."""
        self._requests[self._slot()[0]] += 1

    def allow(self) -> bool:
        """May a failed attempt be retried now? (True: the retry is counted.)"""
        i, k = self._slot()
        live = [j for j in range(self.n) if self._stamp[j] > k - self.n]
        requests = sum(self._requests[j] for j in live)
        retries = sum(self._retries[j] for j in live)
        if retries >= max(self.min_retries, self.ratio * requests):
            return False
        self._retries[i] += 1
        return True


class GatewayHealth:
    """The gateway's side of outlier ejection (module docstring): the targets it may probe, the
    reports, the metrics per server and pool."""

    def __init__(self, state: Any, view: EjectionView, cfg: Any, pools: dict[tuple[str, str], list[Any]],
                 registry: Any):
        ej, rb = cfg.ejection, cfg.retry_budget
        self.state, self.view, self.on = state, view, ej.enabled
        self.rule = EjectionRule(ej.consecutive_failures, ej.base_s, ej.max_s)
        self.budget = RetryBudget(rb.ratio, rb.min_retries, rb.window_s) if rb.enabled else None
        servers = sorted({e.base_url for eps in pools.values() for e in eps})
        self.pools = {POOL + pool_key(model, offering): (model, offering) for model, offering in pools}
        if self.on:  # (a probe is held as long as its answer may take to begin)
            view.probe_targets = [SERVER + url for url in servers] + sorted(self.pools)
            view.lease_s = cfg.connect_timeout_s + cfg.first_token_timeout_s + 1.0
        self._down = False
        self.ejections = LoopCounter("xroute_gateway_server_ejections_total", "Times a server was ejected (by this "
                                     "process's report)", ("base_url",), registry)
        self.pool_ejections = LoopCounter("xroute_gateway_pool_ejections_total", "Times a pool was ejected (by this "
                                          "process's report)", ("model", "offering_id"), registry)
        ejected = Gauge("xroute_gateway_server_ejected", "1 while a server is ejected or half-open (the shared "
                        "state, as this process's view has it)", ["base_url"], registry=registry)
        failures = Gauge("xroute_gateway_server_consecutive_failures", "A server's failures in a row (the shared "
                         "state, as this process's view has it)", ["base_url"], registry=registry)
        pool_ejected = Gauge("xroute_gateway_pool_ejected", "1 while a pool is ejected or half-open",
                             ["model", "offering_id"], registry=registry)
        for url in servers:
            ejected.labels(url).set_function(_reader(view.ejected, SERVER + url))
            failures.labels(url).set_function(_reader(view.failures, SERVER + url))
        for target, (model, offering) in self.pools.items():
            pool_ejected.labels(model, offering).set_function(_reader(view.ejected, target))

    def outcomes(self, pool: str, servers: Sequence[tuple[str, Outcome]], o: Outcome) -> list[tuple[str, bool]]:
        """What an attempt teaches: ``servers`` -- the servers it reached, in order, with what
        each answered (the last one's is the attempt's ``o``) -- and its pool; only what changes
        something (a failure, or a success on a target the view has failing or ejected)."""
        if not self.on:
            return []
        view = self.view
        items = []
        for url, out in servers:
            f = failed(out)
            if f is not None and (f or url in view.health):
                items.append((url, f))
        f = failed(o)
        if f is not None and (f or pool in view.health):
            items.append((pool, f))
        return items

    async def report(self, items: list[tuple[str, bool]]) -> None:
        """``items`` to the shared state, its answer into this process's view (and the metrics).
        A state that cannot be reached teaches nothing (logged once per outage)."""
        try:
            got = await self.state.report(items, self.rule)
        except StateUnavailable as err:
            if not self._down:
                LOG.warning("gateway outcomes not reported for ejection (shared state unavailable)",
                            extra={"fields": {"error": one_line(err)}})
            self._down = True
            return
        self._down = False
        self.view.merge(got)
        for e in got:
            if e.ejected_now:
                if e.target.startswith(SERVER):
                    self.ejections.inc(e.target[len(SERVER):])
                elif e.target in self.pools:
                    self.pool_ejections.inc(*self.pools[e.target])
                LOG.info("upstream ejected", extra={"fields": {"target": e.target, "for_s": e.left_s,
                                                               "ejections": e.ejections}})
