"""The versioned policy store and its append-only audit log (``router/store/policies.py``,
``router/store/audit.py``) on both backends -- SQLite (the decision log's file) and a real PostgreSQL --
: versions, per-policy versions, optimistic concurrency, concurrent writers, the policy files'
apply, append-only enforced by the database, durability across a kill."""

from __future__ import annotations

import itertools
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from router.store.audit import Change, append
from router.store.policies import (
    PolicyChangeError,
    PolicyStore,
    PolicyStoreError,
    create_policy,
    delete_policy,
    put_policy,
)
from xroute.schema.policy_ir import Policy, PolicySet

_names = itertools.count()


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str | Path:
    if request.param == "sqlite":
        return tmp_path / "decisions.db"
    return request.getfixturevalue("postgres").create_database(f"pol_{next(_names)}")  # type: ignore[no-any-return]


def deny(name: str, **c: Any) -> Policy:
    return Policy(name=name, effect="deny", constraints=c or {"pricing_modes": ["spot"]})


def test_changes_make_versions_and_each_is_audited(target: str | Path) -> None:
    store = PolicyStore(target)
    assert store.head() == 0 and store.at() == PolicySet()
    ps = store.change("key:aaaa0001", create_policy(deny("no-spot")), request_id="r1")
    assert ps.version == 1 and ps.policy("no-spot").version == 1  # type: ignore[union-attr]
    ps = store.change("key:aaaa0001", put_policy(deny("no-spot", providers=["aws"])))
    assert ps.version == 2 and ps.policy("no-spot").version == 2  # type: ignore[union-attr]
    assert store.change("key:aaaa0001", put_policy(deny("no-spot", providers=["aws"]))).version == 2  # unchanged
    ps = store.change("key:bbbb0002", put_policy(Policy(name="fast", effect="prefer", weight=0.1)))
    assert ps.version == 3 and [p.name for p in ps.policies] == ["no-spot", "fast"]
    ps = store.change("key:bbbb0002", delete_policy("no-spot"))
    assert ps.version == 4 and [p.name for p in ps.policies] == ["fast"]
    assert store.head() == 4
    assert store.at(1).policy("no-spot").constraints.pricing_modes == ["spot"]  # type: ignore[union-attr]
    assert store.at(2).policy("no-spot").constraints.providers == ["aws"]  # type: ignore[union-attr]
    with pytest.raises(PolicyChangeError) as e:
        store.at(99)
    assert e.value.status == 404
    entries = store.audit()
    assert [(x["action"], x["resource"], x["version"], x["principal"]) for x in entries] == [
        ("create", "no-spot", 1, "key:aaaa0001"), ("update", "no-spot", 2, "key:aaaa0001"),
        ("create", "fast", 3, "key:bbbb0002"), ("delete", "no-spot", 4, "key:bbbb0002")]
    assert entries[0]["before"] is None and entries[0]["after"]["constraints"] == {"pricing_modes": ["spot"]}
    assert entries[1]["before"]["version"] == 1 and entries[1]["after"]["constraints"]["providers"] == ["aws"]
    assert entries[3]["after"] is None and entries[3]["before"]["name"] == "no-spot"
    assert entries[0]["request_id"] == "r1" and entries[0]["at"].endswith("Z")
    assert [x["audit_id"] for x in store.audit(resource="no-spot", after=entries[0]["audit_id"])] == [
        entries[1]["audit_id"], entries[3]["audit_id"]]
    store.close()


def test_refused_changes_write_nothing(target: str | Path) -> None:
    store = PolicyStore(target)
    store.change("key:1", create_policy(deny("a")))
    cases = [(create_policy(deny("a")), 409, "conflict"),
             (put_policy(deny("a", providers=["gcp"]).model_copy(update={"version": 7})), 409, "version_conflict"),
             (put_policy(deny("new").model_copy(update={"version": 1})), 409, "version_conflict"),
             (delete_policy("zzz"), 404, "not_found"),
             (delete_policy("a", version=3), 409, "version_conflict"),
             (put_policy(deny("b", region_sets=["eu"])), 422, "invalid_policy")]
    for mutation, status, error in cases:
        with pytest.raises(PolicyChangeError) as e:
            store.change("key:1", mutation)
        assert (e.value.status, e.value.error) == (status, error), e.value.message
    assert store.head() == 1 and len(store.audit()) == 1
    # the right version is taken
    ps = store.change("key:1", put_policy(deny("a", providers=["gcp"]).model_copy(update={"version": 1})))
    assert ps.version == 2 and ps.policy("a").version == 2  # type: ignore[union-attr]
    store.close()


def test_the_audit_log_is_append_only_in_the_database(target: str | Path) -> None:
    store = PolicyStore(target)
    store.change("key:1", create_policy(deny("a")))
    if isinstance(target, Path):
        conn = sqlite3.connect(target)
        for sql in ("UPDATE audit_log SET principal = 'someone else'", "DELETE FROM audit_log"):
            with pytest.raises(sqlite3.DatabaseError, match="append-only"):
                conn.execute(sql)
        conn.close()
    else:
        import psycopg

        with psycopg.connect(target, autocommit=True) as conn:
            for sql in ("UPDATE audit_log SET principal = 'someone else'", "DELETE FROM audit_log"):
                with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
                    conn.execute(sql)
    assert store.audit()[0]["principal"] == "key:1"
    store.close()


def test_concurrent_writers_lose_nothing_and_conflicting_ones_get_409(target: str | Path) -> None:
    """Eight writers (each its own store connection, as eight routers) create 5 policies each at
    once: 40 versions, contiguous, every policy there, one audit entry each. Then eight update one
    policy from the same version: exactly one wins."""
    PolicyStore(target).close()  # (the schema, once)
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            s = PolicyStore(target)
            for j in range(5):
                s.change(f"key:w{k}", create_policy(deny(f"p{k}-{j}")))
            s.close()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    store = PolicyStore(target)
    ps = store.at()
    assert ps.version == 40 and sorted(p.name for p in ps.policies) == sorted(f"p{k}-{j}" for k in range(8) for j in range(5))
    assert [v["version"] for v in store.versions(100)] == list(range(40, 0, -1))
    assert len(store.audit(limit=1000)) == 40
    won, lost = [], []

    def updater(k: int) -> None:
        s = PolicyStore(target)
        try:
            s.change(f"key:u{k}", put_policy(deny("p0-0", providers=[f"x{k}"]).model_copy(update={"version": 1})))
            won.append(k)
        except PolicyChangeError as e:
            lost.append(e.status)
        finally:
            s.close()

    threads = [threading.Thread(target=updater, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1 and lost == [409] * 7
    assert store.at().policy("p0-0").constraints.providers == [f"x{won[0]}"]  # type: ignore[union-attr]
    store.close()


def test_policy_files_apply_once_keep_api_policies_and_drop_what_the_files_dropped(target: str | Path) -> None:
    store = PolicyStore(target)
    files = PolicySet.model_validate({"region_sets": {"eu": ["aws:eu-west-1"]},
                                      "policies": [deny("f1"), {"name": "f2", "effect": "allow",
                                                                "constraints": {"region_sets": ["eu"]}}]})
    new = store.apply_files("config:a.yaml", files, ["a.yaml"])
    assert new is not None and new.version == 1 and [p.name for p in new.policies] == ["f1", "f2"]
    assert store.apply_files("config:a.yaml", files, ["a.yaml"]) is None  # unchanged: nothing written
    store.change("key:1", create_policy(deny("api-made", providers=["gcp"])))
    files2 = PolicySet.model_validate({"region_sets": {"eu": ["aws:eu-west-1"]},
                                       "policies": [deny("f1", providers=["aws"]), deny("f3")]})
    new = store.apply_files("config:a.yaml", files2, ["a.yaml"])
    assert new is not None and new.version == 3
    assert {p.name: p.version for p in new.policies} == {"f1": 2, "api-made": 1, "f3": 1}  # f2 gone: the files dropped it
    actions = [(e["action"], e["kind"], e["resource"]) for e in store.audit(after=0) if e["version"] == 3]
    assert ("delete", "policy", "f2") in actions and ("update", "policy", "f1") in actions
    assert ("create", "policy", "f3") in actions and ("apply", "policy_files", "a.yaml") in actions
    # a region set the store's other policies still use cannot be dropped by the files
    store.change("key:1", create_policy(Policy(name="uses-eu", effect="allow", constraints={"region_sets": ["eu"]})))
    with pytest.raises(PolicyChangeError) as e:
        store.apply_files("config:a.yaml", PolicySet(policies=[deny("f1")]), ["a.yaml"])
    assert e.value.status == 422 and "unknown region set 'eu'" in e.value.message
    store.close()


def test_the_slo_tiers_keep_their_order_through_the_store(target: str | Path) -> None:
    """First match wins among ``slo_tiers``: a catch-all named before the tight class in the
    alphabet, but written after it, must stay after it in every stored version (it was stored with
    sorted keys, and a live router then classed every request as the catch-all)."""
    store = PolicyStore(target)
    files = PolicySet.model_validate({"slo_tiers": {"tight": {"max_tpot_ms": 40}, "any": {}},
                                      "policies": [deny("f1")]})
    assert files.request_class(None, 1500.0, 30.0, None) == "tight"
    new = store.apply_files("config:a.yaml", files, ["a.yaml"])
    assert new is not None and list(new.slo_tiers) == ["tight", "any"]
    for ps in (store.at(), store.change("key:1", create_policy(deny("api-made", providers=["gcp"])))):
        assert list(ps.slo_tiers) == ["tight", "any"]
        assert ps.request_class(None, 1500.0, 30.0, None) == "tight"
        assert ps.request_class(None, 1500.0, 80.0, None) == "any"
    # the same tiers in the other order are another set: applied as a change
    swapped = PolicySet.model_validate({"slo_tiers": {"any": {}, "tight": {"max_tpot_ms": 40}},
                                        "policies": [deny("f1")]})
    new = store.apply_files("config:a.yaml", swapped, ["a.yaml"])
    assert new is not None and list(new.slo_tiers) == ["any", "tight"]
    assert store.at().request_class(None, 1500.0, 30.0, None) == "any"
    store.close()


def test_routers_starting_together_apply_the_files_once(target: str | Path) -> None:
    PolicyStore(target).close()
    files = PolicySet(policies=[deny("f1"), deny("f2", providers=["gcp"])])
    results: list[Any] = []

    def start() -> None:
        s = PolicyStore(target)
        results.append(s.apply_files("config:p.yaml", files, ["p.yaml"]))
        s.close()

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(r is not None for r in results) == 1
    store = PolicyStore(target)
    assert store.head() == 1 and store.files_applied()["names"] == ["f1", "f2"]  # type: ignore[index]
    store.close()


def test_an_acknowledged_change_survives_a_kill(tmp_path: Path) -> None:
    """A process that commits a change and is killed (SIGKILL) right after the call returns: the
    change is there when the store is opened again (synchronous commit before acknowledgement)."""
    db = tmp_path / "decisions.db"
    code = ("import os, sys\n"
            "from router.store.policies import PolicyStore, create_policy\n"
            "from xroute.schema.policy_ir import Policy\n"
            f"s = PolicyStore({str(db)!r})\n"
            "for k in range(20):\n"
            "    s.change('key:k', create_policy(Policy(name=f'p{k}', effect='deny')))\n"
            "    print(k, flush=True)\n"
            "os.kill(os.getpid(), 9)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == -signal.SIGKILL and r.stdout.split()[-1] == "19", r.stderr
    store = PolicyStore(db)
    assert store.head() == 20 and len(store.at().policies) == 20 and len(store.audit()) == 20
    store.close()


def test_an_unreachable_postgres_store_is_one_line_without_secrets(postgres: Any) -> None:
    url = postgres.database_url("nope_does_not_exist")
    with pytest.raises(PolicyStoreError) as e:
        PolicyStore(url)
    msg = str(e.value)
    assert "\n" not in msg and postgres.password not in msg and "policy store postgresql://" in msg


def test_audit_entries_are_written_in_the_callers_transaction(tmp_path: Path) -> None:
    """``router.store.audit.append`` is generic (a later wave audits quotas, tenants, role bindings the
    same way): entries written inside a transaction that rolls back leave nothing."""
    store = PolicyStore(tmp_path / "d.db")
    conn = sqlite3.connect(tmp_path / "d.db", isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    append(lambda sql, args: conn.execute(sql, args), "key:x", [Change("create", "quota", "acme", None, {"rpm": 5})], 1)
    conn.execute("ROLLBACK")
    assert store.audit() == []
    conn.execute("BEGIN IMMEDIATE")
    append(lambda sql, args: conn.execute(sql, args), "key:x", [Change("create", "quota", "acme", None, {"rpm": 5})], 1)
    conn.execute("COMMIT")
    (e,) = store.audit(kind="quota")
    assert e["after"] == {"rpm": 5} and e["resource"] == "acme"
    conn.close()
    store.close()
