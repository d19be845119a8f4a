"""The Rego export (``xroute/policy_rego.py``) evaluated by a real Rego engine (``regopy``, the
rego-cpp interpreter) agrees with the native compiled masks (``envs.policies``) on thousands of
random cases: the same offerings excluded, by the same policy, the same biases, the same policies
applied."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from regopy import Interpreter

from envs import policies as pol
from tests.policy_cases import random_policy_set
from xroute.bundle import load_bundle
from xroute.policy_rego import glob_regex, to_rego
from xroute.schema.policy_ir import PolicySet


def test_wildcards_become_anchored_regular_expressions_that_match_as_fnmatch_does() -> None:
    import fnmatch

    values = ["g5.xlarge", "g5x.large", "aws:eu-west-1", "a.b", "llama3-8b", "p4d.24xlarge", "x[1]", "Standard_NC6s_v3",
              "eu-west-1", "", "a?b", "gcp:europe-west4"]
    patterns = ["g5.*", "g5?xlarge", "aws:eu-*", "a.b", "llama3-[0-9]b", "p[!3]*", "*[1]*", "Standard_NC*", "*",
                "eu-west-?", "a[?]b", "gcp:europe-*", "[a-c]*", "*:*-west-*", "x[", "plain"]
    for p in patterns:
        rx = re.compile(glob_regex(p))
        for v in values:
            assert bool(rx.fullmatch(v)) == fnmatch.fnmatchcase(v, p), (p, v, glob_regex(p))


def _interpreter(ps: PolicySet) -> Interpreter:
    module, data = to_rego(ps)
    r = Interpreter()
    r.add_module("xroute", module)
    r.add_data(data)
    return r


@pytest.mark.slow
def test_rego_export_agrees_with_the_native_masks_on_thousands_of_random_cases() -> None:
    rng = np.random.default_rng(22)
    full = load_bundle(None).catalog()
    tenants, models, origins = ["acme", "beta"], ["llama3-8b", "mixtral"], ["aws:us-east-2", "gcp:us-west4"]
    cases = offerings_checked = excluded_seen = biased_seen = 0
    for _ in range(200):
        catalog = [full[int(k)] for k in sorted(rng.choice(len(full), int(rng.integers(2, 8)), replace=False))]
        ps = random_policy_set(rng, catalog, tenants, models, origins)
        native = pol.CompiledPolicies(ps, catalog)
        out = native.outcome_buffers()
        rego = _interpreter(ps)
        n = len(catalog)
        for _ in range(10):
            tenant, model, origin = (str(rng.choice(v)) for v in (tenants, models, origins))
            cls = ps.request_class(str(rng.choice(["", "", "gold"])), float(rng.choice([400, 1800, 2500])), 50.0, None)
            usd = rng.choice([0.3, 0.9, 1.5, 4.0, 12.0, 40.0, np.nan], n)
            rtt = rng.choice([1.0, 30.0, 100.0, 200.0, 300.0], n)
            slots = rng.integers(0, 8, n)
            busy = np.minimum(rng.integers(0, 9, n), slots).astype(float)
            head = np.array([pol.headroom(b, s) for b, s in zip(busy, slots)])
            ctx = native.context(tenant, model, cls, origin)
            native.apply(ctx, np.ones(n, dtype=bool), usd, rtt, busy, slots, np.ones(n, dtype=bool), out)
            rego.set_input({"tenant": tenant, "model": model, "request_class": cls, "origin": origin,
                            "offerings": [{"offering_id": o.offering_id, "provider": o.provider, "region": o.region,
                                           "location": o.location, "instance_type": o.instance_type,
                                           "accelerator": o.accelerator, "pricing_mode": o.pricing_mode,
                                           "usd_per_hour": None if math.isnan(usd[i]) else float(usd[i]),
                                           "rtt_ms": float(rtt[i]), "headroom": float(head[i])}
                                          for i, o in enumerate(catalog)]})
            got = json.loads(str(rego.query("x := data.xroute.routing.decision")))["bindings"]["x"]
            assert got["applied"] == list(ctx.applied)
            want_excluded = {catalog[i].offering_id: native.names[r] for i, r in enumerate(out.reason.tolist()) if r >= 0}
            assert got["excluded"] == want_excluded, (ps.model_dump(exclude_none=True), got, want_excluded)
            assert got["allowed"] == sorted(o.offering_id for i, o in enumerate(catalog) if out.allowed[i])
            for i, o in enumerate(catalog):
                if out.allowed[i]:
                    assert got["bias"][o.offering_id] == pytest.approx(out.bias[i], abs=1e-9)
            cases += 1
            offerings_checked += n
            excluded_seen += len(want_excluded)
            biased_seen += int((out.bias != 0).sum())
    assert cases == 2000 and offerings_checked > 8000
    assert excluded_seen > 2000 and biased_seen > 300  # the cases exercise every kind of rule, not only "allow all"


def test_export_rego_command_writes_a_bundle_an_engine_loads(tmp_path: Path) -> None:
    from xroute.config import CONFIG_DIR

    out = tmp_path / "opa"
    r = subprocess.run([sys.executable, "-m", "xroute_app", "policies", "export-rego", "--policies",
                        str(CONFIG_DIR / "policies"), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rego = Interpreter()
    rego.add_module("xroute", (out / "policy.rego").read_text())
    rego.add_data(json.loads((out / "data.json").read_text()))
    rego.set_input({"tenant": "acme", "model": "llama3-8b", "request_class": "interactive", "origin": "aws:eu-central-1",
                    "offerings": [{"offering_id": "x", "provider": "aws", "region": "us-east-1",
                                   "location": "aws:us-east-1", "instance_type": "g5.xlarge", "accelerator": "A10G",
                                   "pricing_mode": "on_demand", "usd_per_hour": 1.0, "rtt_ms": 90.0, "headroom": 1.0},
                                  {"offering_id": "y", "provider": "aws", "region": "eu-west-1",
                                   "location": "aws:eu-west-1", "instance_type": "g5.xlarge", "accelerator": "A10G",
                                   "pricing_mode": "spot", "usd_per_hour": 0.5, "rtt_ms": 20.0, "headroom": 1.0},
                                  {"offering_id": "z", "provider": "aws", "region": "eu-west-1",
                                   "location": "aws:eu-west-1", "instance_type": "p4d.24xlarge",
                                   "accelerator": "A100", "pricing_mode": "on_demand", "usd_per_hour": 32.0,
                                   "rtt_ms": 20.0, "headroom": 1.0}]})
    got = json.loads(str(rego.query("x := data.xroute.routing.decision")))["bindings"]["x"]
    assert got["excluded"] == {"x": "eu-residency", "y": "no-spot-interactive", "z": "price-ceiling"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies:\n  - {name: a, effect: deny, constraints: {providers: []}}\n")
    r = subprocess.run([sys.executable, "-m", "xroute_app", "policies", "export-rego", "--policies", str(bad), "--out",
                        str(tmp_path / "o2")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "field 'policies[0].constraints.providers'" in r.stderr and "Traceback" not in r.stderr
