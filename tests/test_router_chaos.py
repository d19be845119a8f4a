"""Chaos under load (issue 21, "Done means"): ``xroute serve --workers 2`` on a real PostgreSQL log
and a real Redis state, four clients sending keyed routes (~100/s in all) each followed by keyed
feedback, retrying what the router asks to be retried (409, 503 with ``Retry-After``, the same key)
-- while Redis is SIGKILLed and started again empty, and then PostgreSQL is stopped (``-m
immediate``) and started again. A fifth thread polls ``/readyz`` every 0.1 s.

Afterwards: every acknowledged decision (200) and feedback (201) is in the log; no
``Idempotency-Key`` has two decisions (in the log, and in what the clients were answered); nothing
was answered but the documented statuses, every 503 with ``Retry-After``; ``/readyz`` was 503 from
within 2 s of each outage's start to within 2 s of its end and 200 otherwise; every line the router
wrote is JSON. It prints what a client saw of each outage (the figures in ``docs/router.md``,
"What a client sees during an outage")."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psycopg
import pytest
import redis

from tests.servers import PostgresServer, RedisServer
from tests.test_router_drill import serve
from tests.test_router_support import ROUTE

pytestmark = pytest.mark.slow

CLIENTS = 4
PACE_S = 0.04  # each client's pause between requests: ~100 routes/s from four clients
WARM_S, OUTAGE_S, SETTLE_S = 3.0, 4.0, 5.0
ROUTE_STATUSES = {200, 409, 429, 503}
FEEDBACK_STATUSES = {201, 409, 503}
ERRORS_503 = {"unavailable", "state_unavailable", "state_restoring"}


@dataclass
class Seen:
    """What the clients sent and were answered."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    #: (monotonic time, "route" | "feedback", status, error code or None, retry-after or None)
    answers: list[tuple[float, str, int, str | None, str | None]] = field(default_factory=list)
    route_ms: list[float] = field(default_factory=list)  # the decided routes' answer times
    decided: dict[str, set[bytes]] = field(default_factory=lambda: defaultdict(set))  # key -> 200 bodies
    decisions: set[str] = field(default_factory=set)  # acknowledged decision ids
    feedback: dict[int, str] = field(default_factory=dict)  # acknowledged feedback id -> decision id
    bad: list[str] = field(default_factory=list)

    def note(self, kind: str, r: httpx.Response) -> None:
        error = None
        if r.status_code >= 400:
            try:
                error = r.json()["error"]
            except (ValueError, KeyError):
                error = "(not the JSON error shape)"
        with self.lock:
            self.answers.append((time.monotonic(), kind, r.status_code, error, r.headers.get("retry-after")))
            if kind == "route" and r.status_code == 200:
                self.route_ms.append(r.elapsed.total_seconds() * 1000)


def _client(k: int, url: str, auth: dict[str, str], origins: list[str], stop: threading.Event, seen: Seen) -> None:
    with httpx.Client(base_url=url, timeout=15, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        for n in itertools.count():
            if stop.is_set():
                return
            began = time.monotonic()  # (a request begun is carried through: retried for up to 20 s)
            key = f"chaos-{k}-{n}"
            body = {**ROUTE, "origin": origins[n % len(origins)], "session_id": key}
            decision = None
            while decision is None and time.monotonic() < began + 20:
                try:
                    r = c.post("/v1/route", json=body, headers={**auth, "Idempotency-Key": key})
                except httpx.HTTPError as e:
                    with seen.lock:
                        seen.bad.append(f"route {key}: {type(e).__name__}: {e}")
                    time.sleep(0.2)
                    continue
                seen.note("route", r)
                if r.status_code == 200:
                    decision = r.json()["decision_id"]
                    with seen.lock:
                        seen.decided[key].add(r.content)
                        seen.decisions.add(decision)
                elif r.status_code == 429:
                    break  # (not decided; the pools are full: a new request later)
                else:  # 409, 503: the same key again, as asked (sooner than Retry-After: the drill's point)
                    time.sleep(0.05)
            if decision is not None:
                fkey = f"fb-{key}"
                while time.monotonic() < began + 20:
                    try:
                        r = c.post("/v1/feedback", json={"decision_id": decision, "latency_ms": 80.0, "ttft_ms": 20.0,
                                                         "output_tokens": 40}, headers={**auth, "Idempotency-Key": fkey})
                    except httpx.HTTPError as e:
                        with seen.lock:
                            seen.bad.append(f"feedback {fkey}: {type(e).__name__}: {e}")
                        time.sleep(0.2)
                        continue
                    seen.note("feedback", r)
                    if r.status_code == 201:
                        with seen.lock:
                            seen.feedback[r.json()["feedback_id"]] = decision
                        break
                    time.sleep(0.05)
            time.sleep(PACE_S)


def _when_up(connect: Any, out: list[float]) -> None:
    """When ``connect()`` first succeeds (tried every 20 ms, for up to a minute): a server is back
    when it accepts connections, a little before the command that started it notices."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            connect()
        except (psycopg.Error, redis.RedisError, OSError):
            time.sleep(0.02)
            continue
        out.append(time.monotonic())
        return


def _restart(start: Any, connect: Any) -> float:
    """``start()`` a server; returns when it first accepted a connection."""
    up: list[float] = []
    watcher = threading.Thread(target=_when_up, args=(connect, up))
    watcher.start()
    start()
    watcher.join(timeout=60)
    return up[0] if up else time.monotonic()


def _poll_readiness(url: str, stop: threading.Event, out: list[tuple[float, int]]) -> None:
    while not stop.is_set():
        try:
            out.append((time.monotonic(), httpx.get(f"{url}/readyz", timeout=5).status_code))
        except httpx.HTTPError:
            out.append((time.monotonic(), 0))
        time.sleep(0.1)


def _readiness_follows(samples: list[tuple[float, int]], outages: list[tuple[str, float, float]]
                       ) -> list[tuple[str, float, float]]:
    """Check ``/readyz`` was 503 exactly while a backend was down, give or take 2 s: it turned 503
    within 2 s of each outage's start, stayed 503 until it turned 200 within 2 s of the outage's end
    (either side: the end is when a client first got a connection, measured from outside), never
    flapped, and was 200 outside the outages. Returns (outage, seconds to 503, seconds from the end
    to 200 -- negative: before the end as measured)."""
    flips = []
    for name, start, stop in outages:
        during = [(t, s) for t, s in samples if start <= t < stop + 2.0]
        shown = f"{name} (down {stop - start:.2f} s): {[(round(t - start, 2), s) for t, s in during]}"
        first_down = next((t for t, s in during if s == 503), None)
        assert first_down is not None and first_down - start <= 2.0, shown
        back = next((t for t, s in during if t > first_down and s == 200), None)
        assert back is not None and abs(back - stop) <= 2.0, shown
        assert {s for t, s in during if t >= back} == {200}, shown  # no flapping once back
        flips.append((name, first_down - start, back - stop))
    for t, s in samples:  # outside every outage (and its 2 s on each side): ready
        if not any(start - 2.0 <= t <= stop + 2.0 for _, start, stop in outages):
            assert s == 200, (t, s, outages)
    return flips


def _seen_of(seen: Seen, start: float, stop: float, next_start: float) -> dict[str, Any]:
    """What the clients saw of one outage: the first failed answer after it began, the last before
    every answer was good again, and their errors."""
    after = [a for a in seen.answers if start <= a[0] < next_start]
    failed = [a for a in after if a[2] not in (200, 201, 429)]
    if not failed:
        return {"failed": 0}
    last = max(a[0] for a in failed)
    return {"failed": len(failed), "first_s": round(min(a[0] for a in failed) - start, 2),
            "visible_s": round(last - min(a[0] for a in failed), 2), "last_after_end_s": round(last - stop, 2),
            "errors": dict(Counter(f"{a[2]} {a[3]}" for a in failed))}


def test_keyed_load_through_a_redis_loss_and_a_postgres_restart(tmp_path: Path) -> None:
    pg = PostgresServer().start()
    redis_srv = RedisServer().start()
    served = None
    try:
        db_url = pg.create_database("chaos")
        served = serve(tmp_path, db_url, redis_srv.url, "chaos")
        setup = served.setup
        auth = setup.auth("a")
        origins = httpx.get(f"{served.url}/v1/offerings", headers=auth, timeout=10).json()["origins"]
        seen = Seen()
        ready: list[tuple[float, int]] = []
        t0 = time.monotonic()
        stop = threading.Event()
        threads = [threading.Thread(target=_client, args=(k, served.url, auth, origins, stop, seen))
                   for k in range(CLIENTS)]
        threads.append(threading.Thread(target=_poll_readiness, args=(served.url, stop, ready)))
        for t in threads:
            t.start()
        time.sleep(WARM_S)
        redis_down = time.monotonic()
        redis_srv.kill()
        time.sleep(OUTAGE_S)
        redis_up = _restart(redis_srv.start, lambda: redis.Redis.from_url(redis_srv.url, socket_timeout=1).ping())
        # (empty: nothing persisted)
        time.sleep(SETTLE_S)
        pg_down = time.monotonic()
        pg.stop("immediate")
        time.sleep(OUTAGE_S)
        pg_up = _restart(pg.start, lambda: psycopg.connect(db_url, connect_timeout=2).close())  # (crash recovery first)
        time.sleep(SETTLE_S)
        stop.set()
        end = time.monotonic()
        timeline = end - t0
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)

        statuses = Counter((kind, status) for _, kind, status, _, _ in seen.answers)
        report = {"answers": {f"{k} {s}": n for (k, s), n in sorted(statuses.items())},
                  "decisions": len(seen.decisions), "feedback": len(seen.feedback),
                  "decisions_per_s": round(len(seen.decisions) / timeline, 1),
                  "route_ms_p50_p99": [round(float(np.percentile(seen.route_ms, q)), 1) for q in (50, 99)],
                  "redis": {"down_s": round(redis_up - redis_down, 2), **_seen_of(seen, redis_down, redis_up, pg_down)},
                  "postgresql": {"down_s": round(pg_up - pg_down, 2), **_seen_of(seen, pg_down, pg_up, end + 60)}}
        print("\nchaos: " + json.dumps(report, indent=1))
        # only the documented answers, every 503 as documented; the router never went away
        assert not seen.bad, seen.bad[:5]
        assert {s for k, s in statuses if k == "route"} <= ROUTE_STATUSES, statuses
        assert {s for k, s in statuses if k == "feedback"} <= FEEDBACK_STATUSES, statuses
        for _, kind, status, error, retry_after in seen.answers:
            if status == 503:
                assert error in ERRORS_503 and retry_after is not None and int(retry_after) >= 1, (kind, error)
            elif status == 409:
                assert error == "conflict"
        assert statuses[("route", 200)] > 100 and statuses[("feedback", 201)] > 100, statuses  # real load
        assert statuses[("route", 503)] > 0  # and the outages were seen

        # no key decided twice: one answer per key to the clients, one row per key in the log
        twice = {k: len(v) for k, v in seen.decided.items() if len(v) > 1}
        assert not twice, twice
        with psycopg.connect(db_url, connect_timeout=10) as conn:
            dup = conn.execute("SELECT idempotency_key, count(*) FROM decisions WHERE idempotency_key IS NOT NULL "
                               "GROUP BY idempotency_key HAVING count(*) > 1").fetchall()
            assert dup == [], dup
            logged = {r[0] for r in conn.execute("SELECT decision_id FROM decisions")}
            logged_feedback: dict[int, str] = dict(conn.execute("SELECT feedback_id, decision_id FROM feedback").fetchall())
        # every acknowledged decision and feedback is in the log
        assert seen.decisions <= logged, sorted(seen.decisions - logged)[:5]
        assert all(logged_feedback.get(fid) == did for fid, did in seen.feedback.items())
        assert len(seen.feedback) == len(set(seen.feedback.values()))  # keyed feedback stored once per decision

        outages = [("redis", redis_down, redis_up), ("postgresql", pg_down, pg_up)]
        flips = _readiness_follows(ready, outages)
        print("readiness: " + json.dumps({name: {"to_503_s": round(d, 2), "back_to_200_s": round(u, 2)}
                                          for name, d, u in flips}))
        lines = [x for x in served.log.read_text(errors="replace").splitlines() if x.strip()]
        not_json = [x[:200] for x in lines if not x.startswith("{") or not isinstance(json.loads(x), dict)]
        assert not not_json, not_json[:5]

    finally:
        if served is not None:
            served.stop()
        redis_srv.close()
        pg.close()
