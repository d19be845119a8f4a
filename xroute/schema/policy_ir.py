"""Routing constraints as data — the policy IR. Defined here only.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

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
