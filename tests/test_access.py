"""Access control and the access store, over HTTP on real uvicorn servers: roles over resource ids
(the permission matcher, checked against an independent reference on random cases), the built-in
roles, a read-only auditor, regions masked for inference, denials as 403 naming the permission and
logged with the trace id; tenants, quotas, roles and bindings changed through the admin API --
versioned, audited, applied without a restart on every router sharing the store (SQLite, and
PostgreSQL); and the policy dry run over the decision log."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.app.factory import create_app
from router.control.keys import add_key
from tests.servers import ServerThread
from tests.test_router_support import ROUTE, LogCapture, RouterSetup, make_setup
from xroute.schema.access import ADMIN_KINDS, PermissionError_, Role, check_permission, compile_grant

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


# ---------------------------------------------------------------------------------------- the matcher
def _seg_regex(seg: str) -> str:
    """An fnmatch segment as a regex that never crosses ':' (written apart from the matcher)."""
    out, i = "", 0
    while i < len(seg):
        c = seg[i]
        if c == "*":
            out += "[^:]*"
        elif c == "?":
            out += "[^:]"
        elif c == "[":
            j = seg.find("]", i + 2)
            if j < 0:
                out += re.escape(c)
            else:
                body = seg[i + 1:j]
                out += "[" + ("^" + re.escape(body[1:]) if body.startswith("!") else re.escape(body)) + "]"
                i = j
        else:
            out += re.escape(c)
        i += 1
    return out


def reference(pattern: str, resource: str, location: str | None = None) -> bool:
    """The grammar of ``xroute.schema.access`` as regular expressions."""
    if pattern == "*":
        return True
    model = pattern.startswith("model:")
    segs = pattern.split(":", 3) if model else pattern.split(":")
    if segs[-1] == "*":
        rx = ":".join(_seg_regex(s) for s in segs[:-1]) + "(:.*)?"
        return re.fullmatch(rx, resource) is not None or (len(segs) == 1)
    if model and len(segs) == 4:
        head = ":".join(_seg_regex(s) for s in segs[:3])
        region = segs[3].replace("*", "\0")  # the region segment may be a location id: '*' inside it is free
        region_rx = re.escape(region).replace("\0", ".*").replace(r"\?", ".")
        res = resource.split(":", 3)
        if re.fullmatch(head, ":".join(res[:3])) is None or len(res) != 4:
            return False
        return (re.fullmatch(region_rx, res[3]) is not None
                or (location is not None and re.fullmatch(region_rx, location) is not None))
    return re.fullmatch(":".join(_seg_regex(s) for s in segs), resource) is not None


WORDS = st.sampled_from(["llama3-8b", "llama3-70b", "mistral-7b", "eu-west-1", "us-east-1", "europe-west4", "a", "b"])
MODEL_PAT = st.sampled_from(["*", "llama3-*", "llama3-8b", "mistral-?b", "*-7b", "[lm]*", "nope"])
REGION_PAT = st.sampled_from(["*", "eu-*", "us-*", "europe-*", "aws:eu-*", "gcp:*", "eu-west-1", "*-1", "?s-east-1"])


@settings(max_examples=400, deadline=None)
@given(model=WORDS, region=st.sampled_from(["eu-west-1", "us-east-1", "europe-west4", "japaneast"]),
       provider=st.sampled_from(["aws", "gcp", "azure"]), mp=MODEL_PAT, rp=REGION_PAT,
       tail=st.booleans())
def test_model_permissions_match_the_reference_grammar(model: str, region: str, provider: str, mp: str, rp: str,
                                                        tail: bool) -> None:
    pattern = f"model:inference:{mp}:*" if tail else f"model:inference:{mp}:{rp}"
    check_permission(pattern)
    resource = f"model:inference:{model}:{region}"
    location = f"{provider}:{region}"
    assert compile_grant(pattern).matches(resource, location) == reference(pattern, resource, location), pattern


@settings(max_examples=300, deadline=None)
@given(verb=st.sampled_from(["read", "write"]), kind=st.sampled_from(ADMIN_KINDS),
       pattern=st.sampled_from(["*", "admin:*", "admin:read:*", "admin:write:*", "admin:*:policies", "admin:read:audit",
                                "admin:r*:*", "admin:*:[pq]*", "model:*", "model:inference:*"]))
def test_admin_permissions_match_the_reference_grammar(verb: str, kind: str, pattern: str) -> None:
    check_permission(pattern)
    resource = f"admin:{verb}:{kind}"
    assert compile_grant(pattern).matches(resource) == reference(pattern, resource), (pattern, resource)


REFS = [{"region": reg, "location": f"{prov}:{reg}"} for prov, reg in (
    ("aws", "eu-west-1"), ("aws", "us-east-1"), ("gcp", "europe-west4"), ("gcp", "us-east-1"), ("azure", "japaneast"),
    ("azure", "westeurope"))]


@settings(max_examples=200, deadline=None)
@given(grants=st.lists(st.tuples(MODEL_PAT, REGION_PAT, st.booleans()), max_size=4),
       model=st.sampled_from(["llama3-8b", "mistral-7b", "other"]), role=st.sampled_from(["tenant", "custom", "admin"]))
def test_a_callers_offering_mask_is_the_union_of_its_grants(grants: list[tuple[str, str, bool]], model: str,
                                                           role: str) -> None:
    from router.decision.access import AccessControl
    from xroute.schema.access import Principal

    patterns = [f"model:inference:{m}:*" if tail else f"model:inference:{m}:{r}" for m, r, tail in grants]
    acc = AccessControl({"custom": Role(grants=patterns)}, {}, REFS)
    who = Principal("t", role, "0000abcd")
    mask = acc.inference_mask(who, model)
    own = {"tenant": ["model:inference:*"], "admin": ["*"], "custom": patterns}[role]
    want = [any(reference(p, f"model:inference:{model}:{o['region']}", o["location"]) for p in own) for o in REFS]
    got = [True] * len(REFS) if mask is None else mask.tolist()
    assert got == want, (own, model)
    assert acc.permissions(who).can_infer == (role != "custom" or bool(patterns))


def test_the_wildcards_never_cross_a_segment() -> None:
    g = compile_grant("model:inference:llama3-*:eu-*")
    assert g.matches("model:inference:llama3-8b:eu-west-1")
    assert not g.matches("model:inference:llama3-8b:us-east-1")
    assert not g.matches("model:inference:mistral:eu-west-1")
    # a '*' in the model segment does not swallow the region
    assert not compile_grant("model:inference:*").matches("admin:read:policies")
    assert not compile_grant("admin:read:*").matches("admin:write:policies")
    assert compile_grant("model:inference:*:aws:*").matches("model:inference:m:eu-west-1", "aws:eu-west-1")
    assert not compile_grant("model:inference:*:aws:*").matches("model:inference:m:eu-west-1", "gcp:eu-west-1")
    assert compile_grant("*").matches("admin:write:roles")


@pytest.mark.parametrize("bad, says", [
    ("modle:inference:*", "unknown family 'modle'"), ("model:infer:*", "unknown action 'infer'"),
    ("admin:delete:*", "unknown verb 'delete'"), ("admin:read:polices", "unknown kind 'polices'"),
    ("admin:read", "end it with a '*' segment"), ("admin:read:policies:x", "3 segments"),
    ("model::x:*", "empty segment"), ("model:inference:a b:*", "without spaces")])
def test_bad_permissions_are_named(bad: str, says: str) -> None:
    with pytest.raises(PermissionError_) as e:
        check_permission(bad)
    assert says in e.value.problem
    if " " not in bad:
        with pytest.raises(PermissionError_, match="grants\\[1\\]"):
            Role(grants=["*", bad]).check()


# ---------------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RouterSetup, dict[str, str], LogCapture]]:
    tmp = tmp_path_factory.mktemp("access")
    setup = make_setup(tmp, policy_poll_s=0.2)
    kf = setup.settings.keys_file
    extra = {"c": add_key(kf, "c"), "auditor": add_key(kf, "ops", "auditor"), "b2": add_key(kf, "b")}
    logs = LogCapture()
    try:
        with ServerThread(create_app(setup.settings)) as url:
            logs.attach()  # (after the app configured its logging)
            yield url, setup, extra, logs
    finally:
        logs.detach()


@pytest.fixture(scope="module")
def client(live: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live[0], timeout=10.0) as c:
        yield c


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_id(key: str) -> str:
    return key.split("_")[1]


def test_an_auditor_reads_everything_and_changes_nothing(live: Any, client: httpx.Client) -> None:
    _, setup, extra, logs = live
    admin, aud = setup.auth("admin"), bearer(extra["auditor"])
    # before the role exists the key's role grants nothing, and its tenant ('ops') is not served: refused
    r = client.get("/v1/admin/policies", headers=aud)
    assert r.status_code == 403 and r.json()["error"] == "unknown_tenant", r.text
    r = client.put("/v1/admin/roles/auditor", json={"description": "reads, never writes", "grants": ["admin:read:*"]},
                   headers=admin)
    assert r.status_code == 201 and r.json()["role"]["version"] == 1, r.text
    for path in ("/v1/admin/policies", "/v1/admin/audit", "/v1/admin/tenants", "/v1/admin/roles", "/v1/admin/bindings",
                 "/v1/admin/quotas", "/v1/admin/status"):
        assert client.get(path, headers=aud).status_code == 200, path
    who = client.get("/v1/whoami", headers=aud).json()
    assert who["roles"] == ["auditor"] and who["grants"] == ["admin:read:*"]
    writes = [("PUT", "/v1/admin/policies/x", {"effect": "deny"}, "admin:write:policies"),
              ("DELETE", "/v1/admin/policies/x", None, "admin:write:policies"),
              ("PUT", "/v1/admin/tenants/x", {}, "admin:write:tenants"),
              ("PUT", "/v1/admin/quotas/a", {"requests_per_day": 1}, "admin:write:quotas"),
              ("PUT", "/v1/admin/roles/auditor", {"grants": ["*"]}, "admin:write:roles"),
              ("PUT", "/v1/admin/bindings/key:" + key_id(extra["auditor"]), {"roles": ["admin"]}, "admin:write:roles"),
              ("POST", "/v1/admin/model/reload", None, "admin:write:model"),
              ("POST", "/v1/route", ROUTE, "model:inference:*"),
              ("POST", "/v1/feedback", {"decision_id": "d_x", "latency_ms": 1}, "model:inference:*")]
    for method, path, body, perm in writes:
        r = client.request(method, path, json=body, headers={**aud, "traceparent": TRACE})
        assert r.status_code == 403, (path, r.text)
        err = r.json()
        assert err["error"] == "forbidden" and err["missing_permission"] == perm and perm in err["message"]
        assert err["fields"][0]["field"] == "permission" and err["request_id"]
    denials = [x for x in logs.records() if x["msg"] == "permission denied"]
    assert {d["missing_permission"] for d in denials} >= {w[3] for w in writes}
    assert all(d["principal"] == f"key:{key_id(extra['auditor'])}" for d in denials[-len(writes):])
    assert all(d["trace_id"] == TRACE[3:35] and d["request_id"] for d in denials[-len(writes):])
    # nothing changed: the role is still read-only, no policy was created
    assert client.get("/v1/admin/roles/auditor", headers=admin).json()["grants"] == ["admin:read:*"]
    assert client.get("/v1/admin/policies", headers=admin).json()["policies"] == []


def test_builtin_roles_keep_working_and_cannot_be_redefined(live: Any, client: httpx.Client) -> None:
    _, setup, _, _ = live
    admin = setup.auth("admin")
    assert client.post("/v1/route", json=ROUTE, headers=setup.auth("a")).status_code == 200
    assert client.get("/v1/admin/policies", headers=setup.auth("a")).json()["missing_permission"] == "admin:read:policies"
    roles = {r["name"]: r for r in client.get("/v1/admin/roles", headers=admin).json()["roles"]}
    assert roles["tenant"]["builtin"] and roles["tenant"]["grants"] == ["model:inference:*"]
    assert roles["admin"]["grants"] == ["*"]
    for method in ("PUT", "DELETE"):
        r = client.request(method, "/v1/admin/roles/admin", json={"grants": []} if method == "PUT" else None,
                           headers=admin)
        assert r.status_code == 409 and r.json()["error"] == "builtin_role", r.text
    r = client.put("/v1/admin/roles/bad", json={"grants": ["admin:read:*", "admin:raed:*"]}, headers=admin)
    assert r.status_code == 422 and r.json()["error"] == "invalid_role", r.text
    assert r.json()["fields"][0]["field"] == "body.grants[1]", r.text
    assert "unknown verb 'raed'" in r.json()["fields"][0]["message"] and "read" in r.json()["fields"][0]["message"]


def _offerings_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["offering"]["offering_id"])


def test_inference_permissions_mask_regions_and_refuse_only_when_none_remain(live: Any, client: httpx.Client) -> None:
    _, setup, extra, logs = live
    admin = setup.auth("admin")
    b2 = bearer(extra["b2"])
    models = client.get("/v1/offerings", headers=admin).json()
    model = models.get("default_model") or models["models"][0]
    r = client.put("/v1/admin/roles/eu-only", json={"grants": ["model:inference:*:europe-*"]}, headers=admin)
    assert r.status_code == 201, r.text
    # the key's own role (tenant) grants every region: bind eu-only to a key whose role grants nothing else
    kf = setup.settings.keys_file
    eu_key = add_key(kf, "b", "eu-only")
    time.sleep(2.5)  # (the key store reloads the file every 2 s)
    for _ in range(6):
        r = client.post("/v1/route", json=ROUTE, headers=bearer(eu_key))
        assert _offerings_of(r).startswith("gcp:europe-west4:"), r.text
        by = r.json()["excluded"]["by_reason"]
        assert by["permission"] == 4, by  # the four offerings outside europe-*, masked like a deny
    # /v1/explain says why: the masked offerings' reason is 'permission'
    ex = client.post("/v1/explain", json=ROUTE, headers=bearer(eu_key)).json()
    reasons = {o["offering"]["offering_id"]: o["excluded_by"] for o in ex["offerings"]}
    assert all((why == "permission") != oid.startswith("gcp:europe-west4:") for oid, why in reasons.items()), reasons
    # a binding adds roles to a key: b2 (role tenant) keeps every region; a tenant-wide binding adds to all its keys
    assert client.put(f"/v1/admin/bindings/key:{key_id(extra['b2'])}", json={"roles": ["eu-only"]},
                      headers=admin).status_code == 201
    assert "permission" not in client.post("/v1/route", json=ROUTE, headers=b2).json()["excluded"]["by_reason"]
    # a role for another model only: nothing remains -- 403 naming a permission it lacks, logged with the trace
    r = client.put("/v1/admin/roles/other-model", json={"grants": ["model:inference:other-*:*"]}, headers=admin)
    assert r.status_code == 201
    other = add_key(kf, "b", "other-model")
    time.sleep(2.5)
    r = client.post("/v1/route", json=ROUTE, headers={**bearer(other), "traceparent": TRACE})
    assert r.status_code == 403, r.text
    missing = r.json()["missing_permission"]
    assert missing.startswith(f"model:inference:{model}:"), missing
    assert any(x.get("missing_permission") == missing and x.get("trace_id") == TRACE[3:35] for x in logs.records())
    # a request whose own constraints leave only masked regions: refused too
    r = client.post("/v1/route", json={**ROUTE, "constraints": {"allow": [{"providers": ["aws"]}]}},
                    headers=bearer(eu_key))
    assert r.status_code == 403 and r.json()["missing_permission"] == f"model:inference:{model}:us-east-1", r.text


def test_tenants_are_created_changed_and_deleted_without_a_restart(live: Any, client: httpx.Client) -> None:
    _, setup, extra, _ = live
    admin, c = setup.auth("admin"), bearer(extra["c"])
    assert client.post("/v1/route", json=ROUTE, headers=c).json()["error"] == "unknown_tenant"
    bad = [({"constraints": {"allow": [{"providers": ["awz"]}]}}, "body.constraints.allow[0].providers[0]", "aws"),
           ({"explore_epsilon": 0.9}, "body.explore_epsilon", None),
           ({"quotas": {"models": {"nope": {"max_concurrent": 1}}}}, "body.quotas.models.nope", None),
           ({"gateway": {"origin": "mars:1"}}, "body.gateway.origin", None),
           ({"constraintz": {}}, "body.constraintz", None)]
    for body, field, close in bad:
        r = client.put("/v1/admin/tenants/c", json=body, headers=admin)
        assert r.status_code == 422, r.text
        f = r.json()["fields"][0]
        assert f["field"] == field, r.text
        assert close is None or close in f["suggestions"]
    r = client.put("/v1/admin/tenants/c", json={"constraints": {"deny": [{"pricing_modes": ["spot"]}]}}, headers=admin)
    assert r.status_code == 201 and r.json()["tenant"]["version"] == 1, r.text
    for _ in range(4):  # the tenant's constraints apply at once
        assert not _offerings_of(client.post("/v1/route", json=ROUTE, headers=c)).endswith(":spot")
    r = client.put("/v1/admin/tenants/c", params={"version": 7}, json={}, headers=admin)
    assert r.status_code == 409 and r.json()["fields"][0]["field"] == "query.version"
    r = client.put("/v1/admin/tenants/c", params={"version": 1}, json={}, headers=admin)
    assert r.status_code == 200 and r.json()["tenant"]["version"] == 2
    listing = {t["name"]: t for t in client.get("/v1/admin/tenants", headers=admin).json()["tenants"]}
    assert listing["a"]["source"] == "config" and listing["c"]["source"] == "store"
    assert client.delete("/v1/admin/tenants/c", headers=admin).status_code == 200
    assert client.post("/v1/route", json=ROUTE, headers=c).json()["error"] == "unknown_tenant"
    assert client.delete("/v1/admin/tenants/c", headers=admin).status_code == 404
    entries = client.get("/v1/admin/audit", params={"kind": "tenant", "resource": "c"}, headers=admin).json()["entries"]
    assert [e["action"] for e in entries] == ["create", "update", "delete"]
    assert entries[0]["before"] is None and entries[0]["after"]["constraints"]["deny"][0]["pricing_modes"] == ["spot"]
    assert entries[2]["after"] is None and all(e["principal"] == f"key:{key_id(setup.keys['admin'])}" for e in entries)


def test_quotas_are_set_through_the_api_and_enforced_at_once(live: Any, client: httpx.Client) -> None:
    _, setup, _, _ = live
    admin = setup.auth("admin")
    assert client.put("/v1/admin/quotas/zzz", json={"requests_per_day": 1}, headers=admin).status_code == 404
    r = client.put("/v1/admin/quotas/a", json={"models": {"nope": {"requests_per_day": 1}}}, headers=admin)
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "body.models.nope", r.text
    r = client.put("/v1/admin/quotas/a", json={"requests_per_dya": 1}, headers=admin)
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "body.requests_per_dya", r.text
    used = next((b["requests_day"] for b in client.get("/v1/quotas", headers=setup.auth("a")).json()["buckets"]), 0)
    r = client.put("/v1/admin/quotas/a", json={"requests_per_day": used + 3}, headers=admin)
    assert r.status_code == 200, r.text
    codes = [client.post("/v1/route", json=ROUTE, headers=setup.auth("a")).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429], codes
    r = client.post("/v1/route", json=ROUTE, headers=setup.auth("a"))
    assert r.json()["error"] == "quota_exceeded" and r.json()["limit"]["name"] == "requests_per_day"
    assert client.delete("/v1/admin/quotas/a", headers=admin).status_code == 200
    assert client.post("/v1/route", json=ROUTE, headers=setup.auth("a")).status_code == 200
    entries = client.get("/v1/admin/audit", params={"kind": "quota", "resource": "a"}, headers=admin).json()["entries"]
    assert [e["action"] for e in entries] == ["create", "delete"]
    assert entries[0]["after"] == {"requests_per_day": used + 3, "models": {}} and entries[1]["after"] is None


def test_roles_and_bindings_are_versioned_and_audited(live: Any, client: httpx.Client) -> None:
    _, setup, extra, _ = live
    admin = setup.auth("admin")
    assert client.put("/v1/admin/roles/ops", json={"grants": ["admin:read:status"]}, headers=admin).status_code == 201
    r = client.put("/v1/admin/roles/ops", json={"grants": ["admin:read:*"], "version": 1}, headers=admin)
    assert r.status_code == 200 and r.json()["role"]["version"] == 2
    r = client.put("/v1/admin/roles/ops", json={"grants": ["*"], "version": 1}, headers=admin)
    assert r.status_code == 409 and r.json()["error"] == "version_conflict"
    subject = f"tenant:{'b'}"
    r = client.put(f"/v1/admin/bindings/{subject}", json={"roles": ["opz"]}, headers=admin)
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "body.roles[0]", r.text
    r = client.put("/v1/admin/bindings/nobody", json={"roles": ["ops"]}, headers=admin)
    assert r.status_code == 422, r.text
    assert client.put(f"/v1/admin/bindings/{subject}", json={"roles": ["ops"]}, headers=admin).status_code == 201
    # every key of tenant b now reads the admin API (and still routes: its own role stays)
    assert client.get("/v1/admin/status", headers=setup.auth("b")).status_code == 200
    assert client.post("/v1/route", json=ROUTE, headers=setup.auth("b")).status_code == 200
    r = client.delete("/v1/admin/roles/ops", headers=admin)
    assert r.status_code == 409 and r.json()["error"] == "role_in_use"
    assert client.delete(f"/v1/admin/bindings/{subject}", headers=admin).status_code == 200
    assert client.get("/v1/admin/status", headers=setup.auth("b")).status_code == 403
    assert client.delete("/v1/admin/roles/ops", headers=admin).status_code == 200
    got = client.get("/v1/admin/audit", headers=admin).json()["entries"]
    mine = [(e["kind"], e["action"], e["resource"]) for e in got if e["resource"] in ("ops", subject)]
    assert mine == [("role", "create", "ops"), ("role", "update", "ops"), ("role_binding", "create", subject),
                    ("role_binding", "delete", subject), ("role", "delete", "ops")]


def test_a_dry_run_shows_what_a_policy_change_would_do_to_the_last_decisions(live: Any, client: httpx.Client) -> None:
    _, setup, _, _ = live
    admin = setup.auth("admin")
    went = [_offerings_of(client.post("/v1/route", json=ROUTE, headers=setup.auth("b"))) for _ in range(12)]
    before = client.get("/v1/admin/policies", headers=admin).json()
    no_spot = {"name": "dry-no-spot", "effect": "deny", "constraints": {"pricing_modes": ["spot"]}}
    r = client.post("/v1/admin/policies/dry-run", json={"put": [no_spot], "last": 12, "sample": 50}, headers=admin)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["decisions"] == 12 and out["skipped"] == 0, out
    n_spot = sum(w.endswith(":spot") for w in went)
    assert out["proposed"]["excluded"] == n_spot and out["changed"] == n_spot
    assert all(s["excluded_by"] == "dry-no-spot" and s["offering_id"].endswith(":spot") for s in out["sample"])
    everything = {"name": "dry-all", "effect": "deny"}
    out = client.post("/v1/admin/policies/dry-run", json={"put": [everything], "last": 12}, headers=admin).json()
    assert out["proposed"]["refused"] == 12 and out["transitions"] == {"unchanged->refused": 12}
    pref = {"name": "dry-pref", "effect": "prefer", "weight": 1.0, "constraints": {"providers": ["azure"]}}
    out = client.post("/v1/admin/policies/dry-run", json={"put": [pref], "last": 12}, headers=admin).json()
    assert out["proposed"]["rebiased"] == 12
    # nothing applied
    assert client.get("/v1/admin/policies", headers=admin).json() == before
    # bad input names the field
    r = client.post("/v1/admin/policies/dry-run", json={"delete": ["nope"]}, headers=admin)
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "body.delete[0]"
    r = client.post("/v1/admin/policies/dry-run", json={"put": [{**no_spot, "constraints": {"providers": ["awz"]}}]},
                    headers=admin)
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "body.put[0].constraints.providers[0]", r.text
    assert client.post("/v1/admin/policies/dry-run", json={"last": 0}, headers=admin).status_code == 422
    r = client.post("/v1/admin/policies/dry-run", json={}, headers=setup.auth("a"))
    assert r.status_code == 403 and r.json()["missing_permission"] == "admin:read:policies"


# ---------------------------------------------------------------------------------------- across routers
def _changes_reach_the_other_router(urls: list[str], setup: RouterSetup, c_key: str) -> None:
    a, b = urls
    admin = setup.auth("admin")
    with httpx.Client(timeout=10) as http:
        assert http.post(f"{b}/v1/route", json=ROUTE, headers=bearer(c_key)).json()["error"] == "unknown_tenant"
        r = http.put(f"{a}/v1/admin/tenants/c", json={"quotas": {"requests_per_day": 2}}, headers=admin)
        assert r.status_code == 201, r.text
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            r = http.post(f"{b}/v1/route", json=ROUTE, headers=bearer(c_key))
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text
        # the quota holds across both routers (one more on A, then both refuse)
        assert http.post(f"{a}/v1/route", json=ROUTE, headers=bearer(c_key)).status_code in (200, 429)
        r = http.put(f"{a}/v1/admin/roles/readers", json={"grants": ["admin:read:*"]}, headers=admin)
        assert r.status_code == 201
        r = http.put(f"{a}/v1/admin/bindings/tenant:c", json={"roles": ["readers"]}, headers=admin)
        assert r.status_code == 201
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if http.get(f"{b}/v1/admin/roles", headers=bearer(c_key)).status_code == 200:
                break
            time.sleep(0.05)
        assert http.get(f"{b}/v1/admin/roles", headers=bearer(c_key)).status_code == 200
        entries = http.get(f"{b}/v1/admin/audit", headers=admin).json()["entries"]
        assert [(e["kind"], e["action"], e["resource"]) for e in entries if e["kind"] != "policy_files"] == [
            ("tenant", "create", "c"), ("role", "create", "readers"), ("role_binding", "create", "tenant:c")]
        assert entries[0]["after"]["quotas"]["requests_per_day"] == 2
        assert all(e["principal"] == f"key:{key_id(setup.keys['admin'])}" and e["request_id"] for e in entries)
        # the dry run reads the shared log: both routers' decisions, judged the same on either
        made = [http.post(f"{u}/v1/route", json=ROUTE, headers=setup.auth("a")).status_code for u in (a, b, a)]
        assert made == [200, 200, 200]
        outs = [http.post(f"{u}/v1/admin/policies/dry-run", json={"put": [{"name": "all", "effect": "deny"}],
                                                                   "last": 3}, headers=admin).json() for u in (a, b)]
        assert outs[0] == outs[1] and outs[0]["proposed"]["refused"] == 3 and outs[0]["skipped"] == 0, outs


def test_changes_on_one_router_reach_another_sharing_its_sqlite_store(tmp_path: Path) -> None:
    setup = make_setup(tmp_path, policy_poll_s=0.2)
    c_key = add_key(setup.settings.keys_file, "c")
    servers = [ServerThread(create_app(setup.settings)) for _ in range(2)]
    urls = [s.__enter__() for s in servers]
    try:
        _changes_reach_the_other_router(urls, setup, c_key)
    finally:
        for s in servers:
            s.__exit__(None, None, None)
    # a restart serves what the store holds (the tenant created through the API, its quota, the binding)
    with ServerThread(create_app(setup.settings)) as url:
        got = httpx.get(f"{url}/v1/admin/tenants/c", headers=setup.auth("admin"), timeout=10).json()
        assert got["config"]["quotas"]["requests_per_day"] == 2 and got["source"] == "store"
        assert httpx.get(f"{url}/v1/admin/roles", headers=bearer(c_key), timeout=10).status_code == 200


@pytest.mark.slow
def test_routers_on_one_postgres_database_share_tenants_roles_and_the_audit(postgres: Any, tmp_path: Path) -> None:
    url = postgres.create_database("access_routers")
    setup = make_setup(tmp_path, db_url=url, policy_poll_s=0.2)
    c_key = add_key(setup.settings.keys_file, "c")
    servers = [ServerThread(create_app(setup.settings)) for _ in range(2)]
    try:
        urls = [s.__enter__() for s in servers]
        _changes_reach_the_other_router(urls, setup, c_key)
    finally:
        for s in servers:
            s.__exit__(None, None, None)
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        n = conn.execute("SELECT COUNT(*) FROM audit_log WHERE kind IN ('tenant', 'role', 'role_binding')").fetchone()
        assert n is not None and n[0] == 3
        with pytest.raises(psycopg.Error, match="append-only"):
            conn.execute("UPDATE audit_log SET principal = 'someone else' WHERE kind = 'tenant'")
        heads = conn.execute("SELECT MAX(version) FROM access_versions").fetchone()
        assert heads is not None and heads[0] == 3


def test_the_keys_command_gives_a_key_any_role_and_refuses_a_bad_one(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    kf = tmp_path / "keys.json"
    run = [sys.executable, "-m", "router.control.keys"]
    out = subprocess.run([*run, "add", "--tenant", "ops", "--role", "auditor", "--keys-file", str(kf)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("xr_"), out.stderr
    assert json.loads(kf.read_text())["keys"][0]["role"] == "auditor"
    listed = subprocess.run([*run, "list", "--keys-file", str(kf)], capture_output=True, text=True, timeout=60)
    assert "auditor" in listed.stdout and out.stdout.strip() not in listed.stdout
    bad = subprocess.run([*run, "add", "--tenant", "ops", "--role", "no role", "--keys-file", str(kf)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--role: 'no role'" in bad.stderr, bad.stderr
    assert len(json.loads(kf.read_text())["keys"]) == 1


def test_a_stored_tenant_this_catalog_cannot_serve_is_refused_and_the_rest_installed(tmp_path: Path) -> None:
    """A tenant written through a router with another catalog (a provider this one lacks) fails
    closed here; the other tenants, the roles and the bindings of that version still apply."""
    from router.control.access_store import AccessStore, put_binding, put_role, put_tenant
    from router.core.settings import TenantConfig
    from xroute.schema.access import RoleBinding
    from xroute.schema.policy_ir import Constraints, Rule

    setup = make_setup(tmp_path)
    kf = setup.settings.keys_file
    keys = {"far": add_key(kf, "far"), "near": add_key(kf, "near"), "reader": add_key(kf, "near")}
    store = AccessStore(setup.settings.db_path)
    try:
        far = TenantConfig(constraints=Constraints(allow=[Rule(providers=["elsewhere"])]))
        for m in (put_tenant("far", far, {}), put_tenant("near", TenantConfig(), {}),
                  put_role("reader", Role(grants=["admin:read:*"])),
                  put_binding(f"key:{key_id(keys['reader'])}", RoleBinding(roles=["reader"]))):
            store.change("test", m)
    finally:
        store.close()
    with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/v1/route", json=ROUTE, headers=bearer(keys["far"]))
        assert r.status_code == 403 and r.json()["error"] == "unknown_tenant", r.text
        assert c.post("/v1/route", json=ROUTE, headers=bearer(keys["near"])).status_code == 200
        assert c.get("/v1/admin/audit", headers=bearer(keys["reader"])).status_code == 200
        status = c.get("/v1/admin/status", headers=setup.auth("admin")).json()["access"]
        assert [x.split(":")[0] for x in status["not_served"]] == ["far"] and status["version"] == 4
