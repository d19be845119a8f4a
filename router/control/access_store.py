"""Tenants, their quotas, roles and role bindings as versioned documents on the decision log's
backends -- the same store machinery as the routing policies (``router.store.policies``: one
immutable row per version, the changes' audit entries in the same transaction, writers serialized
on every host) in a table of its own, ``access_versions`` -- and the sync that swaps each new
version into a router between two decisions (``router.control.policy_sync``'s, reused).

**Tenants.** The router config's ``tenants:`` are the base; the store's tenant records overlay it
by name: a record with a ``config`` replaces (or adds) that tenant, a record without one (a
*tombstone*, what deleting a tenant the config declares leaves) removes it. The tenants a router
serves are that overlay (:func:`effective_tenants`). A tenant's quotas are part of its config; the
quota API changes only that part (audited as kind ``quota``).

**Roles and bindings** (``xroute.schema.access``): a role is a named list of permissions; a binding
gives roles to a subject (``key:<key id>``, ``tenant:<name>``, and the reserved identity-provider
forms). The built-in roles ``tenant`` and ``admin`` can be neither defined nor deleted.

Every change bumps the document's version, the changed object's own ``version`` (1 on create), and
writes an audit entry (who, what, before/after, when) in the same transaction; a ``version`` given
with an update must be the current one (409).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from router.control.policy_sync import PolicySync
from router.core.logs import LOG
from router.core.settings import TenantConfig
from router.decision.access import AccessControl
from router.decision.engine import RoutingEngine
from router.store import audit
from router.store.policies import PolicyChangeError, PolicyStore
from xroute.schema.access import BUILTIN_ROLES, PermissionError_, Role, RoleBinding
from xroute.schema.quota import TenantQuotas


class TenantRecord(BaseModel):
    """A tenant as the store holds it: its config (None: removed -- a tombstone over the router
    config's tenant of that name) and its version."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=1)
    config: TenantConfig | None = None


class AccessSet(BaseModel):
    """One version of the access store's document."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = 0
    tenants: dict[str, TenantRecord] = Field(default_factory=dict)
    roles: dict[str, Role] = Field(default_factory=dict)
    bindings: dict[str, RoleBinding] = Field(default_factory=dict)


class AccessStore(PolicyStore):
    """:class:`~router.store.policies.PolicyStore`'s machinery over ``access_versions`` (its table
    created with the policies' and the audit log's: ``PolicyStore.schema``)."""

    TABLE = "access_versions"
    DOC = AccessSet


def effective_tenants(base: Mapping[str, TenantConfig], aset: AccessSet) -> dict[str, TenantConfig]:
    """The tenants a router serves: the config's, overlaid by the store's records (module docstring)."""
    out = dict(base)
    for name, rec in aset.tenants.items():
        if rec.config is None:
            out.pop(name, None)
        else:
            out[name] = rec.config
    return out


def tenant_json(cfg: TenantConfig | None) -> dict[str, Any] | None:
    return None if cfg is None else cfg.model_dump(mode="json", exclude_defaults=True)


def _check_version(kind: str, name: str, given: int | None, current: int | None) -> None:
    if given is not None and current != given:
        have = "it does not exist" if current is None else f"the current version is {current}"
        raise PolicyChangeError(409, "version_conflict", f"{kind} '{name}': version {given} was given, but {have}; "
                                "read it again and retry", "version")


Mutation = Callable[[AccessSet], tuple[AccessSet, list[audit.Change]]]


def _with(aset: AccessSet, **parts: Any) -> AccessSet:
    return aset.model_copy(update=parts)


# ---------------------------------------------------------------------------------------- tenants
def put_tenant(name: str, cfg: TenantConfig, base: Mapping[str, TenantConfig], version: int | None = None,
               kind: str = "tenant") -> Mutation:
    """Create or replace tenant ``name`` (``kind`` ``quota``: only its quotas changed)."""
    def mutate(aset: AccessSet) -> tuple[AccessSet, list[audit.Change]]:
        old = effective_tenants(base, aset).get(name)
        rec = aset.tenants.get(name)
        current = None if old is None else (rec.version if rec is not None else 0)
        _check_version("tenant", name, version, current)
        if old is not None and tenant_json(old) == tenant_json(cfg):
            return aset, []
        new = TenantRecord(version=(rec.version if rec is not None else 0) + 1, config=cfg)
        if kind == "quota":
            before = None if old is None or old.quotas is None else old.quotas.model_dump(mode="json",
                                                                                          exclude_none=True)
            after = None if cfg.quotas is None else cfg.quotas.model_dump(mode="json", exclude_none=True)
            change = audit.Change("delete" if after is None else ("update" if before is not None else "create"),
                                  "quota", name, before, after)
        else:
            change = audit.Change("update" if old is not None else "create", "tenant", name, tenant_json(old),
                                  tenant_json(cfg))
        return _with(aset, tenants={**aset.tenants, name: new}), [change]
    return mutate


def delete_tenant(name: str, base: Mapping[str, TenantConfig], version: int | None = None) -> Mutation:
    def mutate(aset: AccessSet) -> tuple[AccessSet, list[audit.Change]]:
        old = effective_tenants(base, aset).get(name)
        if old is None:
            raise PolicyChangeError(404, "not_found", f"no tenant named '{name}'", "name")
        rec = aset.tenants.get(name)
        _check_version("tenant", name, version, rec.version if rec is not None else 0)
        tenants = dict(aset.tenants)
        if name in base:  # a tombstone over the config's tenant
            tenants[name] = TenantRecord(version=(rec.version if rec is not None else 0) + 1, config=None)
        else:
            tenants.pop(name, None)
        return _with(aset, tenants=tenants), [audit.Change("delete", "tenant", name, tenant_json(old), None)]
    return mutate


def put_quotas(name: str, quotas: TenantQuotas | None, base: Mapping[str, TenantConfig],
               version: int | None = None) -> Mutation:
    """Set (or, with None, remove) tenant ``name``'s quotas; 404 when the tenant does not exist."""
    def mutate(aset: AccessSet) -> tuple[AccessSet, list[audit.Change]]:
        old = effective_tenants(base, aset).get(name)
        if old is None:
            raise PolicyChangeError(404, "not_found", f"no tenant named '{name}' (create it first: PUT "
                                    f"/v1/admin/tenants/{name})", "tenant")
        if quotas is None and old.quotas is None:
            raise PolicyChangeError(404, "not_found", f"tenant '{name}' has no quotas", "tenant")
        return put_tenant(name, old.model_copy(update={"quotas": quotas}), base, version, kind="quota")(aset)
    return mutate


# ---------------------------------------------------------------------------------------- roles
def put_role(name: str, role: Role) -> Mutation:
    def mutate(aset: AccessSet) -> tuple[AccessSet, list[audit.Change]]:
        if name in BUILTIN_ROLES:
            raise PolicyChangeError(409, "builtin_role", f"role '{name}' is built in and cannot be redefined", "name")
        try:
            role.check()
        except PermissionError_ as e:
            field, _, problem = e.problem.partition(": ")
            raise PolicyChangeError(422, "invalid_role", f"field 'body.{field}': {problem}", field) from None
        old = aset.roles.get(name)
        _check_version("role", name, role.version, None if old is None else old.version)
        if old is not None and old.content() == role.content():
            return aset, []
        new = role.model_copy(update={"version": 1 if old is None else (old.version or 0) + 1})
        return (_with(aset, roles={**aset.roles, name: new}),
                [audit.Change("update" if old is not None else "create", "role", name,
                              None if old is None else old.model_dump(mode="json"), new.model_dump(mode="json"))])
    return mutate


def delete_role(name: str, version: int | None = None) -> Mutation:
    def mutate(aset: AccessSet) -> tuple[AccessSet, list[audit.Change]]:
        if name in BUILTIN_ROLES:
            raise PolicyChangeError(409, "builtin_role", f"role '{name}' is built in and cannot be deleted", "name")
        old = aset.roles.get(name)
        if old is None:
            raise PolicyChangeError(404, "not_found", f"no role named '{name}'", "name")
        _check_version("role", name, version, old.version)
        bound = sorted(s for s, b in aset.bindings.items() if name in b.roles)
        if bound:
            raise PolicyChangeError(409, "role_in_use", f"role '{name}' is bound to {', '.join(bound[:5])}"
                                    + (" ..." if len(bound) > 5 else "") + "; change those bindings first", "name")
        roles = {k: v for k, v in aset.roles.items() if k != name}
        return _with(aset, roles=roles), [audit.Change("delete", "role", name, old.model_dump(mode="json"), None)]
    return mutate


def put_binding(subject: str, binding: RoleBinding) -> Mutation:
    def mutate(aset: AccessSet) -> tuple[AccessSet, list[audit.Change]]:
        known = sorted({*BUILTIN_ROLES, *aset.roles})
        for i, r in enumerate(binding.roles):
            if r not in known:
                raise PolicyChangeError(422, "invalid_binding", f"field 'body.roles[{i}]': unknown role '{r}' (known: "
                                        f"{', '.join(known)})", f"roles[{i}]")
        old = aset.bindings.get(subject)
        _check_version("binding", subject, binding.version, None if old is None else old.version)
        if old is not None and old.content() == binding.content():
            return aset, []
        new = binding.model_copy(update={"version": 1 if old is None else (old.version or 0) + 1})
        return (_with(aset, bindings={**aset.bindings, subject: new}),
                [audit.Change("update" if old is not None else "create", "role_binding", subject,
                              None if old is None else old.model_dump(mode="json"), new.model_dump(mode="json"))])
    return mutate


def delete_binding(subject: str, version: int | None = None) -> Mutation:
    def mutate(aset: AccessSet) -> tuple[AccessSet, list[audit.Change]]:
        old = aset.bindings.get(subject)
        if old is None:
            raise PolicyChangeError(404, "not_found", f"no binding for '{subject}'", "subject")
        _check_version("binding", subject, version, old.version)
        bindings = {k: v for k, v in aset.bindings.items() if k != subject}
        return (_with(aset, bindings=bindings),
                [audit.Change("delete", "role_binding", subject, old.model_dump(mode="json"), None)])
    return mutate


# ---------------------------------------------------------------------------------------- the sync
class AccessSync(PolicySync):
    """The engine's tenants and access control, from the access store: :class:`PolicySync`'s loop
    (poll the head every ``poll_s``, read and compile a new version off the event loop, swap it in
    between two decisions; a change made here is installed at once)."""

    def __init__(self, engine: RoutingEngine, store: AccessStore, base: Mapping[str, TenantConfig],
                 poll_s: float = 1.0):
        super().__init__(engine, store, (), poll_s)
        self.base = dict(base)
        self.version = -1
        self.set = AccessSet()
        #: the tenants of the installed version this router cannot serve, with why (``_prepare``)
        self.not_served: list[str] = []
        #: called with the new tenants after each install (the gateway's per-tenant defaults)
        self.on_install: list[Callable[[dict[str, TenantConfig]], None]] = []

    async def start(self) -> None:
        await self.check()

    async def flush_tallies(self) -> None:
        """(The canary's counts are the policy sync's to write.)"""

    async def check(self) -> bool:
        head = await asyncio.to_thread(self.store.head)
        if head <= self.version:
            return False
        aset = await asyncio.to_thread(self.store.at, head)
        return await self.install(aset)

    def tenants(self, aset: AccessSet | None = None) -> dict[str, TenantConfig]:
        return effective_tenants(self.base, self.set if aset is None else aset)

    async def install(self, aset: Any) -> bool:
        async with self._lock:
            if aset.version <= self.version:
                return False
            tenants = self.tenants(aset)
            prepared, bad = await asyncio.to_thread(self._prepare, tenants)
            if bad:  # written through a router with another catalog: those tenants are not served here
                LOG.warning("tenants naming values this router's catalog or models lack are not served here",
                            extra={"fields": {"version": aset.version, "tenants": bad}})
            self.not_served = bad
            access = AccessControl(aset.roles, aset.bindings, self.engine.refs, aset.version)
            if aset.version <= self.version:
                return False
            self.engine.install_tenants(prepared)
            self.engine.install_access(access)
            self.set, self.version = aset, aset.version
            for cb in self.on_install:
                cb(tenants)
            self.swaps += 1
            if aset.version:
                LOG.info("tenants and access control installed", extra={"fields": {
                    "version": aset.version, "tenants": len(tenants), "roles": len(aset.roles),
                    "bindings": len(aset.bindings)}})
            return True

    def _prepare(self, tenants: dict[str, TenantConfig]) -> tuple[dict[str, Any], list[str]]:
        """The tenants compiled (``RoutingEngine.prepare_tenants``); a tenant that does not compile
        here (a constraint value or a quota's model this router lacks) is left out -- its keys are
        refused, fail closed -- and named."""
        try:
            return self.engine.prepare_tenants(tenants), []
        except Exception:
            pass
        bad: list[str] = []
        for name, cfg in tenants.items():
            try:
                self.engine.prepare_tenants({name: cfg})
            except Exception as e:
                bad.append(f"{name}: {type(e).__name__}: {e}"[:200])
        names = {b.split(":", 1)[0] for b in bad}
        return self.engine.prepare_tenants({n: c for n, c in tenants.items() if n not in names}), bad

    async def write(self, principal: str, mutation: Any, request_id: str | None = None) -> Any:
        aset = await asyncio.to_thread(self.store.change, principal, mutation, request_id)
        await self.install(aset)
        return aset

    def describe(self) -> dict[str, Any]:
        return {"store": self.store.describe(), "backend": self.store.dialect, "version": self.version,
                "tenants": len(self.tenants()), "roles": len(self.set.roles), "bindings": len(self.set.bindings),
                "swaps": self.swaps, "error": self.last_error, "not_served": self.not_served, "poll_s": self.poll_s}
