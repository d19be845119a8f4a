"""Derive bundles with another catalog from a real one — for scaling benchmarks and for testing that
a policy copes with offerings it never saw (``perturb_catalog``). Locations, prices, availability
and the request stream stay real; only the set of offerings changes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from xroute.bundle import Bundle

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
