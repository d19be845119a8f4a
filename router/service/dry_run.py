"""A policy change tried on the last N decisions of the decision log, without applying it
(``POST /v1/admin/policies/dry-run``; ``docs/policies.md``, "Dry run").

For each decision (newest first) the request is put back in its context -- tenant, model, request
class, origin, the tenant's and the request's own constraints -- and judged twice: under the policy
set in force now and under the proposed one. A verdict is one of

* ``unchanged`` -- the offering it went to is allowed, with the same prefer bias;
* ``rebiased`` -- still allowed, but the prefer policies weigh it (or the other allowed offerings)
  differently: the choice may move;
* ``excluded`` -- a policy excludes the offering it went to (named): the request would go to another
  of the offerings still allowed (how many: ``allowed``);
* ``refused`` -- no offering remains allowed: the route would answer 422 ``no_offering``.

What it reads: the attributes exactly (the catalog), the numbers *as the router sees them now* --
the price and the RTT from the request's origin in the current telemetry -- and every pool at full
headroom (the router's view of the pools back then is not in the log): a ``min_headroom`` policy
never excludes in a dry run, and a price or RTT ceiling is judged on today's numbers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from envs import policies as env_policies
from router.store.dialect import reading
from xroute.schema.decision import RouteRequest
from xroute.schema.policy_ir import PolicySet

_SQL = ("SELECT decision_id, tenant, created_at, origin, model, offering_id, request_json FROM decisions "
        "ORDER BY decision_id DESC LIMIT ?")
VERDICTS = ("unchanged", "rebiased", "excluded", "refused")


def recent_decisions(target: Path | str, limit: int) -> list[tuple[Any, ...]]:
    """The last ``limit`` decisions of the log (newest first, by id: decision ids are time-sorted, so the
    primary key's last entries, not a sort of the whole log): id, tenant, created_at, origin, model,
    offering id, request JSON."""
    with reading(target) as query:
        return list(query(_SQL, (limit,)))


class _Judge:
    """One policy set, compiled against the engine's catalog, judging logged requests with the rule
    stages of a route (``router.decision.stages.RULES``: the constraint layers, then the policies at
    full headroom) -- the same stages ``/v1/route`` and ``/v1/explain`` run."""

    def __init__(self, ps: PolicySet, engine: Any):
        self.compiled = env_policies.CompiledPolicies(ps, engine.catalog)
        self.engine = engine

    def judge(self, req: RouteRequest, tenant: str, wall: float, chosen: int
              ) -> tuple[str, str | None, np.ndarray, np.ndarray]:
        """(``allowed`` | ``excluded`` | ``refused``, the policy that excluded ``chosen``, the
        offerings still allowed, the policies' bias)."""
        d = self.engine.trace_stages(self.engine.rule_stages, req, tenant, wall, full_headroom=True,
                                     policies=self.compiled)
        allowed, bias = d.allowed, d.bias if d.bias is not None else np.zeros(self.engine.n)
        if not allowed.any():
            return "refused", None, allowed, bias
        if not allowed[chosen]:
            why = d.trace[chosen] if d.trace is not None else None
            policy = why[len(env_policies.REASON_PREFIX):] if why and why.startswith(env_policies.REASON_PREFIX) \
                else None
            return "excluded", policy, allowed, bias
        return "allowed", None, allowed, bias


def dry_run(engine: Any, proposed: PolicySet, rows: Sequence[tuple[Any, ...]], sample: int) -> dict[str, Any]:
    """The verdicts (module docstring) of ``rows`` (:func:`recent_decisions`) under the set in
    force and under ``proposed``: counts of each, how many changed, and a sample of the changed."""
    env = engine.env
    now, new = _Judge(engine.policies.set, engine), _Judge(proposed, engine)
    index = {oid: i for i, oid in enumerate(engine.offering_ids)}
    origin_index = {o: k for k, o in enumerate(env.origins)}
    wall = time.time()
    counts_now = dict.fromkeys(VERDICTS, 0)
    counts = dict.fromkeys(VERDICTS, 0)
    changed: dict[str, int] = {}
    out_sample: list[dict[str, Any]] = []
    skipped = 0
    for did, tenant, created, origin, model, offering_id, request_json in rows:
        m = env.model_index.get(str(model), -1)
        chosen = index.get(str(offering_id), -1)
        o = origin_index.get(str(origin), -1)
        if m < 0 or chosen < 0 or o < 0:  # a catalog, model or origin this router lacks
            skipped += 1
            continue
        try:  # the logged request, for the model it was decided for
            req = RouteRequest.model_validate({**json.loads(request_json), "model": str(model)})
            v0, _, _, b0 = now.judge(req, str(tenant), wall, chosen)
            v1, by, allowed, b1 = new.judge(req, str(tenant), wall, chosen)
        except Exception:
            skipped += 1
            continue
        v0 = "unchanged" if v0 == "allowed" else v0
        if v1 == "allowed":
            v1 = "unchanged" if np.array_equal(b0[allowed], b1[allowed]) else "rebiased"
        counts_now[v0] += 1
        counts[v1] += 1
        if v1 != v0:
            key = f"{v0}->{v1}"
            changed[key] = changed.get(key, 0) + 1
            if len(out_sample) < sample:
                out_sample.append({"decision_id": did, "tenant": tenant, "model": model, "origin": origin,
                                   "offering_id": offering_id, "created_at": float(created), "now": v0, "proposed": v1,
                                   "excluded_by": by, "allowed": int(allowed.sum()),
                                   "bias": {"now": round(float(b0[chosen]), 9), "proposed": round(float(b1[chosen]), 9)}})
    judged = sum(counts.values())
    return {"decisions": judged, "skipped": skipped, "policy_version": engine.policy_version, "now": counts_now,
            "proposed": counts, "changed": sum(changed.values()), "transitions": changed, "sample": out_sample}
