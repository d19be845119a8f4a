"""The Grafana dashboard and the Prometheus rules (``deploy/``, docs/observability.md "Dashboards and
alerts"): the rules pass ``promtool check rules`` and their unit tests (``promtool test rules``:
a burn-rate alert that fires, one that stays quiet ...), and every metric the dashboard's and the
rules' PromQL names is one a real router exports -- a router on uvicorn with a stand-in upstream,
after routes, feedback (an SLO met and one missed), a quota refusal and a gateway request -- with
the labels the expressions select and aggregate by. So the dashboard cannot drift from the code.
``promtool`` is Debian's ``prometheus`` package (``scripts/setup.sh`` installs it for the tests)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from router.app.factory import create_app
from router.control.keys import add_key
from tests.servers import REPO_ROOT, ServerThread
from tests.test_router_support import ROUTE, make_setup
from tests.vllm_standin import StandIn

X = "aws:us-east-1:g5.xlarge:on_demand"
DASHBOARD = REPO_ROOT / "deploy/grafana/dashboards/xroute.json"
RULES = REPO_ROOT / "deploy/prometheus/rules/xroute.yml"
RULE_TESTS = sorted((REPO_ROOT / "deploy/prometheus/tests").glob("*.yml"))
#: a metric selector: the name, then its matchers if any
_SELECTOR = re.compile(r"\b(xroute_[a-z0-9_]+)\b(\{[^}]*\})?")
_MATCHER_LABEL = re.compile(r"([a-z_]+)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def _promtool() -> str:
    tool = shutil.which("promtool")
    assert tool is not None, "promtool is missing: Debian's prometheus package ships it (scripts/setup.sh installs it)"
    return tool


def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    assert RULE_TESTS, "no rule unit tests under deploy/prometheus/tests"
    check = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS" in check.stdout
    for t in RULE_TESTS:  # (from its folder: the tests name the rules relative to it)
        run = subprocess.run([_promtool(), "test", "rules", t.name], cwd=t.parent, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, f"{t.name}:\n{run.stdout}{run.stderr}"
        assert "SUCCESS" in run.stdout


def expressions() -> list[str]:
    """Every PromQL expression of the dashboard (its panels' targets and its variables' queries) and
    of the rules."""
    dash = json.loads(DASHBOARD.read_text())
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    out += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        out += [str(r["expr"]) for r in group["rules"]]
    return out


def test_the_expressions_are_found_and_name_metrics() -> None:
    exprs = expressions()
    assert len(exprs) > 30
    for e in exprs:  # each reads a metric of ours or a recording rule's output (xroute:...)
        assert _SELECTOR.search(e) or "xroute:" in e or e.strip().startswith("vector("), e


def exported(text: str) -> tuple[dict[str, set[str]], set[str]]:
    """Sample names of a /metrics text (a family with no samples yet: the names its type gives)
    -> the label names seen on them; and the names that have samples."""
    out: dict[str, set[str]] = {}
    sampled: set[str] = set()
    for fam in text_string_to_metric_families(text):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
        for s in suffixes.get(fam.type, ("",)):
            out.setdefault(fam.name + s, set())
        for sample in fam.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
            sampled.add(sample.name)
    return out, sampled


@pytest.fixture(scope="module")
def metrics_text(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("dash")
    upstream = StandIn()
    with ServerThread(upstream) as up_url:
        setup = make_setup(tmp, replay_speed=1e-6, upstreams=[{"offering_id": X, "base_urls": [f"{up_url}/v1"]}],
                           gateway={"origin": "aws:us-east-1"},
                           tenants={"a": {"priority": "critical", "constraints": {"prefer": [{"offering_ids": [X]}]}},
                                    "q": {"quotas": {"requests_per_day": 1}}})
        setup.keys["q"] = add_key(setup.settings.keys_file, "q")
        with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=30) as c:
            yield _traffic(c, url, setup)


def _traffic(c: httpx.Client, url: str, setup: Any) -> str:
    for ttft in (50.0, 900_000.0):  # one met, one missed (a TTFT far over the request's)
        r = c.post("/v1/route", json=ROUTE, headers=setup.auth("a"))
        assert r.status_code == 200, r.text
        fb = {"decision_id": r.json()["decision_id"], "latency_ms": ttft + 100.0, "ttft_ms": ttft, "output_tokens": 20,
              "cost_usd": 0.002}
        assert c.post("/v1/feedback", json=fb, headers=setup.auth("a")).status_code == 201
    assert c.post("/v1/route", json=ROUTE, headers=setup.auth("q")).status_code == 200
    over = c.post("/v1/route", json=ROUTE, headers=setup.auth("q"))
    assert over.status_code == 429 and over.json()["error"] == "quota_exceeded", over.text
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key=setup.keys["a"], max_retries=0).chat.completions.create(
        model="llama-2-7b", messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    assert chat.choices[0].message.content
    r = c.get("/metrics", headers=setup.auth("admin"))
    assert r.status_code == 200
    return r.text


def test_every_metric_and_label_the_dashboard_and_rules_use_is_exported(metrics_text: str) -> None:
    have, sampled = exported(metrics_text)
    missing, bad_labels = set(), []
    for e in expressions():
        labels_here: set[str] = set()
        unknown_labels = False  # (a metric with no samples yet: its labels are not in the text)
        for m in _SELECTOR.finditer(e):
            name, matchers = m.group(1), m.group(2) or ""
            if name not in have:
                missing.add(name)
                continue
            labels_here |= have[name]
            unknown_labels |= name not in sampled
            for label in _MATCHER_LABEL.findall(matchers):
                if name in sampled and label not in have[name] | {"le"}:
                    bad_labels.append((name, label))
        for group in _BY.findall(e):
            for label in filter(None, (x.strip() for x in group.split(","))):
                if not unknown_labels and label not in labels_here | {"le"}:
                    bad_labels.append((e[:60], label))
    assert not missing, f"the dashboard or rules read metrics the router does not export: {sorted(missing)}"
    assert not bad_labels, f"labels the router's metrics do not have: {bad_labels}"


def _value(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {name}{labels}")


def test_the_new_metrics_count_what_happened(metrics_text: str) -> None:
    t = metrics_text
    assert _value(t, "xroute_router_outcomes_total", tenant="a", band="critical", slo="met") >= 1
    assert _value(t, "xroute_router_outcomes_total", tenant="a", band="critical", slo="missed") == 1
    assert _value(t, "xroute_router_outcome_cost_usd_total", tenant="a", band="critical") >= 0.004 - 1e-12
    assert _value(t, "xroute_router_outcome_ttft_seconds_count", tenant="a", band="critical") >= 2
    assert _value(t, "xroute_router_outcome_ttft_seconds_bucket", tenant="a", band="critical", le="0.05") >= 1
    assert _value(t, "xroute_router_quota_refusals_total", tenant="q", limit="requests_per_day") == 1
    assert _value(t, "xroute_router_refusals_total", route="/v1/route", error="quota_exceeded") == 1
    assert _value(t, "xroute_router_ready") == 1
    assert _value(t, "xroute_router_pool_slots", offering_id=X) > 0
    assert _value(t, "xroute_router_pool_in_flight", offering_id=X) >= 0
