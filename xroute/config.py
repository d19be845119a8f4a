"""Configuration models (pydantic) and the YAML loader. One place for every config schema.

Unknown keys are errors (``extra="forbid"``) so a typo never silently falls back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xroute.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RewardConfig(Strict):
    """reward = -(cost_weight*cost_norm + latency_weight*latency_norm) - sla_penalty*violation."""

    cost_weight: float = Field(0.6, ge=0)
    latency_weight: float = Field(0.4, ge=0)
    sla_penalty: float = Field(2.0, ge=0, description="added cost of one SLA violation, in reward units")
    reference_usd_per_replica_hour: float = Field(
        1.0, gt=0, description="cost_norm = cost / cost of the request on a reference replica at this price")
    cost_norm_cap: float = Field(5.0, gt=0)
    latency_norm_cap: float = Field(3.0, gt=0)
    failure_latency_norm: float = Field(3.0, ge=0, description="latency_norm charged to a failed request")


class EnvConfig(Strict):
    """Settings of ``xroute/CloudRoute-v0``; see the env docstring for their meaning."""

    max_offerings: int = Field(128, ge=1, description="observation is padded to this many offerings")
    episode_requests: int | None = Field(
        1024, ge=1, description="requests per episode (a random window); None = the whole stream once")
    rate_scale: float = Field(1.0, gt=0, description="compress arrivals: 4 = four times the load")
    queue_timeout_s: float = Field(20.0, gt=0, description="a pool whose next free slot is further away is full")
    retry_overhead_ms: float = Field(1500.0, ge=0, description="detect + reconnect time after a preemption")
    feature_refresh_s: float = Field(30.0, gt=0, description="history features are recomputed at least this often")
    risk_lookback_h: float = Field(6.0, gt=0, description="window of the spot-preemption history features")
    serving_config: str = Field("serving.yaml", description="per-accelerator service model, under configs/")
    reward: RewardConfig = RewardConfig()


class EvaluateConfig(Strict):
    """Defaults of ``xroute evaluate`` (the baselines' knobs live here, not in code)."""

    static_location: str = Field("aws:us-east-1", description="location of the static baseline's offering")
    static_accelerator: str = Field("A10G", description="reference accelerator of the static baseline")
    seed: int = 0
    env: EnvConfig = EnvConfig(episode_requests=None)


M = TypeVar("M", bound=BaseModel)


def _format_validation(e: ValidationError, source: str) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f"{source}: field '{loc}': {msg}{more}"


def parse_config(model: type[M], data: dict[str, Any] | None, source: str = "config") -> M:
    """Validate ``data`` against ``model``; raise :class:`ConfigError` naming the field."""
    try:
        return model.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of keys to values")
    return data


def load_config(model: type[M], path: str | Path | None) -> M:
    if path is None:
        return parse_config(model, {}, model.__name__)
    return parse_config(model, read_yaml(path), str(path))


def config_path(name: str) -> Path:
    """A file under ``configs/`` (absolute paths are returned unchanged)."""
    p = Path(name)
    return p if p.is_absolute() or p.exists() else CONFIG_DIR / name


class AcceleratorSpeed(Strict):
    """Measured serving speed of one replica of the reference model on one accelerator."""

    prefill_tok_s: float = Field(gt=0)
    tpot_ms: float = Field(gt=0, description="ms per output token at concurrency 1")
    tpot_growth: float = Field(ge=0, description="tpot(k) = tpot_ms * (1 + tpot_growth*(k-1))")
    max_concurrency: int = Field(ge=1, description="request slots per replica")
    noise_sigma: float = Field(0.1, ge=0, description="lognormal sigma of run-to-run variation")
    sources: list[str] = Field(default_factory=list)
    derivation: str = ""


class ServingConfig(Strict):
    reference_model: str = ""
    reference_accelerator: str = "A10G"
    accelerators: dict[str, AcceleratorSpeed]
