"""Policy rollouts by canary (``docs/policies.md``, "Canary rollouts"), over HTTP on real uvicorn
servers: two routers on one PostgreSQL database (decision log and policy store) and one Redis
(shared state). A canary started on one router decides the same share of keys on both, the same
key in the same arm; its arms compared from the log match what the routers answered; promoting and
rolling back are versions of the store, audited, applied by both; bad input is a 4xx naming the
field and changes nothing; an auditor reads and cannot write. The arm's hash: stable, monotone in
the share, and near the share over many keys (Hypothesis)."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.app.factory import create_app
from router.control.keys import add_key
from router.decision.canary import CanaryArms, bucket, in_canary
from tests.servers import ServerThread
from tests.test_router_support import ROUTE, RouterSetup, make_setup
from xroute.schema.policy_ir import Canary, PolicySet

NO_SPOT = {"name": "no-spot", "effect": "deny", "constraints": {"pricing_modes": ["spot"]}}
SPOT_ONLY = {"allow": [{"pricing_modes": ["spot"]}]}  # a request only spot offerings may take
_prefixes = itertools.count()


# ------------------------------------------------------------------------------------ the arm's hash
def test_the_arm_is_blake2b_of_id_and_key_read_big_endian() -> None:
    want = int.from_bytes(hashlib.blake2b(b"canary-7\x00acme", digest_size=8).digest(), "big")
    assert bucket("canary-7", "acme") == want
    assert in_canary("canary-7", "acme", 100.0)


@settings(max_examples=60, deadline=None)
@given(cid=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
       keys=st.lists(st.text(min_size=0, max_size=40), min_size=1, max_size=50),
       low=st.floats(0.01, 100.0), high=st.floats(0.01, 100.0))
def test_the_arm_is_deterministic_and_monotone_in_the_share(cid: str, keys: list[str], low: float, high: float) -> None:
    low, high = min(low, high), max(low, high)
    arms = CanaryArms(Canary(id=cid, key="session", share=low, policy_set=PolicySet(version=1), version=1,
                             base_version=0, started_at=0.0, principal="t"),
                      _compiled_empty(), 1)
    for k in keys:
        assert arms.choose(k) == in_canary(cid, k, low) == in_canary(cid, k, low)
        if in_canary(cid, k, low):  # a key in the canary stays in it at a higher share
            assert in_canary(cid, k, high)


@settings(max_examples=15, deadline=None)
@given(cid=st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True), share=st.sampled_from([1.0, 5.0, 30.0, 50.0, 90.0]))
def test_the_share_of_many_keys_in_the_canary_is_near_the_share(cid: str, share: float) -> None:
    n = 20_000
    got = sum(in_canary(cid, f"session-{i}", share) for i in range(n)) / n
    sd = (share / 100 * (1 - share / 100) / n) ** 0.5
    assert abs(got - share / 100) < 5 * sd + 1e-9, (got, share)


def _compiled_empty() -> Any:
    from envs import policies as env_policies

    return env_policies.CompiledPolicies(PolicySet(), [])


# ------------------------------------------------------------------------------------ two routers
@pytest.fixture(scope="module")
def pair(postgres: Any, redis_server: Any, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[list[str], RouterSetup, str]]:
    tmp = tmp_path_factory.mktemp("canary")
    url = postgres.create_database("canary_routers")
    setup = make_setup(tmp, db_url=url, policy_poll_s=0.2, state_backend="redis", state_url=redis_server.url,
                       state_hold_floor_s=0.0, state_hold_max_s=0.5,  # (no pool stays full of unanswered holds)
                       state_prefix=f"canary{next(_prefixes)}{time.time_ns()}")
    auditor = add_key(setup.settings.keys_file, "ops", "auditor")
    servers = [ServerThread(create_app(setup.settings)) for _ in range(2)]
    try:
        urls = [s.__enter__() for s in servers]
        with httpx.Client(base_url=urls[0], timeout=10) as c:
            r = c.put("/v1/admin/roles/auditor", json={"grants": ["admin:read:*"]}, headers=setup.auth("admin"))
            assert r.status_code in (200, 201), r.text
        yield urls, setup, auditor
    finally:
        for s in servers:
            s.__exit__(None, None, None)


def _wait(check: Any, within_s: float = 10.0) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def _canary_on(url: str, setup: RouterSetup) -> dict[str, Any] | None:
    return httpx.get(f"{url}/v1/admin/canary", headers=setup.auth("admin"), timeout=10).json()["canary"]  # type: ignore[no-any-return]


def _version(url: str, setup: RouterSetup) -> int:
    return int(httpx.get(f"{url}/v1/admin/policies", headers=setup.auth("admin"), timeout=10).json()["version"])


def _no_canary(urls: list[str], setup: RouterSetup) -> None:
    """Each test starts with no canary running, on both routers."""
    if _canary_on(urls[0], setup) is not None:
        assert httpx.post(f"{urls[0]}/v1/admin/canary/rollback", headers=setup.auth("admin")).status_code == 200
    v = _version(urls[0], setup)
    assert _wait(lambda: _version(urls[1], setup) == v)


def _route(c: httpx.Client, setup: RouterSetup, **body: Any) -> httpx.Response:
    return c.post("/v1/route", json={**ROUTE, **body}, headers=setup.auth("a"))


@pytest.mark.slow
def test_a_canary_by_session_decides_the_same_keys_on_both_routers_and_compares_as_logged(pair: Any) -> None:
    urls, setup, _ = pair
    _no_canary(urls, setup)
    admin = setup.auth("admin")
    a, b = (httpx.Client(base_url=u, timeout=20) for u in urls)
    with a, b:
        r = a.post("/v1/admin/canary", json={"key": "session", "share": 30, "put": [NO_SPOT], "id": "no-spot-30"},
                   headers=admin)
        assert r.status_code == 201, r.text
        started = r.json()
        c = started["canary"]
        assert c["id"] == "no-spot-30" and c["key"] == "session" and c["share"] == 30
        assert c["diff"] == {"added": ["no-spot"], "changed": [], "removed": [], "sections": []}
        assert c["version"] == started["set_version"] and c["principal"].startswith("key:")
        assert _wait(lambda: (_canary_on(urls[1], setup) or {}).get("id") == "no-spot-30")  # B applied it
        arms: dict[str, str] = {}
        counts = {"stable": 0, "canary": 0}
        no_spot = 0
        for i in range(240):
            sid = f"sess-{i}"
            first, second = (a, b) if i % 2 else (b, a)
            d1, d2 = _route(first, setup, session_id=sid).json(), _route(second, setup, session_id=sid).json()
            assert d1["policies"]["arm"] == d2["policies"]["arm"], sid  # the same key, the same arm, on either
            arm = arms[sid] = d1["policies"]["arm"]
            for d in (d1, d2):
                assert d["policies"]["version"] == started["set_version"]
                assert d["policies"]["canary"] == {"id": "no-spot-30", "version": c["version"], "key": "session",
                                                   "share": 30.0}
                counts[arm] += 1
                if arm == "canary":
                    assert not d["offering"]["offering_id"].endswith(":spot")
                    no_spot += d["excluded"]["by_reason"]["policy:no-spot"]
                else:
                    assert "policy:no-spot" not in d["excluded"]["by_reason"]
        share = sum(v == "canary" for v in arms.values()) / len(arms)
        assert 0.18 < share < 0.42, share  # 240 keys: 30 % +- 4 standard deviations
        # the decision log holds the arm (a decision read back says it, as answered)
        last = _route(a, setup, session_id="sess-1").json()
        counts[last["policies"]["arm"]] += 1
        no_spot += last["excluded"]["by_reason"].get("policy:no-spot", 0)
        assert a.get(f"/v1/decisions/{last['decision_id']}", headers=setup.auth("a")).json()["policies"] == \
            last["policies"]
        # refusals: a request only spot offerings may take is refused in the canary arm, placed in the stable one
        denied = 0
        for i in range(40):
            r = _route(b, setup, session_id=f"sess-{i}", constraints=SPOT_ONLY)
            if arms[f"sess-{i}"] == "canary":
                assert r.status_code == 422 and r.json()["error"] == "no_offering", r.text
                denied += 1
            else:  # (placed, or its spot pools full in the shared state: 429 after the stages, not a refusal of theirs)
                assert r.status_code == 200 or r.json()["error"] == "no_capacity", r.text
                counts["stable"] += r.status_code == 200
        # feedback on a few decisions of each arm: the SLO verdicts and observed costs come from it
        fed = {"stable": 0, "canary": 0}
        for i in range(30):
            r = _route(a, setup, session_id=f"sess-{i}")
            if r.status_code != 200:  # (every pool full in the shared state)
                assert r.json()["error"] == "no_capacity", r.text
                continue
            d = r.json()
            counts[d["policies"]["arm"]] += 1
            no_spot += d["excluded"]["by_reason"].get("policy:no-spot", 0)
            f = a.post("/v1/feedback", json={"decision_id": d["decision_id"], "latency_ms": 900.0, "ttft_ms": 200.0,
                                             "output_tokens": 40, "cost_usd": 0.001}, headers=setup.auth("a"))
            assert f.status_code == 201, f.text
            fed[d["policies"]["arm"]] += 1

        def compared(url: str) -> dict[str, Any] | None:
            got = httpx.get(f"{url}/v1/admin/canary/compare", headers=admin, timeout=20).json()
            ok = (got["arms"]["canary"]["excluded"]["by_reason"].get("policy:no-spot") == no_spot
                  and got["arms"]["canary"]["denied"]["total"] == denied)
            return got if ok else None

        for url in urls:  # either router: the same log, the same tallies (each router's within its poll)
            got = _wait(lambda u=url: compared(u))  # type: ignore[misc]
            assert got is not None, (no_spot, denied, httpx.get(f"{url}/v1/admin/canary/compare", headers=admin).json())
            assert got["id"] == "no-spot-30" and got["running"] is True
            for arm in ("stable", "canary"):
                x = got["arms"][arm]
                assert x["decisions"] == counts[arm], (arm, x, counts)
                assert x["complete"] is True and x["feedback"] == fed[arm]
                assert x["slo"]["judged"] == fed[arm] and x["cost"]["observed_requests"] == fed[arm]
                assert x["cost"]["observed_usd_per_request"] == pytest.approx(0.001) if fed[arm] else True
                assert x["cost"]["expected_usd_per_request"] > 0
            assert got["arms"]["canary"]["denied"]["by_error"] == {"no_offering": denied}
            assert got["arms"]["stable"]["denied"]["total"] == 0
            assert "policy:no-spot" not in got["arms"]["stable"]["excluded"]["by_reason"]
            assert got["delta"]["denied_share"] is not None and got["delta"]["denied_share"] > 0
        # a window smaller than an arm: bounded, and says it is not the whole arm
        small = a.get("/v1/admin/canary/compare?window=5", headers=admin).json()
        assert small["arms"]["stable"]["decisions"] == 5 and small["arms"]["stable"]["complete"] is False


@pytest.mark.slow
def test_share_promote_and_rollback_are_versions_audited_and_applied_on_both_routers(pair: Any) -> None:
    urls, setup, _ = pair
    _no_canary(urls, setup)
    admin = setup.auth("admin")
    a, b = (httpx.Client(base_url=u, timeout=20) for u in urls)
    with a, b:
        assert a.get("/v1/admin/policies/no-spot", headers=admin).status_code == 404  # (stable: none yet)
        v0 = _version(urls[0], setup)
        r = a.post("/v1/admin/canary", json={"key": "session", "share": 20, "put": [NO_SPOT], "id": "grow"},
                   headers=admin)
        assert r.status_code == 201 and r.json()["set_version"] == v0 + 1
        in_at_20 = [f"k{i}" for i in range(200) if in_canary("grow", f"k{i}", 20)]
        # the share grows on B; A applies it within its poll; a key in the canary at 20 % stays in it at 60 %
        r = b.patch("/v1/admin/canary", json={"share": 60}, headers=admin)
        assert r.status_code == 200 and r.json()["set_version"] == v0 + 2 and r.json()["canary"]["share"] == 60
        assert _wait(lambda: (_canary_on(urls[0], setup) or {}).get("share") == 60)
        for k in in_at_20[:20]:
            assert _route(a, setup, session_id=k).json()["policies"]["arm"] == "canary"
        assert b.patch("/v1/admin/canary", json={"share": 60}, headers=admin).json()["set_version"] == v0 + 2
        # promote on A, inside a caller's trace: a new version, the canary's set stable on both routers
        trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        r = a.post("/v1/admin/canary/promote", json={"id": "grow"},
                   headers={**admin, "traceparent": f"00-{trace}-00f067aa0ba902b7-01"})
        assert r.status_code == 200, r.text
        assert r.json() == {"set_version": v0 + 3, "canary": None, "promoted": "grow"}
        assert _wait(lambda: _version(urls[1], setup) == v0 + 3)
        for c in (a, b):
            ps = c.get("/v1/admin/policies", headers=admin).json()
            assert "canary" not in ps and [p["name"] for p in ps["policies"]] == ["no-spot"]
            d = _route(c, setup, session_id="anyone").json()
            assert d["policies"]["arm"] == "stable" and d["policies"]["canary"] is None
            assert d["excluded"]["by_reason"]["policy:no-spot"] > 0
        audit = b.get("/v1/admin/audit?kind=canary&resource=grow", headers=admin).json()["entries"]
        assert [(e["action"], e["version"]) for e in audit] == [("start", v0 + 1), ("share", v0 + 2),
                                                               ("promote", v0 + 3)]
        assert all(e["principal"].startswith("key:") for e in audit)
        assert audit[-1]["trace_id"] == trace and audit[1]["before"] == {"share": 20.0}
        created = b.get("/v1/admin/audit?kind=policy&resource=no-spot", headers=admin).json()["entries"]
        assert created[-1]["action"] == "create" and created[-1]["version"] == v0 + 3
        # a canary by tenant, rolled back: the stable set is as it was, a version later, on both routers
        r = b.post("/v1/admin/canary", json={"key": "tenant", "share": 50, "delete": ["no-spot"]}, headers=admin)
        assert r.status_code == 201, r.text
        cid = r.json()["canary"]["id"]
        assert cid == f"canary-{v0 + 4}" and r.json()["canary"]["diff"]["removed"] == ["no-spot"]
        assert _wait(lambda: (_canary_on(urls[0], setup) or {}).get("id") == cid)
        for tenant in ("a", "b"):
            want = "canary" if in_canary(cid, tenant, 50) else "stable"
            for c in (a, b):
                ex = c.post("/v1/explain", json=ROUTE, headers=setup.auth(tenant)).json()
                assert ex["arm"] == want and ex["canary"]["id"] == cid
                d = c.post("/v1/route", json=ROUTE, headers=setup.auth(tenant)).json()
                assert d["policies"]["arm"] == want
                assert ("policy:no-spot" in d["excluded"]["by_reason"]) == (want == "stable")
        r = a.post("/v1/admin/canary/rollback", headers=admin)
        assert r.status_code == 200 and r.json() == {"set_version": v0 + 5, "canary": None, "rolled_back": cid}
        assert _wait(lambda: _version(urls[1], setup) == v0 + 5)
        for c in (a, b):
            assert [p["name"] for p in c.get("/v1/admin/policies", headers=admin).json()["policies"]] == ["no-spot"]
            for tenant in ("a", "b"):
                d = c.post("/v1/route", json=ROUTE, headers=setup.auth(tenant)).json()
                assert d["policies"]["arm"] == "stable" and "policy:no-spot" in d["excluded"]["by_reason"]
        entries = a.get(f"/v1/admin/audit?kind=canary&resource={cid}", headers=admin).json()["entries"]
        assert [e["action"] for e in entries] == ["start", "rollback"]
        # an ended canary can still be compared by its id (its decisions: ours, and any the migrator made for the
        # sessions the promotion's no-spot moved off spot -- decisions of their arm too)
        ended = a.get(f"/v1/admin/canary/compare?id={cid}", headers=admin).json()
        assert ended["running"] is False, ended
        assert ended["arms"]["stable"]["decisions"] + ended["arms"]["canary"]["decisions"] >= 4, ended
        # leave no policy behind for the other tests
        assert a.delete("/v1/admin/policies/no-spot", headers=admin).status_code == 200


@pytest.mark.slow
def test_bad_input_is_a_4xx_naming_the_field_and_changes_nothing(pair: Any) -> None:
    urls, setup, auditor = pair
    _no_canary(urls, setup)
    admin = setup.auth("admin")
    with httpx.Client(base_url=urls[0], timeout=20) as a:
        v0 = _version(urls[0], setup)
        for path in ("/v1/admin/canary/promote", "/v1/admin/canary/rollback"):
            r = a.post(path, headers=admin)
            assert r.status_code == 409 and r.json()["error"] == "no_canary", r.text
        r = a.patch("/v1/admin/canary", json={"share": 10}, headers=admin)
        assert r.status_code == 409 and r.json()["error"] == "no_canary"
        r = a.get("/v1/admin/canary/compare", headers=admin)
        assert r.status_code == 409 and r.json()["fields"][0]["field"] == "query.id"
        base = {"key": "session", "share": 30, "put": [NO_SPOT]}
        for body, field in (({**base, "share": 0}, "body.share"), ({**base, "share": 100.5}, "body.share"),
                            ({**base, "share": -3}, "body.share"), ({**base, "share": "half"}, "body.share"),
                            ({**base, "key": "user"}, "body.key"), ({"share": 30, "put": [NO_SPOT]}, "body.key"),
                            ({**base, "id": "bad id!"}, "body.id"), ({**base, "extra": 1}, "body.extra"),
                            ({**base, "put": [{**NO_SPOT, "constraints": {"providers": ["awz"]}}]},
                             "body.put[0].constraints.providers[0]"),
                            ({**base, "put": [{**NO_SPOT, "effect": "block"}]}, "body.put[0].effect"),
                            ({**base, "put": [], "delete": ["nope"]}, "body.delete[0]"),
                            ({**base, "put": []}, "body")):
            r = a.post("/v1/admin/canary", json=body, headers=admin)
            assert r.status_code == 422, (body, r.text)
            assert field in [f["field"] for f in r.json()["fields"]], (body, r.json())
        assert r.json()["error"] == "invalid_policy"  # (the draft's errors: the policy writes' shape)
        assert _version(urls[0], setup) == v0 and _canary_on(urls[0], setup) is None  # nothing was applied
        # one running: a second start names it; plain writes wait; a wrong id is refused -- nothing changes
        r = a.post("/v1/admin/canary", json={**base, "id": "first"}, headers=admin)
        assert r.status_code == 201
        v1 = r.json()["set_version"]
        r = a.post("/v1/admin/canary", json={**base, "id": "second"}, headers=admin)
        assert r.status_code == 409 and r.json()["error"] == "canary_running" and "'first'" in r.json()["message"]
        r = a.put("/v1/admin/policies/x", json={"effect": "deny", "constraints": {"providers": ["gcp"]}},
                  headers=admin)
        assert r.status_code == 409 and r.json()["error"] == "canary_running"
        for call in (lambda: a.post("/v1/admin/canary/promote", json={"id": "second"}, headers=admin),
                     lambda: a.post("/v1/admin/canary/rollback", json={"id": "second"}, headers=admin),
                     lambda: a.patch("/v1/admin/canary", json={"share": 50, "id": "second"}, headers=admin)):
            r = call()
            assert r.status_code == 409 and r.json()["error"] == "canary_conflict", r.text
        for body in ({"share": 0}, {"share": 101}, {"share": 5, "extra": True}):
            r = a.patch("/v1/admin/canary", json=body, headers=admin)
            assert r.status_code == 422 and r.json()["fields"][0]["field"].startswith("body."), r.text
        # an auditor reads the canary and its comparison, and changes nothing
        aud = {"Authorization": f"Bearer {auditor}"}
        assert a.get("/v1/admin/canary", headers=aud).json()["canary"]["id"] == "first"
        assert a.get("/v1/admin/canary/compare", headers=aud).status_code == 200
        for method, path, body in (("POST", "/v1/admin/canary", {**base, "id": "aud"}),
                                   ("PATCH", "/v1/admin/canary", {"share": 90}),
                                   ("POST", "/v1/admin/canary/promote", None),
                                   ("POST", "/v1/admin/canary/rollback", None)):
            r = a.request(method, path, json=body, headers=aud)
            assert r.status_code == 403 and r.json()["missing_permission"] == "admin:write:policies", r.text
        assert _version(urls[0], setup) == v1 and _canary_on(urls[0], setup)["share"] == 30  # type: ignore[index]
        assert a.post("/v1/admin/canary/rollback", json={"id": "first"}, headers=admin).status_code == 200


def test_a_canary_by_request_id_on_a_sqlite_log(tmp_path: Any) -> None:
    """One router on the embedded SQLite log and state: the arm follows the request's X-Request-ID (a
    retry with the same id gets the same arm); the router's counts written at shutdown and the log's
    arm column are what the comparison reads after a restart; rolling back leaves no canary."""
    setup = make_setup(tmp_path, policy_poll_s=60.0)  # (no poll flushes the counts: the shutdown must)
    admin = setup.auth("admin")
    counts = {"stable": 0, "canary": 0}
    no_spot = 0
    with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=20) as c:
        r = c.post("/v1/admin/canary", json={"key": "request", "share": 50, "put": [NO_SPOT]}, headers=admin)
        assert r.status_code == 201, r.text
        cid = r.json()["canary"]["id"]
        for i in range(40):
            rid = f"req-{i:04d}"
            arms = set()
            for _ in range(2):  # (a retry under the same request id)
                d = c.post("/v1/route", json=ROUTE, headers={**setup.auth("a"), "X-Request-ID": rid})
                assert d.status_code == 200 and d.headers["x-request-id"] == rid, d.text
                arm = d.json()["policies"]["arm"]
                arms.add(arm)
                counts[arm] += 1
                no_spot += d.json()["excluded"]["by_reason"].get("policy:no-spot", 0)
            assert arms == {"canary" if in_canary(cid, rid, 50) else "stable"}
    assert min(counts.values()) > 0 and no_spot > 0
    with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=20) as c:
        got = c.get("/v1/admin/canary/compare", headers=admin).json()
        assert {arm: got["arms"][arm]["decisions"] for arm in counts} == counts
        assert got["arms"]["canary"]["excluded"]["by_reason"] == {"policy:no-spot": no_spot}
        assert c.post("/v1/admin/canary/rollback", headers=admin).json()["canary"] is None
        d = c.post("/v1/route", json=ROUTE, headers=setup.auth("a")).json()
        assert d["policies"]["arm"] == "stable" and d["policies"]["canary"] is None
