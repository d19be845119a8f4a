"""A small hand-made bundle for unit tests: 3 locations, 6 offerings, a few hundred requests.

The numbers are invented but shaped like the real ones (prices in USD per hour, RTT in ms); tests
that claim something about real data use the shipped bundle instead.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

LOCS = ["aws:us-east-1", "gcp:europe-west4", "azure:japaneast"]


def write_tiny_bundle(root: Path, n_requests: int = 400, preempt: bool = True, seed: int = 7,
                      models: list[str] | None = None, big_instances: bool = False) -> Path:
    """``models``: write a ``model`` column drawing from these names; ``big_instances``: add an
    8-GPU A100-80GB offering (where the larger models fit)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for loc, acc, itype, od, spot in [
        ("aws:us-east-1", "A10G", "g5.xlarge", 1.006, 0.35),
        ("gcp:europe-west4", "L4", "g2-standard-4", 0.78, 0.25),
        ("azure:japaneast", "T4", "NC4as_T4_v3", 0.6, 0.12),
    ]:
        prov, region = loc.split(":")
        for mode, price in (("on_demand", od), ("spot", spot)):
            rows.append({"offering_id": f"{loc}:{itype}:{mode}", "provider": prov, "region": region, "zone": "",
                         "instance_type": itype, "accelerator": acc, "accelerator_count": 1, "vcpus": 4,
                         "memory_gib": 16, "pricing_mode": mode, "capacity_replicas": 2 if mode == "on_demand" else 1,
                         "_price": price})
    if big_instances:
        for mode, price in (("on_demand", 40.0), ("spot", 14.0)):
            rows.append({"offering_id": f"aws:us-east-1:p4de.24xlarge:{mode}", "provider": "aws", "region": "us-east-1",
                         "zone": "", "instance_type": "p4de.24xlarge", "accelerator": "A100-80GB",
                         "accelerator_count": 8, "vcpus": 96, "memory_gib": 1152, "pricing_mode": mode,
                         "capacity_replicas": 8, "_price": price})
    off = pd.DataFrame(rows)
    off.drop(columns="_price").to_csv(root / "offerings.csv", index=False)
    t0 = pd.Timestamp("2024-01-01T00:00:00Z")
    prices = pd.DataFrame({"ts": (t0 - pd.Timedelta("1D")).isoformat(), "offering_id": off["offering_id"],
                           "usd_per_hour": off["_price"]})
    prices.to_csv(root / "prices.csv", index=False)
    rtt = []
    base = {("aws:us-east-1", "gcp:europe-west4"): 90.0, ("aws:us-east-1", "azure:japaneast"): 160.0,
            ("gcp:europe-west4", "azure:japaneast"): 230.0}
    for a in LOCS:
        for b in LOCS:
            v = 2.0 if a == b else base.get((a, b), base.get((b, a)))
            rtt.append({"src": a, "dst": b, "rtt_ms": v})
    pd.DataFrame(rtt).to_csv(root / "rtt.csv", index=False)
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(0.25, n_requests)
    ts = t0 + pd.to_timedelta(np.cumsum(gaps), unit="s")
    out = rng.integers(5, 300, n_requests)
    w = pd.DataFrame({
        "ts": [t.isoformat() for t in ts], "request_id": [f"r{i:05d}" for i in range(n_requests)],
        "origin": rng.choice(LOCS, n_requests), "input_tokens": rng.integers(50, 4000, n_requests),
        "max_output_tokens": 512, "ttft_ms": 2500.0, "tpot_ms": 100.0,
        "output_tokens": out, "tenant": rng.choice(["a", "b"], n_requests),
    })
    if models:
        w["model"] = rng.choice(models, n_requests)
    w.to_csv(root / "workload.csv", index=False)
    if preempt:
        spot_ids = [o for o in off["offering_id"] if o.endswith(":spot")]
        av = []
        for k, oid in enumerate(spot_ids):
            av.append({"ts": (t0 - pd.Timedelta("1h")).isoformat(), "offering_id": oid, "available": 1})
            for down, up in [(20 + 15 * k, 35 + 15 * k), (70, 80)]:
                av.append({"ts": (t0 + pd.Timedelta(seconds=down)).isoformat(), "offering_id": oid, "available": 0})
                av.append({"ts": (t0 + pd.Timedelta(seconds=up)).isoformat(), "offering_id": oid, "available": 1})
        pd.DataFrame(av).sort_values(["offering_id", "ts"]).to_csv(root / "availability.csv", index=False)
    return root


#: a serving model with the tiny bundle's accelerators (numbers shaped like configs/serving.yaml)
SERVING_YAML = """\
reference_accelerator: A10G
accelerators:
  A10G: {memory_gb: 24, prefill_tok_s: 6170, tpot_ms: 31.0, tpot_growth: 0.051, max_concurrency: 7, noise_sigma: 0.07}
  L4: {memory_gb: 24, prefill_tok_s: 5970, tpot_ms: 62.0, tpot_growth: 0.051, max_concurrency: 7, noise_sigma: 0.07}
  T4: {memory_gb: 16, prefill_tok_s: 3210, tpot_ms: 58.1, tpot_growth: 0.051, max_concurrency: 1, noise_sigma: 0.07}
  A100: {memory_gb: 40, prefill_tok_s: 15400, tpot_ms: 12.0, tpot_growth: 0.034, max_concurrency: 20, noise_sigma: 0.07}
  H100: {memory_gb: 80, prefill_tok_s: 28400, tpot_ms: 5.6, tpot_growth: 0.045, max_concurrency: 54, noise_sigma: 0.07}
"""


def write_serving_yaml(path: Path) -> Path:
    path.write_text(SERVING_YAML)
    return path.resolve()
