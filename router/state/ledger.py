"""Tenant quota counters in this process: :class:`QuotaLedger` -- the embedded state's quotas, and
the arithmetic the Redis scripts (``router.state.redis``) repeat server-side, step for step.

The limits are ``xroute.schema.quota``'s. Per bucket (a tenant, or a (tenant, model) pair):

* ``concurrent``: the reservations held, each until it is settled (feedback), released, or its hold
  passes;
* the sliding window: every admitted request's tokens at its admission time; a request leaves the
  window 60 s after it was admitted (window = ``(now - 60 s, now]``); the sum is kept;
* per day: requests admitted and USD (reserved expected cost, replaced by the reported cost on
  feedback), in the day of the admission.

Every bucket counts every request in it, whichever of its limits are set (usage is usage; a limit
added later applies to what is already counted). A reservation (by id: the decision's) records
what it counted where, so a settle or a release undoes exactly that, once. Its record is kept
until it is released, or ``record_ttl_s`` (:data:`RECORD_S`) after its hold has passed: a feedback
later than that leaves the counts as reserved (memory stays O(requests of the last hold + minute),
whether or not clients report). A settled record stays until then too, marked settled, so a
restore from the decision log (:meth:`QuotaLedger.restore`, ``QUOTA_RESTORE`` on Redis) never books
a reservation the counters already hold -- settled or not -- a second time.

Time is wall-clock seconds (``clock``); the day is the UTC day (``xroute.schema.quota.DAY_S``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from xroute.schema.quota import DAY_S, LIMITS, WINDOW_S, QuotaBucket, day_index

#: how long after its hold a reservation's record waits for its feedback (seconds)
RECORD_S = 60.0


@dataclass(frozen=True, slots=True)
class QuotaVerdict:
    """:meth:`QuotaLedger.reserve`'s answer: admitted (``ok``), or the first limit hit -- which
    bucket of the request's (its index), the limit's name and value, what the bucket holds, what
    the request asked, and when it could fit (seconds)."""

    ok: bool
    bucket: int = -1
    name: str = ""
    limit: float = 0.0
    used: float = 0.0
    requested: float = 0.0
    retry_after_s: float = 0.0


#: an admitted request's verdict
ADMITTED = QuotaVerdict(True)


@dataclass(frozen=True, slots=True)
class QuotaUsage:
    """What one bucket holds now: requests in flight, tokens in the sliding window, requests and
    USD of the current day."""

    concurrent: int = 0
    tokens_window: int = 0
    requests_day: int = 0
    usd_day: float = 0.0


@dataclass(frozen=True, slots=True)
class QuotaReserved:
    """A decision log event: ``reservation_id`` counted ``tokens`` and ``usd`` in the buckets
    ``keys`` at wall time ``at``, holding a concurrency slot until ``until`` (wall clock)."""

    reservation_id: str
    keys: tuple[str, ...]
    tokens: int
    usd: float
    at: float
    until: float


@dataclass(frozen=True, slots=True)
class QuotaSettled:
    """A decision log event: ``reservation_id``'s feedback -- it finally counts ``tokens`` and ``usd``."""

    reservation_id: str
    tokens: int
    usd: float


@dataclass(slots=True)
class _Bucket:
    held: dict[str, float] = field(default_factory=dict)  # reservation id -> until (concurrency)
    due: list[tuple[float, str]] = field(default_factory=list)
    window: deque[tuple[float, str]] = field(default_factory=deque)  # (admitted at, id), oldest first
    #: id -> (admitted at, tokens) while in the window; a released id is dropped here only (its window
    #: entry, no longer matching, is skipped when it leaves)
    tokens: dict[str, tuple[float, int]] = field(default_factory=dict)
    tokens_sum: int = 0
    days: dict[int, list[float]] = field(default_factory=dict)  # day -> [requests, usd]

    def evict(self, now: float, window_s: float) -> None:
        due, held = self.due, self.held
        while due and due[0][0] <= now:
            until, rid = heapq.heappop(due)
            if held.get(rid) == until:
                del held[rid]
        if len(due) > 2 * len(held) + 1024:
            self.due = [(u, r) for u, r in due if held.get(r) == u]
            heapq.heapify(self.due)
        win, cut, tokens = self.window, now - window_s, self.tokens
        while win and win[0][0] <= cut:
            t, rid = win.popleft()
            got = tokens.get(rid)
            if got is not None and got[0] == t:
                del tokens[rid]
                self.tokens_sum -= got[1]

    def day(self, d: int) -> list[float]:
        got = self.days.get(d)
        if got is None:
            got = self.days[d] = [0.0, 0.0]
            for old in [k for k in self.days if k < d - 1]:
                del self.days[old]
        return got

    def retry_tokens(self, need: int, limit: float, now: float, window_s: float) -> float:
        """Seconds until the window holds at most ``limit - need`` tokens (inf: never -- the
        request alone is over the limit)."""
        if need > limit:
            return math.inf
        excess = self.tokens_sum + need - limit
        for t, rid in self.window:
            got = self.tokens.get(rid)
            if got is None or got[0] != t:
                continue
            excess -= got[1]
            if excess <= 0:
                return t + window_s - now
        return 0.0


@dataclass(slots=True)
class _Reservation:
    keys: tuple[str, ...]
    tokens: int
    usd: float
    day: int
    expires: float
    settled: bool = False


class QuotaLedger:
    """The quota counters of one process (module docstring). Not thread-safe: the event loop's."""

    def __init__(self, clock: Callable[[], float] = time.time, record_ttl_s: float = RECORD_S,
                 window_s: float = WINDOW_S):
        self.clock = clock
        self.record_ttl_s = record_ttl_s
        #: the ``tokens_per_minute`` window (60 s; tests shorten it to watch it slide)
        self.window_s = window_s
        self._buckets: dict[str, _Bucket] = {}
        self._res: dict[str, _Reservation] = {}
        self._res_due: list[tuple[float, str]] = []

    def _bucket(self, key: str) -> _Bucket:
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
        return b

    def _expire_records(self, now: float) -> None:
        due, res = self._res_due, self._res
        while due and due[0][0] <= now:
            exp, rid = heapq.heappop(due)
            r = res.get(rid)
            if r is not None and r.expires == exp:
                del res[rid]

    def reserve(self, reservation_id: str, buckets: Sequence[QuotaBucket], tokens: int, usd: float, hold_s: float,
                now: float | None = None) -> QuotaVerdict:
        """Check ``tokens`` and ``usd`` (and one request, one concurrency slot until ``hold_s``
        from now) against every limit of ``buckets``; when all have room, count them in each.
        An id that holds a reservation already is admitted again and books nothing (a retry)."""
        now = self.clock() if now is None else now
        self._expire_records(now)
        if reservation_id in self._res:
            return ADMITTED
        d = day_index(now)
        window_s = self.window_s
        found = []
        for i, qb in enumerate(buckets):
            b = self._buckets.get(qb.key)
            if b is None:
                b = self._buckets[qb.key] = _Bucket()
            b.evict(now, window_s)
            found.append(b)
            cc, tpm, rpd, usd_limit = qb.limits
            if cc >= 0 and len(b.held) + 1 > cc:
                return QuotaVerdict(False, i, LIMITS[0], cc, float(len(b.held)), 1.0, 1.0)
            if tpm >= 0 and b.tokens_sum + tokens > tpm:
                return QuotaVerdict(False, i, LIMITS[1], tpm, float(b.tokens_sum), float(tokens),
                                    b.retry_tokens(tokens, tpm, now, window_s))
            n, spent = b.days.get(d, (0.0, 0.0))
            if rpd >= 0 and n + 1 > rpd:
                return QuotaVerdict(False, i, LIMITS[2], rpd, n, 1.0, (d + 1) * DAY_S - now)
            if usd_limit >= 0 and spent + usd > usd_limit:
                return QuotaVerdict(False, i, LIMITS[3], usd_limit, spent, usd, (d + 1) * DAY_S - now)
        # booked now: the slot held until the hold, the tokens in the window, the request and USD in the day
        until, tokens = now + hold_s, int(tokens)
        for b in found:
            b.held[reservation_id] = until
            heapq.heappush(b.due, (until, reservation_id))
            b.window.append((now, reservation_id))
            if len(b.window) > 1 and b.window[-2][0] > now:  # (the wall clock stepped back: keep it sorted)
                b.window = deque(sorted(b.window))
            b.tokens[reservation_id] = (now, tokens)
            b.tokens_sum += tokens
            day = b.day(d)
            day[0] += 1
            day[1] += usd
        expires = until + self.record_ttl_s
        self._res[reservation_id] = _Reservation(tuple(qb.key for qb in buckets), tokens, float(usd), d, expires)
        heapq.heappush(self._res_due, (expires, reservation_id))
        return ADMITTED

    def _book(self, rid: str, keys: Sequence[str], tokens: int, usd: float, at: float, d: int, until: float,
              expires: float, now: float | None = None) -> None:
        now = at if now is None else now
        for key in keys:
            b = self._bucket(key)
            if until > now:
                b.held[rid] = until
                heapq.heappush(b.due, (until, rid))
            if at > now - self.window_s:
                b.window.append((at, rid))
                if len(b.window) > 1 and b.window[-2][0] > at:  # (a rebuild books in log order; keep it sorted)
                    b.window = deque(sorted(b.window))
                b.tokens[rid] = (at, int(tokens))
                b.tokens_sum += int(tokens)
            day = b.day(d)
            day[0] += 1
            day[1] += usd
        self._res[rid] = _Reservation(tuple(keys), int(tokens), float(usd), d, expires)
        heapq.heappush(self._res_due, (expires, rid))

    def settle(self, reservation_id: str, tokens: int | None, usd: float | None) -> bool:
        """A reservation's feedback: its concurrency slot is freed, its tokens (while still in the
        window) and its day's USD become ``tokens`` and ``usd`` (None: as reserved). False when it
        is not held (never reserved, settled or released already, or its record expired)."""
        self._expire_records(self.clock())
        r = self._res.get(reservation_id)
        if r is None or r.settled:
            return False
        r.settled = True  # (kept until its record expires: module docstring)
        for key in r.keys:
            b = self._bucket(key)
            b.held.pop(reservation_id, None)
            got = b.tokens.get(reservation_id)
            if tokens is not None and got is not None:
                b.tokens_sum += int(tokens) - got[1]
                b.tokens[reservation_id] = (got[0], int(tokens))
            if usd is not None and r.day in b.days:
                b.days[r.day][1] += float(usd) - r.usd
        return True

    def release(self, reservation_id: str) -> bool:
        """Undo a reservation entirely (its request was not admitted after all: no pool had room,
        the decision could not be recorded). False when it is not held (or settled already)."""
        r = self._res.get(reservation_id)
        if r is None or r.settled:
            return False
        del self._res[reservation_id]
        for key in r.keys:
            b = self._bucket(key)
            b.held.pop(reservation_id, None)
            got = b.tokens.pop(reservation_id, None)
            if got is not None:  # (its window entry is skipped when it leaves: _Bucket.evict)
                b.tokens_sum -= got[1]
            day = b.days.get(r.day)
            if day is not None:
                day[0] -= 1
                day[1] -= r.usd
        return True

    def usage(self, keys: Iterable[str], now: float | None = None) -> dict[str, QuotaUsage]:
        now = self.clock() if now is None else now
        d = day_index(now)
        out = {}
        for key in keys:
            b = self._buckets.get(key)
            if b is None:
                out[key] = QuotaUsage()
                continue
            b.evict(now, self.window_s)
            n, usd = b.days.get(d, (0.0, 0.0))
            out[key] = QuotaUsage(len(b.held), int(b.tokens_sum), int(n), float(usd))
        return out

    def restore(self, events: Iterable[QuotaReserved | QuotaSettled], now_wall: float | None = None) -> dict[str, int]:
        """Book the decision log's quota events (oldest first; limits are not checked: they were
        admitted): each reservation in the day and window of its time, holding its concurrency
        slot until its ``until`` unless settled; ids the ledger holds already (settled or not) are skipped."""
        now = self.clock() if now_wall is None else now_wall
        out = {"quota_reserved": 0, "quota_settled": 0}
        for ev in events:
            if isinstance(ev, QuotaReserved):
                if ev.reservation_id in self._res or not ev.keys:
                    continue
                self._book(ev.reservation_id, ev.keys, ev.tokens, ev.usd, ev.at, day_index(ev.at), ev.until,
                           max(ev.until, now) + self.record_ttl_s, now)
                out["quota_reserved"] += 1
            elif self.settle(ev.reservation_id, ev.tokens, ev.usd):
                out["quota_settled"] += 1
        return out
