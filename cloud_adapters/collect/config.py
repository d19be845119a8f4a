"""What one collection run asks for (:class:`CollectConfig`), and the command line's words for it:
``--regions`` mapped to providers, durations (``--every``, ``--deadline``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cloud_adapters import registry
from cloud_adapters.base import PoolSelector
from xroute.errors import ConfigError


class CollectConfig(BaseModel):
    """What one collection run asks for, and its limits."""

    model_config = ConfigDict(extra="forbid")

    providers: list[str]
    #: provider -> its regions
    regions: dict[str, list[str]]
    out: Path
    #: location id of this collector: the ``src`` of the RTT rows (a workload's origin)
    origin: str = "local"
    #: the whole run must end within this many seconds (stale sources otherwise)
    deadline_s: float = 300.0
    concurrency: int = 8
    #: how far back the first collection reads spot price history
    spot_history_hours: float = 24.0
    rtt_probes: int = 5
    rtt_timeout_s: float = 2.0
    #: location id -> ``host[:port]`` to probe instead of the provider's API endpoint
    rtt_targets: dict[str, str] = Field(default_factory=dict)
    pools: list[PoolSelector] = Field(default_factory=list)
    utilization_window_s: float = 600.0
    #: per-adapter settings (``aws: {spot_placement_scores: true}``, ``azure: {subscription_id: ...}``)
    provider_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: file format of tables the directory does not have yet
    table_format: Literal[".csv", ".csv.gz", ".parquet"] = ".csv"


def assign_regions(providers: list[str], regions: list[str]) -> dict[str, list[str]]:
    """Map ``--regions`` to providers: ``provider:region`` goes to that provider; a plain name to
    the one provider whose region names look like it (AWS ``us-east-1``, Azure ``eastus``, GCP
    ``us-central1``). Every provider must end up with at least one region."""
    out: dict[str, list[str]] = {p: [] for p in providers}
    classes = {p: registry.adapter_class(p) for p in providers}
    for r in (x.strip() for x in regions):
        if not r:
            continue
        if ":" in r:
            p, _, name = r.partition(":")
            if p not in out:
                raise ConfigError(f"--regions: '{r}' names provider '{p}', which is not in --providers ({', '.join(providers)})")
            out[p].append(name)
            continue
        fits = [p for p, c in classes.items() if c.REGION_PATTERN.match(r)]
        if len(fits) != 1:
            why = "matches no provider's region names" if not fits else f"could belong to {', '.join(fits)}"
            raise ConfigError(f"--regions: '{r}' {why}; write it as provider:region (e.g. aws:{r})")
        out[fits[0]].append(r)
    empty = [p for p, rs in out.items() if not rs]
    if empty:
        raise ConfigError(f"--regions: no region for {', '.join(empty)}")
    return {p: sorted(set(rs), key=rs.index) for p, rs in out.items()}


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``10m``, ``2h``, ``1d``."""
    t = text.strip().lower()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if t and t[-1] in units:
            value = float(t[:-1]) * units[t[-1]]
        else:
            value = float(t)
    except ValueError:
        raise ConfigError(f"'{text}' is not a duration (e.g. 30s, 10m, 1h)") from None
    if value <= 0:
        raise ConfigError(f"'{text}': a duration must be positive")
    return value
