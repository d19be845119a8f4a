"""Prometheus metrics of one router app (own registry, so several apps can live in one process)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5)
#: a stage takes from ~1 us (a mask) to ~100 us (a learned scorer)
_STAGE_BUCKETS = (1e-6, 2.5e-6, 5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 5e-3)
#: a reported time to first token: 10 ms to a minute
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: one pool's load as :meth:`Metrics.watch_pools` reads it: (offering id, work in flight, slots)
PoolLoad = tuple[str, int, int]


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decision_seconds = LoopHistogram(
            "xroute_router_decision_seconds", "In-process decision time: features, masks, policy (no log write)",
            _LATENCY_BUCKETS, r)
        self.route_seconds = LoopHistogram(
            "xroute_router_route_seconds", "POST /v1/route handler time including the durable log write",
            _LATENCY_BUCKETS, r)
        self.stage_seconds = LoopHistogram(
            "xroute_router_stage_seconds", "Each stage of a decision (router.decision.stages), by stage",
            _STAGE_BUCKETS, r, label="stage")
        self.decisions = LoopCounter("xroute_router_decisions_total", "Decisions by chosen offering and policy kind",
                                     ("offering_id", "policy_kind"), r)
        self.fallbacks = LoopCounter("xroute_router_fallback_decisions_total",
                                     "Decisions made by the fallback policy, by reason", ("reason",), r)
        self.model_info = Gauge("xroute_router_model_info", "1 for the policy deciding now (model or fallback)",
                                ["name", "kind", "version"], registry=r)
        self.model_swaps = Counter("xroute_router_model_swaps_total", "Model versions installed", registry=r)
        self.model_errors = Counter("xroute_router_model_errors_total", "Failed model loads, by stage",
                                    ["stage"], registry=r)
        self.errors = Counter("xroute_router_errors_total", "Error responses (4xx/5xx) by route and status",
                              ["route", "status"], registry=r)
        self.telemetry_age = Gauge("xroute_router_telemetry_age_seconds",
                                   "Seconds since the telemetry cache last refreshed", registry=r)
        self.log_batch = Histogram("xroute_router_log_batch_rows", "Rows per decision-log group commit",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.log_commit_seconds = Histogram("xroute_router_log_commit_seconds", "Group commit duration",
                                            buckets=_LATENCY_BUCKETS, registry=r)
        self.log_checkpoint_seconds = Histogram(
            "xroute_router_log_checkpoint_seconds",
            "WAL checkpoints run between group commits (the next commit waits for each)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.migrations = Counter(
            "xroute_router_migrations_total", "Pool events and session migrations by outcome: events, started, "
            "committed, recomputed (committed without a verified snapshot), missed_window, aborted, rolled_back, "
            "hash_mismatches (docs/migration.md)", ["outcome"], registry=r)
        self.webhooks = Counter(
            "xroute_router_webhooks_total", "Migration webhooks by outcome: delivered, retried (an attempt failed, "
            "another is scheduled), failed (out of attempts, or the tenant no longer has a webhook)", ["outcome"],
            registry=r)
        self.admission_queue = Gauge("xroute_router_admission_queue_length",
                                     "Requests waiting in this process's admission queue (docs/router.md)", registry=r)
        self.admission_wait = Histogram(
            "xroute_router_admission_wait_seconds", "Time a request waited in the admission queue, by how it left: "
            "dispatched, expired (its TTFT budget ran out), left (its client went away), failed",
            ["outcome"], buckets=(1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r)
        self.admission = Counter(
            "xroute_router_admission_total", "Requests admission did not place at once, by band and outcome: shed, "
            "queued, queue_full, then dispatched, expired, left or failed", ["band", "outcome"], registry=r)
        self.outcomes = LoopCounter(
            "xroute_router_outcomes_total", "Decisions' first outcomes (a client's feedback, or the gateway's own "
            "measurement) by tenant, the tenant's priority band and SLO verdict: met, missed, unscored (a completed "
            "request reported without its latency, TTFT or output length)", ("tenant", "band", "slo"), r)
        self.outcome_ttft = LoopHistogram(
            "xroute_router_outcome_ttft_seconds", "The TTFT decisions' first outcomes report, by tenant and the "
            "tenant's priority band", _TTFT_BUCKETS, r, labels=("tenant", "band"))
        self.outcome_cost = LoopCounter(
            "xroute_router_outcome_cost_usd_total", "The cost of decisions' first outcomes (the reported one, else "
            "the decision's expected cost; a failed request's reported one, else 0), by tenant and band",
            ("tenant", "band"), r)
        self.refusals = LoopCounter("xroute_router_refusals_total", "Requests the router refused with a 4xx of "
                                    "its own (router.decision.stages.RouteFailure), by route and error code",
                                    ("route", "error"), r)
        self.quota_refusals = LoopCounter("xroute_router_quota_refusals_total", "Requests refused over a tenant "
                                          "quota, by tenant and limit (requests_per_minute, tokens_per_minute, "
                                          "usd_per_day, concurrency ...)", ("tenant", "limit"), r)
        self.ready = Gauge("xroute_router_ready", "1 while this router is ready (its decision log and shared "
                           "state reachable as last seen: GET /readyz)", registry=r)
        self._pools = _PoolCollector(r)
        self._fallback_codes: dict[str, str] = {}
        self._errors: dict[tuple[str, str], Any] = {}
        self._model: tuple[str, str, str] | None = None

    def decided(self, offering_id: str, kind: str, fallback_reason: str | None) -> None:
        """One decision (on the event loop: the counters are :class:`LoopCounter`)."""
        self.decisions.inc(offering_id, kind)
        if fallback_reason is not None:
            code = self._fallback_codes.get(fallback_reason)
            if code is None:
                if len(self._fallback_codes) > 256:
                    self._fallback_codes.clear()
                code = self._fallback_codes[fallback_reason] = _reason_code(fallback_reason)
            self.fallbacks.inc(code)

    def outcome(self, tenant: str, band: str, missed: bool | None, ttft_ms: float | None, cost_usd: float) -> None:
        """A decision's first outcome (on the event loop: :class:`LoopCounter`, :class:`LoopHistogram`)."""
        self.outcomes.inc(tenant, band, "unscored" if missed is None else ("missed" if missed else "met"))
        if ttft_ms is not None:
            self.outcome_ttft.observe_labels((tenant, band), ttft_ms / 1000.0)
        self.outcome_cost.add(cost_usd, tenant, band)

    def refused(self, route: str, error: str, quota: dict[str, Any] | None) -> None:
        """A refusal (``error``: its code); ``quota``: the limit it hit (``xroute.schema.quota.QuotaHit``'s JSON)."""
        self.refusals.inc(route, error)
        if quota is not None:
            self.quota_refusals.inc(str(quota.get("tenant")), str(quota.get("name")))

    def watch_pools(self, load: Callable[[], Iterable[PoolLoad]]) -> None:
        """Export each pool's work in flight and slots (``xroute_router_pool_in_flight``,
        ``xroute_router_pool_slots``), read from ``load`` at each scrape (nothing on the hot path)."""
        self._pools.load = load

    def watch_watchdog(self, describe: Callable[[], dict[str, Any]]) -> None:
        """Export the champion's watchdog (``router.decision.watchdog``), read from ``describe`` at
        each scrape: ``xroute_watchdog_tripped`` (1 while greedy decides instead of the champion),
        ``xroute_watchdog_estimate`` and ``xroute_watchdog_interval_{lower,upper}`` (champion minus
        greedy, reward units per decision; the confidence sequence's bounds; NaN before an estimate),
        ``xroute_watchdog_decisions`` (the paired terms since the champion was loaded or reset)."""
        r = self.registry

        def read(key: str, k: int = -1) -> Callable[[], float]:
            def get() -> float:
                v = describe().get(key)
                if key == "state":
                    return 1.0 if v == "tripped" else 0.0
                if v is not None and k >= 0:
                    v = v[k]
                return float("nan") if v is None else float(v)
            return get

        for name, doc, key, k in (
                ("xroute_watchdog_tripped", "1 while the watchdog has the router serve greedy instead of the champion",
                 "state", -1),
                ("xroute_watchdog_estimate", "The watchdog's estimate of champion minus greedy (reward per decision)",
                 "estimate", -1),
                ("xroute_watchdog_interval_lower", "The lower bound of the watchdog's confidence sequence", "interval", 0),
                ("xroute_watchdog_interval_upper", "The upper bound of the watchdog's confidence sequence", "interval", 1),
                ("xroute_watchdog_decisions", "Paired decisions since the champion was loaded (or the watchdog reset)",
                 "n", -1)):
            Gauge(name, doc, registry=r).set_function(read(key, k))

    def error(self, route: str, status: int) -> None:
        key = (route, str(status))
        c = self._errors.get(key)
        if c is None:
            c = self._errors[key] = self.errors.labels(*key)
        c.inc()

    def set_model(self, name: str, kind: str, version: str | None) -> None:
        new = (name, kind, version or "")
        if new == self._model:
            return
        if self._model is not None:
            self.model_info.remove(*self._model)
        self.model_info.labels(*new).set(1)
        self._model = new

    def committed(self, rows: int, seconds: float) -> None:
        self.log_batch.observe(rows)
        self.log_commit_seconds.observe(seconds)


class LoopHistogram(Collector):
    """A Prometheus histogram observed from one thread (the event loop): a bisect and two
    additions per observation, no lock (``prometheus_client.Histogram`` locks its sum and its bucket,
    a few times the cost; observed twice per routed request, on the event loop that is the router's
    bottleneck: ``docs/results.md``, "Figures behind the code"). Exported by the same registry, in the same
    format (``_bucket{le=...}`` cumulative, ``_count``, ``_sum``). With ``label``, one histogram per
    value of that label (:meth:`observe_as`).
    A scrape from another thread reads a copy; at worst it sees one observation in ``_count`` and
    not yet in ``_sum``."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry,
                 label: str | None = None, labels: Sequence[str] = ()):
        self.name, self.documentation, self.label = name, documentation, label
        #: several labels instead of one: children keyed by a tuple of values (:meth:`observe_labels`)
        self.labels = tuple(labels) if labels else ((label,) if label is not None else ())
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (le="+Inf" only)
        self.sum = 0.0
        #: label value (a tuple of them with ``labels``) -> [counts, sum]
        self.children: dict[Any, list[Any]] = {}
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # "le": value <= bound
        self.sum += value

    def observe_labels(self, label_values: tuple[str, ...], value: float) -> None:
        """One observation of the child of ``label_values`` (one per name in ``labels``)."""
        self.observe_as(label_values, value)  # type: ignore[arg-type]

    def observe_as(self, label_value: str, value: float) -> None:
        child = self.children.get(label_value)
        if child is None:
            child = self.children[label_value] = [[0] * (len(self.bounds) + 1), 0.0]
        child[0][bisect.bisect_left(self.bounds, value)] += 1
        child[1] += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        if not self.labels:
            family = HistogramMetricFamily(self.name, self.documentation)
            family.add_metric([], self._buckets(list(self.counts)), self.sum)
        else:
            family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
            for value, (counts, total) in list(self.children.items()):
                family.add_metric(list(value) if isinstance(value, tuple) else [value], self._buckets(list(counts)),
                                  total)
        yield family

    def _buckets(self, counts: list[int]) -> list[tuple[str, int]]:
        cumulative = list(itertools.accumulate(counts))
        buckets = [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative)]
        buckets.append(("+Inf", cumulative[-1]))
        return buckets


class LoopCounter(Collector):
    """A labelled Prometheus counter incremented from one thread (the event loop): one dict update
    per increment, no lock (``prometheus_client.Counter`` takes a lock and checks the metric on every
    ``inc``; two counters per routed request). ``counts`` maps a tuple of label values to the count;
    exported by the same registry in the same format as ``prometheus_client.Counter`` (``_total``
    samples; no ``_created``). A scrape from another thread reads a copy."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry):
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.counts: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def inc(self, *labels: str) -> None:
        self.counts[labels] = self.counts.get(labels, 0) + 1

    def add(self, amount: float, *labels: str) -> None:
        """Add ``amount`` (>= 0: a counter never goes down) to the count of ``labels``."""
        if amount > 0:
            self.counts[labels] = self.counts.get(labels, 0) + amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, n in dict(self.counts).items():
            family.add_metric(list(labels), float(n))
        yield family


class _PoolCollector(Collector):
    """Each pool's load as :meth:`Metrics.watch_pools` last named its source, read at scrape time."""

    def __init__(self, registry: CollectorRegistry):
        self.load: Callable[[], Iterable[PoolLoad]] | None = None
        registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        busy = GaugeMetricFamily("xroute_router_pool_in_flight", "Work in flight on each offering's pool of the "
                                 "default model as this router sees it (its own and the shared state's others')",
                                 labels=["offering_id"])
        slots = GaugeMetricFamily("xroute_router_pool_slots", "Each offering's pool's slots (its capacity: "
                                  "concurrent requests it serves without queueing) now", labels=["offering_id"])
        for offering_id, n, cap in (self.load() if self.load is not None else ()):
            busy.add_metric([offering_id], float(n))
            slots.add_metric([offering_id], float(cap))
        yield busy
        yield slots


def _reason_code(reason: str) -> str:
    """A bounded label for a fallback reason (the response carries the full text)."""
    for prefix, code in (("telemetry stale", "stale_telemetry"), ("model error", "model_error"),
                         ("no model", "no_model")):
        if reason.startswith(prefix):
            return code
    return "other"
