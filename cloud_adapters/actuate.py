"""Actuation: a capacity plan's targets made real through the cloud adapters, within safety limits
(``xroute capacity apply``; ``docs/capacity.md``, "Actuation and its safety limits").

Provider-neutral: each pool of a :class:`~xroute.schema.capacity.CapacityPlan` (offering x model) is
resolved to the group the adapter's config maps it to (``groups``: an AWS Auto Scaling group, an Azure
VM scale set, a GCP managed instance group) and set through :meth:`CloudAdapter.set_capacity`.

Contracts:

* **Checked whole, before anything changes** (:func:`plan_steps`). Every pool must be known (a
  configured group of a configured provider); the targets' cost at the telemetry's latest prices
  must be within ``ActuationLimits.max_usd_per_hour``; every increase must fit the cloud quotas
  covering the pool (the telemetry's latest ``quotas`` rows; one instance takes its ``vcpus`` of a
  ``vcpus`` quota, its GPUs of a ``gpus`` one, 1 of an ``instances`` one; the room is ``limit -
  usage``, and where the cloud reports no usage, the instances the plan's own pools hold count as
  the usage) and the group's own size bounds. The first breach is an :class:`ActuationRefused`
  naming the field (``pools[3].target``, ``max_usd_per_hour``); nothing is changed. An increase in
  a region whose quotas the telemetry does not hold is refused too: it could not be bounded.
* **Bounded steps.** A pool moves from the group's desired capacity toward its target by at most
  ``ActuationLimits.max_step`` instances per apply (one epoch); the rest waits for the next plan.
* **Dry run by default.** ``dry_run`` computes and reports the changes, records and changes nothing.
* **Journaled, so a killed run resumes without changing anything twice** (:func:`apply_steps`).
  Each change has a stable id (the plan's time, the pool, the target). Before the call it is
  recorded ``intended`` in the :class:`Journal` (durably: the journal has committed when
  ``record`` returns), after it ``applied`` or ``failed``. A rerun of the same plan skips changes
  already ``applied``; one left ``intended`` or ``failed`` is checked against the group first: if
  its desired capacity already is the change's ``after`` (the call went through, the run died
  before recording it) it is recorded ``applied`` without a call, else it is made then. A mutating
  call is retried only when throttled (:meth:`CloudAdapter.call_mutation`).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, Protocol

import pandas as pd

from cloud_adapters.base import CloudAdapter, GroupState, PoolGroup
from cloud_adapters.errors import CloudError
from xroute.errors import ConfigError
from xroute.schema.capacity import ActuationLimits, CapacityChange, CapacityPlan


class ActuationRefused(ConfigError):
    """A plan breaks a limit or names an unknown pool: one line naming the field; nothing changed."""


class Journal(Protocol):
    """Where each intended change is recorded before it is made (and its outcome after)."""

    def last(self, change_ids: list[str]) -> dict[str, CapacityChange]:
        """The latest recorded state of each of ``change_ids`` that has one."""
        ...

    def record(self, change: CapacityChange) -> None:
        """Record ``change`` durably (committed when this returns)."""
        ...


@dataclass(frozen=True)
class Telemetry:
    """What the limits are read from: the collector's bundle tables (``None``: absent)."""

    offerings: pd.DataFrame | None
    prices: pd.DataFrame | None
    quotas: pd.DataFrame | None

    @classmethod
    def from_tables(cls, tables: Mapping[str, pd.DataFrame]) -> Telemetry:
        return cls(tables.get("offerings"), tables.get("prices"), tables.get("quotas"))

    def price(self, offering_id: str) -> float | None:
        """The offering's latest price, USD per instance-hour."""
        p = self.prices
        if p is None or not len(p):
            return None
        mine = p[p["offering_id"] == offering_id]
        return None if not len(mine) else float(mine.sort_values("ts", kind="stable")["usd_per_hour"].iloc[-1])

    def takes(self, offering_id: str) -> dict[str, float] | None:
        """What one instance of the offering takes of a quota, per unit (None: not in the offerings)."""
        o = self.offerings
        row = None if o is None else o[o["offering_id"] == offering_id]
        if row is None or not len(row):
            return None
        return {"vcpus": float(row["vcpus"].iloc[0]), "gpus": float(row["accelerator_count"].iloc[0]), "instances": 1.0}


@dataclass(frozen=True)
class Step:
    """One pool of the plan: its group, what the group holds, the target and this apply's value."""

    index: int
    provider: str
    #: the plan's model of the pool
    model: str
    state: GroupState
    target: int
    after: int
    change_id: str

    @property
    def pool(self) -> PoolGroup:
        return self.state.pool

    @property
    def before(self) -> int:
        return self.state.desired

    @property
    def label(self) -> str:
        return f"{self.pool.offering_id}@{self.model}"


Outcome = Literal["unchanged", "would change", "applied", "failed", "already applied", "found applied"]


@dataclass(frozen=True)
class Result:
    step: Step
    outcome: Outcome
    after: int
    detail: str = ""


def change_id(plan: CapacityPlan, offering_id: str, model: str, target: int) -> str:
    """The stable id of a plan's change of one pool: the plan's time, the pool and the target."""
    return f"{plan.at.astimezone(UTC).isoformat()}/{offering_id}@{model}/{target}"


def plan_steps(plan: CapacityPlan, limits: ActuationLimits, adapters: Mapping[str, CloudAdapter],
               telemetry: Telemetry) -> list[Step]:
    """The plan checked against every limit (module docstring) and turned into one step per pool,
    each bounded by ``max_step``. Reads the groups (no change). Raises :class:`ActuationRefused`."""
    pools: list[tuple[int, str, CloudAdapter, PoolGroup, int]] = []
    models: dict[int, str] = {}
    seen: dict[tuple[str, str], int] = {}
    for i, pt in enumerate(plan.pools):
        provider = pt.offering_id.split(":", 1)[0]
        adapter = adapters.get(provider)
        group = adapter.group(pt.offering_id, pt.model) if adapter is not None else None
        if group is None:
            raise ActuationRefused(f"pools[{i}]: unknown pool {pt.offering_id}@{pt.model}: no group in "
                                   f"provider_options.{provider}.groups maps to it")
        if group.key in seen:
            raise ActuationRefused(f"pools[{i}]: its group '{group.group or group.tags}' ({group.label}) is already "
                                   f"pools[{seen[group.key]}]'s")
        seen[group.key] = i
        models[i] = pt.model
        pools.append((i, provider, adapter, group, pt.target))  # type: ignore[arg-type]

    cost = 0.0
    for i, _, _, group, target in pools:
        if target == 0:
            continue
        price = telemetry.price(group.offering_id)
        if price is None:
            raise ActuationRefused(f"pools[{i}].offering_id: {group.offering_id} has no price in the telemetry, "
                                   "so max_usd_per_hour cannot bound it")
        cost += target * price
    if cost > limits.max_usd_per_hour + 1e-9:
        raise ActuationRefused(f"max_usd_per_hour: the plan's targets cost {cost:.2f} USD/h at the telemetry's latest "
                               f"prices, above the limit {limits.max_usd_per_hour:.2f}")

    states = [(i, provider, adapter.group_state(group), target) for i, provider, adapter, group, target in pools]
    for i, _, st, target in states:
        if st.max_size is not None and target > st.max_size:
            raise ActuationRefused(f"pools[{i}].target: {target} is above the max size {st.max_size} of group "
                                   f"'{st.pool.group}' ({st.pool.label})")
        if st.min_size is not None and target < st.min_size:
            raise ActuationRefused(f"pools[{i}].target: {target} is below the min size {st.min_size} of group "
                                   f"'{st.pool.group}' ({st.pool.label})")
    _check_quotas([(i, st, target) for i, _, st, target in states], telemetry)

    steps = []
    for i, provider, st, target in states:
        delta = max(-limits.max_step, min(limits.max_step, target - st.desired))
        steps.append(Step(i, provider, models[i], st, target, st.desired + delta,
                          change_id(plan, st.pool.offering_id, models[i], target)))
    return steps


def _latest_quotas(quotas: pd.DataFrame | None) -> list[dict[str, object]]:
    if quotas is None or not len(quotas):
        return []
    q = quotas.sort_values("ts", kind="stable").groupby(["provider", "region", "quota_name"], sort=True).tail(1)
    return q.to_dict("records")  # type: ignore[return-value]


def _check_quotas(states: list[tuple[int, GroupState, int]], telemetry: Telemetry) -> None:
    """Every increase within the room of each quota covering its pool (module docstring)."""
    rows = _latest_quotas(telemetry.quotas)
    for i, st, target in states:
        if target <= st.desired:
            continue
        p = st.pool
        provider = p.offering_id.split(":", 1)[0]
        if not any(r["provider"] == provider and r["region"] == p.region for r in rows):
            raise ActuationRefused(f"pools[{i}].target: no quotas of {provider} {p.region} in the telemetry, so the "
                                   f"increase of {p.label} cannot be bounded (collect them: xroute telemetry collect)")
        if telemetry.takes(p.offering_id) is None:
            raise ActuationRefused(f"pools[{i}].offering_id: {p.offering_id} is not in the telemetry's offerings, so "
                                   "its quota use is unknown")
    for r in rows:
        patterns = [x.strip() for x in str(r.get("covers") or "").split(";") if x.strip()]
        covered = [(i, st, target) for i, st, target in states
                   if any(fnmatch.fnmatchcase(st.pool.offering_id, pat) for pat in patterns)]
        if not covered:
            continue
        unit = str(r["unit"]).strip().lower()
        need, held, first = 0.0, 0.0, None
        for i, st, target in covered:
            take = (telemetry.takes(st.pool.offering_id) or {}).get(unit, 1.0)
            held += st.desired * take
            if target > st.desired:
                need += (target - st.desired) * take
                first = i if first is None else first
        if first is None:
            continue
        usage = r.get("usage")
        used = held if usage is None or (isinstance(usage, float) and math.isnan(usage)) else float(usage)  # type: ignore[arg-type]
        room = float(r["limit"]) - used  # type: ignore[arg-type]
        if need > room + 1e-9:
            raise ActuationRefused(f"pools[{first}].target: the plan's increases need {need:g} {unit} of quota "
                                   f"'{r['quota_name']}' ({r['provider']} {r['region']}), which has {max(room, 0.0):g} "
                                   "left")


def apply_steps(steps: list[Step], adapters: Mapping[str, CloudAdapter], journal: Journal | None, *,
                dry_run: bool = True, reason: str = "", on_result: Callable[[Result], None] | None = None
                ) -> list[Result]:
    """Make the steps' changes, each journaled before and after (module docstring); ``dry_run``:
    none (and no journal needed). A failed change is recorded ``failed`` and the others go on."""
    emit = on_result or (lambda r: None)
    prior = journal.last([s.change_id for s in steps]) if journal is not None else {}
    out = []
    for s in steps:
        res = _one(s, adapters[s.provider], journal, prior.get(s.change_id), dry_run, reason)
        emit(res)
        out.append(res)
    return out


def _one(s: Step, adapter: CloudAdapter, journal: Journal | None, prior: CapacityChange | None, dry_run: bool,
         reason: str) -> Result:
    if prior is not None and prior.state == "applied":
        return Result(s, "already applied", prior.after, f"by an earlier run ({prior.before} -> {prior.after})")
    if prior is not None and s.before == prior.after and prior.after != prior.before:
        # the call went through; the run that made it died before recording it
        if not dry_run:
            assert journal is not None
            journal.record(_change(s, prior.before, prior.after, "applied", "found made on resume"))
        return Result(s, "found applied", prior.after, f"{prior.before} -> {prior.after}, made by an earlier run")
    if s.after == s.before:
        return Result(s, "unchanged", s.before)
    if dry_run:
        return Result(s, "would change", s.after)
    assert journal is not None, "a journal is needed to change anything"
    journal.record(_change(s, s.before, s.after, "intended", reason))
    try:
        adapter.set_capacity(s.pool, s.after)
    except (CloudError, ConfigError) as e:
        journal.record(_change(s, s.before, s.after, "failed", str(e)[:500]))
        return Result(s, "failed", s.before, str(e))
    journal.record(_change(s, s.before, s.after, "applied", reason))
    return Result(s, "applied", s.after)


def _change(s: Step, before: int, after: int, state: Literal["intended", "applied", "failed"],
            reason: str) -> CapacityChange:
    return CapacityChange(change_id=s.change_id, offering_id=s.pool.offering_id, model=s.model,
                          before=before, after=after, state=state, reason=reason[:500], at=datetime.now(UTC))
