"""Router pieces without HTTP: policy IR, keys, settings, engine decisions, decision log, export."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import sqlite3
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.exceptions import RequestValidationError

from router.api.route import route_request
from router.control.keys import KeyStore, add_key, list_keys, revoke_key
from router.core.settings import load_settings
from router.decision.engine import RouteFailure, RoutingEngine
from router.decision.model_slot import ActivePolicy, resolve
from router.decision.telemetry import ReplaySource
from router.service.export import export_bundle
from router.state.base import pool_key
from router.state.embedded import EmbeddedState
from router.store.readers import iter_decisions
from router.store.rows import DECISION_COLUMNS, DecisionRef, DecisionRow
from router.store.sqlite import DecisionStore, StoreClosed
from tests.state_support import decide
from tests.test_router_support import ROUTE, LogCapture, make_setup, write_model
from xroute.bundle import load_bundle
from xroute.errors import ConfigError
from xroute.schema.access import Principal
from xroute.schema.decision import FeedbackRequest, RouteRequest
from xroute.schema.offering import Offering
from xroute.schema.policy_ir import CatalogIndex, ConstraintError, Constraints, Rule, compile_constraints

A = Principal("a", "tenant", "k1")


def _catalog() -> list[Offering]:
    out = []
    for prov, region, acc in [("p1", "r-east", "A10G"), ("p2", "r-west", "L4"), ("p3", "r-asia", "T4")]:
        for mode in ("on_demand", "spot"):
            out.append(Offering(f"{prov}:{region}:{acc}:{mode}", prov, region, f"{acc}-box", mode, acc, 1, 4, 16))
    return out


# ---------------------------------------------------------------------------------------- policy IR
def test_policy_ir_allow_deny_prefer_and_layers() -> None:
    idx = CatalogIndex(_catalog())
    c = compile_constraints([("tenant", Constraints(allow=[Rule(providers=["p1", "p2"])])),
                             ("request", Constraints(deny=[Rule(pricing_modes=["spot"])],
                                                     prefer=[Rule(regions=["p2:r-west"])]))], idx)
    assert c.allowed.tolist() == [True, False, True, False, False, False]
    assert c.preferred is not None and c.preferred.tolist() == [False, False, True, True, False, False]
    assert c.excluded_counts() == {"request:denied": 2, "tenant:not_allowed": 2}
    # a request cannot widen its tenant: allowing p3 on top of a p1/p2-only tenant leaves nothing
    none = compile_constraints([("tenant", Constraints(allow=[Rule(providers=["p1"])])),
                                ("request", Constraints(allow=[Rule(providers=["p3"])]))], idx)
    assert not none.allowed.any()
    # fields of one rule AND, rules of one list OR
    both = compile_constraints([("r", Constraints(allow=[Rule(providers=["p1"], pricing_modes=["spot"]),
                                                         Rule(accelerators=["T4"])]))], idx)
    assert both.allowed.tolist() == [False, True, False, False, True, True]


def test_policy_ir_unknown_values_name_the_field_with_close_matches() -> None:
    idx = CatalogIndex(_catalog())
    with pytest.raises(ConstraintError) as e:
        compile_constraints([("constraints", Constraints(deny=[Rule(regions=["r-eats"])]))], idx)
    assert e.value.field == "constraints.deny[0].regions[0]"
    assert "r-east" in e.value.suggestions
    with pytest.raises(ValueError, match="at least one"):
        Rule()
    with pytest.raises(ValueError):
        Constraints.model_validate({"allow": [{"provider": ["p1"]}]})  # typo'd key is an error, not a no-op


# ---------------------------------------------------------------------------------------- keys
def test_keys_are_stored_hashed_verified_and_revocable(tmp_path: Path) -> None:
    f = tmp_path / "keys.json"
    key = add_key(f, "acme")
    admin = add_key(f, "ops", "admin")
    text = f.read_text()
    assert key not in text and key.split("_", 2)[2] not in text
    store = KeyStore(f, check_s=0)
    who = store.verify(key)
    assert who is not None and who.tenant == "acme" and not who.is_admin
    assert store.verify(admin).is_admin  # type: ignore[union-attr]
    assert store.verify(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    for junk in ("", "xr_", "xr_1234_abc", "Bearer x", key + "\x00", "x" * 500):
        assert store.verify(junk) is None
    key_id = key.split("_")[1]
    assert [r["key_id"] for r in list_keys(f)] == [key_id, admin.split("_")[1]]
    assert revoke_key(f, key_id)
    assert store.verify(key) is None  # reloaded on change
    with pytest.raises(ConfigError):
        add_key(f, "bad tenant!")


def test_a_key_verified_once_is_remembered_until_its_record_changes(tmp_path: Path) -> None:
    f = tmp_path / "keys.json"
    key = add_key(f, "acme")
    store = KeyStore(f, check_s=0)
    first = store.verify(key)
    assert first is not None and store.verify(key) is first  # the remembered principal
    add_key(f, "other")  # the file changes: every record is re-read, the key is hashed again
    again = store.verify(key)
    assert again is not None and again.tenant == "acme"
    revoke_key(f, key.split("_")[1])
    assert store.verify(key) is None


def test_loop_histogram_exposes_what_prometheus_clients_histogram_does() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from router.core.metrics import LoopHistogram

    buckets = (25e-6, 1e-3, 0.5)
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = LoopHistogram("x_seconds", "doc", buckets, ours_reg)
    theirs = Histogram("x_seconds", "doc", buckets=buckets, registry=theirs_reg)
    for v in (1e-6, 25e-6, 3e-5, 1e-3, 0.2, 0.7, 9.0):  # below, on and between the bounds, above
        ours.observe(v)
        theirs.observe(v)

    def lines(reg: CollectorRegistry) -> set[str]:
        return {x for x in generate_latest(reg).decode().splitlines() if "_created" not in x}

    assert lines(ours_reg) == lines(theirs_reg)
    assert 'x_seconds_bucket{le="2.5e-05"} 2.0' in lines(ours_reg)


def test_loop_counter_exposes_what_prometheus_clients_counter_does() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from router.core.metrics import LoopCounter

    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = LoopCounter("x_total", "doc", ("offering_id", "kind"), ours_reg)
    theirs = Counter("x_total", "doc", ["offering_id", "kind"], registry=theirs_reg)
    for labels in (("a:b:c", "model"), ("a:b:c", "model"), ('q"uote\\', "fallback")):  # escaping too
        ours.inc(*labels)
        theirs.labels(*labels).inc()

    def lines(reg: CollectorRegistry) -> set[str]:
        return {x for x in generate_latest(reg).decode().splitlines() if "_created" not in x}

    assert lines(ours_reg) == lines(theirs_reg)
    assert 'x_total{kind="model",offering_id="a:b:c"} 2.0' in lines(ours_reg) and ours.counts[("a:b:c", "model")] == 2


def test_the_direct_access_line_is_the_formatted_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """``router.core.logs.access`` writes its line itself when only the router's handler listens: the
    same JSON object, keys in the same order, as ``JsonFormatter`` makes of the logged record."""
    import io
    import re

    from router.core import logs

    logs.configure_logging("INFO")
    h = logs._handler
    assert h is not None
    buf = io.StringIO()
    monkeypatch.setattr(h, "stream", buf)
    token = logs.request_id_var.set("rid-1")
    args = [("rid-1", "POST", "/v1/route", 200, 1.234, 'ten"ant\\x', "d_0123", "ab" * 16),
            ("rid-1", "GET", "unmatched", 404, 0.5, None, None, None)]
    try:
        for a in args:
            logs.access(*a)
        h.force_flush()
        cap = LogCapture().attach()  # another handler: the logging path
        try:
            for a in args:
                logs.access(*a)
        finally:
            cap.detach()
    finally:
        logs.request_id_var.reset(token)
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    direct, via_logging = lines[:2], lines[2:]  # the router's handler got the logged records too
    assert len(via_logging) == 2 and [r["status"] for r in cap.records()] == [200, 404]
    for d, v in zip(direct, via_logging):
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", d.pop("ts"))
        v.pop("ts")
        assert d == v and list(d) == list(v)
    assert direct[0]["tenant"] == 'ten"ant\\x' and "tenant" not in direct[1]


def test_settings_layering_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text("fallback_policy: cheapest\nalternatives: 2\ntenants:\n  a:\n    constraints:\n"
                   "      deny: [{pricing_modes: [spot]}]\n")
    s = load_settings(cfg)
    assert (s.fallback_policy, s.alternatives) == ("cheapest", 2)
    assert s.tenants["a"].constraints.deny[0].pricing_modes == ["spot"]
    monkeypatch.setenv("XROUTE_ROUTER_ALTERNATIVES", "5")
    monkeypatch.setenv("XROUTE_ROUTER_ENV__QUEUE_TIMEOUT_S", "7")
    s = load_settings(cfg, fallback_policy="greedy")
    assert (s.fallback_policy, s.alternatives, s.env) == ("greedy", 5, {"queue_timeout_s": "7"})
    cfg.write_text("alternativs: 2\n")
    with pytest.raises(ConfigError, match="alternativs"):
        load_settings(cfg)
    monkeypatch.delenv("XROUTE_ROUTER_ALTERNATIVES")
    cfg.write_text("alternatives: -1\n")
    with pytest.raises(ConfigError, match="'alternatives'"):
        load_settings(cfg)


# ---------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> RoutingEngine:
    setup = make_setup(tmp_path_factory.mktemp("engine"),
                       tenants={"a": {"constraints": {"deny": [{"accelerators": ["T4"]}]}}})
    return RoutingEngine(setup.settings)


def _decide(engine: RoutingEngine, who: Principal = A, wall: float | None = None, **body: object) -> dict:
    req = RouteRequest.model_validate({**ROUTE, **body})
    payload, row, oid, info = decide(engine, req, who, "d_test", engine.source.start_wall if wall is None else wall)
    out = json.loads(payload)
    assert out["offering"]["offering_id"] == oid == row.offering_id
    return out


def test_decision_respects_tenant_and_request_constraints(engine: RoutingEngine) -> None:
    for _ in range(5):
        d = _decide(engine, constraints={"allow": [{"providers": ["gcp", "azure"]}]})
        assert d["offering"]["provider"] == "gcp"  # azure only has T4, denied for tenant a
        assert d["excluded"]["by_reason"]["tenant:denied"] == 2
        assert d["excluded"]["by_reason"]["request:not_allowed"] == 2
        assert d["policy"]["kind"] == "fallback" and d["policy"]["name"] == "greedy"
        assert d["score_kind"] == "expected_reward"
        assert all(a["offering"]["provider"] == "gcp" for a in d["alternatives"])
        assert d["offering"] not in [a["offering"] for a in d["alternatives"]]
        assert d["expected_latency_ms"] > 0 and d["expected_cost_usd"] > 0
    d = _decide(engine, constraints={"prefer": [{"pricing_modes": ["spot"]}]})
    assert d["offering"]["pricing_mode"] == "spot" and d["excluded"]["by_reason"].get("not_preferred", 0) >= 1
    other = _decide(engine, Principal("b", "tenant", "k2"), constraints={"allow": [{"accelerators": ["T4"]}]})
    assert other["offering"]["accelerator"] == "T4"  # tenant b has no default constraints


def test_decision_errors_name_the_field(engine: RoutingEngine) -> None:
    with pytest.raises(RouteFailure) as e:
        _decide(engine, origin="aws:us-eats-1")
    assert e.value.status == 422 and e.value.fields[0]["field"] == "body.origin"
    assert "aws:us-east-1" in e.value.fields[0]["suggestions"]
    with pytest.raises(RouteFailure) as e:
        _decide(engine, constraints={"allow": [{"accelerators": ["T4"]}]})  # tenant a denies T4
    assert (e.value.status, e.value.error) == (422, "no_offering")
    with pytest.raises(RouteFailure) as e:
        _decide(engine, constraints={"allow": [{"instance_types": ["g5.xlarg"]}]})
    assert e.value.fields[0]["field"] == "body.constraints.allow[0].instance_types[0]"
    assert e.value.fields[0]["suggestions"] == ["g5.xlarge"]


def test_full_pools_answer_429_with_retry_after(tmp_path: Path) -> None:
    eng = RoutingEngine(make_setup(tmp_path, env={"serving_config": str(tmp_path / "serving.yaml"),
                                                  "queue_timeout_s": 0.5}).settings)
    statuses = []
    for _ in range(60):  # long requests from one instant fill every slot of the allowed pool
        try:
            _decide(eng, input_tokens=4000, max_output_tokens=2000, ttft_ms=60000, tpot_ms=1000,
                    constraints={"allow": [{"offering_ids": ["gcp:europe-west4:g2-standard-4:on_demand"]}]})
            statuses.append(200)
        except RouteFailure as e:
            statuses.append(e.status)
            assert int(e.headers["Retry-After"]) >= 1 and e.extra["excluded"]["queue_full"] == 1
    assert statuses[:14] == [200] * 14 and statuses[-1] == 429  # 2 replicas x 7 slots


def test_replay_clock_maps_and_wraps(tmp_path: Path) -> None:
    setup = make_setup(tmp_path)
    src = ReplaySource(setup.settings.telemetry, speed=10.0, offset_s=5.0, start_wall=1000.0)
    t, gen = src.telemetry_time(1000.0)
    assert t == pytest.approx(src.start + 5.0) and gen == 0
    t, gen = src.telemetry_time(1000.0 + (src.span - 5.0 + 1.0) / 10.0)
    assert t == pytest.approx(src.start + 1.0) and gen == 1
    # a wrap keeps the work in flight: the view moves back with the clock (CloudRouteEnv.shift_live_clock),
    # and the shared state is not touched
    src = ReplaySource(setup.settings.telemetry, speed=10.0, offset_s=src.span - 1.0, start_wall=1000.0)
    eng = RoutingEngine(setup.settings, source=src)
    state = EmbeddedState()

    def busy() -> int:  # requests in the router's view of the pools
        return int(eng.env.inflight.sum())

    req = RouteRequest.model_validate({**ROUTE, "max_output_tokens": 1000})  # expected to take ~30 s
    for k in range(5):
        decide(eng, req, A, f"d_{k}", 1000.0 + k * 0.01, state=state)
    assert busy() == 5 and eng.generation == 0
    before = eng.env.est_free.copy()
    decide(eng, req, A, "d_5", 1000.0 + 0.15, state=state)  # 1.5 s later: wrapped
    assert eng.generation == 1 and busy() == 6  # still in flight
    assert sum(state.core.view().in_flight.values()) == 6
    moved = np.isfinite(before)  # the slots expected to free: moved back by the window
    assert moved.sum() == 5 and np.allclose(eng.env.est_free[moved], before[moved] - src.span)
    _decide(eng, wall=1000.0 + 6.0)  # 60 s later: the six have ended as expected
    assert busy() == 1


def test_stale_telemetry_forces_the_fallback_and_says_so(tmp_path: Path) -> None:
    eng = RoutingEngine(make_setup(tmp_path, max_telemetry_age_s=5.0).settings)
    from tests.test_router_support import FakePolicy

    eng.slot.install(ActivePolicy.make(FakePolicy({"prefer": "spot"}), "fake", "model", "v1", "x"))
    wall = eng.freshness.last_ok_wall
    d = _decide(eng, wall=wall + 1.0)
    assert d["policy"]["kind"] == "model" and d["score_kind"] == "q_value" and not d["telemetry"]["stale"]
    assert d["offering"]["pricing_mode"] == "spot"
    d = _decide(eng, wall=wall + 6.0)
    assert d["policy"]["kind"] == "fallback" and "stale" in d["policy"]["reason"]
    assert d["telemetry"]["stale"] and d["telemetry"]["age_s"] == pytest.approx(6.0, abs=0.01)


def test_model_error_at_decision_time_falls_back_for_that_request(engine: RoutingEngine) -> None:
    from tests.test_router_support import FakePolicy

    old = engine.slot.model
    engine.slot.install(ActivePolicy.make(FakePolicy({"nan": True}), "bad", "model", "v9", "x"))
    try:
        d = _decide(engine)
        assert d["policy"]["kind"] == "fallback" and d["policy"]["reason"].startswith("model error")
    finally:
        engine.slot.model = old


def test_the_compiled_greedy_decision_answers_as_the_general_path(tmp_path: Path) -> None:
    """The greedy policy decided in one compiled call (``router.decision.kernels.greedy_decide``) and through
    ``_choose`` like every other policy give byte-identical answers, the same log rows, the same
    429s, and leave the same pool state, over requests with tenant, request and prefer
    constraints that fill the pools."""
    _compare_fused_and_general(tmp_path, "fused_greedy", None)


@pytest.mark.parametrize("hidden", [[64, 64], [32]])
def test_the_compiled_learned_decision_answers_as_the_general_path(tmp_path: Path, hidden: list[int]) -> None:
    """A learned scorer's decision through ``router.decision.kernels.valid_rows`` / ``scored_decide`` and
    through ``_choose`` (``offering_features``, the scorer, ``rank_scored``, ``commit_live``): the
    same bytes, rows, 429s and pool state, with and without a context layer and reward prior."""
    import itertools

    from envs.features import N_OFFERING_FEATURES as NF
    from envs.features import N_REQUEST_FEATURES as NR
    from models.policy import LearnedPolicy, RewardPrior, RouterWeights
    from xroute.config import EnvConfig

    rng = np.random.default_rng(len(hidden))
    ctx_dim = 16 if len(hidden) > 1 else 0
    dims = [NF + NR + ctx_dim, *hidden, 1]
    layers = [(rng.normal(0, 0.3, (a, b)).astype(np.float32), rng.normal(0, 0.1, b).astype(np.float32))
              for a, b in itertools.pairwise(dims)]
    ctx = ((rng.normal(0, 0.3, (NF + NR, ctx_dim)).astype(np.float32), rng.normal(0, 0.1, ctx_dim).astype(np.float32))
           if ctx_dim else None)
    weights = RouterWeights(layers=layers, ctx=ctx, prior=RewardPrior.from_env_config(EnvConfig()) if ctx else None)
    _compare_fused_and_general(tmp_path, "fused_learned", LearnedPolicy(weights))


def _compare_fused_and_general(tmp_path: Path, switch: str, policy: Any) -> None:
    setup = make_setup(tmp_path, env={"serving_config": str(tmp_path / "serving.yaml"), "queue_timeout_s": 2.0},
                       tenants={"a": {"constraints": {"deny": [{"accelerators": ["T4"]}]}}})
    st = setup.settings
    fused, general = (RoutingEngine(st, source=ReplaySource(st.telemetry, st.replay_speed, st.replay_offset_s,
                                                            start_wall=1000.0)) for _ in range(2))
    setattr(general, switch, False)
    general.freshness = fused.freshness  # the same telemetry age in both answers
    if policy is not None:
        for eng in (fused, general):
            policy.reset(eng.env, 0)
            eng.slot.install(ActivePolicy.make(policy, "learned", "model", "v1", "x"))
    rng = np.random.default_rng(3)
    bodies = [{}, {"constraints": {"prefer": [{"pricing_modes": ["spot"]}]}},
              {"constraints": {"allow": [{"providers": ["gcp", "aws"]}], "prefer": [{"regions": ["us-east-1"]}]}},
              {"constraints": {"deny": [{"pricing_modes": ["on_demand"]}]}}, {"session_id": "s-1"}]
    outcomes = {200: 0, 429: 0}
    kinds = set()
    wall0 = 1000.0
    clock = [wall0]  # the shared state's clock: the requests' wall time, the same for both engines
    # every other request reserves in an embedded shared state (whose capacity may send it to an
    # alternative, or refuse it), the others use the environment's view alone
    states = [EmbeddedState(clock=lambda: clock[0]) for _ in range(2)]
    shared_full = 0
    for i in range(400):
        who = A if i % 3 else Principal("b", "tenant", "k2")
        req = RouteRequest.model_validate({**ROUTE, "origin": fused.origins[i % len(fused.origins)],
                                           "input_tokens": int(rng.integers(10, 4000)),
                                           "max_output_tokens": int(rng.integers(1, 2000)), **bodies[i % len(bodies)]})
        wall = clock[0] = wall0 + 0.3 * i
        got = []
        for eng, state in zip((fused, general), states):
            try:
                payload, row, oid, info = decide(eng, req, who, f"d_{i}", wall, state=state if i % 2 else None)
                got.append((200, payload, row, oid))
                kinds.add(json.loads(payload)["score_kind"])
            except RouteFailure as e:
                got.append((e.status, e.error, e.headers, e.extra))
                shared_full += "shared state" in e.message
        assert got[0] == got[1], i
        outcomes[got[0][0]] += 1
    assert outcomes[200] > 100 and outcomes[429] > 20  # both the answers and the full pools were compared
    assert states[0].core.view().in_flight == states[1].core.view().in_flight and states[0].core.view().in_flight
    assert shared_full > 0  # the shared capacity refused some (both engines alike)
    assert kinds == {"expected_reward" if policy is None else "q_value"}
    for k in ("est_free", "est_min", "inflight", "shift"):
        assert np.array_equal(getattr(fused.env, k), getattr(general.env, k)), k
    assert fused.env._events == general.env._events


def test_one_process_on_the_embedded_state_decides_as_its_view_alone(tmp_path: Path) -> None:
    """One process, the embedded state, no feedback: every reservation is its own (others = 0),
    so until a pool's reservations reach their capacity the answers are the environment's view
    alone -- what the router answered before the shared state -- byte for byte; the shared view
    read back (``apply_shared_view``) changes nothing. (Checked up to the first request whose
    first-ranked pool is at its capacity in the state: 94 requests since the view's queue term
    counts its own work on a full pool, which moves the load between pools; 300 before.)"""
    setup = make_setup(tmp_path)
    st = setup.settings
    alone, shared = (RoutingEngine(st, source=ReplaySource(st.telemetry, st.replay_speed, st.replay_offset_s,
                                                           start_wall=1000.0)) for _ in range(2))
    shared.freshness = alone.freshness
    clock = [1000.0]
    state = EmbeddedState(clock=lambda: clock[0])
    rng = np.random.default_rng(5)
    answered = 0
    for i in range(300):
        req = RouteRequest.model_validate({**ROUTE, "origin": alone.origins[i % len(alone.origins)],
                                           "input_tokens": int(rng.integers(10, 4000)),
                                           "max_output_tokens": int(rng.integers(1, 600))})
        wall = clock[0] = 1000.0 + 0.2 * i
        try:
            ranked = alone.rank(req, A, f"d_{i}", wall)
        except RouteFailure:
            ranked = None
        if ranked is not None:  # the premise: the pool the view ranks first still has room in the state
            pool, capacity = alone.candidates(ranked)[0]
            if state.core.view().in_flight.get(pool, 0) >= capacity:
                break  # (the state holds a reservation until its hold passes, the view until its expected end)
        got = []
        for eng, st_ in ((alone, None), (shared, state)):
            try:
                got.append(decide(eng, req, A, f"d_{i}", wall, state=st_)[0])
            except RouteFailure as e:
                got.append((e.status, e.error))
        assert got[0] == got[1], i
        answered += isinstance(got[0], bytes)
        if i % 10 == 0:
            shared.apply_shared_view(state.core.view().in_flight, {})
            assert not shared.env.view_others.any()
    assert answered > 80 and sum(state.core.view().in_flight.values()) > 20  # load, and reservations held


def test_set_live_is_observe_live_without_the_observation(engine: RoutingEngine) -> None:
    """The router's lazy path (``set_live``, then ``_obs`` only when a policy reads features) gives
    exactly ``observe_live``'s mask, expectations and observation."""
    env = engine.env
    t = engine.now(engine.source.start_wall)
    for i, origin in enumerate(engine.origins * 3):
        args = (t + i, origin, 100 + 97 * i, 5 + 7 * i, 500.0 + 300 * i, 20.0 + i, None, None, "a", f"r{i}")
        state = env.save_state()
        obs, info = env.observe_live(*args)
        ref = {k: getattr(env, k).copy() for k in ("c_lat", "c_cost", "c_mask", "c_wait", "c_risk")}
        ref_cost = env.r_ref_cost
        env.restore_state(state)
        mask = env.set_live(*args)
        assert np.array_equal(mask, info["action_mask"][: env.n]) and env.r_ref_cost == ref_cost
        for k, v in ref.items():
            assert np.array_equal(getattr(env, k), v), k
        obs2 = env.observation()
        for k in obs:
            assert np.array_equal(obs[k], obs2[k]), k
        env.commit_live(int(np.flatnonzero(mask)[0]))


def test_one_request_scorer_equals_the_batch_scorer() -> None:
    """``RouterWeights.scores_one`` (the router's path, weights split by input block) is ``scores``
    on a batch of one, all rows valid: equal up to float32 rounding, and the same choice."""
    import itertools

    from envs.features import N_OFFERING_FEATURES as NF
    from envs.features import N_REQUEST_FEATURES as NR
    from models.policy import RewardPrior, RouterWeights
    from xroute.config import EnvConfig

    rng = np.random.default_rng(7)
    for trial in range(60):
        ctx_dim, hidden = [(16, [64, 64]), (0, [32]), (8, [128, 64])][trial % 3]
        dims = [NF + NR + ctx_dim, *hidden, 1]
        layers = [(rng.normal(0, 0.3, (a, b)).astype(np.float32), rng.normal(0, 0.1, b).astype(np.float32))
                  for a, b in itertools.pairwise(dims)]
        ctx = ((rng.normal(0, 0.3, (NF + NR, ctx_dim)).astype(np.float32),
                rng.normal(0, 0.1, ctx_dim).astype(np.float32)) if ctx_dim else None)
        w = RouterWeights(layers=layers, ctx=ctx, prior=RewardPrior.from_env_config(EnvConfig()) if trial % 2 else None)
        k = int(rng.integers(1, 130))
        rows = (rng.random((k, NF)) * 3).astype(np.float32)
        req = rng.random(NR).astype(np.float32)
        batch = w.scores(rows[None], req[None], np.ones((1, k), np.float32))[0]
        one = w.scores_one(rows, req)
        np.testing.assert_allclose(one, batch, rtol=1e-5, atol=1e-5)
        assert int(np.argmax(one)) == int(np.argmax(batch)) or np.isclose(one.max(), batch.max(), rtol=1e-6)


def test_resolve_versions_local_models(tmp_path: Path) -> None:
    m = write_model(tmp_path / "m.json", prefer="spot")
    uri, v1 = resolve(str(m))
    assert uri == str(m) and v1.startswith("local-")
    write_model(m, prefer="on_demand", pad="changed size")
    assert resolve(str(m))[1] != v1
    assert resolve("models:/xroute-router/7") == ("models:/xroute-router/7", "7")
    with pytest.raises(FileNotFoundError):
        resolve(str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------- log + export
def test_group_commit_log_and_export_bundle(tmp_path: Path, engine: RoutingEngine) -> None:
    db = tmp_path / "d.db"

    async def run() -> list[str]:
        store = DecisionStore(db)
        store.start()
        ids = []
        rows = []
        for i in range(40):
            req = RouteRequest.model_validate({**ROUTE, "session_id": f"s{i}"})
            did = f"d_{i:04d}"
            _, row, _, _ = decide(engine, req, A, did, engine.source.start_wall + i * 0.5)
            rows.append(row)
            ids.append(did)
        await asyncio.gather(*(store.record_decision(r) for r in rows))
        # a duplicate id fails alone, not the batch it was committed with
        dup, fresh = rows[3], dataclasses.replace(rows[4], decision_id=f"d_{99:04d}")
        res = await asyncio.gather(store.record_decision(dup), store.record_decision(fresh), return_exceptions=True)
        assert isinstance(res[0], StoreClosed) and not isinstance(res[1], BaseException)
        conn0 = sqlite3.connect(db)
        assert conn0.execute("SELECT COUNT(*) FROM decisions WHERE decision_id = 'd_0099'").fetchone()[0] == 1
        conn0.execute("DELETE FROM decisions WHERE decision_id = 'd_0099'")
        conn0.commit()
        conn0.close()
        fb = FeedbackRequest(decision_id=ids[0], latency_ms=900.0, output_tokens=42)
        await store.record_feedback((fb.decision_id, "a", 1.0, fb.latency_ms, None, fb.output_tokens, 0, None, None, None,
                                    None, None))
        assert store.commits < 40  # grouped
        assert (await store.get_decision(ids[0], "a"))["feedback"][0]["latency_ms"] == 900.0  # type: ignore[index]
        assert await store.get_decision(ids[0], "b") is None
        await store.close()
        return ids

    ids = asyncio.run(run())
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT COUNT(*) FROM decisions").fetchone()[0] == 40
    assert [d["decision_id"] for d in iter_decisions(db)] == ids
    out = tmp_path / "export"
    res = export_bundle(db, engine.source.path, out)
    assert res["decisions"] == 40 and res["with_feedback"] == 1
    b = load_bundle(out)
    assert list(b.workload["request_id"]) == ids
    assert int(b.workload["output_tokens"].iloc[0]) == 42 and int(b.workload["output_tokens"].iloc[1]) == 80
    assert np.all(np.diff(b.workload["ts"].astype("int64")) >= 0)
    assert (out / "outcomes.csv").read_text().count("\n") == 41
    with pytest.raises(ConfigError, match="overwrite"):
        export_bundle(db, engine.source.path, out)


def test_compressed_responses_read_back_exactly_and_old_logs_migrate(tmp_path: Path, engine: RoutingEngine) -> None:
    """Answers are stored compressed against the engine's dictionary and read back byte-identical;
    a log written before compression (plain-text answers, no dictionary column) is migrated in
    place and its rows stay readable beside the new ones."""
    db = tmp_path / "d.db"
    legacy = sqlite3.connect(db)  # the previous schema, one plain-text row
    legacy.executescript("""CREATE TABLE decisions (decision_id TEXT PRIMARY KEY, tenant TEXT NOT NULL,
        created_at REAL NOT NULL, telemetry_ts REAL NOT NULL, origin TEXT NOT NULL, input_tokens INTEGER NOT NULL,
        max_output_tokens INTEGER NOT NULL, ttft_ms REAL NOT NULL, tpot_ms REAL NOT NULL, deadline_ms REAL,
        model TEXT NOT NULL, session_id TEXT, offering_id TEXT NOT NULL,
        expected_latency_ms REAL NOT NULL, expected_cost_usd REAL NOT NULL, policy TEXT NOT NULL,
        policy_kind TEXT NOT NULL, policy_version TEXT, bundle_hash TEXT NOT NULL, request_json TEXT NOT NULL,
        response_json TEXT NOT NULL);
        CREATE TABLE feedback (feedback_id INTEGER PRIMARY KEY AUTOINCREMENT, decision_id TEXT NOT NULL,
        tenant TEXT NOT NULL, received_at REAL NOT NULL, latency_ms REAL, cost_usd REAL, output_tokens INTEGER,
        failed INTEGER NOT NULL, error TEXT);""")
    req = RouteRequest.model_validate(ROUTE)
    old_text, old_row, _, _ = decide(engine, req, A, "d_old", engine.source.start_wall)
    old_values = tuple(v for c, v in zip(DECISION_COLUMNS, old_row.astuple())
                       if c not in ("pool", "hold_until", "idempotency_key", "propensity", "epsilon", "features",
                                    "quota_tokens", "quota_usd", "trace_id", "policy_arm", "greedy_offering_id"))
    legacy.execute(f"INSERT INTO decisions VALUES ({', '.join('?' * len(old_values))})", old_values)
    legacy.execute("INSERT INTO feedback (decision_id, tenant, received_at, latency_ms, failed) "
                   "VALUES ('d_old', 'a', 1.0, 800.0, 0)")
    legacy.commit()
    legacy.close()

    async def run() -> list[tuple[str, bytes]]:
        store = DecisionStore(db)
        store.use_dictionary(engine.response_dictionary())
        store.start()
        sent = []
        for i in range(50):
            text, row, _, _ = decide(engine, req, A, f"d_{i:03d}", engine.source.start_wall + 1 + i)
            await store.record_decision(row)
            sent.append((f"d_{i:03d}", text))
        for did, text in [("d_old", old_text), *sent]:
            rec = await store.get_decision(did, "a")
            assert rec is not None
            rec.pop("request"), rec.pop("feedback")
            assert rec == json.loads(text)
        # the old rows got the state's columns: no pool stored, so the lookup derives it; no TTFT
        old = await store.lookup("d_old")
        assert old is not None and old.input_tokens == ROUTE["input_tokens"]  # what the reward needs, read back
        assert dataclasses.replace(old, input_tokens=0, max_output_tokens=0, ttft_ms=0.0, tpot_ms=0.0,
                                   expected_cost_usd=0.0, policy_kind="", policy_version=None) == DecisionRef(
            "a", old_row.model, pool_key(old_row.model, old_row.offering_id), 1)
        assert (await store.get_decision("d_old", "a"))["feedback"][0]["ttft_ms"] is None  # type: ignore[index]
        await store.close()
        return sent

    sent = asyncio.run(run())
    conn = sqlite3.connect(db)
    stored = dict(conn.execute("SELECT decision_id, length(response_json) FROM decisions"))
    plain = {did: len(text) for did, text in sent}
    assert all(stored[d] * 3 < plain[d] for d in plain)  # compressed with the preset dictionary
    assert conn.execute("SELECT codec, COUNT(*) FROM zdicts GROUP BY codec").fetchall() == [("zstd", 1)]
    conn.close()
    # a second start with the same catalog reuses the stored dictionary
    store = DecisionStore(db)
    assert store.use_dictionary(engine.response_dictionary()) == 1
    asyncio.run(store.close())


def test_deflated_answers_from_older_logs_stay_readable(tmp_path: Path, engine: RoutingEngine) -> None:
    """A log from the versions that deflated answers against a zlib preset dictionary (a
    ``zdicts`` table without a codec column) is migrated in place: those rows read back exactly,
    new rows use Zstandard, and the two dictionaries live side by side."""
    db = tmp_path / "d.db"
    store = DecisionStore(db)
    asyncio.run(store.close())
    data = engine.response_dictionary()[-32768:]
    req = RouteRequest.model_validate(ROUTE)
    old_text, old_row, _, _ = decide(engine, req, A, "d_old", engine.source.start_wall)
    legacy = sqlite3.connect(db)  # rewrite the table as the deflate versions made it
    legacy.executescript("DROP TABLE zdicts; CREATE TABLE zdicts (zdict_id INTEGER PRIMARY KEY, "
                         "sha256 TEXT NOT NULL UNIQUE, data BLOB NOT NULL);")
    legacy.execute("INSERT INTO zdicts (sha256, data) VALUES (?, ?)", (hashlib.sha256(data).hexdigest(), data))
    c = zlib.compressobj(6, zdict=data)
    deflated = c.compress(old_text) + c.flush()
    legacy.execute(f"INSERT INTO decisions VALUES ({', '.join('?' * (len(DECISION_COLUMNS) + 1))})",
                   (*old_row.astuple()[:-1], deflated, 1))
    legacy.commit()
    legacy.close()

    async def run() -> None:
        store = DecisionStore(db)
        assert store.use_dictionary(engine.response_dictionary()) == 2
        store.start()
        text, row, _, _ = decide(engine, req, A, "d_new", engine.source.start_wall + 1)
        await store.record_decision(row)
        for did, sent in (("d_old", old_text), ("d_new", text)):
            rec = await store.get_decision(did, "a")
            assert rec is not None
            rec.pop("request"), rec.pop("feedback")
            assert rec == json.loads(sent)
        await store.close()

    asyncio.run(run())
    conn = sqlite3.connect(db)
    assert dict(conn.execute("SELECT zdict_id, codec FROM zdicts")) == {1: "zlib", 2: "zstd"}
    assert dict(conn.execute("SELECT decision_id, response_zdict FROM decisions")) == {"d_old": 1, "d_new": 2}
    conn.close()


def test_wal_stays_bounded_under_a_steady_stream_of_commits(tmp_path: Path) -> None:
    """The WAL is rewound after checkpoints although commits never pause (it grew without bound
    when only a background checkpointer ran)."""
    db = tmp_path / "d.db"
    pad = "x" * 2000

    took: list[float] = []

    async def run() -> int:
        store = DecisionStore(db, checkpoint_rows=500, on_checkpoint=took.append)
        store.start()
        biggest = 0
        for i in range(60):
            rows = [DecisionRow(f"d_{i:03d}_{j:02d}", "a", 1.0, 1.0, "o", 1, 1, 1.0, 1.0, None, "m", None, "x", 1.0, 1.0,
                                "g", "fallback", None, "h", None, None, None, None, None, None, None, None, "{}", pad)
                    for j in range(50)]
            await asyncio.gather(*(store.record_decision(r) for r in rows))
            wal = db.with_name(db.name + "-wal")
            biggest = max(biggest, wal.stat().st_size if wal.exists() else 0)
        assert store.checkpoints >= 3
        # each checkpoint's duration comes back from the writer process with the next acknowledgement
        assert store.checkpoints - 1 <= len(took) <= store.checkpoints
        assert all(0 < t < 30 for t in took), took
        await store.close()
        return biggest

    biggest = asyncio.run(run())
    written = 3000 * 2000
    assert biggest < written / 2, (biggest, written)  # without rewinding it holds every page written
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM decisions").fetchone()[0] == 3000


def test_a_dead_writer_process_fails_waiting_requests_cleanly(tmp_path: Path, engine: RoutingEngine) -> None:
    """The writer process killed: the request waiting on it and every later one get StoreClosed
    (the API's 503), quickly, with the reason in ``error``; nothing hangs."""
    import os
    import signal

    async def run() -> None:
        store = DecisionStore(tmp_path / "d.db")
        store.start()
        req = RouteRequest.model_validate(ROUTE)
        _, row, _, _ = decide(engine, req, A, "d_first", engine.source.start_wall)
        await store.record_decision(row)  # the writer works
        os.kill(store._proc.pid, signal.SIGKILL)
        _, row2, _, _ = decide(engine, req, A, "d_second", engine.source.start_wall + 1)
        with pytest.raises(StoreClosed, match="writer process exited"):
            await asyncio.wait_for(store.record_decision(row2), timeout=10)
        with pytest.raises(StoreClosed):
            await store.record_decision(row2)
        assert store.error is not None and "writer process exited" in store.error
        assert await store.get_decision("d_first", "a") is not None  # what was committed stays readable
        await store.close()

    asyncio.run(run())


def test_the_process_writer_pipelines_batches_in_order(tmp_path: Path, engine: RoutingEngine) -> None:
    """The writer process keeps up to PROCESS_BATCHES_IN_FLIGHT batches at the writer; acknowledgements
    map to their batches in order, every request is answered after its own commit, and a writer
    killed with batches in flight fails the waiting requests instead of hanging them."""
    import os
    import signal

    from router.store.sqlite import PROCESS_BATCHES_IN_FLIGHT

    req = RouteRequest.model_validate(ROUTE)
    rows = [decide(engine, req, A, f"d_p{i:04d}", engine.source.start_wall + i)[1] for i in range(80)]

    async def run() -> None:
        store = DecisionStore(tmp_path / "d.db")
        store.start()
        answered: list[int] = []
        most = 0
        futs = []
        for i, row in enumerate(rows[:60]):
            fut = store.record_decision(row)
            fut.add_done_callback(lambda f, i=i: answered.append(i))
            futs.append(fut)
            await asyncio.sleep(0)  # a loop iteration: its flush runs
            most = max(most, len(store._in_flight_batches))
        await asyncio.wait_for(asyncio.gather(*futs), timeout=30)
        assert most == PROCESS_BATCHES_IN_FLIGHT == 2
        assert answered == list(range(60)) and store.rows == 60 and store.commits < 60
        for i in (0, 31, 59):
            assert await store.get_decision(f"d_p{i:04d}", "a") is not None
        # the writer killed with two batches in flight: all twenty requests fail or succeed, none hangs
        late = []
        for row in rows[60:]:
            late.append(store.record_decision(row))
            await asyncio.sleep(0)
            if len(store._in_flight_batches) == 2:
                break
        assert len(store._in_flight_batches) == 2
        os.kill(store._proc.pid, signal.SIGKILL)
        res = await asyncio.wait_for(asyncio.gather(*late, return_exceptions=True), timeout=10)
        assert all(isinstance(r, StoreClosed) or r == 0 for r in res) and isinstance(res[-1], StoreClosed)
        assert not store._in_flight_batches and store.closed
        await store.close()

    asyncio.run(run())


_BASE = '"origin":"aws:us-east-1","input_tokens":500,"max_output_tokens":30'
_BODIES = [
    "{" + _BASE + ',"ttft_ms":4000,"tpot_ms":50}', "{" + _BASE + ',"ttft_ms":4000.5,"tpot_ms":50}', "{" + _BASE + ',"ttft_ms":"4000","tpot_ms":50}',
    "{" + _BASE + ',"ttft_ms":true,"tpot_ms":50}', "{" + _BASE + ',"ttft_ms":NaN,"tpot_ms":50}', "{" + _BASE + ',"ttft_ms":Infinity,"tpot_ms":50}',
    "{" + _BASE + ',"ttft_ms":1e400,"tpot_ms":50}', "{" + _BASE + ',"ttft_ms":null,"tpot_ms":50}', "{" + _BASE + "}",
    '{"origin":"aws:us-east-1","input_tokens":"500","max_output_tokens":30,"ttft_ms":1,"tpot_ms":50}',
    '{"origin":"aws:us-east-1","input_tokens":500.0,"max_output_tokens":30,"ttft_ms":1,"tpot_ms":50}',
    '{"origin":"aws:us-east-1","input_tokens":500.5,"max_output_tokens":30,"ttft_ms":1,"tpot_ms":50}',
    '{"origin":"aws:us-east-1","input_tokens":5e2,"max_output_tokens":30,"ttft_ms":1,"tpot_ms":50}',
    '{"origin":"aws:us-east-1","input_tokens":true,"max_output_tokens":30,"ttft_ms":1,"tpot_ms":50}',
    '{"origin":"aws:us-east-1","input_tokens":-1,"max_output_tokens":30,"ttft_ms":1,"tpot_ms":50}',
    '{"origin":"aws:us-east-1","input_tokens":99999999999999999999999,"max_output_tokens":30,"ttft_ms":1,"tpot_ms":50}',
    '{"origin":1,"input_tokens":500,"max_output_tokens":30,"ttft_ms":1,"tpot_ms":50}',
    '{"origin":"","input_tokens":500,"max_output_tokens":30,"ttft_ms":1,"tpot_ms":50}',
    '{"origin":"a\\u00e9\\ud83d\\ude00","input_tokens":500,"max_output_tokens":30,"ttft_ms":1,"tpot_ms":50}',
    '{"origin":"\\ud800","input_tokens":500,"max_output_tokens":30,"ttft_ms":1,"tpot_ms":50}',
    "{" + _BASE + ',"ttft_ms":1,"tpot_ms":50,"origin":"gcp:x"}', "{" + _BASE + ',"ttft_ms":1,"tpot_ms":50,"extra":1}',
    "{" + _BASE + ',"ttft_ms":1,"tpot_ms":50,"session_id":"s-1"}', "{" + _BASE + ',"ttft_ms":1,"tpot_ms":50,"session_id":"bad id"}',
    "{" + _BASE + ',"ttft_ms":1,"tpot_ms":50,"session_id":7}',
    "{" + _BASE + ',"ttft_ms":1,"tpot_ms":50,"constraints":{"deny":[{"pricing_modes":["spot"]}]}}',
    "{" + _BASE + ',"ttft_ms":1,"tpot_ms":50,"constraints":{"allow":[{"providers":"aws"}]}}',
    "{" + _BASE + ',"ttft_ms":1,"tpot_ms":50,"constraints":{"prefer":[{}]}}', "{" + _BASE + ',"ttft_ms":1,"tpot_ms":50,"constraints":[]}',
    "{" + _BASE + ',"ttft_ms":1,"tpot_ms":50,"constraints":null}', "[1]", "null", '"x"', "{", "", "{} x",
]


@pytest.mark.parametrize("raw", _BODIES)
def test_the_routes_json_validation_accepts_what_fastapis_body_parsing_accepts(raw: str) -> None:
    """``POST /v1/route`` validates its body in pydantic's JSON mode (``route_request``); FastAPI's
    body parameters (every other route, and the schema the OpenAPI document gives) parse with
    ``json.loads`` and validate in Python mode. The route must accept exactly those bodies and read
    them the same (else a body the documented schema rejects would get routed)."""

    def python_mode() -> RouteRequest | None:
        try:
            return RouteRequest.model_validate(json.loads(raw))
        except ValueError:  # JSONDecodeError, ValidationError
            return None

    def the_route() -> RouteRequest | None:
        try:
            return route_request(raw.encode(), "application/json")
        except RequestValidationError as e:
            assert all(err["loc"][0] == "body" for err in e.errors())  # rendered as body.<field>
            return None

    want, got = python_mode(), the_route()
    if want is None:
        assert got is None  # a JSON-only acceptance would route what the documented schema rejects
    else:
        assert got == want


def test_a_request_for_an_unknown_model_names_the_field_and_the_known_models(engine: RoutingEngine) -> None:
    with pytest.raises(RouteFailure) as e:
        _decide(engine, model="llama-2-7")
    assert e.value.status == 422 and e.value.error == "unknown_model"
    assert e.value.fields[0]["field"] == "body.model" and "llama-2-7b" in e.value.fields[0]["suggestions"]
    with pytest.raises(RouteFailure) as e:  # known, but no offering of this catalog can hold it: not a 429
        _decide(engine, model="llama-2-13b")
    assert e.value.status == 422 and e.value.error == "model_unavailable" and e.value.fields[0]["field"] == "body.model"


def test_a_rule_says_in_its_json_schema_what_its_validators_enforce() -> None:
    """A rule sets at least one field, each a non-empty list: the validators refuse ``{}`` and an
    explicit ``null``, and the JSON Schema (hence the OpenAPI document) says both."""
    import pydantic

    from xroute.schema.policy_ir import RULE_FIELDS

    schema = Rule.model_json_schema()
    assert schema["minProperties"] == 1 and set(schema["properties"]) == set(RULE_FIELDS)
    for name, prop in schema["properties"].items():
        assert prop["type"] == "array" and prop["minItems"] == 1 and "anyOf" not in prop, name
    for bad, where in (({}, "at least one"), ({"providers": None, "regions": ["x"]}, "providers")):
        with pytest.raises(pydantic.ValidationError, match=where):
            Rule.model_validate(bad)
    assert Rule.model_validate({"regions": ["us-east-1"]}).regions == ["us-east-1"]
