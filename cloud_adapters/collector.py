"""The telemetry collector: adapters -> snapshot rows -> appended to a bundle, atomically.

One run (:func:`collect_once`):

1. finishes any commit a crash interrupted (see *Writes*), takes the directory's lock and reads the
   tables already there;
2. asks every (provider, region) concurrently for offerings, on-demand and spot prices (spot price
   history since the last collected point), spot availability and quotas; probes the RTT to each
   region's API endpoint; reads the configured pools' utilization. A provider failing, throttling
   or past the run's deadline does not stop the others: each *source*
   (``provider:region/feature``) ends ``ok``, ``stale`` (with the reason; the bundle keeps its last
   good rows), ``unsupported`` (the capability map's reason) or ``skipped``;
3. merges the new rows into the tables (offerings upserted in place, step-function tables appended
   with consecutive repeats dropped, RTT upserted), validates every table against
   :mod:`xroute.schema.telemetry`, and leaves out any new offering it could not price or reach
   (no RTT) rather than write a bundle the loader would refuse;
4. commits the tables and ``collect_log.json`` (the manifest: per-source status, last success,
   reasons, call counts) in one journaled step.

*Writes*: every file is written to a temporary name in the same directory, flushed and fsynced;
a journal (``.commit.json``) listing the renames is fsynced; then the files are moved into place
with ``os.replace`` (Ctrl-C deferred meanwhile) and the journal removed. A crash before the
journal leaves the old bundle; after it, the next run (or :func:`recover`) completes the renames.
No reader ever sees a half-written table.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from cloud_adapters import registry
from cloud_adapters.base import (
    AvailabilitySignal,
    CloudAdapter,
    Deadline,
    Feature,
    InstanceOffer,
    PoolSelector,
    PricePoint,
    QuotaRecord,
    UtilizationSample,
    utcnow,
)
from cloud_adapters.errors import CloudNotSupportedError
from cloud_adapters.rtt_probe import ProbeResult, parse_target, probe
from xroute.bundle import validate_table
from xroute.errors import BundleError, ConfigError, XrouteError
from xroute.schema.telemetry import (
    AVAILABILITY,
    OFFERINGS,
    PRICES,
    QUOTAS,
    RTT,
    TABLE_SUFFIXES,
    TABLES,
    UTILIZATION,
    Table,
    location_id,
)

log = logging.getLogger(__name__)

MANIFEST = "collect_log.json"
JOURNAL = ".commit.json"
LOCK = ".collect.lock"
TS_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
KEEP_RUNS = 50


class CollectConfig(BaseModel):
    """What one collection run asks for, and its limits."""

    model_config = ConfigDict(extra="forbid")

    providers: list[str]
    #: provider -> its regions
    regions: dict[str, list[str]]
    out: Path
    #: location id of this collector: the ``src`` of the RTT rows (a workload's origin)
    origin: str = "local"
    #: the whole run must end within this many seconds (stale sources otherwise)
    deadline_s: float = 300.0
    concurrency: int = 8
    #: how far back the first collection reads spot price history
    spot_history_hours: float = 24.0
    rtt_probes: int = 5
    rtt_timeout_s: float = 2.0
    #: location id -> ``host[:port]`` to probe instead of the provider's API endpoint
    rtt_targets: dict[str, str] = Field(default_factory=dict)
    pools: list[PoolSelector] = Field(default_factory=list)
    utilization_window_s: float = 600.0
    #: per-adapter settings (``aws: {spot_placement_scores: true}``, ``azure: {subscription_id: ...}``)
    provider_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: file format of tables the directory does not have yet
    table_format: Literal[".csv", ".csv.gz", ".parquet"] = ".csv"


@dataclass
class SourceStatus:
    """How one source fared in a run."""

    source: str
    status: Literal["ok", "stale", "unsupported", "skipped"]
    rows: int = 0
    reason: str = ""
    seconds: float = 0.0


@dataclass
class _RegionResult:
    provider: str
    region: str
    offers: list[InstanceOffer] = field(default_factory=list)
    prices: list[PricePoint] = field(default_factory=list)
    availability: list[AvailabilitySignal] = field(default_factory=list)
    quotas: list[QuotaRecord] = field(default_factory=list)
    statuses: list[SourceStatus] = field(default_factory=list)


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


# -- regions on the command line ----------------------------------------------------------------------


def assign_regions(providers: list[str], regions: list[str]) -> dict[str, list[str]]:
    """Map ``--regions`` to providers: ``provider:region`` goes to that provider; a plain name to
    the one provider whose region names look like it (AWS ``us-east-1``, Azure ``eastus``, GCP
    ``us-central1``). Every provider must end up with at least one region."""
    out: dict[str, list[str]] = {p: [] for p in providers}
    classes = {p: registry.adapter_class(p) for p in providers}
    for r in (x.strip() for x in regions):
        if not r:
            continue
        if ":" in r:
            p, _, name = r.partition(":")
            if p not in out:
                raise ConfigError(f"--regions: '{r}' names provider '{p}', which is not in --providers ({', '.join(providers)})")
            out[p].append(name)
            continue
        fits = [p for p, c in classes.items() if c.REGION_PATTERN.match(r)]
        if len(fits) != 1:
            why = "matches no provider's region names" if not fits else f"could belong to {', '.join(fits)}"
            raise ConfigError(f"--regions: '{r}' {why}; write it as provider:region (e.g. aws:{r})")
        out[fits[0]].append(r)
    empty = [p for p, rs in out.items() if not rs]
    if empty:
        raise ConfigError(f"--regions: no region for {', '.join(empty)}")
    return {p: sorted(set(rs), key=rs.index) for p, rs in out.items()}


# -- reading and writing tables ---------------------------------------------------------------------------


def _table_file(root: Path, name: str) -> Path | None:
    found = [root / f"{name}{s}" for s in TABLE_SUFFIXES if (root / f"{name}{s}").is_file()]
    if len(found) > 1:
        raise BundleError(str(root), f"table '{name}' is given twice ({', '.join(p.name for p in found)}); keep one")
    return found[0] if found else None


def read_tables(root: Path) -> dict[str, pd.DataFrame]:
    """The bundle tables already in ``root`` (validated, typed); absent tables are left out."""
    out = {}
    for name, table in TABLES.items():
        f = _table_file(root, name)
        if f is None:
            continue
        try:
            df = pd.read_parquet(f) if f.name.endswith(".parquet") else pd.read_csv(f, dtype=str, keep_default_na=False)
        except Exception as e:  # pandas raises many types for unreadable files
            raise BundleError(f.name, f"cannot be read as a table ({type(e).__name__}: {e})") from e
        out[name] = validate_table(df, table, f.name)
    return out


def _serialize(df: pd.DataFrame, table: Table) -> pd.DataFrame:
    df = df.copy()
    for col in table.columns:
        if col.name not in df.columns:
            continue
        if col.kind == "ts":
            df[col.name] = pd.to_datetime(df[col.name], utc=True).dt.strftime(TS_FORMAT)
        elif col.kind in ("int", "flag"):
            df[col.name] = pd.to_numeric(df[col.name]).round().astype("Int64")
    return df


def _write_file(path: Path, df: pd.DataFrame | None = None, data: bytes | None = None) -> None:
    if df is not None:
        if path.name.endswith(".parquet.pending"):
            df.to_parquet(path, index=False)
        else:
            df.to_csv(path, index=False, compression="gzip" if ".csv.gz" in path.name else None)
    else:
        assert data is not None
        path.write_bytes(data)
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(root: Path) -> None:
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C until the block ends (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[Any] = []
    old = signal.signal(signal.SIGINT, lambda *a: got.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got:
            raise KeyboardInterrupt


def recover(root: Path) -> list[str]:
    """Finish a commit that a crash interrupted (or discard one that never reached its journal).
    Returns the files moved into place."""
    journal = root / JOURNAL
    moved = []
    if journal.is_file():
        try:
            pending = json.loads(journal.read_text())["pending"]
        except (ValueError, KeyError, TypeError):
            pending = []
        for tmp, final in pending:
            if (root / tmp).is_file():
                os.replace(root / tmp, root / final)
                moved.append(final)
        _fsync_dir(root)
        journal.unlink()
    for stray in root.glob(".*.pending"):
        stray.unlink()
    _fsync_dir(root)
    return moved


def commit(root: Path, tables: dict[str, tuple[pd.DataFrame, str]], files: dict[str, bytes],
           _crash_after: int | None = None) -> None:
    """Write ``tables`` (name -> (frame, suffix)) and ``files`` (name -> bytes) into ``root`` as one
    journaled step. ``_crash_after`` (tests) stops after that many renames, as a crash would."""
    pending: list[tuple[str, str]] = []
    for name, (df, suffix) in tables.items():
        tmp = root / f".{name}{suffix}.pending"
        _write_file(tmp, df=_serialize(df, TABLES[name]))
        pending.append((tmp.name, f"{name}{suffix}"))
    for name, data in files.items():
        tmp = root / f".{name}.pending"
        _write_file(tmp, data=data)
        pending.append((tmp.name, name))
    jtmp = root / f"{JOURNAL}.tmp"
    _write_file(jtmp, data=json.dumps({"pending": pending}).encode())
    with _sigint_deferred():
        os.replace(jtmp, root / JOURNAL)
        _fsync_dir(root)
        for i, (tmp_name, final) in enumerate(pending):
            if _crash_after is not None and i >= _crash_after:
                return
            os.replace(root / tmp_name, root / final)
        _fsync_dir(root)
        (root / JOURNAL).unlink()
        _fsync_dir(root)


@contextlib.contextmanager
def _dir_lock(root: Path) -> Iterator[None]:
    fh = open(root / LOCK, "a+")
    try:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another collector is writing {root} (lock {LOCK})") from None
        yield
    finally:
        fh.close()


# -- merging -------------------------------------------------------------------------------------------------


def _drop_repeats(df: pd.DataFrame, key: list[str], value: list[str]) -> pd.DataFrame:
    """Drop rows whose values equal the previous row of the same key (step functions: lossless)."""
    if df.empty:
        return df
    prev = df.groupby(key, sort=False)[value].shift()
    same = pd.Series(True, index=df.index)
    for v in value:
        a, b = df[v], prev[v]
        same &= (a == b) | (a.isna() & b.isna())
    return df[~same]


def _append_steps(old: pd.DataFrame | None, new: pd.DataFrame, key: list[str], value: list[str]) -> pd.DataFrame:
    df = new if old is None else pd.concat([old, new], ignore_index=True)
    df = df.drop_duplicates([*key, "ts"], keep="last")
    df = df.sort_values("ts", kind="stable").reset_index(drop=True)
    return _drop_repeats(df, key, value).reset_index(drop=True)


def _frame(rows: list[dict[str, Any]], table: Table) -> pd.DataFrame:
    cols = [c.name for c in table.columns]
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=[*cols, "source"])
    if "ts" in df.columns:
        df["ts"] = pd.to_datetime(df["ts"], utc=True)
    return df


@dataclass
class _Merged:
    tables: dict[str, pd.DataFrame]
    added: dict[str, int]
    held_back: list[str]


def merge(existing: dict[str, pd.DataFrame], regions: list[_RegionResult], rtt_rows: list[dict[str, Any]],
          util: list[UtilizationSample], now: datetime) -> _Merged:
    """New rows merged into the existing tables (see the module docstring for the rules)."""
    added: dict[str, int] = {}
    held: list[str] = []
    out: dict[str, pd.DataFrame] = {}

    # rtt: upsert (src, dst)
    rtt_old = existing.get("rtt")
    rtt = _frame(rtt_rows, RTT)
    if rtt_old is not None:
        rtt = pd.concat([rtt_old, rtt], ignore_index=True).drop_duplicates(["src", "dst"], keep="last")
    if len(rtt):
        out["rtt"] = rtt.reset_index(drop=True)
        added["rtt"] = len(rtt_rows)
    reachable = set(rtt["src"]) | set(rtt["dst"]) if len(rtt) else set()

    # prices: snapshot points older than what the table has for that offering move to "now"
    p_old = existing.get("prices")
    last_old = p_old.groupby("offering_id")["ts"].max().to_dict() if p_old is not None else {}
    price_rows = []
    for rr in regions:
        for p in rr.prices:
            ts = pd.Timestamp(p.ts)
            if p.snapshot and p.offering_id in last_old and ts <= last_old[p.offering_id]:
                ts = pd.Timestamp(now)
            price_rows.append({"ts": ts, "offering_id": p.offering_id, "usd_per_hour": p.usd_per_hour,
                               "source": f"{rr.provider}:{'spot' if p.pricing_mode == 'spot' else 'list'}"})
    priced = {r["offering_id"] for r in price_rows} | set(last_old)

    # offerings: upsert in place (order = offering index downstream), new ones appended
    off_old = existing.get("offerings")
    known = set(off_old["offering_id"]) if off_old is not None else set()
    off_rows = []
    for rr in regions:
        for o in rr.offers:
            for mode in ("on_demand", "spot"):
                oid = o.offering_id(mode)
                if oid not in priced:
                    continue
                if oid not in known and location_id(o.provider, o.region) not in reachable:
                    held.append(f"{oid}: no RTT to {location_id(o.provider, o.region)}")
                    continue
                off_rows.append({"offering_id": oid, "provider": o.provider, "region": o.region, "zone": "",
                                 "instance_type": o.instance_type, "accelerator": o.accelerator,
                                 "accelerator_count": o.accelerator_count, "vcpus": o.vcpus,
                                 "memory_gib": o.memory_gib, "pricing_mode": mode})
    off_new = _frame(off_rows, OFFERINGS)
    if off_old is not None and len(off_new):
        upd = off_new.set_index("offering_id")
        merged = off_old.set_index("offering_id")
        hw = [c for c in ("accelerator", "accelerator_count", "vcpus", "memory_gib") if c in merged.columns]
        both = merged.index.intersection(upd.index)
        merged.loc[both, hw] = upd.loc[both, hw].to_numpy()
        fresh = upd.loc[~upd.index.isin(merged.index)].reset_index()
        offerings = pd.concat([merged.reset_index(), fresh[[c for c in fresh.columns if c in merged.columns or
                                                             c == "offering_id"]]], ignore_index=True)
    elif off_old is not None:
        offerings = off_old
    else:
        offerings = off_new
    if len(offerings):
        out["offerings"] = offerings.reset_index(drop=True)
        added["offerings"] = len(offerings) - (len(off_old) if off_old is not None else 0)
    final_ids = set(offerings["offering_id"]) if len(offerings) else set()

    price_rows = [r for r in price_rows if r["offering_id"] in final_ids]
    if price_rows or p_old is not None:
        out["prices"] = _append_steps(p_old, _frame(price_rows, PRICES), ["offering_id"], ["usd_per_hour"])
        added["prices"] = len(out["prices"]) - (len(p_old) if p_old is not None else 0)

    av_rows = [{"ts": a.ts, "offering_id": a.offering_id, "available": int(a.available), "source": a.detail}
               for rr in regions for a in rr.availability if a.offering_id in final_ids]
    a_old = existing.get("availability")
    if av_rows or a_old is not None:
        out["availability"] = _append_steps(a_old, _frame(av_rows, AVAILABILITY), ["offering_id"], ["available"])
        added["availability"] = len(out["availability"]) - (len(a_old) if a_old is not None else 0)

    q_rows = [{"ts": q.ts, "provider": q.provider, "region": q.region, "quota_name": q.quota_name, "unit": q.unit,
               "limit": q.limit, "usage": q.usage} for rr in regions for q in rr.quotas]
    q_old = existing.get("quotas")
    if q_rows or q_old is not None:
        out["quotas"] = _append_steps(q_old, _frame(q_rows, QUOTAS), ["provider", "region", "quota_name"],
                                      ["unit", "limit", "usage"])
        added["quotas"] = len(out["quotas"]) - (len(q_old) if q_old is not None else 0)

    u_rows = [{"ts": u.ts, "offering_id": u.offering_id, "gpu_util": u.gpu_util, "cpu_util": u.cpu_util}
              for u in util if u.offering_id in final_ids]
    held += sorted({f"utilization of {u.offering_id}: not in the offerings table" for u in util
                    if u.offering_id not in final_ids})
    u_old = existing.get("utilization")
    if u_rows or u_old is not None:
        df = _frame(u_rows, UTILIZATION) if u_old is None else pd.concat([u_old, _frame(u_rows, UTILIZATION)],
                                                                           ignore_index=True)
        df = df.drop_duplicates(["offering_id", "ts"], keep="last").sort_values("ts", kind="stable")
        out["utilization"] = df.reset_index(drop=True)
        added["utilization"] = len(df) - (len(u_old) if u_old is not None else 0)

    for name, df in out.items():
        out[name] = validate_table(df, TABLES[name], f"{name} (collected)")
    return _Merged(out, added, held)


# -- collecting ----------------------------------------------------------------------------------------------


_STEPS: list[tuple[Feature, str]] = [
    (Feature.OFFERINGS, "offerings"), (Feature.ON_DEMAND_PRICES, "on_demand_prices"),
    (Feature.SPOT_PRICES, "spot_prices"), (Feature.SPOT_AVAILABILITY, "spot_availability"), (Feature.QUOTAS, "quotas"),
]


def _collect_region(adapter: CloudAdapter, provider: str, region: str, since: datetime,
                    deadline: Deadline) -> _RegionResult:
    rr = _RegionResult(provider, region)

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
        for f, _ in _STEPS[1:]:
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
        with _dir_lock(root):
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
        results: list[_RegionResult] = []
        probes: list[ProbeResult] = []
        util: list[UtilizationSample] = []
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
                        for f, _ in _STEPS:
                            statuses.append(SourceStatus(f"{loc}/{f.value}", "stale",
                                                         reason=self._adapter_errors.get(provider, "no adapter")))
                        statuses.append(SourceStatus(f"{loc}/rtt", "skipped", reason="no adapter"))
                        continue
                    adapter.deadline = deadline
                    since = _since(existing, provider, region, history_start)
                    tasks[pool.submit(_collect_region, adapter, provider, region, since, deadline)] = ("region", loc)
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
            emit("plan", "", str(len(tasks)))

            pending = set(tasks)
            while pending and not deadline.expired:
                done, pending = wait(pending, timeout=min(1.0, deadline.remaining()), return_when=FIRST_COMPLETED)
                for fut in done:
                    kind, name = tasks[fut]
                    status = self._harvest(fut, kind, name, statuses, results, probes, util)
                    emit("done", f"{kind} {name}", status)
            for fut in pending:
                kind, name = tasks[fut]
                fut.cancel()
                what = "rtt" if kind == "rtt" else "utilization" if kind == "utilization" else "*"
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
        merged = merge(existing, results, rtt_rows, util, started)
        finished = utcnow()
        record = self._record(started, finished, time.monotonic() - t0, statuses, merged, calls_before, retries_before,
                              recovered)
        manifest = self._manifest(root, record)
        suffix = {n: (_table_file(root, n).name[len(n):] if _table_file(root, n) else cfg.table_format)  # type: ignore[union-attr]
                  for n in merged.tables}
        commit(root, {n: (df, suffix[n]) for n, df in merged.tables.items()},
               {MANIFEST: json.dumps(manifest, indent=1, default=str).encode()})
        return CollectReport(record)

    def _harvest(self, fut: Future[Any], kind: str, name: str, statuses: list[SourceStatus],
                 results: list[_RegionResult], probes: list[ProbeResult], util: list[UtilizationSample]) -> str:
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
        util.extend(value)
        statuses.append(SourceStatus(f"{name}/utilization", "ok", rows=len(value)))
        return "ok"

    def _record(self, started: datetime, finished: datetime, wall: float, statuses: list[SourceStatus],
                merged: _Merged, calls_before: dict[str, int], retries_before: dict[str, int],
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


def collect_once(config: CollectConfig, adapters: dict[str, CloudAdapter] | None = None,
                 on_event: Callable[[str, str, str], None] | None = None) -> CollectReport:
    """One collection run into ``config.out`` (see the module docstring)."""
    return Collector(config, adapters).run(on_event)


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``10m``, ``2h``, ``1d``."""
    t = text.strip().lower()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if t and t[-1] in units:
            value = float(t[:-1]) * units[t[-1]]
        else:
            value = float(t)
    except ValueError:
        raise ConfigError(f"'{text}' is not a duration (e.g. 30s, 10m, 1h)") from None
    if value <= 0:
        raise ConfigError(f"'{text}': a duration must be positive")
    return value


def collect_every(config: CollectConfig, every_s: float, *, max_runs: int | None = None,
                  on_report: Callable[[CollectReport], None] | None = None,
                  on_event: Callable[[str, str, str], None] | None = None,
                  on_error: Callable[[Exception], None] | None = None,
                  stop: threading.Event | None = None) -> int:
    """Collect every ``every_s`` seconds (start to start) until ``max_runs`` or ``stop``; returns the
    number of runs. When repeating, a run that fails as a whole (the directory locked, a bad table,
    a full disk) goes to ``on_error`` and the loop goes on; a single run raises."""
    collector = Collector(config)
    stop = stop or threading.Event()
    runs = 0
    next_start = time.monotonic()
    while not stop.is_set() and (max_runs is None or runs < max_runs):
        try:
            report = collector.run(on_event)
        except (XrouteError, OSError) as e:
            if max_runs == 1 or on_error is None:
                raise
            on_error(e)
        else:
            if on_report:
                on_report(report)
        runs += 1
        next_start += every_s
        if max_runs is not None and runs >= max_runs:
            break
        stop.wait(max(0.0, next_start - time.monotonic()))
    return runs


__all__ = ["CollectConfig", "CollectReport", "Collector", "SourceStatus", "assign_regions", "collect_every",
           "collect_once", "commit", "merge", "parse_duration", "read_tables", "recover"]

