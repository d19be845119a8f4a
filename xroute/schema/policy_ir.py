"""Routing constraints as data — the policy IR. Defined here only.

Two parts. **Routing policies** (:class:`Policy`, :class:`PolicySet`: named, versioned; a
``target`` selecting requests, an ``effect`` -- allow, deny, prefer with a weight --, attribute and
numeric ``constraints`` over offerings, a ``priority``; named region sets and SLO tiers): what
``docs/policies.md`` documents, written in YAML (``xroute.config.load_policies``) and through the
router's admin API, compiled to masks and biases by ``envs.policies``. And below them the
**request layer** a route body (and a tenant's defaults) may add, which can only narrow:

A :class:`Constraints` value holds three lists of :class:`Rule`:

* ``allow``: if any allow rule is given, an offering must match at least one of them;
* ``deny``: an offering matching any deny rule is excluded;
* ``prefer``: soft — if at least one offering that is otherwise valid *now* matches a prefer rule,
  the choice is restricted to those; otherwise prefer rules are ignored.

A rule matches an offering when every field it sets matches (AND across fields, OR within a
field's list). ``regions`` accepts a bare region (``us-east-1``) or a location id
(``provider:region``). Values are checked against the catalog, so a typo is an error naming the
field with close matches, not a rule that silently matches nothing.

Constraints come in *layers* (a tenant's defaults, then the request's own); :func:`compile_constraints`
ANDs the layers' hard masks (a request can narrow its tenant's constraints, never widen them) and
unions their prefer rules. The result is a boolean mask over the catalog plus, for every excluded
offering, the first reason (``"<layer>:deny"`` or ``"<layer>:allow"``).
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from xroute.errors import XrouteError
from xroute.schema.offering import Offering

Value = Annotated[str, StringConstraints(min_length=1, max_length=200)]
Values = Annotated[list[Value], Field(min_length=1, max_length=256)]

#: rule field -> the Offering attribute it matches (``regions`` also matches ``location``)
RULE_FIELDS: dict[str, str] = {
    "providers": "provider",
    "regions": "region",
    "instance_types": "instance_type",
    "accelerators": "accelerator",
    "pricing_modes": "pricing_mode",
    "offering_ids": "offering_id",
}


class ConstraintError(XrouteError):
    """A constraint names something the catalog does not have (or excludes every offering).

    ``field`` is the dotted path of the offending value (``constraints.allow[0].providers[1]``).
    """

    def __init__(self, field: str, problem: str, suggestions: Sequence[str] = ()):
        self.field, self.problem, self.suggestions = field, problem, list(suggestions)
        hint = f" (did you mean {', '.join(self.suggestions)}?)" if self.suggestions else ""
        super().__init__(f"field '{field}': {problem}{hint}")


def _rule_json_schema(schema: dict[str, Any]) -> None:
    """Say in the JSON Schema what the validators enforce, so that generated clients and fuzzers
    agree with the server: at least one field, and a field is a list when present (never null)."""
    schema["minProperties"] = 1
    for prop in schema.get("properties", {}).values():
        alts = [a for a in prop.pop("anyOf", []) if a.get("type") != "null"]
        if alts:
            prop.update(alts[0])
        prop.pop("default", None)


class Rule(BaseModel):
    """A set of offerings, by attribute. At least one field must be given; an omitted field
    matches everything (``null`` is refused rather than read as "omitted")."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_rule_json_schema)

    providers: Values | None = Field(None, description="provider names, as in the catalog")
    regions: Values | None = Field(None, description="region names or location ids (provider:region)")
    instance_types: Values | None = None
    accelerators: Values | None = Field(None, description="accelerator names (T4, A10G, ...)")
    pricing_modes: Values | None = Field(None, description="pricing modes, as in the catalog (on_demand, spot)")
    offering_ids: Values | None = None

    @field_validator(*RULE_FIELDS, mode="before")
    @classmethod
    def _not_null(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("must be a list of values; omit the field to match every value")
        return v

    @model_validator(mode="after")
    def _not_empty(self) -> Rule:
        if all(getattr(self, f) is None for f in RULE_FIELDS):
            raise ValueError(f"a rule must set at least one of {', '.join(RULE_FIELDS)}")
        return self


class Constraints(BaseModel):
    """Allow / deny / prefer rules (see the module docstring for their meaning)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: list[Rule] = Field(default_factory=list, max_length=64)
    deny: list[Rule] = Field(default_factory=list, max_length=64)
    prefer: list[Rule] = Field(default_factory=list, max_length=64)

    @property
    def empty(self) -> bool:
        return not (self.allow or self.deny or self.prefer)


@dataclass(frozen=True)
class CompiledConstraints:
    """Constraints compiled against one catalog.

    ``allowed``: hard mask (bool, one per offering); ``preferred``: soft mask or ``None`` when no
    prefer rule was given; ``reason``: for each offering, why it is excluded ("" when allowed).
    """

    allowed: np.ndarray
    preferred: np.ndarray | None
    reason: tuple[str, ...]

    def excluded_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.reason:
            if r:
                out[r] = out.get(r, 0) + 1
        return out


class CatalogIndex:
    """The catalog's attributes as arrays, for compiling many constraint sets against it."""

    def __init__(self, catalog: Sequence[Offering]):
        self.n = len(catalog)
        self.attrs: dict[str, np.ndarray] = {
            a: np.array([getattr(o, a) for o in catalog], dtype=object)
            for a in (*RULE_FIELDS.values(), "location")
        }
        self.known: dict[str, set[str]] = {a: set(v) for a, v in self.attrs.items()}

    def _match_field(self, field: str, values: Sequence[str], path: str) -> np.ndarray:
        attr = RULE_FIELDS[field]
        known = self.known[attr] | (self.known["location"] if field == "regions" else set())
        for k, v in enumerate(values):
            if v not in known:
                close = difflib.get_close_matches(v, sorted(known), n=3, cutoff=0.5)
                raise ConstraintError(f"{path}.{field}[{k}]", f"unknown {attr.replace('_', ' ')} '{v}'", close)
        m = np.isin(self.attrs[attr], list(values))
        if field == "regions":
            m |= np.isin(self.attrs["location"], list(values))
        return m

    def match(self, rule: Rule, path: str) -> np.ndarray:
        """Offerings matched by ``rule``; ``path`` names the rule in error messages."""
        m = np.ones(self.n, dtype=bool)
        for field in RULE_FIELDS:
            values = getattr(rule, field)
            if values is not None:
                m &= self._match_field(field, values, path)
        return m


def compile_constraints(layers: Sequence[tuple[str, Constraints | None]], index: CatalogIndex,
                        ) -> CompiledConstraints:
    """Compile named layers (e.g. ``[("tenant", c1), ("request", c2)]``) into one mask.

    Error paths are ``<layer>.allow[i].<field>[j]``; callers that expose a layer under another
    name (the request body's ``constraints``) pass that name as the layer.
    """
    n = index.n
    allowed = np.ones(n, dtype=bool)
    reason = [""] * n
    preferred: np.ndarray | None = None
    for name, c in layers:
        if c is None or c.empty:
            continue
        if c.allow:
            ok = np.zeros(n, dtype=bool)
            for i, rule in enumerate(c.allow):
                ok |= index.match(rule, f"{name}.allow[{i}]")
            for k in np.flatnonzero(allowed & ~ok):
                reason[k] = f"{name}:not_allowed"
            allowed &= ok
        for i, rule in enumerate(c.deny):
            hit = index.match(rule, f"{name}.deny[{i}]")
            for k in np.flatnonzero(allowed & hit):
                reason[k] = f"{name}:denied"
            allowed &= ~hit
        for i, rule in enumerate(c.prefer):
            hit = index.match(rule, f"{name}.prefer[{i}]")
            preferred = hit if preferred is None else preferred | hit
    return CompiledConstraints(allowed=allowed, preferred=preferred, reason=tuple(reason))


# ================================================================================ named, versioned policies
#: a policy's, a region set's or an SLO tier's name
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
#: a value or a shell-style wildcard (``fnmatch``: ``*``, ``?``, ``[...]``), e.g. ``llama3-*``, ``g5.*``
Pattern = Annotated[str, StringConstraints(min_length=1, max_length=200)]
Patterns = Annotated[list[Pattern], Field(min_length=1, max_length=256)]
_GLOB = frozenset("*?[")

EFFECTS = ("allow", "deny", "prefer")
#: constraint field -> the Offering attribute it matches (``regions`` also matches ``location``;
#: ``region_sets`` matches like ``regions``, through the named sets)
ATTRIBUTE_FIELDS: dict[str, str] = {**{k: v for k, v in RULE_FIELDS.items() if k != "offering_ids"},
                                    "region_sets": "region", "offering_ids": "offering_id"}
#: the numeric constraints: what each compares, and how (an offering meets it when ...)
NUMERIC_FIELDS: dict[str, str] = {
    "max_usd_per_hour": "its instance's price now (USD per instance-hour, GET /v1/offerings' usd_per_hour) <= the value",
    "max_rtt_ms": "the round-trip time from the request's origin to its location (ms) <= the value",
    "min_headroom": "the share of its pool's request slots free in the router's view (0-1) >= the value",
}


def is_pattern(value: str) -> bool:
    """A value holding a wildcard (``*``, ``?`` or ``[``)."""
    return not _GLOB.isdisjoint(value)


def matches_any(value: str, patterns: Sequence[str] | None) -> bool:
    """``value`` equals or matches (``fnmatch``, case-sensitive) one of ``patterns``; ``None``
    (the field omitted) matches everything."""
    if patterns is None:
        return True
    return any(fnmatch.fnmatchcase(value, p) if is_pattern(p) else value == p for p in patterns)


def _no_null_schema(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """Say in the JSON Schema what the validators enforce: a field is never null, except those the
    model names nullable (so generated clients and fuzzers agree with the server)."""
    nullable: frozenset[str] = getattr(cls, "_nullable", frozenset())
    for name, prop in schema.get("properties", {}).items():
        if name in nullable:
            continue
        alts = [a for a in prop.pop("anyOf", []) if a.get("type") != "null"]
        if alts:
            prop.update(alts[0])
        if prop.get("default", 0) is None:
            prop.pop("default")
        if "patternProperties" in prop:  # a name that is not one (a key the pattern refuses) is refused
            prop.setdefault("additionalProperties", False)


class _PolicyModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, json_schema_extra=_no_null_schema)

    @field_validator("*", mode="before")
    @classmethod
    def _not_null(cls, v: Any, info: Any) -> Any:
        if v is None and info.field_name not in cls._nullable:
            raise ValueError("must not be null; omit the field instead")
        return v

    _nullable: ClassVar[frozenset[str]] = frozenset()


class Target(_PolicyModel):
    """Which requests a policy applies to: AND across fields, OR within a field's list (values or
    wildcards); an omitted field matches every request, an empty target every request."""

    tenants: Patterns | None = Field(None, description="tenant names (the API key's tenant), e.g. ['acme', 'team-*']")
    models: Patterns | None = Field(None, description="the requested model (GET /v1/offerings lists them; a request "
                                                      "naming none asks for the default model)")
    classes: Patterns | None = Field(None, description="the request class: the request's request_class, else the "
                                                       "first slo_tiers entry its SLO falls in (a request with "
                                                       "neither has no class and matches no classes list)")
    origins: Patterns | None = Field(None, description="the request's origin (a location id, e.g. 'aws:eu-*')")

    def matches(self, tenant: str, model: str, request_class: str, origin: str) -> bool:
        return (matches_any(tenant, self.tenants) and matches_any(model, self.models)
                and (self.classes is None or (request_class != "" and matches_any(request_class, self.classes)))
                and matches_any(origin, self.origins))


class PolicyConstraints(_PolicyModel):
    """The offerings a policy is about (attributes: AND across fields, OR within a list) and the
    numbers they must meet (see :class:`Policy` for what each effect does with them)."""

    providers: Patterns | None = Field(None, description="provider names, as in the catalog")
    regions: Patterns | None = Field(None, description="region names or location ids (provider:region); wildcards")
    region_sets: Annotated[list[Name], Field(min_length=1, max_length=64)] | None = Field(
        None, description="named region sets (region_sets: in the policy YAML); with regions, either may match")
    instance_types: Patterns | None = Field(None, description="instance types, e.g. ['g5.*']")
    accelerators: Patterns | None = Field(None, description="accelerator names (T4, A10G, ...)")
    pricing_modes: Patterns | None = Field(None, description="on_demand, spot")
    offering_ids: Patterns | None = None
    max_usd_per_hour: float | None = Field(None, ge=0, description=NUMERIC_FIELDS["max_usd_per_hour"])
    max_rtt_ms: float | None = Field(None, ge=0, description=NUMERIC_FIELDS["max_rtt_ms"])
    min_headroom: float | None = Field(None, ge=0, le=1, description=NUMERIC_FIELDS["min_headroom"])

    @property
    def numeric(self) -> bool:
        """Sets a numeric constraint (decided per request, from the telemetry and the origin)."""
        return any(getattr(self, f) is not None for f in NUMERIC_FIELDS)


def _policy_schema(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """:func:`_no_null_schema`, and: a prefer policy has a weight, an allow or deny none."""
    _no_null_schema(schema, cls)
    schema["anyOf"] = [
        {"properties": {"effect": {"const": "prefer"}, "weight": {"type": "number"}}, "required": ["weight"]},
        {"properties": {"effect": {"enum": ["allow", "deny"]}, "weight": {"type": "null"}}},
    ]


class PolicyBody(_PolicyModel):
    """A policy without its name: the body of ``PUT /v1/admin/policies/{name}`` (the path names
    it). See :class:`Policy`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, json_schema_extra=_policy_schema)
    _nullable = frozenset({"weight", "version"})

    version: int | None = Field(None, ge=1, description="set by the policy store (each change adds one); "
                                                         "given on an update, it must be the current version")
    description: Annotated[str, StringConstraints(max_length=1000)] = ""
    target: Target = Target()
    effect: Literal["allow", "deny", "prefer"]
    weight: float | None = Field(None, ge=-100, le=100, description="prefer only: the bias, in reward units")
    constraints: PolicyConstraints = PolicyConstraints()
    priority: int = Field(0, ge=-1_000_000, le=1_000_000)

    @model_validator(mode="after")
    def _weight_iff_prefer(self) -> PolicyBody:
        if self.effect == "prefer":
            if self.weight is None:
                raise ValueError("weight: a prefer policy needs a weight (reward units)")
        elif self.weight is not None:
            raise ValueError(f"weight: only a prefer policy has a weight (this one is {self.effect})")
        return self

    def named(self, name: str) -> Policy:
        return Policy(name=name, **self.model_dump(exclude_unset=True))


class Policy(PolicyBody):
    """A named rule over offerings for the requests its ``target`` selects.

    * ``deny``: excludes the offerings that match the attribute constraints and break a numeric
      one (every matching offering when it sets none). Deny wins over allow.
    * ``allow``: when at least one allow policy applies to a request, the request may go only to
      offerings that match the attributes and meet the numbers of one of them.
    * ``prefer``: adds ``weight`` (reward units, the scale of ``envs.kernels.expected_reward``) to
      the score of the offerings that match and meet the numbers -- greedy's expected reward, the
      learned router's Q value, every baseline's score -- or, with the policy set's
      ``prefer_mode: lexicographic``, keeps only the valid offerings with the highest total weight.

    ``priority`` (higher first, then the name) orders the policies: an offering several policies
    exclude is counted under the first."""

    name: Name

    def content(self) -> dict[str, Any]:
        """The policy without its version (what a change compares)."""
        return self.model_dump(mode="json", exclude={"version"}, exclude_none=True)


class SloTier(_PolicyModel):
    """A request class by SLO: a request falls in the tier when every bound given holds (a tier
    with none holds every request: a catch-all, last)."""

    max_ttft_ms: float | None = Field(None, gt=0)
    max_tpot_ms: float | None = Field(None, gt=0)
    max_deadline_ms: float | None = Field(None, gt=0, description="holds only for a request that gives a deadline")

    def holds(self, ttft_ms: float, tpot_ms: float, deadline_ms: float | None) -> bool:
        if self.max_ttft_ms is not None and not ttft_ms <= self.max_ttft_ms:
            return False
        if self.max_tpot_ms is not None and not tpot_ms <= self.max_tpot_ms:
            return False
        if self.max_deadline_ms is not None and (deadline_ms is None or deadline_ms != deadline_ms
                                                 or not deadline_ms <= self.max_deadline_ms):
            return False
        return True


class PolicySet(_PolicyModel):
    """Every policy in force, with the named region sets and SLO tiers they refer to (each defined
    once), as one immutable, versioned document: a decision sees one whole set."""

    version: int = Field(0, ge=0, description="the policy store's version of the set (0: not from a store)")
    region_sets: dict[Name, Annotated[list[Pattern], Field(min_length=1, max_length=1024)]] = Field(
        default_factory=dict, description="name -> regions or location ids (wildcards allowed)")
    slo_tiers: dict[Name, SloTier] = Field(default_factory=dict, description="name -> SLO bounds, first match wins")
    prefer_mode: Literal["bias", "lexicographic"] = Field(
        "bias", description="bias: prefer weights add to every policy's score; lexicographic: only the valid "
                            "offerings with the highest total weight may be chosen")
    policies: list[Policy] = Field(default_factory=list, max_length=10_000)
    #: the policy store's canary rollout in force, if any (:class:`Canary`; never in a policy file, nor in the
    #: JSON schema of the bodies that take a set: only the store's canary calls write it)
    canary: SkipJsonSchema[Canary | None] = Field(None, description="a canary rollout in force: another set deciding a share of the "
                                                     "traffic (set by the policy store's canary calls only)")

    @model_validator(mode="after")
    def _references(self) -> PolicySet:
        seen: dict[str, int] = {}
        for i, p in enumerate(self.policies):
            if p.name in seen:
                raise ValueError(f"policies[{i}].name: '{p.name}' is defined twice (also policies[{seen[p.name]}])")
            seen[p.name] = i
            for j, s in enumerate(p.constraints.region_sets or ()):
                if s not in self.region_sets:
                    close = difflib.get_close_matches(s, sorted(self.region_sets), n=3, cutoff=0.5)
                    hint = f" (did you mean {', '.join(close)}?)" if close else ""
                    raise ValueError(f"policies[{i}].constraints.region_sets[{j}]: unknown region set '{s}'{hint}; "
                                     f"defined: {', '.join(sorted(self.region_sets)) or 'none'}")
        return self

    def policy(self, name: str) -> Policy | None:
        for p in self.policies:
            if p.name == name:
                return p
        return None

    def request_class(self, explicit: str | None, ttft_ms: float, tpot_ms: float, deadline_ms: float | None) -> str:
        """A request's class: ``explicit`` (the request's ``request_class``) when given, else the
        first SLO tier it falls in, else "" (no class)."""
        if explicit:
            return explicit
        for name, tier in self.slo_tiers.items():
            if tier.holds(ttft_ms, tpot_ms, deadline_ms):
                return name
        return ""

    def regions_of(self, c: PolicyConstraints) -> list[str] | None:
        """The region patterns of ``c``: its ``regions`` and its region sets' members (None: any)."""
        if c.regions is None and c.region_sets is None:
            return None
        out = list(c.regions or ())
        for s in c.region_sets or ():
            out += self.region_sets[s]
        return out


#: what a canary's arm is a function of (``docs/policies.md``, "Canary rollouts")
CANARY_KEYS = ("tenant", "session", "request")


class Canary(_PolicyModel):
    """A canary rollout (``docs/policies.md``, "Canary rollouts"): ``policy_set`` decides the
    requests whose ``key`` (the tenant, the session id, or the request id) hashes below ``share``
    percent (``router.decision.canary.in_canary``: blake2b of the id and the key), the set it sits
    in decides the rest. Written by the policy store only, as part of the versioned set."""

    id: Name = Field(description="the canary's id: with the key, what its hash is a function of")
    key: Literal["tenant", "session", "request"] = Field(description="what selects a request's arm")
    share: float = Field(gt=0, le=100, description="percent of the keys the canary decides, in (0, 100]")
    policy_set: PolicySet = Field(description="the canary arm's whole set (its version: the store version that "
                                              "started the canary)")
    version: int = Field(ge=1, description="the policy store's version that started the canary")
    base_version: int = Field(ge=0, description="the stable set's version the canary was drafted from")
    started_at: float = Field(description="when it started (seconds since the epoch)")
    principal: str = Field(max_length=300, description="who started it")
    description: str = Field("", max_length=1000)

    @model_validator(mode="after")
    def _flat(self) -> Canary:
        if self.policy_set.canary is not None:
            raise ValueError("policy_set.canary: a canary's set cannot hold a canary of its own")
        return self


PolicySet.model_rebuild()


def policy_set_error(e: Any, prefix: str = "") -> ConstraintError:
    """The first error of a pydantic ``ValidationError`` of a policy document as a
    :class:`ConstraintError` naming the field (``policies[2].constraints.regions``)."""
    err = e.errors()[0]
    loc = ""
    for part in err["loc"]:
        loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    # a cross-field check names its own field: "policies[3].weight: ..."
    if ": " in msg and not err["type"] == "extra_forbidden":
        head, rest = msg.split(": ", 1)
        if head and " " not in head:
            loc, msg = (f"{loc}.{head}" if loc and not head.startswith(("policies", "region_sets")) else head), rest
    where = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or "(top level)")
    return ConstraintError(where, msg)


class PolicyCatalog:
    """What a policy's values are checked against (:func:`check_policy_set`): the catalog's
    attribute values, and the models and origins a router knows."""

    def __init__(self, catalog: Sequence[Offering], models: Sequence[str] = (), origins: Sequence[str] = ()):
        self.values: dict[str, set[str]] = {a: {str(getattr(o, a)) for o in catalog}
                                            for a in (*RULE_FIELDS.values(), "location")}
        self.models, self.origins = set(models), set(origins)

    def known(self, field: str) -> set[str]:
        if field in ("regions", "region_sets"):
            return self.values["region"] | self.values["location"]
        return self.values[ATTRIBUTE_FIELDS[field]]


def _check_values(values: Sequence[str], known: set[str], path: str, what: str) -> None:
    for k, v in enumerate(values):
        hit = any(fnmatch.fnmatchcase(x, v) for x in known) if is_pattern(v) else v in known
        if not hit:
            close = difflib.get_close_matches(v, sorted(known), n=3, cutoff=0.5)
            problem = f"'{v}' matches no {what}" if is_pattern(v) else f"unknown {what} '{v}'"
            raise ConstraintError(f"{path}[{k}]", problem, close)


def check_policy_set(ps: PolicySet, cat: PolicyCatalog, prefix: str = "") -> None:
    """Check the values of ``ps``'s policies against a router's catalog and models: an offering
    attribute (or a model) that is not there, or a wildcard that matches none, is an error naming
    its field with close matches, not a rule that silently matches nothing. Named region sets and
    the targets' tenants, classes and origins are definitions that outlive one catalog: they are
    not checked (a member no offering has matches nothing). Compiling never checks: a set written
    for one catalog compiles against another, its unknown values matching nothing."""
    pre = f"{prefix}." if prefix else ""
    for i, p in enumerate(ps.policies):
        where = f"{pre}policies[{i}]"
        for field in ATTRIBUTE_FIELDS:
            if field == "region_sets":
                continue
            values = getattr(p.constraints, field)
            if values is not None:
                what = ATTRIBUTE_FIELDS[field].replace("_", " ") + (" or location" if field == "regions" else "")
                _check_values(values, cat.known(field), f"{where}.constraints.{field}", what)
        if p.target.models is not None and cat.models:
            _check_values(p.target.models, cat.models, f"{where}.target.models", "model")
