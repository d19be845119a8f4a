"""New rows merged into a bundle's tables: offerings upserted in place (their order is the offering
index downstream), step-function tables (prices, availability, quotas) appended with consecutive
repeats dropped, RTT upserted, every table validated against :mod:`xroute.schema.telemetry`; a new
offering that could not be priced or reached (no RTT) is held back rather than written into a
bundle the loader would refuse."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pandas as pd

from cloud_adapters.base import GroupState, UtilizationSample
from cloud_adapters.collect.region import RegionResult
from xroute.bundle import validate_table
from xroute.schema.telemetry import (
    AVAILABILITY,
    INVENTORY,
    OFFERINGS,
    PRICES,
    QUOTAS,
    RTT,
    TABLES,
    UTILIZATION,
    Table,
    location_id,
)


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
class Merged:
    """The merged tables, the rows each gained, and the new rows held back (with why)."""

    tables: dict[str, pd.DataFrame]
    added: dict[str, int]
    held_back: list[str]


def merge(existing: dict[str, pd.DataFrame], regions: list[RegionResult], rtt_rows: list[dict[str, Any]],
          util: list[UtilizationSample], now: datetime,
          inventory: list[tuple[datetime, GroupState]] | None = None) -> Merged:
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
               "limit": q.limit, "usage": q.usage, "covers": ";".join(q.covers) or None}
              for rr in regions for q in rr.quotas]
    q_old = existing.get("quotas")
    if q_rows or q_old is not None:
        q_new = _frame(q_rows, QUOTAS)
        if q_old is not None and "covers" not in q_old.columns:  # (a bundle collected before the column)
            q_old = q_old.assign(covers=None)
        out["quotas"] = _append_steps(q_old, q_new, ["provider", "region", "quota_name"],
                                      ["unit", "limit", "usage", "covers"])
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

    # inventory: a step function per (offering_id, model), like prices
    inv = inventory or []
    i_rows = [{"ts": ts, "offering_id": g.pool.offering_id, "model": g.pool.model, "running": g.running,
               "launching": g.launching} for ts, g in inv if g.pool.offering_id in final_ids]
    held += sorted({f"inventory of {g.pool.label}: {g.pool.offering_id} is not in the offerings table"
                    for _, g in inv if g.pool.offering_id not in final_ids})
    i_old = existing.get("inventory")
    if i_rows or i_old is not None:
        if i_old is not None:
            i_old = i_old.assign(model=i_old["model"].fillna("") if "model" in i_old.columns else "")
        out["inventory"] = _append_steps(i_old, _frame(i_rows, INVENTORY), ["offering_id", "model"],
                                         ["running", "launching"])
        added["inventory"] = len(out["inventory"]) - (len(i_old) if i_old is not None else 0)

    for name, df in out.items():
        out[name] = validate_table(df, TABLES[name], f"{name} (collected)")
    return Merged(out, added, held)
