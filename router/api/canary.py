"""Policy rollouts by canary over HTTP (``docs/policies.md``, "Canary rollouts"): start one, change
its share, compare its arms, promote it or roll it back.

Every step is a change of the policy store (``router.store.policies``: ``start_canary``,
``canary_share``, ``promote_canary``, ``rollback_canary``) -- a new version of the set, its audit
entries in the same transaction, durable before the answer, installed here at once and by every
router sharing the store within ``policy_poll_s`` -- so nothing is half-applied: a refused step
writes nothing. Writing needs ``admin:write:policies``; reading (the canary, the comparison)
``admin:read:policies``.

JSON shapes (the answers):

* the canary (``canary``): ``id``, ``key`` (``tenant`` | ``session`` | ``request``), ``share``
  (percent), ``version`` (the store version that started it), ``base_version`` (the stable version
  it was drafted from), ``started_at``, ``principal``, ``description``, ``diff`` (``added``,
  ``changed``, ``removed``: policy names; ``sections``: the changed sections of ``region_sets``,
  ``slo_tiers``, ``prefer_mode``) and ``policy_set`` (the canary arm's whole set);
* every write: ``{"set_version": N, "canary": <the canary or null>}`` (promote and rollback add
  ``promoted`` / ``rolled_back``: the canary's id);
* the comparison: ``router.service.canary.compare``'s ``window``, ``arms`` and ``delta``, with the
  canary's ``id``, ``running`` and ``set_version``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from router.api.policies import Draft, _invalid, change_failure, principal, proposed_set
from router.core.logs import iso, request_id_var
from router.decision.engine import RouteFailure
from router.http.deps import Caller, ReadPolicies, WritePolicies
from router.http.errors import BODY_NOT_JSON_422
from router.service.canary import arm_rows, compare
from router.store.policies import (
    Mutation,
    PolicyChangeError,
    PolicyStoreError,
    canary_share,
    promote_canary,
    rollback_canary,
    start_canary,
)
from xroute.schema.decision import ErrorResponse
from xroute.schema.policy_ir import Canary, Name, PolicySet

router = APIRouter(prefix="/v1/admin/canary", tags=["policies"],
                   responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},  # type: ignore[dict-item]
                              413: {"model": ErrorResponse, "description": "request body too large"},
                              503: {"model": ErrorResponse, "description": "the policy store cannot be reached"}})

_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorResponse, "description": "a canary is running already (start: `canary_running`, naming it), "
                                                 "none is running (`no_canary`), or `id` names another one "
                                                 "(`canary_conflict`)"},
    422: {"model": ErrorResponse, "description": BODY_NOT_JSON_422 + ", a field is invalid (`share` outside (0, 100], "
                                                 "an unknown `key`), or the draft is (`invalid_policy`, naming the "
                                                 "body's field, with close matches)"}}


class CanaryStart(Draft):
    """A canary: the draft (``put``/``delete`` on top of the stable set, or a whole ``policy_set``)
    decides ``share`` percent of the traffic, selected by the hash of ``key``."""

    key: Annotated[str, Field(pattern=r"^(tenant|session|request)$",
                              description="what selects a request's arm: tenant, session or request")]
    share: float = Field(gt=0, le=100, description="percent of the keys the canary decides, in (0, 100]")
    id: Name | None = Field(None, description="the canary's id (default canary-<version>)")
    description: str = Field("", max_length=1000)


class CanaryShare(BaseModel):
    model_config = ConfigDict(extra="forbid")

    share: float = Field(gt=0, le=100, description="percent of the keys the canary decides, in (0, 100]")
    id: Name | None = Field(None, description="only if this is the canary running (else 409)")


class CanaryEnd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Name | None = Field(None, description="only if this is the canary running (else 409)")


def _sync(caller: Caller) -> Any:
    sync = caller.svc.policies
    if sync is None:
        raise RouteFailure(503, "unavailable", "the policy store is not open")
    return sync


def diff(stable: PolicySet, draft: PolicySet) -> dict[str, list[str]]:
    """What ``draft`` changes of ``stable``: policy names added, changed, removed; sections changed."""
    olds = {p.name: p for p in stable.policies}
    news = {p.name: p for p in draft.policies}
    a, b = stable.model_dump(mode="json"), draft.model_dump(mode="json")
    return {"added": sorted(n for n in news if n not in olds),
            "changed": sorted(n for n, p in news.items() if n in olds and olds[n].content() != p.content()),
            "removed": sorted(n for n in olds if n not in news),
            "sections": [k for k in ("region_sets", "slo_tiers", "prefer_mode") if a[k] != b[k]]}


def canary_view(stable: PolicySet, c: Canary | None) -> dict[str, Any] | None:
    """The canary as the API answers it (module docstring)."""
    if c is None:
        return None
    return {"id": c.id, "key": c.key, "share": c.share, "version": c.version, "base_version": c.base_version,
            "started_at": iso(c.started_at), "principal": c.principal, "description": c.description,
            "diff": diff(stable, c.policy_set),
            "policy_set": c.policy_set.model_dump(mode="json", exclude_none=True)}


async def _change(caller: Caller, mutation: Mutation) -> PolicySet:
    try:
        return await _sync(caller).write(principal(caller), mutation, request_id_var.get())  # type: ignore[no-any-return]
    except PolicyChangeError as e:
        raise change_failure(e) from None
    except PolicyStoreError as e:
        raise RouteFailure(503, "unavailable", f"the policy store cannot be written ({e}); nothing was changed",
                           headers={"Retry-After": "5"}) from None


def _answer(ps: PolicySet, **extra: Any) -> dict[str, Any]:
    return {"set_version": ps.version, "canary": canary_view(ps, ps.canary), **extra}


@router.get("", summary="The canary rollout running, if any (admin:read:policies)")
async def get_canary(caller: ReadPolicies) -> dict[str, Any]:
    """``{"set_version", "canary"}``: the canary of the set this router decides with (null: none)."""
    return _answer(caller.svc.engine.policies.set)


@router.post("", status_code=201, responses=_WRITE_ERRORS,
             summary="Start a canary: a draft policy set decides a share of the traffic (admin:write:policies)")
async def start(body: CanaryStart, caller: WritePolicies) -> dict[str, Any]:
    """201 with the canary and the set's new version. The draft is checked as a dry run's is
    (422 ``invalid_policy`` naming the field); a draft that changes nothing is a 422; a canary
    running already is a 409 naming it."""
    draft = proposed_set(caller, body)
    stable = caller.svc.engine.policies.set
    if not any(diff(stable, draft).values()):
        raise _invalid("", "the draft is the stable set: a canary would change nothing")
    ps = await _change(caller, start_canary(draft, body.key, body.share, body.id, principal(caller),
                                            body.description))
    return _answer(ps)


@router.patch("", responses=_WRITE_ERRORS, summary="Change the canary's share (admin:write:policies)")
async def share(body: CanaryShare, caller: WritePolicies) -> dict[str, Any]:
    """The same id, so the same hash: the keys in the canary at a lower share stay in it at a
    higher one. An unchanged share makes no version."""
    return _answer(await _change(caller, canary_share(body.share, body.id)))


@router.post("/promote", responses=_WRITE_ERRORS,
             summary="Promote the canary: its set becomes the stable one (admin:write:policies)")
async def promote(caller: WritePolicies, body: CanaryEnd | None = None) -> dict[str, Any]:
    return await _end(caller, body, promote_canary, "promoted")


@router.post("/rollback", responses=_WRITE_ERRORS,
             summary="Roll the canary back: the stable set decides everything again (admin:write:policies)")
async def rollback(caller: WritePolicies, body: CanaryEnd | None = None) -> dict[str, Any]:
    return await _end(caller, body, rollback_canary, "rolled_back")


async def _end(caller: Caller, body: CanaryEnd | None, step: Callable[[str | None], Mutation],
               said: str) -> dict[str, Any]:
    """Promote or roll back (``step``: the store's change) the canary ``body`` names, else the one
    running; the answer names the canary under ``said``."""
    running = caller.svc.engine.policies.set.canary
    ps = await _change(caller, step(body.id if body else None))
    return _answer(ps, **{said: body.id if body and body.id else (running.id if running else None)})


@router.get("/compare", responses={409: {"model": ErrorResponse, "description": "no canary running and no `id`"}},
            summary="The canary's arms side by side (admin:read:policies)")
async def compare_arms(
    caller: ReadPolicies,
    id: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                                    description="a canary's id (default: the one running; an ended one's too)")] = None,
    window: Annotated[int, Query(ge=1, le=1_000_000, description="each arm's latest decisions read")] = 10_000,
) -> dict[str, Any]:
    """Per arm, over the decisions made while the canary ran (each arm's latest ``window``):
    decisions, feedback, SLO attainment, expected and observed cost per request, failed attempts,
    exclusions by reason, refusals by error; and the canary's minus the stable arm's (``delta``).
    Bounded: one indexed query per arm; ``complete`` says whether the window held all of them."""
    sync = _sync(caller)
    running = caller.svc.engine.policies.set.canary
    cid = id if id is not None else running.id if running is not None else None
    if cid is None:
        raise RouteFailure(409, "no_canary", "no canary is running (name an ended one with ?id=)",
                           [{"field": "query.id", "message": "no canary is running", "suggestions": []}])
    try:
        await sync.flush_tallies()
        tallies = await asyncio.to_thread(sync.store.tallies, cid)
        rows = await asyncio.to_thread(arm_rows, caller.svc.settings.log_target, cid, window)
    except PolicyStoreError as e:
        raise RouteFailure(503, "unavailable", f"the policy store cannot be read ({e})",
                           headers={"Retry-After": "5"}) from None
    except Exception as e:
        raise RouteFailure(503, "unavailable", f"the decision log cannot be read ({type(e).__name__})",
                           headers={"Retry-After": "5"}) from None
    out = compare(cid, rows, tallies, window)
    return {"id": cid, "running": running is not None and running.id == cid,
            "set_version": caller.svc.engine.policy_version, **out}
