"""The versioned policy store: every version of the policy set, immutable, on the decision log's
backends (the same SQLite file; the same PostgreSQL database for many routers), with each change's
audit entries (``router.store.audit``) committed in the same transaction.

A version is one row holding the whole :class:`~xroute.schema.policy_ir.PolicySet` as JSON; the
store's head is the highest version. A change (:meth:`PolicyStore.change`) runs under the
backend's write lock (SQLite ``BEGIN IMMEDIATE``; a PostgreSQL transaction-scoped advisory lock),
reads the head, derives the new set, and inserts it as head + 1 with its audit entries: writers
are serialized on every host, no change is lost to a concurrent one, and a change is durable
(synchronous commit) before it is acknowledged. Routers poll the head (``policy_poll_s``) and swap
a newly compiled set in between two decisions (``router.app.factory.PolicySync``), so every decision, on
every worker and host, sees one whole version -- the old or the new.

The policies of the router's ``policy_files`` are applied as a change of their own when the files'
content differs from the last files applied (:func:`apply_files`): the policies they define replace
those of the same names, policies an earlier apply of the files defined and the files no longer do
are deleted, and their region sets, SLO tiers and prefer mode replace the store's; policies created
through the admin API are kept.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.store import audit
from router.store.dialect import Database, Dialect
from xroute.schema.policy_ir import Canary, Policy, PolicySet

#: a versioned document's table (the policies', the access store's), written once for both dialects
VERSIONS_TABLE = """
CREATE TABLE IF NOT EXISTS {table} (
    version {bigint} PRIMARY KEY,
    created_at {real} NOT NULL,
    principal TEXT NOT NULL,
    document TEXT NOT NULL,
    files TEXT
);
"""
#: what each router counted of a canary's arms that the decision log does not hold: the exclusions of
#: the decisions (by reason) and the refusals (by error), added to by every router
#: (:meth:`PolicyStore.add_tallies`; ``router.decision.canary``)
TALLIES_TABLE = """
CREATE TABLE IF NOT EXISTS canary_tallies (
    canary_id TEXT NOT NULL,
    arm TEXT NOT NULL,
    kind TEXT NOT NULL,
    reason TEXT NOT NULL,
    n {bigint} NOT NULL,
    PRIMARY KEY (canary_id, arm, kind, reason)
);
"""
_ADD_TALLY = ("INSERT INTO canary_tallies (canary_id, arm, kind, reason, n) VALUES (?, ?, ?, ?, ?) "
              "ON CONFLICT (canary_id, arm, kind, reason) DO UPDATE SET n = canary_tallies.n + excluded.n")
#: the advisory lock serializing policy changes (and the schema's creation) across routers
_PG_LOCK = audit.PG_LOCK  # "xroutp": the audit log's schema is created under it too

Mutation = Callable[[PolicySet], tuple[PolicySet, list[audit.Change]]]


class PolicyStoreError(Exception):
    """The store cannot be read or written (the backend is down): a 503."""


class PolicyChangeError(Exception):
    """A change the store refuses: ``status`` 404 (no such policy), 409 (exists already, or the
    version given is not the current one) or 422 (the result is not a valid policy set)."""

    def __init__(self, status: int, error: str, message: str, field: str = ""):
        super().__init__(message)
        self.status, self.error, self.message, self.field = status, error, message, field


def document(ps: Any, version: int) -> str:
    """A set as stored: its fields in their model's order and every mapping in its own order --
    not sorted: ``slo_tiers`` are tried first match first (``PolicySet.request_class``), so their
    order is part of the set (sorted keys once made a catch-all named before a tight class catch
    every request on a live router)."""
    return json.dumps({**ps.model_dump(mode="json", exclude_none=True), "version": version}, separators=(",", ":"))


def policy_json(p: Policy | None) -> dict[str, Any] | None:
    return None if p is None else p.model_dump(mode="json", exclude_none=True)


class PolicyStore:
    """The policy versions and the audit log on SQLite (a file path) or PostgreSQL (a URL).
    Blocking calls (a router runs them in a thread); one connection, one call at a time
    (``router.store.dialect.Database``).

    The versioned-document machinery (head, versions, ``change``) is shared by the access store
    (``router.control.access_store.AccessStore``: tenants, roles, bindings), which names its own
    table and document type."""

    #: the table of versions and the document each version holds
    TABLE = "policy_versions"
    DOC: Any = PolicySet

    def __init__(self, target: Path | str):
        self.target = target
        self.db = Database(target, self.schema, lock=_PG_LOCK, application="xroute-policies",
                           error=PolicyStoreError, label="policy store", added=(audit.ADDED,))
        #: "sqlite" or "postgresql"
        self.dialect = self.db.dialect.name

    @classmethod
    def schema(cls, dialect: Dialect) -> str:
        """The store's tables: the policy versions, this store's own versions, the audit log."""
        tables = dict.fromkeys(("policy_versions", cls.TABLE))  # (in order, once)
        return ("".join(dialect.ddl(VERSIONS_TABLE, table=t) for t in tables) + dialect.ddl(TALLIES_TABLE)
                + audit.schema(dialect))

    def close(self) -> None:
        self.db.close()

    def describe(self) -> str:
        return self.db.where

    # ------------------------------------------------------------------ reads
    def head(self) -> int:
        """The current version (0: no policy set was ever stored)."""
        rows = self.db.query(f"SELECT MAX(version) FROM {self.TABLE}")
        return int(rows[0][0] or 0)

    def at(self, version: int | None = None) -> Any:
        """The policy set of ``version`` (default: the head); an empty set at version 0."""
        if version is None:
            rows = self.db.query(f"SELECT version, document FROM {self.TABLE} ORDER BY version DESC LIMIT 1")
        else:
            rows = self.db.query(f"SELECT version, document FROM {self.TABLE} WHERE version = ?", (version,))
        if not rows:
            if version not in (None, 0):
                raise PolicyChangeError(404, "not_found", f"no {self.TABLE.split('_')[0]} set version {version}")
            return self.DOC()
        return self.DOC.model_validate_json(rows[0][1])

    def versions(self, limit: int = 100) -> list[dict[str, Any]]:
        rows = self.db.query(f"SELECT version, created_at, principal FROM {self.TABLE} ORDER BY version DESC LIMIT ?",
                           (limit,))
        return [{"version": int(v), "created_at": float(c), "principal": p} for v, c, p in rows]

    def files_applied(self) -> dict[str, Any] | None:
        """The last ``policy_files`` apply: ``{"digest", "names", "paths"}`` (None: never)."""
        rows = self.db.query("SELECT files FROM policy_versions WHERE files IS NOT NULL ORDER BY version DESC LIMIT 1")
        return json.loads(rows[0][0]) if rows else None

    def audit(self, kind: str | None = None, resource: str | None = None, after: int = 0, limit: int = 100
              ) -> list[dict[str, Any]]:
        """Audit entries, oldest first, after the entry id ``after``."""
        sql, args = audit.read_sql(kind, resource, after, limit)
        return [audit.entry(r) for r in self.db.query(sql, args)]

    def tallies(self, canary_id: str) -> list[tuple[str, str, str, int]]:
        """A canary's tallies, every router's together: (arm, kind, reason, count)."""
        rows = self.db.query("SELECT arm, kind, reason, n FROM canary_tallies WHERE canary_id = ?", (canary_id,))
        return [(str(a), str(k), str(r), int(n)) for a, k, r, n in rows]

    def add_tallies(self, rows: list[tuple[str, str, str, str, int]]) -> None:
        """Add (canary id, arm, kind, reason, count) rows to the tallies, in one transaction (an
        upsert adding to what other routers added; no write lock needed)."""
        if not rows:
            return
        with self.db.transaction(lock=False) as execute:
            for row in rows:
                execute(_ADD_TALLY, row)

    # ------------------------------------------------------------------ writes
    def change(self, principal: str, mutate: Any, request_id: str | None = None) -> Any:
        """Apply ``mutate`` to the head set under the write lock: it returns the new set and the
        audited changes (none: nothing is written and the head is returned). The new version and its
        audit entries commit together. Raises what ``mutate`` raises (nothing written)."""
        with self.db.transaction() as execute:
            rows = execute(f"SELECT version, document FROM {self.TABLE} ORDER BY version DESC LIMIT 1").fetchall()
            head = int(rows[0][0]) if rows else 0
            current = self.DOC.model_validate_json(rows[0][1]) if rows else self.DOC()
            new, changes = mutate(current)
            if not changes:
                return current
            version = head + 1
            doc = document(new, version)
            execute(f"INSERT INTO {self.TABLE} (version, created_at, principal, document) VALUES (?, ?, ?, ?)",
                    (version, time.time(), principal, doc))
            audit.append(execute, principal, changes, version, request_id)
        return self.DOC.model_validate_json(doc)

    def apply_files(self, principal: str, files: PolicySet, paths: list[str]) -> PolicySet | None:
        """Apply the policy files' set (:func:`apply_files`) unless the last files applied had the
        same content -- decided inside the write transaction, so routers starting together apply
        it once. Returns the new head set, or None when nothing changed."""
        digest = files_digest(files)
        marker = {"digest": digest, "names": sorted(p.name for p in files.policies), "paths": paths}
        applied: list[PolicySet] = []

        with self.db.transaction() as execute:
            rows = execute("SELECT files FROM policy_versions WHERE files IS NOT NULL ORDER BY version DESC "
                           "LIMIT 1").fetchall()
            last = json.loads(rows[0][0]) if rows else None
            if last is not None and last.get("digest") == digest:
                return None
            rows = execute("SELECT version, document FROM policy_versions ORDER BY version DESC LIMIT 1").fetchall()
            head = int(rows[0][0]) if rows else 0
            current = PolicySet.model_validate_json(rows[0][1]) if rows else PolicySet()
            new, changes = apply_files(files, list(last["names"]) if last else [])(current)
            changes.append(audit.Change("apply", "policy_files", ",".join(paths),
                                        None if last is None else {k: last[k] for k in ("digest", "names")},
                                        {"digest": digest, "names": marker["names"]}))
            version = head + 1
            doc = document(new, version)
            execute("INSERT INTO policy_versions (version, created_at, principal, document, files) VALUES (?, ?, ?, ?, ?)",
                    (version, time.time(), principal, doc, json.dumps(marker)))
            audit.append(execute, principal, changes, version)
            applied.append(PolicySet.model_validate_json(doc))
        return applied[0]


# ---------------------------------------------------------------------------------------- mutations
def _rebuild(current: PolicySet, policies: list[Policy], **sections: Any) -> PolicySet:
    """``current`` with ``policies`` (and sections) replaced, validated as a whole (422 naming the
    field when the result refers to something undefined)."""
    from pydantic import ValidationError

    from xroute.schema.policy_ir import policy_set_error

    data = {**current.model_dump(mode="json", exclude_none=True), **sections,
            "policies": [p.model_dump(mode="json", exclude_none=True) for p in policies]}
    try:
        return type(current).model_validate(data)
    except ValidationError as e:
        err = policy_set_error(e)
        raise PolicyChangeError(422, "invalid_policy", str(err), err.field) from None


def create_policy(policy: Policy) -> Mutation:
    def mutate(current: PolicySet) -> tuple[PolicySet, list[audit.Change]]:
        no_canary(current)
        if current.policy(policy.name) is not None:
            raise PolicyChangeError(409, "conflict", f"policy '{policy.name}' exists already (PUT updates it)", "name")
        new = policy.model_copy(update={"version": 1})
        return _rebuild(current, [*current.policies, new]), [audit.Change("create", "policy", policy.name, None,
                                                                           policy_json(new))]
    return mutate


def put_policy(policy: Policy) -> Mutation:
    """Create or update: with ``policy.version`` given, it must be the current version (else 409)."""
    def mutate(current: PolicySet) -> tuple[PolicySet, list[audit.Change]]:
        no_canary(current)
        old = current.policy(policy.name)
        if policy.version is not None and (old is None or old.version != policy.version):
            have = "it does not exist" if old is None else f"the current version is {old.version}"
            raise PolicyChangeError(409, "version_conflict", f"policy '{policy.name}': version {policy.version} was "
                                    f"given, but {have}; read it again and retry", "version")
        if old is not None and old.content() == policy.content():
            return current, []
        new = policy.model_copy(update={"version": 1 if old is None else (old.version or 0) + 1})
        policies = ([new if p.name == policy.name else p for p in current.policies] if old is not None
                    else [*current.policies, new])
        return _rebuild(current, policies), [audit.Change("update" if old is not None else "create", "policy",
                                                          policy.name, policy_json(old), policy_json(new))]
    return mutate


def delete_policy(name: str, version: int | None = None) -> Mutation:
    def mutate(current: PolicySet) -> tuple[PolicySet, list[audit.Change]]:
        no_canary(current)
        old = current.policy(name)
        if old is None:
            raise PolicyChangeError(404, "not_found", f"no policy named '{name}'", "name")
        if version is not None and old.version != version:
            raise PolicyChangeError(409, "version_conflict", f"policy '{name}': version {version} was given, but the "
                                    f"current version is {old.version}", "version")
        return (_rebuild(current, [p for p in current.policies if p.name != name]),
                [audit.Change("delete", "policy", name, policy_json(old), None)])
    return mutate


def files_digest(files: PolicySet) -> str:
    return hashlib.sha256(document(files, 0).encode()).hexdigest()


def apply_files(files: PolicySet, previous_names: list[str]) -> Mutation:
    """The policy files' set merged into the store's (module docstring): returns the mutation;
    ``previous_names`` are the policies the last apply of the files defined."""
    def mutate(current: PolicySet) -> tuple[PolicySet, list[audit.Change]]:
        changes: list[audit.Change] = []
        by_name = {p.name: p for p in files.policies}
        kept: list[Policy] = []
        for p in current.policies:
            if p.name in by_name:
                continue
            if p.name in previous_names:  # the files defined it and no longer do
                changes.append(audit.Change("delete", "policy", p.name, policy_json(p), None))
                continue
            kept.append(p)
        olds = {p.name: p for p in current.policies}
        for p in files.policies:
            old = olds.get(p.name)
            if old is not None and old.content() == p.content():
                kept.append(old)
                continue
            new = p.model_copy(update={"version": 1 if old is None else (old.version or 0) + 1})
            kept.append(new)
            changes.append(audit.Change("update" if old else "create", "policy", p.name, policy_json(old),
                                        policy_json(new)))
        sections = {"region_sets": files.model_dump(mode="json")["region_sets"],
                    "slo_tiers": files.model_dump(mode="json", exclude_none=True)["slo_tiers"],
                    "prefer_mode": files.prefer_mode}
        before = {k: current.model_dump(mode="json", exclude_none=True)[k] for k in sections}
        if before != sections:
            changes.append(audit.Change("update", "policy_set", "sections", before, sections))
        return _rebuild(current, kept, **sections), changes
    return mutate



# ---------------------------------------------------------------------------------------- canary rollouts
def no_canary(current: PolicySet) -> None:
    """A plain policy change while a canary runs is a 409 naming it: the two arms being compared
    stay the two sets they were when it started (promote or roll it back first)."""
    c = current.canary
    if c is not None:
        raise PolicyChangeError(409, "canary_running", f"canary '{c.id}' is running ({c.share:g} % by {c.key}, "
                                f"since version {c.version}): promote it or roll it back first", "canary")


def _running(current: PolicySet, canary_id: str | None) -> Canary:
    c = current.canary
    if c is None:
        raise PolicyChangeError(409, "no_canary", "no canary is running", "canary")
    if canary_id is not None and canary_id != c.id:
        raise PolicyChangeError(409, "canary_conflict", f"canary '{canary_id}' is not the one running ('{c.id}')",
                                "id")
    return c


def canary_json(c: Canary | None) -> dict[str, Any] | None:
    return None if c is None else c.model_dump(mode="json", exclude_none=True)


def _versioned(base: PolicySet, draft: PolicySet) -> list[Policy]:
    """``draft``'s policies, each with its version relative to ``base``: kept when unchanged, one
    more when changed, 1 when new."""
    out = []
    for p in draft.policies:
        old = base.policy(p.name)
        if old is not None and old.content() == p.content():
            out.append(p.model_copy(update={"version": old.version}))
        else:
            out.append(p.model_copy(update={"version": 1 if old is None else (old.version or 0) + 1}))
    return out


def start_canary(draft: PolicySet, key: str, share: float, canary_id: str | None, principal: str,
                 description: str = "") -> Mutation:
    """Start a canary: ``draft`` (a whole set) decides ``share`` percent of the keys of kind
    ``key``. 409 ``canary_running`` naming the one running."""
    def mutate(current: PolicySet) -> tuple[PolicySet, list[audit.Change]]:
        running = current.canary
        if running is not None:
            raise PolicyChangeError(409, "canary_running", f"canary '{running.id}' is running ({running.share:g} % "
                                    f"by {running.key}, since version {running.version}): promote it or roll it "
                                    "back first", "canary")
        version = current.version + 1
        arm = draft.model_copy(update={"version": version, "canary": None,
                                       "policies": _versioned(current, draft)})
        canary = Canary(id=canary_id or f"canary-{version}", key=key, share=share,  # type: ignore[arg-type]
                        policy_set=arm, version=version, base_version=current.version, started_at=time.time(),
                        principal=principal, description=description)
        new = _rebuild(current, list(current.policies), canary=canary_json(canary))
        return new, [audit.Change("start", "canary", canary.id, None, canary_json(canary))]
    return mutate


def canary_share(share: float, canary_id: str | None = None) -> Mutation:
    """The running canary's share changed (its id, so its hash, stays: a key in the canary at a
    lower share stays in it at a higher one). 409 ``no_canary`` when none runs."""
    def mutate(current: PolicySet) -> tuple[PolicySet, list[audit.Change]]:
        c = _running(current, canary_id)
        if c.share == share:
            return current, []
        new_c = c.model_copy(update={"share": share})
        return (_rebuild(current, list(current.policies), canary=canary_json(new_c)),
                [audit.Change("share", "canary", c.id, {"share": c.share}, {"share": share})])
    return mutate


def promote_canary(canary_id: str | None = None) -> Mutation:
    """The canary's set becomes the stable one (a new version), the canary ends; audited as the
    canary's promotion and each policy it created, changed or deleted. 409 ``no_canary``."""
    def mutate(current: PolicySet) -> tuple[PolicySet, list[audit.Change]]:
        c = _running(current, canary_id)
        arm = c.policy_set
        policies = _versioned(current, arm)
        changes = [audit.Change("promote", "canary", c.id, canary_json(c), None)]
        names = {p.name for p in policies}
        for p in current.policies:
            if p.name not in names:
                changes.append(audit.Change("delete", "policy", p.name, policy_json(p), None))
        for p in policies:
            old = current.policy(p.name)
            if old is None or old.content() != p.content():
                changes.append(audit.Change("update" if old else "create", "policy", p.name, policy_json(old),
                                            policy_json(p)))
        sections = {k: arm.model_dump(mode="json", exclude_none=True)[k] for k in ("region_sets", "slo_tiers",
                                                                                   "prefer_mode")}
        before = {k: current.model_dump(mode="json", exclude_none=True)[k] for k in sections}
        if before != sections:
            changes.append(audit.Change("update", "policy_set", "sections", before, sections))
        data = {**sections, "policies": [policy_json(p) for p in policies]}
        try:
            new = type(current).model_validate(data)
        except ValueError as e:  # (cannot happen: the canary's set was valid when it started)
            raise PolicyChangeError(422, "invalid_policy", str(e), "canary") from None
        return new, changes
    return mutate


def rollback_canary(canary_id: str | None = None) -> Mutation:
    """The canary ends; the stable set stays as it is (a new version without the canary).
    409 ``no_canary``."""
    def mutate(current: PolicySet) -> tuple[PolicySet, list[audit.Change]]:
        c = _running(current, canary_id)
        data = {**current.model_dump(mode="json", exclude_none=True)}
        data.pop("canary", None)
        return (type(current).model_validate(data),
                [audit.Change("rollback", "canary", c.id, canary_json(c), None)])
    return mutate
