"""Load reported by the pools' own inference servers: their Prometheus metrics, scraped directly.

Where a pool runs an inference server that exposes Prometheus metrics (vLLM's ``/metrics``: the
requests running and waiting, and the share of its KV cache in use), the router reads them every
``inference_scrape_s`` -- as the Kubernetes Gateway API inference extension's endpoint picker
reads its model servers -- instead of waiting for the collector's telemetry, which comes minutes
apart. A pool (``inference_servers``: an offering, optionally a model, and the metrics URL of each
of its servers) reports the sum of its servers' running and waiting requests and the mean of their
KV-cache usage; the engine folds them into its view (``RoutingEngine.apply_server_metrics``, the
formula in ``docs/router.md``). A server that does not answer within ``inference_scrape_timeout_s``
leaves its pool's figures to the others; a pool none of whose servers answered for
``inference_stale_s`` is not reported (the view goes back to the router's own counts).

Metric names are settings (``inference_metrics``), vLLM's by default; a metric a server does not
expose counts as absent (a server with neither running nor waiting reports nothing).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.core.logs import LOG


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """One scrape of one server: requests running, waiting, KV-cache usage (0-1; None: not exposed)."""

    running: float
    waiting: float
    kv_cache: float | None


def parse_metrics(text: str, running: str, waiting: str, kv_cache: str) -> ServerLoad | None:
    """The load in a Prometheus text exposition: the sums of the ``running`` and ``waiting`` gauges
    over their label sets (one per model or engine), the mean of ``kv_cache``; None when neither
    count is there. Raises ``ValueError`` for text that is not an exposition."""
    sums: dict[str, float] = {}
    kv: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (running, waiting):
                sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
            elif sample.name == kv_cache:
                kv.append(float(sample.value))
    if running not in sums and waiting not in sums:
        return None
    return ServerLoad(sums.get(running, 0.0), sums.get(waiting, 0.0), sum(kv) / len(kv) if kv else None)


class InferenceScraper:
    """Scrapes every configured server, combines them per pool, hands the result to the engine."""

    def __init__(self, engine: Any, settings: Any):
        self.engine = engine
        names = settings.inference_metrics
        self.names = (names.running, names.waiting, names.kv_cache)
        self.every = settings.inference_scrape_s
        self.timeout = settings.inference_scrape_timeout_s
        self.stale_s = settings.inference_stale_s
        #: pool key -> its servers' URLs
        self.pools: dict[str, list[str]] = {}
        for server in settings.inference_servers:
            key = engine.pool_key_of(server.offering_id, server.model)
            self.pools.setdefault(key, []).extend(server.endpoints)
        self.last: dict[str, tuple[float, ServerLoad | None]] = {}  # url -> (when, load)
        self.failures: dict[str, str] = {}  # url -> the last error, while it fails

    async def _one(self, client: httpx.AsyncClient, url: str) -> None:
        try:
            resp = await client.get(url)
            resp.raise_for_status()
            load = parse_metrics(resp.text, *self.names)
        except Exception as e:  # whatever one server does wrong is that server's failure, not the scraper's
            why = f"{type(e).__name__}: {e}"[:200]
            if url not in self.failures:
                LOG.warning("inference server metrics unreadable", extra={"fields": {"url": url, "error": why}})
            self.failures[url] = why
            return
        self.failures.pop(url, None)
        self.last[url] = (time.monotonic(), load)

    def combined(self, now: float) -> dict[str, tuple[float, float, float | None]]:
        """Per pool, from its servers' fresh scrapes: (running, waiting, mean KV-cache usage)."""
        out = {}
        for pool, urls in self.pools.items():
            fresh = [load for url in urls if (got := self.last.get(url)) is not None
                     and now - got[0] <= self.stale_s and (load := got[1]) is not None]
            if fresh:
                kv = [x.kv_cache for x in fresh if x.kv_cache is not None]
                out[pool] = (sum(x.running for x in fresh), sum(x.waiting for x in fresh),
                             sum(kv) / len(kv) if kv else None)
        return out

    async def scrape_once(self, client: httpx.AsyncClient) -> dict[str, tuple[float, float, float | None]]:
        await asyncio.gather(*(self._one(client, url) for urls in self.pools.values() for url in urls))
        loads = self.combined(time.monotonic())
        self.engine.apply_server_metrics(loads)
        return loads

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout, headers={"User-Agent": "xroute-router"}) as client:
            while True:
                try:
                    await self.scrape_once(client)
                except Exception as e:  # never stop scraping: the next round may succeed
                    LOG.warning("inference server scrape failed", extra={"fields": {"error": f"{type(e).__name__}: {e}"}})
                await asyncio.sleep(self.every)

    def describe(self) -> dict[str, Any]:
        return {"pools": len(self.pools), "servers": sum(len(u) for u in self.pools.values()),
                "failing": dict(self.failures)}
