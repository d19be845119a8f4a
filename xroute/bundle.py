"""Load and validate a telemetry bundle (schema: :mod:`xroute.schema.telemetry`).

Validation is hand-written rather than pandera: every failure must become *one* line naming the
file, the row and the column, and several checks span tables (unknown offering ids, unknown
locations, per-offering time order) which column-schema libraries do not express directly.
"""

from __future__ import annotations

import difflib
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from xroute.errors import BundleError
from xroute.resources import bundles_dir, shipped_bundles
from xroute.schema.offering import Offering
from xroute.schema.telemetry import (
    META_FILE,
    REPLACED_COLUMNS,
    TABLE_SUFFIXES,
    TABLES,
    WORKLOAD,
    BundleMeta,
    Column,
    Table,
    location_id,
)

#: the shipped bundle (``data/bundles/default`` in a checkout; package data in an install)
DEFAULT_BUNDLE = bundles_dir() / "default"


def _find_table_file(root: Path, name: str) -> Path | None:
    found = [root / f"{name}{s}" for s in TABLE_SUFFIXES if (root / f"{name}{s}").is_file()]
    if len(found) > 1:
        raise BundleError(str(root), f"table '{name}' is given twice ({', '.join(p.name for p in found)}); keep one")
    return found[0] if found else None


def _read_table(path: Path, table: Table) -> pd.DataFrame:
    try:
        if path.name.endswith(".parquet"):
            df = pd.read_parquet(path)
        else:
            df = pd.read_csv(path, dtype=str, keep_default_na=False)
    except Exception as e:  # pandas/pyarrow raise many types for unreadable files
        raise BundleError(path.name, f"cannot be read as a table ({type(e).__name__}: {e})") from e
    df.columns = [str(c).strip() for c in df.columns]
    return df


def _blank(s: pd.Series) -> np.ndarray:
    if s.dtype == object or pd.api.types.is_string_dtype(s):
        return np.asarray(s.isna() | (s.astype(str).str.strip() == ""), dtype=bool)
    return np.asarray(s.isna(), dtype=bool)


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _coerce_column(df: pd.DataFrame, col: Column, fname: str) -> pd.Series:
    s = df[col.name]
    blank = _blank(s)
    if col.required and blank.any():
        raise BundleError(fname, "is empty (a value is required)", _first(blank) + 1, col.name)
    if col.kind == "str":
        out = s.astype(str).str.strip().where(~blank, "")
        if col.choices is not None:
            bad = ~blank & ~out.isin(col.choices).to_numpy()
            if bad.any():
                i = _first(bad)
                raise BundleError(fname, f"'{out.iloc[i]}' is not one of {', '.join(col.choices)}", i + 1, col.name)
        return out
    if col.kind == "ints":
        return _coerce_ints(s, blank, col, fname)
    if col.kind == "ts":
        text = s.astype(str).str.strip()
        ts = pd.to_datetime(text, utc=True, errors="coerce", format="ISO8601")
        bad = np.asarray(ts.isna(), dtype=bool) & ~blank
        if bad.any():
            i = _first(bad)
            raise BundleError(fname, f"'{text.iloc[i]}' is not an ISO-8601 timestamp", i + 1, col.name)
        return ts
    num = pd.to_numeric(s.where(~blank, None), errors="coerce")
    vals = num.to_numpy(dtype=float)
    notnum = np.isnan(vals) & ~blank
    if notnum.any():
        i = _first(notnum)
        raise BundleError(fname, f"'{s.iloc[i]}' is not a number", i + 1, col.name)
    inf = ~np.isfinite(vals) & ~np.isnan(vals)
    if inf.any():
        i = _first(inf)
        raise BundleError(fname, "is not finite", i + 1, col.name)
    if col.kind in ("int", "flag"):
        frac = ~blank & (vals != np.round(vals))
        if frac.any():
            i = _first(frac)
            raise BundleError(fname, f"'{s.iloc[i]}' is not a whole number", i + 1, col.name)
    if col.kind == "flag":
        bad = ~blank & ~np.isin(vals, (0.0, 1.0))
        if bad.any():
            i = _first(bad)
            raise BundleError(fname, f"'{s.iloc[i]}' must be 0 or 1", i + 1, col.name)
    if col.minimum is not None:
        bad = ~blank & (vals < col.minimum)
        if bad.any():
            i = _first(bad)
            raise BundleError(fname, f"{vals[i]:g} is below the minimum {col.minimum:g}", i + 1, col.name)
    if col.maximum is not None:
        bad = ~blank & (vals > col.maximum)
        if bad.any():
            i = _first(bad)
            raise BundleError(fname, f"{vals[i]:g} is above the maximum {col.maximum:g}", i + 1, col.name)
    return pd.Series(vals, index=s.index)


_I64 = (-(2**63), 2**63 - 1)


def _coerce_ints(s: pd.Series, blank: np.ndarray, col: Column, fname: str) -> pd.Series:
    """An ``ints`` column as one int64 array per row (empty where blank): CSV text of ids
    separated by spaces, or (Parquet) a list of integers."""
    out: list[np.ndarray] = []
    empty = np.zeros(0, dtype=np.int64)
    for i, (v, b) in enumerate(zip(s.tolist(), blank)):
        if b:
            out.append(empty)
            continue
        items = v.split() if isinstance(v, str) else list(v) if isinstance(v, (list, tuple, np.ndarray)) else None
        if items is None:
            raise BundleError(fname, f"'{v}' is not a list of integers (ids separated by spaces)", i + 1, col.name)
        vals = []
        for x in items:
            try:
                iv = int(x) if not isinstance(x, (float, np.floating)) or float(x).is_integer() else None
            except (TypeError, ValueError):
                iv = None
            if iv is None:
                raise BundleError(fname, f"'{x}' is not an integer id", i + 1, col.name)
            if not _I64[0] <= iv <= _I64[1]:
                raise BundleError(fname, f"{iv} is outside the signed 64-bit range", i + 1, col.name)
            vals.append(iv)
        out.append(np.array(vals, dtype=np.int64))
    return pd.Series(out, index=s.index, dtype=object)


def validate_table(df: pd.DataFrame, table: Table, fname: str) -> pd.DataFrame:
    """Check one table against its spec and return it with typed columns (extra columns kept)."""
    missing = [c for c in table.required_columns if c not in df.columns]
    if missing:
        stale = [f"'{c}': {why}" for c, why in REPLACED_COLUMNS.get(table.name, {}).items() if c in df.columns]
        hint = f"; column {stale[0]}" if stale else ""
        raise BundleError(fname, f"missing column(s) {', '.join(missing)} (has: {', '.join(map(str, df.columns))})"
                                 f"{hint}")
    df = df.reset_index(drop=True).copy()
    for col in table.columns:
        if col.name not in df.columns:
            continue
        df[col.name] = _coerce_column(df, col, fname)
    for key in table.unique[:1] if len(table.unique) == 1 else ():
        dup = df[key].duplicated().to_numpy()
        if dup.any():
            i = _first(dup)
            raise BundleError(fname, f"duplicate value '{df[key].iloc[i]}' (must be unique)", i + 1, key)
    if len(table.unique) > 1:
        dup = df.duplicated(list(table.unique)).to_numpy()
        if dup.any():
            i = _first(dup)
            raise BundleError(fname, f"duplicate row for {', '.join(table.unique)}", i + 1, table.unique[0])
    if table.time_column:
        _check_order(df, table, fname)
    return df


def _check_order(df: pd.DataFrame, table: Table, fname: str) -> None:
    tcol = table.time_column
    assert tcol is not None
    t = df[tcol].astype("int64").to_numpy()
    if not table.order_within:
        back = np.flatnonzero(np.diff(t) < 0)
        if back.size:
            i = int(back[0]) + 1
            raise BundleError(fname, f"timestamps out of order ({df[tcol].iloc[i]} comes after {df[tcol].iloc[i - 1]})", i + 1, tcol)
        return
    within = [c for c in table.order_within if c in df.columns]  # (an optional key column may be absent)
    keys = df[within].fillna("").astype(str).agg("\x1f".join, axis=1) if len(within) > 1 else df[within[0]]
    codes, _ = pd.factorize(keys)
    order = np.lexsort((np.arange(len(df)), codes))
    c_sorted, t_sorted = codes[order], t[order]
    back = (np.diff(c_sorted) == 0) & (np.diff(t_sorted) < 0)
    if back.any():
        i = int(order[int(np.flatnonzero(back)[0]) + 1])
        raise BundleError(fname, f"timestamps out of order for {table.order_within[0]} '{keys.iloc[i]}'", i + 1, tcol)


@dataclass
class Bundle:
    """A validated bundle. Tables are pandas frames with typed columns; absent optional tables are
    ``None``. ``offerings`` order defines offering indices everywhere downstream."""

    path: Path
    offerings: pd.DataFrame
    prices: pd.DataFrame
    rtt: pd.DataFrame
    workload: pd.DataFrame
    availability: pd.DataFrame | None = None
    utilization: pd.DataFrame | None = None
    quotas: pd.DataFrame | None = None
    #: measured throughput between locations (``throughput`` table; None when absent)
    throughput: pd.DataFrame | None = None
    #: instances running per pool as the clouds report them (``inventory`` table; None when absent)
    inventory: pd.DataFrame | None = None
    content_hash: str = ""
    extra: dict[str, pd.DataFrame] = field(default_factory=dict)
    #: ``bundle.yaml`` (``xroute.schema.telemetry.BundleMeta``; defaults when the file is absent)
    meta: BundleMeta = field(default_factory=BundleMeta)

    @property
    def has_prefixes(self) -> bool:
        """Whether any request carries its prompt's prefix block hashes (``prefix_hashes``)."""
        w = self.workload
        return "prefix_hashes" in w.columns and any(len(h) for h in w["prefix_hashes"])

    @property
    def offering_ids(self) -> list[str]:
        return list(self.offerings["offering_id"])

    def catalog(self) -> list[Offering]:
        """The offerings as :class:`Offering` objects, in bundle order."""
        out = []
        has_cap = "capacity_replicas" in self.offerings.columns
        has_zone = "zone" in self.offerings.columns
        has_tier = "tier" in self.offerings.columns  # (serving tiers: xroute.catalog_tools.split_tiers)
        for r in self.offerings.itertuples(index=False):
            cap = getattr(r, "capacity_replicas", 0) if has_cap else 0
            out.append(Offering(
                offering_id=r.offering_id, provider=r.provider, region=r.region,
                instance_type=r.instance_type, pricing_mode=r.pricing_mode,
                accelerator=(getattr(r, "accelerator", "") or "") if "accelerator" in self.offerings.columns else "",
                accelerator_count=int(r.accelerator_count), vcpus=float(r.vcpus), memory_gib=float(r.memory_gib),
                zone=(r.zone or "") if has_zone else "",
                capacity_replicas=0 if cap is None or (isinstance(cap, float) and np.isnan(cap)) else int(cap),
                tier=(getattr(r, "tier", "") or "") if has_tier else "",
                max_batch=int(getattr(r, "max_batch", 0) or 0) if has_tier else 0,
            ))
        return out

    def locations(self) -> list[str]:
        return sorted(set(location_id(p, r) for p, r in zip(self.offerings["provider"], self.offerings["region"])))

    def rtt_lookup(self) -> dict[tuple[str, str], float]:
        """RTT in ms by (src, dst); symmetric where only one direction is given."""
        return rtt_lookup(self.rtt)

    def window(self, start: pd.Timestamp | str | None = None, end: pd.Timestamp | str | None = None) -> Bundle:
        """The same telemetry with the workload cut to ``[start, end)``."""
        w = self.workload
        if start is not None:
            w = w[w["ts"] >= to_utc(start)]
        if end is not None:
            w = w[w["ts"] < to_utc(end)]
        if len(w) == 0:
            t0, t1 = self.time_span()
            raise BundleError("workload", f"no requests between {start or 'the start'} and {end or 'the end'}; "
                                          f"this bundle's requests span {t0:%Y-%m-%dT%H:%M:%S}Z .. "
                                          f"{t1:%Y-%m-%dT%H:%M:%S}Z")
        return replace(self, workload=w.reset_index(drop=True))

    def select(self, rows: np.ndarray) -> Bundle:
        """The same telemetry with only the workload rows ``rows`` (a boolean mask or sorted
        positions; arrival order is kept)."""
        w = self.workload.iloc[rows] if rows.dtype != bool else self.workload[rows]
        if len(w) == 0:
            raise BundleError("workload", "the selection holds no requests")
        return replace(self, workload=w.reset_index(drop=True))

    def time_span(self) -> tuple[pd.Timestamp, pd.Timestamp]:
        return self.workload["ts"].iloc[0], self.workload["ts"].iloc[-1]


def output_budget_rule(workload: pd.DataFrame) -> dict[str, int]:
    """The documented ``max_output_tokens`` of a bundle whose workload lacks the column: per
    tenant (the whole stream when there is no tenant column), the smallest power of two at least as
    large as the longest output of that tenant in the bundle -- a service's ``max_tokens`` setting,
    constant per tenant, so no request's own outcome leaks into what the router sees of it."""
    key = workload["tenant"].where(workload["tenant"] != "", "(none)") if "tenant" in workload.columns \
        else pd.Series("(all)", index=workload.index)
    longest = workload["output_tokens"].groupby(key).max()
    return {str(k): int(2 ** max(0, math.ceil(math.log2(max(float(v), 1.0))))) for k, v in longest.items()}


def _with_output_budget(workload: pd.DataFrame, fname: str) -> pd.DataFrame:
    """``max_output_tokens`` filled by :func:`output_budget_rule` where absent or blank, and every
    realized output checked against it (a request cannot generate more than its budget)."""
    w = workload
    have = w["max_output_tokens"].to_numpy(dtype=float) if "max_output_tokens" in w.columns \
        else np.full(len(w), np.nan)
    if np.isnan(have).any():
        rule = output_budget_rule(w)
        key = w["tenant"].where(w["tenant"] != "", "(none)") if "tenant" in w.columns else pd.Series("(all)", index=w.index)
        derived = key.map(rule).to_numpy(dtype=float)
        w = w.copy()
        w["max_output_tokens"] = np.where(np.isnan(have), derived, have)
        w.attrs["max_output_tokens_rule"] = rule
    over = w["output_tokens"].to_numpy(dtype=float) > w["max_output_tokens"].to_numpy(dtype=float)
    if over.any():
        i = _first(over)
        raise BundleError(fname, f"output_tokens {int(w['output_tokens'].iloc[i])} exceeds max_output_tokens "
                                 f"{int(w['max_output_tokens'].iloc[i])}", i + 1, "output_tokens")
    return w


def to_seconds(ts: pd.Series) -> np.ndarray:
    """Timestamps as float seconds since the Unix epoch (whatever resolution pandas picked)."""
    return np.asarray(pd.to_datetime(ts, utc=True).dt.as_unit("ns").astype("int64"), dtype=np.int64) / 1e9


def to_utc(ts: pd.Timestamp | str) -> pd.Timestamp:
    """A timestamp in UTC; naive input is taken as UTC."""
    t = pd.Timestamp(ts)
    return t.tz_localize("UTC") if t.tzinfo is None else t.tz_convert("UTC")


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def rtt_lookup(rtt: pd.DataFrame) -> dict[tuple[str, str], float]:
    """An ``rtt`` table as RTT in ms by (src, dst); symmetric where only one direction is given."""
    d: dict[tuple[str, str], float] = {}
    for s, t, v in zip(rtt["src"], rtt["dst"], rtt["rtt_ms"]):
        d[(s, t)] = float(v)
    for (s, t), v in list(d.items()):
        d.setdefault((t, s), v)
    return d


def throughput_lookup(throughput: pd.DataFrame | None) -> dict[tuple[str, str], float]:
    """A ``throughput`` table as Gbit/s by (src, dst); symmetric where only one direction is given
    (empty without the table)."""
    d: dict[tuple[str, str], float] = {}
    if throughput is None:
        return d
    for s, t, v in zip(throughput["src"], throughput["dst"], throughput["gbps"]):
        d[(s, t)] = float(v)
    for (s, t), v in list(d.items()):
        d.setdefault((t, s), v)
    return d


def origins_reaching(rtt: dict[tuple[str, str], float], locations: Iterable[str],
                     candidates: Iterable[str]) -> list[str]:
    """The ``candidates`` with an RTT to every one of ``locations`` (where requests can come from)."""
    locs = set(locations)
    return sorted(o for o in set(candidates) if all((o, loc) in rtt for loc in locs))


def read_table(root: str | Path, name: str) -> pd.DataFrame | None:
    """One table of the bundle directory ``root``, validated on its own (``None`` when absent)."""
    table = TABLES[name]
    f = _find_table_file(Path(root), name)
    return None if f is None else validate_table(_read_table(f, table), table, f.name)


def bundle_root(ref: str | Path | None) -> Path:
    """The directory a bundle reference names: ``None`` the default shipped bundle; a path as the
    user gave it (relative to the working directory); a bare name that is no directory there, the
    shipped bundle of that name."""
    if ref is None:
        return DEFAULT_BUNDLE
    root = Path(ref).expanduser()
    if not root.exists() and len(root.parts) == 1 and (bundles_dir() / root.name).is_dir():
        return bundles_dir() / root.name
    return root


def load_bundle(path: str | Path | None = None, *, workload: pd.DataFrame | None = None) -> Bundle:
    """Read and validate the bundle at ``path`` (default: the shipped bundle) -- a directory,
    resolved against the working directory, or the name of a shipped bundle (``default``,
    ``feb2024``, ...) where no such directory exists.

    ``workload``: the request table to use when the directory has none (a collector's directory
    served live, see ``router.decision.telemetry.LiveSource``); validated like a file.

    Raises :class:`BundleError` with file, row and column on the first problem found.
    """
    root = bundle_root(path)
    if not root.is_dir():
        raise BundleError(str(root), "is not a directory holding a telemetry bundle (nor the name of a shipped one: "
                          f"{', '.join(shipped_bundles())})")
    frames: dict[str, pd.DataFrame | None] = {}
    fname: dict[str, str] = {}
    digest = hashlib.sha256()
    for name, table in TABLES.items():
        f = _find_table_file(root, name)
        fname[name] = f.name if f is not None else name
        if f is None and name == WORKLOAD.name and workload is not None:
            fname[name] = f"{name} (given)"
            frames[name] = validate_table(workload, table, fname[name])
            digest.update(name.encode())
            digest.update(workload.to_csv(index=False).encode())
            continue
        if f is None:
            if table.required:
                raise BundleError(str(root), f"missing table '{name}' (expected {name}.csv or {name}.parquet)")
            frames[name] = None
            continue
        digest.update(name.encode())
        digest.update(f.read_bytes())
        frames[name] = validate_table(_read_table(f, table), table, f.name)

    offerings, prices, rtt, workload = (frames[n] for n in ("offerings", "prices", "rtt", "workload"))
    assert offerings is not None and prices is not None and rtt is not None and workload is not None
    if len(offerings) == 0:
        raise BundleError(fname["offerings"], "has no offerings")
    if len(workload) == 0:
        raise BundleError(fname["workload"], "has no requests (the workload is empty)")

    known = set(offerings["offering_id"])
    for name in ("prices", "availability", "utilization", "inventory"):
        df = frames[name]
        if df is None:
            continue
        bad = ~df["offering_id"].isin(known).to_numpy()
        if bad.any():
            i = _first(bad)
            oid = df["offering_id"].iloc[i]
            raise BundleError(fname[name], f"unknown offering_id '{oid}'{_suggest(oid, known)}", i + 1, "offering_id")
    unpriced = sorted(known - set(prices["offering_id"]))
    if unpriced:
        raise BundleError(fname["prices"], f"no price for offering(s) {', '.join(unpriced[:5])}")

    locs = set(rtt["src"]) | set(rtt["dst"])
    off_locs = (offerings["provider"] + ":" + offerings["region"]).to_numpy()
    bad = ~np.isin(off_locs, list(locs))
    if bad.any():
        i = _first(bad)
        raise BundleError(fname["offerings"], f"location '{off_locs[i]}' has no RTT rows{_suggest(off_locs[i], locs)}", i + 1, "region")
    bad = ~workload["origin"].isin(locs).to_numpy()
    if bad.any():
        i = _first(bad)
        o = workload["origin"].iloc[i]
        raise BundleError(fname["workload"], f"unknown location '{o}'{_suggest(o, locs)}", i + 1, "origin")
    pairs = set(zip(rtt["src"], rtt["dst"]))
    for o in sorted(set(workload["origin"])):
        for loc in sorted(set(off_locs)):
            if (o, loc) not in pairs and (loc, o) not in pairs:
                raise BundleError(fname["rtt"], f"no RTT between origin '{o}' and offering location '{loc}'")

    tp = frames["throughput"]
    if tp is not None:  # (a KV transfer's throughput between two locations the RTT table knows)
        for col in ("src", "dst"):
            bad = ~tp[col].isin(locs).to_numpy()
            if bad.any():
                i = _first(bad)
                v = tp[col].iloc[i]
                raise BundleError(fname["throughput"], f"unknown location '{v}'{_suggest(v, locs)}", i + 1, col)

    workload = _with_output_budget(workload, fname["workload"])
    meta = read_meta(root)
    if (root / META_FILE).is_file():
        digest.update(META_FILE.encode())
        digest.update((root / META_FILE).read_bytes())
    check_prefixes(workload, meta, fname["workload"])
    return Bundle(path=root, offerings=offerings, prices=prices, rtt=rtt, workload=workload,
                  availability=frames["availability"], utilization=frames["utilization"],
                  quotas=frames["quotas"], throughput=frames["throughput"], inventory=frames["inventory"],
                  content_hash=digest.hexdigest()[:16],
                  meta=meta)


def read_meta(root: Path) -> BundleMeta:
    """The bundle's ``bundle.yaml`` (defaults when absent); a bad file is a :class:`BundleError`
    naming the field."""
    import yaml
    from pydantic import ValidationError

    f = root / META_FILE
    if not f.is_file():
        return BundleMeta()
    try:
        data = yaml.safe_load(f.read_text())
    except yaml.YAMLError as e:
        raise BundleError(META_FILE, f"not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BundleError(META_FILE, "the top level must be a mapping of keys to values")
    try:
        return BundleMeta.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise BundleError(META_FILE, f"field '{where}': {err['msg']}") from None


def check_prefixes(workload: pd.DataFrame, meta: BundleMeta, fname: str) -> None:
    """A workload's ``prefix_hashes`` against the bundle's block size: stated in ``bundle.yaml``
    when any row has hashes, and at most ``ceil(input_tokens / block)`` of them per request."""
    if "prefix_hashes" not in workload.columns:
        return
    counts = np.fromiter((len(h) for h in workload["prefix_hashes"]), dtype=np.int64, count=len(workload))
    if not counts.any():
        return
    if meta.prefix_block_tokens is None:
        raise BundleError(META_FILE, "field 'prefix_block_tokens': required when the workload has prefix_hashes "
                                     "(the block size, in tokens, the hashes were computed with)")
    block = meta.prefix_block_tokens
    most = -(-workload["input_tokens"].to_numpy(dtype=np.int64) // block)
    over = counts > most
    if over.any():
        i = _first(over)
        raise BundleError(fname, f"{counts[i]} block hashes for {int(workload['input_tokens'].iloc[i])} input tokens: "
                                 f"at most ceil(input_tokens / {block}) = {most[i]}", i + 1, "prefix_hashes")


def prefix_arrays(workload: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The workload's ``prefix_hashes`` as CSR arrays: ``offsets`` (len + 1) and ``ids``, request i's
    hashes being ``ids[offsets[i]:offsets[i + 1]]`` (none for every request when the column is absent)."""
    n = len(workload)
    if "prefix_hashes" not in workload.columns:
        return np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    parts = list(workload["prefix_hashes"])
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(h) for h in parts], out=offsets[1:])
    ids = np.concatenate(parts).astype(np.int64) if offsets[-1] else np.zeros(0, dtype=np.int64)
    return offsets, ids
