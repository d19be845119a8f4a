"""Derive bundles with another catalog from a real one — for scaling benchmarks and for testing that
a policy copes with offerings it never saw (``perturb_catalog``). Locations, prices, availability
and the request stream stay real; only the set of offerings changes. And split a pool into serving
tiers (``split_tiers``: the env settings' ``tiers``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from xroute.bundle import Bundle, _suggest
from xroute.errors import ConfigError
from xroute.schema.offering import tier_offering_id

if TYPE_CHECKING:
    from xroute.config import ServingTier

_PER_OFFERING = ("prices", "availability", "utilization")


def _clone(bundle: Bundle, picks: list[tuple[str, str]]) -> Bundle:
    """A bundle whose catalog is ``picks``: (source offering_id, new offering_id) pairs."""
    src = bundle.offerings.set_index("offering_id")
    rows = []
    for old, new in picks:
        r = src.loc[old].to_dict()
        r["offering_id"] = new
        rows.append(r)
    cols = list(bundle.offerings.columns)
    offerings = pd.DataFrame(rows)[[c for c in cols]]
    mapping = pd.DataFrame(picks, columns=["_src", "offering_id"])
    tables: dict[str, pd.DataFrame | None] = {}
    for name in _PER_OFFERING:
        df = getattr(bundle, name)
        if df is None:
            tables[name] = None
            continue
        m = df.rename(columns={"offering_id": "_src"}).merge(mapping, on="_src").drop(columns="_src")
        tables[name] = m.sort_values(["offering_id", "ts"], kind="stable").reset_index(drop=True)
    return replace(bundle, offerings=offerings.reset_index(drop=True), content_hash=bundle.content_hash + "-derived",
                   **tables)  # type: ignore[arg-type]


def split_tiers(bundle: Bundle, tiers: list[ServingTier], slots: dict[str, int], where: str = "env config") -> Bundle:
    """The bundle with each of ``tiers`` split off its pool: a new offering ``<offering>#<name>``
    right after its parent, with the parent's hardware and telemetry, ``capacity_replicas`` the
    tier's replicas, its ``tier`` and ``max_batch``; the parent keeps the rest of its replicas (it
    may keep none: then it is masked as an empty pool). ``slots``: request slots per replica by
    accelerator (the serving profile's ``max_concurrency``), the most a tier's ``max_batch`` may be.
    No tiers: the bundle itself. A ``ConfigError`` names the field (``tiers[i].<field>``) of an
    unknown offering, a tier of a tier, a name twice on one pool, more replicas than the pool has, a
    max batch above the profile's, or a pool sized by an inventory table (its replicas follow the
    clouds' counts, which know no tiers)."""
    if not tiers:
        return bundle
    off = bundle.offerings
    ids = list(off["offering_id"])
    known = set(ids)
    col = off["capacity_replicas"] if "capacity_replicas" in off.columns else [np.nan] * len(ids)
    caps = {o.offering_id: o.replicas_per_instance if c is None or c != c else int(c)  # (as the env reads it)
            for o, c in zip(bundle.catalog(), col)}
    acc = dict(zip(ids, off["accelerator"].astype(str) if "accelerator" in off.columns else [""] * len(ids)))
    inv = set(bundle.inventory["offering_id"]) if bundle.inventory is not None and "offering_id" in \
        bundle.inventory.columns else set()
    left = dict(caps)
    mine: dict[str, list[tuple[str, int, int]]] = {}
    for i, t in enumerate(tiers):
        f = f"{where}: field 'tiers[{i}]"
        if t.offering not in known:
            raise ConfigError(f"{f}.offering': '{t.offering}' is not an offering of {bundle.path}"
                              f"{_suggest(t.offering, known)}")
        if "tier" in off.columns and str(off.loc[ids.index(t.offering), "tier"] or ""):
            raise ConfigError(f"{f}.offering': '{t.offering}' is a tier already; split its parent")
        if t.offering in inv:
            raise ConfigError(f"{f}.offering': '{t.offering}' is sized by the bundle's inventory table "
                              "(the clouds' instance counts know no tiers); tier a pool of fixed capacity_replicas")
        new = tier_offering_id(t.offering, t.name)
        if new in known or any(new == tier_offering_id(t.offering, n) for n, _, _ in mine.get(t.offering, [])):
            raise ConfigError(f"{f}.name': '{t.name}' is a tier of '{t.offering}' already")
        if t.replicas > left[t.offering]:
            raise ConfigError(f"{f}.replicas': {t.replicas} is more than the {left[t.offering]} replicas "
                              f"'{t.offering}' has left (of {caps[t.offering]})")
        top = slots.get(acc[t.offering])
        if top is None:
            raise ConfigError(f"{f}.offering': the serving profile has no accelerator '{acc[t.offering]}' "
                              f"for '{t.offering}'")
        if t.max_batch > top:
            raise ConfigError(f"{f}.max_batch': {t.max_batch} is more than the serving profile's {top} slots "
                              f"per replica of {acc[t.offering]}")
        left[t.offering] -= t.replicas
        mine.setdefault(t.offering, []).append((t.name, t.replicas, t.max_batch))
    picks: list[tuple[str, str]] = []
    extra: dict[str, tuple[str, int, int]] = {}
    for o in ids:
        picks.append((o, o))
        for name, rep, mb in mine.get(o, []):
            picks.append((o, tier_offering_id(o, name)))
            extra[tier_offering_id(o, name)] = (name, rep, mb)
    b = _clone(bundle, picks)
    out = b.offerings.copy()
    if "tier" not in out.columns:
        out["tier"] = ""
    if "max_batch" not in out.columns:
        out["max_batch"] = 0
    cap = out["capacity_replicas"].astype(float) if "capacity_replicas" in out.columns else \
        pd.Series(np.nan, index=out.index)
    for k, oid in enumerate(out["offering_id"]):
        if oid in extra:
            name, rep, mb = extra[oid]
            out.loc[k, ["tier", "max_batch"]] = [name, mb]
            cap.iloc[k] = rep
        elif oid in mine:
            cap.iloc[k] = left[oid]
    out["capacity_replicas"] = cap
    out["max_batch"] = out["max_batch"].astype(int)
    tag = ",".join(f"{tier_offering_id(t.offering, t.name)}={t.replicas}x{t.max_batch}" for t in tiers)
    return replace(b, offerings=out, content_hash=bundle.content_hash + f"-tiers[{tag}]")


def select_offerings(bundle: Bundle, ids: list[str]) -> Bundle:
    """The same bundle with only the offerings ``ids`` (their telemetry kept as it is): a scenario
    with less capacity than the whole catalog (``configs/overload.yaml``)."""
    known = set(bundle.offering_ids)
    missing = [i for i in ids if i not in known]
    if missing:
        raise ConfigError(f"field 'offerings': '{missing[0]}' is not an offering of {bundle.path}")
    return _clone(bundle, [(i, i) for i in ids])


def resize_catalog(bundle: Bundle, n: int) -> Bundle:
    """A catalog of exactly ``n`` offerings: the real ones cycled, copies suffixed ``#k``."""
    ids = bundle.offering_ids
    picks = [(ids[k % len(ids)], ids[k % len(ids)] + ("" if k < len(ids) else f"#{k // len(ids)}"))
             for k in range(n)]
    return _clone(bundle, picks)


def perturb_catalog(bundle: Bundle, drop_frac: float = 0.2, add: int | None = None, seed: int = 0) -> Bundle:
    """Remove ``drop_frac`` of the offerings at random and add ``add`` new ones (default: as many as
    were dropped), each a copy of a remaining offering, shuffled into a new order — so a policy
    sees offerings, indices and a catalog size it was not trained on."""
    rng = np.random.default_rng(seed)
    ids = bundle.offering_ids
    n_drop = round(drop_frac * len(ids))
    keep = sorted(rng.choice(len(ids), len(ids) - n_drop, replace=False).tolist())
    kept = [ids[k] for k in keep]
    n_add = n_drop if add is None else add
    new = [(kept[int(k)], f"{kept[int(k)]}#new{j}") for j, k in enumerate(rng.integers(0, len(kept), n_add))]
    picks = [(i, i) for i in kept] + new
    order = rng.permutation(len(picks))
    return _clone(bundle, [picks[k] for k in order])


def unseen_catalog_dir(bundle: Bundle) -> Path:
    """The shipped unseen catalog built for ``bundle``'s window (``data/catalogs/unseen/<name>``:
    ``tools/build_default_bundle.py --catalog unseen``)."""
    from xroute.resources import catalogs_dir

    return catalogs_dir() / "unseen" / bundle.path.name


def swap_catalog(bundle: Bundle, donor: str | Path | Bundle, frac: float = 0.2, seed: int = 0) -> Bundle:
    """``bundle`` with ``frac`` of its offerings, drawn at random (``seed``), swapped for as many
    offerings of ``donor`` that ``bundle`` does not have -- each of the same pricing mode as the one
    it replaces, in its place -- with their prices and availability, and ``donor``'s RTT and
    throughput rows the bundle lacks. The request stream is untouched.

    ``donor``: a catalog directory (offerings, prices, rtt; availability, throughput optional; no
    workload needed: validated against ``bundle``'s) or a loaded bundle. For the check that a
    trained router copes with offerings it never saw (``xroute evaluate --swap-offerings``)."""
    from xroute.bundle import load_bundle
    from xroute.errors import ConfigError

    if not 0.0 < frac <= 1.0:
        raise ConfigError(f"--swap-offerings: must be in (0, 1], got {frac:g}")
    if not isinstance(donor, Bundle):
        # validated against this stream's origins; the prefix columns need the bundle's own meta
        donor = load_bundle(donor, workload=bundle.workload.drop(columns=["prefix_hashes"], errors="ignore"))
    ids = bundle.offering_ids
    mine = set(ids)
    new = donor.offerings[~donor.offerings["offering_id"].isin(mine)]
    rng = np.random.default_rng(seed)
    n = round(frac * len(ids))
    out_pos = sorted(rng.choice(len(ids), n, replace=False).tolist())
    modes = bundle.offerings["pricing_mode"].to_numpy()
    picks: dict[int, str] = {}
    for mode in sorted({str(modes[i]) for i in out_pos}):
        slots = [i for i in out_pos if modes[i] == mode]
        pool = new.loc[new["pricing_mode"] == mode, "offering_id"].tolist()
        if len(pool) < len(slots):
            raise ConfigError(f"--swap-offerings: {len(slots)} {mode} offerings to swap, but the unseen catalog "
                              f"{donor.path} has only {len(pool)} {mode} offerings the bundle lacks")
        for i, j in zip(slots, rng.choice(len(pool), len(slots), replace=False)):
            picks[i] = pool[int(j)]
    d_off = donor.offerings.set_index("offering_id")
    rows = [d_off.loc[picks[i]].to_dict() | {"offering_id": picks[i]} if i in picks else r
            for i, r in enumerate(bundle.offerings.to_dict("records"))]
    offerings = pd.DataFrame(rows)[list(bundle.offerings.columns)].reset_index(drop=True)
    added, dropped = set(picks.values()), {ids[i] for i in out_pos}

    def per_offering(name: str) -> pd.DataFrame | None:
        a, b = getattr(bundle, name), getattr(donor, name)
        parts = [] if a is None else [a[~a["offering_id"].isin(dropped)]]
        if b is not None:
            parts.append(b[b["offering_id"].isin(added)][[c for c in (a.columns if a is not None else b.columns)
                                                          if c in b.columns]])
        if not parts:
            return None
        return pd.concat(parts, ignore_index=True).sort_values(["offering_id", "ts"], kind="stable").reset_index(drop=True)

    def pairs(name: str) -> pd.DataFrame | None:
        a, b = getattr(bundle, name), getattr(donor, name)
        if a is None or b is None:
            return a if b is None else b
        have = set(zip(a["src"], a["dst"]))
        extra = b[[(s, d) not in have for s, d in zip(b["src"], b["dst"])]]
        return pd.concat([a, extra[[c for c in a.columns if c in extra.columns]]], ignore_index=True)

    tag = f"-swap{frac:g}:{seed}:{donor.content_hash}"
    return replace(bundle, offerings=offerings, prices=per_offering("prices"),
                   availability=per_offering("availability"), utilization=per_offering("utilization"),
                   rtt=pairs("rtt"), throughput=pairs("throughput"), content_hash=bundle.content_hash + tag)
