"""The ejected pools and servers as this process sees them (:class:`EjectionView`): what the
decisions mask (``router.decision.stages.Ejected``, reason ``upstream_ejected``), what the
gateway's server choice skips, what ``/v1/offerings`` and ``/metrics`` show.

The ejections live in the shared state (``router.service.ports.Ejections``): a gateway reports its
attempts' outcomes there and applies the answer here at once; every router reads them all with the
shared view's loop (``router.service.recovery.refresh_shared_view``, every
``state_view_refresh_s``) -- so the decision path reads a view in memory and makes no round trip,
and another router's ejection is seen here at most one refresh (plus a round trip) after it
happened.

Targets are ``pool:<pool key>`` (a (model, offering) pair, ``router.state.base.pool_key``) and
``server:<base URL>``. A target whose interval is over is half-open: it stays masked except for the
one probe the state hands to one router at a time (``Ejection.probe``). Here, a pool's probe is a
token: the pool is unmasked for the next decision that may use it, which holds the token (offered,
masked for the others) until the gateway says where that decision went (:meth:`placed`): the probe
spent when it went to the pool, offered again when it did not -- or after ``OFFER_S`` when nobody
says (a ``/v1/route`` decision: its outcome is the client's, so the probe's lease in the state
lapses and is claimed again). A server's probe is taken by the gateway's choice of server
(:meth:`take`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np

from router.state.base import Ejection

POOL = "pool:"
SERVER = "server:"


class EjectionView:
    """This process's view of the ejections (module docstring). ``pool_index``: pool key ->
    (model index, offering index); ``shape``: (models, offerings)."""

    #: how long a pool's probe offered to a decision waits for :meth:`placed` (seconds)
    OFFER_S = 1.0

    def __init__(self, pool_index: dict[str, tuple[int, int]], shape: tuple[int, int],
                 clock: Callable[[], float] = time.monotonic):
        self.pool_index, self.shape, self.clock = pool_index, shape, clock
        #: every target ejected, half-open or with failures, as last read or reported
        self.health: dict[str, Ejection] = {}
        #: when each ejected target's interval ends (this process's monotonic clock)
        self.ends: dict[str, float] = {}
        #: the probes this process holds: target -> (the decision it is offered to, until when) or None (ready)
        self.tokens: dict[str, tuple[str, float] | None] = {}
        #: the pools new decisions may use, (models, offerings); None: every one
        self.keep: np.ndarray | None = None
        #: per model index, the offering indices and targets of the pools with a ready probe
        self.ready: dict[int, list[tuple[int, str]]] = {}
        #: the soonest an offered probe lapses (inf: none offered)
        self.offer_due = float("inf")
        #: what this process may probe (the gateway's servers and pools) and for how long it holds a probe
        self.probe_targets: list[str] = []
        self.lease_s = 0.0
        #: the reports' answers merged since the shared view's read began (:meth:`reading`)
        self._since: list[Ejection] | None = None

    # ------------------------------------------------------------------ what the state said
    def reading(self) -> None:
        """The shared view's read begins: the reports answered until it is applied are kept, and
        folded in again after it (the read may have been made before them: a pool this process
        ejected meanwhile must not come back with an older read)."""
        self._since = []

    def apply(self, items: Iterable[Ejection]) -> None:
        """The shared view's read: every target's health (those it does not name are healthy)."""
        since, self._since = self._since or [], None
        self.health = {}
        self.ends = {}
        self._fold([*items, *since])

    def merge(self, items: Iterable[Ejection]) -> None:
        """A report's answer: the health of the targets it named."""
        items = list(items)
        if self._since is not None:
            self._since.extend(e for e in items if not e.probe)
        self._fold(items)

    def _fold(self, items: Iterable[Ejection]) -> None:
        health, tokens, ends = self.health, self.tokens, self.ends
        now = self.clock()
        for e in items:
            if e.left_s is None and not e.failures:
                health.pop(e.target, None)
            else:
                health[e.target] = e
            if e.left_s is None:
                ends.pop(e.target, None)
            else:
                ends[e.target] = now + e.left_s
            if e.probe:
                tokens[e.target] = None
        for target in list(tokens):
            h = health.get(target)
            if h is None or h.left_s is None or h.left_s > 0:  # back, or ejected again: the probe is over
                del tokens[target]
        self._rebuild()

    def _rebuild(self) -> None:
        keep: np.ndarray | None = None
        ready: dict[int, list[tuple[int, str]]] = {}
        due = float("inf")
        for target, e in self.health.items():
            if e.left_s is None or not target.startswith(POOL):
                continue
            ma = self.pool_index.get(target[len(POOL):])
            if ma is None:
                continue
            if target in self.tokens:
                token = self.tokens[target]
                if token is None:
                    ready.setdefault(ma[0], []).append((ma[1], target))
                    continue
                due = min(due, token[1])
            if keep is None:
                keep = np.ones(self.shape, dtype=bool)
            keep[ma] = False
        self.keep, self.ready, self.offer_due = keep, ready, due

    # ------------------------------------------------------------------ what the decisions and the gateway read
    def ejected(self, target: str) -> bool:
        """Ejected or half-open (its probe aside)."""
        e = self.health.get(target)
        return e is not None and e.left_s is not None

    def left(self, target: str) -> float | None:
        """Seconds until an ejected target is half-open (0: it is); None: not ejected."""
        end = self.ends.get(target)
        return None if end is None else max(0.0, end - self.clock())

    def failures(self, target: str) -> int:
        e = self.health.get(target)
        return 0 if e is None else e.failures

    def offer(self, m: int, allowed: np.ndarray, decision_id: str | None) -> np.ndarray | None:
        """The pools of model ``m`` a route decision may use (None: every one), its ready probes
        among ``allowed`` offered to it (masked for the others until :meth:`placed`)."""
        if self.offer_due <= self.clock():
            self._lapse()
        keep = self.keep
        row = None if keep is None else keep[m]
        got = self.ready.get(m)
        if got and decision_id is not None:
            until = self.clock() + self.OFFER_S
            offered = False
            for a, target in got:
                if allowed[a]:
                    self.tokens[target] = (decision_id, until)
                    offered = True
            if offered:
                self._rebuild()  # (a new array: ``row`` is the one before)
        return row

    def _lapse(self) -> None:
        now = self.clock()
        for target, token in list(self.tokens.items()):
            if token is not None and token[1] <= now:
                self.tokens[target] = None
        self._rebuild()

    def placed(self, decision_id: str, target: str) -> bool:
        """Where a decision offered a probe went (``target``, its pool): that probe is spent, the
        others offered to it ready again. True when it is the pool's probe."""
        probe = False
        changed = False
        for t, token in list(self.tokens.items()):
            if token is not None and token[0] == decision_id:
                changed = True
                if t == target:
                    del self.tokens[t]
                    probe = True
                else:
                    self.tokens[t] = None
        if changed:
            self._rebuild()
        return probe

    def take(self, target: str) -> bool:
        """A server's probe, if this process holds it ready: spent now (True)."""
        if target in self.tokens and self.tokens[target] is None:
            del self.tokens[target]
            return True
        return False

    def retry_after_s(self, m: int) -> float:
        """The soonest an ejected pool of model ``m`` is half-open (seconds, at least 1)."""
        left = [self.left(t) or 0.0 for t in self.ends
                if t.startswith(POOL) and self.pool_index.get(t[len(POOL):], (-1, -1))[0] == m]
        return max(1.0, min(left, default=1.0))
