"""The router's side of off-policy evaluation, over HTTP against a real server, on both decision-log
backends: per-tenant exploration (off by default, bounded, drawn per decision so a retry draws the
same), the propensity, action set and features logged with every decision, the reward computed
from the feedback with the one reward definition, a log written before all this migrated in place,
and ``xroute export-ope`` then ``xroute ope`` end to end on what the router logged."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psycopg
import pytest

from envs import kernels
from envs.features import N_OFFERING_FEATURES
from router.app.factory import create_app
from router.core.settings import EXPLORE_MAX
from router.decision import ope_log
from router.decision.engine import RoutingEngine
from router.state.base import Admission
from router.state.embedded import EmbeddedState
from router.store.readers import iter_decisions
from router.store.rows import ADDED_COLUMNS, ADDED_INDEXES
from router.store.sqlite import DecisionStore, GroupCommitLog, read_catalogs
from tests.servers import REPO_ROOT, ServerThread
from tests.state_support import decide
from tests.test_router_support import ROUTE, RouterSetup, make_setup
from xroute.errors import ConfigError
from xroute.schema.access import Principal
from xroute.schema.decision import RouteRequest
from xroute.schema.ope import read_log

EPS = 0.1
#: requests of tenant ``a`` (exploring) in the main test; its draws are fixed by the idempotency keys
N = 600
DENY_SPOT = {"deny": [{"pricing_modes": ["spot"]}]}
_names = (f"ope_{i}" for i in itertools.count())


def _setup(tmp: Path, backend: str, request: pytest.FixtureRequest, **kw: Any) -> RouterSetup:
    extra: dict[str, Any] = {}
    if backend == "postgresql":
        pg = request.getfixturevalue("postgres")
        extra["db_url"] = pg.create_database(next(_names))
    return make_setup(tmp, replay_speed=1e-6, env={"serving_config": str(tmp / "serving.yaml")}, **extra, **kw)


def _target(setup: RouterSetup) -> Path | str:
    s = setup.settings
    return s.db_url.get_secret_value() if s.db_url is not None else s.db_path


def _outcome(answer: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """What a client reports: the latency around the one expected (lognormal noise), the first
    token after a quarter of it, every token asked for."""
    latency = float(answer["expected_latency_ms"]) * float(np.exp(0.15 * rng.standard_normal()))
    return {"decision_id": answer["decision_id"], "latency_ms": latency, "ttft_ms": 0.25 * latency,
            "output_tokens": ROUTE["max_output_tokens"]}


def _logged(target: Path | str) -> dict[str, dict[str, Any]]:
    """Every decision of the log with its OPE record unpacked, by id."""
    out = {}
    for d in iter_decisions(target, ope=True):
        d["record"] = None if d["features"] is None else ope_log.unpack(d["features"])
        out[d["decision_id"]] = d
    return out


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xroute_app", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_exploration_is_logged_with_exact_propensities_and_evaluates_end_to_end(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    """Tenant ``a`` explores with epsilon 0.1, tenant ``b`` does not. Over HTTP: ``b`` never
    explores and logs propensity 1; ``a`` explores at a rate consistent with epsilon (a binomial
    bound; the draws are fixed by the idempotency keys), every served offering is in its logged
    action set, a deny constraint holds for explored requests too, each propensity is exactly
    eps-greedy's and they behave as probabilities (mean of 1/p = mean set size), and a retry
    under the same key answers the same. Then ``xroute export-ope`` and ``xroute ope``: greedy and
    the served policy (``greedy:epsilon=0.1``) get estimates, the served policy's intervals cover
    its own logged mean reward, and greedy's estimate is above it (exploration costs reward)."""
    setup = _setup(tmp_path, backend, request, tenants={"a": {"explore_epsilon": EPS}})
    target = _target(setup)
    rng = np.random.default_rng(11)
    answers: dict[str, dict[str, Any]] = {}
    denied: set[str] = set()
    with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=30) as http:
        catalog = {o["offering"]["offering_id"]: o["offering"]
                   for o in http.get("/v1/offerings", headers=setup.auth("a")).json()["offerings"]}
        for i in range(N + 100):
            who = "a" if i < N else "b"
            body = {**ROUTE, "constraints": DENY_SPOT} if i % 2 else ROUTE
            r = http.post("/v1/route", json=body, headers={**setup.auth(who), "Idempotency-Key": f"k-{i}"})
            assert r.status_code == 200, r.text
            d = r.json()
            answers[d["decision_id"]] = d
            if i % 2:
                denied.add(d["decision_id"])
            fb = _outcome(d, rng)
            if i % 50 == 7:  # a report that says too little to score: stored, its reward NULL
                fb.pop("ttft_ms")
            assert http.post("/v1/feedback", json=fb, headers=setup.auth(who)).status_code == 201
        # a retry under a key answers the same, explored or not, and books nothing
        for i in (3, 4, 5):
            again = http.post("/v1/route", json={**ROUTE, "constraints": DENY_SPOT} if i % 2 else ROUTE,
                              headers={**setup.auth("a"), "Idempotency-Key": f"k-{i}"})
            assert again.status_code == 200
            first = answers[again.json()["decision_id"]]
            assert again.json() == first
        # one decision left without feedback: the export counts it as pending
        pending = http.post("/v1/route", json=ROUTE, headers=setup.auth("a")).json()["decision_id"]

    logged = _logged(target)
    assert len(logged) == N + 101 and pending in logged
    ids = read_catalogs(target)
    assert len(ids) == 1
    offering_ids = next(iter(ids.values()))
    explored = expected = var = 0.0
    inv_p, sizes = [], []
    for did, d in logged.items():
        rec, p = d["record"], d["propensity"]
        assert rec is not None and p is not None
        action_set = [offering_ids[k] for k in rec.action_idx]
        served = d["offering_id"]
        assert action_set[rec.chosen] == served  # the served offering is in the logged set
        assert rec.rows.shape == (len(action_set), N_OFFERING_FEATURES) and np.isfinite(rec.rows).all()
        m = len(action_set)
        if did in denied:
            assert all(catalog[o]["pricing_mode"] != "spot" for o in action_set)
        if d["tenant"] == "b":
            assert d["epsilon"] == 0.0 and p == 1.0 and rec.chosen == rec.argmax
            continue
        assert d["epsilon"] == EPS
        is_choice = rec.chosen == rec.argmax
        assert p == ((1 - EPS) + EPS / m if is_choice else EPS / m)  # exactly eps-greedy's
        explored += not is_choice
        q = EPS * (1 - 1 / m)  # P(served != the policy's choice)
        expected += q
        var += q * (1 - q)
        inv_p.append(1 / p)
        sizes.append(m)
    assert expected > 20  # the sets were not all singletons: exploration could show
    assert abs(explored - expected) <= 4 * math.sqrt(var), (explored, expected, var)
    # propensities as probabilities: E[1/p(a)] over a ~ p is the set size
    se = float(np.std(inv_p, ddof=1)) / math.sqrt(len(inv_p))
    assert abs(float(np.mean(inv_p)) - float(np.mean(sizes))) <= 4 * se
    # the exploring decisions' answers name the offering served and the policy that decided
    assert all(answers[did]["offering"]["offering_id"] == logged[did]["offering_id"] for did in answers)

    # the reward at feedback: the environment's one reward definition on what the client reported
    engine = RoutingEngine(setup.settings)
    sample = [did for did in answers if logged[did]["reward"] is not None][:5]
    for did in sample:
        d = logged[did]
        got, missed = engine.env.outcome_reward(d["input_tokens"], d["observed_output_tokens"], d["ttft_ms"],
                                                d["tpot_ms"], d["deadline_ms"], d["expected_cost_usd"],
                                                d["observed_latency_ms"], d["observed_ttft_ms"], False)
        rw = engine.env.cfg.reward
        ref = engine.env.reference_cost(d["input_tokens"], d["observed_output_tokens"])
        budget = d["ttft_ms"] + d["tpot_ms"] * (d["observed_output_tokens"] - 1)
        by_hand = kernels.realized_reward(d["expected_cost_usd"], ref, d["observed_latency_ms"], budget, missed, False,
                                          rw.cost_weight, rw.latency_weight, rw.sla_penalty, rw.cost_norm_cap,
                                          rw.latency_norm_cap, rw.failure_latency_norm)
        assert d["reward"] == got == by_hand and d["sla_violation"] == int(missed)
    no_reward = {did for did, d in logged.items() if d["feedback_at"] is not None and d["reward"] is None}
    assert len(no_reward) == len([i for i in range(N + 100) if i % 50 == 7])

    # export, then estimate
    out = tmp_path / "decisions.parquet"
    cfg = tmp_path / "router.yaml"
    cfg.write_text(json.dumps({"env": {"serving_config": str(tmp_path / "serving.yaml")}}))
    db = str(target)
    done = _cli("export-ope", "--db", db, "--config", str(cfg), "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (f"exported {N + 100 - len(no_reward)} decisions to {out}; left out: 1 without "
                                   f"feedback yet, {len(no_reward)} whose feedback says too little to score (a "
                                   "completed request needs latency_ms, ttft_ms and output_tokens)")
    lg = read_log(out)
    assert lg.n == N + 100 - len(no_reward) and lg.header.source.startswith("router ")
    again = _cli("export-ope", "--db", db, "--config", str(cfg), "--output", str(out))
    assert again.returncode == 2 and "--output" in again.stderr and "exists" in again.stderr
    only_a = tmp_path / "a.jsonl"
    assert _cli("export-ope", "--db", db, "--config", str(cfg), "--output", str(only_a), "--tenant", "a",
                "--until", "2999-01-01T00:00:00Z").returncode == 0
    assert set(read_log(only_a).tenant) == {"a"}
    late = _cli("export-ope", "--db", db, "--config", str(cfg), "--output", str(tmp_path / "x.parquet"),
                "--since", "2999-01-01T00:00:00")
    assert late.returncode == 2 and "no decision in" in late.stderr
    bad = _cli("export-ope", "--db", db, "--output", str(tmp_path / "y.parquet"), "--since", "yesterday")
    assert bad.returncode == 2 and "--since: 'yesterday' is not an ISO-8601 time" in bad.stderr

    exploring = tmp_path / "a-only.parquet"
    assert _cli("export-ope", "--db", db, "--config", str(cfg), "--output", str(exploring), "--tenant",
                "a").returncode == 0
    report = tmp_path / "ope.json"
    served = f"greedy:epsilon={EPS}"
    run = _cli("ope", "--log", str(exploring), "--policy", "greedy", "--policy", served, "--output", str(report))
    assert run.returncode == 0, run.stderr
    rep = json.loads(report.read_text())
    logged_mean = rep["log"]["logged_mean"]["value"]
    assert rep["log"]["logging_policies"] == {"greedy": rep["log"]["decisions"]}
    own = rep["policies"][served]
    for est in ("ips", "snips", "dr"):
        lo, hi = own[est]["ci95"]
        assert lo <= logged_mean <= hi, (est, own[est], logged_mean)
    g = rep["policies"]["greedy"]
    assert all(math.isfinite(g[est]["value"]) for est in ("ips", "snips", "dr"))
    assert g["snips"]["value"] > logged_mean and g["dr"]["value"] > logged_mean
    assert 0.85 < g["agreement"] < 1.0


def test_without_exploration_nothing_explores_and_the_log_can_be_turned_off(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    """Off by default: no tenant configured, every decision logs propensity 1 and serves the
    policy's choice; a failed request's feedback is scored as the simulation scores one. With
    ``log_features: false`` nothing of it is logged (and the export says why)."""
    setup = _setup(tmp_path / "on", backend, request)
    with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=30) as http:
        for i in range(60):
            d = http.post("/v1/route", json=ROUTE, headers={**setup.auth("a"), "Idempotency-Key": f"k{i}"}).json()
            fb = {"decision_id": d["decision_id"], "failed": True, "error": "timeout"} if i == 0 else \
                _outcome(d, np.random.default_rng(i))
            assert http.post("/v1/feedback", json=fb, headers=setup.auth("a")).status_code == 201
    logged = _logged(_target(setup))
    assert len(logged) == 60
    for d in logged.values():
        assert d["propensity"] == 1.0 and d["epsilon"] == 0.0 and d["record"].chosen == d["record"].argmax
    failed = next(d for d in logged.values() if d["failed"])
    env = RoutingEngine(setup.settings).env
    assert failed["reward"] == env.outcome_reward(failed["input_tokens"], failed["max_output_tokens"],
                                                  failed["ttft_ms"], failed["tpot_ms"], None, 0.0, None, None,
                                                  True)[0]
    assert failed["sla_violation"] == 1

    off = _setup(tmp_path / "off", backend, request, log_features=False)
    with ServerThread(create_app(off.settings)) as url, httpx.Client(base_url=url, timeout=30) as http:
        d = http.post("/v1/route", json=ROUTE, headers=off.auth("a")).json()
        assert http.post("/v1/feedback", json=_outcome(d, np.random.default_rng(0)),
                         headers=off.auth("a")).status_code == 201
    (row,) = _logged(_target(off)).values()
    assert row["features"] is None and row["propensity"] == 1.0 and row["reward"] is not None
    done = _cli("export-ope", "--db", str(_target(off)), "--output", str(tmp_path / "o.parquet"))
    assert done.returncode == 2 and "left out: 1 logged without features" in done.stderr


def test_exploration_bounds_are_checked_and_name_the_field(tmp_path: Path) -> None:
    for value, problem in ((EXPLORE_MAX + 0.01, f"less than or equal to {EXPLORE_MAX}"),
                           (-0.1, "greater than or equal to 0")):
        with pytest.raises(ConfigError, match=rf"field 'tenants\.acme\.explore_epsilon': Input should be {problem}"):
            make_setup(tmp_path, tenants={"acme": {"explore_epsilon": value}})
    with pytest.raises(ConfigError, match=r"field 'tenants\.acme\.explore_epsilon': exploration needs log_features"):
        make_setup(tmp_path, log_features=False, tenants={"acme": {"explore_epsilon": 0.1}})
    # through the command line: one line, exit 2, before listening
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tenants: {acme: {explore_epsilon: 0.5}}\n")
    done = subprocess.run([sys.executable, "-m", "xroute_app", "serve", "--config", str(cfg), "--port", "1"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("xroute: error:") and "'tenants.acme.explore_epsilon'" in done.stderr


def test_the_draw_is_a_function_of_the_decision_so_a_replay_decides_the_same(tmp_path: Path) -> None:
    """Two routers fed the same requests under the same idempotency keys explore on the same
    requests and send them to the same offerings (the draw is per decision, not a shared
    stream); under other keys they explore elsewhere. Every answer's alternatives follow the
    policy's ranking, the explored offering first."""
    setup = make_setup(tmp_path, replay_speed=1e-6, tenants={"a": {"explore_epsilon": EXPLORE_MAX}})
    who = Principal("a", "tenant", "k")

    def run(prefix: str) -> list[tuple[str, int, int]]:
        eng = RoutingEngine(setup.settings)
        out = []
        for i in range(200):
            body = RouteRequest.model_validate({**ROUTE, "input_tokens": 100 + 37 * i})
            r = eng.rank(body, who, f"d_{i}", eng.source.start_wall, explore_key=f"{prefix}{i}")
            assert r.ope is not None
            _, _, first, argmax = r.ope
            out.append((eng.offering_ids[r.cands[0]], first, argmax))
        return out

    first, replay, other = run("k"), run("k"), run("other-")
    assert first == replay
    explored = [i for i, (_, pos, argmax) in enumerate(first) if pos != argmax]
    assert 10 < len(explored) < 60  # EXPLORE_MAX of 200, less the draws that hit the policy's choice
    assert explored != [i for i, (_, pos, argmax) in enumerate(other) if pos != argmax]


def test_a_request_the_shared_state_moves_logs_what_it_served_and_no_propensity(tmp_path: Path) -> None:
    """When the pool drawn (or chosen) has no room in the shared state, the request goes to the
    next candidate, as any full pool's would: the record names the offering served, the policy's
    choice stays what it was, and the propensity is NULL -- the probability of what was served is
    not known (the export leaves such decisions out)."""
    setup = make_setup(tmp_path, replay_speed=1e-6)
    eng = RoutingEngine(setup.settings)
    who = Principal("a", "tenant", "k")
    req = RouteRequest.model_validate(ROUTE)
    wall = eng.source.start_wall
    state = EmbeddedState()
    first = eng.candidates(eng.rank(req, who, "probe", wall))[0]  # ranked, not admitted
    for i in range(first[1]):  # another router fills that pool (this one's view does not know yet)
        assert state.core.admit(Admission(f"other-{i}", [first], 600.0)).pool == first[0]
    _, row, served, _ = decide(eng, req, who, "d_moved", wall, state=state)
    assert row.features is not None
    rec = ope_log.unpack(row.features)
    offering_ids = eng.offering_ids
    assert eng.pool_key_of(served) != first[0]
    assert offering_ids[rec.action_idx[rec.chosen]] == served
    assert eng.pool_key_of(offering_ids[rec.action_idx[rec.argmax]]) == first[0]
    assert row.propensity is None
    _, row, _, _ = decide(eng, req, who, "d_free", wall)  # without the shared state's refusal: known
    assert row.propensity == 1.0


# ------------------------------------------------------------------------------ migration
def _drop_ope_columns(target: Path | str) -> None:
    """Turn a log into one written before the OPE columns and the catalogs table existed."""
    stmts = ["DROP TABLE catalogs"] + [f"ALTER TABLE {t} DROP COLUMN {c}" for t, cols in ADDED_COLUMNS.items()
                                       for c, _ in cols if c in ("propensity", "epsilon", "features", "reward",
                                                                 "sla_violation")]
    if isinstance(target, str):
        with psycopg.connect(target) as conn:
            for s in stmts:
                conn.execute(s)  # type: ignore[arg-type]
    else:
        conn2 = sqlite3.connect(target)
        for s in stmts:
            conn2.execute(s)
        conn2.commit()
        conn2.close()


async def _open(target: Path | str) -> GroupCommitLog:
    if isinstance(target, str):
        from router.store.postgres import PostgresLog

        log: GroupCommitLog = PostgresLog(target)
        await log.open()  # type: ignore[attr-defined]
    else:
        log = DecisionStore(target)
    log.start()
    return log


def test_a_log_written_before_is_migrated_and_its_old_rows_are_left_out_of_the_export(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    """A log from before the OPE columns (both backends) gets them in place on start: its rows
    stay readable (their OPE columns NULL) beside the new ones, feedback on them is stored, and
    ``export-ope`` leaves them out, saying why."""
    setup = _setup(tmp_path, backend, request)
    target = _target(setup)
    engine = RoutingEngine(setup.settings)
    who = Principal("a", "tenant", "k")
    req = RouteRequest.model_validate(ROUTE)

    async def write(prefix: str, n: int) -> None:
        log = await _open(target)
        await log.register_catalog(engine.catalog_key, engine.offering_ids)
        for i in range(n):
            _, row, _, _ = decide(engine, req, who, f"{prefix}{i}", engine.source.start_wall + i)
            if prefix == "d_old":  # written by the previous version: none of the new columns
                row = dataclasses.replace(row, propensity=None, epsilon=None, features=None)
            await log.record_decision(row)
        await log.close()

    asyncio.run(write("d_old", 3))  # creates the current schema ...
    _drop_ope_columns(target)  # ... then back to the previous one
    asyncio.run(write("d_new", 3))  # the next start migrates it
    with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=30) as http:
        for did in ("d_old0", "d_new0", "d_new1"):
            fb = {"decision_id": did, "latency_ms": 800.0, "ttft_ms": 100.0, "output_tokens": 50}
            assert http.post("/v1/feedback", json=fb, headers=setup.auth("a")).status_code == 201
        got = http.get("/v1/decisions/d_old0", headers=setup.auth("a"))
        assert got.status_code == 200 and got.json()["feedback"][0]["latency_ms"] == 800.0
    logged = _logged(target)
    assert logged["d_old0"]["features"] is None and logged["d_new0"]["record"] is not None
    assert logged["d_old0"]["reward"] is not None  # feedback on an old decision is scored too
    out = tmp_path / "m.jsonl.gz"
    cfg = tmp_path / "router.yaml"
    cfg.write_text(json.dumps({"env": {"serving_config": str(tmp_path / "serving.yaml")}}))
    done = _cli("export-ope", "--db", str(target), "--config", str(cfg), "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("left out: 3 without feedback yet, 1 logged without features (before this "
                                        "version, or log_features: false)")
    assert sorted(read_log(out).decision_id) == ["d_new0", "d_new1"]


def test_two_processes_migrating_one_log_at_once_add_each_column_once(tmp_path: Path) -> None:
    """Two routers starting on one SQLite log (the CI failure: both read the old columns, the second
    then added ``cached_tokens`` the first had added). While another connection holds the write lock
    and adds the columns, opening the store waits for it and adds nothing twice."""
    import threading

    from router.store.dialect import SQLITE, add_columns, connect_sqlite

    path = tmp_path / "log.db"
    DecisionStore(path)._conn.close()  # the current schema, less the columns added since
    with sqlite3.connect(path) as old:
        for stmt in ADDED_INDEXES:  # (an old log had no index on the columns added since)
            old.execute(f"DROP INDEX {stmt.split()[5]}")
        for table, added in ADDED_COLUMNS.items():
            for name, _ in added:
                old.execute(f"ALTER TABLE {table} DROP COLUMN {name}")
    holder = connect_sqlite(path)
    holder.execute("BEGIN IMMEDIATE")  # another process migrating it now
    errors: list[BaseException] = []

    def other_start() -> None:
        try:
            DecisionStore(path)._conn.close()
        except BaseException as e:  # (reported by the assertion below)
            errors.append(e)

    t = threading.Thread(target=other_start)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # waiting for the lock, not reading the old columns
    for table, added in ADDED_COLUMNS.items():
        have = {r[1] for r in holder.execute(f"PRAGMA table_info({table})")}
        for name, kind in added:
            if name not in have:
                holder.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
    holder.execute("COMMIT")
    t.join(30)
    assert not t.is_alive() and errors == []
    add_columns(holder.execute, SQLITE, "decisions", ADDED_COLUMNS["decisions"])  # idempotent
    cols = [r[1] for r in holder.execute("PRAGMA table_info(decisions)")]
    assert len(cols) == len(set(cols)) and {n for n, _ in ADDED_COLUMNS["decisions"]} <= set(cols)
