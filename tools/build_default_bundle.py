#!/usr/bin/env python
"""Build the shipped default telemetry bundle (``data/bundles/default``) from the real public data.

    .venv/bin/python tools/build_default_bundle.py --shared ../shared/data --out data/bundles/default

Deterministic: the same inputs give byte-identical output (no clock, no unseeded randomness; every
"random" choice is a SHA-256 hash of a stable id; every table is sorted). Only this builder reads the
shared data; the product reads the bundle it writes. The schema lives in
:mod:`xroute.schema.telemetry`; the decisions and numbers are documented in ``docs/telemetry.md`` and
in the README.md the builder writes next to the tables.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from cloud_adapters.events import spot_notice_s  # noqa: E402
from xroute.bundle import load_bundle, output_budget_rule  # noqa: E402
from xroute.schema.telemetry import (  # noqa: E402
    AVAILABILITY,
    OFFERINGS,
    PRICES,
    RTT,
    THROUGHPUT,
    WORKLOAD,
    location_id,
)

# ----------------------------------------------------------------------------------------- decisions
WORKLOAD_DAY = pd.Timestamp("2023-11-16")

#: tenant -> (file under workload/, TTFT objective ms, TPOT objective ms): the SLO each service promises
TENANTS: dict[str, tuple[str, float, float]] = {
    "code": ("workload/azure_llm_inference_2023_code.csv", 1500.0, 40.0),
    "conv": ("workload/azure_llm_inference_2023_conv.csv", 2500.0, 100.0),
}

#: client locations (a cloud region stands in for the clients near it) and their share of requests
ORIGINS: tuple[tuple[str, float, str], ...] = (
    ("aws:us-east-2", 0.25, "North America (Ohio)"),
    ("gcp:us-west4", 0.20, "North America (Las Vegas)"),
    ("azure:uksouth", 0.20, "Europe (London)"),
    ("aws:eu-central-1", 0.15, "Europe (Frankfurt)"),
    ("azure:koreacentral", 0.10, "Asia (Seoul)"),
    ("gcp:asia-southeast1", 0.10, "Asia (Singapore)"),
)

#: offering regions per cloud: North America, Europe, Asia
REGIONS: dict[str, tuple[str, ...]] = {
    "aws": ("us-east-1", "us-west-2", "eu-west-1", "ap-northeast-1"),
    "azure": ("eastus", "westeurope", "japaneast"),
    "gcp": ("us-central1", "europe-west4", "asia-northeast1"),
}

#: regions of the *unseen catalog* (``--catalog unseen``): none an offering region of ``REGIONS`` nor a
#: client origin, each priced in the same price files; for the check that a trained router copes
#: with offerings it never saw (``xroute evaluate --swap-offerings``)
UNSEEN_REGIONS: dict[str, tuple[str, ...]] = {
    "aws": ("ap-southeast-1",),
    "azure": ("westus2", "northeurope", "southeastasia"),
    "gcp": ("us-east4", "europe-west1", "asia-east1"),
}

#: instance types per cloud: the smallest one-accelerator type of each GPU the cloud sells, or its
#: only (8-GPU) type where no smaller one exists (the env splits it into per-GPU replicas)
INSTANCE_TYPES: dict[str, tuple[str, ...]] = {
    "aws": ("g4dn.xlarge", "g5.xlarge", "p3.2xlarge", "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge"),
    "azure": ("Standard_NC4as_T4_v3", "Standard_NV36ads_A10_v5", "Standard_NC6s_v3", "Standard_NC24ads_A100_v4",
              "Standard_ND96asr_v4", "Standard_ND96isr_H100_v5"),
    "gcp": ("g2-standard-4", "a2-highgpu-1g", "a2-ultragpu-1g", "a3-highgpu-8g"),
}

#: the price file each cloud's rows come from; the row nearest WORKLOAD_DAY is taken
PRICE_FILES: dict[str, str] = {
    "aws": "prices/multicloud_daily_coroot_2023-2024.csv",
    "azure": "prices/multicloud_daily_coroot_2023-2024.csv",
    "gcp": "prices/gcp_weekly_cyclenerd_2022-2026.csv",
}

@dataclass(frozen=True)
class Variant:
    """Another window of the shared data: the price snapshot nearest ``price_date``, other spans
    of the real spot traces (``spot_salt`` re-hashes each offering's start in its trace), another
    client geography (``origin_weights``, same origins) and traffic mix (``keep``: the share of each
    tenant's requests kept, by a hash of the request id). The default variant is the shipped bundle."""

    name: str = "default"
    price_date: str = "2023-11-16"
    spot_salt: str = ""
    origin_weights: tuple[tuple[str, float], ...] = ()
    keep: tuple[tuple[str, float], ...] = ()
    #: the request trace: ``azure`` (the Azure LLM inference hour) or ``mooncake`` (the Mooncake
    #: FAST'25 trace with its KV-cache block hashes: ``build_workload_mooncake``)
    trace: str = "azure"


#: the vendored variants (tools/build_default_bundle.py --variant NAME --out data/bundles/NAME)
VARIANTS: dict[str, Variant] = {
    "default": Variant(),
    "feb2024": Variant("feb2024", price_date="2024-02-20", spot_salt="feb2024",
                       origin_weights=(("aws:us-east-2", 0.10), ("gcp:us-west4", 0.10), ("azure:uksouth", 0.35),
                                       ("aws:eu-central-1", 0.30), ("azure:koreacentral", 0.05),
                                       ("gcp:asia-southeast1", 0.10)),
                       keep=(("code", 1.0), ("conv", 0.6))),
    "mar2024": Variant("mar2024", price_date="2024-03-25", spot_salt="mar2024",
                       origin_weights=(("aws:us-east-2", 0.15), ("gcp:us-west4", 0.10), ("azure:uksouth", 0.10),
                                       ("aws:eu-central-1", 0.10), ("azure:koreacentral", 0.30),
                                       ("gcp:asia-southeast1", 0.25)),
                       keep=(("code", 0.5), ("conv", 1.0))),
    "mooncake": Variant("mooncake", price_date="2024-03-31", spot_salt="mooncake", trace="mooncake"),
    # Asia-heavy clients, as mar2024's, in another window (prices of 2024-01-15, other spot spans): the
    # training mix had no Asia-heavy traffic (docs/results.md, "A training window with Asia-heavy clients")
    "asia": Variant("asia", price_date="2024-01-15", spot_salt="asia",
                       origin_weights=(("aws:us-east-2", 0.15), ("gcp:us-west4", 0.10), ("azure:uksouth", 0.10),
                                       ("aws:eu-central-1", 0.10), ("azure:koreacentral", 0.25),
                                       ("gcp:asia-southeast1", 0.30)),
                       keep=(("code", 0.8), ("conv", 0.8))),
}

#: the Mooncake trace (``trace="mooncake"``): its file, the block size of its hash_ids, when its
#: relative timestamps start (the trace has no date; its prices are the snapshot nearest it), the
#: model it is served with (configs/models.yaml: a long-context deployment) and its SLO rule
MOONCAKE_FILE = "workload/mooncake_fast25_synthetic_trace.jsonl"
MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_START = "2024-03-31T12:00:00Z"
MOONCAKE_MODEL = "llama-3.1-8b"
MOONCAKE_TENANT = "longctx"
#: TTFT objective = base + per prompt token (ms): an interactive second plus 2,000 prompt tokens a second
MOONCAKE_TTFT_BASE_MS = 1000.0
MOONCAKE_TTFT_PER_TOKEN_MS = 0.5
MOONCAKE_TPOT_MS = 100.0

CAPACITY_HEADROOM = 1.5
SPOT_CAPACITY_DIVISOR = 4
DEFAULT_SPOT_COMPRESSION = 12.0
DEFAULT_SELF_RTT_MS = 1.0  # for a region whose matrix has no self-entry (Azure)


# ------------------------------------------------------------------------------------------ helpers
def stable_u64(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256("\x1f".join(parts).encode()).digest()[:8], "big")


def stable_uniform(*parts: str) -> float:
    return stable_u64(*parts) / 2.0**64


def iso(ts: pd.Timestamp) -> str:
    ts = ts.tz_convert("UTC") if ts.tzinfo else ts.tz_localize("UTC")
    return ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def fmt(x: float, digits: int = 6) -> str:
    """A float as short, stable text (rounded, no trailing zeros, no exponent for our ranges)."""
    s = f"{round(float(x), digits):.{digits}f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def write_table(df: pd.DataFrame, path: Path) -> None:
    text = df.to_csv(index=False, lineterminator="\n")
    data = text.encode()
    if path.name.endswith(".gz"):
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
            gz.write(data)
        data = buf.getvalue()
    path.write_bytes(data)


def md_table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- workload
def origins_of(variant: Variant) -> tuple[tuple[str, float, str], ...]:
    """The client origins with the variant's weights (the default's when it sets none)."""
    if not variant.origin_weights:
        return ORIGINS
    w = dict(variant.origin_weights)
    if set(w) != {o for o, _, _ in ORIGINS}:
        raise SystemExit(f"variant {variant.name}: origin_weights must name exactly {[o for o, _, _ in ORIGINS]}")
    return tuple((o, w[o], desc) for o, _, desc in ORIGINS)


def derive_sessions(hashes: list[list[int]]) -> tuple[list[int], int]:
    """Session of each request from the prefix structure alone (the Mooncake trace names none):
    request j continues the latest earlier request i whose prompt blocks, all but its last (which
    may be partial), begin j's -- a conversation's next turn resends the whole previous prompt and
    adds to it -- taking the longest such match; otherwise j opens a session. Returns (each
    request's session number, how many requests continued one)."""
    index: dict[tuple[int, ...], int] = {}
    session: list[int] = []
    opened = cont = 0
    for j, h in enumerate(hashes):
        prev = None
        for n in range(len(h), 0, -1):
            prev = index.get(tuple(h[:n]))
            if prev is not None:
                break
        if prev is None:
            session.append(opened)
            opened += 1
        else:
            session.append(session[prev])
            cont += 1
        if len(h) > 1:
            index[tuple(h[:-1])] = j
        index[tuple(h)] = j
    return session, cont


def mooncake_ttft_ms(input_tokens: np.ndarray) -> np.ndarray:
    return MOONCAKE_TTFT_BASE_MS + MOONCAKE_TTFT_PER_TOKEN_MS * np.asarray(input_tokens, dtype=float)


def build_workload_mooncake(shared: Path, variant: Variant) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The Mooncake FAST'25 synthetic trace, verbatim: its timestamps (ms from the start) from
    ``MOONCAKE_START``, its input and output lengths and its block hashes (``prefix_hashes``), the
    sessions derived from the prefixes (:func:`derive_sessions`), each session's origin drawn by a
    hash of its id. Returns (table to write, typed frame for stats)."""
    import json

    rows = [json.loads(line) for line in (shared / MOONCAKE_FILE).read_text().splitlines() if line.strip()]
    hashes = [[int(x) for x in r["hash_ids"]] for r in rows]
    session, cont = derive_sessions(hashes)
    t0 = pd.Timestamp(MOONCAKE_START)
    w = pd.DataFrame({
        "ts": [t0 + pd.Timedelta(milliseconds=int(r["timestamp"])) for r in rows],
        "request_id": [f"mooncake-{i:06d}" for i in range(len(rows))],
        "tenant": MOONCAKE_TENANT,
        "input_tokens": [int(r["input_length"]) for r in rows],
        "output_tokens": [int(r["output_length"]) for r in rows],
        "session_id": [f"mooncake-s{k:05d}" for k in session],
    })
    w["prefix_hashes"] = hashes
    w.attrs["continued"] = cont
    w = w.sort_values(["ts", "request_id"], kind="mergesort").reset_index(drop=True)
    origins = origins_of(variant)
    cum = np.cumsum([wt for _, wt, _ in origins])
    names = [o for o, _, _ in origins]
    w["origin"] = [names[int(np.searchsorted(cum, stable_uniform("origin", sid), side="right"))]
                   for sid in w["session_id"]]
    w["ttft_ms"] = mooncake_ttft_ms(w["input_tokens"].to_numpy())
    w["tpot_ms"] = MOONCAKE_TPOT_MS
    w["model"] = MOONCAKE_MODEL
    w["max_output_tokens"] = w["tenant"].map(output_budget_rule(w))
    out = pd.DataFrame({
        "ts": [iso(t) for t in w["ts"]], "request_id": w["request_id"], "origin": w["origin"],
        "input_tokens": w["input_tokens"], "max_output_tokens": w["max_output_tokens"],
        "ttft_ms": [fmt(v, 1) for v in w["ttft_ms"]], "tpot_ms": [fmt(v, 1) for v in w["tpot_ms"]],
        "model": w["model"], "output_tokens": w["output_tokens"], "session_id": w["session_id"],
        "tenant": w["tenant"], "prefix_hashes": [" ".join(str(x) for x in h) for h in w["prefix_hashes"]],
    })
    return out, w


def build_workload(shared: Path, variant: Variant = VARIANTS["default"]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both Azure traces merged by timestamp. Returns (table to write, typed frame for stats)."""
    if variant.trace == "mooncake":
        return build_workload_mooncake(shared, variant)
    parts = []
    for tenant, (rel, _, _) in TENANTS.items():
        src = pd.read_csv(shared / rel)
        ts = pd.to_datetime(src["timestamp"], format="%Y-%m-%d %H:%M:%S.%f").dt.tz_localize("UTC")
        parts.append(pd.DataFrame({
            "ts": ts, "request_id": [f"{tenant}-{i:06d}" for i in range(len(src))], "tenant": tenant,
            "input_tokens": src["context_tokens"].astype(int), "output_tokens": src["generated_tokens"].astype(int),
        }))
    w = pd.concat(parts, ignore_index=True).sort_values(["ts", "request_id"], kind="mergesort").reset_index(drop=True)
    if variant.keep:
        share = dict(variant.keep)
        kept = [stable_uniform("keep", variant.name, rid) < share.get(t, 1.0) for rid, t in zip(w["request_id"], w["tenant"])]
        w = w[np.array(kept)].reset_index(drop=True)
    origins = origins_of(variant)
    cum = np.cumsum([wt for _, wt, _ in origins])
    if not math.isclose(cum[-1], 1.0):
        raise SystemExit(f"origin weights sum to {cum[-1]}, not 1")
    names = [o for o, _, _ in origins]
    w["origin"] = [names[int(np.searchsorted(cum, stable_uniform("origin", rid), side="right"))]
                   for rid in w["request_id"]]
    w["ttft_ms"] = w["tenant"].map({t: v[1] for t, v in TENANTS.items()})
    w["tpot_ms"] = w["tenant"].map({t: v[2] for t, v in TENANTS.items()})
    # the traces record what was generated, not the client's max_tokens: the documented per-tenant rule
    w["max_output_tokens"] = w["tenant"].map(output_budget_rule(w))
    out = pd.DataFrame({
        "ts": [iso(t) for t in w["ts"]], "request_id": w["request_id"], "origin": w["origin"],
        "input_tokens": w["input_tokens"], "max_output_tokens": w["max_output_tokens"],
        "ttft_ms": [fmt(v, 1) for v in w["ttft_ms"]], "tpot_ms": [fmt(v, 1) for v in w["tpot_ms"]],
        "output_tokens": w["output_tokens"], "tenant": w["tenant"],
    })
    return out, w


# ------------------------------------------------------------------------------- catalog and prices
@dataclass(frozen=True)
class PricedType:
    provider: str
    region: str
    instance_type: str
    accelerator: str
    accelerator_count: int
    vcpus: float
    memory_gib: float
    on_demand: float
    spot: float | None
    source: str
    snapshot: str


def pick_prices(shared: Path, day: pd.Timestamp = WORKLOAD_DAY,
                regions: dict[str, tuple[str, ...]] | None = None) -> list[PricedType]:
    regions = REGIONS if regions is None else regions
    out: list[PricedType] = []
    frames = {rel: pd.read_csv(shared / rel) for rel in sorted(set(PRICE_FILES.values()))}
    specs = pd.read_csv(shared / "prices/instance_specs.csv")
    for provider in sorted(regions):
        rel = PRICE_FILES[provider]
        df = frames[rel]
        df = df[df["provider"] == provider]
        for region in regions[provider]:
            for itype in INSTANCE_TYPES[provider]:
                rows = df[(df["region"] == region) & (df["instance_type"] == itype)
                          & df["price_on_demand_usd_per_hour"].notna()]
                if rows.empty:
                    continue  # the cloud does not sell this type in this region (in the price file)
                days = (pd.to_datetime(rows["snapshot_date"]) - day).dt.days
                # nearest snapshot; on a tie the earlier one (the price already in effect)
                key = days.abs() * 2 + (days > 0)
                r = rows.loc[key.sort_values(kind="mergesort").index[0]]
                acc, cnt, vcpu, mem = r["accelerator"], r["accelerator_count"], r["vcpus"], r["memory_gib"]
                sp = specs[(specs["provider"] == provider) & (specs["instance_type"] == itype)]
                if not sp.empty:  # fill any gap in the price row from the spec file
                    s = sp.iloc[0]
                    acc = acc if isinstance(acc, str) else s["accelerator"]
                    cnt = cnt if pd.notna(cnt) else s["accelerator_count"]
                    vcpu = vcpu if pd.notna(vcpu) else s["vcpus"]
                    mem = mem if pd.notna(mem) else s["memory_gib"]
                spot = r["price_spot_usd_per_hour"]
                out.append(PricedType(
                    provider, region, itype, str(acc), int(cnt), float(vcpu), float(mem),
                    float(r["price_on_demand_usd_per_hour"]), float(spot) if pd.notna(spot) else None,
                    rel.split("/")[-1], str(r["snapshot_date"])))
    return out


# -------------------------------------------------------------------------------------- capacity
def model_speeds(serving_path: Path, model: str, accelerator: str) -> dict[str, float]:
    """``model`` on one GPU of ``accelerator`` by the rules of configs/models.yaml (envs.serving.place):
    prefill tokens/s, TPOT ms, slots per replica, KV tokens."""
    from envs.serving import load_models, load_serving, place
    from xroute.schema.offering import Offering

    serving = load_serving(str(serving_path))
    models = load_models(str(serving_path.parent / "models.yaml"))
    o = Offering("x", "aws", "r", "i", "on_demand", accelerator, 1, 1.0, 1.0)
    pl = place([o], [1], serving, models, [model])
    return {"prefill_tok_s": float(pl.prefill_tok_s[0, 0]), "tpot_ms": float(pl.tpot_s[0, 0] * 1000.0),
            "max_concurrency": int(pl.conc[0, 0]), "kv_tokens": float(pl.kv_tokens[0, 0])}


def capacity_rule(w: pd.DataFrame, serving: dict, speeds: dict[str, float] | None = None) -> dict[str, float]:
    """Pool sizes from the stream's mean concurrency at the reference accelerator's speed (of the
    stream's model, ``speeds``, when it is not the reference model)."""
    ref = speeds if speeds is not None else serving["accelerators"][serving["reference_accelerator"]]
    service = w["input_tokens"] / ref["prefill_tok_s"] + w["output_tokens"] * ref["tpot_ms"] / 1000.0
    span = (w["ts"].iloc[-1] - w["ts"].iloc[0]).total_seconds()
    mean_conc = float(service.sum() / span)
    od = max(1, math.ceil(CAPACITY_HEADROOM * mean_conc / ref["max_concurrency"]))
    return {"mean_concurrency": mean_conc, "span_s": span, "on_demand": od,
            "spot": max(1, od // SPOT_CAPACITY_DIVISOR), "ref_slots": ref["max_concurrency"],
            "total_service_s": float(service.sum())}


# ------------------------------------------------------------------------------------- spot traces
@dataclass
class Trace:
    key: str          # file:column
    file: str
    column: str
    provider: str
    region: str       # cloud region of the zone
    family: str       # instance family traced (p3, r5, a2, k80, v100)
    t: np.ndarray     # seconds since the trace's start
    v: np.ndarray     # 1.0 available, 0.0 not, nan not measured
    uses: int = 0


def _gcp_zone_region(zone: str) -> str:
    """us-central1-a -> us-central1"""
    return zone.rsplit("-", 1)[0]


def load_traces(shared: Path) -> list[Trace]:
    traces: list[Trace] = []
    wide = [
        ("spot/cbl_aws_p3.2xlarge_availability_2023-02-15_9zones.csv", "aws", "p3"),
        ("spot/cbl_aws_p3.2xlarge_16node_availability_2023-08-27.csv", "aws", "p3"),
        ("spot/cbl_aws_p3.2xlarge_4node_preemption_2023-08-03.csv", "aws", "p3"),
        ("spot/cbl_aws_r5.16xlarge_preemption_2023-04-19.csv", "aws", "r5"),
        ("spot/spothedge_gcp_a2-a100x8_availability_6zones.csv", "gcp", "a2"),
    ]
    for rel, provider, family in wide:
        df = pd.read_csv(shared / rel)
        for col in df.columns:
            if col in ("tick", "t_offset_s") or col.startswith("spot_price"):
                continue
            raw = df[col].to_numpy(dtype=float)
            v = np.where(np.isnan(raw), np.nan, (raw >= 1).astype(float))  # available = N >= 1
            if np.isnan(v).all():
                continue
            region = col[:-1] if provider == "aws" else col.rsplit("-", 1)[0]
            traces.append(Trace(f"{rel.split('/')[-1]}:{col}", rel, col, provider, region, family,
                                df["t_offset_s"].to_numpy(dtype=float), v))
    rel = "spot/aws_use1_gpu_spot_running_state_2020-03.csv"
    df = pd.read_csv(shared / rel)
    df["t"] = pd.to_datetime(df["tick_start_utc"])
    for (zone, acc, gpus), g in sorted(df.groupby(["zone", "accelerator", "gpus_per_instance"]), key=lambda kv: kv[0]):
        g = g.sort_values("t")
        t = (g["t"] - g["t"].iloc[0]).dt.total_seconds().to_numpy()
        v = 1.0 - g["not_running"].to_numpy(dtype=float)  # this file's polarity: 1 = preempted
        traces.append(Trace(f"{rel.split('/')[-1]}:{zone}/{acc}x{gpus}", rel, f"{zone}/{acc}x{gpus}", "aws",
                            zone[:-1], acc, t, v))
    traces.sort(key=lambda tr: tr.key)
    return traces


def valid_starts(tr: Trace, window_s: float) -> np.ndarray:
    """Sample indices where a window of ``window_s`` fits inside the trace with no unmeasured sample."""
    n = len(tr.t)
    end = np.searchsorted(tr.t, tr.t + window_s, side="right")  # first sample after each window
    fits = tr.t + window_s <= tr.t[-1]
    bad = np.concatenate([[0], np.cumsum(np.isnan(tr.v))])
    clean = (bad[end] - bad[np.arange(n)]) == 0
    return np.flatnonzero(fits & clean)


def _changes(tr: Trace) -> int:
    v = tr.v[~np.isnan(tr.v)]
    return int(np.count_nonzero(v[1:] != v[:-1]))


def assign_traces(spot_offerings: list[dict], traces: list[Trace], window_s: float) -> dict[str, Trace]:
    """Each spot offering gets one trace column; the preference order is documented in the README.

    Pass 1, same cloud and region: the traced instance family matching the accelerator first (p3 for
    V100, a2 for GCP A100-class), then the 2023 traces before the 2020 one, then by name; GCP
    A100/A100-80GB/H100 without a same-region zone take any SpotHedge zone. Pass 2, every other
    offering: the least-used column that changes at least once in its trace, same cloud first, then
    by name (round-robin over the remaining columns). A column that never changes (always up or
    always down) serves only its own region.
    """
    usable = [tr for tr in traces if len(valid_starts(tr, window_s))]
    if not usable:
        raise SystemExit(f"no spot trace is long enough for a {window_s / 3600:.1f} h window; "
                         "lower --spot-compression")
    out: dict[str, Trace] = {}
    family = {"V100": ("p3", "v100"), "A100": ("a2",), "A100-80GB": ("a2",), "H100": ("a2",)}
    later = []
    for o in spot_offerings:
        same = [tr for tr in usable if tr.provider == o["provider"] and tr.region == o["region"]]
        if o["provider"] == "gcp" and not same and o["accelerator"] in ("A100", "A100-80GB", "H100"):
            same = [tr for tr in usable if tr.provider == "gcp"]
        if not same:
            later.append(o)
            continue
        fam = family.get(o["accelerator"], ())
        rank = {tr.key: i for i, tr in enumerate(sorted(
            same, key=lambda tr: (tr.family not in fam, "2020" in tr.file, tr.key)))}
        best = min(same, key=lambda tr: (tr.uses, rank[tr.key]))
        best.uses += 1
        out[o["offering_id"]] = best
    varying = [tr for tr in usable if _changes(tr) > 0]
    for o in later:
        best = min(varying, key=lambda tr: (tr.uses, tr.provider != o["provider"], tr.key))
        best.uses += 1
        out[o["offering_id"]] = best
    return out


def build_availability(spot_offerings: list[dict], traces: list[Trace], t0: pd.Timestamp, t1: pd.Timestamp,
                       compression: float, salt: str = "") -> tuple[pd.DataFrame, list[dict]]:
    span = (t1 - t0).total_seconds()
    window = span * compression
    mapping = assign_traces(spot_offerings, traces, window)
    rows, info = [], []
    for o in spot_offerings:
        oid = o["offering_id"]
        tr = mapping[oid]
        starts = valid_starts(tr, window)
        h = stable_u64("spot-offset", oid) if not salt else stable_u64("spot-offset", salt, oid)
        i0 = int(starts[h % len(starts)])
        sel = np.flatnonzero((tr.t >= tr.t[i0]) & (tr.t <= tr.t[i0] + window))
        t_rel, v = tr.t[sel] - tr.t[i0], tr.v[sel]
        change = np.concatenate([[True], v[1:] != v[:-1]])
        for tt, vv in zip(t_rel[change], v[change]):
            ts = t0 + pd.Timedelta(microseconds=round(tt / compression * 1e6))
            rows.append((ts, oid, int(vv), f"{tr.file.split('/')[-1]}:{tr.column}@{tr.t[i0] + tt:.0f}s"))
        info.append({"offering_id": oid, "trace": f"{tr.file.split('/')[-1]}:{tr.column}",
                     "offset_h": tr.t[i0] / 3600, "flips": int(change.sum() - 1),
                     "avail_frac": float(np.mean(v)), "start": int(v[0])})
    df = pd.DataFrame(rows, columns=["ts", "offering_id", "available", "source"])
    df = df.sort_values(["ts", "offering_id"], kind="mergesort").reset_index(drop=True)
    df["ts"] = [iso(t) for t in df["ts"]]
    return df, info


# --------------------------------------------------------------------------------------------- RTT
def load_intra(shared: Path) -> dict[str, dict[tuple[str, str], float]]:
    a = pd.read_csv(shared / "rtt/aws_interregion_rtt_p50_1y_cloudping_ms.csv")
    z = pd.read_csv(shared / "rtt/azure_interregion_rtt_p50_ms.csv")
    g = pd.read_csv(shared / "rtt/gcp_interregion_rtt_median_ms_2023-11-27.csv")
    return {
        "aws": {(s, d): float(v) for s, d, v in zip(a["src_region"], a["dst_region"], a["rtt_p50_ms"]) if pd.notna(v)},
        "azure": {(s, d): float(v) for s, d, v in zip(z["src_region"], z["dst_region"], z["rtt_p50_ms"]) if pd.notna(v)},
        "gcp": {(s, d): float(v) for s, d, v in zip(g["src_region"], g["dst_region"], g["rtt_median_ms"]) if pd.notna(v)},
    }


INTRA_SOURCE = {"aws": "aws-cloudping-p50", "azure": "azure-p50", "gcp": "gcp-median"}


def load_skyplane(shared: Path) -> dict[tuple[str, str], float]:
    s = pd.read_csv(shared / "rtt/skyplane_crosscloud_ping_rtt_2022-04.csv")
    s = s[(s["src_tier"] == "PREMIUM") & (s["dst_tier"] == "PREMIUM") & s["avg_rtt_ms"].notna()]

    def loc(cloud: str, where: str) -> str:
        return location_id(cloud, _gcp_zone_region(where) if cloud == "gcp" else where)

    src = [loc(c, r) for c, r in zip(s["src_cloud"], s["src_region_or_zone"])]
    dst = [loc(c, r) for c, r in zip(s["dst_cloud"], s["dst_region_or_zone"])]
    df = pd.DataFrame({"src": src, "dst": dst, "v": s["avg_rtt_ms"].to_numpy()})
    df = df[df["src"].str.split(":").str[0] != df["dst"].str.split(":").str[0]]
    return {(a, b): float(v) for (a, b), v in df.groupby(["src", "dst"])["v"].median().items()}


def build_rtt(locations: list[str], shared: Path) -> pd.DataFrame:
    intra = load_intra(shared)
    sky = load_skyplane(shared)

    def intra_ms(p: str, r1: str, r2: str) -> float | None:
        if r1 == r2:
            v = intra[p].get((r1, r2))
            return v if v is not None and v > 0 else None
        v = intra[p].get((r1, r2))
        return v if v is not None else intra[p].get((r2, r1))

    def proximity(p: str, r1: str, r2: str) -> float:
        if r1 == r2:
            return 0.0
        v = intra_ms(p, r1, r2)
        return v if v is not None else math.inf

    rows = []
    for a in locations:
        pa, ra = a.split(":", 1)
        for b in locations:
            pb, rb = b.split(":", 1)
            if pa == pb:
                v = intra_ms(pa, ra, rb)
                if v is not None:
                    src = INTRA_SOURCE[pa] + ("" if (ra, rb) in intra[pa] else ":reverse")
                elif ra == rb:
                    v, src = DEFAULT_SELF_RTT_MS, "default:intra-region (no self-entry in the matrix)"
                else:
                    raise SystemExit(f"no intra-cloud RTT for {a} -> {b}")
            elif (a, b) in sky:
                v, src = sky[(a, b)], "skyplane-ping-avg"
            elif (b, a) in sky:
                v, src = sky[(b, a)], "skyplane-ping-avg:reverse"
            else:  # nearest measured proxy pair: same clouds, closest regions by intra-cloud RTT
                cands = []
                for (x, y), val in sky.items():
                    for (p, q) in ((x, y), (y, x)):
                        if p.split(":")[0] == pa and q.split(":")[0] == pb:
                            d = proximity(pa, ra, p.split(":", 1)[1]) + proximity(pb, rb, q.split(":", 1)[1])
                            cands.append((d, p, q, val))
                if not cands:
                    raise SystemExit(f"no skyplane measurement between {pa} and {pb}")
                d, p, q, v = min(cands)
                src = f"estimated:skyplane {p}->{q} (proxy distance {d:.0f} ms)"
            rows.append({"src": a, "dst": b, "rtt_ms": fmt(v, 2), "source": src})
    return pd.DataFrame(rows)


THROUGHPUT_FILE = "rtt/skyplane_crosscloud_iperf3_throughput_2022-01.csv"


def build_throughput(locations: list[str], shared: Path) -> pd.DataFrame:
    """Between every two distinct offering locations Skyplane measured (iperf3, PREMIUM tier at both
    ends, successful runs, GCP zones mapped to their region): the median received throughput in
    Gbit/s, the direction as measured, else the reverse one. Pairs never measured are left out (the
    environment's ``migration.default_throughput_gbps`` covers them)."""
    s = pd.read_csv(shared / THROUGHPUT_FILE)
    ok = s["success"].astype(str).str.lower().isin(["true", "1"])
    s = s[ok & (s["src_tier"] == "PREMIUM") & (s["dst_tier"] == "PREMIUM") & s["throughput_received_bps"].notna()]

    def loc(cloud: str, where: str) -> str:
        return location_id(cloud, _gcp_zone_region(where) if cloud == "gcp" else where)

    df = pd.DataFrame({"src": [loc(c, r) for c, r in zip(s["src_cloud"], s["src_region_or_zone"])],
                       "dst": [loc(c, r) for c, r in zip(s["dst_cloud"], s["dst_region_or_zone"])],
                       "bps": s["throughput_received_bps"].to_numpy(dtype=float)})
    med = {(a, b): float(v) for (a, b), v in df.groupby(["src", "dst"])["bps"].median().items()}
    counts = {(a, b): int(v) for (a, b), v in df.groupby(["src", "dst"]).size().items()}
    rows = []
    for a in locations:
        for b in locations:
            if a == b:
                continue
            if (a, b) in med:
                v, src = med[(a, b)], f"skyplane-iperf3-median ({counts[(a, b)]} runs)"
            elif (b, a) in med:
                v, src = med[(b, a)], f"skyplane-iperf3-median:reverse ({counts[(b, a)]} runs)"
            else:
                continue
            rows.append({"src": a, "dst": b, "gbps": fmt(v / 1e9, 3), "source": src})
    return pd.DataFrame(rows, columns=["src", "dst", "gbps", "source"])


# --------------------------------------------------------------------------------------- the build
def sla_feasibility(w: pd.DataFrame, serving: dict) -> list[list[object]]:
    """Share of requests whose SLO an accelerator meets on average with no queue and no network:
    TTFT = prefill + one token <= ttft_ms, and tpot(k) <= tpot_ms for requests of > 1 token."""
    rows = []
    for acc, s in serving["accelerators"].items():
        cells: list[object] = [acc]
        for k in (1, s["max_concurrency"]):
            tpot = s["tpot_ms"] * (1 + s["tpot_growth"] * (k - 1))
            ttft = w["input_tokens"] / s["prefill_tok_s"] * 1000.0 + tpot
            ok = (ttft <= w["ttft_ms"]) & ((tpot <= w["tpot_ms"]) | (w["output_tokens"] <= 1))
            for tenant in TENANTS:
                m = w["tenant"] == tenant
                cells.append(f"{100 * ok[m].mean():.1f}%")
        rows.append(cells)
    return rows


def build(shared: Path, out: Path, serving_path: Path, compression: float,
          variant: Variant = VARIANTS["default"], catalog: str = "shipped") -> dict:
    """Write the bundle of ``variant`` to ``out``; with ``catalog="unseen"`` only its catalog tables
    (offerings, prices, availability, rtt, throughput) for the regions of ``UNSEEN_REGIONS``, on the
    variant's window and traffic (same capacity rule), with RTT and throughput to the shipped regions
    too -- the donor of ``xroute.catalog_tools.swap_catalog``."""
    unseen = catalog == "unseen"
    if compression <= 0:
        raise SystemExit("--spot-compression must be > 0")
    serving = yaml.safe_load(serving_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():  # leave no stale table of another format behind
        if f.is_file() and (f.suffix in (".csv", ".parquet") or f.name.endswith(".csv.gz")):
            f.unlink()

    for f in (out / "bundle.yaml",):
        if f.is_file():
            f.unlink()
    workload, w = build_workload(shared, variant)
    t0, t1 = w["ts"].iloc[0], w["ts"].iloc[-1]
    speeds = model_speeds(serving_path, MOONCAKE_MODEL, serving["reference_accelerator"]) \
        if variant.trace == "mooncake" else None
    cap = capacity_rule(w, serving, speeds)

    priced = pick_prices(shared, pd.Timestamp(variant.price_date), UNSEEN_REGIONS if unseen else REGIONS)
    offerings, prices = [], []
    price_ts = iso(t0.normalize() - pd.Timedelta(days=1))
    for p in priced:
        for mode, usd in (("on_demand", p.on_demand), ("spot", p.spot)):
            if usd is None:
                continue
            oid = f"{p.provider}:{p.region}:{p.instance_type}:{mode}"
            offerings.append({
                "offering_id": oid, "provider": p.provider, "region": p.region, "instance_type": p.instance_type,
                "accelerator": p.accelerator, "accelerator_count": p.accelerator_count, "vcpus": fmt(p.vcpus),
                "memory_gib": fmt(p.memory_gib), "pricing_mode": mode,
                "capacity_replicas": cap["on_demand"] if mode == "on_demand" else cap["spot"],
                # the notice a spot instance gets before it stops (cloud_adapters.events); none on demand
                "notice_s": fmt(spot_notice_s(p.provider) or 0.0) if mode == "spot" else "",
            })
            prices.append({"ts": price_ts, "offering_id": oid, "usd_per_hour": fmt(usd),
                           "source": f"{p.source}:{p.snapshot}"})
    off = pd.DataFrame(offerings).sort_values("offering_id", kind="mergesort").reset_index(drop=True)
    pr = pd.DataFrame(prices).sort_values("offering_id", kind="mergesort").reset_index(drop=True)
    missing = sorted(set(off["accelerator"]) - set(serving["accelerators"]))
    if missing:
        raise SystemExit(f"{serving_path}: no serving entry for accelerator(s) {', '.join(missing)}")

    spot = off[off["pricing_mode"] == "spot"].to_dict("records")
    avail, avail_info = build_availability(spot, load_traces(shared), t0, t1, compression, variant.spot_salt)

    off_locs = set(location_id(p, r) for p, r in zip(off["provider"], off["region"]))
    if unseen:  # the catalog is swapped into a shipped bundle: also reach (and move KV to) its regions
        off_locs |= {location_id(p, r) for p, rs in REGIONS.items() for r in rs}
    locs = sorted(off_locs | {o for o, _, _ in origins_of(variant)})
    rtt = build_rtt(locs, shared)
    tput = build_throughput(sorted(off_locs), shared)

    # column order exactly as the schema declares, then our extra provenance columns
    off = off[[c.name for c in OFFERINGS.columns if c.name in off.columns]]
    pr = pr[[c.name for c in PRICES.columns] + ["source"]]
    avail = avail[[c.name for c in AVAILABILITY.columns] + ["source"]]
    rtt = rtt[[c.name for c in RTT.columns] + ["source"]]
    tput = tput[[c.name for c in THROUGHPUT.columns] + ["source"]]
    workload = workload[[c.name for c in WORKLOAD.columns if c.name in workload.columns]]

    write_table(off, out / "offerings.csv")
    write_table(pr, out / "prices.csv")
    write_table(avail, out / "availability.csv")
    write_table(rtt, out / "rtt.csv")
    write_table(tput, out / "throughput.csv")
    stats = {"offerings": off, "prices": pr, "avail_info": avail_info, "rtt": rtt, "tput": tput, "w": w, "cap": cap,
             "t0": t0, "t1": t1, "compression": compression, "priced": priced, "serving": serving,
             "locations": locs, "variant": variant, "speeds": speeds, "serving_path": serving_path}
    if unseen:
        (out / "README.md").write_text(catalog_readme(stats))
        # the catalog must pass the product's own validation against the traffic it is built for
        stats["bundle"] = load_bundle(out, workload=workload.drop(columns=["prefix_hashes"], errors="ignore"))
        return stats
    write_table(workload, out / "workload.csv.gz")
    if variant.trace == "mooncake":
        (out / "bundle.yaml").write_text(
            f"# xroute.schema.telemetry.BundleMeta (written by tools/build_default_bundle.py --variant {variant.name})\n"
            f"prefix_block_tokens: {MOONCAKE_BLOCK_TOKENS}\n"
            "description: \"Mooncake FAST'25 synthetic trace (hash_ids = 512-token KV-cache blocks) on real "
            "prices, spot availability and RTT\"\n")

    (out / "README.md").write_text(render_readme(stats))
    bundle = load_bundle(out)  # the builder's output must pass the product's own validation
    stats["bundle"] = bundle
    return stats


# ------------------------------------------------------------------------------------------ README
def catalog_readme(s: dict) -> str:
    off, info, v, comp = s["offerings"], s["avail_info"], s["variant"], s["compression"]
    price_rows = [[p.provider, p.region, p.instance_type, p.accelerator, p.accelerator_count, fmt(p.on_demand),
                   fmt(p.spot) if p.spot is not None else "—", f"{p.source} {p.snapshot}"] for p in s["priced"]]
    av_rows = [[i["offering_id"], i["trace"], f"{i['offset_h']:.2f}", i["flips"], f"{i['avail_frac']:.2f}"]
               for i in info]
    return f"""# Unseen catalog for bundle `{v.name}` — provenance

Written by `tools/build_default_bundle.py` (do not edit by hand; rebuild with
`.venv/bin/python tools/build_default_bundle.py --shared ../shared/data --variant {v.name} --catalog unseen
--out data/catalogs/unseen/{v.name} --spot-compression {comp:g}`). Same inputs ⇒ byte-identical files.

**What it is for.** Offerings in regions that no shipped bundle has an offering in and that are no
client origin ({'; '.join(f"{p}: {', '.join(r)}" for p, r in UNSEEN_REGIONS.items())}), so no
router trained on the shipped bundles has seen them. `xroute evaluate --swap-offerings 0.2` swaps
20 % of bundle `{v.name}`'s offerings for offerings of this catalog (`xroute.catalog_tools.swap_catalog`):
the check that a trained router copes with a catalog it was never trained on, without retraining.

**What it holds.** The catalog tables of the bundle recipe (offerings, prices, availability, rtt,
throughput; no workload: the bundle's own is used), built exactly as bundle `{v.name}`'s: price
snapshots nearest **{v.price_date}**, the same instance types per cloud, pools sized by the same
capacity rule for the same traffic, real spot traces replayed {comp:g}x compressed on the bundle's
window ({iso(s['t0'])} → {iso(s['t1'])}), spot notices from `cloud_adapters/events.py`. `rtt` and
`throughput` cover these regions, the shipped bundles' offering regions and the client origins,
from the same sources and with the same proxy rule as the bundle's (see its README).

{len(off)} offerings ({int((off.pricing_mode == 'on_demand').sum())} on-demand, {int((off.pricing_mode == 'spot').sum())} spot)
in {len(set(off.provider + ':' + off.region))} regions; {len(s['rtt'])} rtt rows; {len(s['tput'])} throughput rows.

## Prices

{md_table(["provider", "region", "instance type", "accelerator", "count", "on-demand $/h", "spot $/h", "source"], price_rows)}

## Spot availability (one real trace column per spot offering)

{md_table(["offering", "trace", "offset h", "changes", "available"], av_rows)}
"""


def render_readme(s: dict) -> str:
    off, pr, w, cap, info, rtt = s["offerings"], s["prices"], s["w"], s["cap"], s["avail_info"], s["rtt"]
    by = off.groupby(["provider", "accelerator", "pricing_mode"]).size().unstack(fill_value=0)
    by_rows = [[p, a, int(r.get("on_demand", 0)), int(r.get("spot", 0))] for (p, a), r in by.iterrows()]
    price_rows = []
    for p in s["priced"]:
        price_rows.append([p.provider, p.region, p.instance_type, p.accelerator, p.accelerator_count, fmt(p.on_demand),
                           fmt(p.spot) if p.spot is not None else "—", f"{p.source} {p.snapshot}"])
    origin_counts = w["origin"].value_counts()
    origin_rows = [[o, f"{wt:.0%}", desc, int(origin_counts.get(o, 0))] for o, wt, desc in origins_of(s["variant"])]
    tenants = [[t, int((w["tenant"] == t).sum()), f"{a:g}", f"{b:g}", int(w.loc[w["tenant"] == t, "max_output_tokens"].iloc[0]),
                int(w.loc[w["tenant"] == t, "input_tokens"].mean()), int(w.loc[w["tenant"] == t, "output_tokens"].mean()),
                int(w.loc[w["tenant"] == t, "output_tokens"].max())]
               for t, (_, a, b) in TENANTS.items()] if s["variant"].trace == "azure" else []
    av_rows = [[i["offering_id"], i["trace"], f"{i['offset_h']:.2f}", i["start"], i["flips"], f"{i['avail_frac']:.2f}"]
               for i in info]
    kinds = rtt["source"].str.split(r"[: ]", regex=True).str[0].value_counts()
    n_est = int(rtt["source"].str.startswith("estimated").sum())
    est_rows = [[r.src, r.dst, r.rtt_ms, r.source] for r in rtt.itertuples() if r.source.startswith("estimated")]
    total_flips = sum(i["flips"] for i in info)
    selfs = rtt[rtt["src"] == rtt["dst"]].assign(p=lambda d: d["src"].str.split(":").str[0], v=lambda d: d["rtt_ms"].astype(float))
    self_rng = "; ".join(f"{p} {g.v.min():g}–{g.v.max():g} ms" for p, g in selfs.groupby("p") if p != "azure")
    span_min = cap["span_s"] / 60
    comp = s["compression"]
    v = s["variant"]
    if v.name == "default":
        title, cmd, vnote = "Default telemetry bundle", f"--out data/bundles/default --spot-compression {comp:g}", ""
    else:
        title = f"Telemetry bundle `{v.name}` (another window of the shared data)"
        cmd = f"--variant {v.name} --out data/bundles/{v.name} --spot-compression {comp:g}"
        vnote = (f"\n**Variant `{v.name}`** of the default bundle's recipe: prices from the snapshots nearest "
                 f"**{v.price_date}** (the row each offering got is in the price table below), other spans of the "
                 f"real spot traces (offsets re-hashed with salt `{v.spot_salt}`), clients weighted as in the origin "
                 f"table, and of each tenant's requests the share " +
                 ", ".join(f"{t} {f:.0%}" for t, f in v.keep) +
                 " kept (by a hash of the request id). Pools are sized for this traffic (capacity rule below). "
                 "The request hour is the same real trace; the text below describes the recipe, "
                 "its tables this bundle.\n")
    text = f"""# {title} — provenance

Written by `tools/build_default_bundle.py` (do not edit by hand; rebuild with
`.venv/bin/python tools/build_default_bundle.py --shared ../shared/data {cmd}`). Same inputs ⇒
byte-identical files. Format: `docs/telemetry.md`;
schema: `xroute/schema/telemetry.py`. Everything below is real public data; the transformations are
listed per table. Extra `source` columns (allowed by the schema) name the input of every row.
{vnote}
Window: **{iso(s['t0'])} → {iso(s['t1'])}** ({span_min:.1f} min), the real hour of Azure's LLM
inference trace. {len(off)} offerings ({int((off.pricing_mode == 'on_demand').sum())} on-demand,
{int((off.pricing_mode == 'spot').sum())} spot) in {len(set(off.provider + ':' + off.region))} regions of 3 clouds;
{len(w)} requests; {len(s['locations'])} locations in `rtt`.

## Sources → tables

| table | source file(s) under shared/data | licence as stated there |
|---|---|---|
| workload.csv.gz | workload/azure_llm_inference_2023_code.csv, workload/azure_llm_inference_2023_conv.csv | CC BY 4.0 (Azure/AzurePublicDataset, AzureLLMInferenceDataset2023) |
| offerings.csv, prices.csv (AWS, Azure) | prices/multicloud_daily_coroot_2023-2024.csv (+ prices/instance_specs.csv for any missing spec) | Apache-2.0 (coroot/cloud-pricing); Infracost terms for values |
| offerings.csv, prices.csv (GCP) | prices/gcp_weekly_cyclenerd_2022-2026.csv | Apache-2.0 (Cyclenerd/google-cloud-pricing-cost-calculator) |
| availability.csv | spot/cbl_aws_p3.2xlarge_availability_2023-02-15_9zones.csv, spot/cbl_aws_p3.2xlarge_16node_availability_2023-08-27.csv, spot/cbl_aws_p3.2xlarge_4node_preemption_2023-08-03.csv, spot/cbl_aws_r5.16xlarge_preemption_2023-04-19.csv (skypilot-org/spot-traces, Can't Be Late), spot/spothedge_gcp_a2-a100x8_availability_6zones.csv (SpotHedge/SkyServe), spot/aws_use1_gpu_spot_running_state_2020-03.csv (Michaelvll/skypilot-spot-strategy) | no licence stated by the sources |
| rtt.csv | rtt/aws_interregion_rtt_p50_1y_cloudping_ms.csv (cloudping), rtt/azure_interregion_rtt_p50_ms.csv (MicrosoftDocs, CC BY 4.0), rtt/gcp_interregion_rtt_median_ms_2023-11-27.csv (Google Cloud Performance Dashboard), rtt/skyplane_crosscloud_ping_rtt_2022-04.csv (skyplane, Apache-2.0) | as listed |
| throughput.csv | {THROUGHPUT_FILE} (skyplane, Apache-2.0) | as listed |
| (offerings' notice_s) | cloud_adapters/events.py (the clouds' documented notices) | — |
| (capacity_replicas, SLA check) | configs/serving.yaml (itself from serving/accelerator_throughput.csv) | see that file |

## workload.csv.gz

- Both traces merged and sorted by timestamp (ties by request_id); timestamps are the trace's own
  (UTC, microseconds). `request_id` = `<tenant>-<row index in its source file, 6 digits>`;
  `tenant` = `code` (code completion) or `conv` (conversation) — two real services.
- `input_tokens` = `context_tokens`, `output_tokens` = `generated_tokens` (the realized outcome, which
  only the simulation of service reads), unchanged.
- `max_output_tokens`: the traces record what was generated, not the client's `max_tokens`; the
  documented rule (`xroute.bundle.output_budget_rule`): per tenant, the smallest power of two at least as
  large as the tenant's longest output. A constant per service, so no request's own outcome leaks
  into what a router sees of it.
- No `model` column: every request is for the default model of `configs/models.yaml`
  (`llama-2-7b`, the model `configs/serving.yaml` measured).
- `origin`: u = first 8 bytes of SHA-256("origin" ␟ request_id) / 2^64, mapped through the cumulative
  weights below (a cloud region stands in for the clients near it; none is an offering region, so no
  cloud gets a free same-region hop).
- SLO per tenant: `ttft_ms` (time to first token) and `tpot_ms` (time per output token after the
  first), stricter for code completion; met when both hold.

{md_table(["tenant", "requests", "ttft_ms", "tpot_ms", "max_output_tokens", "mean input", "mean output", "longest output"], tenants)}

{md_table(["origin", "weight", "stands for", "requests"], origin_rows)}

SLO feasibility from `configs/serving.yaml` alone (TTFT = input/prefill + one token, TPOT = tpot(k);
no queueing, no network, no noise; RTT adds 1–250 ms to TTFT), share of requests meeting both:

{md_table(["accelerator", "code, k=1", "conv, k=1", "code, k=slots", "conv, k=slots"], sla_feasibility(w, s['serving'])) if tenants else ""}

## offerings.csv and prices.csv

- Regions: {'; '.join(f"{p}: {', '.join(r)}" for p, r in REGIONS.items())} (North America, Europe, Asia).
- Instance types: the smallest single-GPU type of each GPU the cloud sells in the price file, or its
  only 8-GPU type (p4d/p4de/p5, ND96asr_v4, ND96isr_H100_v5, a3-highgpu-8g; the env treats an n-GPU
  instance as n one-GPU replicas at price/n). A type absent from a region's price rows is not offered
  there. AWS has no L4 (g6 launched 2024) and GCP's T4/V100 are attachable GPUs priced only in a 2025
  file, so they are left out.
- `offering_id` = `provider:region:instance_type:pricing_mode`; a spot offering exists where the row
  has a spot price (p4de has none). `accelerator_count`, `vcpus`, `memory_gib` from the same price row.
- Price: per (provider, region, instance type) the row of the cloud's price file whose snapshot is
  nearest {WORKLOAD_DAY.date()} (ties: the earlier). AWS/Azure: coroot 2023-11-21 (5 days after), except
  Azure ND96isr_H100_v5, first listed 2024-01-09. GCP: Cyclenerd's 2023-10-26 row set, in effect on the
  day (its next change is 2024-01-26), except a3-highgpu-8g, first listed 2024-05-17. On-demand rows use
  the on-demand column, spot rows the spot column.
- One price row per offering at {pr['ts'].iloc[0]} (00:00 UTC the day before the workload): a step
  function that holds through the hour. No intraday variation is invented.
- `capacity_replicas`: mean concurrency of the whole stream at A10G speed (Little's law: Σ(input/
  {s['serving']['accelerators']['A10G']['prefill_tok_s']} + output × {s['serving']['accelerators']['A10G']['tpot_ms']} ms) / span =
  {cap['total_service_s']:.0f} s / {cap['span_s']:.0f} s = **{cap['mean_concurrency']:.1f}**); on-demand pools:
  ceil({CAPACITY_HEADROOM} × {cap['mean_concurrency']:.1f} / {cap['ref_slots']} slots) = **{cap['on_demand']}** replicas each; spot pools:
  max(1, {cap['on_demand']} // {SPOT_CAPACITY_DIVISOR}) = **{cap['spot']}** (spot capacity is scarce).

{md_table(["provider", "accelerator", "on-demand offerings", "spot offerings"], by_rows)}

{md_table(["provider", "region", "instance type", "accelerator", "GPUs", "on-demand $/h", "spot $/h", "price row"], price_rows)}

## availability.csv (spot offerings only)

- Polarity: in the CBL/SpotHedge files a value N = instances obtained/running, so available = N ≥ 1
  (an empty cell = zone not measured; windows containing one are never used). In the 2020 file
  `not_running` = 1 means preempted, so available = 1 − not_running.
- Trace per offering, in this order: (1) a column of the same cloud and region — GCP A100/A100-80GB/H100
  from the SpotHedge a2 A100 zones, AWS from the CBL p3/r5 zone columns (V100 prefers the p3 columns)
  — and for GCP A100-class offerings without a same-region zone any SpotHedge zone; (2) every other
  offering (Azure, AWS regions without traces, GCP L4) round-robin over all columns, least-used first.
  Ties go to the least-used column, then by name, so columns are shared only when they run out.
- Time compression ×{comp:g}: the {span_min:.1f}-minute workload replays {span_min * comp / 60:.1f} h of real
  spot behaviour (an hour of real spot holds few preemptions). Start sample = the hash
  SHA-256("spot-offset" ␟ offering_id) modulo the number of valid start samples.
- One row at the workload start, then a row only where the value changes; the `source` column gives
  the trace column and the real trace time (seconds since the trace's start).
- **{total_flips} availability changes** in the hour over {len(info)} spot offerings.

{md_table(["offering", "trace column", "offset (h)", "start", "changes", "available share"], av_rows)}

## rtt.csv

- Every ordered pair (both directions, self included) of the {len(s['locations'])} locations
  (offering regions ∪ origins): {len(rtt)} rows.
- Same cloud: AWS cloudping P50 (1 year), Azure P50, GCP median matrices, as published (direction as
  given). Self-RTT: the matrix's own intra-region value ({self_rng}); the Azure
  matrix has none, so {DEFAULT_SELF_RTT_MS:g} ms.
- Cross cloud: skyplane ping `avg_rtt_ms`, PREMIUM tier at both ends, GCP zones mapped to their region,
  median over repeated measurements of the direction; the reverse direction when only that was measured.
- Pairs skyplane never measured ({n_est}): the nearest measured proxy pair — same two clouds, the regions
  closest by intra-cloud RTT to the two ends — and its value, marked `estimated:` in `source`.

Row sources: {', '.join(f'{k} {v}' for k, v in kinds.items())}.

{md_table(["src", "dst", "rtt_ms", "source"], est_rows) if est_rows else ""}

## throughput.csv and offerings' notice_s (migration: docs/env.md, "Spot preemption and migration")

- `throughput.csv`: between two distinct offering locations, the median received throughput of
  Skyplane's iperf3 runs ({THROUGHPUT_FILE},
  January 2022, 64 connections, PREMIUM tier at both ends, successful runs; GCP zones mapped to their
  region), the direction as measured, else the reverse one
  (`:reverse` in `source`): {len(s['tput'])} rows, {s['tput']['gbps'].astype(float).min():.2f}–{s['tput']['gbps'].astype(float).max():.2f} Gbit/s.
  Pairs never measured are absent; the environment moves a KV cache between them at its
  `migration.default_throughput_gbps`.
- `notice_s` (spot offerings; empty on demand): the notice the cloud gives before a spot instance
  stops, from `cloud_adapters/events.py` — AWS 120 s (the two-minute interruption warning), Azure 30 s
  (Scheduled Events `Preempt`, `NotBefore` at least 30 s ahead), GCP 30 s (preemption: ACPI soft-off
  grace).
"""
    return mooncake_readme(text, s) if v.trace == "mooncake" else text


def mooncake_readme(text: str, s: dict) -> str:
    """The recipe's README with the workload parts said for the Mooncake trace (``trace="mooncake"``)."""
    import re

    w, v, sp = s["w"], s["variant"], s["speeds"]
    comp = s["compression"]
    blocks = np.array([len(h) for h in w["prefix_hashes"]])
    seen: set[int] = set()
    reused = 0
    for h in w["prefix_hashes"]:
        reused += sum(x in seen for x in h)
        seen.update(h)
    turns = w.groupby("session_id").size()
    multi = turns[turns > 1]
    head = f"""# Telemetry bundle `{v.name}` (the Mooncake trace: KV-cache prefix blocks) — provenance

Written by `tools/build_default_bundle.py` (do not edit by hand; rebuild with
`.venv/bin/python tools/build_default_bundle.py --shared ../shared/data --variant {v.name} --out data/bundles/{v.name} --spot-compression {comp:g}`). Same inputs ⇒
byte-identical files. Format: `docs/telemetry.md`;
schema: `xroute/schema/telemetry.py` (and `bundle.yaml`: `prefix_block_tokens: {MOONCAKE_BLOCK_TOKENS}`). The
telemetry (prices, spot, RTT) is real public data by the default bundle's recipe; the request stream is
the Mooncake FAST'25 synthetic trace, whose arrival times are Poisson-generated (the one part of the shared
data that is not measured) while its prompts, outputs and prefix blocks come from real multi-turn
conversations. Extra `source` columns (allowed by the schema) name the input of every row.

**Variant `{v.name}`** of the default bundle's recipe: prices from the snapshots nearest **{v.price_date}** (the row
each offering got is in the price table below), other spans of the real spot traces (offsets re-hashed with salt
`{v.spot_salt}`), pools sized for this traffic (capacity rule below); the text below describes the recipe, its tables
this bundle.
"""
    text = text[text.index("\nWindow: **"):]
    text = text.replace("the real hour of Azure's LLM\ninference trace.", "the Mooncake trace's\n17 minutes.", 1)
    text = text.replace("| workload.csv.gz | workload/azure_llm_inference_2023_code.csv, workload/azure_llm_inference_2023_conv.csv "
                        "| CC BY 4.0 (Azure/AzurePublicDataset, AzureLLMInferenceDataset2023) |",
                        f"| workload.csv.gz, bundle.yaml | {MOONCAKE_FILE} | Apache-2.0 (kvcache-ai/Mooncake "
                        "`FAST25-release/traces/synthetic_trace.jsonl` @ 3b5a594, verbatim) |", 1)
    a = text.index("## workload.csv.gz")
    b = text.index("## offerings.csv and prices.csv")
    sla = []
    for acc in ("A10G", "L4", "A100", "A100-80GB", "H100"):
        m = model_speeds(s["serving_path"], MOONCAKE_MODEL, acc)
        ttft = w["input_tokens"] / m["prefill_tok_s"] * 1000.0 + m["tpot_ms"]
        sla.append([acc, m["max_concurrency"], f"{m['kv_tokens'] / MOONCAKE_BLOCK_TOKENS:.0f}",
                    f"{m['prefill_tok_s']:.0f}", f"{m['tpot_ms']:.1f}",
                    f"{100 * float((ttft <= w['ttft_ms']).mean()):.1f}%"])
    workload = f"""## workload.csv.gz and bundle.yaml

- The trace's {len(w)} requests, in its order: `ts` = {MOONCAKE_START} + the trace's `timestamp` (ms from its
  start; the trace has no date, so the telemetry is taken near {v.price_date}); `request_id` = `mooncake-<row,
  6 digits>`; `input_tokens` = `input_length`, `output_tokens` = `output_length` (the realized outcome, which
  only the simulation of service reads), unchanged.
- `prefix_hashes` = the trace's `hash_ids`, verbatim: one id per {MOONCAKE_BLOCK_TOKENS}-token block of the prompt,
  ceil(input / {MOONCAKE_BLOCK_TOKENS}) of them (the last block partial); the same id = the same block after the same
  prefix (every id sits at one position with one predecessor in the whole trace: a chain). Mean
  {blocks.mean():.1f} blocks a request; {100 * reused / max(int(blocks.sum()), 1):.1f} % of the blocks repeat an earlier
  request's (the paper's 64 %), every repeat inside a leading prefix.
- `session_id`: the trace names none. Derived from the prefixes alone (`derive_sessions`): a request whose
  blocks begin with all but the last block of an earlier request's prompt continues that request's
  conversation (a next turn resends the previous prompt and adds to it); the latest, longest such match.
  {w.attrs.get("continued", 0)} requests continue a session; {len(turns)} sessions, {len(multi)} of them with more than one turn
  (at most {int(turns.max())}). The rest of the reuse is prefix sharing between sessions (requests of
  different conversations that begin alike), which the prefix cache exploits and the session id does not name.
- `model` = `{MOONCAKE_MODEL}` (configs/models.yaml: a 128k-context model with grouped-query attention,
  served as a long-context deployment whose request slots reserve 16,384 KV tokens); the Llama-2 models'
  4k context could not hold these prompts.
- `tenant` = `{MOONCAKE_TENANT}` (one service). SLO: `ttft_ms` = {MOONCAKE_TTFT_BASE_MS:g} + {MOONCAKE_TTFT_PER_TOKEN_MS:g} ×
  `input_tokens` (an interactive second plus 2,000 prompt tokens a second: a long prompt is allowed a
  longer first token), `tpot_ms` = {MOONCAKE_TPOT_MS:g}; `max_output_tokens` by the documented per-tenant rule
  (`xroute.bundle.output_budget_rule`): {int(w["max_output_tokens"].iloc[0])}.
- `origin`: drawn per **session** (a conversation's client does not move): u = first 8 bytes of
  SHA-256("origin" ␟ session_id) / 2^64, mapped through the default bundle's origin weights.

| requests | sessions | mean input | max input | mean output | max output | mean blocks |
|---|---|---|---|---|---|---|
| {len(w)} | {len(turns)} | {int(w["input_tokens"].mean())} | {int(w["input_tokens"].max())} | {int(w["output_tokens"].mean())} | {int(w["output_tokens"].max())} | {blocks.mean():.1f} |

`{MOONCAKE_MODEL}` per one-GPU replica (configs/models.yaml rules; A10 as A10G): slots, prefix-cache
capacity in {MOONCAKE_BLOCK_TOKENS}-token blocks (its KV tokens / block), prefill and TPOT, and the share of requests
whose TTFT objective a free replica meets with no cache hit (prefill + one token; no queue, no network):

{md_table(["accelerator", "slots", "cache blocks", "prefill tok/s", "TPOT ms", "TTFT met, cold"], sla)}

"""
    text = head + text[:a] + workload + text[b:]
    text = re.sub(r"- `capacity_replicas`: mean concurrency of the whole stream at A10G speed \(Little's law: "
                  r"Σ\(input/\n  [0-9.]+ \+ output × [0-9.]+ ms\) / span =",
                  f"- `capacity_replicas`: mean concurrency of the whole stream at the speed of `{MOONCAKE_MODEL}` on one "
                  f"A10G (Little's law,\n  no cache hit: Σ(input/{sp['prefill_tok_s']:.0f} + output × {sp['tpot_ms']:.1f} ms) / span =",
                  text, count=1)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=REPO_ROOT.parent / "shared" / "data",
                    help="the shared real-data directory (read-only)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "bundles" / "default")
    ap.add_argument("--serving", type=Path, default=REPO_ROOT / "configs" / "serving.yaml",
                    help="service-time model (capacity rule and the SLA check)")
    ap.add_argument("--spot-compression", type=float, default=DEFAULT_SPOT_COMPRESSION,
                    help="real spot-trace seconds replayed per workload second (default 12)")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="default",
                    help="another window of the shared data: price date, spot spans, client and tenant mix")
    ap.add_argument("--catalog", choices=("shipped", "unseen"), default="shipped",
                    help="unseen: only the catalog tables, for regions no shipped bundle has (UNSEEN_REGIONS)")
    args = ap.parse_args(argv)
    s = build(args.shared, args.out, args.serving, args.spot_compression, VARIANTS[args.variant], args.catalog)
    off, b = s["offerings"], s["bundle"]
    size = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    print(f"wrote {args.out}: {len(off)} offerings, {len(b.workload)} requests, "
          f"{len(b.availability) if b.availability is not None else 0} availability rows "
          f"({sum(i['flips'] for i in s['avail_info'])} changes), {len(b.rtt)} rtt rows, "
          f"{size / 1e6:.2f} MB; content hash {b.content_hash}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
