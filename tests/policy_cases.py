"""Support for the routing-policy tests (no tests here): the policies' meaning written out plainly
-- one loop over policies and offerings straight from the schema, with ``fnmatch`` -- as the
reference the compiled form (``envs.policies``), the Rego export and every policy's decisions are
checked against; and random policy sets, catalogs and requests.

The reference is deliberately naive (no arrays, no caching, no ranks precomputed): it shares no
code with ``envs.policies`` but the schema."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from xroute.schema.offering import Offering
from xroute.schema.policy_ir import Policy, PolicySet


def _match(value: str, patterns: list[str] | None) -> bool:
    return patterns is None or any(fnmatch.fnmatchcase(value, p) for p in patterns)


def _target(p: Policy, tenant: str, model: str, cls: str, origin: str) -> bool:
    t = p.target
    if t.classes is not None and (cls == "" or not _match(cls, t.classes)):
        return False
    return _match(tenant, t.tenants) and _match(model, t.models) and _match(origin, t.origins)


def _attributes(p: Policy, ps: PolicySet, o: Offering) -> bool:
    c = p.constraints
    regions = None
    if c.regions is not None or c.region_sets is not None:
        regions = list(c.regions or []) + [r for s in (c.region_sets or []) for r in ps.region_sets[s]]
    return (_match(o.provider, c.providers)
            and (regions is None or _match(o.region, regions) or _match(o.location, regions))
            and _match(o.instance_type, c.instance_types) and _match(o.accelerator, c.accelerators)
            and _match(o.pricing_mode, c.pricing_modes) and _match(o.offering_id, c.offering_ids))


def _meets(p: Policy, usd: float, rtt: float, head: float) -> bool:
    c = p.constraints
    if c.max_usd_per_hour is not None and not (not math.isnan(usd) and usd <= c.max_usd_per_hour):
        return False
    if c.max_rtt_ms is not None and not rtt <= c.max_rtt_ms:
        return False
    return not (c.min_headroom is not None and not head >= c.min_headroom)


@dataclass
class Verdict:
    allowed: bool
    excluded_by: str | None
    bias: float


def reference(ps: PolicySet, catalog: list[Offering], tenant: str, model: str, cls: str, origin: str,
              usd: np.ndarray, rtt: np.ndarray, head: np.ndarray) -> list[Verdict]:
    """What the policies say of each offering (docs/policies.md), computed the plain way."""
    ranked = sorted(ps.policies, key=lambda p: (-p.priority, p.name))
    applying = [p for p in ranked if _target(p, tenant, model, cls, origin)]
    allows = [p for p in applying if p.effect == "allow"]
    out = []
    for i, o in enumerate(catalog):
        u, r, h = float(usd[i]), float(rtt[i]), float(head[i])
        why = None
        for p in applying:  # the first deny (by rank) that hits it
            if p.effect == "deny" and _attributes(p, ps, o) and (not p.constraints.numeric or not _meets(p, u, r, h)):
                why = p.name
                break
        if why is None and allows and not any(_attributes(p, ps, o) and _meets(p, u, r, h) for p in allows):
            why = allows[0].name
        bias = 0.0
        if why is None:
            bias = sum(float(p.weight or 0.0) for p in applying
                       if p.effect == "prefer" and _attributes(p, ps, o) and _meets(p, u, r, h))
        out.append(Verdict(why is None, why, bias))
    return out


# ---------------------------------------------------------------------------------------- random cases
def _pick(rng: np.random.Generator, values: list[str], glob: bool = True) -> list[str]:
    """1-2 of ``values``, sometimes as a wildcard (a prefix + ``*``, ``?`` for one character), and
    now and then a value no catalog has (it must match nothing)."""
    out = []
    for _ in range(int(rng.integers(1, 3))):
        v = str(rng.choice(values))
        roll = rng.random()
        if glob and roll < 0.2 and len(v) > 2:
            v = v[: int(rng.integers(1, len(v)))] + "*"
        elif glob and roll < 0.3 and len(v) > 1:
            k = int(rng.integers(0, len(v)))
            v = v[:k] + "?" + v[k + 1:]
        elif roll < 0.35:
            v = v + "-nowhere"
        out.append(v)
    return out


def random_policy_set(rng: np.random.Generator, catalog: list[Offering], tenants: list[str], models: list[str],
                      origins: list[str], n_policies: int | None = None) -> PolicySet:
    """A random, valid policy set over ``catalog``'s attribute values (region sets, SLO tiers,
    every effect, numeric limits around the catalog's prices, RTTs and headrooms)."""
    attrs = {"providers": sorted({o.provider for o in catalog}), "regions": sorted({o.region for o in catalog}),
             "locations": sorted({o.location for o in catalog}),
             "instance_types": sorted({o.instance_type for o in catalog}),
             "accelerators": sorted({o.accelerator for o in catalog}), "pricing_modes": ["on_demand", "spot"],
             "offering_ids": [o.offering_id for o in catalog]}
    region_sets = {f"set{k}": _pick(rng, attrs["locations"] + attrs["regions"]) for k in range(int(rng.integers(0, 3)))}
    tiers = {"fast": {"max_ttft_ms": float(rng.choice([500, 1500, 2000]))}, "any": {}} if rng.random() < 0.7 else {}
    classes = [*tiers, "batch", "gold"]
    policies = []
    for k in range(int(rng.integers(1, 9)) if n_policies is None else n_policies):
        effect = str(rng.choice(["allow", "deny", "deny", "prefer"]))
        target: dict[str, Any] = {}
        if rng.random() < 0.4:
            target["tenants"] = _pick(rng, [*tenants, "*"])
        if rng.random() < 0.2:
            target["models"] = _pick(rng, models)
        if rng.random() < 0.3:
            target["classes"] = _pick(rng, classes)
        if rng.random() < 0.3:
            target["origins"] = _pick(rng, origins)
        c: dict[str, Any] = {}
        for fld in ("providers", "regions", "instance_types", "accelerators", "pricing_modes", "offering_ids"):
            if rng.random() < (0.15 if fld == "offering_ids" else 0.3):
                c[fld] = _pick(rng, attrs[fld] + (attrs["locations"] if fld == "regions" else []))
        if region_sets and rng.random() < 0.3:
            c["region_sets"] = [str(rng.choice(sorted(region_sets)))]
        if rng.random() < 0.3:
            c["max_usd_per_hour"] = float(rng.choice([0.5, 1.0, 2.0, 5.0, 30.0, 100.0]))
        if rng.random() < 0.25:
            c["max_rtt_ms"] = float(rng.choice([5.0, 50.0, 120.0, 250.0]))
        if rng.random() < 0.2:
            c["min_headroom"] = float(rng.choice([0.0, 0.25, 0.5, 0.9, 1.0]))
        p: dict[str, Any] = {"name": f"p{k}", "effect": effect, "target": target, "constraints": c,
                             "priority": int(rng.integers(-2, 3))}
        if effect == "prefer":
            p["weight"] = float(rng.choice([-0.5, -0.05, 0.05, 0.2, 1.0, 3.0]))
        policies.append(p)
    return PolicySet.model_validate({"region_sets": region_sets, "slo_tiers": tiers, "policies": policies,
                                     "prefer_mode": "lexicographic" if rng.random() < 0.2 else "bias"})
