"""Tenants, their quotas, roles and role bindings over HTTP (``docs/policies.md``, "Access
control"; ``docs/quotas.md``): the admin API that lists, creates, updates and deletes them, and
``GET /v1/whoami``.

Every change is checked (a 4xx naming the field), committed to the access store with its audit
entry (``router.control.access_store``) before it is answered, and installed here at once (the other
routers within ``policy_poll_s``). Permissions: ``admin:read|write:tenants`` (tenants),
``admin:read|write:quotas`` (quotas), ``admin:read|write:roles`` (roles and bindings)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse

from router.control.access_store import (
    AccessSync,
    delete_binding,
    delete_role,
    delete_tenant,
    put_binding,
    put_quotas,
    put_role,
    put_tenant,
    tenant_json,
)
from router.core.logs import request_id_var
from router.core.settings import TenantConfig
from router.decision.engine import RouteFailure
from router.http.deps import (
    Caller,
    CallerDep,
    ReadRoles,
    ReadTenants,
    WriteQuotas,
    WriteRoles,
    WriteTenants,
)
from router.http.errors import BODY_NOT_JSON_422
from router.store.policies import PolicyChangeError, PolicyStoreError
from xroute.schema.access import BUILTIN_ROLES, NAME_PATTERN, SUBJECT_PATTERN, Role, RoleBinding
from xroute.schema.decision import ErrorResponse
from xroute.schema.policy_ir import ConstraintError, compile_constraints
from xroute.schema.quota import TenantQuotas

router = APIRouter(prefix="/v1/admin", tags=["access"],
                   responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},  # type: ignore[dict-item]
                              413: {"model": ErrorResponse, "description": "request body too large"},
                              503: {"model": ErrorResponse, "description": "the access store cannot be reached"}})
whoami_router = APIRouter(prefix="/v1", tags=["access"])

Name = Annotated[str, PathParam(pattern=NAME_PATTERN)]
Subject = Annotated[str, PathParam(pattern=SUBJECT_PATTERN, description="key:<key id>, tenant:<name>, "
                                   "idp:<issuer>:<subject> or group:<name>")]
Version = Annotated[int | None, Query(ge=1, description="change only if this is the current version (else 409)")]
_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "no such object"},
    409: {"model": ErrorResponse, "description": "the version given is not the current one, a built-in role, or a "
                                                 "role still bound"},
    422: {"model": ErrorResponse, "description": BODY_NOT_JSON_422 + ", or a field is invalid (named in fields; a "
                                                 "value the catalog, the served models or the defined roles lack)"}}


def _sync(caller: Caller) -> AccessSync:
    sync = caller.svc.access
    if sync is None:
        raise RouteFailure(503, "unavailable", "the access store is not open")
    return sync  # type: ignore[no-any-return]


async def _write(caller: Caller, mutation: Any) -> Any:
    try:
        return await _sync(caller).write(f"key:{caller.who.key_id}", mutation, request_id_var.get())
    except PolicyChangeError as e:
        field = e.field
        where = (f"body.{field}" if field.startswith(("roles[", "grants[")) else
                 "query.version" if field == "version" else f"path.{field}" if field else "body")
        raise RouteFailure(e.status, e.error, e.message, [{"field": where, "message": e.message, "suggestions": []}]
                           ) from None
    except PolicyStoreError as e:
        raise RouteFailure(503, "unavailable", f"the access store cannot be written ({e}); nothing was changed",
                           headers={"Retry-After": "5"}) from None


def _invalid(field: str, problem: str, suggestions: list[str] | None = None, error: str = "invalid_tenant"
             ) -> RouteFailure:
    return RouteFailure(422, error, f"field '{field}': {problem}",
                        [{"field": field, "message": problem, "suggestions": suggestions or []}])


def _check_quotas(caller: Caller, q: TenantQuotas | None, prefix: str) -> None:
    if q is None:
        return
    models = caller.svc.engine.models
    for m in q.models:
        if m not in models:
            import difflib

            raise _invalid(f"{prefix}models.{m}", f"unknown model '{m}' (known: {', '.join(models)})",
                           difflib.get_close_matches(m, models, n=3, cutoff=0.4), "invalid_quota")


def _check_tenant(caller: Caller, name: str, cfg: TenantConfig) -> None:
    """What the settings check at start, for one tenant: its constraints against the catalog, its
    quotas' models, exploration only with the features logged, its gateway origin."""
    svc = caller.svc
    engine = svc.engine
    try:
        compile_constraints([("constraints", cfg.constraints)], engine.index)
    except ConstraintError as e:
        raise _invalid(f"body.{e.field}", e.problem, list(e.suggestions)) from None
    _check_quotas(caller, cfg.quotas, "body.quotas.")
    if cfg.explore_epsilon > 0 and not svc.settings.log_features:
        raise _invalid("body.explore_epsilon", "exploration needs log_features: true on the router")
    if cfg.gateway.origin is not None and cfg.gateway.origin not in engine.origin_set:
        raise _invalid("body.gateway.origin", f"unknown origin '{cfg.gateway.origin}' (GET /v1/offerings lists them)")
    gw = svc.gateway
    if cfg.gateway.store_prompts and (gw is None or gw.transcripts is None):
        raise _invalid("body.gateway.store_prompts", "this router opened no transcript store (no tenant of its "
                       "config keeps prompts); set it in the router config")


def _tenant_out(sync: AccessSync, name: str) -> dict[str, Any] | None:
    cfg = sync.tenants().get(name)
    if cfg is None:
        return None
    rec = sync.set.tenants.get(name)
    return {"name": name, "version": rec.version if rec is not None else 0,
            "source": "store" if rec is not None else "config", "config": tenant_json(cfg)}


# ---------------------------------------------------------------------------------------- tenants
@router.get("/tenants", summary="The tenants this router serves (admin:read:tenants)")
async def list_tenants(caller: ReadTenants) -> dict[str, Any]:
    """Each tenant with its config, its version (0: as the router config declares it, never
    changed through the API) and where it comes from (``config`` or ``store``)."""
    sync = _sync(caller)
    return {"version": sync.version, "tenants": [_tenant_out(sync, n) for n in sorted(sync.tenants())]}


@router.get("/tenants/{name}", responses=_ERRORS, summary="One tenant (admin:read:tenants)")
async def get_tenant(name: Name, caller: ReadTenants) -> dict[str, Any]:
    out = _tenant_out(_sync(caller), name)
    if out is None:
        raise RouteFailure(404, "not_found", f"no tenant named '{name}'")
    return out


@router.put("/tenants/{name}", responses={**_ERRORS, 201: {"description": "created"}},
            summary="Create or replace a tenant (admin:write:tenants)")
async def put_tenant_route(name: Name, body: TenantConfig, caller: WriteTenants, version: Version = None
                           ) -> JSONResponse:
    """The body is the tenant's whole config, as under ``tenants.<name>`` in the router config
    (constraints, explore_epsilon, gateway, quotas). 201 when it did not exist."""
    _check_tenant(caller, name, body)
    sync = _sync(caller)
    existed = name in sync.tenants()
    aset = await _write(caller, put_tenant(name, body, sync.base, version))
    return JSONResponse({"tenant": _tenant_out(sync, name), "access_version": aset.version},
                        status_code=200 if existed else 201)


@router.delete("/tenants/{name}", responses=_ERRORS, summary="Delete a tenant (admin:write:tenants)")
async def delete_tenant_route(name: Name, caller: WriteTenants, version: Version = None) -> dict[str, Any]:
    """Its keys are refused from then on (403 ``unknown_tenant``); its decisions stay in the log.
    A tenant of the router config is removed too (the store keeps that it was)."""
    sync = _sync(caller)
    aset = await _write(caller, delete_tenant(name, sync.base, version))
    return {"deleted": name, "access_version": aset.version}


# ---------------------------------------------------------------------------------------- quotas
@router.put("/quotas/{tenant}", responses=_ERRORS, summary="Set a tenant's quotas (admin:write:quotas)")
async def put_quotas_route(tenant: Name, body: TenantQuotas, caller: WriteQuotas, version: Version = None
                           ) -> dict[str, Any]:
    """The body is the tenant's whole quotas (``docs/quotas.md``); they apply to the next request
    on every router (``GET /v1/admin/quotas`` shows them with their usage)."""
    _check_quotas(caller, body, "body.")
    sync = _sync(caller)
    aset = await _write(caller, put_quotas(tenant, body, sync.base, version))
    return {"tenant": _tenant_out(sync, tenant), "access_version": aset.version}


@router.delete("/quotas/{tenant}", responses=_ERRORS, summary="Remove a tenant's quotas (admin:write:quotas)")
async def delete_quotas_route(tenant: Name, caller: WriteQuotas, version: Version = None) -> dict[str, Any]:
    sync = _sync(caller)
    aset = await _write(caller, put_quotas(tenant, None, sync.base, version))
    return {"tenant": _tenant_out(sync, tenant), "access_version": aset.version}


# ---------------------------------------------------------------------------------------- roles
def _role_out(name: str, role: Role | None) -> dict[str, Any]:
    if role is None:
        return {"name": name, "builtin": True, "grants": list(BUILTIN_ROLES[name]), "version": None,
                "description": "built in"}
    return {"name": name, "builtin": False, **role.model_dump(mode="json")}


@router.get("/roles", summary="Roles: built in and defined (admin:read:roles)")
async def list_roles(caller: ReadRoles) -> dict[str, Any]:
    sync = _sync(caller)
    roles = [_role_out(n, None) for n in BUILTIN_ROLES] + [_role_out(n, r) for n, r in sorted(sync.set.roles.items())]
    return {"version": sync.version, "roles": roles}


@router.get("/roles/{name}", responses=_ERRORS, summary="One role (admin:read:roles)")
async def get_role(name: Name, caller: ReadRoles) -> dict[str, Any]:
    if name in BUILTIN_ROLES:
        return _role_out(name, None)
    role = _sync(caller).set.roles.get(name)
    if role is None:
        raise RouteFailure(404, "not_found", f"no role named '{name}'")
    return _role_out(name, role)


@router.put("/roles/{name}", responses={**_ERRORS, 201: {"description": "created"}},
            summary="Create or update a role (admin:write:roles)")
async def put_role_route(name: Name, body: Role, caller: WriteRoles) -> JSONResponse:
    """``grants``: permissions (``xroute.schema.access``); with ``version``, only if it is the
    role's current version (else 409)."""
    sync = _sync(caller)
    existed = name in sync.set.roles
    aset = await _write(caller, put_role(name, body))
    return JSONResponse({"role": _role_out(name, aset.roles.get(name)), "access_version": aset.version},
                        status_code=200 if existed else 201)


@router.delete("/roles/{name}", responses=_ERRORS, summary="Delete a role (admin:write:roles)")
async def delete_role_route(name: Name, caller: WriteRoles, version: Version = None) -> dict[str, Any]:
    aset = await _write(caller, delete_role(name, version))
    return {"deleted": name, "access_version": aset.version}


@router.get("/bindings", summary="Role bindings (admin:read:roles)")
async def list_bindings(caller: ReadRoles) -> dict[str, Any]:
    sync = _sync(caller)
    return {"version": sync.version, "bindings": [{"subject": s, **b.model_dump(mode="json")}
                                                  for s, b in sorted(sync.set.bindings.items())]}


@router.put("/bindings/{subject}", responses={**_ERRORS, 201: {"description": "created"}},
            summary="Give roles to a subject (admin:write:roles)")
async def put_binding_route(subject: Subject, body: RoleBinding, caller: WriteRoles) -> JSONResponse:
    """The subject's whole list of roles (added to its key's own role); every role must exist."""
    sync = _sync(caller)
    existed = subject in sync.set.bindings
    aset = await _write(caller, put_binding(subject, body))
    b = aset.bindings[subject]
    return JSONResponse({"binding": {"subject": subject, **b.model_dump(mode="json")}, "access_version": aset.version},
                        status_code=200 if existed else 201)


@router.delete("/bindings/{subject}", responses=_ERRORS, summary="Remove a subject's roles (admin:write:roles)")
async def delete_binding_route(subject: Subject, caller: WriteRoles, version: Version = None) -> dict[str, Any]:
    aset = await _write(caller, delete_binding(subject, version))
    return {"deleted": subject, "access_version": aset.version}


@whoami_router.get("/whoami", responses={401: {"model": ErrorResponse}},  # type: ignore[dict-item]
                   summary="The caller: its tenant, key id, roles and what they grant")
async def whoami(caller: CallerDep) -> dict[str, Any]:
    who = caller.who
    return {"tenant": who.tenant, "key_id": who.key_id, "role": who.role,
            **caller.svc.engine.access.describe(who)}
