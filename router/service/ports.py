"""What the services consume of the shared state, declared here where it is consumed (as the
Gateway API Inference Extension's director declares the small datastore interface it uses): the
decision path's four operations, idempotency, recovery, the migrator's session placement, and the
backend's health. ``router.state`` implements them -- ``EmbeddedState`` (one synchronous core
behind one generic async adapter), ``RedisState`` (one Lua script an operation), ``FailOpenState``
-- and never imports this module: the protocols are structural, checked by mypy where a backend is
handed to a service (``router.app.factory``).

Contracts (the types are ``router.state.base``'s):

* :meth:`DecisionState.admit` -- a decision's ranked pools with their capacity and hold, an
  optional quota charge and an optional prefix record, all or nothing; **one round trip on Redis,
  one script**, whatever the options. A full pool's request is not counted against a quota; a quota
  that refuses leaves the pool untaken; the prefix is recorded only on the pool taken.
* :meth:`DecisionState.settle` -- a decision's outcome or undo: release, statistics, quota
  reconciliation (or undo), prefix retention; one round trip on Redis.
* :meth:`DecisionState.lookup` -- prefix and session affinity before ranking.
* :meth:`DecisionState.view` -- in-flight work, expiries, durations, quota usage (the decisions'
  shared view, the status pages).
* :meth:`DecisionState.fairness` -- the tenants' fairness counters as the admission queue reads them
  (lifting the just backlogged); the counters move inside ``admit`` and ``settle`` (their ``fair``).
* :class:`Idempotency` -- claim, complete, abandon (``StateRestoring`` while a lost state is being
  restored).
* :class:`Ejections` -- outlier ejection of the gateway's servers and pools: ``report`` folds
  attempts' outcomes into each target's consecutive failures (the ``after``-th ejects it for an
  interval doubled on each ejection in a row, up to a cap; ``router.state.base.ejection_step``, the
  same arithmetic on both backends: ``lua/lib/eject.lua``), ``ejections`` reads them all with the
  shared view's loop and hands a half-open target's one probe to one caller at a time. Neither is
  on the decision path: the decisions read the ejected pools from the view the loop keeps
  (``router.decision.ejections``).
* :class:`Recovery` -- a server's epoch, the announced restore and the restore of a decision log.

Every operation of a backend with a server may raise ``StateUnavailable`` (the API's 503).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from router.state.base import (
    Admission,
    Admitted,
    Affinity,
    Claim,
    Ejection,
    EjectionRule,
    Epoch,
    Released,
    Reserved,
    Settled,
    Settlement,
    StateView,
)
from router.state.ledger import QuotaReserved, QuotaSettled, QuotaUsage

#: a decision log's events, as a restore replays them
LogEvent = Reserved | Released | QuotaReserved | QuotaSettled


class DecisionState(Protocol):
    """The decision path's four operations (module docstring)."""

    @property
    def quota_reader(self) -> Callable[[Sequence[str]], dict[str, QuotaUsage]] | None:
        """The quota usage read without an await, exact, where the state lives in this process;
        None: the decisions read it with :meth:`view` (``router.decision.quotas.QuotaView``)."""
        ...

    async def admit(self, a: Admission) -> Admitted: ...

    async def settle(self, s: Settlement) -> Settled: ...

    async def lookup(self, hashes: np.ndarray, session: str | None, ttl_s: float) -> Affinity:
        """The pools expected to hold the leading blocks of ``hashes`` (int64, prompt order) now,
        their retention, and where ``session`` last went."""
        ...

    async def view(self, quota_keys: Sequence[str] = (), durations: bool = False) -> StateView:
        """In-flight work and expiries per pool; with ``durations`` the observed mean durations of
        the pools with work in flight; the usage of ``quota_keys``."""
        ...

    async def fairness(self, tenants: Sequence[str], lift: Sequence[str] = ()) -> dict[str, float]:
        """The fairness counters of the backlogged ``tenants``, after lifting those of ``lift`` (just
        backlogged) to the lowest of the others (``xroute.admission_rules.lift``): the admission
        queue's read, never on the decision path (``admit`` and ``settle`` move the counters)."""
        ...


class Idempotency(Protocol):
    """Idempotency keys (callers scope them: tenant, route, the client's ``Idempotency-Key``)."""

    async def claim(self, key: str, ttl_s: float) -> Claim:
        """Take ``key`` for ``ttl_s`` seconds, or learn who has it."""
        ...

    async def complete(self, key: str, answer: bytes, ttl_s: float) -> None:
        """Store the answer of the request that claimed ``key``; retries get it for ``ttl_s``."""
        ...

    async def abandon(self, key: str) -> None:
        """Drop a claim whose request failed (unless it was completed), so a retry decides anew."""
        ...


class Ejections(Protocol):
    """Outlier ejection (module docstring); the targets are opaque strings (the gateway's
    ``server:<base URL>`` and ``pool:<pool key>``)."""

    async def report(self, outcomes: Sequence[tuple[str, bool]], rule: EjectionRule) -> list[Ejection]:
        """Fold ``(target, failed)`` outcomes into their records, in order; each target's health
        after its outcome (``ejected_now``: this report ejected it). One round trip on Redis."""
        ...

    async def ejections(self, probe: Sequence[str] = (), lease_s: float = 0.0) -> list[Ejection]:
        """Every target ejected, half-open or with failures counted; the probe of each half-open
        target of ``probe`` that no one holds becomes the caller's for ``lease_s`` (``probe`` True)."""
        ...


class Recovery(Protocol):
    """A state and the decision logs kept consistent (``router.service.recovery``)."""

    async def epoch(self) -> Epoch | None:
        """The shared state's current epoch, begun by this call when the server has none; None for
        a state in this process (rebuilt from the decision log at start instead)."""
        ...

    async def begin_restore(self, epoch: Epoch, log_id: str) -> None:
        """Say, before reading the decision log ``log_id``, that this router is restoring it into
        ``epoch``: until :meth:`end_restore` (or a deadline), no router decides a keyed or quota'd
        request the state cannot answer whole (``StateRestoring``)."""
        ...

    async def end_restore(self, epoch: Epoch, log_id: str, restored: bool) -> None:
        """The announced restore is over; ``restored``: this router's part in ``epoch`` is done."""
        ...

    async def restore(self, epoch: Epoch | None, log_id: str, events: Iterable[LogEvent],
                      answers: Iterable[tuple[str, bytes, float]], now_wall: float | None = None
                      ) -> dict[str, int] | None:
        """Put back what one decision log knows: the reservations of ``events`` whose hold has not
        passed (released where the log has their feedback), the quota reservations (settled where
        it has their feedback), the idempotency ``answers`` (``(key, answer, until)``) -- into
        ``epoch`` once per epoch and log (None: another router did), or, in this process (no epoch),
        at start. Nothing already held is booked twice."""
        ...


class Sessions(Protocol):
    """The migrator's: a committed migration's target as the session's entry."""

    async def put_session(self, session_id: str, value: bytes, ttl_s: float) -> None: ...


class Health(Protocol):
    """What ``/readyz`` and ``/v1/admin/status`` read of the backend."""

    @property
    def backend(self) -> str: ...

    @property
    def error(self) -> str | None:
        """The server's failure as last seen (None: it answered; always None in this process)."""
        ...

    async def healthy(self) -> bool: ...

    def describe(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class SharedState(DecisionState, Idempotency, Ejections, Recovery, Sessions, Health, Protocol):
    """Everything the services use of the state (``Services.state``)."""
