"""xroute as a user installs it: the wheel, without extras, in a fresh virtual environment, used
from another directory. The core evaluates policies on the shipped bundle and serves a learned
router exported earlier -- without torch, stable-baselines3 or Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.servers import free_port

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _run(args: list[str], cwd: Path, timeout: int = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel, built from the checkout, and what the build printed."""
    root = tmp_path_factory.mktemp("wheel")
    r = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(root), str(REPO)], cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return next(root.glob("xroute-*.whl")), r.stdout + r.stderr


def test_the_wheel_ships_every_bundle_and_config_without_a_packaging_warning(built: tuple[Path, str]) -> None:
    """Each folder of data/bundles must be listed in pyproject's packages (else setuptools warns,
    and a future setuptools drops it): the wheel holds every file the checkout ships there."""
    import zipfile

    wheel, log = built
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [p for p in (REPO / "data" / "bundles").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    want = {f"xroute/resources/bundles/{p.relative_to(REPO / 'data' / 'bundles').as_posix()}" for p in shipped}
    cats = [p for p in (REPO / "data" / "catalogs").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    want |= {f"xroute/resources/catalogs/{p.relative_to(REPO / 'data' / 'catalogs').as_posix()}" for p in cats}
    want |= {f"xroute/resources/configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")}
    want |= {f"xroute/resources/configs/policies/{p.name}" for p in (REPO / "configs" / "policies").glob("*.yaml")}
    lua = [p for p in (REPO / "router" / "state" / "lua").rglob("*.lua")]  # the shared state's scripts
    want |= {p.relative_to(REPO).as_posix() for p in lua}
    assert len(lua) > 10 and len(want) > 15 and want <= names, sorted(want - names)
    assert "absent from the `packages` configuration" not in log, log[-3000:]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, built: tuple[Path, str]) -> Path:
    """A fresh venv with the built wheel and the core dependencies only (pinned by constraints.txt)."""
    root = tmp_path_factory.mktemp("install")
    wheel = built[0]
    v = root / "venv"
    r = _run([sys.executable, "-m", "venv", str(v)], cwd=root)
    assert r.returncode == 0, r.stderr
    r = _run([str(v / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"), str(wheel)],
             cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return v


def test_the_core_install_has_no_training_stack(venv: Path, tmp_path: Path) -> None:
    py = str(venv / "bin" / "python")
    for mod in ("torch", "stable_baselines3", "ray"):
        r = _run([py, "-c", f"import {mod}"], cwd=tmp_path)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, mod
    r = _run([py, "-c", "import xroute, envs, models.policy, router.app.factory; print(xroute.__file__)"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # the Redis state's Lua scripts, read from the installed package (each with its libraries)
    r = _run([py, "-c", "from router.state.redis import SCRIPTS, lua; print(sum(len(lua(n)) for n in SCRIPTS))"],
             cwd=tmp_path)
    assert r.returncode == 0 and int(r.stdout) > 10_000, r.stderr
    assert str(REPO) not in r.stdout  # the installed package, not the checkout


def test_evaluate_on_the_shipped_bundle_from_another_directory(venv: Path, tmp_path: Path) -> None:
    r = _run([str(venv / "bin" / "xroute"), "evaluate", "--policy", "greedy", "--policy", "cheapest", "--sample",
              "600", "--seeds", "2", "--output", "r.json", "--quiet"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "r.json").read_text())  # the path the user gave, in their directory
    assert rep["policies"]["greedy"]["requests"] == 600 and rep["bundle"].endswith("default")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    bad = _run([str(venv / "bin" / "xroute"), "evaluate", "--policy", "greedy", "--telemetry", "nowhere"], cwd=tmp_path)
    assert bad.returncode == 2 and "nowhere" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_a_router_exported_earlier(venv: Path, tmp_path: Path) -> None:
    """A learned router exported by training (here: random weights of the champion's shape, written
    by this checkout) serves one request from the core install."""
    import itertools

    from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES
    from models.policy import RewardPrior, RouterWeights, save_router
    from xroute.config import EnvConfig

    rng = np.random.default_rng(0)
    dims = [N_OFFERING_FEATURES + N_REQUEST_FEATURES, 16, 1]
    layers = [(rng.normal(0, 0.1, (a, b)).astype(np.float32), np.zeros(b, np.float32)) for a, b in itertools.pairwise(dims)]
    export = save_router(RouterWeights(layers=layers, prior=RewardPrior.from_env_config(EnvConfig())), tmp_path / "export")
    bin_ = venv / "bin"
    r = _run([str(bin_ / "python"), "-m", "router.control.keys", "add", "--tenant", "t", "--keys-file", "keys.json"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip().splitlines()[-1]
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    (tmp_path / "router.yaml").write_text("tenants: {t: {}}\n")  # the key's tenant, declared
    proc = subprocess.Popen([str(bin_ / "xroute"), "serve", "--host", "127.0.0.1", "--port", str(port), "--model",
                             str(export), "--keys-file", "keys.json", "--db", "d.db", "--config", "router.yaml"],
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        a = httpx.post(f"{url}/v1/route", headers={"Authorization": f"Bearer {key}"}, timeout=10,
                       json={"origin": "aws:us-east-2", "input_tokens": 500, "max_output_tokens": 100, "ttft_ms": 2000,
                             "tpot_ms": 100})
        assert a.status_code == 200, a.text
        body = a.json()
        assert body["policy"]["kind"] == "model" and body["score_kind"] == "q_value"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    assert (tmp_path / "d.db").exists()  # the decision log where the user said, in their directory
