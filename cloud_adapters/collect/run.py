"""One collection run into a bundle directory (:func:`collect_once`, :class:`Collector`): under the
directory's lock, finish an interrupted commit, read the tables, ask every (provider, region), probe
RTTs and read pools' utilization concurrently within the run's deadline, merge, and commit the
tables with ``collect_log.json`` (the manifest: per-source status, last success, reasons, call
counts; :class:`CollectReport` is one run's record)."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd

from cloud_adapters import registry
from cloud_adapters.base import CloudAdapter, Deadline, GroupState, UtilizationSample, utcnow
from cloud_adapters.collect.commit import commit, read_tables, recover, table_file
from cloud_adapters.collect.config import CollectConfig
from cloud_adapters.collect.lock import dir_lock
from cloud_adapters.collect.merge import Merged, merge
from cloud_adapters.collect.region import STEPS, RegionResult, SourceStatus, collect_region
from cloud_adapters.errors import CloudNotSupportedError
from cloud_adapters.rtt_probe import ProbeResult, parse_target, probe
from xroute.errors import XrouteError
from xroute.schema.telemetry import location_id

log = logging.getLogger(__name__)

MANIFEST = "collect_log.json"
KEEP_RUNS = 50


@dataclass
class CollectReport:
    """The outcome of one run (also appended to ``collect_log.json``)."""

    record: dict[str, Any]

    @property
    def sources(self) -> list[dict[str, Any]]:
        return list(self.record["sources"])

    @property
    def stale(self) -> list[dict[str, Any]]:
        return [s for s in self.sources if s["status"] == "stale"]

    @property
    def ok(self) -> bool:
        """True when no source went stale."""
        return not self.stale

    @property
    def any_ok(self) -> bool:
        return any(s["status"] == "ok" for s in self.sources)

    @property
    def calls(self) -> int:
        return int(sum(self.record["calls"].values()))


def _since(existing: dict[str, pd.DataFrame], provider: str, region: str, default: datetime) -> datetime:
    p = existing.get("prices")
    if p is None or not len(p):
        return default
    prefix = f"{provider}:{region}:"
    mine = p[p["offering_id"].str.startswith(prefix) & p["offering_id"].str.endswith(":spot")]
    if not len(mine):
        return default
    return mine["ts"].max().to_pydatetime()  # type: ignore[no-any-return]


class Collector:
    """Collects into one bundle directory; keeps its adapters (and their caches) between runs."""

    def __init__(self, config: CollectConfig, adapters: dict[str, CloudAdapter] | None = None):
        self.config = config
        self.adapters: dict[str, CloudAdapter] = dict(adapters or {})
        self._adapter_errors: dict[str, str] = {}

    def _adapter(self, name: str) -> CloudAdapter | None:
        if name in self.adapters:
            return self.adapters[name]
        try:
            a = registry.get_adapter(name, self.config.provider_options.get(name))
        except XrouteError as e:
            self._adapter_errors[name] = getattr(e, "reason", str(e))
            return None
        except Exception as e:  # e.g. a settings model refusing a field
            self._adapter_errors[name] = f"{type(e).__name__}: {e}"
            return None
        self.adapters[name] = a
        return a

    def run(self, on_event: Callable[[str, str, str], None] | None = None) -> CollectReport:
        """One collection run. ``on_event(kind, task, detail)`` reports progress: ``plan`` (detail:
        the number of tasks), then ``done`` per task (detail: ok / stale)."""
        cfg = self.config
        root = cfg.out
        root.mkdir(parents=True, exist_ok=True)
        emit = on_event or (lambda *a: None)
        with dir_lock(root):
            recovered = recover(root)
            return self._run_locked(root, emit, recovered)

    def _run_locked(self, root: Path, emit: Callable[[str, str, str], None], recovered: list[str]) -> CollectReport:
        cfg = self.config
        started = utcnow()
        t0 = time.monotonic()
        deadline = Deadline(cfg.deadline_s)
        existing = read_tables(root)
        history_start = started - timedelta(hours=cfg.spot_history_hours)
        statuses: list[SourceStatus] = []
        results: list[RegionResult] = []
        probes: list[ProbeResult] = []
        util: list[UtilizationSample] = []
        inventory: list[tuple[datetime, GroupState]] = []
        calls_before = {n: a.stats.total for n, a in self.adapters.items()}
        retries_before = {n: sum(a.stats.retries.values()) for n, a in self.adapters.items()}

        tasks: dict[Future[Any], tuple[str, str]] = {}
        pool = ThreadPoolExecutor(max_workers=max(1, cfg.concurrency), thread_name_prefix="collect")
        try:
            targets: dict[str, tuple[str, int]] = {}
            for provider in cfg.providers:
                adapter = self._adapter(provider)
                for region in cfg.regions.get(provider, []):
                    loc = location_id(provider, region)
                    if adapter is None:
                        for f, _ in STEPS:
                            statuses.append(SourceStatus(f"{loc}/{f.value}", "stale",
                                                         reason=self._adapter_errors.get(provider, "no adapter")))
                        statuses.append(SourceStatus(f"{loc}/rtt", "skipped", reason="no adapter"))
                        continue
                    adapter.deadline = deadline
                    since = _since(existing, provider, region, history_start)
                    tasks[pool.submit(collect_region, adapter, provider, region, since, deadline)] = ("region", loc)
                    try:
                        targets[loc] = (parse_target(cfg.rtt_targets[loc]) if loc in cfg.rtt_targets
                                        else adapter.api_endpoint(region))
                    except XrouteError as e:
                        statuses.append(SourceStatus(f"{loc}/rtt", "stale", reason=getattr(e, "reason", str(e))))
            for loc, (host, port) in targets.items():
                tasks[pool.submit(probe, host, port, count=cfg.rtt_probes, timeout_s=cfg.rtt_timeout_s,
                                  location=loc)] = ("rtt", loc)
            window_end = started
            window_start = started - timedelta(seconds=cfg.utilization_window_s)
            for sel in cfg.pools:
                adapter = self._adapter(sel.source)
                if adapter is None:
                    statuses.append(SourceStatus(f"{sel.source}:{sel.offering_id}/utilization", "stale",
                                                 reason=self._adapter_errors.get(sel.source, "no adapter")))
                    continue
                adapter.deadline = deadline
                tasks[pool.submit(adapter.utilization, sel, window_start, window_end)] = (
                    "utilization", f"{sel.source}:{sel.offering_id}")
            for provider in cfg.providers:
                adapter = self.adapters.get(provider)
                if adapter is not None and adapter.config.groups:
                    tasks[pool.submit(_inventory, adapter)] = ("inventory", provider)
            emit("plan", "", str(len(tasks)))

            pending = set(tasks)
            while pending and not deadline.expired:
                done, pending = wait(pending, timeout=min(1.0, deadline.remaining()), return_when=FIRST_COMPLETED)
                for fut in done:
                    kind, name = tasks[fut]
                    status = self._harvest(fut, kind, name, statuses, results, probes, util, inventory)
                    emit("done", f"{kind} {name}", status)
            for fut in pending:
                kind, name = tasks[fut]
                fut.cancel()
                what = kind if kind in ("rtt", "utilization", "inventory") else "*"
                statuses.append(SourceStatus(f"{name}/{what}", "stale",
                                             reason=f"the run's deadline ({cfg.deadline_s:g} s) passed"))
                emit("done", f"{kind} {name}", "stale")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

        order = {location_id(p, r): i for i, (p, r) in enumerate(
            (p, r) for p in cfg.providers for r in cfg.regions.get(p, []))}
        results.sort(key=lambda rr: order.get(location_id(rr.provider, rr.region), len(order)))
        probes.sort(key=lambda p: order.get(p.location, len(order)))
        for rr in results:
            statuses.extend(rr.statuses)
        rtt_rows = [{"src": cfg.origin, "dst": p.location, "rtt_ms": round(float(p.rtt_ms), 3),
                     "source": f"tcp-connect-median-of-{len(p.samples_ms)}"} for p in probes if p.rtt_ms is not None]
        merged = merge(existing, results, rtt_rows, util, started, inventory)
        finished = utcnow()
        record = self._record(started, finished, time.monotonic() - t0, statuses, merged, calls_before, retries_before,
                              recovered)
        manifest = self._manifest(root, record)
        suffix = {n: (table_file(root, n).name[len(n):] if table_file(root, n) else cfg.table_format)  # type: ignore[union-attr]
                  for n in merged.tables}
        commit(root, {n: (df, suffix[n]) for n, df in merged.tables.items()},
               {MANIFEST: json.dumps(manifest, indent=1, default=str).encode()})
        return CollectReport(record)

    def _harvest(self, fut: Future[Any], kind: str, name: str, statuses: list[SourceStatus],
                 results: list[RegionResult], probes: list[ProbeResult], util: list[UtilizationSample],
                 inventory: list[tuple[datetime, GroupState]]) -> str:
        try:
            value = fut.result()
        except XrouteError as e:
            unsupported = isinstance(e, CloudNotSupportedError)
            statuses.append(SourceStatus(f"{name}/{kind}", "unsupported" if unsupported else "stale",
                                         reason=getattr(e, "reason", str(e))))
            return "unsupported" if unsupported else "stale"
        except Exception as e:  # an adapter bug must not stop the run
            log.exception("%s %s failed", kind, name)
            statuses.append(SourceStatus(f"{name}/{kind}", "stale", reason=f"internal error {type(e).__name__}: {e}"))
            return "stale"
        if kind == "region":
            results.append(value)
            return "stale" if any(s.status == "stale" for s in value.statuses) else "ok"
        if kind == "rtt":
            probes.append(value)
            if value.ok:
                statuses.append(SourceStatus(f"{name}/rtt", "ok", rows=1))
                return "ok"
            statuses.append(SourceStatus(f"{name}/rtt", "stale", reason=f"no TCP connection to {value.host}:{value.port} "
                                         f"({value.error})"))
            return "stale"
        if kind == "inventory":
            inventory.extend(value)
            statuses.append(SourceStatus(f"{name}/inventory", "ok", rows=len(value)))
            return "ok"
        util.extend(value)
        statuses.append(SourceStatus(f"{name}/utilization", "ok", rows=len(value)))
        return "ok"

    def _record(self, started: datetime, finished: datetime, wall: float, statuses: list[SourceStatus],
                merged: Merged, calls_before: dict[str, int], retries_before: dict[str, int],
                recovered: list[str]) -> dict[str, Any]:
        cfg = self.config
        calls = {n: a.stats.total - calls_before.get(n, 0) for n, a in self.adapters.items()}
        retries = {n: sum(a.stats.retries.values()) - retries_before.get(n, 0) for n, a in self.adapters.items()}
        statuses = sorted(statuses, key=lambda s: s.source)
        return {
            "started": started.isoformat(), "finished": finished.isoformat(), "wall_s": round(wall, 3),
            "deadline_s": cfg.deadline_s, "concurrency": cfg.concurrency, "cores": os.cpu_count(),
            "host": socket.gethostname(), "origin": cfg.origin, "providers": cfg.providers, "regions": cfg.regions,
            "calls": calls, "retries": retries,
            "sources": [s.__dict__ | {"seconds": round(s.seconds, 3)} for s in statuses],
            "stale": [s.source for s in statuses if s.status == "stale"],
            "rows_added": merged.added, "held_back": merged.held_back, "recovered": recovered,
        }

    def _manifest(self, root: Path, record: dict[str, Any]) -> dict[str, Any]:
        path = root / MANIFEST
        old: dict[str, Any] = {}
        if path.is_file():
            try:
                old = json.loads(path.read_text())
            except ValueError:
                old = {}
        sources = dict(old.get("sources", {}))
        for s in record["sources"]:
            prev = sources.get(s["source"], {})
            entry = {"status": s["status"], "last_attempt": record["started"], "reason": s["reason"],
                     "last_ok": record["started"] if s["status"] == "ok" else prev.get("last_ok")}
            sources[s["source"]] = entry
        runs = [*old.get("runs", []), record][-KEEP_RUNS:]
        return {"format": 1, "updated": record["finished"], "sources": sources, "runs": runs}


def _inventory(adapter: CloudAdapter) -> list[tuple[datetime, GroupState]]:
    """What every configured group of ``adapter`` holds, stamped with when it was asked."""
    return [(utcnow(), g) for g in adapter.inventory()]


def collect_once(config: CollectConfig, adapters: dict[str, CloudAdapter] | None = None,
                 on_event: Callable[[str, str, str], None] | None = None) -> CollectReport:
    """One collection run into ``config.out`` (see the module docstring)."""
    return Collector(config, adapters).run(on_event)
