"""The ``replay`` adapter: the adapter interface over a recorded bundle (no network).

By default it serves the shipped bundle (``xroute.bundle.load_bundle()`` with no path); ``path``
names another. Records keep the bundle's own provider names and offering ids, so what the replay
adapter returns is what the live adapters would have returned at the recorded time. ``at`` fixes
"now" (default: the last timestamp in the bundle): current prices and availability are the rows in
force at ``at``; spot price history is every row up to ``at``.

Regions may be given as location ids (``aws:us-east-1``) or plain region names.
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any, ClassVar

import pandas as pd

from cloud_adapters.base import (
    AdapterConfig,
    AvailabilitySignal,
    CloudAdapter,
    Feature,
    InstanceOffer,
    PoolSelector,
    PricePoint,
    QuotaRecord,
    UtilizationSample,
)
from cloud_adapters.errors import CloudError, CloudNotSupportedError

NAME = "replay"


class ReplayConfig(AdapterConfig):
    """``path``: bundle directory (default: the shipped bundle); ``at``: ISO-8601 "now"."""

    path: str | None = None
    at: str | None = None
    gpu_only: bool = False


class ReplayAdapter(CloudAdapter):
    """Serves a recorded bundle through the adapter interface."""

    name = NAME
    config_class = ReplayConfig
    config: ReplayConfig
    UNSUPPORTED: ClassVar[dict[Feature, str]] = {}
    CACHE_TTL_S: ClassVar[dict[Feature, float]] = {}

    def __init__(self, config: ReplayConfig | dict[str, Any] | None = None, **kw: Any):
        super().__init__(config, **kw)
        self._bundle: Any = None
        self._lock = threading.Lock()

    @property
    def bundle(self) -> Any:
        with self._lock:
            if self._bundle is None:
                from xroute.bundle import load_bundle

                self._bundle = load_bundle(self.config.path)
            return self._bundle

    @property
    def now(self) -> pd.Timestamp:
        if self.config.at:
            t = pd.Timestamp(self.config.at)
            return t.tz_localize("UTC") if t.tzinfo is None else t.tz_convert("UTC")
        b = self.bundle
        times = [b.prices["ts"].max()]
        for df in (b.availability, b.utilization, b.quotas):
            if df is not None and len(df):
                times.append(df["ts"].max())
        return max(times)

    def capabilities(self) -> dict[Feature, str | None]:
        caps = super().capabilities()
        b = self.bundle
        for feature, table in ((Feature.SPOT_AVAILABILITY, "availability"), (Feature.QUOTAS, "quotas"),
                               (Feature.UTILIZATION, "utilization")):
            if getattr(b, table) is None:
                caps[feature] = f"the bundle at {b.path} has no {table} table"
        caps[Feature.QUOTA_USAGE] = caps[Feature.QUOTAS]
        return caps

    def regions(self) -> list[str]:
        """The bundle's location ids."""
        return self.bundle.locations()  # type: ignore[no-any-return]

    def knows_region(self, region: str) -> bool:
        return any(region in (loc, loc.split(":", 1)[1]) for loc in self.regions())

    def _rows(self, region: str) -> pd.DataFrame:
        off = self.bundle.offerings
        loc = off["provider"] + ":" + off["region"]
        mask = (loc == region) if ":" in region else (off["region"] == region)
        if not mask.any():
            raise CloudError(NAME, f"the bundle has no offerings in '{region}'", region=region, operation="offerings",
                             hint=f"one of {', '.join(self.regions()[:8])}")
        return off[mask]

    def api_endpoint(self, region: str) -> tuple[str, int]:
        raise CloudNotSupportedError(NAME, "a recording has no endpoint; its RTT is the bundle's rtt table "
                                     "(recorded_rtt())", region=region)

    def recorded_rtt(self) -> pd.DataFrame:
        """The bundle's rtt table (src, dst, rtt_ms)."""
        return self.bundle.rtt[["src", "dst", "rtt_ms"]].copy()

    # -- hooks -------------------------------------------------------------------------------------

    def _fetch_offerings(self, region: str) -> list[InstanceOffer]:
        rows = self._rows(region).drop_duplicates(["provider", "region", "instance_type"])
        has_acc = "accelerator" in rows.columns
        return [InstanceOffer(provider=r.provider, region=r.region, instance_type=r.instance_type,
                              accelerator=(r.accelerator or "") if has_acc else "",
                              accelerator_count=int(r.accelerator_count), vcpus=float(r.vcpus),
                              memory_gib=float(r.memory_gib))
                for r in rows.itertuples(index=False)]

    def _prices_of(self, region: str, instance_types: tuple[str, ...], mode: str) -> pd.DataFrame:
        rows = self._rows(region)
        rows = rows[rows["instance_type"].isin(instance_types) & (rows["pricing_mode"] == mode)]
        p = self.bundle.prices
        p = p[p["offering_id"].isin(rows["offering_id"]) & (p["ts"] <= self.now)]
        return p.merge(rows[["offering_id", "provider", "region", "instance_type"]], on="offering_id")

    def _fetch_on_demand_prices(self, region: str, instance_types: tuple[str, ...]) -> list[PricePoint]:
        p = self._prices_of(region, instance_types, "on_demand").sort_values("ts", kind="stable")
        last = p.groupby("offering_id", sort=True).tail(1)
        return [PricePoint(r.ts.to_pydatetime(), r.provider, r.region, r.instance_type, "on_demand", float(r.usd_per_hour))
                for r in last.itertuples(index=False)]

    def _fetch_spot_prices(self, region: str, instance_types: tuple[str, ...], since: datetime | None) -> list[PricePoint]:
        p = self._prices_of(region, instance_types, "spot").sort_values("ts", kind="stable")
        if since is None:
            p = p.groupby("offering_id", sort=True).tail(1)
        else:
            p = p[p["ts"] >= pd.Timestamp(since)]
        return [PricePoint(r.ts.to_pydatetime(), r.provider, r.region, r.instance_type, "spot", float(r.usd_per_hour),
                           snapshot=since is None) for r in p.itertuples(index=False)]

    def _fetch_spot_availability(self, region: str, instance_types: tuple[str, ...]) -> list[AvailabilitySignal]:
        rows = self._rows(region)
        rows = rows[rows["instance_type"].isin(instance_types) & (rows["pricing_mode"] == "spot")]
        a = self.bundle.availability
        a = a[a["offering_id"].isin(rows["offering_id"]) & (a["ts"] <= self.now)].sort_values("ts", kind="stable")
        last = a.groupby("offering_id").tail(1).merge(rows[["offering_id", "provider", "region", "instance_type"]])
        return [AvailabilitySignal(r.ts.to_pydatetime(), r.provider, r.region, r.instance_type, bool(r.available),
                                   "recorded") for r in last.itertuples(index=False)]

    def _fetch_quotas(self, region: str) -> list[QuotaRecord]:
        q = self.bundle.quotas
        loc = q["provider"] + ":" + q["region"]
        q = q[((loc == region) if ":" in region else (q["region"] == region)) & (q["ts"] <= self.now)]
        last = q.sort_values("ts", kind="stable").groupby(["provider", "region", "quota_name"]).tail(1)
        has_usage, has_covers = "usage" in last.columns, "covers" in last.columns
        return [QuotaRecord(r.ts.to_pydatetime(), r.provider, r.region, r.quota_name, r.unit, float(r.limit),
                            None if not has_usage or pd.isna(r.usage) else float(r.usage),
                            tuple(p for p in str(r.covers).split(";") if p) if has_covers and not pd.isna(r.covers)
                            else ())
                for r in last.itertuples(index=False)]

    def _fetch_utilization(self, pool: PoolSelector, start: datetime, end: datetime) -> list[UtilizationSample]:
        u = self.bundle.utilization
        u = u[(u["offering_id"] == pool.offering_id) & (u["ts"] >= pd.Timestamp(start)) & (u["ts"] < pd.Timestamp(end))]
        has_cpu = "cpu_util" in u.columns
        return [UtilizationSample(r.ts.to_pydatetime(), r.offering_id, float(r.gpu_util),
                                  None if not has_cpu or pd.isna(r.cpu_util) else float(r.cpu_util))
                for r in u.itertuples(index=False)]
