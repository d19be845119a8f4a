"""A hand-made bundle for the provisioning world's tests (``envs.provisioning``): A10G pools in three
locations, every number chosen so the outcomes can be computed by hand -- a noiseless service model
(prefill 1,000 tokens/s, 10 ms per output token at any batch, 2 slots per replica) and launch delays
of 100 s boot + 10 s engine start + 13.48 GB / 1.348 GB/s = 120 s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

T0 = pd.Timestamp("2024-01-01T00:00:00Z")
OD, OD_AZ = "aws:us-east-1:g5.xlarge:on_demand", "azure:eastus:NV6ads_A10G:on_demand"
SPOT, SPOT_W, SPOT_AZ = "aws:us-east-1:g5.xlarge:spot", "aws:us-west-2:g5.xlarge:spot", "azure:eastus:NV6ads_A10G:spot"
#: USD per instance-hour: 3.6 on demand (0.001 a second), 0.36 spot (0.0001 a second)
PRICES = {OD: 3.6, OD_AZ: 3.6, SPOT: 0.36, SPOT_W: 0.36, SPOT_AZ: 0.36}
NOTICE = {SPOT: 120.0, SPOT_W: 120.0, SPOT_AZ: 30.0}
LOCS = ["aws:us-east-1", "aws:us-west-2", "azure:eastus"]

SERVING = """\
reference_accelerator: A10G
accelerators:
  A10G: {memory_gb: 24, prefill_tok_s: 1000, tpot_ms: 10.0, tpot_growth: 0.0, max_concurrency: 2, noise_sigma: 0.0}
launch: {boot_s_single_gpu: 100, boot_s_multi_gpu: 200, engine_start_s: 10, weights_gb_per_s: 1.348}
"""


def write_capbundle(root: Path, requests: list[dict[str, Any]], availability: dict[str, list[tuple[float, int]]]
                    | None = None, quotas: list[dict[str, Any]] | None = None) -> Path:
    """``requests``: dicts with ``t`` (seconds after T0) and optionally ``in``, ``out``, ``origin``,
    ``tenant``; ``availability``: per spot offering, (seconds after T0, 0/1) rows; ``quotas``: rows of
    the quotas table (``ts`` in seconds after T0)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for oid in PRICES:
        prov, region, itype, mode = oid.split(":")
        rows.append({"offering_id": oid, "provider": prov, "region": region, "zone": "", "instance_type": itype,
                     "accelerator": "A10G", "accelerator_count": 1, "vcpus": 4, "memory_gib": 16, "pricing_mode": mode,
                     "capacity_replicas": 1, "notice_s": NOTICE.get(oid)})
    pd.DataFrame(rows).to_csv(root / "offerings.csv", index=False)
    pd.DataFrame({"ts": (T0 - pd.Timedelta("1D")).isoformat(), "offering_id": list(PRICES),
                  "usd_per_hour": list(PRICES.values())}).to_csv(root / "prices.csv", index=False)
    pd.DataFrame([{"src": a, "dst": b, "rtt_ms": 2.0 if a == b else 20.0} for a in LOCS for b in LOCS]).to_csv(
        root / "rtt.csv", index=False)
    w = pd.DataFrame([{"ts": (T0 + pd.Timedelta(seconds=r["t"])).isoformat(), "request_id": f"r{k:04d}",
                       "origin": r.get("origin", "aws:us-east-1"), "input_tokens": r.get("in", 1000),
                       "output_tokens": r.get("out", 100), "max_output_tokens": 65536, "ttft_ms": 300000.0,
                       "tpot_ms": 100.0, "tenant": r.get("tenant", "a")} for k, r in enumerate(requests)])
    w.to_csv(root / "workload.csv", index=False)
    av = []
    for oid in (SPOT, SPOT_W, SPOT_AZ):
        av.append({"ts": (T0 - pd.Timedelta("1h")).isoformat(), "offering_id": oid, "available": 1})
        for t, v in (availability or {}).get(oid, []):
            av.append({"ts": (T0 + pd.Timedelta(seconds=t)).isoformat(), "offering_id": oid, "available": v})
    pd.DataFrame(av).sort_values(["offering_id", "ts"]).to_csv(root / "availability.csv", index=False)
    if quotas:
        q = [{**r, "ts": (T0 + pd.Timedelta(seconds=r["ts"])).isoformat()} for r in quotas]
        pd.DataFrame(q).to_csv(root / "quotas.csv", index=False)
    (root / "serving.yaml").write_text(SERVING)
    return root


def world(root: Path, **cfg: Any) -> Any:
    """The provisioning world over the bundle at ``root`` with its serving model (``spot_lag_s`` 0:
    preemptions exactly when recorded; pass ``cfg`` to override)."""
    from envs.provisioning import ProvisionWorld

    base: dict[str, Any] = {"serving_config": str((root / "serving.yaml").resolve()), "spot_lag_s": 0.0}
    return ProvisionWorld(str(root), {**base, **cfg})
