"""Asking one (provider, region): offerings, then on-demand and spot prices, spot availability and
quotas, in that order; each source ends ``ok``, ``stale`` (with the reason), ``unsupported`` (the
capability map's reason) or ``skipped``, and a failing source does not stop the others."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from cloud_adapters.base import (
    AvailabilitySignal,
    CloudAdapter,
    Deadline,
    Feature,
    InstanceOffer,
    PricePoint,
    QuotaRecord,
)
from cloud_adapters.errors import CloudNotSupportedError
from xroute.errors import XrouteError

log = logging.getLogger(__name__)


@dataclass
class SourceStatus:
    """How one source fared in a run."""

    source: str
    status: Literal["ok", "stale", "unsupported", "skipped"]
    rows: int = 0
    reason: str = ""
    seconds: float = 0.0


@dataclass
class RegionResult:
    """What one (provider, region) answered, and how each of its sources fared."""

    provider: str
    region: str
    offers: list[InstanceOffer] = field(default_factory=list)
    prices: list[PricePoint] = field(default_factory=list)
    availability: list[AvailabilitySignal] = field(default_factory=list)
    quotas: list[QuotaRecord] = field(default_factory=list)
    statuses: list[SourceStatus] = field(default_factory=list)


STEPS: list[tuple[Feature, str]] = [
    (Feature.OFFERINGS, "offerings"), (Feature.ON_DEMAND_PRICES, "on_demand_prices"),
    (Feature.SPOT_PRICES, "spot_prices"), (Feature.SPOT_AVAILABILITY, "spot_availability"), (Feature.QUOTAS, "quotas"),
]


def collect_region(adapter: CloudAdapter, provider: str, region: str, since: datetime,
                   deadline: Deadline) -> RegionResult:
    rr = RegionResult(provider, region)

    def step(feature: Feature, fn: Callable[[], list[Any]]) -> list[Any] | None:
        src = f"{provider}:{region}/{feature.value}"
        reason = adapter.capabilities()[feature]
        if reason is not None:
            rr.statuses.append(SourceStatus(src, "unsupported", reason=reason))
            return None
        if deadline.expired:
            rr.statuses.append(SourceStatus(src, "stale", reason="the run's deadline passed before it was asked"))
            return None
        t0 = time.monotonic()
        try:
            rows = fn()
        except CloudNotSupportedError as e:
            rr.statuses.append(SourceStatus(src, "unsupported", reason=e.problem, seconds=time.monotonic() - t0))
            return None
        except XrouteError as e:
            rr.statuses.append(SourceStatus(src, "stale", reason=getattr(e, "reason", str(e)), seconds=time.monotonic() - t0))
            log.info("%s stale: %s", src, e)
            return None
        except Exception as e:  # an adapter bug must not stop the other providers
            log.exception("%s failed", src)
            rr.statuses.append(SourceStatus(src, "stale", reason=f"internal error {type(e).__name__}: {e}",
                                            seconds=time.monotonic() - t0))
            return None
        rr.statuses.append(SourceStatus(src, "ok", rows=len(rows), seconds=time.monotonic() - t0))
        return rows

    offers = step(Feature.OFFERINGS, lambda: adapter.offerings(region))
    if offers is None:
        for f, _ in STEPS[1:]:
            rr.statuses.append(SourceStatus(f"{provider}:{region}/{f.value}", "skipped", reason="no offerings"))
        return rr
    rr.offers = offers
    types = [o.instance_type for o in offers]
    od = step(Feature.ON_DEMAND_PRICES, lambda: adapter.on_demand_prices(region, types)) or []
    history = adapter.supports(Feature.SPOT_PRICE_HISTORY)
    spot = step(Feature.SPOT_PRICES, lambda: adapter.spot_prices(region, types, since=since if history else None)) or []
    rr.prices = od + spot
    spot_types = sorted({p.instance_type for p in spot})
    rr.availability = step(Feature.SPOT_AVAILABILITY, lambda: adapter.spot_availability(region, spot_types)) or []
    rr.quotas = step(Feature.QUOTAS, lambda: adapter.quotas(region)) or []
    return rr
