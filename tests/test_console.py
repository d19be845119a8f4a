"""The web console (``router/console``, ``docs/console.md``) against a real router (uvicorn in a thread)
with a seeded decision log: every page in a real headless Chromium (Debian's, through Selenium and
chromium-driver) with no error in the browser's console; a tenant key sees its own tenant only
(status and content); an auditor sees everything and changes nothing; a change through a form needs
its CSRF token and the API's permission; bad input to every query parameter and form field is a 4xx
naming the field. Screenshots go to ``tests/artifacts/console/`` (ignored by git)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.app.factory import create_app
from router.console.auth import COOKIE, csrf_token
from router.control.keys import add_key
from tests.servers import ServerThread, chromium
from tests.test_router_support import ROUTE, RouterSetup, make_setup

ARTIFACTS = Path(__file__).parent / "artifacts" / "console"
PAGES = ("pools", "decisions", "policies", "tenants", "model")


@dataclass
class Live:
    url: str
    setup: RouterSetup
    client: httpx.Client
    auditor: str
    ids: dict[str, list[str]] = field(default_factory=dict)
    event_id: str = ""
    pool: str = ""

    def auth(self, who: str) -> dict[str, str]:
        key = self.auditor if who == "auditor" else self.setup.keys[who]
        return {"Authorization": f"Bearer {key}"}

    def key(self, who: str) -> str:
        return self.auditor if who == "auditor" else self.setup.keys[who]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("console")
    setup = make_setup(tmp, tenants={"a": {"quotas": {"max_concurrent": 50, "requests_per_day": 1000}}})
    auditor = add_key(setup.settings.keys_file, "ops", "auditor")
    with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=30) as c:
        lv = Live(url, setup, c, auditor)
        admin = lv.auth("admin")
        r = c.put("/v1/admin/roles/auditor", json={"description": "reads, never writes", "grants": ["admin:read:*"]},
                  headers=admin)
        assert r.status_code in (200, 201), r.text
        # a pool event masking one pool (every decision below excludes it)
        lv.pool = c.get("/v1/offerings", headers=admin).json()["offerings"][-1]["offering"]["offering_id"]
        lv.event_id = f"console-{int(time.time())}"
        r = c.post("/v1/events", json={"event_id": lv.event_id, "kind": "degraded", "pool": lv.pool}, headers=admin)
        assert r.status_code in (200, 202), r.text
        # the log: decisions of tenants a and b, in sessions, some with their outcome
        for tenant in ("a", "b"):
            lv.ids[tenant] = []
            for i in range(6):
                r = c.post("/v1/route", json={**ROUTE, "session_id": f"{tenant}-s{i % 2}"}, headers=lv.auth(tenant))
                assert r.status_code == 200, r.text
                lv.ids[tenant].append(r.json()["decision_id"])
            for did in lv.ids[tenant][:3]:
                r = c.post("/v1/feedback", json={"decision_id": did, "latency_ms": 900.0, "ttft_ms": 210.0,
                                                 "output_tokens": 60}, headers=lv.auth(tenant))
                assert r.status_code == 201, r.text
        # two policy versions to compare
        for weight in (0.5, 0.75):
            r = c.put("/v1/admin/policies/prefer-on-demand", json={
                "effect": "prefer", "weight": weight, "constraints": {"pricing_modes": ["on_demand"]}}, headers=admin)
            assert r.status_code in (200, 201), r.text
        yield lv


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = chromium()
    try:
        yield driver
    finally:
        driver.quit()


def login(driver: Any, live: Live, who: str) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(f"{live.url}/console/login")
    driver.find_element(By.ID, "key").send_keys(live.key(who))
    click(driver, By.ID, "login")
    assert driver.current_url.endswith("/console/pools"), driver.current_url
    cookie = driver.get_cookie(COOKIE)
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    driver.get_log("browser")  # (what came before: the login page's own)


def click(driver: Any, by: str, value: str) -> None:
    """Click an element and wait for the page it loads (a form's submission, a link)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    old = driver.find_element(By.TAG_NAME, "html")
    driver.find_element(by, value).click()

    def gone(d: Any) -> bool:  # (Chromium 156 may answer a node of the page left behind with an inspector
        try:  # error, "Node with given id does not belong to the document", not a stale reference)
            return bool(expected_conditions.staleness_of(old)(d))
        except WebDriverException as e:
            return "does not belong to the document" in str(e)

    WebDriverWait(driver, 20).until(gone)


def console_errors(driver: Any) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]


def shot(driver: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def text(driver: Any) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.TAG_NAME, "body").text)


# ------------------------------------------------------------------------------------------- browser
@pytest.mark.slow
def test_every_page_renders_in_chromium_without_a_console_error(live: Live, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    login(browser, live, "admin")
    for page in PAGES:
        browser.get(f"{live.url}/console/{page}")
        assert browser.find_element(By.TAG_NAME, "h1").text, page
        assert console_errors(browser) == [], page
        shot(browser, f"admin-{page}")
    # pools: every offering in the table and the grid, the masked pool with its reason
    browser.get(f"{live.url}/console/pools")
    rows = browser.find_elements(By.CSS_SELECTOR, "#offerings tr")[1:]
    n = len(live.client.get("/v1/offerings", headers=live.auth("admin")).json()["offerings"])
    assert len(rows) == n and len(browser.find_elements(By.CSS_SELECTOR, "#region-grid .dot")) == n
    masked = [r.text for r in rows if r.text.startswith(live.pool)]
    assert masked and f"pool event degraded ({live.event_id})" in masked[0]
    # decisions: both tenants; one decision's explanation and outcome
    browser.get(f"{live.url}/console/decisions")
    listed = {a.text for a in browser.find_elements(By.CSS_SELECTOR, "#decisions td:first-child a")}
    assert set(live.ids["a"]) | set(live.ids["b"]) <= listed
    click(browser, By.LINK_TEXT, live.ids["a"][0])
    assert browser.find_element(By.ID, "decision-id").text == live.ids["a"][0]
    assert browser.find_elements(By.CSS_SELECTOR, "#alternatives tr") and browser.find_elements(By.CSS_SELECTOR,
                                                                                                  "#feedback tr")
    assert "pool_event" in browser.find_element(By.ID, "exclusions").text
    assert console_errors(browser) == []
    shot(browser, "admin-decision")
    # search by tenant and session through the form, then page with the keyset cursor
    browser.get(f"{live.url}/console/decisions")
    browser.find_element(By.NAME, "tenant").send_keys("b")
    browser.find_element(By.NAME, "session").send_keys("b-s1")
    limit = browser.find_element(By.NAME, "limit")
    limit.clear()
    limit.send_keys("2")
    click(browser, By.ID, "search-go")
    assert console_errors(browser) == []
    first = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#decisions td:first-child a")]
    click(browser, By.ID, "older")
    second = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#decisions td:first-child a")]
    expect = [d for d in reversed(live.ids["b"]) if live.ids["b"].index(d) % 2 == 1]
    assert first + second == expect, (first, second, expect)
    # policies: the diff of the two versions, a dry run of a draft
    browser.get(f"{live.url}/console/policies")
    versions = [o.get_attribute("value") for o in Select(browser.find_element(By.ID, "diff-a")).options]
    Select(browser.find_element(By.ID, "diff-a")).select_by_value(versions[1])
    Select(browser.find_element(By.ID, "diff-b")).select_by_value(versions[0])
    click(browser, By.ID, "diff-go")
    diff = browser.find_element(By.ID, "diff").text
    assert "prefer-on-demand" in diff and "weight" in diff and "0.5" in diff and "0.75" in diff
    shot(browser, "admin-policies-diff")
    draft = browser.find_element(By.ID, "draft")
    draft.send_keys("name: deny-everything\neffect: deny\n")
    click(browser, By.ID, "dry-run-go")
    assert int(browser.find_element(By.ID, "dry-run-changed").text) == len(live.ids["a"]) + len(live.ids["b"])
    assert "refused" in browser.find_element(By.ID, "dry-run").text
    assert console_errors(browser) == []
    shot(browser, "admin-policies-dry-run")
    # the policy set did not change (a dry run applies nothing)
    assert live.client.get("/v1/admin/policies", headers=live.auth("admin")).json()["policies"][0]["weight"] == 0.75
    # tenants: quotas against their limits, sessions
    browser.get(f"{live.url}/console/tenants?tenant=a")
    assert "requests_per_day" in browser.find_element(By.ID, "quotas").text
    assert sum(int(td.text) for td in browser.find_elements(By.CSS_SELECTOR, "#usage-hours td:nth-child(2)")) == 6
    assert "a-s0" in browser.find_element(By.ID, "sessions").text
    shot(browser, "admin-tenants")


@pytest.mark.slow
def test_a_tenant_key_sees_its_own_tenant_only(live: Live, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    login(browser, live, "a")
    nav = {a.text for a in browser.find_elements(By.CSS_SELECTOR, "header a")}
    assert nav == {"Pools", "Decisions", "Tenants"}
    browser.get(f"{live.url}/console/decisions")
    tenants = {td.text for td in browser.find_elements(By.CSS_SELECTOR, "#decisions td:nth-child(3)")}
    ids = {a.text for a in browser.find_elements(By.CSS_SELECTOR, "#decisions td:first-child a")}
    assert tenants == {"a"} and ids == set(live.ids["a"])
    assert console_errors(browser) == []
    shot(browser, "tenant-decisions")
    browser.get(f"{live.url}/console/tenants")
    assert browser.find_element(By.ID, "tenant-name").text == "a" and "b-s" not in text(browser)
    # another tenant's decision, decisions, quotas; the admin pages: refused, nothing of b in the answer
    c, key = live.client, {"Cookie": f"{COOKIE}={live.key('a')}"}
    other = live.ids["b"][0]
    for path, status in ((f"/console/decisions/{other}", 404), ("/console/decisions?tenant=b", 403),
                         ("/console/decisions?tenant=b&session=b-s0", 403), ("/console/tenants?tenant=b", 403),
                         ("/console/policies", 403), ("/console/model", 403)):
        r = c.get(path, headers=key)
        assert r.status_code == status, (path, r.text)
        # (a 404 says the id asked for, as the API does: nothing of b's decision itself)
        assert "'b'" not in r.text and "b-s0" not in r.text and live.ids["b"][1] not in r.text, path
    r = c.get("/console/decisions?limit=200", headers=key)
    assert r.status_code == 200 and not any(d in r.text for d in live.ids["b"])
    assert all(d in r.text for d in live.ids["a"])


@pytest.mark.slow
def test_an_auditor_sees_everything_and_changes_nothing(live: Live, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    login(browser, live, "auditor")
    for page in PAGES:
        browser.get(f"{live.url}/console/{page}")
        assert browser.find_element(By.TAG_NAME, "h1").text, page
        assert console_errors(browser) == [], page
    browser.get(f"{live.url}/console/pools")
    assert live.event_id in browser.find_element(By.ID, "events").text
    assert browser.find_elements(By.CSS_SELECTOR, "button.end-event") == []  # no button to change anything
    shot(browser, "auditor-pools")
    browser.get(f"{live.url}/console/decisions")
    assert {td.text for td in browser.find_elements(By.CSS_SELECTOR, "#decisions td:nth-child(3)")} == {"a", "b"}
    # with its own valid form token, the change is still refused -- the API's permission, nothing changed
    r = live.client.post(f"/console/pools/events/{live.event_id}/end", data={"csrf": csrf_token(live.auditor)},
                         headers={"Cookie": f"{COOKIE}={live.auditor}"})
    assert r.status_code == 403 and "admin:write:events" in r.text
    pools = live.client.get("/console/pools", headers=live.auth("admin")).text
    assert f"pool event degraded ({live.event_id})" in pools
    # nor a canary: no form to start one, and a hand-made start is refused
    browser.get(f"{live.url}/console/policies")
    assert browser.find_elements(By.ID, "no-canary") and not browser.find_elements(By.ID, "canary-start")
    r = live.client.post("/console/policies/canary/start", data={
        "csrf": csrf_token(live.auditor), "draft": "name: x\neffect: deny\n", "key": "request", "share": "50"},
        headers={"Cookie": f"{COOKIE}={live.auditor}"})
    assert r.status_code == 403 and "admin:write:policies" in r.text
    assert live.client.get("/v1/admin/canary", headers=live.auth("admin")).json()["canary"] is None


@pytest.mark.slow
def test_a_form_changes_only_with_its_csrf_token_and_the_permission(live: Live, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    c, cookie = live.client, {"Cookie": f"{COOKIE}={live.key('admin')}"}
    # a cross-site form post carries no token (SameSite=Strict keeps the cookie home anyway): 403, nothing ended
    for data in ({}, {"csrf": "0" * 64}, {"csrf": csrf_token(live.key("a"))}):
        r = c.post(f"/console/pools/events/{live.event_id}/end", data=data, headers=cookie)
        assert r.status_code == 403 and r.json()["fields"][0]["field"] == "body.csrf", r.text
    assert f"pool event degraded ({live.event_id})" in c.get("/console/pools", headers=cookie).text
    # the admin ends it through the page
    login(browser, live, "admin")
    click(browser, By.CSS_SELECTOR, "button.end-event")
    assert browser.current_url.endswith("/console/pools")
    assert browser.find_elements(By.ID, "no-events") and console_errors(browser) == []
    audit = c.get("/v1/admin/audit", params={"kind": "pool_event"}, headers=live.auth("admin")).json()["entries"]
    assert any(e["resource"] == live.event_id for e in audit)
    # logging out clears the cookie: the pages send the browser to the login form
    click(browser, By.CSS_SELECTOR, "header button")
    assert browser.get_cookie(COOKIE) is None
    browser.get(f"{live.url}/console/decisions")
    assert browser.current_url.endswith("/console/login")


@pytest.mark.slow
def test_a_canary_started_compared_rolled_back_and_promoted_through_the_page(live: Live, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    c, admin = live.client, live.auth("admin")
    login(browser, live, "admin")
    browser.get(f"{live.url}/console/policies")
    assert browser.find_elements(By.ID, "no-canary")
    # start: half the requests decided by a draft that denies spot pools
    browser.find_element(By.ID, "canary-draft").send_keys("name: canary-no-spot\neffect: deny\n"
                                                          "constraints: {pricing_modes: [spot]}\n")
    Select(browser.find_element(By.ID, "canary-key")).select_by_visible_text("request")
    share = browser.find_element(By.ID, "canary-share-input")
    share.clear()
    share.send_keys("50")
    click(browser, By.ID, "canary-start")
    assert console_errors(browser) == []
    running = c.get("/v1/admin/canary", headers=admin).json()["canary"]
    assert running is not None and running["share"] == 50 and running["key"] == "request"
    assert running["diff"]["added"] == ["canary-no-spot"]
    cid = running["id"]
    # traffic in both arms, then the arms side by side on the page
    for _ in range(30):
        r = c.post("/v1/route", json=ROUTE, headers=live.auth("b"))
        assert r.status_code == 200, r.text
    browser.get(f"{live.url}/console/policies")
    assert browser.find_element(By.ID, "canary-id").text == cid
    table = browser.find_element(By.ID, "canary-compare")
    rows = {r.find_element(By.TAG_NAME, "th").text: [td.text for td in r.find_elements(By.TAG_NAME, "td")]
            for r in table.find_elements(By.TAG_NAME, "tr")[1:]}
    compare = c.get("/v1/admin/canary/compare", headers=admin).json()
    stable_n, canary_n = compare["arms"]["stable"]["decisions"], compare["arms"]["canary"]["decisions"]
    assert stable_n > 0 and canary_n > 0 and rows["decisions"][:2] == [str(stable_n), str(canary_n)]
    assert "policy:canary-no-spot" in rows["exclusions"][1] and "policy:canary-no-spot" not in rows["exclusions"][0]
    assert console_errors(browser) == []
    browser.execute_script("document.getElementById('canary').scrollIntoView()")
    shot(browser, "admin-canary")
    # its share changed, then rolled back: the stable set decides everything again, unchanged
    before = c.get("/v1/admin/policies", headers=admin).json()
    new_share = browser.find_element(By.ID, "canary-new-share")
    new_share.clear()
    new_share.send_keys("25")
    click(browser, By.ID, "canary-share-go")
    assert c.get("/v1/admin/canary", headers=admin).json()["canary"]["share"] == 25
    click(browser, By.ID, "canary-rollback")
    assert browser.find_elements(By.ID, "no-canary") and console_errors(browser) == []
    after = c.get("/v1/admin/policies", headers=admin).json()
    assert after.get("canary") is None and after["policies"] == before["policies"]
    # another one promoted: its draft becomes the stable set
    browser.find_element(By.ID, "canary-draft").send_keys("name: canary-prefer-east\neffect: prefer\nweight: 0.01\n"
                                                          "constraints: {regions: [us-east-1]}\n")
    click(browser, By.ID, "canary-start")
    click(browser, By.ID, "canary-promote")
    assert browser.find_elements(By.ID, "no-canary") and console_errors(browser) == []
    names = [p["name"] for p in c.get("/v1/admin/policies", headers=admin).json()["policies"]]
    assert "canary-prefer-east" in names and "canary-no-spot" not in names
    audit = c.get("/v1/admin/audit", headers=admin).json()["entries"]
    assert {"start", "share", "rollback", "promote"} <= {e.get("action") for e in audit}, audit[-6:]


@pytest.mark.slow
def test_the_canary_forms_need_their_token_and_name_bad_fields(live: Live) -> None:
    c, cookie, token = live.client, {"Cookie": f"{COOKIE}={live.key('admin')}"}, csrf_token(live.key("admin"))
    draft = "name: x\neffect: deny\n"
    r = c.post("/console/policies/canary/start", data={"draft": draft, "key": "request", "share": "10"}, headers=cookie)
    assert r.status_code == 403 and r.json()["fields"][0]["field"] == "body.csrf"
    for data, name in (({"key": "planet", "share": "10"}, "body.key"), ({"key": "tenant", "share": "0"}, "body.share"),
                        ({"key": "tenant", "share": "101"}, "body.share"), ({"key": "tenant", "share": "x"}, "body.share"),
                        ({"key": "tenant", "share": "10", "draft": "name: x\neffect: sometimes\n"},
                         "body.draft.put[0].effect")):
        r = c.post("/console/policies/canary/start", data={"csrf": token, "draft": draft, **data}, headers=cookie)
        assert r.status_code == 422 and name in [f["field"] for f in r.json()["fields"]], (data, r.text)
    for path, data, name in (("/console/policies/canary/share", {"share": "5", "id": "bad id"}, "body.id"),
                              ("/console/policies/canary/share", {"share": "500", "id": "c1"}, "body.share"),
                              ("/console/policies/canary/promote", {"id": ""}, "body.id"),
                              ("/console/policies/canary/explode", {"id": "c1"}, "path.action")):
        r = c.post(path, data={"csrf": token, **data}, headers=cookie)
        assert r.status_code == 422 and name in [f["field"] for f in r.json()["fields"]], (path, r.text)
    # no canary running: promoting one is the API's 409, nothing changes
    r = c.post("/console/policies/canary/promote", data={"csrf": token, "id": "c1"}, headers=cookie)
    assert r.status_code == 409, r.text


# ---------------------------------------------------------------------------------------- plain HTTP
@pytest.mark.slow
@pytest.mark.parametrize(("path", "field"), [
    ("/console/decisions?limit=0", "query.limit"),
    ("/console/decisions?limit=201", "query.limit"),
    ("/console/decisions?limit=x", "query.limit"),
    ("/console/decisions?since=yesterday", "query.since"),
    ("/console/decisions?until=2026-13-01", "query.until"),
    ("/console/decisions?since=2026-12-05T10:00:00Z&until=2026-12-05T09:00:00Z", "query.until"),
    ("/console/decisions?before=nope", "query.before"),
    ("/console/decisions?before=-1_d_00", "query.before"),
    ("/console/decisions?session=s1", "query.session"),
    ("/console/decisions?session=bad%20id&tenant=a", "query.session"),
    ("/console/decisions?id=no%20such", "query.id"),
    ("/console/decisions?tenant=" + "x" * 65, "query.tenant"),
    ("/console/decisions/bad%20id", "path.decision_id"),
    ("/console/tenants?tenant=bad%20name", "query.tenant"),
    ("/console/policies?a=1", "query.b"),
    ("/console/policies?a=-1&b=1", "query.a"),
    ("/console/policies?a=x&b=1", "query.a"),
    ("/console/policies?a=1&b=999", "query.b"),
])
def test_bad_query_parameters_are_a_4xx_naming_the_field(live: Live, path: str, field: str) -> None:
    r = live.client.get(path, headers=live.auth("admin"))
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
    assert field in [f["field"] for f in r.json()["fields"]], r.text


@pytest.mark.slow
@pytest.mark.parametrize(("path", "data", "field"), [
    ("/console/login", {}, "body.key"),
    ("/console/login", {"key": "k" * 600}, "body.key"),
    ("/console/policies/dry-run", {"draft": ""}, "body.draft"),
    ("/console/policies/dry-run", {"draft": "a: [1"}, "body.draft"),
    ("/console/policies/dry-run", {"draft": "42"}, "body.draft"),
    ("/console/policies/dry-run", {"draft": "name: x\neffect: maybe\n"}, "body.draft.put[0].effect"),
    ("/console/policies/dry-run", {"draft": "name: x\neffect: deny\nconstraints: {regions: [atlantis]}\n"},
     "body.draft.put[0].constraints.regions[0]"),
    ("/console/policies/dry-run", {"draft": "name: x\neffect: deny\n", "last": "0"}, "body.last"),
    ("/console/policies/dry-run", {"draft": "name: x\neffect: deny\n", "last": "many"}, "body.last"),
    ("/console/pools/events/a%20b/end", {}, "path.event_id"),
])
def test_bad_form_fields_are_a_4xx_naming_the_field(live: Live, path: str, data: dict[str, str], field: str) -> None:
    token = csrf_token(live.key("admin"))
    r = live.client.post(path, data={"csrf": token, **data}, headers={"Cookie": f"{COOKIE}={live.key('admin')}"})
    assert 400 <= r.status_code < 500, (path, data, r.status_code, r.text)
    assert field in [f["field"] for f in r.json()["fields"]], r.text


@pytest.mark.slow
def test_keys_are_checked_as_the_api_checks_them(live: Live) -> None:
    c = live.client
    r = c.get("/console/pools")
    assert r.status_code == 303 and r.headers["location"] == "/console/login"
    r = c.get("/console/pools", headers={"Cookie": f"{COOKIE}=xr_nope"})  # a stale cookie: log in again
    assert r.status_code == 303 and r.headers["location"] == "/console/login"
    r = c.get("/console/pools", headers={"Authorization": "Bearer xr_nope"})  # a bad header key: the API's 401
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    r = c.post("/console/login", data={"key": "xr_nope"})
    assert r.status_code == 401 and "invalid API key" in r.text and COOKIE not in r.headers.get("set-cookie", "")
    r = c.post("/console/login", data={"key": live.key("a")})
    assert r.status_code == 303 and "httponly" in r.headers["set-cookie"].lower()
    assert "samesite=strict" in r.headers["set-cookie"].lower() and "path=/console" in r.headers["set-cookie"].lower()
    assert c.get("/console/pools", headers=live.auth("a")).status_code == 200


# ------------------------------------------------------------------------------------- bounded reads
def test_every_console_query_has_a_limit_and_walks_an_index(tmp_path: Path) -> None:
    """SQLite's own plan of each query the console's pages issue on a log with the router's schema: a
    ``LIMIT``, and no full scan of a table (``SCAN t`` without an index and a sort; a ``SCAN t USING
    INDEX`` walks an index from one end and stops at the limit)."""
    import sqlite3

    from router.service.dry_run import _SQL as DRY_RUN_SQL
    from router.store import migrations as mig
    from router.store.policies import PolicyStore
    from router.store.readers import REQUESTS_SQL, RESERVED_SQL, SESSIONS_SQL, search_sql
    from router.store.rows import ARM_SQL
    from router.store.sqlite import DecisionStore

    db = tmp_path / "decisions.db"
    DecisionStore(db)._conn.close()  # (the decision log's schema; no writer started)
    mig.MigrationStore(db).db.close()
    PolicyStore(db).close()
    now, cursor = time.time(), (time.time() - 60, "d_0000000000000000")
    queries: list[tuple[str, tuple[Any, ...]]] = [
        search_sql(limit=51), search_sql(since=now - 3600, until=now, limit=51),
        search_sql(before=cursor, limit=51), search_sql(since=now - 3600, before=cursor, limit=51),
        search_sql(tenant="a", limit=51), search_sql(tenant="a", before=cursor, limit=51),
        search_sql(tenant="a", since=now - 3600, until=now, limit=51),
        search_sql(tenant="a", session="s", limit=51), search_sql(tenant="a", session="s", before=cursor, limit=51),
        (REQUESTS_SQL, (3600, "a", now - 86400, 25)), (RESERVED_SQL, (60, "a", now - 3600, 61)),
        (SESSIONS_SQL, ("a", now - 86400, 50)),
        (DRY_RUN_SQL, (200,)), (ARM_SQL, ("canary:c1", 10_000)),
        (mig._SELECT + " WHERE m.tenant = ? ORDER BY m.updated_at DESC LIMIT ?", ("a", 50)),
        ("SELECT migration_id, version, state, at, detail FROM migration_transitions WHERE migration_id IN (?, ?) "
         "ORDER BY migration_id, version LIMIT 5000", ("m1", "m2")),
        ("SELECT version, created_at, principal FROM policy_versions ORDER BY version DESC LIMIT ?", (50,)),
        ("SELECT version, document FROM policy_versions WHERE version = ?", (1,)),
    ]
    conn = sqlite3.connect(db)
    for sql, args in queries:
        details = [str(r[3]) for r in conn.execute("EXPLAIN QUERY PLAN " + sql, args).fetchall()]
        assert " LIMIT " in sql or "WHERE version = ?" in sql, sql
        # a plain SCAN only of a table whose rows are in the key's order (an INTEGER PRIMARY KEY), read from
        # one end with no sort: it stops at the LIMIT
        full = [d for d in details if d.startswith("SCAN ") and "USING" not in d]
        assert not full or not any("TEMP B-TREE" in d for d in details), (sql, details)
    conn.close()


@pytest.mark.slow
def test_the_tenants_page_shows_its_migrations_with_their_state_history(live: Live, browser: Any) -> None:
    """(Last: the interruption migrates sessions, whose target decisions join the log.)"""
    from datetime import UTC, datetime, timedelta

    from selenium.webdriver.common.by import By

    c = live.client
    place = c.get("/v1/sessions/a-s0", headers=live.auth("a")).json()["placement"]
    deadline = (datetime.now(UTC) + timedelta(minutes=10)).isoformat()
    r = c.post("/v1/events", json={"event_id": f"{live.event_id}-int", "kind": "interruption", "pool": place,
                                   "deadline": deadline}, headers=live.auth("admin"))
    assert r.status_code in (200, 202), r.text
    page = ""
    for _ in range(100):  # (the migrator starts them at once; a target is chosen within its poll)
        page = c.get("/console/tenants", headers=live.auth("a")).text
        if "a-s0" in page and "target_chosen" in page:
            break
        time.sleep(0.1)
    assert "a-s0" in page and "a-s1" in page and "b-s" not in page
    # each migration's history: requested, then the target chosen
    login(browser, live, "a")
    browser.get(f"{live.url}/console/tenants")
    rows = browser.find_elements(By.CSS_SELECTOR, "#migrations tr")[1:]
    assert rows and all("requested" in r.text and place in r.text for r in rows)
    assert console_errors(browser) == []
    shot(browser, "tenant-migrations")


@pytest.mark.slow
def test_the_model_page_reads_champion_and_challenger_with_the_gate_from_the_registry(tmp_path: Path) -> None:
    """``router.console.model_info`` on a real MLflow registry (a SQLite store): each alias's version, its
    run, the gate's verdict, its ``gate_*`` tags and metrics; an alias nobody set is reported absent."""
    import mlflow
    from mlflow import MlflowClient

    from router.console import model_info

    prior = mlflow.get_tracking_uri()  # (MLflow's process-wide settings: left as they were for the other tests)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        client = MlflowClient()
        exp = client.create_experiment("console-test", artifact_location=str(tmp_path / "artifacts"))
        run = client.create_run(exp)
        client.log_metric(run.info.run_id, "gate_reward_delta", 0.0042)
        client.log_metric(run.info.run_id, "loss", 1.0)
        client.set_terminated(run.info.run_id)
        client.create_registered_model("console-router")
        mv = client.create_model_version("console-router", source=str(tmp_path / "artifacts" / "m"),
                                         run_id=run.info.run_id,
                                         tags={"gate_passed": "False", "gate_reason": "loses under overload"})
        client.set_registered_model_alias("console-router", "challenger", mv.version)
        view = model_info.registry_view("models:/console-router@champion")
        assert view["error"] is None and view["name"] == "console-router"
        champion, challenger = view["versions"]
        assert champion == {"alias": "champion", "version": None}
        assert challenger["version"] == mv.version and challenger["run_id"] == run.info.run_id
        assert challenger["gate_passed"] == "False" and challenger["gate_reason"] == "loses under overload"
        assert challenger["metrics"] == {"gate_reward_delta": 0.0042}  # (only the gate's figures)
        assert challenger["run_link"] is None  # (a file store: no UI to link to)
        assert model_info.registry_view("runs:/abc/model") == {"name": None, "versions": [], "error": None}
        # the page's template with that view
        from router.console.render import TEMPLATES

        html = TEMPLATES.env.get_template("model.html").render(
            nav=[], who=None, csrf="", active="model", policy={"name": "greedy", "kind": "fallback"},
            model_uri="models:/console-router@champion", loaded=None, error=None, swaps=0, registry=view,
            state={}, decisions_since_start=0)
        assert "challenger: version 1" in html and "not passed" in html and "gate_reward_delta" in html
    finally:
        mlflow.set_tracking_uri(prior)
        model_info._cache.clear()


@pytest.mark.slow
def test_the_pages_on_a_postgresql_log(tmp_path: Path) -> None:
    """The same readers on the decision log's PostgreSQL backend (a real server): search by tenant and
    session in keyset pages, one decision, the tenant's decisions per hour and reservations per minute."""
    from tests.servers import PostgresServer

    server = PostgresServer().start()
    try:
        setup = make_setup(tmp_path, db_url=server.create_database("console"),
                           tenants={"a": {"quotas": {"requests_per_day": 1000}}})
        with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=30) as c:
            ids = []
            t0 = time.time()
            for i in range(5):
                r = c.post("/v1/route", json={**ROUTE, "session_id": f"pg-s{i % 2}"}, headers=setup.auth("a"))
                assert r.status_code == 200, r.text
                ids.append(r.json()["decision_id"])
            admin = setup.auth("admin")
            r = c.get("/console/decisions?tenant=a&session=pg-s0&limit=2", headers=admin)
            assert r.status_code == 200 and [ids[4], ids[2]] == [d for d in ids if d in r.text][::-1]
            nxt = r.text.split('id="older" href="')[1].split('"')[0].replace("&amp;", "&")
            r = c.get(nxt, headers=admin)
            assert r.status_code == 200 and ids[0] in r.text and ids[2] not in r.text
            r = c.get(f"/console/decisions/{ids[1]}", headers=setup.auth("a"))
            assert r.status_code == 200 and ids[1] in r.text
            r = c.get("/console/tenants?tenant=a", headers=admin)
            assert r.status_code == 200 and "pg-s0" in r.text
            hours = r.text.split('id="usage-hours"')[1].split("</table>")[0]
            assert '<td class="n">5</td>' in hours
            # the bucket is the hour the decisions were made in (PostgreSQL's CAST rounds: the next hour after :30)
            assert time.strftime("%Y-%m-%d %H:00:00Z", time.gmtime(t0)) in hours, hours
            for page in ("pools", "decisions", "policies", "model"):
                assert c.get(f"/console/{page}", headers=admin).status_code == 200, page
    finally:
        server.close()
