"""Shared helpers for the router tests (no tests here): a tiny-bundle router setup with three keys,
and a fake model loader whose behaviour is read from a small JSON file."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from envs.features import F
from router.control.keys import add_key
from router.core.logs import JsonFormatter
from router.core.settings import RouterSettings, load_settings
from tests.tinybundle import write_serving_yaml, write_tiny_bundle


@dataclass
class RouterSetup:
    settings: RouterSettings
    keys: dict[str, str]
    root: Path

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}


def make_setup(tmp: Path, **overrides: Any) -> RouterSetup:
    """Tiny bundle, own serving yaml, keys for tenants ``a`` and ``b`` (declared, with
    ``overrides["tenants"]`` merged in) and an admin; no model."""
    tmp.mkdir(parents=True, exist_ok=True)
    bundle = tmp / "bundle"
    if not bundle.exists():
        write_tiny_bundle(bundle)
    serving = write_serving_yaml(tmp / "serving.yaml")
    keys_file = tmp / "keys.json"
    if keys_file.exists():
        keys_file.unlink()
    keys = {"a": add_key(keys_file, "a"), "b": add_key(keys_file, "b"), "admin": add_key(keys_file, "ops", "admin")}
    base: dict[str, Any] = {"telemetry": bundle, "env": {"serving_config": str(serving)}, "db_path": tmp / "decisions.db",
                            "keys_file": keys_file, "model_uri": "", "model_poll_s": 0, "log_level": "WARNING"}
    base.update(overrides)
    # the tenants the keys name are declared (an undeclared tenant's key is refused: 403 unknown_tenant)
    base["tenants"] = {"a": {}, "b": {}, **(overrides.get("tenants") or {})}
    cfg = tmp / "router.yaml"  # (what subprocess routers read: the declared tenants)
    cfg.write_text(json.dumps({"tenants": base["tenants"]}) + "\n")
    return RouterSetup(load_settings(cfg, **base), keys, tmp)


ROUTE = {"origin": "aws:us-east-1", "input_tokens": 400, "max_output_tokens": 80, "ttft_ms": 2500, "tpot_ms": 100}


def retry_restoring(send: Callable[[], Any], within_s: float = 15.0) -> Any:
    """``send()`` (an HTTP request), again as its 503 ``state_restoring`` asks (``Retry-After``): a
    keyed request on the Redis state in the first ``state_restore_window_s`` of an epoch -- a Redis
    new to the routers looks exactly like one that lost its data (``docs/router.md``)."""
    deadline = time.monotonic() + within_s
    while True:
        r = send()
        if r.status_code != 503 or r.json().get("error") != "state_restoring" or time.monotonic() > deadline:
            return r
        time.sleep(float(r.headers.get("retry-after", "1")) / 4)


# ---------------------------------------------------------------------------------------- fake model
class FakeWeights:
    """Scores = +10 on spot (or on-demand) rows, minus expected latency; ``nan`` poisons them."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec

    def scores(self, rows: np.ndarray, request: np.ndarray, mask: np.ndarray) -> np.ndarray:
        if self.spec.get("delay_s"):
            time.sleep(float(self.spec["delay_s"]))
        spot = rows[..., F["is_spot"]]
        pref = spot if self.spec.get("prefer") == "spot" else 1.0 - spot
        s = 10.0 * pref - rows[..., F["exp_latency"]]
        if self.spec.get("nan"):
            s = s * np.nan
        return np.asarray(s, dtype=np.float32)


class FakePolicy:
    def __init__(self, spec: dict[str, Any]):
        self.name = f"fake-{spec.get('prefer', 'on_demand')}"
        self.weights = FakeWeights(spec)

    def reset(self, env: Any, seed: int) -> None:
        self.n = env.n

    def act(self, obs: dict[str, np.ndarray], info: dict[str, Any]) -> int:
        raise AssertionError("the router scores FakePolicy through its weights")


def fake_loader(uri: str) -> FakePolicy:
    """The model loader the tests configure: ``uri`` is a JSON file (corrupt JSON raises)."""
    spec = json.loads(Path(uri).read_text())
    if spec.get("load_error"):
        raise RuntimeError("simulated load failure")
    return FakePolicy(spec)


def write_model(path: Path, **spec: Any) -> Path:
    path.write_text(json.dumps(spec))
    return path


# ---------------------------------------------------------------------------------------- logs
class LogCapture(logging.Handler):
    """Collects the router's formatted JSON log lines (they do not propagate to the root logger)."""

    NAMES = ("xroute", "uvicorn", "uvicorn.error")

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def attach(self) -> LogCapture:
        for n in self.NAMES:
            logging.getLogger(n).addHandler(self)
            if logging.getLogger(n).level > logging.INFO or logging.getLogger(n).level == 0:
                logging.getLogger(n).setLevel(logging.INFO)
        return self

    def detach(self) -> None:
        for n in self.NAMES:
            logging.getLogger(n).removeHandler(self)

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.lines]
