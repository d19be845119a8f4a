"""Plain ``xroute train`` (no ``--ray-address``) starts a Ray of its own, whatever the machine holds:
a live head someone else started with ``ray start --head``, and the stale
``ray_current_cluster`` file that head leaves behind once it stopped. Before, ``ray.init(num_cpus=...)``
followed that file and failed ("When connecting to an existing cluster, num_cpus and num_gpus must
not be provided").

Real Ray, real ``ray start``, real ``xroute train`` subprocesses. Everything Ray writes goes under a
temp dir of this test (``RAY_TMPDIR``: the root where Ray keeps ``ray_current_cluster`` and its
sessions), the head listens on a port of its own (``--port=0``), so Ray runs of other processes on
the machine neither see it nor are seen; the head is stopped (and anything left of it under that
temp dir killed, by process id) when the test ends.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_agent import write_agent_setup

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _pids_under(root: Path) -> list[int]:
    """Ids of the processes whose command line names ``root`` (the head's, and its children's:
    they all get their session directory under it)."""
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if str(root).encode() in cmd:
            out.append(int(d.name))
    return out


def _kill_all_under(root: Path) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_under(root)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while pids and time.monotonic() < deadline and _pids_under(root):
            time.sleep(0.3)


class Head:
    """``ray start --head --block`` of 'someone else' (its own auth token, one CPU), in ``root``."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root = root
        self.address_file = root / "ray" / "ray_current_cluster"
        self.log = open(root / "head.log", "w")  # (closed in stop)
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--port=0", "--num-cpus=1",
             "--include-dashboard=false", "--disable-usage-stats"],
            env={**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not (self.address_file.exists() and self.address_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"ray start --head did not come up: {(root / 'head.log').read_text()[-2000:]}")
            time.sleep(0.5)
        self.address = self.address_file.read_text().strip()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # --block: the head's reaper takes its processes down with it
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def ray_root() -> Iterator[Path]:
    # short: Ray's unix sockets live under it (and a socket path has at most 107 bytes)
    root = Path(tempfile.mkdtemp(prefix="xr-ray-", dir="/tmp"))
    try:
        yield root
    finally:
        _kill_all_under(root)
        shutil.rmtree(root, ignore_errors=True)


def _train(setup: dict[str, Any], env: dict[str, str], run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xroute_app", "train", "--config", str(setup["train_yaml"]),
                           "--run-dir", str(run_dir)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=900)


def _sessions(root: Path) -> set[str]:
    return {p.name for p in (root / "ray").glob("session_2*")}


def test_plain_train_starts_its_own_ray_beside_a_live_head_and_after_it_stopped(tmp_path: Path,
                                                                                 ray_root: Path) -> None:
    setup = write_agent_setup(tmp_path, total_timesteps=0, search={"seeds": [0], "gamma": [0.5]},
                              mlflow={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(RAY_TMPDIR=str(ray_root), RAY_USAGE_STATS_ENABLED="0", MLFLOW_DISABLE_TELEMETRY="true")

    # 1. someone else's live cluster: ray_current_cluster names it, and plain ray.init() would join it
    head = Head(ray_root, env)
    try:
        head_session = _sessions(ray_root)
        assert len(head_session) == 1
        r = _train(setup, env, tmp_path / "run-live")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "cannot start" not in r.stderr and "Traceback" not in r.stderr
        assert "train wall time" in r.stdout and "gate" in r.stdout
        # it ran a Ray of its own (a session of its own beside the head's), left the head running
        # and the machine's pointer to the head as it was
        assert len(_sessions(ray_root) - head_session) == 1
        assert head.alive()
        assert head.address_file.read_text().strip() == head.address
    finally:
        head.stop()

    # 2. the head stopped: its processes are gone, the file still names it (ray stop would remove it; a
    # crash or a kill does not) -- the case a new user hit
    assert not head.alive()
    deadline = time.monotonic() + 30
    while _pids_under(ray_root) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _pids_under(ray_root), "the stopped head left processes behind"
    assert head.address_file.read_text().strip() == head.address
    before = _sessions(ray_root)
    r = _train(setup, env, tmp_path / "run-stale")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cannot start" not in r.stderr and "Traceback" not in r.stderr
    assert "train wall time" in r.stdout
    assert len(_sessions(ray_root) - before) == 1
    # and it shut its own Ray down: nothing of it is left running
    assert not _pids_under(ray_root)
