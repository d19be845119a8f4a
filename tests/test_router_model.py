"""Model loading, hot swap and faults: the router keeps answering with the last good policy or the
fallback, and every response says which policy decided."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from router.app.factory import create_app
from tests.servers import ServerThread, free_port
from tests.test_router_support import ROUTE, make_setup, write_model

FAKE = "tests.test_router_support:fake_loader"


def _wait(pred: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


@pytest.mark.slow
def test_hot_swap_under_load_is_atomic_and_bad_versions_are_refused(tmp_path: Path) -> None:
    model = write_model(tmp_path / "model.json", prefer="on_demand")
    setup = make_setup(tmp_path, model_uri=str(model), model_loader=FAKE, model_poll_s=0.2)
    with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=10) as c:
        first = c.post("/v1/route", json=ROUTE, headers=setup.auth("a")).json()
        assert first["policy"]["kind"] == "model" and first["policy"]["name"] == "fake-on_demand"
        assert first["score_kind"] == "q_value" and first["offering"]["pricing_mode"] == "on_demand"
        v1 = first["policy"]["version"]

        answers: list[tuple[int, dict[str, Any]]] = []
        stop = threading.Event()

        def fire() -> None:
            with httpx.Client(base_url=url, timeout=10) as cc:
                while not stop.is_set():
                    r = cc.post("/v1/route", json={**ROUTE, "max_output_tokens": 5}, headers=setup.auth("a"))
                    answers.append((r.status_code, r.json()))

        threads = [threading.Thread(target=fire) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        write_model(model, prefer="spot", note="v2")
        _wait(lambda: any(a[1].get("policy", {}).get("version") not in (None, v1) for a in answers))
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join()
        assert answers and {s for s, _ in answers} == {200}  # nothing dropped or failed during the swap
        for _, a in answers:  # each request wholly decided by one version
            assert a["offering"]["pricing_mode"] == ("on_demand" if a["policy"]["version"] == v1 else "spot")
        v2 = answers[-1][1]["policy"]["version"]
        assert v2 != v1 and answers[-1][1]["policy"]["name"] == "fake-spot"

        for bad in ("{not json", '{"nan": true, "prefer": "on_demand"}', '{"load_error": true}'):
            good = c.post("/v1/route", json=ROUTE, headers=setup.auth("a")).json()["policy"]["version"]
            model.write_text(bad)
            _wait(lambda: c.get("/readyz").json()["model_error"] is not None)
            d = c.post("/v1/route", json=ROUTE, headers=setup.auth("a"))
            assert d.status_code == 200 and d.json()["policy"]["version"] == good  # last good model keeps serving
            write_model(model, prefer="spot", note="v2")  # same content, new mtime: a new version again
            _wait(lambda: c.get("/readyz").json()["model_error"] is None)
        metrics = c.get("/metrics", headers=setup.auth("admin")).text
        assert 'xroute_router_model_errors_total{stage="load"} 2.0' in metrics
        assert 'xroute_router_model_errors_total{stage="validate"} 1.0' in metrics
        assert 'xroute_router_model_info{kind="model",name="fake-spot"' in metrics


def test_corrupt_or_missing_model_at_start_serves_the_fallback(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_bytes(b"\x00\xffgarbage")
    for uri, stage in ((str(corrupt), "load"), (str(tmp_path / "absent"), "resolve")):
        setup = make_setup(tmp_path / stage, model_uri=uri, model_loader=FAKE)
        with ServerThread(create_app(setup.settings)) as url:
            r = httpx.post(f"{url}/v1/route", json=ROUTE, headers=setup.auth("a"))
            assert r.status_code == 200
            p = r.json()["policy"]
            assert p["kind"] == "fallback" and p["name"] == "greedy" and f"({stage}:" in p["reason"]


def test_missing_model_module_serves_the_fallback(tmp_path: Path) -> None:
    write_model(tmp_path / "m.json", prefer="spot")
    setup = make_setup(tmp_path, model_uri=str(tmp_path / "m.json"), model_loader="models.not_written_yet:load_policy")
    with ServerThread(create_app(setup.settings)) as url:
        p = httpx.post(f"{url}/v1/route", json=ROUTE, headers=setup.auth("a")).json()["policy"]
        assert p["kind"] == "fallback" and "ModuleNotFoundError" in p["reason"]


@pytest.mark.slow
def test_unreachable_registry_at_start_serves_the_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    setup = make_setup(tmp_path, model_uri="models:/xroute-router@champion", model_load_timeout_s=20)
    with ServerThread(create_app(setup.settings)) as url:
        r = httpx.post(f"{url}/v1/route", json=ROUTE, headers=setup.auth("a"))
        assert r.status_code == 200 and r.json()["policy"]["kind"] == "fallback"
        assert "resolve" in r.json()["policy"]["reason"]
        status = httpx.get(f"{url}/v1/admin/status", headers=setup.auth("admin")).json()
        assert status["model_version"] is None and "resolve" in status["model_error"]


def test_exported_learned_policy_is_served_with_its_scores(tmp_path: Path) -> None:
    policy = pytest.importorskip("models.policy")
    from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES

    rng = np.random.default_rng(0)
    d_in, ctx = N_OFFERING_FEATURES + N_REQUEST_FEATURES, 4
    w = policy.RouterWeights(
        layers=[(rng.normal(size=(d_in + ctx, 8)).astype(np.float32), np.zeros(8, np.float32)),
                (rng.normal(size=(8, 1)).astype(np.float32), np.zeros(1, np.float32))],
        ctx=(rng.normal(size=(d_in, ctx)).astype(np.float32), np.zeros(ctx, np.float32)))
    export = policy.save_router(w, tmp_path / "export")
    setup = make_setup(tmp_path, model_uri=str(export))
    with ServerThread(create_app(setup.settings)) as url:
        d = httpx.post(f"{url}/v1/route", json=ROUTE, headers=setup.auth("a")).json()
    assert d["policy"]["kind"] == "model" and d["policy"]["version"].startswith("local-")
    assert d["score_kind"] == "q_value" and all(a["score"] <= d["score"] for a in d["alternatives"])
