"""Prefix affinity and sessions in the router: the shared index steers a conversation's next turn
to the pool that holds its prefix (a soft preference the constraints override), the client's
hashes are checked, feedback's ``cached_tokens`` corrects the pool's retention, the Redis index
gives the same answers as the in-process one, and two routers on one real Redis see each other's
affinity."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from envs.features import F
from router.decision.engine import RouteFailure, RoutingEngine
from router.service.ports import SharedState
from router.state.base import PrefixSend
from router.state.embedded import EmbeddedState
from router.state.redis import RedisState
from tests.servers import RedisServer, ServerThread
from tests.state_support import decide, prefix_feedback, reserve_recording
from tests.test_router_support import ROUTE, RouterSetup, make_setup
from xroute.schema.access import Principal
from xroute.schema.decision import RouteRequest, prefix_block_hashes

A = Principal("a", "tenant", "k1")
TOKENS = list(range(1000, 1000 + 3000))  # a 3,000-token prompt: 6 blocks of 512 (the last partial)


def test_the_client_helper_chains_block_hashes() -> None:
    h = prefix_block_hashes(TOKENS, 512)
    assert len(h) == 6 and len(set(h)) == 6 and all(-(2**63) <= x < 2**63 for x in h)
    longer = prefix_block_hashes([*TOKENS[:2560], 7, 8, 9], 512)  # the same five full blocks, then others
    assert longer[:5] == h[:5] and longer[5] != h[5]
    shifted = prefix_block_hashes([5, *TOKENS], 512)  # one token more in front: no block in common
    assert not set(shifted) & set(h)
    assert prefix_block_hashes(TOKENS, 512, salt=b"tenant-b")[0] != h[0]
    with pytest.raises(ValueError):
        prefix_block_hashes(TOKENS, 0)


# ------------------------------------------------------------------------------------ the engine
@pytest.fixture()
def engine(tmp_path: Path) -> RoutingEngine:
    return RoutingEngine(make_setup(tmp_path, replay_speed=1.0).settings)


def _req(**body: Any) -> RouteRequest:
    return RouteRequest.model_validate({**ROUTE, "input_tokens": 3000, **body})


def test_a_next_turn_goes_where_its_prefix_is_and_a_constraint_breaks_the_pin(engine: RoutingEngine) -> None:
    state = EmbeddedState()
    h = prefix_block_hashes(TOKENS, engine.block_tokens)
    wall = engine.source.start_wall
    first = json.loads(decide(engine, _req(prefix_hashes=h, session_id="s1"), A, "d_1", wall, state)[0])
    oid = first["offering"]["offering_id"]
    a = engine.offering_ids.index(oid)
    time.sleep(0.7)  # the blocks are expected computed after the first request's expected TTFT (~0.5 s)
    aff = state.core.lookup(np.array(h), "a:s1", 600.0)
    assert aff.runs == {engine.pool_keys[engine.env.default_model][a]: 6} and aff.session_pool is not None
    second = json.loads(decide(engine, _req(prefix_hashes=h, session_id="s1"), A, "d_2", wall + 0.7, state)[0])
    env = engine.env
    assert env.r_cached[a] == 3000.0 and env.r_sess_here[a] == 1.0  # the view: the whole prompt cached there
    rows = env.offering_features(np.arange(env.n))
    assert rows[a, F["exp_cached"]] == 1.0 and rows[a, F["session_here"]] == 1.0
    assert rows[:, F["exp_cached"]].sum() == 1.0  # nowhere else
    assert second["offering"]["offering_id"] == oid  # no prefill there: greedy's best
    # a request the tenant's constraints keep off that offering goes elsewhere, pin or not
    third = json.loads(decide(engine, _req(prefix_hashes=h, session_id="s1",
                                          constraints={"deny": [{"offering_ids": [oid]}]}), A, "d_3", wall + 0.8,
                                     state)[0])
    assert third["offering"]["offering_id"] != oid


def test_too_many_blocks_for_the_prompt_is_a_422_naming_the_field(engine: RoutingEngine) -> None:
    h = prefix_block_hashes(TOKENS, engine.block_tokens)
    with pytest.raises(RouteFailure) as e:
        decide(engine, _req(prefix_hashes=h, input_tokens=1024), A, "d_x", engine.source.start_wall, EmbeddedState())
    assert e.value.status == 422 and e.value.fields[0]["field"] == "body.prefix_hashes"
    assert "at most ceil(input_tokens / 512) = 2" in e.value.message


# ------------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RouterSetup]]:
    setup = make_setup(tmp_path_factory.mktemp("prefix-http"), replay_speed=1.0)
    from router.app.factory import create_app

    with ServerThread(create_app(setup.settings)) as url:
        yield url, setup


@pytest.mark.parametrize(("patch", "field"), [
    ({"prefix_hashes": ["abc"]}, "body.prefix_hashes[0]"),
    ({"prefix_hashes": [1, 2.5]}, "body.prefix_hashes[1]"),
    ({"prefix_hashes": [2**63]}, "body.prefix_hashes[0]"),
    ({"prefix_hashes": [-(2**63) - 1]}, "body.prefix_hashes[0]"),
    ({"prefix_hashes": []}, "body.prefix_hashes"),
    ({"prefix_hashes": "1 2 3"}, "body.prefix_hashes"),
    ({"prefix_hashes": {"0": 1}}, "body.prefix_hashes"),
    ({"prefix_hashes": [1, 2]}, "body.prefix_hashes"),  # 400 input tokens are one block of 512
    ({"session_id": ""}, "body.session_id"),
])
def test_a_malformed_prefix_field_is_a_422_naming_it(live: tuple[str, RouterSetup], patch: dict[str, Any],
                                                     field: str) -> None:
    url, setup = live
    r = httpx.post(f"{url}/v1/route", json={**ROUTE, **patch}, headers=setup.auth("a"), timeout=10)
    assert r.status_code == 422, r.text
    assert field in [f["field"] for f in r.json()["fields"]], r.json()


def test_feedback_cached_tokens_is_checked_stored_and_corrects_the_retention(live: tuple[str, RouterSetup]) -> None:
    url, setup = live
    h = prefix_block_hashes(TOKENS[:400], 512)
    d = httpx.post(f"{url}/v1/route", json={**ROUTE, "prefix_hashes": h}, headers=setup.auth("a"), timeout=10).json()
    for bad in (-1, 401, "x", 1.5):
        r = httpx.post(f"{url}/v1/feedback", json={"decision_id": d["decision_id"], "cached_tokens": bad},
                       headers=setup.auth("a"), timeout=10)
        assert r.status_code == 422 and r.json()["fields"][0]["field"] == "body.cached_tokens", (bad, r.text)
        assert r.json()["error"] == ("invalid_cached_tokens" if bad == 401 else "invalid_request")
    # the decision predicted nothing cached (the first of its prefix): the report is stored and counts nothing
    ok = httpx.post(f"{url}/v1/feedback", json={"decision_id": d["decision_id"], "cached_tokens": 0},
                    headers=setup.auth("a"), timeout=10)
    assert ok.status_code == 201, ok.text
    rec = httpx.get(f"{url}/v1/decisions/{d['decision_id']}", headers=setup.auth("a"), timeout=10).json()
    assert rec["feedback"][0]["cached_tokens"] == 0 and rec["request"]["prefix_hashes"] == h
    offerings = httpx.get(f"{url}/v1/offerings", headers=setup.auth("a"), timeout=10).json()
    assert offerings["prefix_block_tokens"] == 512


# ---------------------------------------------------------------------------- both backends alike
def _send(hashes: np.ndarray, pool: str, cap: int, predicted: float, session: str | None = None) -> PrefixSend:
    return PrefixSend(hashes, session, 600.0, {pool: (cap, predicted, 0.0)})


async def _drive(state: SharedState, rng: np.random.Generator) -> list[tuple[dict[str, int], str | None]]:
    """A random stream of conversations through ``state``: what each lookup answered."""
    prompts: list[list[int]] = []
    pools = [f"m|o{k}" for k in range(5)]
    caps = {p: int(c) for p, c in zip(pools, rng.integers(6, 40, 5))}
    out = []
    for i in range(150):
        if prompts and rng.random() < 0.6:
            base = prompts[int(rng.integers(len(prompts)))]
            prompt = base[: int(rng.integers(1, len(base) + 1))] + [int(x) for x in rng.integers(-2**62, 2**62, 3)]
        else:
            prompt = [int(x) for x in rng.integers(-2**62, 2**62, int(rng.integers(1, 9)))]
        prompts.append(prompt)
        h = np.array(prompt, dtype=np.int64)
        sess = f"a:s{int(rng.integers(5))}"
        aff = await state.lookup(h, sess, 600.0)
        out.append((aff.runs, aff.session_pool))
        pool = pools[int(rng.integers(len(pools)))]
        rid = f"d_{i}"
        got = await reserve_recording(state, [(pool, 1000)], rid, 60.0, _send(h, pool, caps[pool], 512.0, sess))
        assert got == pool
        if i % 7 == 0:
            assert await prefix_feedback(state, rid, 128.0, 0.5) == pool
    return out


def test_the_redis_index_answers_as_the_embedded_one(redis_server: RedisServer) -> None:
    """The same random stream of conversations through both backends: every lookup the same (runs,
    sessions), the same retention after feedback."""
    async def both() -> tuple[list[Any], list[Any], dict[str, float], dict[str, float]]:
        emb = EmbeddedState()
        red = RedisState(redis_server.url, prefix=f"pfx-equal-{time.time_ns()}")
        try:
            a = await _drive(emb, np.random.default_rng(3))
            b = await _drive(red, np.random.default_rng(3))
            probe = np.array([1], dtype=np.int64)
            # every pool's retention as each backend holds it (a lookup on a block every pool got)
            for st in (emb, red):
                for k in range(5):
                    await reserve_recording(st, [(f"m|o{k}", 1000)], f"probe{k}", 60.0,
                                               _send(probe, f"m|o{k}", 10, 0.0))
            ra = (await emb.lookup(probe, None, 600.0)).retention
            rb = (await red.lookup(probe, None, 600.0)).retention
            return a, b, ra, rb
        finally:
            await red.close()

    a, b, ra, rb = asyncio.run(both())
    assert a == b
    assert sum(bool(runs) for runs, _ in a) > 30 and sum(s is not None for _, s in a) > 30  # it did match
    assert ra.keys() == rb.keys() and all(ra[p] == pytest.approx(rb[p], rel=1e-12) for p in ra)
    assert min(ra.values()) < 1.0  # feedback (128 of 512 predicted) lowered some pool's retention


def test_two_routers_on_one_redis_share_the_affinity(tmp_path: Path, redis_server: RedisServer) -> None:
    """Router A places a conversation's first turn; router B, another process's view of the same
    Redis, sees that pool holding the prefix and the session there when the next turn comes to it,
    and a cached-token report sent to B lowers the pool's retention A then reads."""
    from router.app.factory import create_app

    prefix = f"pfx-two-{time.time_ns()}"
    setups = [make_setup(tmp_path / name, replay_speed=1.0, state_backend="redis", state_url=redis_server.url,
                         state_prefix=prefix) for name in ("a", "b")]
    h = prefix_block_hashes(TOKENS, 512)
    body = {**ROUTE, "input_tokens": 3000, "prefix_hashes": h, "session_id": "conv-1"}
    servers = [ServerThread(create_app(s.settings)) for s in setups]
    with servers[0] as url_a, servers[1] as url_b:
        first = httpx.post(f"{url_a}/v1/route", json=body, headers=setups[0].auth("a"), timeout=10).json()
        oid = first["offering"]["offering_id"]
        time.sleep(0.7)  # its blocks expected computed (its expected TTFT, ~0.5 s)
        second = httpx.post(f"{url_b}/v1/route", json=body, headers=setups[1].auth("a"), timeout=10)
        assert second.status_code == 200, second.text
        eng_b = _engine(servers[1])
        a = eng_b.offering_ids.index(oid)
        assert eng_b.env.r_cached[a] == 3000.0 and eng_b.env.r_sess_here[a] == 1.0
        assert second.json()["offering"]["offering_id"] == oid
        # the server had only half of it: B is told, and the pool's retention (shared) drops for A too
        fb = httpx.post(f"{url_b}/v1/feedback", json={"decision_id": second.json()["decision_id"],
                                                      "cached_tokens": 1500}, headers=setups[1].auth("a"), timeout=10)
        assert fb.status_code == 201, fb.text
        third = httpx.post(f"{url_a}/v1/route", json=body, headers=setups[0].auth("a"), timeout=10)
        assert third.status_code == 200, third.text
        eng_a = _engine(servers[0])
        assert eng_a.env.r_cached[a] == pytest.approx(3000.0 * (1 - 0.05 * 0.5))  # retention 1 -> 0.975
        # another tenant's session of the same name is another session
        other = httpx.post(f"{url_a}/v1/route", json={**body, "prefix_hashes": None}, headers=setups[0].auth("b"),
                           timeout=10)
        assert other.status_code == 200 and eng_a.env.r_sess_here.sum() == 0.0


def _engine(srv: ServerThread) -> RoutingEngine:
    app = srv.config.loaded_app
    while not hasattr(app, "services"):
        app = app.app
    return app.services.engine  # type: ignore[no-any-return]


def test_a_model_trained_on_the_layout_before_the_prefix_features_is_refused(tmp_path: Path) -> None:
    """The two features added at the end of the layout (``exp_cached``, ``session_here``) change the
    network's input width: a model exported before them is refused with a clear error, never read
    with its columns shifted."""
    import itertools
    import json as js

    from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES, OFFERING_FEATURES
    from models.policy import RouterWeights, read_router, save_router
    from xroute.errors import ConfigError

    assert OFFERING_FEATURES[-2:] == ("exp_cached", "session_here")
    rng = np.random.default_rng(0)
    old_nf = N_OFFERING_FEATURES - 2
    dims = [old_nf + N_REQUEST_FEATURES, 8, 1]
    layers = [(rng.normal(0, 0.1, (a, b)).astype(np.float32), np.zeros(b, np.float32)) for a, b in itertools.pairwise(dims)]
    d = save_router(RouterWeights(layers=layers), tmp_path / "old")
    meta = js.loads((d / "router.json").read_text())
    meta["offering_features"] = list(OFFERING_FEATURES[:-2])  # as exported before this layout
    (d / "router.json").write_text(js.dumps(meta))
    with pytest.raises(ConfigError, match=r"trained on another feature layout than envs\.features defines now; retrain"):
        read_router(d)
