"""AWS through boto3: EC2 instance types and spot prices, the Price List API, Service Quotas, CloudWatch.

Credentials come from boto3's standard chain (environment, shared config/SSO, instance or task
role); nothing is read from our config. Endpoints: ``XROUTE_AWS_ENDPOINT_URL_<SERVICE>``
(``EC2``, ``PRICING``, ``SERVICE_QUOTAS``, ``CLOUDWATCH``), then ``XROUTE_AWS_ENDPOINT_URL``,
then ``endpoint_url`` in the config, else the real regional endpoints.

botocore's own retries are switched off (one attempt per call); :meth:`CloudAdapter.call` retries
instead, so throttling and the run's deadline are handled in one place.
"""

from __future__ import annotations

import json
import re
import threading
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

from pydantic import Field, field_validator

from cloud_adapters.base import (
    AdapterConfig,
    AvailabilitySignal,
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
    check_groups,
    env_override,
    frac,
    host_port,
    normalize_accelerator,
    parse_ts,
    require_sdk,
    retry_after_seconds,
    utcnow,
)
from cloud_adapters.errors import (
    CloudAuthError,
    CloudError,
    CloudNotSupportedError,
    CloudResponseError,
    CloudThrottledError,
    CloudUnavailableError,
)

PROVIDER = "aws"

_THROTTLE_CODES = {"Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
                   "RequestThrottled", "RequestThrottledException", "SlowDown"}
_AUTH_CODES = {"AuthFailure", "UnauthorizedOperation", "AccessDenied", "AccessDeniedException",
               "InvalidClientTokenId", "ExpiredToken", "ExpiredTokenException", "UnrecognizedClientException",
               "SignatureDoesNotMatch", "NoSuchEntity"}
_UNAVAILABLE_CODES = {"InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable",
                      "ServiceUnavailableException", "InternalServerError", "InternalServiceException"}
_UNSUPPORTED_CODES = {"InvalidAction", "UnknownOperationException", "NotImplemented", "UnsupportedOperation"}

#: IAM action each operation needs (for the fix hint of an access error)
IAM_ACTIONS: dict[str, str] = {
    "DescribeInstanceTypes": "ec2:DescribeInstanceTypes",
    "DescribeInstanceTypeOfferings": "ec2:DescribeInstanceTypeOfferings",
    "DescribeSpotPriceHistory": "ec2:DescribeSpotPriceHistory",
    "GetSpotPlacementScores": "ec2:GetSpotPlacementScores",
    "DescribeInstances": "ec2:DescribeInstances",
    "GetProducts": "pricing:GetProducts",
    "ListServiceQuotas": "servicequotas:ListServiceQuotas",
    "GetMetricData": "cloudwatch:GetMetricData",
    "DescribeAutoScalingGroups": "autoscaling:DescribeAutoScalingGroups",
    "SetDesiredCapacity": "autoscaling:SetDesiredCapacity",
}

#: an Auto Scaling group instance's lifecycle states: serving, and asked for but not serving yet
_ASG_RUNNING = {"InService"}
_ASG_LAUNCHING = {"Pending", "Pending:Wait", "Pending:Proceed", "Warmed:Pending", "Warmed:Pending:Wait",
                  "Warmed:Pending:Proceed"}

_SPOT_DESCRIPTIONS = ("Linux/UNIX", "Linux/UNIX (Amazon VPC)")


class AwsConfig(AdapterConfig):
    """AWS settings (all optional)."""

    endpoint_url: str | None = None
    #: named profile of the shared config; default: the standard chain
    profile: str | None = None
    #: the Price List API answers in us-east-1, eu-central-1 and ap-south-1 only
    pricing_region: str = "us-east-1"
    #: instance families to list (wildcards for DescribeInstanceTypes' instance-type filter)
    instance_families: list[str] = Field(default_factory=lambda: [
        "g4dn", "g5", "g6", "g6e", "gr6", "p3", "p4d", "p4de", "p5", "p5e", "p5en"])
    #: quota classes kept from Service Quotas (the ``Class`` dimension's family: G/OnDemand -> G)
    quota_classes: list[str] = Field(default_factory=lambda: ["G", "P", "VT"])
    #: ask GetSpotPlacementScores for a spot availability signal (one call per type and region,
    #: limited per account and day by AWS)
    spot_placement_scores: bool = False
    placement_score_threshold: int = 3
    #: CloudWatch metric for GPU utilization (the CloudWatch agent's NVIDIA metric by default)
    gpu_metric_namespace: str = "CWAgent"
    gpu_metric_name: str = "nvidia_smi_utilization_gpu"
    metric_period_s: int = 300

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: list[PoolGroup]) -> list[PoolGroup]:
        return check_groups(PROVIDER, v)


def quota_covers(region: str, quota_class: str) -> tuple[str, ...]:
    """The offerings a vCPU quota of Service Quotas' usage ``Class`` (``G/OnDemand``, ``P/Spot``)
    counts: the instance types of that family letter, in that pricing mode, in the region."""
    family, _, mode = quota_class.partition("/")
    pricing = {"OnDemand": "on_demand", "Spot": "spot"}.get(mode)
    if not family or pricing is None:
        return ()
    return (f"{PROVIDER}:{region}:{family.lower()}*:{pricing}",)


class AwsAdapter(CloudAdapter):
    """AWS EC2 offerings, prices, spot signals, quotas and CloudWatch utilization."""

    name = PROVIDER
    REGION_PATTERN = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d+$")
    config_class = AwsConfig
    config: AwsConfig
    UNSUPPORTED: ClassVar[dict[Feature, str]] = {}

    def __init__(self, config: AwsConfig | dict[str, Any] | None = None, **kw: Any):
        super().__init__(config, **kw)
        self._clients: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        self._session: Any = None

    def capabilities(self) -> dict[Feature, str | None]:
        caps = super().capabilities()
        if not self.config.spot_placement_scores:
            caps[Feature.SPOT_AVAILABILITY] = (
                "off by default: set spot_placement_scores: true (needs ec2:GetSpotPlacementScores; "
                "AWS limits the distinct requests per account and day)")
        return caps

    # -- clients ----------------------------------------------------------------------------------

    def _endpoint(self, service: str) -> str | None:
        key = service.upper().replace("-", "_")
        return env_override(f"XROUTE_AWS_ENDPOINT_URL_{key}", "XROUTE_AWS_ENDPOINT_URL") or self.config.endpoint_url

    def _client(self, service: str, region: str) -> Any:
        with self._lock:
            c = self._clients.get((service, region))
            if c is not None:
                return c
            boto3 = require_sdk(PROVIDER, "boto3")
            botocore_config = require_sdk(PROVIDER, "botocore.config")
            if self._session is None:
                self._session = boto3.session.Session(profile_name=self.config.profile)
            cfg = botocore_config.Config(
                retries={"total_max_attempts": 1, "mode": "standard"},
                connect_timeout=self.config.timeout_s, read_timeout=self.config.timeout_s,
                user_agent_extra="xroute-collector",
            )
            c = self._session.client(service, region_name=region, endpoint_url=self._endpoint(service), config=cfg)
            self._clients[(service, region)] = c
            return c

    def api_endpoint(self, region: str) -> tuple[str, int]:
        override = self._endpoint("ec2")
        return host_port(override) if override else (f"ec2.{region}.amazonaws.com", 443)

    def _pages(self, service: str, region: str, operation: str, method: str, token_key: str = "NextToken", *,
               client_region: str | None = None, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """Each page of a paged call, one retried request per page (``client_region``: where the
        service answers, when not in ``region`` itself, as for the Price List API)."""
        client = self._client(service, client_region or region)
        token: str | None = None
        seen: set[str] = set()
        while True:
            args = dict(kwargs)
            if token:
                args[token_key] = token
            page = self.call(operation, region, getattr(client, method), **args)
            yield page
            token = page.get(token_key) or None
            if not token:
                return
            if token in seen:
                raise CloudResponseError(PROVIDER, "the same page token came back twice", region=region,
                                         operation=operation, field=token_key)
            seen.add(token)

    # -- offerings ---------------------------------------------------------------------------------

    def _fetch_offerings(self, region: str) -> list[InstanceOffer]:
        explicit = self.config.instance_types
        filt: dict[str, Any] = {"InstanceTypes": list(explicit)} if explicit else {"Filters": [
            {"Name": "instance-type", "Values": [f"{f}.*" for f in self.config.instance_families]}]}
        found: dict[str, InstanceOffer] = {}
        for page in self._pages("ec2", region, "DescribeInstanceTypes", "describe_instance_types", **filt):
            r = Reader(PROVIDER, region, "DescribeInstanceTypes")
            for i, it in enumerate(r.get(page, "InstanceTypes")):
                p = f"InstanceTypes[{i}]"
                name = r.get(it, "InstanceType", prefix=p)
                gpus = it.get("GpuInfo", {}).get("Gpus", [])
                count = sum(int(r.get(g, "Count", cast=int, prefix=f"{p}.GpuInfo.Gpus[{j}]")) for j, g in enumerate(gpus))
                found[name] = InstanceOffer(
                    provider=PROVIDER, region=region, instance_type=name,
                    accelerator=normalize_accelerator(str(gpus[0].get("Name", ""))) if gpus else "",
                    accelerator_count=count,
                    vcpus=r.get(it, "VCpuInfo", "DefaultVCpus", cast=float, prefix=p),
                    memory_gib=r.get(it, "MemoryInfo", "SizeInMiB", cast=float, prefix=p) / 1024.0,
                )
        # DescribeInstanceTypes lists every type AWS has; keep those offered in this region
        names = sorted(n for n, o in found.items() if self._wanted(o))
        offered: set[str] = set()
        for chunk in range(0, len(names), 100):
            for page in self._pages("ec2", region, "DescribeInstanceTypeOfferings", "describe_instance_type_offerings",
                                    LocationType="region",
                                    Filters=[{"Name": "instance-type", "Values": names[chunk:chunk + 100]}]):
                r = Reader(PROVIDER, region, "DescribeInstanceTypeOfferings")
                for i, o in enumerate(r.get(page, "InstanceTypeOfferings")):
                    offered.add(r.get(o, "InstanceType", prefix=f"InstanceTypeOfferings[{i}]"))
        out = [found[n] for n in names if n in offered]
        return sorted(out, key=lambda o: o.instance_type)

    # -- prices ------------------------------------------------------------------------------------

    def _fetch_on_demand_prices(self, region: str, instance_types: tuple[str, ...]) -> list[PricePoint]:
        wanted = set(instance_types)
        filters = [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in (
            ("regionCode", region), ("operatingSystem", "Linux"), ("tenancy", "Shared"),
            ("preInstalledSw", "NA"), ("capacitystatus", "Used"))]
        if len(wanted) == 1:
            filters.append({"Type": "TERM_MATCH", "Field": "instanceType", "Value": next(iter(wanted))})
        best: dict[str, PricePoint] = {}
        n = 0
        for page in self._pages("pricing", region, "GetProducts", "get_products", client_region=self.config.pricing_region,
                                ServiceCode="AmazonEC2", Filters=filters, FormatVersion="aws_v1", MaxResults=100):
            r = Reader(PROVIDER, region, "GetProducts")
            for raw in r.get(page, "PriceList"):
                field = f"PriceList[{n}]"
                n += 1
                try:
                    item = json.loads(raw) if isinstance(raw, str) else raw
                except json.JSONDecodeError:
                    raise r.error("is not JSON", field) from None
                itype = r.get(item, "product", "attributes", "instanceType", prefix=field)
                if itype not in wanted:
                    continue
                for term_id, term in r.get(item, "terms", "OnDemand", prefix=field).items():
                    for dim_id, dim in r.get(term, "priceDimensions", prefix=f"{field}.terms.OnDemand.{term_id}").items():
                        dp = f"{field}.terms.OnDemand.{term_id}.priceDimensions.{dim_id}"
                        if str(dim.get("unit", "")).lower() not in ("hrs", "hours"):
                            continue
                        usd = r.get(dim, "pricePerUnit", "USD", cast=float, prefix=dp)
                        if usd <= 0:
                            continue
                        eff = parse_ts(term.get("effectiveDate")) or utcnow()
                        old = best.get(itype)
                        if old is None or usd < old.usd_per_hour:
                            best[itype] = PricePoint(eff, PROVIDER, region, itype, "on_demand", usd)
        return [best[t] for t in sorted(best)]

    def _fetch_spot_prices(self, region: str, instance_types: tuple[str, ...], since: datetime | None) -> list[PricePoint]:
        now = utcnow()
        start = since if since is not None else now
        by_type: dict[str, list[tuple[datetime, str, float]]] = defaultdict(list)
        n = 0
        for page in self._pages("ec2", region, "DescribeSpotPriceHistory", "describe_spot_price_history",
                                InstanceTypes=list(instance_types), ProductDescriptions=list(_SPOT_DESCRIPTIONS),
                                StartTime=start, EndTime=now, MaxResults=1000):
            r = Reader(PROVIDER, region, "DescribeSpotPriceHistory")
            for h in r.get(page, "SpotPriceHistory"):
                p = f"SpotPriceHistory[{n}]"
                n += 1
                ts = r.get(h, "Timestamp", prefix=p)
                if not isinstance(ts, datetime):
                    raise r.error("is not a timestamp", f"{p}.Timestamp")
                by_type[r.get(h, "InstanceType", prefix=p)].append(
                    (ts.astimezone(UTC), r.get(h, "AvailabilityZone", prefix=p), r.get(h, "SpotPrice", cast=float, prefix=p)))
        out: list[PricePoint] = []
        for itype in sorted(by_type):
            for ts, usd in cheapest_over_zones(by_type[itype]):
                out.append(PricePoint(ts, PROVIDER, region, itype, "spot", usd, snapshot=since is None))
        return out

    # -- spot availability -------------------------------------------------------------------------

    def _fetch_spot_availability(self, region: str, instance_types: tuple[str, ...]) -> list[AvailabilitySignal]:
        client = self._client("ec2", region)
        out = []
        for t in instance_types:
            resp = self.call("GetSpotPlacementScores", region, client.get_spot_placement_scores,
                             InstanceTypes=[t], TargetCapacity=1, TargetCapacityUnitType="units",
                             SingleAvailabilityZone=False, RegionNames=[region])
            r = Reader(PROVIDER, region, "GetSpotPlacementScores")
            scores = [r.get(s, "Score", cast=int, prefix=f"SpotPlacementScores[{i}]")
                      for i, s in enumerate(r.get(resp, "SpotPlacementScores")) if s.get("Region", region) == region]
            if not scores:
                continue
            score = max(scores)
            out.append(AvailabilitySignal(utcnow(), PROVIDER, region, t, score >= self.config.placement_score_threshold,
                                          f"spot placement score {score}/10"))
        return out

    # -- quotas ------------------------------------------------------------------------------------

    def _fetch_quotas(self, region: str) -> list[QuotaRecord]:
        now = utcnow()
        kept: list[tuple[str, float, dict[str, Any] | None, tuple[str, ...]]] = []
        n = 0
        for page in self._pages("service-quotas", region, "ListServiceQuotas", "list_service_quotas", ServiceCode="ec2"):
            r = Reader(PROVIDER, region, "ListServiceQuotas")
            for q in r.get(page, "Quotas"):
                p = f"Quotas[{n}]"
                n += 1
                metric = q.get("UsageMetric") or {}
                dims = metric.get("MetricDimensions") or {}
                family = str(dims.get("Class", "")).split("/")[0]
                if dims.get("Resource") != "vCPU" or family not in self.config.quota_classes:
                    continue
                kept.append((r.get(q, "QuotaName", prefix=p), r.get(q, "Value", cast=float, prefix=p), metric,
                             quota_covers(region, str(dims.get("Class", "")))))
        usage = self._quota_usage(region, [m for _, _, m, _ in kept])
        return [QuotaRecord(now, PROVIDER, region, name, "vcpus", limit, usage.get(i), covers)
                for i, (name, limit, _, covers) in enumerate(kept)]

    def _quota_usage(self, region: str, metrics: list[dict[str, Any] | None]) -> dict[int, float]:
        """Current usage of each quota from its CloudWatch ``AWS/Usage`` metric; unreadable usage
        is left out (the limit is still reported)."""
        queries = []
        for i, m in enumerate(metrics):
            if not m or not m.get("MetricName"):
                continue
            queries.append({"Id": f"q{i}", "ReturnData": True, "MetricStat": {
                "Metric": {"Namespace": m.get("MetricNamespace", "AWS/Usage"), "MetricName": m["MetricName"],
                           "Dimensions": [{"Name": k, "Value": v} for k, v in (m.get("MetricDimensions") or {}).items()]},
                "Period": 300, "Stat": m.get("MetricStatisticRecommendation") or "Maximum"}})
        if not queries:
            return {}
        end = utcnow()
        try:
            results = self._metric_data(region, queries, end - timedelta(hours=1), end)
        except CloudAuthError:
            return {}
        out: dict[int, float] = {}
        for qid, points in results.items():
            if points:
                out[int(qid[1:])] = max(0.0, points[max(points)])
        return out

    # -- utilization -------------------------------------------------------------------------------

    def _metric_data(self, region: str, queries: list[dict[str, Any]], start: datetime,
                     end: datetime) -> dict[str, dict[datetime, float]]:
        out: dict[str, dict[datetime, float]] = defaultdict(dict)
        for chunk in range(0, len(queries), 500):
            for page in self._pages("cloudwatch", region, "GetMetricData", "get_metric_data",
                                    MetricDataQueries=queries[chunk:chunk + 500], StartTime=start, EndTime=end):
                r = Reader(PROVIDER, region, "GetMetricData")
                for i, res in enumerate(r.get(page, "MetricDataResults")):
                    p = f"MetricDataResults[{i}]"
                    ts = r.get(res, "Timestamps", prefix=p)
                    vals = r.get(res, "Values", prefix=p)
                    for t, v in zip(ts, vals, strict=False):
                        out[r.get(res, "Id", prefix=p)][t.astimezone(UTC)] = float(v)
        return out

    def _fetch_utilization(self, pool: PoolSelector, start: datetime, end: datetime) -> list[UtilizationSample]:
        region = pool.region or ""
        if not region:
            raise CloudError(PROVIDER, "the pool needs a region", operation="utilization", field="region")
        filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in pool.tags.items()]
        filters.append({"Name": "instance-state-name", "Values": ["running"]})
        ids: list[str] = []
        for page in self._pages("ec2", region, "DescribeInstances", "describe_instances", Filters=filters):
            r = Reader(PROVIDER, region, "DescribeInstances")
            for i, res in enumerate(r.get(page, "Reservations")):
                for j, inst in enumerate(r.get(res, "Instances", prefix=f"Reservations[{i}]")):
                    ids.append(r.get(inst, "InstanceId", prefix=f"Reservations[{i}].Instances[{j}]"))
        if not ids:
            return []
        period = self.config.metric_period_s
        queries = []
        for k, iid in enumerate(ids):
            dims = [{"Name": "InstanceId", "Value": iid}]
            queries.append({"Id": f"g{k}", "MetricStat": {"Metric": {
                "Namespace": self.config.gpu_metric_namespace, "MetricName": self.config.gpu_metric_name,
                "Dimensions": dims}, "Period": period, "Stat": "Average"}})
            queries.append({"Id": f"c{k}", "MetricStat": {"Metric": {
                "Namespace": "AWS/EC2", "MetricName": "CPUUtilization", "Dimensions": dims},
                "Period": period, "Stat": "Average"}})
        data = self._metric_data(region, queries, start, end)
        gpu: dict[datetime, list[float]] = defaultdict(list)
        cpu: dict[datetime, list[float]] = defaultdict(list)
        for qid, points in data.items():
            target = gpu if qid.startswith("g") else cpu
            for t, v in points.items():
                target[t].append(v)
        out = []
        for t in sorted(gpu):
            c = cpu.get(t)
            out.append(UtilizationSample(t, pool.offering_id, frac(sum(gpu[t]) / len(gpu[t])),
                                         frac(sum(c) / len(c)) if c else None))
        return out

    # -- inventory and actuation (Auto Scaling groups; tagged instances) -----------------------------

    def _fetch_group(self, pool: PoolGroup) -> GroupState:
        region = pool.region
        if not pool.group:
            return self._tagged_instances(pool)
        resp = self.call("DescribeAutoScalingGroups", region, self._client("autoscaling", region).describe_auto_scaling_groups,
                         AutoScalingGroupNames=[pool.group])
        r = Reader(PROVIDER, region, "DescribeAutoScalingGroups")
        found = r.get(resp, "AutoScalingGroups")
        if not found:
            raise CloudError(PROVIDER, f"groups: no Auto Scaling group '{pool.group}' (pool {pool.label})",
                             region=region, operation="DescribeAutoScalingGroups")
        g = found[0]
        states = [str(r.get(i, "LifecycleState", prefix=f"AutoScalingGroups[0].Instances[{k}]"))
                  for k, i in enumerate(g.get("Instances") or [])]
        return GroupState(pool, desired=r.get(g, "DesiredCapacity", cast=int, prefix="AutoScalingGroups[0]"),
                          running=sum(s in _ASG_RUNNING for s in states),
                          launching=sum(s in _ASG_LAUNCHING for s in states),
                          min_size=r.get(g, "MinSize", cast=int, prefix="AutoScalingGroups[0]"),
                          max_size=r.get(g, "MaxSize", cast=int, prefix="AutoScalingGroups[0]"))

    def _tagged_instances(self, pool: PoolGroup) -> GroupState:
        """A pool found by tags: its running and pending instances (``DescribeInstances``); no group,
        so what it holds is what it wants (``desired`` = running + pending)."""
        region = pool.region
        filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in sorted(pool.tags.items())]
        filters.append({"Name": "instance-state-name", "Values": ["pending", "running"]})
        counts = {"running": 0, "pending": 0}
        for page in self._pages("ec2", region, "DescribeInstances", "describe_instances", Filters=filters):
            r = Reader(PROVIDER, region, "DescribeInstances")
            for i, res in enumerate(r.get(page, "Reservations")):
                for j, inst in enumerate(r.get(res, "Instances", prefix=f"Reservations[{i}]")):
                    state = r.get(inst, "State", "Name", prefix=f"Reservations[{i}].Instances[{j}]")
                    counts[state] = counts.get(state, 0) + 1
        return GroupState(pool, desired=counts["running"] + counts["pending"], running=counts["running"],
                          launching=counts["pending"])

    def _set_group_capacity(self, pool: PoolGroup, desired: int) -> None:
        # HonorCooldown off: the plan's epoch is the pacing, and max_step bounds each change
        self.call_mutation("SetDesiredCapacity", pool.region, self._client("autoscaling", pool.region).set_desired_capacity,
                           AutoScalingGroupName=pool.group, DesiredCapacity=int(desired), HonorCooldown=False)

    # -- errors ------------------------------------------------------------------------------------

    def _translate(self, exc: BaseException, operation: str, region: str | None) -> CloudError | None:
        bx = require_sdk(PROVIDER, "botocore.exceptions")
        kw: dict[str, Any] = {"region": region, "operation": operation}
        if isinstance(exc, bx.ClientError):
            err = exc.response.get("Error", {}) or {}
            meta = exc.response.get("ResponseMetadata", {}) or {}
            code, status = str(err.get("Code", "")), int(meta.get("HTTPStatusCode") or 0)
            problem = f"{code or 'HTTP ' + str(status)}: {str(err.get('Message', ''))[:200]}"
            if code in _THROTTLE_CODES or status == 429:
                return CloudThrottledError(PROVIDER, problem, retry_after=retry_after_seconds(
                    (meta.get("HTTPHeaders") or {}).get("retry-after")), **kw)
            if code in _AUTH_CODES or status in (401, 403):
                return CloudAuthError(PROVIDER, problem, hint=f"allow {IAM_ACTIONS.get(operation, operation)} "
                                      "for the credentials of boto3's standard chain", **kw)
            if code in _UNSUPPORTED_CODES:
                return CloudNotSupportedError(PROVIDER, problem, **kw)
            if code in _UNAVAILABLE_CODES or status >= 500:
                return CloudUnavailableError(PROVIDER, problem, **kw)
            return CloudError(PROVIDER, problem, **kw)
        if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError | bx.NoRegionError):
            return CloudAuthError(PROVIDER, str(exc), hint="configure credentials (env, ~/.aws, SSO or an instance role)", **kw)
        if isinstance(exc, require_sdk(PROVIDER, "botocore.parsers").ResponseParserError):
            return CloudResponseError(PROVIDER, f"the response body could not be parsed ({str(exc).splitlines()[0][:120]})", **kw)
        if isinstance(exc, bx.HTTPClientError | bx.ResponseStreamingError | bx.IncompleteReadError):
            return CloudUnavailableError(PROVIDER, f"{type(exc).__name__}: {str(exc)[:160]}", **kw)
        return None


def cheapest_over_zones(points: list[tuple[datetime, str, float]]) -> list[tuple[datetime, float]]:
    """A region-level price series from per-zone ones: at each change, the cheapest zone's price."""
    current: dict[str, float] = {}
    out: list[tuple[datetime, float]] = []
    for ts, zone, price in sorted(points, key=lambda p: (p[0], p[1])):
        current[zone] = price
        best = min(current.values())
        if out and out[-1][0] == ts:
            out[-1] = (ts, best)
        elif not out or out[-1][1] != best:
            out.append((ts, best))
    return out
