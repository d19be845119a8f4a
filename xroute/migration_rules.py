"""The migration rules the router and the simulator share (``docs/migration.md``, ``docs/env.md``).

One module, imported by ``router.service.migration`` (a live notice) and ``envs.cloud_route`` (a simulated
one), so the two apply the same rules rather than two copies of them:

* the **de-prioritized region**: after an interruption notice the interrupted pool's region loses
  ``penalty`` (reward units, as a prefer policy's weight) from every score for ``deprioritize_s``
  (:func:`deprioritize_until`, :func:`region_bias`) -- a known failure is recovering straight into
  the region that was just preempted (SkyPilot issue #10021);
* the **notice window**: a migration fits when it is done by the pool's deadline
  (:func:`fits_window`); past the deadline (plus a grace) it is out of time (:func:`past_window`);
* **transfer or recompute** (:func:`choose_kv_move`): a running request's KV cache (its prompt and
  the tokens it generated) is either moved to the target -- ``transfer_s = rtt + bytes / throughput``
  -- or recomputed there by a prefill -- ``recompute_s = tokens / prefill_tok_s``. The rule: the
  faster of the two among those that fit the window (a transfer must leave the source before its
  deadline; a recompute needs only the generated tokens handed over, within the migration delay);
  if neither fits, the work is lost and re-executed from scratch (a missed window).

Pure functions and constants: no I/O, no clock, no provider names (the notice each cloud gives is
``cloud_adapters.events``'s; a bundle carries it per offering as ``offerings.notice_s``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

#: how long an interrupted pool's region is de-prioritized after the notice (s); the router's
#: ``migration_deprioritize_s`` and the environment's ``migration.deprioritize_s`` default to it
DEPRIORITIZE_S = 600.0
#: what a de-prioritized region's offerings lose from their scores (reward units); the router's
#: ``migration_region_penalty`` and the environment's ``migration.region_penalty`` default to it
REGION_PENALTY = 1.0
#: the time from a notice to a session's target being ready (choose it, announce and verify the
#: snapshot), s: ``benchmarks/bench_migration.py`` committed 100 sessions 0.76 s after the event
#: (``docs/migration.md``), rounded up to 1 s for one session
MIGRATION_DELAY_S = 1.0
#: the notice of a spot offering whose bundle row gives none (s): the shortest the clouds give
#: (Azure Scheduled Events ``Preempt`` and GCP preemption: about 30 s; AWS: 2 minutes)
DEFAULT_NOTICE_S = 30.0
#: the throughput between two locations the bundle's ``throughput`` table does not name (Gbit/s):
#: a conservative 1 Gbit/s, below every median of Skyplane's iperf3 measurements between clouds
DEFAULT_THROUGHPUT_GBPS = 1.0

TRANSFER, RECOMPUTE, LOST = "transfer", "recompute", "lost"


def deprioritize_until(notice_at: float, deprioritize_s: float) -> float:
    """Until when a notice at ``notice_at`` de-prioritizes the interrupted pool's region."""
    return notice_at + deprioritize_s


def region_bias(locations: Sequence[str], deprioritized: Iterable[tuple[str, float]], now: float,
                penalty: float) -> np.ndarray:
    """The score bias of each offering (by its location id, ``provider:region``) at ``now``:
    ``-penalty`` where its location is a region de-prioritized until after ``now`` (pairs of
    region and until when), else 0. Not cumulative: two notices in one region cost ``penalty``."""
    bias = np.zeros(len(locations))
    if penalty <= 0:
        return bias
    active = {r for r, until in deprioritized if r and until > now}
    if active:
        for k, loc in enumerate(locations):
            if loc in active:
                bias[k] = -penalty
    return bias


def past_window(now: float, deadline: float, grace_s: float = 0.0) -> bool:
    """Whether ``now`` is past a notice's ``deadline`` (plus ``grace_s``): the migration is out of time."""
    return now > deadline + grace_s


def fits_window(notice_at: float, deadline: float, delay_s: float, move_s: float = 0.0) -> bool:
    """Whether a migration that starts at the notice (``notice_at``), takes ``delay_s`` to reach its
    target and ``move_s`` more to move state off the source is done by the ``deadline``."""
    return not past_window(notice_at + delay_s + move_s, deadline)


def transfer_s(kv_bytes: float, gbps: float, rtt_ms: float) -> float:
    """Seconds to move ``kv_bytes`` of KV cache at ``gbps`` Gbit/s between two locations ``rtt_ms`` apart."""
    return rtt_ms / 1000.0 + 8.0 * kv_bytes / (max(gbps, 1e-9) * 1e9)


def recompute_s(tokens: float, prefill_tok_s: float) -> float:
    """Seconds for the target to rebuild the KV cache of ``tokens`` by a prefill at ``prefill_tok_s``."""
    return tokens / max(prefill_tok_s, 1e-9)


@dataclass(frozen=True)
class KvMove:
    """How a running request's KV cache reaches its target: ``mode`` (``transfer``, ``recompute``
    or ``lost``), the seconds it takes after the migration delay (the transfer's; a recompute's
    prefill runs on the target), and the bytes moved (0 unless transferred)."""

    mode: str
    seconds: float
    kv_bytes: float

    @property
    def missed(self) -> bool:
        return self.mode == LOST


def choose_kv_move(notice_at: float, deadline: float, delay_s: float, kv_bytes: float, gbps: float, rtt_ms: float,
                   tokens: float, prefill_tok_s: float) -> KvMove:
    """Transfer or recompute the KV cache of ``tokens`` tokens (``kv_bytes``), the migration
    starting at ``notice_at`` with the pool gone at ``deadline``: the faster one of those that fit
    the window (:func:`fits_window`; a tie goes to recompute, which moves nothing); ``lost`` when
    neither fits (the migration delay alone overruns the window)."""
    tr = transfer_s(kv_bytes, gbps, rtt_ms)
    rc = recompute_s(tokens, prefill_tok_s)
    if kv_bytes > 0 and tr < rc and fits_window(notice_at, deadline, delay_s, tr):
        return KvMove(TRANSFER, tr, float(kv_bytes))
    if fits_window(notice_at, deadline, delay_s):
        return KvMove(RECOMPUTE, rc, 0.0)
    return KvMove(LOST, 0.0, 0.0)
