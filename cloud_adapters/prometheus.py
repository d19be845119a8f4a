"""Pool utilization from a Prometheus server's HTTP API (e.g. NVIDIA's DCGM exporter metrics).

A pool's ``query`` is PromQL returning one series of GPU utilization as a fraction 0-1, default
``avg(DCGM_FI_DEV_GPU_UTIL{<selector>}) / 100``; ``cpu_query`` likewise for CPU (optional, e.g.
``1 - avg(rate(node_cpu_seconds_total{mode="idle",<selector>}[5m]))``). Both are asked with
``/api/v1/query_range`` over the collection window. Values are clipped to 0-1; a query answering
several series is averaged per timestamp.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any, ClassVar

from cloud_adapters.base import (
    AdapterConfig,
    CloudAdapter,
    Feature,
    InstanceOffer,
    PoolSelector,
    PricePoint,
    QuotaRecord,
    Reader,
    UtilizationSample,
    env_override,
    host_port,
    require_sdk,
    retry_after_seconds,
)
from cloud_adapters.errors import (
    CloudAuthError,
    CloudError,
    CloudResponseError,
    CloudThrottledError,
    CloudUnavailableError,
)
from xroute.errors import ConfigError

NAME = "prometheus"


class PrometheusConfig(AdapterConfig):
    """Prometheus settings; a pool's ``url`` overrides ``url``. ``bearer_token_env`` names an
    environment variable holding a token (the token itself never goes in the config)."""

    url: str | None = None
    step_s: int = 60
    bearer_token_env: str | None = None


class PrometheusSource(CloudAdapter):
    """A utilization-only source: everything but :meth:`utilization` is unsupported."""

    name = NAME
    config_class = PrometheusConfig
    config: PrometheusConfig
    UNSUPPORTED: ClassVar[dict[Feature, str]] = {
        f: "Prometheus is a utilization source only" for f in Feature if f is not Feature.UTILIZATION
    }

    def __init__(self, config: PrometheusConfig | dict[str, Any] | None = None, **kw: Any):
        super().__init__(config, **kw)
        self._http: Any = None

    def _client(self) -> Any:
        if self._http is None:
            headers = {"User-Agent": "xroute-collector"}
            if self.config.bearer_token_env:
                token = env_override(self.config.bearer_token_env)
                if token:
                    headers["Authorization"] = f"Bearer {token}"
            self._http = require_sdk(NAME, "httpx").Client(timeout=self.config.timeout_s, headers=headers)
        return self._http

    def _url(self, pool: PoolSelector | None) -> str:
        url = (pool.url if pool and pool.url else None) or env_override("XROUTE_PROMETHEUS_URL") or self.config.url
        if not url:
            raise ConfigError("prometheus: no URL; give the pool a url or set XROUTE_PROMETHEUS_URL")
        return url.rstrip("/")

    def api_endpoint(self, region: str) -> tuple[str, int]:
        return host_port(self._url(None))

    def _query_range(self, pool: PoolSelector, query: str, start: datetime, end: datetime) -> dict[datetime, float]:
        params = {"query": query, "start": f"{start.timestamp():.3f}", "end": f"{end.timestamp():.3f}",
                  "step": f"{self.config.step_s}s"}
        body = self.call("query_range", pool.offering_id, self._get, f"{self._url(pool)}/api/v1/query_range", params)
        r = Reader(NAME, pool.offering_id, "query_range")
        if r.get(body, "status") != "success":
            raise r.error(f"query failed: {body.get('errorType', '')} {body.get('error', '')}".strip(), "status")
        if r.get(body, "data", "resultType") != "matrix":
            raise r.error("expected a matrix (range query)", "data.resultType")
        sums: dict[datetime, list[float]] = defaultdict(list)
        for i, series in enumerate(r.get(body, "data", "result")):
            for j, pair in enumerate(r.get(series, "values", prefix=f"data.result[{i}]")):
                f = f"data.result[{i}].values[{j}]"
                if not isinstance(pair, list) or len(pair) != 2:
                    raise r.error("is not a [time, value] pair", f)
                t = datetime.fromtimestamp(r.get(pair, 0, cast=float, prefix=f), UTC)
                v = r.get(pair, 1, cast=float, prefix=f)
                if math.isfinite(v):
                    sums[t].append(v)
        return {t: sum(v) / len(v) for t, v in sums.items() if v}

    def _get(self, url: str, params: dict[str, str]) -> Any:
        resp = self._client().get(url, params=params)
        resp.raise_for_status()
        return resp.json()

    def _fetch_utilization(self, pool: PoolSelector, start: datetime, end: datetime) -> list[UtilizationSample]:
        gpu = self._query_range(pool, pool.query.replace("{selector}", pool.selector), start, end)
        cpu = self._query_range(pool, pool.cpu_query.replace("{selector}", pool.selector), start, end) \
            if pool.cpu_query else {}
        return [UtilizationSample(t, pool.offering_id, _clip(gpu[t]), _clip(cpu[t]) if t in cpu else None)
                for t in sorted(gpu)]

    def _translate(self, exc: BaseException, operation: str, region: str | None) -> CloudError | None:
        httpx = require_sdk(NAME, "httpx")
        kw: dict[str, Any] = {"region": region, "operation": operation}
        if isinstance(exc, httpx.HTTPStatusError):
            status = exc.response.status_code
            if status == 429:
                return CloudThrottledError(NAME, "HTTP 429", retry_after=retry_after_seconds(
                    exc.response.headers.get("retry-after")), **kw)
            if status in (401, 403):
                return CloudAuthError(NAME, f"HTTP {status}", hint="set bearer_token_env to a variable holding a token", **kw)
            if status >= 500:
                return CloudUnavailableError(NAME, f"HTTP {status}", **kw)
            return CloudError(NAME, f"HTTP {status}: {exc.response.text[:160]}", **kw)
        if isinstance(exc, httpx.TransportError):
            return CloudUnavailableError(NAME, f"{type(exc).__name__}: {str(exc)[:160]}", **kw)
        if isinstance(exc, json.JSONDecodeError):
            return CloudResponseError(NAME, f"the response body is not JSON ({exc.msg} at {exc.pos})", **kw)
        return None

    # a utilization-only source has no catalog
    def _fetch_offerings(self, region: str) -> list[InstanceOffer]:
        raise AssertionError("unsupported")

    def _fetch_on_demand_prices(self, region: str, instance_types: tuple[str, ...]) -> list[PricePoint]:
        raise AssertionError("unsupported")

    def _fetch_spot_prices(self, region: str, instance_types: tuple[str, ...], since: datetime | None) -> list[PricePoint]:
        raise AssertionError("unsupported")

    def _fetch_quotas(self, region: str) -> list[QuotaRecord]:
        raise AssertionError("unsupported")


def _clip(x: float) -> float:
    return min(1.0, max(0.0, x))
