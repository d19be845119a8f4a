"""The router on live telemetry: a directory ``xroute telemetry collect`` keeps current, served on the
wall clock and reloaded when it changes — unit level, through the real HTTP server, and end to end
from the collector over local cloud stand-ins."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest

from router.app.factory import create_app
from router.decision.engine import RoutingEngine
from router.decision.telemetry import LiveSource
from tests.servers import ServerThread
from tests.state_support import decide
from tests.test_router_support import ROUTE, make_setup
from xroute.errors import ConfigError
from xroute.schema.access import Principal
from xroute.schema.decision import RouteRequest

A = Principal("a", "tenant", "k1")


def live_dir(tmp: Path) -> Path:
    """The tiny bundle as a collector leaves it: no workload table, a manifest with its commit time."""
    setup = make_setup(tmp / "setup")
    d = tmp / "live"
    shutil.copytree(setup.settings.telemetry, d)  # type: ignore[arg-type]
    (d / "workload.csv").unlink()
    manifest(d, time.time() - 5.0)
    return d


def manifest(d: Path, t: float) -> None:
    (d / "collect_log.json").write_text(json.dumps({"format": 1, "updated": pd.Timestamp(t, unit="s", tz="UTC").isoformat()}))


def reprice(d: Path, offering_id: str, usd_per_hour: float) -> None:
    """What a collector commit does: append a price step, rewrite the manifest."""
    p = pd.read_csv(d / "prices.csv")
    now = pd.Timestamp.now(tz="UTC")
    p = pd.concat([p, pd.DataFrame([{"ts": (now - pd.Timedelta(seconds=1)).isoformat(), "offering_id": offering_id,
                                     "usd_per_hour": usd_per_hour}])])
    p.to_csv(d / "prices.csv", index=False)
    manifest(d, now.timestamp())


def test_live_source_clock_reload_and_catalog_change(tmp_path: Path) -> None:
    d = live_dir(tmp_path)
    setup = make_setup(tmp_path / "s2", telemetry=d, telemetry_live=True, max_telemetry_age_s=600.0)
    engine = RoutingEngine(setup.settings)
    src = engine.source
    assert isinstance(src, LiveSource) and src.name == "live:live"
    assert sorted(engine.origins) == ["aws:us-east-1", "azure:japaneast", "gcp:europe-west4"]  # from the RTT table
    assert abs(src.as_of() - (time.time() - 5.0)) < 2.0

    wall = time.time()
    text, _, chosen, _ = decide(engine, RouteRequest.model_validate(ROUTE), A, "d_1", wall)
    ans = json.loads(text)
    assert ans["telemetry"]["source"] == "live:live"
    assert abs(pd.Timestamp(ans["telemetry"]["telemetry_time"]).timestamp() - wall) < 0.002  # the wall clock
    assert src.poll() is None  # nothing changed

    # the chosen offering gets 50x dearer: after the reload the router sees the new price
    before = {r["offering"]["offering_id"]: r["usd_per_hour"] for r in engine.offerings_state(time.time())["offerings"]}
    reprice(d, chosen, before[chosen] * 50)
    new = src.poll()
    assert new is not None
    engine.apply_telemetry(engine.prepare_telemetry(new))
    src.accept()
    after = {r["offering"]["offering_id"]: r["usd_per_hour"] for r in engine.offerings_state(time.time())["offerings"]}
    assert after[chosen] == pytest.approx(before[chosen] * 50)
    assert engine.bundle_hash == new.content_hash
    _, _, chosen2, _ = decide(engine, RouteRequest.model_validate(ROUTE), A, "d_2", time.time())
    assert chosen2 != chosen

    # a commit that changes the catalog is refused (needs a restart); polls keep offering it, the data ages
    as_of = src.as_of()
    off = pd.read_csv(d / "offerings.csv")
    extra = off.iloc[[0]].assign(offering_id=off["offering_id"].iloc[0] + "-b", instance_type="g5.2xlarge")
    pd.concat([off, extra]).to_csv(d / "offerings.csv", index=False)
    p = pd.read_csv(d / "prices.csv")
    pd.concat([p, p.iloc[[0]].assign(offering_id=extra["offering_id"].iloc[0])]).to_csv(d / "prices.csv", index=False)
    manifest(d, time.time())
    bad = src.poll()
    assert bad is not None
    with pytest.raises(ConfigError, match="catalog changed"):
        engine.prepare_telemetry(bad)
    assert src.as_of() == as_of and src.poll() is not None


def test_live_source_names_what_is_missing(tmp_path: Path) -> None:
    d = live_dir(tmp_path)
    rtt = pd.read_csv(d / "rtt.csv")
    rtt[rtt["src"] == rtt["dst"]].to_csv(d / "rtt.csv", index=False)  # nobody reaches every location
    with pytest.raises(ConfigError, match="no RTT source reaches every offering"):
        LiveSource(d)
    with pytest.raises(ConfigError, match=r"field 'telemetry_live': .*needs 'telemetry'"):
        make_setup(tmp_path / "s3", telemetry=None, telemetry_live=True)
    with pytest.raises(ConfigError, match="is not a directory"):
        LiveSource(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no 'offerings' and 'rtt' tables"):
        LiveSource(tmp_path / "empty")


def test_live_router_over_http_picks_up_a_collector_commit(tmp_path: Path) -> None:
    """The app's refresh loop polls the directory; a new commit changes what /v1/offerings reports and
    the data age /readyz reports, without a restart."""
    d = live_dir(tmp_path)
    setup = make_setup(tmp_path / "s4", telemetry=d, telemetry_live=True, telemetry_refresh_s=0.2,
                       max_telemetry_age_s=600.0)
    key = {"Authorization": f"Bearer {setup.keys['a']}"}
    with ServerThread(create_app(setup.settings)) as url:
        r = httpx.post(f"{url}/v1/route", json=ROUTE, headers=key)
        assert r.status_code == 200, r.text
        chosen = r.json()["offering"]["offering_id"]
        age0 = httpx.get(f"{url}/readyz").json()["telemetry_age_s"]
        assert 4.0 < age0 < 30.0  # the manifest says 5 s ago
        price0 = {o["offering"]["offering_id"]: o["usd_per_hour"]
                  for o in httpx.get(f"{url}/v1/offerings", headers=key).json()["offerings"]}[chosen]
        reprice(d, chosen, price0 * 50)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            now = {o["offering"]["offering_id"]: o["usd_per_hour"]
                   for o in httpx.get(f"{url}/v1/offerings", headers=key).json()["offerings"]}[chosen]
            if now != price0:
                break
            time.sleep(0.1)
        assert now == pytest.approx(price0 * 50)
        assert httpx.get(f"{url}/readyz").json()["telemetry_age_s"] < age0
        r2 = httpx.post(f"{url}/v1/route", json=ROUTE, headers=key)
        assert r2.status_code == 200 and r2.json()["offering"]["offering_id"] != chosen


@pytest.mark.slow
def test_collector_output_served_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: ``collect_once`` against the local AWS/Azure/GCP stand-ins writes a directory; the
    router serves it live (no workload table) and places a request from the collector's origin."""
    from cloud_adapters.collect.run import collect_once
    from tests.clouds import local_clouds
    from tests.test_cloud_collector import ORIGIN, config

    out = tmp_path / "collected"
    with local_clouds() as clouds:
        for k, v in clouds.env.items():
            monkeypatch.setenv(k, v)
        report = collect_once(config(out))
    assert report.any_ok and not (out / "workload.csv").exists()
    setup = make_setup(tmp_path / "s5", telemetry=out, telemetry_live=True, env={}, max_telemetry_age_s=600.0)
    engine = RoutingEngine(setup.settings)
    assert ORIGIN in engine.origins
    text, _, chosen, _ = decide(engine, RouteRequest(origin=ORIGIN, input_tokens=300, max_output_tokens=60,
                                                    ttft_ms=2500, tpot_ms=100), A, "d_e2e", time.time())
    assert chosen in engine.offering_ids and json.loads(text)["telemetry"]["stale"] is False
