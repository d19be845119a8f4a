"""The fault drill's findings on pool events and migration (``docs/migration.md``), each against a
real router (uvicorn on loopback, the tiny bundle) and, where the finding is about sharing, a real
redis-server / PostgreSQL:

* an event's deadline is bounded (``migration_max_deadline_s``) and an event can be ended early
  (``POST /v1/events/{id}/end``: durable, audited, every router's mask follows it; migrations
  under way finish, none starts, none commits cold);
* a storm of commits at a deadline stays within the Redis connection pool (the session writes go
  in the state's pipeline): no placement write lost, no ``state_unavailable`` for a route then;
* after a committed migration, the session's next turn follows its committed placement.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.app.factory import create_app
from router.control.keys import add_key
from router.decision.engine import migrated_entry
from tests.servers import ServerThread
from tests.test_migration import SPOT, aws_notice, iso
from tests.test_router_support import ROUTE, LogCapture, RouterSetup, make_setup

POOL = SPOT["aws"]
PREFER_POOL = {"prefer": [{"offering_ids": [POOL]}]}
DIGEST = hashlib.sha256(b"the session's state").hexdigest()


def _deadline(s: float) -> str:
    return iso(datetime.now(UTC) + timedelta(seconds=s))


class Router:
    def __init__(self, url: str, setup: RouterSetup, events_key: str, app: Any):
        self.url, self.setup, self.app = url, setup, app
        self.E = {"Authorization": f"Bearer {events_key}"}
        self.A = setup.auth("a")
        self.c = httpx.Client(base_url=url, timeout=30)

    def place(self, sessions: list[str], body: dict[str, Any]) -> None:
        """Each session placed on ``POOL`` by one routed request (its feedback sent)."""
        for s in sessions:
            d = self.c.post("/v1/route", json={**ROUTE, "session_id": s, **body}, headers=self.A).json()
            assert d["offering"]["offering_id"] == POOL, d
            assert self.c.post("/v1/feedback", json={"decision_id": d["decision_id"], "latency_ms": 100},
                               headers=self.A).status_code == 201

    def migration(self, s: str) -> dict[str, Any] | None:
        r = self.c.get(f"/v1/sessions/{s}?tenant=a", headers=self.E)
        assert r.status_code == 200, r.text
        return r.json()["migration"]  # type: ignore[no-any-return]

    def wait(self, s: str, states: set[str], within: float = 20.0) -> dict[str, Any]:
        end = time.monotonic() + within
        while True:
            m = self.migration(s)
            if m is not None and m["state"] in states:
                return m
            assert time.monotonic() < end, f"{s} never reached {states}: {m}"
            time.sleep(0.05)

    def announce(self, s: str, m: dict[str, Any]) -> httpx.Response:
        return self.c.post(f"/v1/sessions/{s}/snapshot?tenant=a", headers=self.E, json={
            "migration_id": m["migration_id"], "version": m["version"], "last_ack_seq": 0, "sha256": DIGEST,
            "uri": f"s3://drill/{s}"})

    def verify(self, s: str, m: dict[str, Any]) -> httpx.Response:
        return self.c.post(f"/v1/sessions/{s}/verify?tenant=a", headers=self.E, json={
            "migration_id": m["migration_id"], "target": m["target"], "sha256": DIGEST})

    def masked(self) -> bool:
        """Whether this router's decisions exclude ``POOL`` for a pool event (``/v1/explain``)."""
        ex = self.c.post("/v1/explain", json=ROUTE, headers=self.A).json()
        assert "offerings" in ex, ex
        return {o["offering"]["offering_id"]: o["excluded_by"] for o in ex["offerings"]}[POOL] == "pool_event"


def _env(root: Path) -> dict[str, Any]:
    return {"serving_config": str(root / "serving.yaml"), "queue_timeout_s": 600.0}


@contextmanager
def router(setup: RouterSetup, key: str, keys_of: RouterSetup | None = None) -> Iterator[Router]:
    """A router on ``setup`` (its tenants' keys those of ``keys_of``, when it shares their file)."""
    app = create_app(setup.settings)
    with ServerThread(app) as url:
        r = Router(url, keys_of or setup, key, app)
        try:
            yield r
        finally:
            r.c.close()


def _setup(root: Path, **kw: Any) -> tuple[RouterSetup, str]:
    setup = make_setup(root, **{"migration_poll_s": 0.05, **kw}, env=_env(root))
    return setup, add_key(setup.settings.keys_file, "ops", "events")


# ---------------------------------------------------------------------------------------- 6: bounded events
def test_an_event_deadline_beyond_the_plausible_is_refused_naming_it(tmp_path: Path) -> None:
    setup, key = _setup(tmp_path, migration_max_deadline_s=3600.0)
    with router(setup, key) as r:
        far = [{"event_id": "forever", "kind": "interruption", "pool": POOL, "deadline": "9999-12-31T23:59:59Z"},
               {"event_id": "drain-2h", "kind": "drained", "pool": POOL, "deadline": _deadline(7200)},
               {"cloud": aws_notice(datetime.now(UTC) + timedelta(days=365), "aws-next-year"), "pool": POOL}]
        for body in far:
            got = r.c.post("/v1/events", json=body, headers=r.E)
            assert got.status_code == 422, got.text
            err = got.json()
            assert err["error"] == "deadline_too_far" and err["fields"][0]["field"] == "body.deadline", err
            assert "migration_max_deadline_s" in err["fields"][0]["message"]
        assert not r.masked()
        with sqlite3.connect(setup.settings.db_path) as conn:
            assert conn.execute("SELECT COUNT(*) FROM pool_events").fetchone()[0] == 0
        ok = r.c.post("/v1/events", json={"event_id": "drain-50m", "kind": "drained", "pool": POOL,
                                          "deadline": _deadline(3000)}, headers=r.E)
        assert ok.status_code == 200, ok.text
        assert r.masked()


def test_the_deadline_bound_is_a_checked_setting(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from router.core.settings import RouterSettings

    assert RouterSettings().migration_max_deadline_s == 6 * 3600
    for bad in (0, -1, 31 * 86_400):
        with pytest.raises(ValidationError, match="migration_max_deadline_s"):
            RouterSettings(migration_max_deadline_s=bad)


def test_ending_an_event_unmasks_the_pool_is_audited_and_lets_migrations_under_way_finish(tmp_path: Path) -> None:
    """An interruption (deadline 3 s) with three sessions' migrations under way, ended 'by mistake':
    the pool is unmasked at once and its region no longer de-prioritized, the end is durable and
    audited, a migration whose snapshot is then verified commits, and the two others are not
    committed cold at the (no longer real) deadline: they roll back after ``migration_timeout_s``
    (6 s), their sessions staying on the pool."""
    setup, key = _setup(tmp_path, migration_timeout_s=6.0, migration_grace_s=0.5)
    with router(setup, key) as r:
        sessions = ["e0", "e1", "e2"]
        r.place(sessions, {"constraints": PREFER_POOL})
        body = {"event_id": "ev-oops", "kind": "interruption", "pool": POOL, "deadline": _deadline(3)}
        got = r.c.post("/v1/events", json=body, headers=r.E)
        assert got.status_code == 200 and got.json()["migrations"] == 3, got.text
        ms = {s: r.wait(s, {"target_chosen"}) for s in sessions}
        assert r.announce("e1", ms["e1"]).status_code == 200
        assert r.masked() and r.app.services.engine.events_bias is not None
        # the end: a tenant key may not, an unknown event is a 404 naming it
        assert r.c.post("/v1/events/ev-oops/end", json={}, headers=r.A).status_code == 403
        assert r.c.post("/v1/events/ev-oops/end", json={}).status_code == 401
        nope = r.c.post("/v1/events/never-posted/end", json={}, headers=r.E)
        assert nope.status_code == 404 and nope.json()["fields"][0]["field"] == "path.event_id", nope.text
        bad = r.c.post("/v1/events/ev-oops/end", json={"reason": "x" * 600}, headers=r.E)
        assert bad.status_code == 422 and bad.json()["fields"][0]["field"] == "body.reason", bad.text
        end = r.c.post("/v1/events/ev-oops/end", json={"reason": "posted by mistake"}, headers=r.E)
        assert end.status_code == 200, end.text
        e = end.json()
        assert e["event_id"] == "ev-oops" and e["already_ended"] is False and e["open_migrations"] == 3
        assert e["ended_at"] <= time.time() and e["masked_until"] == e["ended_at"]
        # unmasked at once on this router, the region no longer de-prioritized: new work may go there
        assert not r.masked() and r.app.services.engine.events_bias is None
        d = r.c.post("/v1/route", json={**ROUTE, "constraints": PREFER_POOL}, headers=r.A).json()
        assert d["offering"]["offering_id"] == POOL and "pool_event" not in d["excluded"]["by_reason"]
        # again: the same answer, nothing new
        again = r.c.post("/v1/events/ev-oops/end", json={"reason": "twice"}, headers=r.E)
        assert again.status_code == 200 and again.json()["already_ended"] is True
        assert again.json()["ended_at"] == e["ended_at"]
        # the same event posted again (a watcher's retry) is a duplicate: it does not mask the pool again
        dup = r.c.post("/v1/events", json=body, headers=r.E)
        assert dup.status_code == 200 and dup.json()["duplicate"] is True and not r.masked()
        # a migration under way finishes when its target verifies
        assert r.announce("e0", ms["e0"]).status_code == 200
        m0 = r.wait("e0", {"snapshot_announced"})
        assert r.verify("e0", m0).json()["state"] == "committed"
        # the others are not committed cold at the deadline: rolled back after migration_timeout_s
        for s in ("e1", "e2"):
            m = r.wait(s, {"committed", "rolled_back", "aborted"}, within=20)
            assert m["state"] == "rolled_back" and not m["recomputed"] and not m["missed_window"], m
            assert r.c.get(f"/v1/sessions/{s}?tenant=a", headers=r.E).json()["placement"] == POOL
        assert not r.masked()
        audit = r.c.get("/v1/admin/audit?kind=pool_event", headers=setup.auth("admin")).json()["entries"]
        assert len(audit) == 1, audit
        a = audit[0]
        assert (a["action"], a["resource"]) == ("end", "ev-oops") and a["principal"].startswith("key:")
        assert a["before"]["masked_until"] > a["after"]["masked_until"] == e["ended_at"]
        assert a["after"]["reason"] == "posted by mistake"
    with sqlite3.connect(setup.settings.db_path) as conn:
        row = conn.execute("SELECT ended_at, ended_by, end_reason FROM pool_events WHERE event_id = 'ev-oops'"
                           ).fetchone()
    assert row[0] == e["ended_at"] and row[1].startswith("key:") and row[2] == "posted by mistake"
    # and after a restart the pool stays unmasked (the end is in the log)
    with router(setup, key) as r2:
        assert not r2.masked()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_event_ended_on_one_router_is_ended_on_every_router(tmp_path: Path, backend: str,
                                                              request: pytest.FixtureRequest) -> None:
    """Two routers on one decision log (SQLite file, PostgreSQL database): the event posted at A
    masks the pool at B within B's poll; ended at B, it is unmasked at A within A's poll."""
    common: dict[str, Any] = {}
    if backend == "postgresql":
        pg = request.getfixturevalue("postgres")
        common["db_url"] = pg.create_database(f"mig_end_{time.time_ns()}")
    sa, key = _setup(tmp_path / "a", **common)
    if backend == "sqlite":
        common["db_path"] = sa.settings.db_path
    sb = make_setup(tmp_path / "b", migration_poll_s=0.05, **common, env=_env(tmp_path / "b"),
                    keys_file=sa.settings.keys_file)
    with router(sa, key) as a, router(sb, key, keys_of=sa) as b:
        assert not a.masked() and not b.masked()
        got = a.c.post("/v1/events", json={"event_id": "ev-cross", "kind": "interruption", "pool": POOL,
                                           "deadline": _deadline(600)}, headers=a.E)
        assert got.status_code == 200, got.text
        end = time.monotonic() + 10
        while not b.masked():
            assert time.monotonic() < end, "B never masked the pool"
            time.sleep(0.05)
        ended = b.c.post("/v1/events/ev-cross/end", json={"reason": "cancelled"}, headers=b.E)
        assert ended.status_code == 200 and ended.json()["already_ended"] is False, ended.text
        assert not b.masked()
        end = time.monotonic() + 10
        while a.masked():
            assert time.monotonic() < end, "A never unmasked the pool"
            time.sleep(0.05)
        assert a.app.services.engine.events_keep is None
        again = a.c.post("/v1/events/ev-cross/end", json={}, headers=a.E)
        assert again.status_code == 200 and again.json()["already_ended"] is True


# ---------------------------------------------------------------------------------------- 7: a storm of commits
@pytest.mark.slow
def test_a_storm_of_commits_at_a_deadline_stays_within_the_redis_pool(tmp_path: Path, redis_server: Any) -> None:
    """200 sessions on one pool, an interruption 6 s ahead and no serving side: at the deadline the
    router commits all 200 cold at once (more than the state's 64 connections). Every session's
    placement reaches the shared state, no write is logged as failed, and routes sent meanwhile
    never get 503 ``state_unavailable``."""
    import redis

    prefix = f"storm{time.time_ns()}"
    setup, key = _setup(tmp_path, state_backend="redis", state_url=redis_server.url, state_prefix=prefix,
                        migration_grace_s=0.5)
    logs = LogCapture()
    try:
        with router(setup, key) as r:
            logs.attach()  # (after the app set its logging up)
            sessions = [f"st{i:03d}" for i in range(200)]
            r.place(sessions, {"constraints": PREFER_POOL})
            got = r.c.post("/v1/events", json={"event_id": "ev-storm", "kind": "interruption", "pool": POOL,
                                               "deadline": _deadline(6)}, headers=r.E)
            assert got.status_code == 200 and got.json()["migrations"] == 200, got.text
            statuses: list[int] = []
            stop = threading.Event()

            def traffic() -> None:
                with httpx.Client(base_url=r.url, timeout=30) as c:
                    while not stop.is_set():
                        statuses.append(c.post("/v1/route", json=ROUTE, headers=r.A).status_code)

            t = threading.Thread(target=traffic)
            t.start()
            try:
                targets = {s: r.wait(s, {"committed"}, within=40)["target"] for s in sessions}
            finally:
                stop.set()
                t.join()
            assert statuses and 503 not in statuses, sorted(set(statuses))
            engine = r.app.services.engine
            rc = redis.Redis.from_url(redis_server.url)
            lost = []
            for s, target in targets.items():
                v = rc.get(f"{prefix}:{{router}}:sess:a:{s}")
                if v != migrated_entry(engine.pool_key_of(target)):  # (what the commit writes)
                    lost.append((s, v))
            assert not lost, f"{len(lost)} placements not written: {lost[:3]}"
    finally:
        logs.detach()
    failed = [x for x in logs.records() if x.get("level") == "warning" and
              ("session placement" in x["msg"] or "Too many connections" in json.dumps(x))]
    assert not failed, failed[:3]


# ---------------------------------------------------------------------------------------- 8: the next turn
@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_a_sessions_next_turn_follows_its_committed_migration(tmp_path: Path, backend: str,
                                                             request: pytest.FixtureRequest) -> None:
    """Twelve sessions on one spot pool, an interruption, every migration committed with its
    snapshot verified; then each session's next turn (the same request as its earlier ones: greedy,
    no prefix_hashes) goes to the migration's target -- where its state now is -- although the
    targets' load would send a fresh request elsewhere (before the fix: 0 of 12 did)."""
    kw: dict[str, Any] = {}
    if backend == "redis":
        kw = {"state_backend": "redis", "state_url": request.getfixturevalue("redis_server").url,
              "state_prefix": f"next{time.time_ns()}"}
    setup, key = _setup(tmp_path, **kw)
    with router(setup, key) as r:
        sessions = [f"n{i:02d}" for i in range(12)]
        r.place(sessions, {"constraints": PREFER_POOL})
        assert r.c.post("/v1/events", json={"event_id": "ev-next", "kind": "interruption", "pool": POOL,
                                            "deadline": _deadline(120)}, headers=r.E).status_code == 200
        targets = {}
        for s in sessions:
            m = r.wait(s, {"target_chosen"})
            assert r.announce(s, m).status_code == 200
            m = r.wait(s, {"snapshot_announced"})
            v = r.verify(s, m)
            assert v.status_code == 200 and v.json()["state"] == "committed", v.text
            targets[s] = v.json()["target"]
        went = {}
        for s in sessions:
            d = r.c.post("/v1/route", json={**ROUTE, "session_id": s, "constraints": PREFER_POOL}, headers=r.A)
            assert d.status_code == 200, d.text
            went[s] = d.json()["offering"]["offering_id"]
        assert went == targets, {s: (went[s], targets[s]) for s in sessions if went[s] != targets[s]}


# ---------------------------------------------------------------------------------------- 7: the serving side in batches
def test_a_serving_side_moves_a_pools_sessions_in_batches(tmp_path: Path) -> None:
    """The serving side lists the event's migrations a page at a time and announces and verifies
    their snapshots in one call each; each item's outcome is what its single call would answer."""
    setup, key = _setup(tmp_path, max_body_bytes=2**20)  # (1,001 items fit: the 422 is the schema's)
    with router(setup, key) as r:
        sessions = [f"b{i}" for i in range(5)]
        r.place(sessions, {"constraints": PREFER_POOL})
        assert r.c.post("/v1/events", json={"event_id": "ev-batch", "kind": "interruption", "pool": POOL,
                                            "deadline": _deadline(120)}, headers=r.E).status_code == 200
        for s in sessions:
            r.wait(s, {"target_chosen"})
        # the list: pages by id, every tenant's (admin:read:sessions), 404 for an unknown event
        assert r.c.get("/v1/events/ev-batch/migrations", headers=r.A).status_code == 403
        assert r.c.get("/v1/events/nope/migrations", headers=r.E).status_code == 404
        seen, after = [], ""
        while True:
            page = r.c.get("/v1/events/ev-batch/migrations", headers=r.E,
                           params={"state": "target_chosen", "after": after, "limit": 2}).json()
            seen += page["migrations"]
            if page["next_after"] is None:
                break
            after = page["next_after"]
        assert sorted(m["session_id"] for m in seen) == sessions and len({m["migration_id"] for m in seen}) == 5
        ms = {m["session_id"]: m for m in seen}

        def snap(s: str, **kw: Any) -> dict[str, Any]:
            m = ms[s]
            return {"session_id": s, "tenant": "a", "migration_id": m["migration_id"], "version": m["version"],
                    "last_ack_seq": 3, "sha256": DIGEST, "uri": f"s3://drill/{s}", **kw}

        items = [snap(s) for s in sessions[:4]] + [snap("b4", version=ms["b4"]["version"] + 7),
                                                    snap("b0", migration_id="m_unknown")]
        got = r.c.post("/v1/sessions/snapshots", json={"items": items}, headers=r.E)
        assert got.status_code == 200, got.text
        res = got.json()["results"]
        assert [x["status"] for x in res] == [200, 200, 200, 200, 409, 404]
        assert all(x["migration"]["state"] == "snapshot_announced" for x in res[:4])
        assert res[4]["error"] == "stale_version" and res[4]["fields"][0]["field"] == "body.version"
        assert res[5]["error"] == "not_found"
        ver = [{"session_id": s, "tenant": "a", "migration_id": ms[s]["migration_id"], "target": ms[s]["target"],
                "sha256": DIGEST} for s in sessions[:3]]
        ver.append({**ver[0], "session_id": "b3", "migration_id": ms["b3"]["migration_id"],
                    "target": ms["b3"]["target"], "sha256": hashlib.sha256(b"other bytes").hexdigest()})
        got = r.c.post("/v1/sessions/verifications", json={"items": ver}, headers=r.E)
        assert got.status_code == 200, got.text
        res = got.json()["results"]
        assert [x["status"] for x in res] == [200, 200, 200, 409]
        assert all(x["migration"]["state"] == "committed" for x in res[:3])
        assert res[3]["error"] == "hash_mismatch" and res[3]["migration"]["target"] != ms["b3"]["target"]
        for s in sessions[:3]:
            v = r.c.get(f"/v1/sessions/{s}?tenant=a", headers=r.E).json()
            assert v["placement"] == ms[s]["target"] and v["replay_from"] == 4
        # bad batches are 422s naming the field; a tenant key may not name another tenant
        empty = r.c.post("/v1/sessions/snapshots", json={"items": []}, headers=r.E)
        assert empty.status_code == 422 and empty.json()["fields"][0]["field"] == "body.items"
        big = r.c.post("/v1/sessions/verifications", json={"items": [ver[0]] * 1001}, headers=r.E)
        assert big.status_code == 422 and big.json()["fields"][0]["field"] == "body.items"
        other = r.c.post("/v1/sessions/snapshots", json={"items": [snap("b4", tenant="b")]},
                         headers=setup.auth("a"))
        assert other.status_code == 403  # (a tenant key: no admin:write:events at all)
