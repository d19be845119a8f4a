"""A canary rollout's two arms side by side (``GET /v1/admin/canary/compare``; ``docs/policies.md``,
"Canary rollouts").

From the decision log, per arm (the rows whose ``policy_arm`` is ``stable:<id>`` or
``canary:<id>``: the decisions made while the canary ran), over the latest ``window`` decisions of
the arm -- one bounded query each, on the partial index ``decisions_policy_arm``
(``router.store.rows.ARM_SQL``): the decisions, their expected cost, the feedback received, the SLO
verdicts (``feedback.sla_violation``) and the observed cost. From the policy store's tallies (every
router's counts, ``router.decision.canary``): the exclusions of those decisions by reason and the
refusals by error (``no_offering``, ``forbidden``, ``no_capacity``, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from router.core.logs import iso
from router.decision.canary import ARMS
from router.store.dialect import reading
from router.store.rows import ARM_SQL


def arm_rows(target: Path | str, canary_id: str, window: int) -> dict[str, tuple[Any, ...]]:
    """Each arm's aggregate row (:data:`ARM_SQL`) over its latest ``window`` decisions."""
    with reading(target) as query:
        return {arm: tuple(query(ARM_SQL, (f"{arm}:{canary_id}", window))[0]) for arm in ARMS}


def _ratio(a: float | None, b: int) -> float | None:
    return None if not b or a is None else float(a) / b


def compare(canary_id: str, rows: dict[str, tuple[Any, ...]], tallies: list[tuple[str, str, str, int]],
            window: int) -> dict[str, Any]:
    """The comparison's ``arms`` and ``delta`` (module docstring) from :func:`arm_rows` and the
    store's tallies (``PolicyStore.tallies``)."""
    arms: dict[str, Any] = {}
    for arm in ARMS:
        n, exp_cost, with_fb, judged, met, obs_cost, n_cost, failed, first, last = rows[arm]
        n = int(n or 0)
        excluded = {r: c for a, k, r, c in tallies if a == arm and k == "excluded"}
        denied = {r: c for a, k, r, c in tallies if a == arm and k == "denied"}
        arms[arm] = {
            "label": f"{arm}:{canary_id}",
            "decisions": n,
            "complete": n < window,
            "first_at": None if first is None else iso(float(first)),
            "last_at": None if last is None else iso(float(last)),
            "feedback": int(with_fb or 0),
            "failed": int(failed or 0),
            "slo": {"judged": int(judged or 0), "met": int(met or 0),
                    "attainment": _ratio(met, int(judged or 0))},
            "cost": {"expected_usd_per_request": _ratio(exp_cost, n),
                     "observed_usd_per_request": _ratio(obs_cost, int(n_cost or 0)),
                     "observed_requests": int(n_cost or 0)},
            "excluded": {"total": sum(excluded.values()), "by_reason": dict(sorted(excluded.items()))},
            "denied": {"total": sum(denied.values()), "by_error": dict(sorted(denied.items()))},
        }
    s, c = arms["stable"], arms["canary"]
    total = s["decisions"] + c["decisions"] + s["denied"]["total"] + c["denied"]["total"]

    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    delta = {
        "slo_attainment": diff(s["slo"]["attainment"], c["slo"]["attainment"]),
        "expected_usd_per_request": diff(s["cost"]["expected_usd_per_request"], c["cost"]["expected_usd_per_request"]),
        "observed_usd_per_request": diff(s["cost"]["observed_usd_per_request"], c["cost"]["observed_usd_per_request"]),
        "denied_share": diff(_ratio(s["denied"]["total"], s["decisions"] + s["denied"]["total"]),
                             _ratio(c["denied"]["total"], c["decisions"] + c["denied"]["total"])),
    }
    return {"window": window, "arms": arms, "delta": delta,
            "canary_share_observed": _ratio(c["decisions"] + c["denied"]["total"], total)}


__all__ = ["arm_rows", "compare"]
