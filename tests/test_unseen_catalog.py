"""Offerings a trained router never saw: the shipped unseen catalogs (``data/catalogs/unseen``),
``xroute.catalog_tools.swap_catalog`` and ``xroute evaluate --swap-offerings`` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from envs.cloud_route import CloudRouteEnv
from models.baselines import make_baseline
from xroute.bundle import load_bundle, shipped_bundles
from xroute.catalog_tools import swap_catalog, unseen_catalog_dir
from xroute.config import EvaluateConfig
from xroute.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "data"


@pytest.mark.parametrize("name", ["default", "feb2024", "mar2024", "mooncake", "asia"])
def test_every_shipped_bundle_has_an_unseen_catalog_disjoint_from_every_bundle(name: str):
    """Its regions are neither an offering region of any shipped bundle nor a client origin."""
    b = load_bundle(name)
    donor = load_bundle(unseen_catalog_dir(b), workload=b.workload.drop(columns=["prefix_hashes"], errors="ignore"))
    seen_locs: set[str] = set()
    for other in shipped_bundles():
        o = load_bundle(other)
        seen_locs |= set(o.offerings["provider"] + ":" + o.offerings["region"]) | set(o.workload["origin"])
    new_locs = set(donor.offerings["provider"] + ":" + donor.offerings["region"])
    assert new_locs and not new_locs & seen_locs
    assert set(donor.offerings["pricing_mode"]) == {"on_demand", "spot"}
    assert set(donor.offerings["accelerator"]) <= set(b.offerings["accelerator"])  # the serving model knows them


def test_swap_replaces_a_fifth_in_place_with_real_rows_of_the_catalog():
    b = load_bundle("default")
    donor_dir = unseen_catalog_dir(b)
    s = swap_catalog(b, donor_dir, 0.2, seed=3)
    donor = load_bundle(donor_dir, workload=b.workload)
    old, new = b.offering_ids, s.offering_ids
    changed = [i for i, (x, y) in enumerate(zip(old, new)) if x != y]
    assert len(new) == len(old) and len(changed) == round(0.2 * len(old))
    assert set(new[i] for i in changed) <= set(donor.offering_ids) - set(old)
    assert len(set(new)) == len(new)
    # each swapped-in offering takes the place of one of the same pricing mode (the catalog's mix stays)
    assert (s.offerings["pricing_mode"].to_numpy() == b.offerings["pricing_mode"].to_numpy()).all()
    # its rows are the catalog's, the dropped offerings' rows are gone, the kept ones' untouched
    for name in ("prices", "availability"):
        got, dn, bn = getattr(s, name), getattr(donor, name), getattr(b, name)
        assert set(got["offering_id"]) <= set(new)
        for oid in (new[changed[0]], old[0] if 0 not in changed else old[1]):
            src = dn if oid in set(dn["offering_id"]) else bn
            pd.testing.assert_frame_equal(got[got["offering_id"] == oid].reset_index(drop=True),
                                          src[src["offering_id"] == oid][list(got.columns)].reset_index(drop=True))
    assert not set(s.prices["offering_id"]) & {old[i] for i in changed}
    # RTT from every origin to every location of the new catalog (the env needs it)
    pairs = set(zip(s.rtt["src"], s.rtt["dst"]))
    for o in set(b.workload["origin"]):
        for loc in set(s.offerings["provider"] + ":" + s.offerings["region"]):
            assert (o, loc) in pairs or (loc, o) in pairs
    assert s.workload is b.workload and s.content_hash != b.content_hash
    assert swap_catalog(b, donor_dir, 0.2, seed=3).offering_ids == new  # seeded
    assert swap_catalog(b, donor_dir, 0.2, seed=4).offering_ids != new


def test_a_policy_places_work_on_the_swapped_in_offerings():
    """Not a no-op: greedy on the swapped catalog sends part of the traffic to offerings that were
    not in the bundle, and the episode runs to the end with them."""
    b = load_bundle("mar2024")
    s = swap_catalog(b, unseen_catalog_dir(b), 0.2, seed=0).select(np.arange(600))
    cfg = EvaluateConfig()
    env = CloudRouteEnv(s, cfg.env.model_copy(update={"episode_requests": None}))
    pol = make_baseline("greedy", cfg)
    obs, info = env.reset(seed=0)
    pol.reset(env, 0)
    new = set(s.offering_ids) - set(b.offering_ids)
    new_idx = {i for i, o in enumerate(s.offering_ids) if o in new}
    on_new, steps, trunc = 0, 0, False
    while not trunc:
        a = pol.act(obs, info)
        on_new += a in new_idx
        obs, _r, _t, trunc, info = env.step(a)
        steps += 1
    assert steps == 600 and on_new > 0


def test_swap_refuses_what_it_cannot_do(tmp_path: Path):
    b = load_bundle("default")
    with pytest.raises(ConfigError, match="--swap-offerings: must be in"):
        swap_catalog(b, unseen_catalog_dir(b), 0.0)
    with pytest.raises(ConfigError, match="has only"):  # more to swap than the catalog has
        swap_catalog(b, unseen_catalog_dir(b), 1.0)


def _xroute(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xroute_app", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def test_evaluate_swap_offerings_reports_what_went_to_them(tmp_path: Path):
    out = tmp_path / "r.json"
    p = _xroute("evaluate", "--telemetry", "feb2024", "--window", "test", "--swap-offerings", "0.2",
                "--sample", "400", "--seeds", "1", "-p", "greedy", "-p", "cheapest", "--quiet", "--no-plot",
                "--output", str(out), cwd=REPO)
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    b = load_bundle("feb2024")
    assert len(rep["swapped_in"]) == round(0.2 * len(b.offerings))
    assert not set(rep["swapped_in"]) & set(b.offering_ids)
    share = rep["placed_on_swapped_in"]
    assert set(share) == {"greedy", "cheapest"} and all(0.0 <= v <= 1.0 for v in share.values())
    assert share["greedy"] > 0.0
    assert "requests placed on the swapped-in offerings" in p.stdout


@pytest.mark.parametrize("args, message", [
    (["--swap-offerings", "1.5"], "--swap-offerings: must be in (0, 1]"),
    (["--swap-offerings", "0.2", "--unseen-catalog", "/nonexistent/catalog"], "--unseen-catalog: /nonexistent"),
    (["--unseen-catalog", "data/catalogs/unseen/default"], "--unseen-catalog: only with --swap-offerings"),
])
def test_evaluate_swap_errors_are_one_line(tmp_path: Path, args: list[str], message: str):
    p = _xroute("evaluate", "-p", "greedy", "--quiet", "--no-plot", "--output", str(tmp_path / "r.json"), *args,
                cwd=REPO)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in p.stderr


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs the shared real data (../shared/data)")
@pytest.mark.parametrize("variant", ["default", "mooncake"])
def test_the_shipped_unseen_catalogs_are_current(tmp_path: Path, variant: str):
    from tools.build_default_bundle import main

    shipped = REPO / "data" / "catalogs" / "unseen" / variant
    assert main(["--shared", str(SHARED), "--variant", variant, "--catalog", "unseen", "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in shipped.iterdir())
    assert names == sorted(p.name for p in tmp_path.iterdir())
    for n in names:
        assert (tmp_path / n).read_bytes() == (shipped / n).read_bytes(), f"{variant}/{n} is stale; rebuild it"
