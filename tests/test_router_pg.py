"""The decision log's two backends behind one interface -- SQLite (the embedded default) and
PostgreSQL (``db_url``) -- against a real PostgreSQL server (``tests/servers.py``): the same suite
for both, then what only PostgreSQL has: several routers writing one log, the server going away
and coming back, and credentials that never reach a log."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.app.factory import create_app
from router.core.text import redact
from router.decision.engine import RoutingEngine
from router.service.export import export_bundle
from router.store.postgres import PostgresLog, check_reachable
from router.store.readers import iter_decisions
from router.store.rows import DecisionRef, DecisionRow
from router.store.sqlite import DecisionStore, GroupCommitLog, StoreClosed
from tests.servers import PostgresServer, ServerThread
from tests.state_support import decide
from tests.test_router_support import ROUTE, LogCapture, make_setup
from xroute.bundle import load_bundle
from xroute.errors import ConfigError
from xroute.schema.access import Principal
from xroute.schema.decision import RouteRequest

A = Principal("a", "tenant", "k1")
_names = (f"t{i}" for i in itertools.count())


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> RoutingEngine:
    return RoutingEngine(make_setup(tmp_path_factory.mktemp("engine")).settings)


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str | Path:
    """Where a fresh decision log lives: a SQLite file, or a new database on the test server."""
    if request.param == "sqlite":
        return tmp_path / "d.db"
    return request.getfixturevalue("postgres").create_database(f"log_{next(_names)}")  # type: ignore[no-any-return]


async def _open(target: str | Path, **kw: Any) -> GroupCommitLog:
    log: GroupCommitLog
    if isinstance(target, Path):
        log = DecisionStore(target, **kw)
    else:
        pg = PostgresLog(target, **kw)
        await pg.open()
        log = pg
    log.start()
    return log


def _rows(engine: RoutingEngine, n: int, prefix: str = "d_", start: float = 0.0) -> list[DecisionRow]:
    req = RouteRequest.model_validate(ROUTE)
    return [decide(engine, req, A, f"{prefix}{i:04d}", engine.source.start_wall + start + i * 0.5)[1]  # type: ignore[attr-defined]
            for i in range(n)]


def test_both_backends_group_commit_read_and_export(target: str | Path, engine: RoutingEngine, tmp_path: Path) -> None:
    """Rows of one loop iteration share a commit; a duplicate id fails alone; feedback gets
    increasing ids; reads see only the caller's tenant; the export reads either backend."""
    rows = _rows(engine, 40)
    ids = [r.decision_id for r in rows]

    async def run() -> None:
        log = await _open(target)
        assert await log.healthy()
        await asyncio.gather(*(log.record_decision(r) for r in rows))
        assert log.rows == 40 and log.commits < 40  # grouped
        dup, fresh = rows[3], dataclasses.replace(rows[4], decision_id="d_9999")
        res = await asyncio.gather(log.record_decision(dup), log.record_decision(fresh), return_exceptions=True)
        assert isinstance(res[0], StoreClosed) and res[1] == 0
        f1 = await log.record_feedback((ids[0], "a", 1.0, 900.0, None, 42, 0, None, 120.0, None, -0.5, 0))
        f2 = await log.record_feedback((ids[0], "a", 2.0, None, None, None, 1, "timeout", None, None, None,
                                                   None))
        assert f2 > f1 > 0
        rec = await log.get_decision(ids[0], "a")
        assert rec is not None and rec["decision_id"] == ids[0] and rec["request"]["origin"] == ROUTE["origin"]
        assert [(f["latency_ms"], f["failed"], f["error"]) for f in rec["feedback"]] == [
            (900.0, False, None), (None, True, "timeout")]
        assert await log.get_decision(ids[0], "b") is None and await log.get_decision("d_nope", None) is None
        assert (await log.get_decision(ids[0], None)) == rec  # the admin view
        assert await log.owner(ids[1]) == "a" and await log.owner("d_nope") is None
        assert log.describe()["backend"] in ("sqlite", "postgresql") and log.describe()["rows"] == 43
        await log.close()
        with pytest.raises(StoreClosed):
            log.record_decision(rows[5])

    asyncio.run(run())
    exported = [d["decision_id"] for d in iter_decisions(target)]
    assert exported == [*ids[:5], "d_9999", *ids[5:]]  # (created_at, decision_id) order; d_9999 has d_0004's time
    assert [d["decision_id"] for d in iter_decisions(target, "b")] == []
    out = export_bundle(target, engine.source.path, tmp_path / "export")  # type: ignore[attr-defined]
    assert out["decisions"] == 41 and out["with_feedback"] == 1
    bundle = load_bundle(tmp_path / "export")
    assert int(bundle.workload["output_tokens"].iloc[0]) == 80  # the latest feedback has none: max_output_tokens
    readme = (tmp_path / "export" / "README.md").read_text()
    assert "passfile" not in readme and "pgpass" not in readme  # a URL is shown redacted


def test_both_backends_look_up_decisions_and_read_back_keyed_rows(target: str | Path, engine: RoutingEngine) -> None:
    """What feedback reads of a decision (tenant, model, pool, feedback so far), and the rows made
    under an idempotency key since a time -- the answer exactly as sent -- for restoring the keys
    after a restart; the new feedback column (TTFT) reads back."""
    now = time.time()
    rows = _rows(engine, 3)
    kid = f"d_{int(now * 1000):012x}{7:020x}"  # a decision id as the router makes them (time-sorted)
    keyed = dataclasses.replace(rows[2], decision_id=kid, created_at=now, idempotency_key="a:route:k1")

    async def run() -> None:
        log = await _open(target)
        await asyncio.gather(*(log.record_decision(r) for r in [*rows[:2], keyed]))
        await log.record_feedback((rows[0].decision_id, "a", now, 900.0, None, None, 0, None, 120.0, None, None, None))
        await log.record_feedback((kid, "a", now, 5.0, None, 3, 0, None, None, "a:feedback:k2", None, None))
        r0 = rows[0]
        ref = await log.lookup(r0.decision_id)
        assert ref == DecisionRef("a", r0.model, r0.pool, 1, r0.input_tokens, r0.max_output_tokens,  # type: ignore[arg-type]
                                  r0.ttft_ms, r0.tpot_ms, r0.deadline_ms, r0.expected_cost_usd, None, None,
                                  r0.policy_kind, r0.policy_version, r0.propensity,
                                  None if r0.features is None else bytes(r0.features), r0.greedy_offering_id)
        assert (await log.lookup(rows[1].decision_id)).feedback == 0 and await log.lookup("d_nope") is None  # type: ignore[union-attr]
        assert (await log.get_decision(r0.decision_id, "a"))["feedback"][0]["ttft_ms"] == 120.0  # type: ignore[index]
        decisions, feedback = await log.keyed_since(now - 60)
        assert [(d[0], d[1], d[2]) for d in decisions] == [("a:route:k1", keyed.request_json, keyed.response_json)]
        assert [f[:4] for f in feedback] == [("a:feedback:k2", feedback[0][1], kid, now)]
        assert feedback[0][4:] == (5.0, None, None, 3, 0, None)
        assert await log.keyed_since(now + 3600) == ([], [])
        await log.close()

    asyncio.run(run())


def test_close_commits_what_is_pending(target: str | Path, engine: RoutingEngine) -> None:
    rows = _rows(engine, 30, "d_c")

    async def run() -> list[Any]:
        log = await _open(target)
        futs = [log.record_decision(r) for r in rows]  # queued; close() lets them all commit
        await log.close()
        return [f.result() for f in futs]

    assert asyncio.run(run()) == [0] * 30
    assert len(list(iter_decisions(target))) == 30


def test_several_logs_write_one_postgres_database_concurrently(postgres: PostgresServer, engine: RoutingEngine) -> None:
    """Four writers (as four routers would) commit interleaved batches into one database: every row
    is there once, and each writer reads the others' decisions."""
    url = postgres.create_database(f"shared_{next(_names)}")
    per = 60
    rows = [_rows(engine, per, f"d_w{k}_", start=1000.0 * k) for k in range(4)]

    async def run() -> None:
        logs = [await _open(url) for _ in range(4)]
        await asyncio.gather(*(log.record_decision(r) for i in range(per) for log, rs in zip(logs, rows)
                               for r in [rs[i]]))
        for k, log in enumerate(logs):
            other = rows[(k + 1) % 4][7].decision_id
            assert await log.get_decision(other, "a") is not None
            await log.close()

    asyncio.run(run())
    assert sorted(d["decision_id"] for d in iter_decisions(url)) == sorted(r.decision_id for rs in rows for r in rs)


@pytest.mark.slow
def test_postgres_down_answers_storeclosed_and_recovers(engine: RoutingEngine) -> None:
    """The server stopped under a running log: the batch in flight and the next ones fail with
    StoreClosed (the API's 503), ``healthy()`` says so, nothing is acknowledged that was not
    committed; started again, the next write commits without a restart of the log."""
    server = PostgresServer().start()
    try:
        url = server.create_database("outage")
        rows = _rows(engine, 20, "d_o")

        async def run() -> None:
            log = await _open(url)
            await log.record_decision(rows[0])
            server.stop("immediate")
            res = await asyncio.gather(*(log.record_decision(r) for r in rows[1:5]), return_exceptions=True)
            assert all(isinstance(r, StoreClosed) for r in res), res
            assert log.error is not None and "decision log postgresql://" in log.error
            assert not await log.healthy()
            with pytest.raises(StoreClosed):
                await log.get_decision(rows[0].decision_id, "a")
            server.start()
            assert await log.healthy()  # the probe reconnects
            for _ in range(3):  # each idle connection notices the restart on its first use
                res = await asyncio.gather(*(log.record_decision(r) for r in rows[5:]), return_exceptions=True)
                if all(r == 0 for r in res):
                    break
            assert all(r == 0 for r in res), res
            assert await log.get_decision(rows[10].decision_id, "a") is not None
            await log.close()

        asyncio.run(run())
        stored = {d["decision_id"] for d in iter_decisions(url)}
        assert rows[0].decision_id in stored and rows[5].decision_id in stored
        assert not stored & {r.decision_id for r in rows[1:5]}  # failed, and never acknowledged
    finally:
        server.close()


def test_unreachable_postgres_is_one_line_without_secrets(postgres: PostgresServer) -> None:
    url = postgres.database_url("nope_missing")
    with pytest.raises(ConfigError) as e:
        check_reachable(url)
    assert "nope_missing" in str(e.value) and "\n" not in str(e.value)
    assert "passfile" not in str(e.value) and postgres.password not in str(e.value)
    assert redact("postgresql://u:s3cret@h:5433/db?sslmode=require") == "postgresql://u@h:5433/db"

    async def run() -> None:
        log = PostgresLog(url)
        with pytest.raises(StoreClosed) as e2:
            await log.open()
        assert postgres.password not in str(e2.value) and "passfile" not in str(e2.value)

    asyncio.run(run())


@pytest.fixture(scope="module")
def pg_routers(postgres: PostgresServer, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[list[str], Any, LogCapture]]:
    """Two routers (their own processes' worth of state: app, engine, event loop) writing one
    PostgreSQL log, with the same keys."""
    url = postgres.create_database("routers")
    tmp = tmp_path_factory.mktemp("pgrouters")
    setup = make_setup(tmp, db_url=url, log_level="INFO")
    logs = LogCapture().attach()
    servers = [ServerThread(create_app(setup.settings)) for _ in range(2)]
    try:
        urls = []
        for srv in servers:
            urls.append(srv.__enter__())
            logs.attach()
        yield urls, setup, logs
    finally:
        for srv in servers:
            srv.__exit__(None, None, None)
        logs.detach()


def test_routers_on_one_postgres_log_read_each_others_decisions(pg_routers: Any, postgres: PostgresServer) -> None:
    urls, setup, logs = pg_routers
    acked: list[tuple[int, str]] = []
    lock = threading.Lock()

    def fire(k: int) -> None:
        with httpx.Client(base_url=urls[k % 2], timeout=10) as c:
            for i in range(25):
                r = c.post("/v1/route", json={**ROUTE, "session_id": f"s{k}-{i}"}, headers=setup.auth("a"))
                if r.status_code == 200:
                    with lock:
                        acked.append((k % 2, r.json()["decision_id"]))

    threads = [threading.Thread(target=fire, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(acked) >= 50
    with httpx.Client(timeout=10) as c:
        for served_by, did in acked:
            other = urls[1 - served_by]
            r = c.get(f"{other}/v1/decisions/{did}", headers=setup.auth("a"))
            assert r.status_code == 200 and r.json()["decision_id"] == did
            assert c.get(f"{other}/v1/decisions/{did}", headers=setup.auth("b")).status_code == 404
        did = acked[0][1]
        fb = c.post(f"{urls[1]}/v1/feedback", json={"decision_id": did, "latency_ms": 5.0}, headers=setup.auth("a"))
        assert fb.status_code == 201
        rec = c.get(f"{urls[0]}/v1/admin/decisions/{did}", headers=setup.auth("admin")).json()
        assert rec["feedback"][0]["latency_ms"] == 5.0
        status = c.get(f"{urls[0]}/v1/admin/status", headers=setup.auth("admin")).json()["decision_log"]
        assert status["backend"] == "postgresql" and status["url"].endswith("/routers") and "passfile" not in status["url"]
        assert c.get(f"{urls[0]}/readyz").json()["decision_log"] == "ok"
    text = "\n".join(logs.lines)
    assert postgres.password not in text and "pgpass" not in text
