"""Routing policies in the router, over HTTP on real uvicorn servers: undeclared tenants fail
closed, the admin API (create, update, delete, list, audit) through the one schema, decisions that
obey the policies and say which excluded or biased what, ``POST /v1/explain``, policy files applied
at start, and a change made on one router applied -- atomically -- by another sharing its store
(SQLite, and PostgreSQL for many routers)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.app.factory import create_app
from router.control.keys import add_key
from tests.servers import ServerThread
from tests.test_router_support import ROUTE, LogCapture, RouterSetup, make_setup

SPOT = {"name": "a-no-spot", "effect": "deny", "target": {"tenants": ["a"]}, "constraints": {"pricing_modes": ["spot"]}}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RouterSetup, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("pol")
    setup = make_setup(tmp, policy_poll_s=0.2)
    extra = {"c": add_key(setup.settings.keys_file, "c")}  # a key of a tenant the router does not declare
    with ServerThread(create_app(setup.settings)) as url:
        yield url, setup, extra


@pytest.fixture(scope="module")
def client(live: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live[0], timeout=10.0) as c:
        yield c


def route(client: httpx.Client, setup: RouterSetup, who: str = "a", **body: Any) -> httpx.Response:
    return client.post("/v1/route", json={**ROUTE, **body}, headers=setup.auth(who))


def test_undeclared_tenants_fail_closed_naming_the_tenant(live: Any, client: httpx.Client) -> None:
    _, setup, extra = live
    h = {"Authorization": f"Bearer {extra['c']}"}
    for method, path, body in (("POST", "/v1/route", ROUTE), ("GET", "/v1/offerings", None),
                               ("POST", "/v1/explain", ROUTE), ("GET", "/v1/decisions/d_x", None)):
        r = client.request(method, path, headers=h, json=body)
        assert r.status_code == 403, (path, r.text)
        err = r.json()
        assert err["error"] == "unknown_tenant" and "tenant 'c' is not declared" in err["message"]
        assert err["fields"][0]["field"] == "tenant" and err["request_id"]
    # an admin key's tenant ('ops') is not declared either: it may administer, not route
    assert client.get("/v1/admin/policies", headers=setup.auth("admin")).status_code == 200
    r = route(client, setup, "admin")
    assert r.status_code == 403 and r.json()["error"] == "unknown_tenant"
    assert route(client, setup, "a").status_code == 200


def test_undeclared_tenants_may_route_when_the_setting_allows_it(tmp_path: Path) -> None:
    setup = make_setup(tmp_path, undeclared_tenants="allow")
    key = add_key(setup.settings.keys_file, "walk-in")
    with ServerThread(create_app(setup.settings)) as url:
        r = httpx.post(f"{url}/v1/route", json=ROUTE, headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200 and r.json()["tenant"] == "walk-in"


def test_admin_api_creates_updates_deletes_through_the_one_schema(live: Any, client: httpx.Client) -> None:
    _, setup, _ = live
    admin = setup.auth("admin")
    assert client.post("/v1/admin/policies", json=SPOT, headers=setup.auth("a")).status_code == 403
    r = client.post("/v1/admin/policies", json=SPOT, headers=admin)
    assert r.status_code == 201, r.text
    v0 = r.json()["set_version"]
    assert r.json()["policy"]["version"] == 1
    assert client.post("/v1/admin/policies", json=SPOT, headers=admin).status_code == 409
    got = client.get("/v1/admin/policies/a-no-spot", headers=admin).json()
    assert got["effect"] == "deny" and got["version"] == 1
    # bad input: 422 naming the field, with close matches for a value the catalog lacks
    bad = [({**SPOT, "name": "x1", "constraints": {"providers": ["awz"]}}, "body.constraints.providers[0]", "aws"),
           ({**SPOT, "name": "x2", "constraints": {"pricing_modes": ["spott"]}}, "body.constraints.pricing_modes[0]",
            "spot"),
           ({**SPOT, "name": "x3", "constraints": {"region_sets": ["eu"]}}, "body.constraints.region_sets[0]", None),
           ({**SPOT, "name": "x4", "effct": "deny"}, "body.effct", None),
           ({**SPOT, "name": "x5", "weight": 1.0}, "body", None)]
    for body, field, close in bad:
        r = client.post("/v1/admin/policies", json=body, headers=admin)
        assert r.status_code == 422, r.text
        f = r.json()["fields"][0]
        assert f["field"] == field, r.text
        assert close is None or close in f["suggestions"]
    # update with the version read: 200; with a stale one: 409; the body names no name
    upd = {k: v for k, v in SPOT.items() if k != "name"}
    r = client.put("/v1/admin/policies/a-no-spot", json={**upd, "version": 1, "priority": 5}, headers=admin)
    assert r.status_code == 200 and r.json()["policy"]["version"] == 2 and r.json()["set_version"] == v0 + 1
    r = client.put("/v1/admin/policies/a-no-spot", json={**upd, "version": 1, "priority": 6}, headers=admin)
    assert r.status_code == 409 and r.json()["error"] == "version_conflict"
    r = client.put("/v1/admin/policies/tmp", json={"effect": "prefer", "weight": 0.1}, headers=admin)
    assert r.status_code == 201 and r.json()["policy"]["name"] == "tmp"
    assert client.delete("/v1/admin/policies/tmp", headers=admin).status_code == 200
    assert client.delete("/v1/admin/policies/tmp", headers=admin).status_code == 404
    listing = client.get("/v1/admin/policies", headers=admin).json()
    assert [p["name"] for p in listing["policies"]] == ["a-no-spot"] and listing["version"] == v0 + 3
    # every change in the audit log, by the admin key's id, with before and after
    key_id = setup.keys["admin"].split("_")[1]
    entries = client.get("/v1/admin/audit", params={"kind": "policy"}, headers=admin).json()["entries"]
    assert [(e["action"], e["resource"]) for e in entries][-4:] == [
        ("create", "a-no-spot"), ("update", "a-no-spot"), ("create", "tmp"), ("delete", "tmp")]
    assert all(e["principal"] == f"key:{key_id}" for e in entries)
    assert entries[-3]["before"]["priority"] == 0 and entries[-3]["after"]["priority"] == 5
    assert client.get("/v1/admin/audit", headers=setup.auth("a")).status_code == 403
    page = client.get("/v1/admin/audit", params={"limit": 2}, headers=admin).json()
    nxt = client.get("/v1/admin/audit", params={"after": page["next_after"]}, headers=admin).json()["entries"]
    assert nxt and nxt[0]["audit_id"] > page["entries"][-1]["audit_id"]


def test_decisions_obey_the_policies_and_say_which_excluded_what(live: Any, client: httpx.Client) -> None:
    _, setup, _ = live
    admin = setup.auth("admin")
    client.put("/v1/admin/policies/a-no-spot", json={k: v for k, v in SPOT.items() if k != "name"}, headers=admin)
    spot_ids = {o["offering"]["offering_id"] for o in client.get("/v1/offerings", headers=setup.auth("a")).json()[
        "offerings"] if o["offering"]["pricing_mode"] == "spot"}
    version = client.get("/v1/admin/policies", headers=admin).json()["version"]
    for _ in range(10):
        d = route(client, setup, "a").json()
        assert d["offering"]["offering_id"] not in spot_ids
        assert all(a["offering"]["offering_id"] not in spot_ids for a in d["alternatives"])
        assert d["excluded"]["by_reason"]["policy:a-no-spot"] == len(spot_ids)
        assert d["policies"] == {"version": version, "arm": "stable", "canary": None, "request_class": None, "biased": {}}
        got = client.get(f"/v1/decisions/{d['decision_id']}", headers=setup.auth("a")).json()
        assert got["policies"] == d["policies"] and got["excluded"] == d["excluded"]  # in the decision log
    b = route(client, setup, "b").json()  # another tenant: the policy does not target it
    assert "policy:a-no-spot" not in b["excluded"]["by_reason"] and b["policies"]["version"] == version
    # a request's own constraints narrow further, never widen
    r = route(client, setup, "a", constraints={"allow": [{"pricing_modes": ["spot"]}]})
    assert r.status_code == 422 and r.json()["error"] == "no_offering"
    assert r.json()["excluded"]["request:not_allowed"] + r.json()["excluded"]["policy:a-no-spot"] == 6


def test_a_prefer_policy_biases_the_score_and_is_recorded(live: Any, client: httpx.Client) -> None:
    _, setup, _ = live
    admin = setup.auth("admin")
    base = route(client, setup, "b").json()
    target = base["alternatives"][-1]["offering"]["offering_id"]  # not greedy's choice without the bias
    unbiased = base["alternatives"][-1]["score"]
    r = client.put("/v1/admin/policies/b-prefer", json={"effect": "prefer", "weight": 5.0, "target": {"tenants": ["b"]},
                                                        "constraints": {"offering_ids": [target]}}, headers=admin)
    assert r.status_code == 201, r.text
    d = route(client, setup, "b").json()
    assert d["offering"]["offering_id"] == target and d["policies"]["biased"] == {"b-prefer": 1}
    assert d["score"] == pytest.approx(unbiased + 5.0, abs=0.2)  # its expected reward (about the same) + the weight
    client.delete("/v1/admin/policies/b-prefer", headers=admin)


def test_explain_says_why_each_offering_is_or_is_not_eligible(live: Any, client: httpx.Client) -> None:
    _, setup, _ = live
    admin = setup.auth("admin")
    client.put("/v1/admin/policies/a-no-spot", json={k: v for k, v in SPOT.items() if k != "name"}, headers=admin)
    client.put("/v1/admin/policies/ceiling", json={"effect": "deny", "constraints": {"max_usd_per_hour": 0.9}},
               headers=admin)
    try:
        e = client.post("/v1/explain", json=ROUTE, headers=setup.auth("a")).json()
        assert e["tenant"] == "a" and set(e["applied"]) == {"a-no-spot", "ceiling"}
        rows = {r["offering"]["offering_id"]: r for r in e["offerings"]}
        for oid, r in rows.items():
            if oid.endswith(":spot"):
                assert r["excluded_by"] == "policy:a-no-spot" and not r["eligible"]
            elif r["usd_per_hour"] > 0.9:
                assert r["excluded_by"] == "policy:ceiling" and r["policy"]["excluded_by"] == "ceiling"
            else:
                assert r["policy"]["allowed"]
        assert e["eligible"] == sum(r["eligible"] for r in rows.values()) > 0
        # an admin explains for another tenant; a tenant key may not
        eb = client.post("/v1/explain", params={"tenant": "b"}, json=ROUTE, headers=admin).json()
        assert eb["applied"] == ["ceiling"]
        assert client.post("/v1/explain", params={"tenant": "b"}, json=ROUTE,
                           headers=setup.auth("a")).status_code == 403
        # the same request routed lands on an offering explain called eligible
        d = route(client, setup, "a").json()
        assert rows[d["offering"]["offering_id"]]["policy"]["allowed"]
    finally:
        client.delete("/v1/admin/policies/ceiling", headers=admin)


def test_policy_files_are_applied_at_start_and_a_bad_one_stops_the_start(tmp_path: Path) -> None:
    pol = tmp_path / "policies"
    pol.mkdir()
    (pol / "p.yaml").write_text("policies:\n  - {name: no-spot, effect: deny, constraints: {pricing_modes: [spot]}}\n")
    setup = make_setup(tmp_path / "r", policy_files=[pol])
    with ServerThread(create_app(setup.settings)) as url:
        d = httpx.post(f"{url}/v1/route", json=ROUTE, headers=setup.auth("a"), timeout=10).json()
        assert d["policies"]["version"] == 1 and "policy:no-spot" in d["excluded"]["by_reason"]
        audit = httpx.get(f"{url}/v1/admin/audit", headers=setup.auth("admin"), timeout=10).json()["entries"]
        assert {(e["action"], e["resource"]) for e in audit} >= {("create", "no-spot"), ("apply", str(pol))}
        assert all(e["principal"] == f"config:{pol}" for e in audit)
    # the same files again: nothing new; the store keeps what the API made
    with ServerThread(create_app(setup.settings)) as url:
        d = httpx.post(f"{url}/v1/route", json=ROUTE, headers=setup.auth("a"), timeout=10).json()
        assert d["policies"]["version"] == 1
    # a bad file: `xroute serve` refuses to start, one line naming the file and the field
    (pol / "p.yaml").write_text("policies:\n  - {name: x, effect: deny, constraints: {providers: [awz]}}\n")
    cfg = tmp_path / "router.yaml"
    cfg.write_text(json.dumps({"tenants": {"a": {}}, "policy_files": [str(pol)], "env": setup.settings.env,
                               "telemetry": str(setup.settings.telemetry), "model_uri": ""}))
    r = subprocess.run([sys.executable, "-m", "xroute_app", "serve", "--config", str(cfg), "--db",
                        str(tmp_path / "r" / "decisions.db"), "--port", "1"], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "field 'policy_files.policies[0].constraints.providers[0]': unknown provider 'awz'" in r.stderr
    assert "Traceback" not in r.stderr


def _watch_versions(url: str, setup: RouterSetup, stop: threading.Event, seen: list[tuple[int, dict[str, int], str]]
                    ) -> None:
    with httpx.Client(base_url=url, timeout=10) as c:
        while not stop.is_set():
            r = c.post("/v1/route", json=ROUTE, headers=setup.auth("a"))
            if r.status_code == 200:
                d = r.json()
                seen.append((d["policies"]["version"], d["excluded"]["by_reason"], d["offering"]["offering_id"]))


def _changes_apply_atomically_on_the_other_router(urls: list[str], setup: RouterSetup) -> None:
    """Router A changes the policies several times while router B routes without pause: B's
    answers move to each new version within about a policy poll, and every answer is decided by
    exactly the set of the version it names -- never a mix of two."""
    a, b = urls
    admin = setup.auth("admin")
    stop = threading.Event()
    seen: list[tuple[int, dict[str, int], str]] = []
    watcher = threading.Thread(target=_watch_versions, args=(b, setup, stop, seen))
    watcher.start()
    sets: dict[int, set[str]] = {}
    try:
        with httpx.Client(base_url=a, timeout=10) as c:
            sets[c.get("/v1/admin/policies", headers=admin).json()["version"]] = set()
            names: set[str] = set()
            for op, name, body in ([
                    ("put", "no-spot", {"effect": "deny", "constraints": {"pricing_modes": ["spot"]}}),
                    ("put", "no-t4", {"effect": "deny", "constraints": {"accelerators": ["T4"]}}),
                    ("delete", "no-spot", None),
                    ("put", "no-gcp", {"effect": "deny", "constraints": {"providers": ["gcp"]}}),
                    ("delete", "no-t4", None)]):
                r = (c.put(f"/v1/admin/policies/{name}", json=body, headers=admin) if op == "put"
                     else c.delete(f"/v1/admin/policies/{name}", headers=admin))
                assert r.status_code in (200, 201), r.text
                names = names | {name} if op == "put" else names - {name}
                sets[r.json()["set_version"]] = set(names)
                deadline = time.monotonic() + 5.0
                v = r.json()["set_version"]
                while time.monotonic() < deadline and not any(x[0] == v for x in seen):
                    time.sleep(0.05)
                assert any(x[0] == v for x in seen), f"router B never decided with version {v}"
    finally:
        stop.set()
        watcher.join(30)
    assert len(seen) > 20
    versions = [x[0] for x in seen]
    assert versions == sorted(versions)  # B never goes back to an older set
    for version, by_reason, offering in seen:
        names = sets[version]
        assert {k[len("policy:"):] for k in by_reason if k.startswith("policy:")} == names, (version, by_reason)
        assert not ("no-spot" in names and offering.endswith(":spot"))
        assert not ("no-gcp" in names and offering.startswith("gcp:"))


def test_a_change_on_one_router_is_applied_atomically_by_another_sharing_its_sqlite_store(tmp_path: Path) -> None:
    setup = make_setup(tmp_path, policy_poll_s=0.2)
    servers = [ServerThread(create_app(setup.settings)) for _ in range(2)]
    urls = [s.__enter__() for s in servers]
    try:
        _changes_apply_atomically_on_the_other_router(urls, setup)
    finally:
        for s in servers:
            s.__exit__(None, None, None)


@pytest.mark.slow
def test_routers_on_one_postgres_database_share_the_policies(postgres: Any, tmp_path: Path) -> None:
    url = postgres.create_database("policies_routers")
    setup = make_setup(tmp_path, db_url=url, policy_poll_s=0.2)
    logs = LogCapture().attach()
    servers = [ServerThread(create_app(setup.settings)) for _ in range(2)]
    try:
        urls = [s.__enter__() for s in servers]
        _changes_apply_atomically_on_the_other_router(urls, setup)
        assert not any(postgres.password in line for line in logs.lines)
    finally:
        for s in servers:
            s.__exit__(None, None, None)
        logs.detach()
