"""Access control on every call (``docs/policies.md``, "Access control"): a caller's roles, their
grants compiled, and the checks -- ``admin:<verb>:<kind>`` on every admin route
(``router.http.deps.admin_dep``), ``model:inference:<model>:<region>`` on every routing decision
(``RoutingEngine.rank``: the regions a caller may not use are masked out like a deny policy, and
only when no offering the request could use remains is it a 403 naming the missing permission).

A caller's roles: its key's own ``role`` (``tenant`` or ``admin``, the built-in roles, or the name of
a role defined through the admin API), plus the roles bound (``/v1/admin/bindings``) to the subjects
it is known by (``Principal.subjects``: ``key:<key id>``, ``tenant:<tenant>``). The roles and
bindings come from the access store (``router.control.access_store``), one version at a time: an
:class:`AccessControl` is built per version and swapped in whole, so its caches (a caller's
compiled permissions, its offering mask per model) never outlive the version they were built for.
The schema -- resource ids, permission patterns, roles, bindings -- is ``xroute.schema.access``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

import numpy as np

from router.core.logs import LOG, trace_id_var
from xroute.schema.access import (
    BUILTIN_ROLES,
    Grant,
    Principal,
    Role,
    RoleBinding,
    admin_resource,
    compile_grant,
    model_resource,
)

#: distinct callers whose compiled permissions are kept (every key of a deployment, in practice)
_CACHE_MAX = 4096


class Permissions:
    """One caller's grants, compiled, with what was already decided for it."""

    __slots__ = ("_allowed", "_masks", "any_admin", "can_infer", "grants", "roles", "unknown_roles")

    def __init__(self, roles: Sequence[str], unknown_roles: Sequence[str], grants: Sequence[Grant]):
        self.roles, self.unknown_roles = tuple(roles), tuple(unknown_roles)
        self.grants = tuple(grants)
        #: some grant reaches an admin resource (the caller may administer: no tenant needed)
        self.any_admin = any(g.pattern == "*" or g.segments[0] == "admin" for g in self.grants)
        #: some grant reaches a ``model:inference`` resource (the caller may route at all)
        self.can_infer = any(g.pattern == "*" or (g.segments[0] == "model" and fnmatchcase("inference", g.segments[1]))
                             for g in self.grants)
        self._allowed: dict[str, bool] = {}
        self._masks: dict[str, np.ndarray | None] = {}

    def allows(self, resource: str) -> bool:
        hit = self._allowed.get(resource)
        if hit is None:
            hit = self._allowed[resource] = any(g.matches(resource) for g in self.grants)
        return hit


class AccessControl:
    """The roles and bindings of one access-store version, compiled per caller on first use."""

    def __init__(self, roles: Mapping[str, Role], bindings: Mapping[str, RoleBinding], refs: Sequence[dict[str, str]],
                 version: int = 0):
        self.version = version
        self.roles: dict[str, tuple[str, ...]] = {n: tuple(r.grants) for n, r in roles.items()}
        self.roles.update(BUILTIN_ROLES)
        self.bindings = {s: tuple(b.roles) for s, b in bindings.items()}
        self.regions = [r["region"] for r in refs]
        self.locations = [r["location"] for r in refs]
        self._perms: dict[tuple[str, str, str], Permissions] = {}
        self._compiled: dict[str, Grant] = {}

    def permissions(self, who: Principal) -> Permissions:
        key = (who.key_id, who.role, who.tenant)
        hit = self._perms.get(key)
        if hit is not None:
            return hit
        names: list[str] = [who.role]
        for subject in who.subjects:
            for r in self.bindings.get(subject, ()):
                if r not in names:
                    names.append(r)
        grants: list[Grant] = []
        unknown: list[str] = []
        for n in names:
            patterns = self.roles.get(n)
            if patterns is None:
                unknown.append(n)
                continue
            for p in patterns:
                g = self._compiled.get(p)
                if g is None:
                    g = self._compiled[p] = compile_grant(p)
                grants.append(g)
        perms = Permissions(names, unknown, grants)
        if len(self._perms) >= _CACHE_MAX:
            self._perms.clear()
        self._perms[key] = perms
        return perms

    def inference_mask(self, who: Principal, model: str) -> np.ndarray | None:
        """The offerings ``who`` may place a request of ``model`` on (None: every one)."""
        perms = self.permissions(who)
        if model in perms._masks:
            return perms._masks[model]
        mask: np.ndarray | None
        if any(g.pattern == "*" or (g.open_tail and g.matches(model_resource("inference", model, "")))
               for g in perms.grants):
            mask = None
        else:
            seen: dict[tuple[str, str], bool] = {}  # (a catalog has far fewer locations than offerings)
            for reg, loc in zip(self.regions, self.locations):
                if (reg, loc) not in seen:
                    res = model_resource("inference", model, reg)
                    seen[(reg, loc)] = any(g.matches(res, loc) for g in perms.grants)
            mask = np.array([seen[(reg, loc)] for reg, loc in zip(self.regions, self.locations)], dtype=bool)
            if mask.all():
                mask = None
        perms._masks[model] = mask
        return mask

    def describe(self, who: Principal) -> dict[str, Any]:
        p = self.permissions(who)
        return {"subjects": list(who.subjects), "roles": list(p.roles), "unknown_roles": list(p.unknown_roles),
                "grants": [g.pattern for g in p.grants], "version": self.version}


def denied(who: Principal, resource: str, what: str) -> dict[str, Any]:
    """The 403 for a call ``who``'s roles do not permit (the arguments of ``RouteFailure``), logged
    with the request's trace id (the request id is on every log line)."""
    LOG.warning("permission denied", extra={"fields": {
        "principal": f"key:{who.key_id}", "tenant": who.tenant, "role": who.role, "missing_permission": resource,
        "trace_id": trace_id_var.get()}})
    return {"status": 403, "error": "forbidden",
            "message": f"{what} needs the permission '{resource}', which no role of this key grants "
                       f"(its roles: see GET /v1/whoami)",
            "fields": [{"field": "permission", "message": f"missing '{resource}'", "suggestions": []}],
            "extra": {"missing_permission": resource}}


def admin_denied(who: Principal, verb: str, kind: str) -> dict[str, Any]:
    return denied(who, admin_resource(verb, kind), f"this call ({verb} {kind})")
