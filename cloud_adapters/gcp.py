"""GCP through google-cloud-compute, plus the Cloud Billing Catalog's REST API (httpx).

google-cloud-billing is not a dependency: the Catalog's one call we need
(``GET /v1/services/6F81-5844-456A/skus``, Compute Engine's SKUs) is plain REST, read with httpx,
authenticated with an API key (``XROUTE_GCP_BILLING_API_KEY``) or the same Application Default
Credentials token as the Compute client.

Credentials: Application Default Credentials (``gcloud auth application-default login``, a
service account key in ``GOOGLE_APPLICATION_CREDENTIALS``, or the metadata server). Project:
``project`` in the config, ``GOOGLE_CLOUD_PROJECT``, or the credentials' project. Endpoints:
``XROUTE_GCP_ENDPOINT`` replaces ``compute.googleapis.com`` and, unless
``XROUTE_GCP_BILLING_ENDPOINT`` / ``XROUTE_GCP_MONITORING_ENDPOINT`` are set,
``cloudbilling.googleapis.com`` and ``monitoring.googleapis.com``.

Pool utilization comes from Cloud Monitoring's ``timeSeries.list`` (REST, httpx, the ADC token):
the Ops Agent's ``agent.googleapis.com/gpu/utilization`` and Compute Engine's
``compute.googleapis.com/instance/cpu/utilization``, averaged over the instances whose labels
match the pool's ``tags``.

The client library's own retries are switched off (``retry=None``); :meth:`CloudAdapter.call` retries.
"""

from __future__ import annotations

import re
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from cloud_adapters.base import (
    AdapterConfig,
    CloudAdapter,
    Feature,
    GroupState,
    InstanceOffer,
    PoolGroup,
    PoolSelector,
    PricePoint,
    QuotaRecord,
    Reader,
    UtilizationSample,
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

PROVIDER = "gcp"
COMPUTE = "https://compute.googleapis.com"
BILLING = "https://cloudbilling.googleapis.com"
MONITORING = "https://monitoring.googleapis.com"
COMPUTE_ENGINE_SERVICE = "6F81-5844-456A"
SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]

_CORE_RAM = re.compile(r"^(?:Spot Preemptible |Preemptible )?(?P<fam>[A-Z][A-Z0-9]*) (?:Predefined )?Instance "
                       r"(?P<kind>Core|Ram) running in ")
_GPU = re.compile(r"^Nvidia (?P<gpu>.+?) GPU (?:attached to Spot Preemptible VMs )?running in ", re.I)


_AUTH_HINT = "grant roles/compute.viewer and enable the Compute Engine and Cloud Billing APIs for the project"

class GcpConfig(AdapterConfig):
    """GCP settings. ``project`` defaults to ``GOOGLE_CLOUD_PROJECT`` or the credentials' project."""

    project: str | None = None
    endpoint: str | None = None
    billing_endpoint: str | None = None
    monitoring_endpoint: str | None = None
    #: machine families with built-in accelerators (A2: A100, A3: H100, G2: L4)
    machine_families: list[str] = Field(default_factory=lambda: ["a2", "a3", "g2"])
    #: Cloud Monitoring metrics of a pool: the Ops Agent's GPU metric (percent) and Compute
    #: Engine's CPU metric (a fraction); ``*_scale`` turns each into a fraction
    gpu_metric: str = "agent.googleapis.com/gpu/utilization"
    gpu_metric_scale: float = 100.0
    cpu_metric: str = "compute.googleapis.com/instance/cpu/utilization"
    cpu_metric_scale: float = 1.0
    alignment_s: int = 300

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: list[PoolGroup]) -> list[PoolGroup]:
        for i, g in enumerate(v):
            if g.tags and not g.group:
                raise ValueError(f"groups[{i}].group: a GCP pool is a managed instance group; give its name")
        check_groups(PROVIDER, v, need=("zone",))
        for i, g in enumerate(v):
            if not str(g.zone).startswith(f"{g.region}-"):
                raise ValueError(f"groups[{i}].zone: '{g.zone}' is not a zone of the offering's region '{g.region}'")
        return v


#: a managed instance's ``currentAction`` while it is asked for and not serving yet (``none``: running)
_MIG_LAUNCHING = ("creating", "creating_without_retries", "verifying")


def accelerator_name(name: str) -> str:
    """Shared name of a GCP accelerator type or catalog GPU: nvidia-tesla-a100 / 'Tesla A100' -> A100."""
    n = name.strip().lower().replace(" ", "-")
    n = re.sub(r"^nvidia-", "", n)
    n = re.sub(r"^tesla-", "", n)
    n = n.upper()
    return "H100" if n == "H100-80GB" else n


class GcpAdapter(CloudAdapter):
    """GCP machine and accelerator types per zone, region quotas, Catalog prices, Cloud Monitoring utilization."""

    name = PROVIDER
    REGION_PATTERN = re.compile(r"^[a-z]+-[a-z]+\d+$")
    config_class = GcpConfig
    config: GcpConfig
    UNSUPPORTED: ClassVar[dict[Feature, str]] = {
        Feature.SPOT_PRICE_HISTORY: "the Cloud Billing Catalog gives current prices only; history builds up by polling",
        Feature.SPOT_AVAILABILITY: "GCP has no API for spot obtainability (preemptions show only as instance events)",
    }

    def __init__(self, config: GcpConfig | dict[str, Any] | None = None, **kw: Any):
        super().__init__(config, **kw)
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}
        self._creds: Any = None
        self._project: str | None = None
        self._http: Any = None
        self._catalog_lock = threading.Lock()

    @property
    def compute_endpoint(self) -> str:
        return (env_override("XROUTE_GCP_ENDPOINT") or self.config.endpoint or COMPUTE).rstrip("/")

    @property
    def billing_endpoint(self) -> str:
        return (env_override("XROUTE_GCP_BILLING_ENDPOINT", "XROUTE_GCP_ENDPOINT") or self.config.billing_endpoint
                or BILLING).rstrip("/")

    @property
    def monitoring_endpoint(self) -> str:
        return (env_override("XROUTE_GCP_MONITORING_ENDPOINT", "XROUTE_GCP_ENDPOINT") or self.config.monitoring_endpoint
                or MONITORING).rstrip("/")

    def api_endpoint(self, region: str) -> tuple[str, int]:
        if self.compute_endpoint != COMPUTE:
            return host_port(self.compute_endpoint)
        return f"{region}-compute.googleapis.com", 443

    def _anonymous(self) -> bool:
        return anonymous_credentials(PROVIDER, "XROUTE_GCP_CREDENTIALS", self.config.credentials, self.compute_endpoint, COMPUTE)

    def _credentials(self) -> tuple[Any, str]:
        with self._lock:
            if self._creds is None:
                project = self.config.project or env_override("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT")
                if self._anonymous():
                    self._creds = require_sdk(PROVIDER, "google.auth.credentials").AnonymousCredentials()
                else:
                    auth = require_sdk(PROVIDER, "google.auth")
                    try:
                        self._creds, found = auth.default(scopes=SCOPES)
                    except auth.exceptions.DefaultCredentialsError as e:
                        raise CloudAuthError(PROVIDER, "no Application Default Credentials", hint=(
                            "gcloud auth application-default login, or GOOGLE_APPLICATION_CREDENTIALS")) from e
                    project = project or found
                if not project:
                    raise ConfigError("gcp: no project; set project in the config or GOOGLE_CLOUD_PROJECT")
                self._project = project
            assert self._project is not None
            return self._creds, self._project

    def _client(self, kind: str) -> Any:
        creds, _ = self._credentials()
        with self._lock:
            if kind not in self._clients:
                compute = require_sdk(PROVIDER, "google.cloud.compute_v1")
                options = require_sdk(PROVIDER, "google.api_core.client_options")
                opts = None if self.compute_endpoint == COMPUTE else options.ClientOptions(api_endpoint=self.compute_endpoint)
                self._clients[kind] = getattr(compute, kind)(credentials=creds, transport="rest", client_options=opts)
            return self._clients[kind]

    def _list(self, operation: str, region: str, client: Any, request: dict[str, Any]) -> list[Any]:
        """All items of a list call, paging by hand so each page is one retried request."""
        out: list[Any] = []
        token, seen = "", set()
        while True:
            pager = self.call(operation, region, client.list, request={**request, "page_token": token},
                              retry=None, timeout=self.config.timeout_s)
            page = next(iter(pager.pages))
            out.extend(page.items)
            token = page.next_page_token
            if not token:
                return out
            if token in seen:
                raise CloudResponseError(PROVIDER, "the same page token came back twice", region=region,
                                         operation=operation, field="nextPageToken")
            seen.add(token)

    def _rest_pages(self, operation: str, region: str | None, url: str, params: dict[str, str],
                    headers: Callable[[], dict[str, str]]) -> Iterator[dict[str, Any]]:
        """Every page of a REST list call (``pageToken`` / ``nextPageToken``), each one retried
        request (``headers`` asked for each, so a refreshed token is used); a page token that comes
        back twice is an error, not an endless loop."""
        token, seen = "", set()
        while True:
            page = self.call(operation, region, self._get_json, url, {**params, **({"pageToken": token} if token else {})},
                             headers())
            yield page
            token = page.get("nextPageToken") or ""
            if not token:
                return
            if token in seen:
                raise Reader(PROVIDER, region, operation).error("the same page token came back twice", "nextPageToken")
            seen.add(token)

    # -- offerings ---------------------------------------------------------------------------------

    def _region(self, region: str) -> Any:
        _, project = self._credentials()
        key = ("region", region)
        hit = self._cache.get(key, 60.0)
        if hit is None:
            hit = self.call("regions.get", region, self._client("RegionsClient").get, project=project, region=region,
                            retry=None, timeout=self.config.timeout_s)
            self._cache.put(key, hit)
        return hit

    def _fetch_offerings(self, region: str) -> list[InstanceOffer]:
        _, project = self._credentials()
        zones = sorted(z.rsplit("/", 1)[-1] for z in self._region(region).zones)
        if not zones:
            raise CloudResponseError(PROVIDER, "the region lists no zones", region=region, operation="regions.get",
                                     field="zones")
        fams = "|".join(self.config.machine_families)
        by_type: dict[str, InstanceOffer] = {}
        in_zones: dict[str, list[str]] = defaultdict(list)
        for zone in zones:
            accels = {a.name for a in self._list("acceleratorTypes.list", region, self._client("AcceleratorTypesClient"),
                                                  {"project": project, "zone": zone})}
            items = self._list("machineTypes.list", region, self._client("MachineTypesClient"),
                               {"project": project, "zone": zone, "filter": f'name eq "({fams})-.*"'})
            for i, mt in enumerate(items):
                where = f"items[{i}]"
                for f in ("name", "guest_cpus", "memory_mb"):
                    if f not in mt:
                        raise CloudResponseError(PROVIDER, "missing in the response", region=region,
                                                 operation="machineTypes.list", field=f"{where}.{_camel(f)}")
                if mt.name.split("-")[0] not in self.config.machine_families:
                    continue
                acc = [a for a in mt.accelerators if a.guest_accelerator_type]
                if acc and acc[0].guest_accelerator_type not in accels:
                    continue  # machine type listed, its GPU not offered in this zone
                by_type.setdefault(mt.name, InstanceOffer(
                    provider=PROVIDER, region=region, instance_type=mt.name,
                    accelerator=accelerator_name(acc[0].guest_accelerator_type) if acc else "",
                    accelerator_count=sum(int(a.guest_accelerator_count) for a in acc),
                    vcpus=float(mt.guest_cpus), memory_gib=float(mt.memory_mb) / 1024.0,
                ))
                in_zones[mt.name].append(zone)
        return [InstanceOffer(**{**o.__dict__, "zones": tuple(in_zones[n])}) for n, o in sorted(by_type.items())]

    # -- prices (Cloud Billing Catalog) ------------------------------------------------------------

    def _httpx(self) -> Any:
        with self._lock:
            if self._http is None:
                self._http = require_sdk(PROVIDER, "httpx").Client(timeout=self.config.timeout_s,
                                                                    headers={"User-Agent": "xroute-collector"})
            return self._http

    def _billing_auth(self) -> tuple[dict[str, str], dict[str, str]]:
        key = env_override("XROUTE_GCP_BILLING_API_KEY")
        if key:
            return {}, {"key": key}
        return self._bearer(), {}

    def _bearer(self) -> dict[str, str]:
        """The ADC token as a header (none in anonymous mode)."""
        creds, _ = self._credentials()
        if self._anonymous():
            return {}
        if not creds.valid:
            creds.refresh(require_sdk(PROVIDER, "google.auth.transport.requests").Request())
        return {"Authorization": f"Bearer {creds.token}"}

    def _catalog(self) -> list[dict[str, Any]]:
        """All Compute Engine SKUs of the Catalog (cached 6 h; a few pages of 5000). Regions
        collected at once wait for one read rather than each reading it."""
        with self._catalog_lock:
            hit = self._cache.get(("catalog",), self.CACHE_TTL_S[Feature.ON_DEMAND_PRICES])
            if hit is not None:
                return hit  # type: ignore[no-any-return]
            return self._read_catalog()

    def _read_catalog(self) -> list[dict[str, Any]]:
        headers, auth_params = self._billing_auth()
        url = f"{self.billing_endpoint}/v1/services/{COMPUTE_ENGINE_SERVICE}/skus"
        skus: list[dict[str, Any]] = []
        r = Reader(PROVIDER, None, "services.skus.list")
        for page in self._rest_pages("services.skus.list", None, url,
                                     {"currencyCode": "USD", "pageSize": "5000", **auth_params}, lambda: headers):
            for s in r.get(page, "skus"):
                s["_field"] = f"skus[{len(skus)}]"
                skus.append(s)
        self._cache.put(("catalog",), skus)
        return skus

    def _get_json(self, url: str, params: dict[str, str], headers: dict[str, str]) -> Any:
        resp = self._httpx().get(url, params=params, headers=headers)
        resp.raise_for_status()
        return resp.json()

    def _unit_prices(self, region: str, spot: bool) -> tuple[dict[tuple[str, str], tuple[float, datetime]], datetime]:
        """``(family, 'core'|'ram')`` and ``('gpu', name)`` -> (USD per hour per unit, effective time)."""
        out: dict[tuple[str, str], tuple[float, datetime]] = {}
        latest = None
        r = Reader(PROVIDER, region, "services.skus.list")
        for s in self._catalog():
            f = s["_field"]
            usage = r.get(s, "category", "usageType", prefix=f, default="")
            if usage not in ("OnDemand", "Preemptible") or (usage == "Preemptible") != spot:
                continue
            if region not in (s.get("serviceRegions") or []):
                continue
            desc = str(r.get(s, "description", prefix=f))
            m, g = _CORE_RAM.match(desc), _GPU.match(desc)
            if m:
                key = (m.group("fam").lower(), m.group("kind").lower())
            elif g and r.get(s, "category", "resourceGroup", prefix=f, default="") == "GPU":
                key = ("gpu", accelerator_name(g.group("gpu")))
            else:
                continue
            infos = r.get(s, "pricingInfo", prefix=f)
            if not infos:
                raise r.error("is empty", f"{f}.pricingInfo")
            info = infos[-1]
            rates = r.get(info, "pricingExpression", "tieredRates", prefix=f"{f}.pricingInfo[{len(infos) - 1}]")
            if not rates:
                continue
            price = rates[-1].get("unitPrice", {})
            usd = float(r.get(price, "units", cast=float, prefix=f"{f}.pricingInfo.tieredRates.unitPrice", default=0))
            usd += float(r.get(price, "nanos", cast=float, prefix=f"{f}.pricingInfo.tieredRates.unitPrice", default=0)) / 1e9
            ts = parse_ts(info.get("effectiveTime")) or utcnow()
            latest = ts if latest is None or ts > latest else latest
            out[key] = (usd, ts)
        return out, latest or utcnow()

    def _price(self, region: str, instance_types: tuple[str, ...], spot: bool) -> list[PricePoint]:
        units, _ = self._unit_prices(region, spot)
        offers = {o.instance_type: o for o in self._cached(
            Feature.OFFERINGS, (region,), lambda: self._fetch_offerings(region))}
        out = []
        for t in instance_types:
            o = offers.get(t)
            if o is None:
                continue
            fam = t.split("-")[0]
            parts = [(units.get((fam, "core")), o.vcpus), (units.get((fam, "ram")), o.memory_gib)]
            if o.accelerator_count:
                parts.append((units.get(("gpu", o.accelerator)), float(o.accelerator_count)))
            if any(p is None for p, _ in parts):
                continue  # a component is not in the catalog for this region: leave the type unpriced
            usd = sum(p[0] * n for p, n in parts if p is not None)
            ts = max(p[1] for p, _ in parts if p is not None)
            out.append(PricePoint(ts, PROVIDER, region, t, "spot" if spot else "on_demand", round(usd, 6)))
        return out

    def _fetch_on_demand_prices(self, region: str, instance_types: tuple[str, ...]) -> list[PricePoint]:
        return self._price(region, instance_types, spot=False)

    def _fetch_spot_prices(self, region: str, instance_types: tuple[str, ...], since: datetime | None) -> list[PricePoint]:
        return self._price(region, instance_types, spot=True)

    # -- utilization (Cloud Monitoring) ------------------------------------------------------------

    def _series(self, pool: PoolSelector, metric: str, scale: float, start: datetime,
                end: datetime) -> dict[datetime, float]:
        """The pool's mean of ``metric`` per alignment period: one ``timeSeries.list`` with a
        cross-series mean over the instances whose labels match ``pool.tags``."""
        _, project = self._credentials()
        flt = f'metric.type = "{metric}" AND resource.type = "gce_instance"'
        flt += "".join(f' AND metadata.user_labels."{k}" = "{v}"' for k, v in sorted(pool.tags.items()))
        if pool.region:
            flt += f' AND resource.labels.zone = starts_with("{pool.region}")'
        params = {"filter": flt, "interval.startTime": _rfc3339(start), "interval.endTime": _rfc3339(end),
                  "aggregation.alignmentPeriod": f"{self.config.alignment_s}s",
                  "aggregation.perSeriesAligner": "ALIGN_MEAN", "aggregation.crossSeriesReducer": "REDUCE_MEAN"}
        url = f"{self.monitoring_endpoint}/v3/projects/{project}/timeSeries"
        out: dict[datetime, list[float]] = defaultdict(list)
        r = Reader(PROVIDER, pool.region, "timeSeries.list")
        for page in self._rest_pages("timeSeries.list", pool.region, url, params, self._bearer):
            for i, ts in enumerate(page.get("timeSeries") or []):
                for j, pt in enumerate(r.get(ts, "points", prefix=f"timeSeries[{i}]")):
                    f = f"timeSeries[{i}].points[{j}]"
                    when = parse_ts(r.get(pt, "interval", "endTime", prefix=f))
                    if when is None:
                        raise r.error("is not a timestamp", f"{f}.interval.endTime")
                    value = pt.get("value", {})
                    v = value.get("doubleValue", value.get("int64Value"))
                    if v is None:
                        raise r.error("missing in the response", f"{f}.value.doubleValue")
                    out[when].append(float(v) / scale)
        return {t: min(1.0, max(0.0, sum(v) / len(v))) for t, v in out.items()}

    def _fetch_utilization(self, pool: PoolSelector, start: datetime, end: datetime) -> list[UtilizationSample]:
        cfg = self.config
        gpu = self._series(pool, cfg.gpu_metric, cfg.gpu_metric_scale, start, end)
        cpu = self._series(pool, cfg.cpu_metric, cfg.cpu_metric_scale, start, end) if cfg.cpu_metric else {}
        return [UtilizationSample(t, pool.offering_id, gpu[t], cpu.get(t)) for t in sorted(gpu)]

    # -- quotas ------------------------------------------------------------------------------------

    def _fetch_quotas(self, region: str) -> list[QuotaRecord]:
        reg = self._region(region)
        now = utcnow()
        cpu_metrics = {"CPUS", "PREEMPTIBLE_CPUS", *(f"{f.upper()}_CPUS" for f in self.config.machine_families)}
        out = []
        for i, q in enumerate(reg.quotas):
            if "metric" not in q or "limit" not in q:
                raise CloudResponseError(PROVIDER, "missing in the response", region=region, operation="regions.get",
                                         field=f"quotas[{i}].{'metric' if 'metric' not in q else 'limit'}")
            unit: Literal["vcpus", "gpus"]
            if q.metric.endswith("_GPUS") and "ALL_REGIONS" not in q.metric:
                unit = "gpus"
            elif q.metric in cpu_metrics:
                unit = "vcpus"
            else:
                continue
            out.append(QuotaRecord(now, PROVIDER, region, q.metric, unit, float(q.limit),
                                   float(q.usage) if "usage" in q else None, self._quota_covers(region, q.metric)))
        return out

    def _quota_covers(self, region: str, metric: str) -> tuple[str, ...]:
        """What a region quota counts: ``CPUS`` the region's on-demand vCPUs, ``PREEMPTIBLE_CPUS`` its spot
        ones, ``<FAMILY>_CPUS`` that machine family's on-demand ones, ``[PREEMPTIBLE_]<GPU>_GPUS`` the
        machine types with that GPU (from the offerings, listed once per region; none when they cannot be
        read)."""
        spot = metric.startswith("PREEMPTIBLE_")
        core = metric.removeprefix("PREEMPTIBLE_")
        mode = "spot" if spot else "on_demand"
        if core == "CPUS":
            return (f"{PROVIDER}:{region}:*:{mode}",)
        if core.endswith("_CPUS"):
            return (f"{PROVIDER}:{region}:{core.removesuffix('_CPUS').lower()}-*:on_demand",)
        gpu = accelerator_name(core.removesuffix("_GPUS").replace("_", "-"))
        try:
            offers = self.offerings(region)
        except CloudError:
            return ()
        return tuple(f"{PROVIDER}:{region}:{o.instance_type}:{mode}" for o in offers if o.accelerator == gpu)

    # -- inventory and actuation (zonal managed instance groups) -----------------------------------

    def _fetch_group(self, pool: PoolGroup) -> GroupState:
        """The group's ``targetSize`` and its ``currentActions`` summary (``instanceGroupManagers.get``):
        instances with no action are running; creating or verifying ones launching."""
        _, project = self._credentials()
        mig = self.call("instanceGroupManagers.get", pool.region, self._client("InstanceGroupManagersClient").get,
                        project=project, zone=pool.zone, instance_group_manager=pool.group, retry=None,
                        timeout=self.config.timeout_s)
        for f in ("target_size", "current_actions"):
            if f not in mig:
                raise CloudResponseError(PROVIDER, "missing in the response", region=pool.region,
                                         operation="instanceGroupManagers.get", field=_camel(f))
        acts = mig.current_actions
        return GroupState(pool, desired=int(mig.target_size), running=int(acts.none),
                          launching=sum(int(getattr(acts, a)) for a in _MIG_LAUNCHING))

    def _set_group_capacity(self, pool: PoolGroup, desired: int) -> None:
        """``instanceGroupManagers.resize``; the zonal operation it starts is not waited for (the
        next inventory shows it)."""
        _, project = self._credentials()
        self.call_mutation("instanceGroupManagers.resize", pool.region,
                           self._client("InstanceGroupManagersClient").resize_unary, project=project, zone=pool.zone,
                           instance_group_manager=pool.group, size=int(desired), retry=None,
                           timeout=self.config.timeout_s)

    # -- errors ------------------------------------------------------------------------------------

    def _translate(self, exc: BaseException, operation: str, region: str | None) -> CloudError | None:
        kw: dict[str, Any] = {"region": region, "operation": operation}
        http = translate_http_error(PROVIDER, exc, kw, _AUTH_HINT)
        if http is not None:
            return http
        gx = require_sdk(PROVIDER, "google.api_core.exceptions")
        if isinstance(exc, gx.GoogleAPICallError):
            resp = getattr(exc, "response", None)
            headers = getattr(resp, "headers", None) or {}
            status = int(exc.code) if isinstance(exc.code, int) else 0
            return error_for_status(PROVIDER, status, f"{type(exc).__name__}: {str(exc.message)[:160]}", headers.get("Retry-After"), kw, _AUTH_HINT)
        rx = require_sdk(PROVIDER, "requests.exceptions")
        if isinstance(exc, rx.ConnectionError | rx.Timeout | rx.ChunkedEncodingError):
            return CloudUnavailableError(PROVIDER, f"{type(exc).__name__}: {str(exc)[:160]}", **kw)
        if isinstance(exc, rx.JSONDecodeError):
            return CloudResponseError(PROVIDER, "the response body is not JSON", **kw)
        px = require_sdk(PROVIDER, "google.protobuf.json_format")
        if isinstance(exc, px.ParseError):
            return CloudResponseError(PROVIDER, f"the response could not be read ({str(exc)[:160]})", **kw)
        ax = require_sdk(PROVIDER, "google.auth.exceptions")
        if isinstance(exc, ax.GoogleAuthError):
            return CloudAuthError(PROVIDER, str(exc)[:200], hint="refresh Application Default Credentials", **kw)
        return None


def _rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)
