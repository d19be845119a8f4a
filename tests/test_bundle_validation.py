"""Bundle validation: the shipped bundle loads, and every kind of bad bundle fails with one
:class:`BundleError` naming the file, row and column. Bad bundles are the small hand-made bundle of
``tests/tinybundle.py`` with one cell or table corrupted."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from tests.tinybundle import write_tiny_bundle
from xroute.bundle import DEFAULT_BUNDLE, load_bundle
from xroute.errors import BundleError
from xroute.schema.telemetry import TABLES

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED = REPO_ROOT.parent / "shared" / "data"


# ------------------------------------------------------------------------------------ helpers
def _read(root: Path, table: str) -> pd.DataFrame:
    return pd.read_csv(root / f"{table}.csv", dtype=str, keep_default_na=False)


def _edit(root: Path, table: str, change: Callable[[pd.DataFrame], pd.DataFrame | None]) -> None:
    df = _read(root, table)
    out = change(df)
    (df if out is None else out).to_csv(root / f"{table}.csv", index=False)


def _fails(root: Path, file: str, row: int | None = None, column: str | None = None,
           says: str = "") -> BundleError:
    with pytest.raises(BundleError) as ei:
        load_bundle(root)
    e = ei.value
    msg = str(e)
    assert e.file == file, msg
    assert file in msg
    if row is not None:
        assert e.row == row, msg
        assert f"row {row}" in msg
    if column is not None:
        assert e.column == column, msg
        assert f"'{column}'" in msg
    assert says in msg, msg
    return e


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_bundle(tmp_path / "b")


# ------------------------------------------------------------------------------ shipped bundle
def test_shipped_bundle_loads_and_matches_its_design():
    b = load_bundle()
    assert b.path == DEFAULT_BUNDLE
    off = b.offerings
    assert 60 <= len(off) <= 120
    assert set(off["provider"]) == {"aws", "azure", "gcp"}
    assert "aws:us-east-1:g5.xlarge:on_demand" in set(off["offering_id"])  # the static baseline's default
    assert list(off["offering_id"]) == sorted(off["offering_id"])
    # every offering has exactly one price, timestamped before the workload starts
    assert len(b.prices) == len(off) and b.prices["ts"].max() < b.workload["ts"].iloc[0]
    # spot offerings are the only ones with availability rows, each starting at the workload start
    spot = set(off.loc[off["pricing_mode"] == "spot", "offering_id"])
    assert b.availability is not None and set(b.availability["offering_id"]) == spot
    first = b.availability.groupby("offering_id")["ts"].min()
    assert (first == b.workload["ts"].iloc[0]).all()
    # the whole stream, both tenants
    assert len(b.workload) == 8819 + 19366
    assert set(b.workload["tenant"]) == {"code", "conv"}
    # every offering location and every origin has RTT to every offering location, with no zero
    rtt = b.rtt_lookup()
    locs = b.locations()
    for src in set(b.workload["origin"]) | set(locs):
        for dst in locs:
            assert rtt[(src, dst)] > 0
    # every accelerator has a serving-speed entry
    serving = yaml.safe_load((REPO_ROOT / "configs" / "serving.yaml").read_text())
    assert set(off["accelerator"]) <= set(serving["accelerators"])
    assert sum(p.stat().st_size for p in DEFAULT_BUNDLE.iterdir()) < 10_000_000


def test_tiny_bundle_is_valid(tiny: Path):
    b = load_bundle(tiny)
    assert len(b.offerings) == 6 and len(b.workload) == 400


# ------------------------------------------------------------------------------ bad bundles
def test_missing_table(tiny: Path):
    (tiny / "rtt.csv").unlink()
    e = _fails(tiny, str(tiny), says="missing table 'rtt'")
    assert e.row is None


def test_missing_optional_table_is_fine(tiny: Path):
    (tiny / "availability.csv").unlink()
    assert load_bundle(tiny).availability is None


def test_missing_column(tiny: Path):
    _edit(tiny, "prices", lambda d: d.drop(columns="usd_per_hour"))
    _fails(tiny, "prices.csv", says="missing column(s) usd_per_hour")


def test_text_in_number_column(tiny: Path):
    _edit(tiny, "prices", lambda d: d.assign(usd_per_hour=d["usd_per_hour"].where(d.index != 2, "cheap")))
    _fails(tiny, "prices.csv", 3, "usd_per_hour", "'cheap' is not a number")


def test_text_in_int_column(tiny: Path):
    _edit(tiny, "workload", lambda d: d.assign(output_tokens=d["output_tokens"].where(d.index != 9, "12.5")))
    _fails(tiny, "workload.csv", 10, "output_tokens", "not a whole number")


@pytest.mark.parametrize("value", ["", "   ", "NaN", "nan"])
def test_empty_or_nan_required_value(tiny: Path, value: str):
    _edit(tiny, "workload", lambda d: d.assign(input_tokens=d["input_tokens"].where(d.index != 4, value)))
    _fails(tiny, "workload.csv", 5, "input_tokens")


def test_empty_required_text(tiny: Path):
    _edit(tiny, "offerings", lambda d: d.assign(instance_type=d["instance_type"].where(d.index != 1, "")))
    _fails(tiny, "offerings.csv", 2, "instance_type", "is empty")


def test_negative_price(tiny: Path):
    _edit(tiny, "prices", lambda d: d.assign(usd_per_hour=d["usd_per_hour"].where(d.index != 0, "-0.5")))
    _fails(tiny, "prices.csv", 1, "usd_per_hour", "below the minimum 0")


def test_infinite_value(tiny: Path):
    _edit(tiny, "rtt", lambda d: d.assign(rtt_ms=d["rtt_ms"].where(d.index != 3, "inf")))
    _fails(tiny, "rtt.csv", 4, "rtt_ms", "not finite")


def test_bad_flag(tiny: Path):
    _edit(tiny, "availability", lambda d: d.assign(available=d["available"].where(d.index != 1, "2")))
    _fails(tiny, "availability.csv", 2, "available", "must be 0 or 1")


def test_bad_timestamp(tiny: Path):
    _edit(tiny, "workload", lambda d: d.assign(ts=d["ts"].where(d.index != 6, "yesterday")))
    _fails(tiny, "workload.csv", 7, "ts", "not an ISO-8601 timestamp")


def test_unknown_offering_id_in_prices(tiny: Path):
    _edit(tiny, "prices", lambda d: d.assign(offering_id=d["offering_id"].where(d.index != 1, "aws:us-east-1:g5.xlarge:spotty")))
    _fails(tiny, "prices.csv", 2, "offering_id", "unknown offering_id 'aws:us-east-1:g5.xlarge:spotty' (did you mean")


def test_unknown_offering_id_in_availability(tiny: Path):
    _edit(tiny, "availability", lambda d: d.assign(offering_id=d["offering_id"].where(d.index != 0, "nope:nowhere:x:spot")))
    _fails(tiny, "availability.csv", 1, "offering_id", "unknown offering_id 'nope:nowhere:x:spot'")


def test_offering_without_price(tiny: Path):
    _edit(tiny, "prices", lambda d: d.iloc[1:])
    _fails(tiny, "prices.csv", says="no price for offering(s)")


def test_unknown_origin(tiny: Path):
    _edit(tiny, "workload", lambda d: d.assign(origin=d["origin"].where(d.index != 11, "aws:mars-north-1")))
    _fails(tiny, "workload.csv", 12, "origin", "unknown location 'aws:mars-north-1'")


def test_offering_location_without_rtt(tiny: Path):
    _edit(tiny, "rtt", lambda d: d[(d["src"] != "azure:japaneast") & (d["dst"] != "azure:japaneast")])
    _edit(tiny, "workload", lambda d: d.assign(origin=d["origin"].replace("azure:japaneast", "aws:us-east-1")))
    _fails(tiny, "offerings.csv", column="region", says="location 'azure:japaneast' has no RTT rows")


def test_workload_out_of_order(tiny: Path):
    def swap(d: pd.DataFrame) -> pd.DataFrame:
        d = d.copy()
        d.loc[[20, 21], "ts"] = d.loc[[21, 20], "ts"].to_numpy()
        return d

    _edit(tiny, "workload", swap)
    _fails(tiny, "workload.csv", 22, "ts", "timestamps out of order")


def test_prices_out_of_order_within_one_offering(tiny: Path):
    def add_earlier(d: pd.DataFrame) -> pd.DataFrame:
        later = d.iloc[[0]].assign(ts="2023-12-31T12:00:00+00:00", usd_per_hour="1.5")
        earlier = d.iloc[[0]].assign(ts="2023-12-30T00:00:00+00:00", usd_per_hour="1.2")
        return pd.concat([later, d.iloc[1:], earlier], ignore_index=True)

    _edit(tiny, "prices", add_earlier)
    oid = _read(tiny, "prices")["offering_id"].iloc[0]
    _fails(tiny, "prices.csv", 7, "ts", f"timestamps out of order for offering_id '{oid}'")


def test_prices_interleaved_offerings_in_order_are_fine(tiny: Path):
    def add_later(d: pd.DataFrame) -> pd.DataFrame:
        return pd.concat([d, d.assign(ts="2024-01-01T00:30:00+00:00")], ignore_index=True)

    _edit(tiny, "prices", add_later)
    assert len(load_bundle(tiny).prices) == 12


def test_empty_workload(tiny: Path):
    _edit(tiny, "workload", lambda d: d.iloc[0:0])
    _fails(tiny, "workload.csv", says="has no requests")


def test_duplicate_offering_id(tiny: Path):
    _edit(tiny, "offerings", lambda d: pd.concat([d, d.iloc[[2]]], ignore_index=True))
    oid = _read(tiny, "offerings")["offering_id"].iloc[2]
    _fails(tiny, "offerings.csv", 7, "offering_id", f"duplicate value '{oid}'")


def test_duplicate_rtt_pair(tiny: Path):
    _edit(tiny, "rtt", lambda d: pd.concat([d, d.iloc[[4]]], ignore_index=True))
    _fails(tiny, "rtt.csv", 10, "src", "duplicate row for src, dst")


def test_bad_pricing_mode(tiny: Path):
    _edit(tiny, "offerings", lambda d: d.assign(pricing_mode=d["pricing_mode"].where(d.index != 3, "reserved")))
    _fails(tiny, "offerings.csv", 4, "pricing_mode", "'reserved' is not one of on_demand, spot")


def test_bad_provider(tiny: Path):
    _edit(tiny, "offerings", lambda d: d.assign(provider=d["provider"].where(d.index != 0, "oracle")))
    _fails(tiny, "offerings.csv", 1, "provider", "'oracle' is not one of aws, azure, gcp")


def test_table_given_twice(tiny: Path):
    _read(tiny, "rtt").to_parquet(tiny / "rtt.parquet")
    _fails(tiny, str(tiny), says="table 'rtt' is given twice")


def test_unreadable_table(tiny: Path):
    (tiny / "rtt.csv").unlink()
    (tiny / "rtt.parquet").write_bytes(b"not a parquet file")
    _fails(tiny, "rtt.parquet", says="cannot be read as a table")


def test_not_a_directory(tmp_path: Path):
    with pytest.raises(BundleError, match="is not a directory"):
        load_bundle(tmp_path / "missing")


# ------------------------------------------------------------------------------ file formats
def _assert_same(a, b) -> None:
    for name in TABLES:
        fa, fb = getattr(a, name), getattr(b, name)
        if fa is None or fb is None:
            assert fa is None and fb is None, name
            continue
        pd.testing.assert_frame_equal(fa, fb, check_dtype=False, obj=name)
    assert a.content_hash != "" and b.content_hash != ""


def _convert(src: Path, dst: Path, fmt: str) -> Path:
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        name = f.name.split(".")[0]
        if name not in TABLES:
            continue
        if fmt == "csv.gz":
            raw = pd.read_csv(f, dtype=str, keep_default_na=False)
            raw.to_csv(dst / f"{name}.csv.gz", index=False, compression={"method": "gzip", "mtime": 0})
        elif fmt == "csv":
            raw = pd.read_csv(f, dtype=str, keep_default_na=False)
            raw.to_csv(dst / f"{name}.csv", index=False)
        else:  # parquet with native types: numbers as numbers, timestamps as UTC datetimes
            typed = pd.read_csv(f)
            for col in typed.columns:
                if col == "ts":
                    typed[col] = pd.to_datetime(typed[col], utc=True, format="ISO8601")
            typed.to_parquet(dst / f"{name}.parquet", index=False)
    return dst


@pytest.mark.parametrize("fmt", ["csv.gz", "parquet"])
def test_formats_load_the_same_tiny(tiny: Path, tmp_path: Path, fmt: str):
    _assert_same(load_bundle(tiny), load_bundle(_convert(tiny, tmp_path / fmt, fmt)))


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_formats_load_the_same_shipped(tmp_path: Path, fmt: str):
    _assert_same(load_bundle(), load_bundle(_convert(DEFAULT_BUNDLE, tmp_path / fmt, fmt)))


def test_parquet_errors_name_file_row_column(tiny: Path, tmp_path: Path):
    root = _convert(tiny, tmp_path / "pq", "parquet")
    df = pd.read_parquet(root / "workload.parquet")
    df.loc[3, "ttft_ms"] = float("nan")
    df.to_parquet(root / "workload.parquet", index=False)
    _fails(root, "workload.parquet", 4, "ttft_ms", "is empty")


def test_copied_shipped_bundle_with_one_bad_cell(tmp_path: Path):
    root = tmp_path / "copy"
    shutil.copytree(DEFAULT_BUNDLE, root)
    w = pd.read_csv(root / "workload.csv.gz", dtype=str, keep_default_na=False)
    w.loc[1000, "output_tokens"] = "-3"
    (root / "workload.csv.gz").unlink()
    w.to_csv(root / "workload.csv.gz", index=False)
    _fails(root, "workload.csv.gz", 1001, "output_tokens", "below the minimum 0")


# ------------------------------------------------------------------------------ the builder
@pytest.mark.skipif(not SHARED.is_dir(), reason="needs the shared real data (../shared/data)")
def test_builder_is_deterministic_and_the_shipped_bundle_is_current(tmp_path: Path):
    from tools.build_default_bundle import main

    for d in ("a", "b"):
        assert main(["--shared", str(SHARED), "--out", str(tmp_path / d)]) == 0
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert names == sorted(p.name for p in DEFAULT_BUNDLE.iterdir())
    for n in names:
        a = (tmp_path / "a" / n).read_bytes()
        assert a == (tmp_path / "b" / n).read_bytes(), f"{n} differs between two builds"
        assert a == (DEFAULT_BUNDLE / n).read_bytes(), f"{n}: the shipped bundle is stale; rebuild it"


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs the shared real data (../shared/data)")
def test_builder_spot_compression_flag(tmp_path: Path):
    from tools.build_default_bundle import main

    assert main(["--shared", str(SHARED), "--out", str(tmp_path / "x1"), "--spot-compression", "1"]) == 0
    slow = load_bundle(tmp_path / "x1").availability
    fast = load_bundle().availability
    assert slow is not None and fast is not None
    # replaying 1 hour instead of 12 hours of real spot behaviour: fewer changes
    assert len(slow) < len(fast)
    with pytest.raises(SystemExit):
        main(["--shared", str(SHARED), "--out", str(tmp_path / "x0"), "--spot-compression", "0"])


def test_docs_describe_every_table_and_column():
    doc = (REPO_ROOT / "docs" / "telemetry.md").read_text()
    for name, table in TABLES.items():
        assert f"### `{name}` — {'required' if table.required else 'optional'}" in doc, name
        for col in table.columns:
            assert f"| `{col.name}` | {col.kind} | {'yes' if col.required else 'no'} |" in doc, f"{name}.{col.name}"


# ------------------------------------------------------------------ what a client sends vs the outcome
def test_a_bundle_without_max_output_tokens_gets_the_documented_per_tenant_budget(tiny: Path):
    """The rule: per tenant, the smallest power of two >= its longest output (a constant per
    service, so no request's own outcome shows in what the router sees of it)."""
    def drop(df: pd.DataFrame) -> pd.DataFrame:
        df = df.drop(columns="max_output_tokens")
        df.loc[df["tenant"] == "a", "output_tokens"] = "5"
        df.loc[df.index[df["tenant"] == "a"][0], "output_tokens"] = "700"
        return df

    _edit(tiny, "workload", drop)
    w = load_bundle(tiny).workload
    a, b = w[w["tenant"] == "a"], w[w["tenant"] == "b"]
    assert set(a["max_output_tokens"]) == {1024.0}  # 700 -> 1024, for every request of tenant a
    assert set(b["max_output_tokens"]) == {2 ** int(np.ceil(np.log2(b["output_tokens"].max())))}


def test_an_output_over_its_budget_and_an_old_bundle_are_named(tiny: Path):
    _edit(tiny, "workload", lambda df: df.assign(output_tokens=df["output_tokens"].where(df.index != 5, "9000")))
    _fails(tiny, "workload.csv", 6, "output_tokens", "exceeds max_output_tokens")
    _edit(tiny, "workload", lambda df: df.drop(columns=["ttft_ms", "tpot_ms"]).assign(sla_ms="4000"))
    e = _fails(tiny, "workload.csv", None, None, "missing column(s) ttft_ms, tpot_ms")
    assert "'sla_ms': the SLO is now ttft_ms + tpot_ms" in str(e)


def test_a_window_outside_the_bundle_says_what_it_spans(tiny: Path):
    b = load_bundle(tiny)
    with pytest.raises(BundleError, match=r"no requests between 2030-01-01 and the end; this bundle's requests "
                                          r"span 2024-01-01T00:00:\d\dZ \.\. 2024-01-01T00:\d\d:\d\dZ"):
        b.window("2030-01-01", None)


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs the shared real data (../shared/data)")
@pytest.mark.parametrize("variant", ["feb2024", "mar2024", "asia"])
def test_the_vendored_variants_are_current_and_really_other_windows(tmp_path: Path, variant: str):
    """The other windows of the shared data (another price date, other spot spans, another client
    and tenant mix) rebuild byte for byte, and differ from the default where they say they do."""
    from tools.build_default_bundle import VARIANTS, main

    assert main(["--shared", str(SHARED), "--variant", variant, "--out", str(tmp_path / variant)]) == 0
    shipped = REPO_ROOT / "data" / "bundles" / variant
    for f in sorted(p.name for p in shipped.iterdir()):
        assert (tmp_path / variant / f).read_bytes() == (shipped / f).read_bytes(), f"{variant}/{f} is stale"
    b, d = load_bundle(shipped), load_bundle()
    v = VARIANTS[variant]
    assert not b.prices["usd_per_hour"].reset_index(drop=True).equals(d.prices["usd_per_hour"].reset_index(drop=True))
    assert b.availability is not None and d.availability is not None and not b.availability.equals(d.availability)
    share = b.workload["tenant"].value_counts() / d.workload["tenant"].value_counts()
    for tenant, keep in v.keep:
        assert share[tenant] == pytest.approx(keep, abs=0.02)
    top = b.workload["origin"].value_counts(normalize=True)
    for origin, weight in v.origin_weights:
        assert top[origin] == pytest.approx(weight, abs=0.02)


# ------------------------------------------------------------------------------ prefix hashes
def _with_prefixes(root: Path, block: int | None = 512, cells: list[str] | None = None) -> None:
    def add(df: pd.DataFrame) -> pd.DataFrame:
        df["prefix_hashes"] = cells if cells is not None else [" ".join(str(-7 + 3 * k + j) for j in range(
            -(-int(n) // 512))) for k, n in enumerate(df["input_tokens"])]
        return df

    _edit(root, "workload", add)
    if block is not None:
        (root / "bundle.yaml").write_text(f"prefix_block_tokens: {block}\n")


def test_prefix_hashes_load_as_int64_arrays_and_count_in_the_hash(tiny: Path):
    before = load_bundle(tiny).content_hash
    _with_prefixes(tiny)
    b = load_bundle(tiny)
    assert b.has_prefixes and b.meta.prefix_block_tokens == 512 and b.content_hash != before
    h = b.workload["prefix_hashes"].iloc[0]
    assert h.dtype == np.int64 and len(h) == -(-int(b.workload["input_tokens"].iloc[0]) // 512)
    (tiny / "bundle.yaml").write_text("prefix_block_tokens: 512\ndescription: changed\n")
    assert load_bundle(tiny).content_hash != b.content_hash  # bundle.yaml is part of the content
    _edit(tiny, "workload", lambda df: df.assign(prefix_hashes=""))
    assert not load_bundle(tiny).has_prefixes  # empty cells: no prefix information, as before


@pytest.mark.parametrize(("cell", "says"), [
    ("1 x 3", "'x' is not an integer id"),
    ("1 2.5", "'2.5' is not an integer id"),
    ("9223372036854775808", "outside the signed 64-bit range"),
])
def test_a_bad_prefix_cell_is_named(tiny: Path, cell: str, says: str):
    n = len(_read(tiny, "workload"))
    _with_prefixes(tiny, cells=["1"] * 3 + [cell] + ["1"] * (n - 4))
    _fails(tiny, "workload.csv", 4, "prefix_hashes", says)


def test_prefix_hashes_need_the_block_size_and_fit_the_prompt(tiny: Path):
    _with_prefixes(tiny, block=None)
    _fails(tiny, "bundle.yaml", None, None, "field 'prefix_block_tokens': required")
    (tiny / "bundle.yaml").write_text("prefix_block_tokens: 2048\n")  # fewer, bigger blocks: too many ids
    _fails(tiny, "workload.csv", 1, "prefix_hashes", "at most ceil(input_tokens / 2048)")
    (tiny / "bundle.yaml").write_text("prefix_blok_tokens: 512\n")
    _fails(tiny, "bundle.yaml", None, None, "prefix_blok_tokens")
    (tiny / "bundle.yaml").write_text("prefix_block_tokens: 0\n")
    _fails(tiny, "bundle.yaml", None, None, "greater than or equal to 1")


def test_the_mooncake_bundle_holds_the_trace_and_derived_sessions():
    b = load_bundle("mooncake")
    w = b.workload
    assert len(w) == 3993 and b.meta.prefix_block_tokens == 512 and set(w["model"]) == {"llama-3.1-8b"}
    counts = np.array([len(h) for h in w["prefix_hashes"]])
    assert (counts == -(-w["input_tokens"].to_numpy(dtype=np.int64) // 512)).all()
    # a session's turns: each later turn's prompt begins with all but the last block of an earlier turn's
    for _, g in list(w.groupby("session_id"))[:300]:
        hs = [list(h) for h in g["prefix_hashes"]]
        for k in range(1, len(hs)):
            assert any((len(a) > 1 and hs[k][:len(a) - 1] == a[:-1]) or hs[k][:len(a)] == a for a in hs[:k])
    assert w["session_id"].nunique() == 2516


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs the shared real data (../shared/data)")
def test_the_mooncake_bundle_is_current(tmp_path: Path):
    from tools.build_default_bundle import main

    assert main(["--shared", str(SHARED), "--variant", "mooncake", "--out", str(tmp_path / "m")]) == 0
    shipped = REPO_ROOT / "data" / "bundles" / "mooncake"
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert names == sorted(p.name for p in shipped.iterdir())
    for n in names:
        assert (tmp_path / "m" / n).read_bytes() == (shipped / n).read_bytes(), f"{n}: stale; rebuild it"
