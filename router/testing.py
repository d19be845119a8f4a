"""Helpers to run the real router in tests and benchmarks: uvicorn on a free loopback port, in a
thread of this process (:class:`ServerThread`) or as a subprocess (:func:`start_subprocess`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent

#: a serving model with the accelerators of ``tests/tinybundle.py`` (numbers shaped like configs/serving.yaml)
SERVING_YAML = """\
reference_accelerator: A10G
accelerators:
  A10G: {memory_gb: 24, prefill_tok_s: 6170, tpot_ms: 31.0, tpot_growth: 0.051, max_concurrency: 7, noise_sigma: 0.07}
  L4: {memory_gb: 24, prefill_tok_s: 5970, tpot_ms: 62.0, tpot_growth: 0.051, max_concurrency: 7, noise_sigma: 0.07}
  T4: {memory_gb: 16, prefill_tok_s: 3210, tpot_ms: 58.1, tpot_growth: 0.051, max_concurrency: 1, noise_sigma: 0.07}
  A100: {memory_gb: 40, prefill_tok_s: 15400, tpot_ms: 12.0, tpot_growth: 0.034, max_concurrency: 20, noise_sigma: 0.07}
  H100: {memory_gb: 80, prefill_tok_s: 28400, tpot_ms: 5.6, tpot_growth: 0.045, max_concurrency: 54, noise_sigma: 0.07}
"""


def write_serving_yaml(path: Path) -> Path:
    path.write_text(SERVING_YAML)
    return path.resolve()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerThread:
    """``with ServerThread(app) as url:`` — uvicorn serving ``app`` on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: Any, port: int | None = None, startup_timeout: float = 60.0):
        import uvicorn

        self.port = port or free_port()
        self.config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None, access_log=False,
                                     lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.startup_timeout = startup_timeout
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the router failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError("the router did not start in time")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_subprocess(args: list[str], env: dict[str, str], port: int, log: Path,
                     timeout: float = 90.0) -> subprocess.Popen[bytes]:
    """``python -m xroute_app serve --port PORT ARGS`` with ``env`` added; returns once /readyz answers."""
    full_env = {**os.environ, **env}
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "xroute_app", "serve", "--port", str(port), *args],
                                cwd=REPO_ROOT, env=full_env, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}; log: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"router did not become ready; log: {log.read_text()[-2000:]}")
