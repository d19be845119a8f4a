"""Access control -- defined here only: resource ids, permission patterns, roles and role bindings
(``docs/policies.md``, "Access control").

**Resource ids** (what a call touches), two families:

* ``model:<action>:<model>:<region>`` -- placing a request of ``<model>`` on an offering in
  ``<region>``; the one action today is ``inference`` (``POST /v1/route``, the gateway,
  ``/v1/feedback``, ``/v1/explain``). ``<region>`` is the offering's region (``eu-west-1``) or
  its location id (``aws:eu-west-1``): a pattern on that segment may be written either way.
* ``admin:<verb>:<kind>`` -- an admin call: ``<verb>`` is ``read`` or ``write``, ``<kind>`` one of
  :data:`ADMIN_KINDS` (``GET /v1/admin/policies`` is ``admin:read:policies``, ``PUT
  /v1/admin/roles/x`` is ``admin:write:roles``).

**Permissions** (what a role grants) are resource ids with wildcards: each ``:``-separated segment
is a literal or an ``fnmatch`` pattern (``*``, ``?``, ``[...]``) matched within that segment (a
``*`` never crosses a ``:``), except that a **last segment of exactly** ``*`` also matches every
segment after it: ``*`` is everything, ``model:*`` every model action, ``admin:read:*`` every admin
read, ``model:inference:llama3-*:eu-*`` inference of any llama3 model in any ``eu-`` region. The
region segment of a model permission is the rest of the string (it may hold one ``:``, a location
id's). A permission is checked when written: an unknown family, action, verb or kind (a literal that
is not one) is an error naming it, with close matches.

**Roles** hold permissions (``grants``); **bindings** give roles to a subject. A subject is what a
caller is known by: ``key:<key id>`` (one API key), ``tenant:<name>`` (every key of a tenant), and
-- reserved for tokens from an identity provider -- ``idp:<issuer>:<subject>`` and
``group:<name>``. Built-in roles (:data:`BUILTIN_ROLES`) cannot be redefined: ``tenant`` (every
tenant key: ``model:inference:*``, on its own tenant), ``admin`` (every admin key: ``*``) and
``events`` (the serving side of migrations: ``admin:write:events``, ``admin:read:sessions``).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from xroute.errors import XrouteError

#: the actions of the ``model`` family
MODEL_ACTIONS: tuple[str, ...] = ("inference",)
#: the verbs of the ``admin`` family
ADMIN_VERBS: tuple[str, ...] = ("read", "write")
#: what admin calls touch (``admin:<verb>:<kind>``)
ADMIN_KINDS: tuple[str, ...] = ("policies", "audit", "quotas", "tenants", "roles", "decisions", "status", "model",
                                "metrics", "events", "sessions", "capacity")
FAMILIES: tuple[str, ...] = ("model", "admin")
#: the roles every router knows; a key's ``role`` names one (or a role defined through the admin API)
BUILTIN_ROLES: dict[str, tuple[str, ...]] = {"tenant": ("model:inference:*",), "admin": ("*",),
                                             # the serving side of migrations (docs/migration.md): pool events,
                                             # snapshots and verifications, and any tenant's sessions
                                             "events": ("admin:write:events", "admin:read:sessions")}

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
#: (visible ASCII, not ``\S``: regex dialects disagree on what a space is -- see ``Permission``)
SUBJECT_PATTERN = r"^(key:[0-9a-f]{8}|tenant:[A-Za-z0-9][A-Za-z0-9._-]{0,63}|idp:[!-9;-~]{1,200}:[!-~]{1,200}|group:[!-~]{1,200})$"
_NAME = re.compile(NAME_PATTERN)
_SUBJECT = re.compile(SUBJECT_PATTERN)


class PermissionError_(XrouteError):
    """A permission pattern that is not one: ``problem`` says why, ``suggestions`` close matches."""

    def __init__(self, problem: str, suggestions: list[str] | None = None):
        super().__init__(problem)
        self.problem, self.suggestions = problem, suggestions or []


def _is_pattern(s: str) -> bool:
    return any(c in s for c in "*?[")


def _check_literal(value: str, known: tuple[str, ...], what: str) -> None:
    if _is_pattern(value):
        if not any(fnmatchcase(k, value) for k in known):
            raise PermissionError_(f"{what} pattern '{value}' matches no {what} (known: {', '.join(known)})")
        return
    if value not in known:
        raise PermissionError_(f"unknown {what} '{value}' (known: {', '.join(known)})",
                               difflib.get_close_matches(value, known, n=3, cutoff=0.5))


def check_permission(pattern: str) -> str:
    """``pattern`` if it is a valid permission (module docstring), else :class:`PermissionError_`."""
    if not pattern or len(pattern) > 300 or any(c.isspace() for c in pattern):
        raise PermissionError_("a permission is 1-300 characters without spaces, e.g. model:inference:llama3-*:eu-*")
    if pattern == "*":
        return pattern
    family = pattern.split(":", 1)[0]
    if family not in FAMILIES:
        raise PermissionError_(f"unknown family '{family}' (a permission is *, model:... or admin:...)",
                               difflib.get_close_matches(family, FAMILIES, n=2, cutoff=0.5))
    segs = pattern.split(":", 3) if family == "model" else pattern.split(":")
    full = 4 if family == "model" else 3
    if any(not s for s in segs):
        raise PermissionError_(f"'{pattern}': an empty segment")
    if len(segs) > full:
        raise PermissionError_(f"'{pattern}': an admin permission is admin:<verb>:<kind> (3 segments)")
    if len(segs) < full and segs[-1] != "*":
        example = "model:inference:*" if family == "model" else "admin:read:*"
        raise PermissionError_(f"'{pattern}' names no whole resource: end it with a '*' segment (e.g. {example})")
    if len(segs) > 1:
        if family == "model":
            _check_literal(segs[1], MODEL_ACTIONS, "action")
        else:
            _check_literal(segs[1], ADMIN_VERBS, "verb")
            if len(segs) > 2:
                _check_literal(segs[2], ADMIN_KINDS, "kind")
    return pattern


def model_resource(action: str, model: str, region: str) -> str:
    return f"model:{action}:{model}:{region}"


def admin_resource(verb: str, kind: str) -> str:
    return f"admin:{verb}:{kind}"


@dataclass(frozen=True, slots=True)
class Grant:
    """One permission, split in segments for matching (:func:`compile_grant`)."""

    pattern: str
    segments: tuple[str, ...]
    #: the last segment is exactly ``*``: it also matches every segment after it
    open_tail: bool
    #: each segment as a compiled ``fnmatch`` pattern (``fnmatch.translate``)
    rx: tuple[Any, ...] = ()

    def matches(self, resource: str, location: str | None = None) -> bool:
        """Whether this grant covers ``resource`` (a model resource's region segment is also tried
        as ``location``, the offering's location id, when given)."""
        if self.pattern == "*":
            return True
        res = resource.split(":", 3) if resource.startswith("model:") else resource.split(":")
        rx = self.rx
        if self.open_tail:
            if len(res) < len(rx) - 1:
                return False
            return all(m(r) is not None for r, m in zip(res, rx[:-1]))
        if len(res) != len(rx):
            return False
        for i, (r, m) in enumerate(zip(res, rx)):
            if m(r) is not None:
                continue
            if i == 3 and location is not None and res[0] == "model" and m(location) is not None:
                continue
            return False
        return True


def compile_grant(pattern: str) -> Grant:
    segs = tuple(pattern.split(":", 3) if pattern.startswith("model:") or pattern == "model" else pattern.split(":"))
    return Grant(pattern, segs, segs[-1] == "*", tuple(re.compile(fnmatch.translate(s)).match for s in segs))


#: a permission's shape, as the JSON Schema can say it (the grammar is checked by :func:`check_permission`):
#: visible ASCII only -- not ``\S``, whose meaning differs between regex dialects (Python's counts
#: U+0085 as a space, ECMA-262's, which JSON Schema names, does not)
Permission = Annotated[str, Field(min_length=1, max_length=300, pattern=r"^[!-~]+$")]
RoleName = Annotated[str, Field(pattern=NAME_PATTERN)]


class Role(BaseModel):
    """A named set of permissions (each checked by :meth:`check` when written)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    description: str = Field("", max_length=500)
    grants: list[Permission] = Field(default_factory=list, max_length=200,
                                     description="permissions (resource ids with wildcards): "
                                                 "model:<action>:<model>:<region>, admin:<verb>:<kind>, or *")
    version: int | None = Field(None, ge=1, description="set by the store (1 on create, +1 on each change); on an "
                                                        "update, when given, it must be the current version (else 409)")

    def check(self) -> None:
        """:class:`PermissionError_` for the first grant that is not a permission, its problem
        prefixed with ``grants[i]: ``."""
        for i, g in enumerate(self.grants):
            try:
                check_permission(g)
            except PermissionError_ as e:
                raise PermissionError_(f"grants[{i}]: {e.problem}"
                                       + (f" (did you mean {', '.join(e.suggestions)}?)" if e.suggestions else ""),
                                       e.suggestions) from None

    def content(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"version"})


class RoleBinding(BaseModel):
    """Roles given to one subject (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    roles: list[RoleName] = Field(min_length=1, max_length=50, description="role names (built-in or defined)")
    description: str = Field("", max_length=500)
    version: int | None = Field(None, ge=1, description="set by the store; on an update, when given, it must be the "
                                                        "current version (else 409)")

    def content(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"version"})


def valid_subject(subject: str) -> bool:
    return bool(_SUBJECT.match(subject))


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


# ---------------------------------------------------------------------------------------- the caller
#: a key's own role: ``tenant`` or ``admin`` (built in), or a role defined through the admin API
#: (:class:`Role`; more roles can be bound to the key, its tenant: ``router.decision.access``)
KeyRole = str


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant, its role, and which key (by id, never the secret)."""

    tenant: str
    role: KeyRole
    key_id: str

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def subjects(self) -> tuple[str, ...]:
        """What role bindings may name this caller by (``xroute.schema.access``): its key, its
        tenant. (A caller authenticated by an identity provider's token would be known by
        ``idp:<issuer>:<subject>`` and its ``group:<name>``s.)"""
        return (f"key:{self.key_id}", f"tenant:{self.tenant}")
