"""Pool events and session migrations (``router/service/migration.py``, ``docs/migration.md``) against a
real router (uvicorn on loopback, the tiny bundle, the SQLite decision log): events in xroute's
schema and as the clouds emit them, the masks, the state machine through the HTTP API, bad events
refused with nothing changed, and a restart that resumes unfinished migrations."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloud_adapters.events import NoticeError, parse_notice
from router.app.factory import create_app
from router.control.keys import add_key
from tests.servers import ServerThread
from tests.test_router_support import ROUTE, RouterSetup, make_setup
from xroute.schema.migration import valid_path

FIXTURES = Path(__file__).parent / "fixtures" / "cloud" / "events"
SPOT = {"aws": "aws:us-east-1:g5.xlarge:spot", "gcp": "gcp:europe-west4:g2-standard-4:spot",
        "azure": "azure:japaneast:NC4as_T4_v3:spot"}
PREFER_SPOT = {"prefer": [{"pricing_modes": ["spot"]}]}


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())  # type: ignore[no-any-return]


def iso(dt: datetime) -> str:
    return dt.isoformat().replace("+00:00", "Z")


def aws_notice(at: datetime, event_id: str) -> dict[str, Any]:
    p = fixture("aws_spot_interruption.json")
    p["time"], p["id"] = iso(at), event_id
    return p


def azure_notice(not_before: datetime, event_id: str) -> dict[str, Any]:
    p = fixture("azure_scheduled_preempt.json")
    p["Events"][0]["NotBefore"] = format_datetime(not_before, usegmt=True)
    p["Events"][0]["EventId"] = event_id
    return p


# ---------------------------------------------------------------------------------------- cloud shapes
def test_recorded_cloud_notices_are_read_into_the_schema() -> None:
    now = datetime(2026, 12, 4, 8, 0, 5, tzinfo=UTC)
    aws = parse_notice(fixture("aws_spot_interruption.json"), now)
    assert (aws.kind, aws.location, aws.instance) == ("interruption", "aws:us-east-1", "i-1234567890abcdef0")
    assert aws.deadline == datetime(2026, 12, 4, 8, 2, 0, tzinfo=UTC)  # two minutes after the warning
    reb = parse_notice(fixture("aws_rebalance.json"), now)
    assert reb.kind == "rebalance" and reb.deadline is None and reb.event_id.endswith("013")
    az = parse_notice(fixture("azure_scheduled_preempt.json"), now)
    assert (az.kind, az.location, az.instance) == ("interruption", None, "myspotvm_0")
    assert az.deadline == datetime(2026, 12, 4, 8, 0, 30, tzinfo=UTC) and az.issued_at == now
    gcp = parse_notice(fixture("gcp_preempted_audit.json"), now)
    assert (gcp.kind, gcp.location, gcp.instance) == ("interruption", "gcp:europe-west4", "spot-vm-1")
    assert gcp.deadline == datetime(2026, 12, 4, 8, 0, 30, tzinfo=UTC)


@pytest.mark.parametrize("name, mutate, field", [
    ("aws_spot_interruption.json", lambda p: p["detail"].pop("instance-id"), "detail.instance-id"),
    ("aws_spot_interruption.json", lambda p: p.__setitem__("time", "yesterday"), "time"),
    ("aws_spot_interruption.json", lambda p: p.__setitem__("detail-type", "EC2 Instance State-change"), "detail-type"),
    ("aws_spot_interruption.json", lambda p: p["detail"].__setitem__("instance-action", "dance"),
     "detail.instance-action"),
    ("azure_scheduled_preempt.json", lambda p: p["Events"][0].__setitem__("EventType", "Reboot"), "Events"),
    ("azure_scheduled_preempt.json", lambda p: p["Events"][0].__setitem__("NotBefore", "soon"), "Events.0.NotBefore"),
    ("gcp_preempted_audit.json", lambda p: p["resource"]["labels"].pop("zone"), "resource.labels.zone"),
    ("gcp_preempted_audit.json", lambda p: p["protoPayload"].__setitem__("methodName", "v1.compute.instances.stop"),
     "protoPayload.methodName"),
])
def test_a_malformed_cloud_notice_names_its_field(name: str, mutate: Any, field: str) -> None:
    p = fixture(name)
    mutate(p)
    with pytest.raises(NoticeError) as e:
        parse_notice(p)
    assert e.value.field == field


# ---------------------------------------------------------------------------------------- the router
class Live:
    def __init__(self, url: str, setup: RouterSetup, events_key: str, app: Any):
        self.url, self.setup, self.app = url, setup, app
        self.E = {"Authorization": f"Bearer {events_key}"}
        self.A = setup.auth("a")
        self.c = httpx.Client(base_url=url, timeout=15)
        self.n = 0

    def sessions(self, k: int, prefix: str, **body: Any) -> dict[str, str]:
        """``k`` sessions of tenant a, each placed by one routed request (its feedback sent)."""
        out = {}
        for i in range(k):
            s = f"{prefix}{i}"
            r = self.c.post("/v1/route", json={**ROUTE, "session_id": s, **body}, headers=self.A)
            assert r.status_code == 200, r.text
            d = r.json()
            out[s] = d["offering"]["offering_id"]
            assert self.c.post("/v1/feedback", json={"decision_id": d["decision_id"], "latency_ms": 100},
                               headers=self.A).status_code == 201
        return out

    def event(self, body: dict[str, Any]) -> httpx.Response:
        return self.c.post("/v1/events", json=body, headers=self.E)

    def session(self, s: str) -> dict[str, Any]:
        r = self.c.get(f"/v1/sessions/{s}", headers=self.A)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def wait_state(self, s: str, states: set[str], within: float = 15.0) -> dict[str, Any]:
        end = time.monotonic() + within
        while True:
            v = self.session(s)
            if v["migration"] is not None and v["migration"]["state"] in states:
                return v
            assert time.monotonic() < end, f"session {s} never reached {states}: {v}"
            time.sleep(0.05)

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.setup.settings.db_path)

    def counts(self) -> tuple[int, int, int]:
        with self.db() as conn:
            return tuple(conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]  # type: ignore[return-value]
                         for t in ("pool_events", "migrations", "migration_transitions"))


def _env(root: Path) -> dict[str, Any]:
    """The tiny bundle's serving model (make_setup writes it there), and queues long enough for
    every session these tests place."""
    return {"serving_config": str(root / "serving.yaml"), "queue_timeout_s": 600.0}


@contextmanager
def serving(setup: RouterSetup) -> Iterator[Live]:
    """A router on ``setup`` behind a real HTTP server, with an ops key that may post events."""
    key = add_key(setup.settings.keys_file, "ops", "events")
    app = create_app(setup.settings)
    with ServerThread(app) as url:
        lv = Live(url, setup, key, app)
        try:
            yield lv
        finally:
            lv.c.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("migration")
    setup = make_setup(root, migration_poll_s=0.05, migration_timeout_s=3.0, migration_grace_s=0.5,
                       migration_region_penalty=50.0, env=_env(root))
    with serving(setup) as lv:
        yield lv


def _deadline(s: float) -> str:
    return iso(datetime.now(UTC) + timedelta(seconds=s))


def test_an_interruption_masks_the_pool_and_moves_its_sessions_through_every_state(live: Live) -> None:
    placed = live.sessions(6, "mv", constraints=PREFER_SPOT)
    pool = SPOT["aws"]
    on = sorted(s for s, p in placed.items() if p == pool)
    assert on, placed
    r = live.event({"event_id": "ev-move", "kind": "interruption", "pool": pool, "deadline": _deadline(120)})
    assert r.status_code == 200, r.text
    ans = r.json()
    assert ans["duplicate"] is False and ans["migrations"] == len(on) and ans["deprioritized_region"] == "aws:us-east-1"
    # new decisions never take the masked pool, and say why; /v1/explain says so too
    ex = live.c.post("/v1/explain", json=ROUTE, headers=live.A).json()
    assert {r["offering"]["offering_id"]: r["excluded_by"] for r in ex["offerings"]}[pool] == "pool_event"
    for _ in range(3):
        d = live.c.post("/v1/route", json={**ROUTE, "constraints": PREFER_SPOT}, headers=live.A).json()
        assert d["offering"]["offering_id"] != pool and d["excluded"]["by_reason"]["pool_event"] == 1
    payload = b"the session's KV cache and decode state" * 10
    digest = hashlib.sha256(payload).hexdigest()
    for s in on:
        v = live.wait_state(s, {"target_chosen"})
        m = v["migration"]
        assert v["placement"] == pool and v["migrating"] and m["target"] not in (None, pool)
        snap = live.c.post(f"/v1/sessions/{s}/snapshot?tenant=a", headers=live.E,
                           json={"migration_id": m["migration_id"], "version": m["version"], "last_ack_seq": 7,
                                 "sha256": digest, "uri": f"s3://snapshots/{s}"})
        assert snap.status_code == 200 and snap.json()["state"] == "snapshot_announced", snap.text
        ver = live.c.post(f"/v1/sessions/{s}/verify?tenant=a", headers=live.E,
                          json={"migration_id": m["migration_id"], "target": m["target"], "sha256": digest})
        assert ver.status_code == 200 and ver.json()["state"] == "committed", ver.text
        after = live.session(s)
        assert after["placement"] == m["target"] and not after["migrating"] and after["replay_from"] == 8
        assert after["version"] == m["version"] + 3  # snapshot_announced, verified, committed
    with live.db() as conn:
        rows = conn.execute("SELECT migration_id, state FROM migration_transitions WHERE migration_id IN "
                            "(SELECT migration_id FROM migrations WHERE event_id = 'ev-move') ORDER BY migration_id, "
                            "version").fetchall()
        keys = conn.execute("SELECT COUNT(*), COUNT(DISTINCT idempotency_key) FROM decisions WHERE idempotency_key "
                            "LIKE 'a:route:mig-%'").fetchone()
    paths: dict[str, list[str]] = {}
    for mid, st in rows:
        paths.setdefault(mid, []).append(st)
    assert len(paths) == len(on)
    assert all(p == ["requested", "target_chosen", "snapshot_announced", "verified", "committed"] for p in paths.values())
    assert keys[0] == keys[1] >= len(on)  # each target decision once


def test_the_preempted_region_is_deprioritized(live: Live) -> None:
    """An interruption on a region's spot pool lowers the scores of the region's other offerings
    by ``migration_region_penalty`` (50 here) for new decisions."""
    only = {"allow": [{"offering_ids": ["aws:us-east-1:g5.xlarge:on_demand", "gcp:europe-west4:g2-standard-4:on_demand"]}]}
    svc = live.app.services
    assert svc.engine.events_bias is not None  # (the previous test's interruption is still de-prioritizing)
    d = live.c.post("/v1/route", json={**ROUTE, "constraints": only}, headers=live.A).json()
    assert d["offering"]["offering_id"] == "gcp:europe-west4:g2-standard-4:on_demand"
    scores = {a["offering"]["offering_id"]: a["score"] for a in d["alternatives"]}
    assert scores["aws:us-east-1:g5.xlarge:on_demand"] < d["score"] - 40


def test_a_hash_mismatch_refuses_the_target_and_moves_on_to_another(live: Live) -> None:
    placed = live.sessions(6, "hm", constraints=PREFER_SPOT)
    pool = SPOT["gcp"]
    on = [s for s, p in placed.items() if p == pool]
    if not on:  # (the greedy choice among spot pools: make sure one session is there)
        on = list(live.sessions(1, "hmx", constraints={"prefer": [{"offering_ids": [pool]}]}))
    s = on[0]
    assert live.event({"event_id": "ev-hash", "kind": "drained", "pool": pool,
                       "deadline": _deadline(120)}).status_code == 200
    m = live.wait_state(s, {"target_chosen"})["migration"]
    first = m["target"]
    good = hashlib.sha256(b"state").hexdigest()
    assert live.c.post(f"/v1/sessions/{s}/snapshot?tenant=a", headers=live.E,
                       json={"migration_id": m["migration_id"], "version": m["version"], "last_ack_seq": 0,
                             "sha256": good, "uri": "gs://b/o"}).status_code == 200
    bad = live.c.post(f"/v1/sessions/{s}/verify?tenant=a", headers=live.E,
                      json={"migration_id": m["migration_id"], "target": first,
                            "sha256": hashlib.sha256(b"other").hexdigest()})
    assert bad.status_code == 409 and bad.json()["error"] == "hash_mismatch"
    assert bad.json()["fields"][0]["field"] == "body.sha256"
    again = bad.json()["migration"]
    assert again["state"] == "target_chosen" and again["target"] not in (first, pool) and again["tried"] == [first]
    # the old version's snapshot is stale now
    stale = live.c.post(f"/v1/sessions/{s}/snapshot?tenant=a", headers=live.E,
                        json={"migration_id": m["migration_id"], "version": m["version"], "last_ack_seq": 0,
                              "sha256": good, "uri": "gs://b/o"})
    assert stale.status_code == 409 and stale.json()["error"] == "stale_version"
    assert live.c.post(f"/v1/sessions/{s}/snapshot?tenant=a", headers=live.E,
                       json={"migration_id": m["migration_id"], "version": again["version"], "last_ack_seq": 0,
                             "sha256": good, "uri": "gs://b/o"}).status_code == 200
    ok = live.c.post(f"/v1/sessions/{s}/verify?tenant=a", headers=live.E,
                     json={"migration_id": m["migration_id"], "target": again["target"], "sha256": good})
    assert ok.status_code == 200 and ok.json()["state"] == "committed"
    assert live.session(s)["placement"] == again["target"]


def test_out_of_time_commits_cold_or_rolls_back(live: Live) -> None:
    """No snapshot before an interruption's deadline: the work restarts at the target
    (``recomputed``, ``missed_window``). A rebalance nobody acts on within
    ``migration_timeout_s`` (3 s here) rolls back: the session stays."""
    pool = SPOT["azure"]
    s = next(iter(live.sessions(1, "cold", constraints={"prefer": [{"offering_ids": [pool]}]})))
    r = live.event({"cloud": azure_notice(datetime.now(UTC) + timedelta(seconds=2), "az-cold"), "pool": pool})
    assert r.status_code == 200 and r.json()["migrations"] >= 1, r.text
    v = live.wait_state(s, {"committed"}, within=15)
    m = v["migration"]
    assert m["recomputed"] and m["missed_window"] and v["placement"] == m["target"] != pool
    assert v["replay_from"] is None  # nothing to replay from: the work restarts
    od = "gcp:europe-west4:g2-standard-4:on_demand"
    s2 = next(iter(live.sessions(1, "rb", constraints={"prefer": [{"offering_ids": [od]}]})))
    assert live.event({"event_id": "ev-rebalance", "kind": "rebalance", "pool": od}).status_code == 200
    v2 = live.wait_state(s2, {"rolled_back"}, within=15)
    assert v2["placement"] == od and not v2["migrating"]
    assert v2["migration"]["target"] not in (None, od) and "migration_timeout_s" in v2["migration"]["reason"]
    # a session whose constraints allow only the pool has no target at all: rolled back at once
    only = "aws:us-east-1:g5.xlarge:on_demand"
    s3 = next(iter(live.sessions(1, "rb-only", constraints={"allow": [{"offering_ids": [only]}]})))
    assert live.event({"event_id": "ev-rebalance-2", "kind": "degraded", "pool": only}).status_code == 200
    v3 = live.wait_state(s3, {"rolled_back"}, within=15)
    assert v3["placement"] == only and v3["migration"]["target"] is None and "no_offering" in v3["migration"]["reason"]


def test_a_duplicate_event_is_answered_as_the_first_and_changes_nothing(live: Live) -> None:
    pool = SPOT["aws"]
    body = {"cloud": aws_notice(datetime.now(UTC), "aws-dup-1"), "pool": pool}
    first = live.event(body)
    assert first.status_code == 200 and first.json()["duplicate"] is False and first.json()["event_id"] == "aws-dup-1"
    before = live.counts()
    again = live.event(body)
    assert again.status_code == 200 and again.json()["duplicate"] is True and again.json()["migrations"] == 0
    assert live.counts() == before


def _bad_events() -> list[tuple[str, dict[str, Any], int, str, str]]:
    future = _deadline(60)
    aws_missing = aws_notice(datetime.now(UTC), "aws-bad-1")
    del aws_missing["detail"]["instance-id"]
    return [
        ("unknown pool", {"event_id": "b1", "kind": "interruption", "pool": "aws:us-east-1:g5.xlarge:spto",
                          "deadline": future}, 422, "unknown_pool", "body.pool"),
        ("past deadline", {"event_id": "b2", "kind": "interruption", "pool": SPOT["aws"],
                           "deadline": _deadline(-5)}, 422, "deadline_passed", "body.deadline"),
        ("no deadline", {"event_id": "b3", "kind": "interruption", "pool": SPOT["aws"]}, 422, "invalid_request", "body"),
        ("unknown kind", {"event_id": "b4", "kind": "meteor", "pool": SPOT["aws"]}, 422, "invalid_request", "body.kind"),
        ("malformed cloud payload", {"cloud": aws_missing, "pool": SPOT["aws"]}, 422, "invalid_cloud_event",
         "body.cloud.detail.instance-id"),
        ("old cloud payload", {"cloud": aws_notice(datetime.now(UTC) - timedelta(minutes=5), "aws-old"),
                               "pool": SPOT["aws"]}, 422, "deadline_passed", "body.deadline"),
        ("cloud payload of another region", {"cloud": aws_notice(datetime.now(UTC), "aws-region"),
                                             "pool": SPOT["gcp"]}, 422, "location_mismatch", "body.pool"),
        ("duplicate id, another body", {"event_id": "ev-move", "kind": "degraded", "pool": SPOT["gcp"]}, 409,
         "event_id_reused", "body.event_id"),
        ("unknown field", {"event_id": "b5", "kind": "degraded", "pool": SPOT["gcp"], "severity": 3}, 422,
         "invalid_request", "body.severity"),
    ]


@pytest.mark.parametrize("case", _bad_events(), ids=lambda c: c[0])
def test_a_bad_event_is_a_4xx_naming_the_field_and_changes_nothing(live: Live, case: Any) -> None:
    _, body, status, error, field = case
    before = live.counts()
    keep = live.app.services.engine.events_keep
    r = live.event(body)
    assert r.status_code == status, r.text
    got = r.json()
    assert got["error"] == error and any(f["field"] == field for f in got["fields"]), got
    assert live.counts() == before
    k2 = live.app.services.engine.events_keep
    assert (keep is None and k2 is None) or (keep is not None and k2 is not None and (keep == k2).all())


def test_roles_and_tenants(live: Live) -> None:
    body = {"event_id": "role", "kind": "degraded", "pool": SPOT["gcp"]}
    assert live.c.post("/v1/events", json=body, headers=live.A).status_code == 403  # a tenant key
    assert live.c.post("/v1/events", json=body).status_code == 401
    s = next(iter(live.sessions(1, "own")))
    assert live.c.get(f"/v1/sessions/{s}", headers=live.setup.auth("b")).status_code == 404  # another tenant's
    assert live.c.get(f"/v1/sessions/{s}?tenant=a", headers=live.setup.auth("b")).status_code == 403
    assert live.c.get(f"/v1/sessions/{s}", headers=live.E).status_code == 404  # (the events key's own tenant)
    assert live.c.get(f"/v1/sessions/{s}?tenant=a", headers=live.E).json()["placement"] is not None
    assert live.c.get("/v1/sessions/never-seen", headers=live.A).status_code == 404


def test_long_poll_answers_when_the_version_moves(live: Live) -> None:
    pool = "azure:japaneast:NC4as_T4_v3:on_demand"
    s = next(iter(live.sessions(1, "lp", constraints={"prefer": [{"offering_ids": [pool]}]})))
    v0 = live.session(s)["version"]
    t0 = time.monotonic()
    idle = live.c.get(f"/v1/sessions/{s}?wait=0.5&version={v0}", headers=live.A)
    assert idle.json()["version"] == v0 and time.monotonic() - t0 >= 0.45
    live.event({"event_id": "ev-lp", "kind": "degraded", "pool": pool})
    moved = live.c.get(f"/v1/sessions/{s}?wait=10&version={v0}", headers=live.A).json()
    assert moved["version"] != v0 and moved["migration"]["event_id"] == "ev-lp"


def test_a_restart_resumes_unfinished_migrations_and_keeps_the_masks(tmp_path: Path) -> None:
    setup = make_setup(tmp_path, migration_poll_s=0.05, env=_env(tmp_path))
    key = add_key(setup.settings.keys_file, "ops", "events")
    pool = SPOT["aws"]
    with ServerThread(create_app(setup.settings)) as url:
        lv = Live(url, setup, key, None)
        s = next(iter(lv.sessions(1, "rs", constraints={"prefer": [{"offering_ids": [pool]}]})))
        body = {"event_id": "ev-restart", "kind": "interruption", "pool": pool, "deadline": _deadline(300)}
        assert lv.event(body).json()["migrations"] == 1
        m = lv.wait_state(s, {"target_chosen"})["migration"]
        digest = hashlib.sha256(b"x").hexdigest()
        assert lv.c.post(f"/v1/sessions/{s}/snapshot?tenant=a", headers=lv.E,
                         json={"migration_id": m["migration_id"], "version": m["version"], "last_ack_seq": 1,
                               "sha256": digest, "uri": "file:///tmp/x"}).status_code == 200
        lv.c.close()
    with ServerThread(create_app(setup.settings)) as url:
        lv = Live(url, setup, key, None)
        v = lv.session(s)
        assert v["migration"]["state"] == "snapshot_announced" and v["placement"] == pool
        d = lv.c.post("/v1/route", json={**ROUTE, "constraints": PREFER_SPOT}, headers=lv.A).json()
        assert d["offering"]["offering_id"] != pool  # the mask came back from the log
        assert lv.event(body).json()["duplicate"] is True  # and the event id is still known
        ok = lv.c.post(f"/v1/sessions/{s}/verify?tenant=a", headers=lv.E,
                       json={"migration_id": m["migration_id"], "target": m["target"], "sha256": digest})
        assert ok.status_code == 200 and ok.json()["state"] == "committed"
        lv.c.close()
    with sqlite3.connect(setup.settings.db_path) as conn:
        states = [r[0] for r in conn.execute("SELECT state FROM migration_transitions ORDER BY version")]
    assert valid_path(states) and states[-1] == "committed"


def test_the_openapi_document_lists_the_new_routes_and_their_errors(live: Live) -> None:
    spec = live.c.get("/openapi.json").json()
    ev = spec["paths"]["/v1/events"]["post"]
    assert {"409", "422", "403"} <= set(ev["responses"])
    assert {"PoolEvent", "CloudEventEnvelope"} <= set(spec["components"]["schemas"])
    for p in ("/v1/sessions/{session_id}", "/v1/sessions/{session_id}/snapshot", "/v1/sessions/{session_id}/verify"):
        assert p in spec["paths"]



def test_the_outcomes_are_counted_in_the_metrics(live: Live) -> None:
    """What the tests above did, as ``xroute_router_migrations_total`` counts it."""
    text = live.c.get("/metrics", headers=live.setup.auth("admin")).text
    got = {m.group(1): float(m.group(2)) for m in
           re.finditer(r'^xroute_router_migrations_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}
    assert got["committed"] >= 3 and got["recomputed"] >= 1 and got["missed_window"] >= 1
    assert got["hash_mismatches"] >= 1 and got["rolled_back"] >= 2 and got["events"] >= 5
    assert got["migrations_started"] >= got["committed"]


def test_an_events_key_is_made_with_its_own_role(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from router.control.keys import KeyStore, cli
    from xroute.schema.access import BUILTIN_ROLES

    keys = tmp_path / "keys.json"
    run = CliRunner().invoke(cli, ["add", "--tenant", "ops", "--role", "events", "--keys-file", str(keys)])
    assert run.exit_code == 0, run.output
    who = KeyStore(keys).verify(run.output.strip())
    assert who is not None and who.role == "events" and not who.is_admin
    assert set(BUILTIN_ROLES["events"]) == {"admin:write:events", "admin:read:sessions"}


def test_two_routers_on_one_postgresql_log_and_redis_move_each_session_once(
        tmp_path: Path, postgres: Any, redis_server: Any) -> None:
    """Router A takes the event; router B shares the log and the state but reads the events only
    every 30 s, so it still routes a new session to the pool after the event: A's next sweep finds
    that straggler and moves it too. Every transition is a compare-and-set, so each happens once
    whichever router makes it; the serving side announces to B and verifies at A."""
    url = postgres.create_database(f"mig_two_{time.time_ns()}")
    prefix = f"migtwo{time.time_ns()}"
    common = {"db_url": url, "state_backend": "redis", "state_url": redis_server.url, "state_prefix": prefix,
              "migration_poll_s": 0.05}
    sa = make_setup(tmp_path / "a", **common, env=_env(tmp_path / "a"))
    key = add_key(sa.settings.keys_file, "ops", "events")
    sb = make_setup(tmp_path / "b", **{**common, "migration_poll_s": 30.0}, env=_env(tmp_path / "b"),
                    keys_file=sa.settings.keys_file)
    pool = SPOT["gcp"]
    with ServerThread(create_app(sa.settings)) as url_a, ServerThread(create_app(sb.settings)) as url_b:
        a, b = Live(url_a, sa, key, None), Live(url_b, sa, key, None)
        placed = {**a.sessions(4, "two-a", constraints={"prefer": [{"offering_ids": [pool]}]}),
                  **b.sessions(4, "two-b", constraints={"prefer": [{"offering_ids": [pool]}]})}
        assert set(placed.values()) == {pool}
        ans = a.event({"event_id": "ev-two", "kind": "interruption", "pool": pool, "deadline": _deadline(120)})
        assert ans.status_code == 200 and ans.json()["migrations"] == 8, ans.text
        late = b.sessions(1, "two-late", constraints={"prefer": [{"offering_ids": [pool]}]})
        assert set(late.values()) == {pool}  # (B has not read the event yet)
        assert a.c.post("/v1/route", json={**ROUTE, "constraints": PREFER_SPOT}, headers=a.A
                        ).json()["offering"]["offering_id"] != pool
        placed.update(late)
        digest = hashlib.sha256(b"two").hexdigest()
        for s in placed:
            m = b.wait_state(s, {"target_chosen"})["migration"]
            assert b.c.post(f"/v1/sessions/{s}/snapshot?tenant=a", headers=b.E,
                            json={"migration_id": m["migration_id"], "version": m["version"], "last_ack_seq": 0,
                                  "sha256": digest, "uri": "s3://two/x"}).status_code == 200
            ok = a.c.post(f"/v1/sessions/{s}/verify?tenant=a", headers=a.E,
                          json={"migration_id": m["migration_id"], "target": m["target"], "sha256": digest})
            assert ok.status_code == 200 and ok.json()["state"] == "committed", ok.text
            assert b.session(s)["placement"] == m["target"] != pool
        a.c.close()
        b.c.close()
    import psycopg

    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT migration_id, state FROM migration_transitions ORDER BY migration_id, version"
                            ).fetchall()
        keys = conn.execute("SELECT idempotency_key, COUNT(*) FROM decisions WHERE idempotency_key LIKE %s "
                            "GROUP BY idempotency_key", ("a:route:mig-%",)).fetchall()
    paths: dict[str, list[str]] = {}
    for mid, st in rows:
        paths.setdefault(mid, []).append(st)
    assert len(paths) == 9
    assert all(p == ["requested", "target_chosen", "snapshot_announced", "verified", "committed"] for p in paths.values())
    assert keys and all(n == 1 for _, n in keys)


def test_a_rebalance_rolled_back_then_an_interruption_moves_the_session(tmp_path: Path) -> None:
    """A rebalance recommendation, then an interruption of the same pool while the session's
    migration off the rebalance is still open (the interruption's sweep skips the session: one open
    migration at a time). That migration rolls back (nobody announced a snapshot within
    ``migration_timeout_s``) and leaves the session on the pool: the interruption's next sweep --
    which reads only what came since its previous one -- finds it there as of the rollback and
    moves it."""
    setup = make_setup(tmp_path, migration_poll_s=0.05, migration_timeout_s=1.5, env=_env(tmp_path))
    key = add_key(setup.settings.keys_file, "ops", "events")
    pool = SPOT["gcp"]
    app = create_app(setup.settings)
    with ServerThread(app) as url:
        app.services.migrator.SWEEP_OVERLAP_S = 0.0  # (no overlap: the session's decision is not re-read)
        lv = Live(url, setup, key, app)
        s = next(iter(lv.sessions(1, "rb-int", constraints={"prefer": [{"offering_ids": [pool]}]})))
        time.sleep(0.2)
        assert lv.event({"event_id": "ev-rb-1", "kind": "rebalance", "pool": pool}).status_code == 200
        lv.wait_state(s, {"target_chosen"})
        r = lv.event({"event_id": "ev-rb-2", "kind": "interruption", "pool": pool, "deadline": _deadline(120)})
        assert r.status_code == 200 and r.json()["migrations"] == 0, r.text  # (its migration is open)
        v = lv.wait_state(s, {"target_chosen"}, within=20)
        while v["migration"]["event_id"] != "ev-rb-2":
            v = lv.wait_state(s, {"target_chosen"}, within=20)
            time.sleep(0.05)
        assert v["migration"]["target"] != pool
        with lv.db() as conn:
            states = dict(conn.execute("SELECT event_id, state FROM migrations").fetchall())
        assert states["ev-rb-1"] == "rolled_back"
        lv.c.close()


def test_a_placement_the_rules_no_longer_allow_is_migrated(tmp_path: Path) -> None:
    """A routing policy written through the admin API denies spot to tenant b: b's sessions on spot
    pools are migrated (non-terminal: the pool stays) to a target the policy allows; tenant a's
    are not touched; a later policy version that changes nothing for them moves nothing."""
    setup = make_setup(tmp_path, migration_poll_s=0.05, migration_timeout_s=30.0, env=_env(tmp_path))
    key = add_key(setup.settings.keys_file, "ops", "events")
    app = create_app(setup.settings)
    with ServerThread(app) as url:
        lv = Live(url, setup, key, app)
        B = setup.auth("b")
        a_placed = lv.sessions(3, "ra", constraints=PREFER_SPOT)
        b_placed = {}
        for i in range(4):
            d = lv.c.post("/v1/route", json={**ROUTE, "session_id": f"rb{i}", "constraints": PREFER_SPOT},
                          headers=B).json()
            b_placed[f"rb{i}"] = d["offering"]["offering_id"]
        on_spot = sorted(s for s, p in b_placed.items() if p.endswith(":spot"))
        assert on_spot and all(p.endswith(":spot") for p in a_placed.values()), (a_placed, b_placed)
        admin = setup.auth("admin")
        r = lv.c.post("/v1/admin/policies", headers=admin, json={
            "name": "b-no-spot", "effect": "deny", "target": {"tenants": ["b"]},
            "constraints": {"pricing_modes": ["spot"]}})
        assert r.status_code in (200, 201), r.text
        digest = hashlib.sha256(b"kv").hexdigest()
        for s in on_spot:
            end = time.monotonic() + 15
            while True:
                v = lv.c.get(f"/v1/sessions/{s}?tenant=b", headers=lv.E).json()
                if v["migration"] is not None and v["migration"]["state"] == "target_chosen":
                    break
                assert time.monotonic() < end, v
                time.sleep(0.05)
            m = v["migration"]
            assert m["event_id"].startswith("rules-") and m["source"] == b_placed[s]
            assert m["target"].endswith(":on_demand") and m["deadline"] is None
            assert lv.c.post(f"/v1/sessions/{s}/snapshot?tenant=b", headers=lv.E, json={
                "migration_id": m["migration_id"], "version": m["version"], "last_ack_seq": 1, "sha256": digest,
                "uri": f"s3://snap/{s}"}).status_code == 200
            ver = lv.c.post(f"/v1/sessions/{s}/verify?tenant=b", headers=lv.E, json={
                "migration_id": m["migration_id"], "target": m["target"], "sha256": digest})
            assert ver.json()["state"] == "committed", ver.text
        for s in a_placed:  # the policy targets b only
            assert lv.session(s)["migration"] is None
        # another version (a prefer for b) that leaves every placement allowed: no new migration
        before = lv.counts()[1]
        assert lv.c.post("/v1/admin/policies", headers=admin, json={
            "name": "b-prefer", "effect": "prefer", "weight": 0.01, "target": {"tenants": ["b"]}}).status_code in (200, 201)
        time.sleep(0.5)
        assert lv.counts()[1] == before
        lv.c.close()
