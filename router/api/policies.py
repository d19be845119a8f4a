"""The routing policies over HTTP (``docs/policies.md``): the admin API to list, read, create,
update and delete them, the audit log's read API, and ``POST /v1/explain`` -- why each offering is
or is not eligible for a request.

Every change goes through the one schema (``xroute.schema.policy_ir.Policy``), is checked against
this router's catalog (a value it lacks is a 422 naming the field, with close matches), is
committed to the policy store with its audit entry (``router.store.policies``) before it is
answered, and is installed here at once (the other routers within ``policy_poll_s``)."""

from __future__ import annotations

import difflib
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from router.core.logs import request_id_var
from router.decision.access import denied
from router.decision.engine import RouteFailure
from router.http.deps import Caller, InferenceDep, ReadAudit, ReadPolicies, WritePolicies
from router.http.errors import BODY_NOT_JSON_422
from router.store.policies import (
    PolicyChangeError,
    PolicyStoreError,
    create_policy,
    delete_policy,
    put_policy,
)
from xroute.schema.decision import ErrorResponse, RouteRequest
from xroute.schema.policy_ir import ConstraintError, Policy, PolicyBody, PolicySet, policy_set_error

router = APIRouter(prefix="/v1/admin", tags=["policies"],
                   responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},  # type: ignore[dict-item]
                              413: {"model": ErrorResponse, "description": "request body too large"},
                              503: {"model": ErrorResponse, "description": "the policy store cannot be reached"}})
explain_router = APIRouter(prefix="/v1", tags=["policies"])

PolicyName = Annotated[str, PathParam(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
_CHANGE_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "no such policy"},
    409: {"model": ErrorResponse, "description": "the policy exists already (create), or the version given is not "
                                                 "the current one"},
    422: {"model": ErrorResponse, "description": BODY_NOT_JSON_422 + ", a field is invalid, or names a value the "
                                                 "catalog lacks (close matches in suggestions)"}}


def principal(caller: Caller) -> str:
    """Who makes a change, as the audit log records it: the API key's id (never the key)."""
    return f"key:{caller.who.key_id}"


def _sync(caller: Caller) -> Any:
    sync = caller.svc.policies
    if sync is None:
        raise RouteFailure(503, "unavailable", "the policy store is not open")
    return sync


def _check(caller: Caller, policy: Policy) -> None:
    """``policy`` against the current set's named sets and this router's catalog: a 422 naming the
    body's field (``body.constraints.regions[0]``) with close matches."""
    engine = caller.svc.engine
    current = engine.policies.set
    try:
        ps = PolicySet(region_sets=current.region_sets, slo_tiers=current.slo_tiers, policies=[policy])
        engine.check_policies(ps)
    except ConstraintError as e:
        raise _invalid(e.field, e.problem, e.suggestions) from None
    except ValueError as e:  # (pydantic's ValidationError: a region set the store does not define)
        err = policy_set_error(e)
        raise _invalid(err.field, err.problem) from None


def _invalid(field: str, problem: str, suggestions: list[str] | None = None) -> RouteFailure:
    field = field.removeprefix("policies[0]").removeprefix(".")
    return RouteFailure(422, "invalid_policy", f"field 'body.{field}': {problem}",
                        [{"field": f"body.{field}" if field else "body", "message": problem,
                          "suggestions": suggestions or []}])


async def _write(caller: Caller, mutation: Any) -> PolicySet:
    try:
        return await _sync(caller).write(principal(caller), mutation, request_id_var.get())  # type: ignore[no-any-return]
    except PolicyChangeError as e:
        raise change_failure(e) from None
    except PolicyStoreError as e:
        raise RouteFailure(503, "unavailable", f"the policy store cannot be written ({e}); nothing was changed",
                           headers={"Retry-After": "5"}) from None


def change_failure(e: PolicyChangeError) -> RouteFailure:
    """A change the store refused, in the error shape: the field of the body it names (``canary``:
    the canary running, no field of the body)."""
    field = e.field if not e.field.startswith("policies[") else e.field.split(".", 1)[-1]
    name = "canary" if field == "canary" else f"body.{field}" if field else "body"
    return RouteFailure(e.status, e.error, e.message, [{"field": name, "message": e.message, "suggestions": []}])


def _set_json(ps: PolicySet) -> dict[str, Any]:
    return ps.model_dump(mode="json", exclude_none=True)


@router.get("/policies", summary="The routing policy set in force (admin)")
async def list_policies(caller: ReadPolicies) -> dict[str, Any]:
    """The set this router decides with: its version, named region sets, SLO tiers, prefer mode
    and policies (each with its own version)."""
    return _set_json(caller.svc.engine.policies.set)


@router.get("/policies/{name}", responses=_CHANGE_ERRORS, summary="One routing policy (admin)")
async def get_policy(name: PolicyName, caller: ReadPolicies) -> dict[str, Any]:
    p = caller.svc.engine.policies.set.policy(name)
    if p is None:
        raise RouteFailure(404, "not_found", f"no policy named '{name}'")
    return p.model_dump(mode="json", exclude_none=True)


@router.post("/policies", status_code=201, responses=_CHANGE_ERRORS, summary="Create a routing policy (admin)")
async def create(body: Policy, caller: WritePolicies) -> dict[str, Any]:
    """201 with the policy at version 1 and the set's new version; 409 if the name exists."""
    _check(caller, body)
    ps = await _write(caller, create_policy(body))
    return {"policy": _policy_out(ps, body.name), "set_version": ps.version}


@router.put("/policies/{name}", responses={**_CHANGE_ERRORS, 201: {"description": "created"}},
            summary="Create or update a routing policy (admin)")
async def update(name: PolicyName, body: PolicyBody, caller: WritePolicies) -> JSONResponse:
    """The body is the whole policy but its name (the path's). With ``version``, the update
    applies only if it is the policy's current version (else 409: read it again); an unchanged
    policy is not a new version."""
    policy = body.named(name)
    _check(caller, policy)
    existed = caller.svc.engine.policies.set.policy(name) is not None
    ps = await _write(caller, put_policy(policy))
    return JSONResponse({"policy": _policy_out(ps, name), "set_version": ps.version}, status_code=200 if existed else 201)


@router.delete("/policies/{name}", responses=_CHANGE_ERRORS, summary="Delete a routing policy (admin)")
async def delete(name: PolicyName, caller: WritePolicies,
                 version: Annotated[int | None, Query(ge=1, description="delete only if this is the current "
                                                                        "version (else 409)")] = None
                 ) -> dict[str, Any]:
    ps = await _write(caller, delete_policy(name, version))
    return {"deleted": name, "set_version": ps.version}


def _policy_out(ps: PolicySet, name: str) -> dict[str, Any] | None:
    p = ps.policy(name)
    return None if p is None else p.model_dump(mode="json", exclude_none=True)


@router.get("/audit", summary="The audit log: who changed what, before and after, when (admin)")
async def read_audit(
    caller: ReadAudit,
    kind: Annotated[str | None, Query(max_length=64, description="only this kind: policy, policy_set, policy_files")] = None,
    resource: Annotated[str | None, Query(max_length=200, description="only this resource (a policy's name)")] = None,
    after: Annotated[int, Query(ge=0, description="entries after this audit_id (paging)")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    """Entries oldest first; page with ``after`` = the last ``audit_id`` seen (``next_after``)."""
    import asyncio

    sync = _sync(caller)
    try:
        entries = await asyncio.to_thread(sync.store.audit, kind, resource, after, limit)
    except PolicyStoreError as e:
        raise RouteFailure(503, "unavailable", f"the audit log cannot be read ({e})",
                           headers={"Retry-After": "5"}) from None
    return {"entries": entries, "next_after": entries[-1]["audit_id"] if entries else after}


@explain_router.post("/explain", responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},  # type: ignore[dict-item]
                                            413: {"model": ErrorResponse, "description": "request body too large"},
                                            422: {"model": ErrorResponse,
                                                  "description": BODY_NOT_JSON_422 + ", or a field is invalid"}},
                     summary="Why each offering is or is not eligible for a request")
async def explain(body: RouteRequest, caller: InferenceDep,
                  tenant: Annotated[str | None, Query(max_length=64, description="admin keys: explain for this "
                                                                                  "tenant (default: the key's)")] = None,
                  ) -> dict[str, Any]:
    """The request as ``POST /v1/route`` would take it -- nothing is decided, reserved or logged:
    for every offering, whether it is eligible now and, if not, the first reason (the tenant's or
    the request's constraints, the routing policy that excluded it, or the pool's state), its
    policy bias and the prefer policies that gave it, and the numbers the policies read."""
    who = caller.who.tenant
    if tenant is not None and tenant != who:
        if not caller.svc.engine.access.permissions(caller.who).allows("admin:read:tenants"):
            raise RouteFailure(**denied(caller.who, "admin:read:tenants", "explaining for another tenant"))
        who = tenant
    # the caller's permissions mask regions as on /v1/route; explaining for another tenant shows that tenant's view
    return caller.svc.engine.explain(body, who, time.time(), caller.who if who == caller.who.tenant else None)


class Draft(BaseModel):
    """A proposed policy change: policies created or replaced (``put``, by name) and deleted
    (``delete``) on top of the set in force -- or a whole proposed ``policy_set`` instead."""

    model_config = ConfigDict(extra="forbid")

    put: list[Policy] = Field(default_factory=list, max_length=500, description="policies created or replaced")
    delete: list[str] = Field(default_factory=list, max_length=500, description="names of policies removed")
    policy_set: PolicySet | None = Field(None, description="the whole proposed set (instead of put/delete)")


class DryRunBody(Draft):
    """A proposed policy change (:class:`Draft`) tried on the last ``last`` decisions."""

    last: int = Field(200, ge=1, le=5000, description="how many of the latest decisions to judge")
    sample: int = Field(10, ge=0, le=100, description="changed decisions listed")


def proposed_set(caller: Caller, body: Draft) -> PolicySet:
    """The whole set ``body`` proposes, checked against this router's catalog (a 422
    ``invalid_policy`` naming the body's field, with close matches)."""
    current = caller.svc.engine.policies.set
    if body.policy_set is not None:
        if body.put or body.delete:
            raise _invalid("policy_set", "give policy_set, or put/delete -- not both")
        if body.policy_set.canary is not None:
            raise _invalid("policy_set.canary", "a proposed set cannot hold a canary")
        ps = body.policy_set
    else:
        names = {p.name for p in current.policies}
        for i, name in enumerate(body.delete):
            if name not in names:
                raise RouteFailure(422, "invalid_policy", f"field 'body.delete[{i}]': no policy named '{name}'",
                                   [{"field": f"body.delete[{i}]", "message": f"no policy named '{name}'",
                                     "suggestions": difflib.get_close_matches(name, sorted(names), n=3)}])
        put = {p.name: p for p in body.put}
        policies = [put.pop(p.name, p) for p in current.policies if p.name not in body.delete]
        data = {**current.model_dump(mode="json", exclude_none=True, exclude={"canary"}),
                "policies": [p.model_dump(mode="json", exclude_none=True) for p in [*policies, *put.values()]]}
        try:
            ps = PolicySet.model_validate(data)
        except ValueError as e:
            err = policy_set_error(e)
            raise _invalid(err.field.replace("policies[", "put["), err.problem) from None
    try:
        caller.svc.engine.check_policies(ps)
    except ConstraintError as e:
        raise _invalid(_put_field(ps, body, e.field), e.problem, e.suggestions) from None
    return ps


def _put_field(ps: PolicySet, body: Draft, field: str) -> str:
    """A field of the proposed set (``policies[3].constraints...``) as the body names it."""
    if body.policy_set is not None:
        return f"policy_set.{field}"
    head, sep, rest = field.partition("].")
    if head.startswith("policies[") and sep:
        name = ps.policies[int(head[len("policies["):])].name
        for j, p in enumerate(body.put):
            if p.name == name:
                return f"put[{j}].{rest}"
    return field


@router.post("/policies/dry-run", responses={422: {"model": ErrorResponse,  # type: ignore[dict-item]
                                                   "description": BODY_NOT_JSON_422 + ", a field is invalid, or names "
                                                                  "a value the catalog lacks"}},
             summary="How a policy change would have changed the last N decisions (admin:read:policies and "
                     "admin:read:decisions)")
async def dry_run_route(body: DryRunBody, caller: ReadPolicies) -> dict[str, Any]:
    """Nothing is applied. Each of the last ``last`` decisions judged under the set in force and
    under the proposed one (``router.service.dry_run``): how many would be ``excluded`` (routed to another
    offering), ``refused`` (no offering left), ``rebiased`` or ``unchanged``, and a sample of the
    changed ones."""
    import asyncio

    from router.service.dry_run import dry_run, recent_decisions

    if not caller.svc.engine.access.permissions(caller.who).allows("admin:read:decisions"):
        raise RouteFailure(**denied(caller.who, "admin:read:decisions", "a dry run (it reads every tenant's "
                                    "decisions)"))
    ps = proposed_set(caller, body)
    try:
        rows = await asyncio.to_thread(recent_decisions, caller.svc.settings.log_target, body.last)
    except Exception as e:
        raise RouteFailure(503, "unavailable", f"the decision log cannot be read ({type(e).__name__})",
                           headers={"Retry-After": "5"}) from None
    return dry_run(caller.svc.engine, ps, rows, body.sample)
