"""Azure through azure-mgmt-compute and azure-identity, plus the public Retail Prices API (httpx).

Credentials: ``DefaultAzureCredential`` (environment, workload identity, managed identity, Azure
CLI, ...); the subscription from the config's ``subscription_id`` or ``AZURE_SUBSCRIPTION_ID``.
Endpoints: ``XROUTE_AZURE_ENDPOINT`` replaces Resource Manager (``https://management.azure.com``)
and, unless ``XROUTE_AZURE_PRICES_ENDPOINT`` is set, the Retail Prices API
(``https://prices.azure.com``), which needs no credentials.

azure-core's own retries are switched off (``retry_total=0``); :meth:`CloudAdapter.call` retries.
"""

from __future__ import annotations

import re
import threading
from datetime import datetime
from typing import Any, ClassVar

from pydantic import Field, field_validator

from cloud_adapters.base import (
    AdapterConfig,
    CloudAdapter,
    Feature,
    GroupState,
    InstanceOffer,
    PoolGroup,
    PricePoint,
    QuotaRecord,
    Reader,
    anonymous_credentials,
    check_groups,
    env_override,
    error_for_status,
    host_port,
    parse_ts,
    require_sdk,
    translate_http_error,
    utcnow,
)
from cloud_adapters.errors import (
    CloudAuthError,
    CloudError,
    CloudResponseError,
    CloudUnavailableError,
)
from xroute.errors import ConfigError

PROVIDER = "azure"
ARM = "https://management.azure.com"
RETAIL_PRICES = "https://prices.azure.com"
RETAIL_API_VERSION = "2023-01-01-preview"

#: accelerator of the N-series families whose size names do not carry it (``_T4_``, ``_A100_`` do)
FAMILY_ACCELERATOR: dict[str, str] = {
    "standardNCSv3Family": "V100",
    "standardNCSv2Family": "P100",
    "standardNDSv2Family": "V100",
    "standardNDSFamily": "P40",
    "standardNDASv4_A100Family": "A100",
    "standardNDAMSv4_A100Family": "A100-80GB",
    "standardNVSv3Family": "M60",
    "standardNVFamily": "M60",
    "standardNCFamily": "K80",
}
_NAME_ACCEL = re.compile(r"_(T4|A10|A100|H100|H200|V100|L4|L40S|MI300X|M60|P40|P100)(_|$)", re.I)


_AUTH_HINT = "grant the identity Reader on the subscription"

class AzureConfig(AdapterConfig):
    """Azure settings. ``subscription_id`` defaults to ``AZURE_SUBSCRIPTION_ID``."""

    subscription_id: str | None = None
    endpoint: str | None = None
    prices_endpoint: str | None = None
    #: size-name prefixes to keep (N-series are the GPU sizes)
    size_prefixes: list[str] = Field(default_factory=lambda: ["Standard_N"])
    #: how many sizes one Retail Prices query asks for (the ``$filter`` length is limited)
    prices_chunk: int = 15

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: list[PoolGroup]) -> list[PoolGroup]:
        for i, g in enumerate(v):
            if g.tags and not g.group:
                raise ValueError(f"groups[{i}].group: an Azure pool is a VM scale set; give its name")
        return check_groups(PROVIDER, v, need=("resource_group",))


class _NoToken:
    """The credential object of ``credentials: anonymous`` (local endpoints only): never asked for
    a token, since that mode also replaces the bearer-token policy with one that sends nothing."""

    def get_token(self, *scopes: str, **kw: Any) -> Any:
        raise RuntimeError("anonymous Azure credentials hold no token")


class AzureAdapter(CloudAdapter):
    """Azure VM sizes (resource SKUs), Retail Prices, and compute usages/quotas per location."""

    name = PROVIDER
    REGION_PATTERN = re.compile(r"^[a-z]+[a-z0-9]*$")
    config_class = AzureConfig
    config: AzureConfig
    UNSUPPORTED: ClassVar[dict[Feature, str]] = {
        Feature.SPOT_PRICE_HISTORY: "the Retail Prices API gives current prices only; history builds up by polling",
        Feature.SPOT_AVAILABILITY: "no live spot obtainability signal is read (the Spot Placement Score API is not "
        "used yet); sizes restricted for the subscription in a location are left out of the offerings instead",
        Feature.UTILIZATION: "not implemented: Azure Monitor's VM host metrics have no GPU utilization (it needs a "
        "guest agent with custom metrics); use a Prometheus pool (DCGM exporter)",
    }

    def __init__(self, config: AzureConfig | dict[str, Any] | None = None, **kw: Any):
        super().__init__(config, **kw)
        self._lock = threading.Lock()
        self._compute: Any = None
        self._http: Any = None
        #: per region, each offered size's quota family (resource SKUs' ``family``): what a family quota covers
        self._families: dict[str, dict[str, str]] = {}

    @property
    def arm_endpoint(self) -> str:
        return (env_override("XROUTE_AZURE_ENDPOINT") or self.config.endpoint or ARM).rstrip("/")

    @property
    def prices_endpoint(self) -> str:
        return (env_override("XROUTE_AZURE_PRICES_ENDPOINT", "XROUTE_AZURE_ENDPOINT") or self.config.prices_endpoint
                or RETAIL_PRICES).rstrip("/")

    def api_endpoint(self, region: str) -> tuple[str, int]:
        if self.arm_endpoint != ARM:
            return host_port(self.arm_endpoint)
        return f"{region}.management.azure.com", 443

    def _anonymous(self) -> bool:
        return anonymous_credentials(PROVIDER, "XROUTE_AZURE_CREDENTIALS", self.config.credentials, self.arm_endpoint, ARM)

    def _client(self) -> Any:
        with self._lock:
            if self._compute is None:
                compute = require_sdk(PROVIDER, "azure.mgmt.compute")
                sub = self.config.subscription_id or env_override("AZURE_SUBSCRIPTION_ID")
                if not sub:
                    raise ConfigError("azure: no subscription; set subscription_id in the config or AZURE_SUBSCRIPTION_ID")
                kw: dict[str, Any] = {}
                if self._anonymous():
                    policies = require_sdk(PROVIDER, "azure.core.pipeline.policies")
                    credential: Any = _NoToken()
                    kw["authentication_policy"] = policies.SansIOHTTPPolicy()
                else:
                    credential = require_sdk(PROVIDER, "azure.identity").DefaultAzureCredential()
                self._compute = compute.ComputeManagementClient(
                    credential, sub, base_url=self.arm_endpoint, retry_total=0,
                    connection_timeout=self.config.timeout_s, read_timeout=self.config.timeout_s, **kw,
                )
            return self._compute

    def _httpx(self) -> Any:
        with self._lock:
            if self._http is None:
                httpx = require_sdk(PROVIDER, "httpx")
                self._http = httpx.Client(timeout=self.config.timeout_s, headers={"User-Agent": "xroute-collector"})
            return self._http

    def _list(self, operation: str, region: str, pager_factory: Any) -> list[Any]:
        """All items of an azure-core pager, one retried request per page (a failed page is asked
        for again with the same continuation token)."""
        pages = pager_factory().by_page()
        out: list[Any] = []
        while True:
            out.extend(self.call(operation, region, lambda: list(next(pages))))
            if pages.continuation_token is None:
                return out

    # -- offerings ---------------------------------------------------------------------------------

    def _fetch_offerings(self, region: str) -> list[InstanceOffer]:
        client = self._client()
        skus = self._list("ResourceSkus.List", region, lambda: client.resource_skus.list(
            filter=f"location eq '{region}'"))
        out = []
        r = Reader(PROVIDER, region, "ResourceSkus.List")
        for i, sku in enumerate(skus):
            p = f"value[{i}]"
            if sku.get("resourceType") != "virtualMachines":
                continue
            name = str(r.get(sku, "name", prefix=p))
            if not any(name.startswith(x) for x in self.config.size_prefixes):
                continue
            if region.lower() not in [str(loc).lower() for loc in (sku.get("locations") or [])]:
                continue
            if _restricted(sku, region):
                continue
            caps = {str(c.get("name")): c.get("value") for c in (sku.get("capabilities") or [])}
            gpus = int(r.get(caps, "GPUs", cast=float, prefix=f"{p}.capabilities", default=0))
            zones: tuple[str, ...] = ()
            for info in sku.get("locationInfo") or []:
                if str(info.get("location", "")).lower() == region.lower():
                    zones = tuple(sorted(info.get("zones") or []))
            self._families.setdefault(region, {})[name] = str(sku.get("family") or "")
            out.append(InstanceOffer(
                provider=PROVIDER, region=region, instance_type=name,
                accelerator=accelerator_of(name, str(sku.get("family") or "")) if gpus else "", accelerator_count=gpus,
                vcpus=r.get(caps, "vCPUs", cast=float, prefix=f"{p}.capabilities"),
                memory_gib=r.get(caps, "MemoryGB", cast=float, prefix=f"{p}.capabilities"),
                zones=zones,
            ))
        return sorted(out, key=lambda o: o.instance_type)

    # -- prices (Retail Prices API, unauthenticated) -----------------------------------------------

    def _retail_items(self, region: str, instance_types: tuple[str, ...]) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        n = 0
        for chunk in range(0, len(instance_types), self.config.prices_chunk):
            names = instance_types[chunk:chunk + self.config.prices_chunk]
            sku_filter = " or ".join(f"armSkuName eq '{t}'" for t in names)
            flt = (f"serviceName eq 'Virtual Machines' and armRegionName eq '{region}' "
                   f"and priceType eq 'Consumption' and ({sku_filter})")
            url: str | None = f"{self.prices_endpoint}/api/retail/prices"
            params: dict[str, str] | None = {"api-version": RETAIL_API_VERSION, "$filter": flt}
            seen: set[str] = set()
            while url:
                page = self.call("RetailPrices", region, self._get_json, url, params)
                r = Reader(PROVIDER, region, "RetailPrices")
                for it in r.get(page, "Items"):
                    if not isinstance(it, dict):
                        raise r.error("is not an object", f"Items[{n}]")
                    it["_field"] = f"Items[{n}]"
                    n += 1
                    items.append(it)
                nxt = page.get("NextPageLink") or None
                if nxt and nxt in seen:
                    raise r.error("the same page link came back twice", "NextPageLink")
                if nxt:
                    seen.add(nxt)
                    nxt = _rebase(nxt, self.prices_endpoint)
                url, params = nxt, None
        return items

    def _get_json(self, url: str, params: dict[str, str] | None) -> Any:
        resp = self._httpx().get(url, params=params)
        resp.raise_for_status()
        return resp.json()

    def _prices(self, region: str, instance_types: tuple[str, ...], spot: bool) -> list[PricePoint]:
        # one query serves both pricing modes; keep its answer a minute so a collection asks once
        key = ("retail", region, instance_types)
        items = self._cache.get(key, 60.0)
        if items is None:
            items = self._retail_items(region, instance_types)
            self._cache.put(key, items)
        best: dict[str, PricePoint] = {}
        for it in items:
            r = Reader(PROVIDER, region, "RetailPrices")
            f = it["_field"]
            sku_name = str(r.get(it, "skuName", prefix=f))
            product = str(it.get("productName", ""))
            if product.endswith("Windows") or "Low Priority" in sku_name or str(it.get("type", "Consumption")) != "Consumption":
                continue
            if sku_name.endswith(" Spot") != spot:
                continue
            if str(it.get("unitOfMeasure", "1 Hour")) != "1 Hour":
                continue
            itype = r.get(it, "armSkuName", prefix=f)
            if itype not in instance_types:
                continue
            usd = r.get(it, "retailPrice", cast=float, prefix=f)
            if usd <= 0 or str(it.get("currencyCode", "USD")) != "USD":
                continue
            ts = parse_ts(it.get("effectiveStartDate")) or utcnow()
            old = best.get(itype)
            if old is None or ts > old.ts:
                best[itype] = PricePoint(ts, PROVIDER, region, itype, "spot" if spot else "on_demand", usd)
        return [best[t] for t in sorted(best)]

    def _fetch_on_demand_prices(self, region: str, instance_types: tuple[str, ...]) -> list[PricePoint]:
        return self._prices(region, instance_types, spot=False)

    def _fetch_spot_prices(self, region: str, instance_types: tuple[str, ...], since: datetime | None) -> list[PricePoint]:
        return self._prices(region, instance_types, spot=True)

    # -- quotas ------------------------------------------------------------------------------------

    def _fetch_quotas(self, region: str) -> list[QuotaRecord]:
        client = self._client()
        usages = self._list("Usage.List", region, lambda: client.usage.list(region))
        now = utcnow()
        out = []
        r = Reader(PROVIDER, region, "Usage.List")
        for i, u in enumerate(usages):
            p = f"value[{i}]"
            name = str(r.get(u, "name", "value", prefix=p))
            gpu_family = name.lower().startswith("standardn") and name.endswith("Family")
            if not (gpu_family or name in ("cores", "lowPriorityCores")):
                continue
            usage = r.get(u, "currentValue", cast=float, prefix=p, default=None)
            out.append(QuotaRecord(now, PROVIDER, region, name, "vcpus", r.get(u, "limit", cast=float, prefix=p), usage,
                                   self._quota_covers(region, name)))
        return out

    def _quota_covers(self, region: str, name: str) -> tuple[str, ...]:
        """What a usage quota counts: ``cores`` the region's standard (on-demand) vCPUs, ``lowPriorityCores``
        its spot ones, a family quota the on-demand sizes of that family (from the resource SKUs, listed
        once per region; none when they cannot be read)."""
        if name == "cores":
            return (f"{PROVIDER}:{region}:*:on_demand",)
        if name == "lowPriorityCores":
            return (f"{PROVIDER}:{region}:*:spot",)
        if region not in self._families:
            try:
                self.offerings(region)
            except CloudError:
                return ()
        return tuple(f"{PROVIDER}:{region}:{size}:on_demand" for size, fam in sorted(self._families.get(region, {}).items())
                     if fam.lower() == name.lower())

    # -- inventory and actuation (VM scale sets) ---------------------------------------------------

    def _fetch_group(self, pool: PoolGroup) -> GroupState:
        """The scale set's capacity (``sku.capacity``) and its VMs' provisioning states: ``Succeeded``
        running, ``Creating`` launching (``VirtualMachineScaleSetVMs.List``)."""
        client = self._client()
        rg, name, region = pool.resource_group, pool.group, pool.region
        vmss = self.call("VirtualMachineScaleSets.Get", region, client.virtual_machine_scale_sets.get, rg, name)
        r = Reader(PROVIDER, region, "VirtualMachineScaleSets.Get")
        desired = r.get(vmss, "sku", "capacity", cast=int)
        vms = self._list("VirtualMachineScaleSetVMs.List", region,
                         lambda: client.virtual_machine_scale_set_vms.list(rg, name))
        rv = Reader(PROVIDER, region, "VirtualMachineScaleSetVMs.List")
        states = [str(rv.get(vm, "properties", "provisioningState", prefix=f"value[{i}]")) for i, vm in enumerate(vms)]
        return GroupState(pool, desired=desired,
                          running=sum(s == "Succeeded" for s in states), launching=sum(s == "Creating" for s in states))

    def _set_group_capacity(self, pool: PoolGroup, desired: int) -> None:
        """``PATCH`` the scale set's ``sku.capacity`` (``VirtualMachineScaleSets.Update``); the
        long-running operation is not waited for (``polling=False``): the next inventory shows it."""
        client = self._client()
        self.call_mutation("VirtualMachineScaleSets.Update", pool.region,
                           lambda: client.virtual_machine_scale_sets.begin_update(
                               pool.resource_group, pool.group, {"sku": {"capacity": int(desired)}}, polling=False
                           ).result())

    # -- errors ------------------------------------------------------------------------------------

    def _translate(self, exc: BaseException, operation: str, region: str | None) -> CloudError | None:
        kw: dict[str, Any] = {"region": region, "operation": operation}
        http = translate_http_error(PROVIDER, exc, kw, _AUTH_HINT)
        if http is not None:
            return http
        ax = require_sdk(PROVIDER, "azure.core.exceptions")
        if isinstance(exc, ax.ClientAuthenticationError):
            return CloudAuthError(PROVIDER, str(exc.message or exc)[:200], hint="sign in (az login, a managed identity or "
                                  "AZURE_CLIENT_ID/SECRET/TENANT_ID) and grant Reader on the subscription", **kw)
        if isinstance(exc, ax.IncompleteReadError):  # a DecodeError, but the connection broke: transient
            return CloudUnavailableError(PROVIDER, f"{type(exc).__name__}: {str(exc)[:160]}", **kw)
        if isinstance(exc, ax.DecodeError):
            return CloudResponseError(PROVIDER, "the response body could not be decoded", **kw)
        if isinstance(exc, ax.HttpResponseError) and exc.status_code:
            resp = getattr(exc, "response", None)
            ra = resp.headers.get("Retry-After") if resp is not None else None
            code = getattr(getattr(exc, "error", None), "code", None) or f"HTTP {exc.status_code}"
            return error_for_status(PROVIDER, int(exc.status_code), str(code), ra, kw, _AUTH_HINT)
        if isinstance(exc, ax.ServiceRequestError | ax.ServiceResponseError):
            return CloudUnavailableError(PROVIDER, f"{type(exc).__name__}: {str(exc)[:160]}", **kw)
        if isinstance(exc, ax.DeserializationError):
            return CloudResponseError(PROVIDER, f"the response could not be read ({str(exc)[:120]})", **kw)
        if isinstance(exc, ax.AzureError):
            return CloudError(PROVIDER, f"{type(exc).__name__}: {str(exc)[:160]}", **kw)
        return None


def _restricted(sku: Any, region: str) -> bool:
    """Whether the size cannot be deployed in ``region`` by this subscription (location restriction)."""
    for r in sku.get("restrictions") or []:
        if r.get("type") == "Location" and region.lower() in [str(v).lower() for v in (r.get("values") or [])]:
            return True
    return False


def accelerator_of(size: str, family: str) -> str:
    """The GPU of an N-series size: from its name (``Standard_NC4as_T4_v3`` -> T4) or its family."""
    m = _NAME_ACCEL.search(size)
    if m:
        return m.group(1).upper()
    return FAMILY_ACCELERATOR.get(family, "")


def _rebase(link: str, endpoint: str) -> str:
    """A next-page link on our (possibly overridden) endpoint: keep its path and query."""
    if link.startswith(endpoint):
        return link
    m = re.match(r"^https?://[^/]+(/.*)$", link)
    return endpoint + m.group(1) if m else link
