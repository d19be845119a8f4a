"""Cloud adapters: live offerings, prices, spot signals, quotas, utilization and RTT.

The only package that imports cloud SDKs (``boto3``, ``azure.*``, ``google.cloud.*``); they are
imported lazily by the provider modules, so importing this package needs none of them.
"""

from cloud_adapters.base import (
    AvailabilitySignal,
    CloudAdapter,
    Feature,
    InstanceOffer,
    PoolSelector,
    PricePoint,
    QuotaRecord,
    UtilizationSample,
)
from cloud_adapters.errors import CloudError
from cloud_adapters.registry import get_adapter, names

__all__ = [
    "AvailabilitySignal",
    "CloudAdapter",
    "CloudError",
    "Feature",
    "InstanceOffer",
    "PoolSelector",
    "PricePoint",
    "QuotaRecord",
    "UtilizationSample",
    "get_adapter",
    "names",
]
